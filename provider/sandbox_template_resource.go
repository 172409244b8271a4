package provider

import (
	"context"
	"fmt"

	"github.com/hashicorp/terraform-plugin-framework-validators/int64validator"
	"github.com/hashicorp/terraform-plugin-framework-validators/listvalidator"
	"github.com/hashicorp/terraform-plugin-framework-validators/mapvalidator"
	"github.com/hashicorp/terraform-plugin-framework-validators/stringvalidator"
	"github.com/hashicorp/terraform-plugin-framework/attr"
	"github.com/hashicorp/terraform-plugin-framework/diag"
	"github.com/hashicorp/terraform-plugin-framework/path"
	"github.com/hashicorp/terraform-plugin-framework/resource"
	"github.com/hashicorp/terraform-plugin-framework/resource/schema"
	"github.com/hashicorp/terraform-plugin-framework/resource/schema/booldefault"
	"github.com/hashicorp/terraform-plugin-framework/resource/schema/int64default"
	"github.com/hashicorp/terraform-plugin-framework/resource/schema/objectdefault"
	"github.com/hashicorp/terraform-plugin-framework/resource/schema/stringdefault"
	"github.com/hashicorp/terraform-plugin-framework/schema/validator"
	"github.com/hashicorp/terraform-plugin-framework/types"
	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"

	agentboxv1alpha1 "github.com/agentbox/terraform-provider-agentbox/internal/api/v1alpha1"
)

var (
	_ resource.Resource                = (*sandboxTemplateResource)(nil)
	_ resource.ResourceWithConfigure   = (*sandboxTemplateResource)(nil)
	_ resource.ResourceWithImportState = (*sandboxTemplateResource)(nil)
	_ resource.ResourceWithModifyPlan  = (*sandboxTemplateResource)(nil)
)

// NewSandboxTemplateResource manages a SandboxTemplate.
func NewSandboxTemplateResource() resource.Resource { return &sandboxTemplateResource{} }

type sandboxTemplateResource struct{ data *providerData }

type sandboxTemplateModel struct {
	ID                 types.String `tfsdk:"id"`
	Name               types.String `tfsdk:"name"`
	Namespace          types.String `tfsdk:"namespace"`
	Image              types.String `tfsdk:"image"`
	ImagePullPolicy    types.String `tfsdk:"image_pull_policy"`
	RunAsImageUser     types.Bool   `tfsdk:"run_as_image_user"`
	RuntimeClassName   types.String `tfsdk:"runtime_class_name"`
	Env                types.Map    `tfsdk:"env"`
	Resources          types.Object `tfsdk:"resources"`
	Workspace          types.Object `tfsdk:"workspace"`
	IdleTimeout        types.String `tfsdk:"idle_timeout"`
	CheckpointInterval types.String `tfsdk:"checkpoint_interval"`
	CheckpointsKept    types.Int64  `tfsdk:"checkpoints_kept"`
	Python             types.Object `tfsdk:"python"`
	MCPServers         types.List   `tfsdk:"mcp_servers"`
	SecretFiles        types.List   `tfsdk:"secret_files"`
	EgressProxy        types.String `tfsdk:"egress_proxy"`
	NodePool           types.String `tfsdk:"node_pool"`
	NodeSelector       types.Map    `tfsdk:"node_selector"`
	Tolerations        types.List   `tfsdk:"tolerations"`
}

type resourcesModel struct {
	Requests types.Map `tfsdk:"requests"`
	Limits   types.Map `tfsdk:"limits"`
}

type workspaceModel struct {
	Size                    types.String `tfsdk:"size"`
	StorageClassName        types.String `tfsdk:"storage_class_name"`
	VolumeSnapshotClassName types.String `tfsdk:"volume_snapshot_class_name"`
	MountPath               types.String `tfsdk:"mount_path"`
}

type pythonModel struct {
	DefaultTimeout  types.String `tfsdk:"default_timeout"`
	MaxTimeout      types.String `tfsdk:"max_timeout"`
	IndexURL        types.String `tfsdk:"index_url"`
	ExtraIndexURLs  types.List   `tfsdk:"extra_index_urls"`
	TrustedHosts    types.List   `tfsdk:"trusted_hosts"`
	AllowedPackages types.List   `tfsdk:"allowed_packages"`
	Environments    types.Object `tfsdk:"environments"`
}

type pythonEnvironmentsModel struct {
	MaxCount types.Int64  `tfsdk:"max_count"`
	MaxSize  types.String `tfsdk:"max_size"`
	TTL      types.String `tfsdk:"ttl"`
}

type mcpServerModel struct {
	Name    types.String `tfsdk:"name"`
	Command types.String `tfsdk:"command"`
	Args    types.List   `tfsdk:"args"`
	Env     types.Map    `tfsdk:"env"`
	URL     types.String `tfsdk:"url"`
	// Audience is the aud a user token must carry to reach the server.
	Audience types.String `tfsdk:"audience"`
}

type secretFileModel struct {
	SecretName types.String `tfsdk:"secret_name"`
	MountPath  types.String `tfsdk:"mount_path"`
}

// Defaults mirror the CRD's, so that a template that leaves them out plans
// the values the API server will store.
const (
	defaultWorkspaceSize  = "1Gi"
	defaultMountPath      = "/workspace"
	defaultIdleTimeout    = "1h"
	defaultPythonTimeout  = "30s"
	defaultPythonMax      = "2m"
	templateKind          = "SandboxTemplate"
	sandboxTemplateTFType = "sandbox_template"
)

var templateCR = crKind{kind: templateKind, tfType: sandboxTemplateTFType}

// checkpointsKeptRange is the CRD's bound on checkpointsKept.
var checkpointsKeptRange = int64validator.Between(1, 10)

// pythonEnvironmentsCountRange is the CRD's bound on
// python.environments.maxCount.
var pythonEnvironmentsCountRange = int64validator.Between(1, 64)

var (
	resourcesAttrTypes          = map[string]attr.Type{"requests": types.MapType{ElemType: types.StringType}, "limits": types.MapType{ElemType: types.StringType}}
	workspaceAttrTypes          = map[string]attr.Type{"size": types.StringType, "storage_class_name": types.StringType, "volume_snapshot_class_name": types.StringType, "mount_path": types.StringType}
	pythonEnvironmentsAttrTypes = map[string]attr.Type{"max_count": types.Int64Type, "max_size": types.StringType, "ttl": types.StringType}
	pythonAttrTypes             = map[string]attr.Type{"default_timeout": types.StringType, "max_timeout": types.StringType, "index_url": types.StringType,
		"extra_index_urls": types.ListType{ElemType: types.StringType}, "allowed_packages": types.ListType{ElemType: types.StringType},
		"trusted_hosts": types.ListType{ElemType: types.StringType},
		"environments":  types.ObjectType{AttrTypes: pythonEnvironmentsAttrTypes}}
	mcpServerAttrTypes = map[string]attr.Type{"name": types.StringType, "command": types.StringType, "args": types.ListType{ElemType: types.StringType}, "env": types.MapType{ElemType: types.StringType},
		"url": types.StringType, "audience": types.StringType}
	secretFileAttrTypes = map[string]attr.Type{"secret_name": types.StringType, "mount_path": types.StringType}
)

func (r *sandboxTemplateResource) Metadata(_ context.Context, req resource.MetadataRequest, resp *resource.MetadataResponse) {
	resp.TypeName = req.ProviderTypeName + "_" + sandboxTemplateTFType
}

func (r *sandboxTemplateResource) Schema(ctx context.Context, _ resource.SchemaRequest, resp *resource.SchemaResponse) {
	optionalMap := func(desc string) schema.MapAttribute {
		return schema.MapAttribute{ElementType: types.StringType, Optional: true, MarkdownDescription: desc}
	}
	optionalList := func(desc string) schema.ListAttribute {
		return schema.ListAttribute{ElementType: types.StringType, Optional: true, MarkdownDescription: desc}
	}
	resp.Schema = schema.Schema{
		MarkdownDescription: "A sandbox template: everything a sandbox of this kind runs with (image, gVisor runtime class, " +
			"resources, workspace volume, idle timeout, Python policy, MCP servers, egress proxy). Sandboxes name their " +
			"template; it becomes a `SandboxTemplate` object. Sandbox pods always run with restricted security: non-root, " +
			"read-only root filesystem with a writable `/tmp`, all capabilities dropped, seccomp `RuntimeDefault` and no " +
			"service-account token.",
		Attributes: map[string]schema.Attribute{
			"id":        idAttribute(templateKind),
			"name":      nameAttribute(templateKind),
			"namespace": namespaceAttribute(templateKind),
			"image": schema.StringAttribute{
				Optional: true,
				MarkdownDescription: "Container image of the sandbox: any Linux image (amd64), such as `python:3.12`, `node:22` or a company " +
					"base image. The platform injects its supervisor, which replaces the image's entrypoint and command; the image's " +
					"environment and working directory are kept, and every process the sandbox runs gets the image's environment. It runs " +
					"as user 65532 (or the image's own, with `run_as_image_user`) on a read-only root file system, with `HOME` the workspace unless `env` sets it. `python_exec` and " +
					"`execute` need `python3` on the image's `PATH`, and a terminal opened without a command needs `bash` or `sh`. " +
					"Unset means the platform's default sandbox image (Python 3).",
			},
			"image_pull_policy": schema.StringAttribute{
				Optional: true,
				MarkdownDescription: "When the node pulls the image: " + codeList(pullPolicies) + ". Unset means `IfNotPresent` for an `image` the template names, and the platform's " +
					"`image_pull_policy` for its default image.",
				Validators: []validator.String{stringvalidator.OneOf(pullPolicies...)},
			},
			"run_as_image_user": schema.BoolAttribute{
				Optional: true, Computed: true, Default: booldefault.StaticBool(false),
				MarkdownDescription: "Run the sandbox as the user its image sets (`USER` in a Dockerfile) instead of user 65532, for " +
					"an image whose files belong to a user of its own. The image's user must be a number and not root: a sandbox never " +
					"runs as root, and Kubernetes cannot check a user name. An image whose user is root, unset or a name does not " +
					"start: its sandboxes report the reason `ImageRunsAsRoot`. The sandbox keeps group 65532 for its workspace. " +
					"Defaults to `false`.",
			},
			"runtime_class_name": schema.StringAttribute{
				Optional: true, Computed: true, Default: stringdefault.StaticString(defaultRuntimeClass),
				MarkdownDescription: "RuntimeClass of the sandbox pods; it should select gVisor. Defaults to `" + defaultRuntimeClass + "`.",
			},
			"env": optionalMap("Environment variables of the sandbox (plain values; put secrets in `secret_files`). Every process the sandbox runs gets them: commands, `python_exec` and `execute` runs, terminals and MCP servers. Names starting with `AGENTBOX_` configure the sandbox's supervisor, and `GODEBUG` is the supervisor's own: they are not passed on."),
			"resources": schema.SingleNestedAttribute{
				Optional:            true,
				MarkdownDescription: "CPU and memory of each sandbox pod, as Kubernetes quantities (`cpu = \"500m\"`, `memory = \"1Gi\"`).",
				Attributes: map[string]schema.Attribute{
					"requests": optionalMap("What the scheduler reserves for the pod."),
					"limits":   optionalMap("The most the pod may use."),
				},
			},
			"workspace": schema.SingleNestedAttribute{
				Optional: true, Computed: true,
				Default: objectdefault.StaticValue(types.ObjectValueMust(workspaceAttrTypes, map[string]attr.Value{
					"size": types.StringValue(defaultWorkspaceSize), "storage_class_name": types.StringNull(),
					"volume_snapshot_class_name": types.StringNull(), "mount_path": types.StringValue(defaultMountPath),
				})),
				MarkdownDescription: "The persistent workspace volume. It survives idle stops (through a snapshot) and is the hard " +
					"cap on what the sandbox may store.",
				Attributes: map[string]schema.Attribute{
					"size": schema.StringAttribute{
						Optional: true, Computed: true, Default: stringdefault.StaticString(defaultWorkspaceSize),
						MarkdownDescription: "Size of the volume, a Kubernetes quantity, and the most the files in it may hold: the supervisor refuses writes past it. Defaults to `" + defaultWorkspaceSize + "`.",
					},
					"storage_class_name": schema.StringAttribute{
						Optional: true, MarkdownDescription: "StorageClass of the volume. Unset means the cluster's default class.",
					},
					"volume_snapshot_class_name": schema.StringAttribute{
						Optional: true, MarkdownDescription: "VolumeSnapshotClass used to snapshot the workspace on idle stop. Unset means the default class.",
					},
					"mount_path": schema.StringAttribute{
						Optional: true, Computed: true, Default: stringdefault.StaticString(defaultMountPath),
						MarkdownDescription: "Where the workspace is mounted. Defaults to `" + defaultMountPath + "`.",
						Validators:          []validator.String{mountPathCheck},
					},
				},
			},
			"idle_timeout": schema.StringAttribute{
				Optional: true, Computed: true, Default: stringdefault.StaticString(defaultIdleTimeout),
				MarkdownDescription: "How long a sandbox may go without API activity before it is snapshotted and stopped; only " +
					"idle time counts. A Go duration such as `30m` or `1h`. Defaults to `" + defaultIdleTimeout + "`.",
				Validators: []validator.String{durationCheck},
			},
			"checkpoint_interval": schema.StringAttribute{
				Optional: true,
				MarkdownDescription: "How often a running sandbox's workspace is checkpointed, in the background and with the platform's " +
					"snapshot driver, without pausing the agent; unset means never. A sandbox whose node is lost resumes from its newest " +
					"checkpoint and loses only the changes made after it. A sandbox with no API call since its newest checkpoint is not " +
					"checkpointed again. Must be " + checkpointIntervalCheck.description + ".",
				Validators: []validator.String{checkpointIntervalCheck},
			},
			"checkpoints_kept": schema.Int64Attribute{
				Optional: true, Computed: true, Default: int64default.StaticInt64(agentboxv1alpha1.DefaultCheckpointsKept),
				MarkdownDescription: "How many checkpoints a running sandbox keeps, the newest included; an idle stop's snapshot " +
					"supersedes them all. The " + checkpointsKeptRange.MarkdownDescription(ctx) + "; defaults to `" +
					fmt.Sprint(agentboxv1alpha1.DefaultCheckpointsKept) + "`.",
				Validators: []validator.Int64{checkpointsKeptRange},
			},
			"python": schema.SingleNestedAttribute{
				Optional: true, Computed: true,
				Default: objectdefault.StaticValue(types.ObjectValueMust(pythonAttrTypes, map[string]attr.Value{
					"default_timeout": types.StringValue(defaultPythonTimeout), "max_timeout": types.StringValue(defaultPythonMax),
					"index_url": types.StringNull(), "extra_index_urls": types.ListNull(types.StringType), "allowed_packages": types.ListNull(types.StringType),
					"trusted_hosts": types.ListNull(types.StringType),
					"environments":  types.ObjectNull(pythonEnvironmentsAttrTypes),
				})),
				MarkdownDescription: "Policy of `python_exec` and of the cached Python environments.",
				Attributes: map[string]schema.Attribute{
					"default_timeout": schema.StringAttribute{
						Optional: true, Computed: true, Default: stringdefault.StaticString(defaultPythonTimeout),
						MarkdownDescription: "Timeout of calls that give none. Defaults to `" + defaultPythonTimeout + "`.",
						Validators:          []validator.String{durationCheck},
					},
					"max_timeout": schema.StringAttribute{
						Optional: true, Computed: true, Default: stringdefault.StaticString(defaultPythonMax),
						MarkdownDescription: "Hard cap on a call's timeout. Defaults to `" + defaultPythonMax + "`.",
						Validators:          []validator.String{durationCheck},
					},
					"index_url":        schema.StringAttribute{Optional: true, MarkdownDescription: "Package index that requirements are installed from."},
					"extra_index_urls": optionalList("Further package indexes."),
					"trusted_hosts": optionalList("Package index hosts (`host` or `host:port`) that installs may reach over plain HTTP " +
						"or without verifying their certificate, such as an internal mirror served without TLS: pip's `--trusted-host`, " +
						"uv's `--allow-insecure-host`. Trusting a host gives up the transport's integrity for its packages; name only " +
						"hosts on a network you control."),
					"allowed_packages": optionalList("If set, only these packages may be installed."),
					"environments": schema.SingleNestedAttribute{
						Optional: true,
						MarkdownDescription: "Bounds of the sandbox's cached Python environments (built for `execute` runs with requirements, " +
							"or ahead of them with the Compute API's `/v1/agents/{id}/envs`). They live in a hidden directory of the workspace " +
							"volume (`.agentbox/envs`), so an idle stop keeps them and a resumed sandbox does not rebuild them; they count " +
							"against the workspace's size and are never synced to the filespace. Past any bound the least recently used idle " +
							"environments are removed. Unset attributes take the defaults.",
						Attributes: map[string]schema.Attribute{
							"max_count": schema.Int64Attribute{
								Optional: true,
								MarkdownDescription: "How many environments are kept: " + pythonEnvironmentsCountRange.MarkdownDescription(ctx) +
									". Defaults to `" + fmt.Sprint(agentboxv1alpha1.DefaultPythonEnvironmentsMaxCount) + "`.",
								Validators: []validator.Int64{pythonEnvironmentsCountRange},
							},
							"max_size": schema.StringAttribute{
								Optional: true,
								MarkdownDescription: "Disk the environments may take together, " + quantityCheck.description +
									"; it must be smaller than `workspace.size`. Defaults to half of `workspace.size`.",
								Validators: []validator.String{quantityCheck},
							},
							"ttl": schema.StringAttribute{
								Optional: true,
								MarkdownDescription: "An idle environment unused for longer than this (idle stops included) is removed: " +
									envTTLCheck.description + ". Defaults to `168h` (7 days).",
								Validators: []validator.String{envTTLCheck},
							},
						},
					},
				},
			},
			"mcp_servers": schema.ListNestedAttribute{
				Optional: true,
				MarkdownDescription: "MCP servers the sandbox's supervisor bridges to the Compute API's `mcp_request`: stdio servers " +
					"(`command`) it starts in every sandbox and restarts on failure, and remote Streamable HTTP servers (`url`) it " +
					"connects to through the sandbox's egress proxy. A user token given with an `mcp_request` (header " +
					"`X-Agentbox-User-Token`) must have the server's `audience` (by default its name, or a remote server's `url`) as an audience; a stdio server " +
					"receives it in the request's `params._meta` under `agentbox.dev/user-token`, never in its environment, and a remote " +
					"one as `Authorization: Bearer`.",
				NestedObject: schema.NestedAttributeObject{Attributes: map[string]schema.Attribute{
					"name": schema.StringAttribute{Required: true, MarkdownDescription: "Name the server is addressed by."},
					"command": schema.StringAttribute{
						Optional: true, MarkdownDescription: "Program to run, for a stdio server. Set exactly one of `command` and `url`.",
						Validators: []validator.String{
							stringvalidator.LengthBetween(1, 1024),
							stringvalidator.ExactlyOneOf(path.MatchRelative().AtParent().AtName("url")),
						},
					},
					"args": schema.ListAttribute{
						ElementType: types.StringType, Optional: true, MarkdownDescription: "Its arguments (stdio servers only).",
						Validators: []validator.List{listvalidator.ConflictsWith(path.MatchRelative().AtParent().AtName("url"))},
					},
					"env": schema.MapAttribute{
						ElementType: types.StringType, Optional: true, MarkdownDescription: "Its environment (stdio servers only).",
						Validators: []validator.Map{mapvalidator.ConflictsWith(path.MatchRelative().AtParent().AtName("url"))},
					},
					"url": schema.StringAttribute{
						Optional: true,
						MarkdownDescription: "Streamable HTTP endpoint of a remote MCP server (`http://` or `https://`). The supervisor " +
							"reaches it through the sandbox's egress proxy, which must allow its host, and sends the caller's user " +
							"token, when an `mcp_request` carries one, as `Authorization: Bearer`. Set exactly one of `command` and `url`.",
						Validators: []validator.String{stringvalidator.LengthBetween(1, 2048), mcpURLCheck},
					},
					"audience": schema.StringAttribute{
						Optional: true,
						MarkdownDescription: "The audience a user token must carry for an `mcp_request` to this server to pass it on: " +
							"unset, the server's `name` for a stdio server and its `url` for a remote one. The platform refuses a " +
							"token for another audience (`invalid_user_token`) before the call reaches the server.",
						Validators: []validator.String{stringvalidator.LengthBetween(1, 1024)},
					},
				}},
			},
			"secret_files": schema.ListNestedAttribute{
				Optional:            true,
				MarkdownDescription: "Kubernetes Secrets mounted read-only as files into the sandbox.",
				NestedObject: schema.NestedAttributeObject{Attributes: map[string]schema.Attribute{
					"secret_name": schema.StringAttribute{Required: true, MarkdownDescription: "Secret in the template's namespace."},
					"mount_path": schema.StringAttribute{
						Required: true, Validators: []validator.String{mountPathCheck},
						MarkdownDescription: "Folder its keys appear in as files. It may not be in the workspace, whose snapshots would carry the Secret.",
					},
				}},
			},
			"egress_proxy": schema.StringAttribute{
				Optional: true,
				MarkdownDescription: "Name of the `agentbox_egress_proxy` (in the same namespace) that sandboxes reach the " +
					"outside world through. Unset means sandboxes can reach nothing outside the cluster but DNS.",
			},
			"node_pool": schema.StringAttribute{
				Optional: true, MarkdownDescription: "Name of the `agentbox_node_pool` whose nodes run the sandboxes.",
			},
			"node_selector": optionalMap("Extra node labels the sandbox pods require."),
			"tolerations": tolerationsAttribute("Tolerations added to the sandbox pods, beside those of the `node_pool`'s " +
				"RuntimeClass: for nodes tainted for reasons of the cluster's own (dedicated hardware, a spot pool) that " +
				"the template's sandboxes may use."),
		},
	}
}

func (r *sandboxTemplateResource) Configure(_ context.Context, req resource.ConfigureRequest, resp *resource.ConfigureResponse) {
	r.data = providerDataFrom(req.ProviderData, &resp.Diagnostics)
}

// ModifyPlan plans the namespace and ID, known before apply.
func (r *sandboxTemplateResource) ModifyPlan(ctx context.Context, req resource.ModifyPlanRequest, resp *resource.ModifyPlanResponse) {
	planObjectID(ctx, r.data, req, resp)
}

func (r *sandboxTemplateResource) Create(ctx context.Context, req resource.CreateRequest, resp *resource.CreateResponse) {
	var plan sandboxTemplateModel
	c := modelAndClient(ctx, r.data, req.Plan, &plan, &resp.Diagnostics)
	if c == nil {
		return
	}
	ns := resolveNamespace(plan.Namespace, r.data)
	obj := &agentboxv1alpha1.SandboxTemplate{ObjectMeta: metav1.ObjectMeta{Name: plan.Name.ValueString(), Namespace: ns}}
	obj.Spec = plan.spec(ctx, &resp.Diagnostics)
	if resp.Diagnostics.HasError() || !templateCR.create(ctx, c, obj, &resp.Diagnostics) {
		return
	}
	plan.ID = types.StringValue(objectID(ns, obj.Name))
	plan.Namespace = types.StringValue(ns)
	resp.Diagnostics.Append(resp.State.Set(ctx, &plan)...)
}

func (r *sandboxTemplateResource) Read(ctx context.Context, req resource.ReadRequest, resp *resource.ReadResponse) {
	var state sandboxTemplateModel
	c := modelAndClient(ctx, r.data, req.State, &state, &resp.Diagnostics)
	if c == nil {
		return
	}
	var obj agentboxv1alpha1.SandboxTemplate
	if !templateCR.read(ctx, c, objectKey(state.Namespace, state.Name), &obj, resp) {
		return
	}
	state.fromSpec(ctx, &obj.Spec, &resp.Diagnostics)
	state.ID = types.StringValue(objectID(obj.Namespace, obj.Name))
	resp.Diagnostics.Append(resp.State.Set(ctx, &state)...)
}

func (r *sandboxTemplateResource) Update(ctx context.Context, req resource.UpdateRequest, resp *resource.UpdateResponse) {
	var plan sandboxTemplateModel
	c := modelAndClient(ctx, r.data, req.Plan, &plan, &resp.Diagnostics)
	if c == nil {
		return
	}
	key := objectKey(plan.Namespace, plan.Name)
	spec := plan.spec(ctx, &resp.Diagnostics)
	if resp.Diagnostics.HasError() {
		return
	}
	var obj agentboxv1alpha1.SandboxTemplate
	if err := c.Get(ctx, key, &obj); err != nil {
		apiErrorDiag(&resp.Diagnostics, "Read", key, templateKind, err)
		return
	}
	// The whole spec is Terraform's: replacing it undoes out-of-band edits.
	obj.Spec = spec
	if err := c.Update(ctx, &obj); err != nil {
		apiErrorDiag(&resp.Diagnostics, "Update", key, templateKind, err)
		return
	}
	resp.Diagnostics.Append(resp.State.Set(ctx, &plan)...)
}

func (r *sandboxTemplateResource) Delete(ctx context.Context, req resource.DeleteRequest, resp *resource.DeleteResponse) {
	var state sandboxTemplateModel
	c := modelAndClient(ctx, r.data, req.State, &state, &resp.Diagnostics)
	if c == nil {
		return
	}
	obj := &agentboxv1alpha1.SandboxTemplate{ObjectMeta: namedObjectMeta(state.Namespace, state.Name)}
	templateCR.delete(ctx, c, obj, noDeleteWait, &resp.Diagnostics)
}

func (r *sandboxTemplateResource) ImportState(ctx context.Context, req resource.ImportStateRequest, resp *resource.ImportStateResponse) {
	importObject(ctx, r.data, req, resp)
}

// spec converts the planned attributes into the object's spec.
func (m *sandboxTemplateModel) spec(ctx context.Context, diags *diag.Diagnostics) agentboxv1alpha1.SandboxTemplateSpec {
	s := agentboxv1alpha1.SandboxTemplateSpec{
		Image:            m.Image.ValueString(),
		ImagePullPolicy:  corev1.PullPolicy(m.ImagePullPolicy.ValueString()),
		RunAsImageUser:   m.RunAsImageUser.ValueBool(),
		RuntimeClassName: m.RuntimeClassName.ValueString(),
		IdleTimeout:      parseDuration(m.IdleTimeout, "idle_timeout", diags),
		CheckpointsKept:  int32(m.CheckpointsKept.ValueInt64()),
		NodeSelector:     goMap(ctx, m.NodeSelector, diags),
		Tolerations:      tolerationsSpec(ctx, m.Tolerations, diags),
	}
	if !m.CheckpointInterval.IsNull() && !m.CheckpointInterval.IsUnknown() {
		d := parseDuration(m.CheckpointInterval, "checkpoint_interval", diags)
		s.CheckpointInterval = &d
	}
	env := goMap(ctx, m.Env, diags)
	for _, k := range sortedKeys(env) {
		s.Env = append(s.Env, corev1.EnvVar{Name: k, Value: env[k]})
	}
	if !m.Resources.IsNull() && !m.Resources.IsUnknown() {
		var rm resourcesModel
		diags.Append(m.Resources.As(ctx, &rm, objectAsOptions)...)
		s.Resources.Requests = resourceList(goMap(ctx, rm.Requests, diags), "resources.requests", diags)
		s.Resources.Limits = resourceList(goMap(ctx, rm.Limits, diags), "resources.limits", diags)
	}
	if !m.Workspace.IsNull() && !m.Workspace.IsUnknown() {
		var wm workspaceModel
		diags.Append(m.Workspace.As(ctx, &wm, objectAsOptions)...)
		s.Workspace = agentboxv1alpha1.WorkspaceSpec{
			Size:                    parseQuantity(wm.Size, "workspace.size", diags),
			StorageClassName:        stringPtr(wm.StorageClassName),
			VolumeSnapshotClassName: stringPtr(wm.VolumeSnapshotClassName),
			MountPath:               wm.MountPath.ValueString(),
		}
	}
	if !m.Python.IsNull() && !m.Python.IsUnknown() {
		var pm pythonModel
		diags.Append(m.Python.As(ctx, &pm, objectAsOptions)...)
		s.Python = agentboxv1alpha1.PythonPolicy{
			DefaultTimeout:  parseDuration(pm.DefaultTimeout, "python.default_timeout", diags),
			MaxTimeout:      parseDuration(pm.MaxTimeout, "python.max_timeout", diags),
			IndexURL:        pm.IndexURL.ValueString(),
			ExtraIndexURLs:  goStrings(ctx, pm.ExtraIndexURLs, diags),
			TrustedHosts:    goStrings(ctx, pm.TrustedHosts, diags),
			AllowedPackages: goStrings(ctx, pm.AllowedPackages, diags),
			Environments:    pythonEnvironmentsSpec(ctx, pm.Environments, diags),
		}
	}
	if !m.MCPServers.IsNull() && !m.MCPServers.IsUnknown() {
		var servers []mcpServerModel
		diags.Append(m.MCPServers.ElementsAs(ctx, &servers, false)...)
		for _, sv := range servers {
			s.MCPServers = append(s.MCPServers, agentboxv1alpha1.MCPServer{
				Name: sv.Name.ValueString(), Command: sv.Command.ValueString(), URL: sv.URL.ValueString(),
				Audience: sv.Audience.ValueString(),
				Args:     goStrings(ctx, sv.Args, diags), Env: goMap(ctx, sv.Env, diags),
			})
		}
	}
	if !m.SecretFiles.IsNull() && !m.SecretFiles.IsUnknown() {
		var files []secretFileModel
		diags.Append(m.SecretFiles.ElementsAs(ctx, &files, false)...)
		for _, f := range files {
			s.SecretFiles = append(s.SecretFiles, agentboxv1alpha1.SecretFile{SecretName: f.SecretName.ValueString(), MountPath: f.MountPath.ValueString()})
		}
	}
	if v := m.EgressProxy.ValueString(); v != "" {
		s.EgressProxyRef = &agentboxv1alpha1.LocalObjectReference{Name: v}
	}
	s.NodePoolRef = stringPtr(m.NodePool)
	return s
}

// fromSpec sets the attributes from the live spec, keeping the prior
// spelling of values that are equal (see keepDuration).
func (m *sandboxTemplateModel) fromSpec(ctx context.Context, s *agentboxv1alpha1.SandboxTemplateSpec, diags *diag.Diagnostics) {
	m.Image = stringOrNull(s.Image)
	m.ImagePullPolicy = stringOrNull(string(s.ImagePullPolicy))
	m.RunAsImageUser = types.BoolValue(s.RunAsImageUser)
	m.RuntimeClassName = types.StringValue(s.RuntimeClassName)
	m.IdleTimeout = keepDuration(m.IdleTimeout, s.IdleTimeout.Duration)
	m.CheckpointInterval = types.StringNull()
	if s.CheckpointInterval != nil {
		m.CheckpointInterval = keepDuration(m.CheckpointInterval, s.CheckpointInterval.Duration)
	}
	m.CheckpointsKept = types.Int64Value(int64(s.CheckpointsKept))
	m.NodeSelector = mapValue(ctx, m.NodeSelector, s.NodeSelector, diags)
	m.Tolerations = tolerationsValue(ctx, m.Tolerations, s.Tolerations, diags)
	env := map[string]string{}
	for _, e := range s.Env {
		// Values from Secrets or fields are not Terraform's to manage here.
		if e.ValueFrom == nil {
			env[e.Name] = e.Value
		}
	}
	m.Env = mapValue(ctx, m.Env, env, diags)
	m.Resources = resourcesValue(ctx, m.Resources, &s.Resources, diags)
	m.Workspace = workspaceValue(ctx, m.Workspace, &s.Workspace, diags)
	m.Python = pythonValue(ctx, m.Python, &s.Python, diags)
	m.MCPServers = mcpServersValue(ctx, m.MCPServers, s.MCPServers, diags)
	m.SecretFiles = secretFilesValue(ctx, s.SecretFiles, diags)
	m.EgressProxy = types.StringNull()
	if s.EgressProxyRef != nil {
		m.EgressProxy = types.StringValue(s.EgressProxyRef.Name)
	}
	m.NodePool = stringPtrValue(s.NodePoolRef)
}

func resourcesValue(ctx context.Context, prior types.Object, r *corev1.ResourceRequirements, diags *diag.Diagnostics) types.Object {
	var priorRes resourcesModel
	if !prior.IsNull() && !prior.IsUnknown() {
		diags.Append(prior.As(ctx, &priorRes, objectAsOptions)...)
	}
	if len(r.Requests) == 0 && len(r.Limits) == 0 {
		return types.ObjectNull(resourcesAttrTypes)
	}
	rm := resourcesModel{
		Requests: quantityMap(ctx, priorRes.Requests, r.Requests, diags),
		Limits:   quantityMap(ctx, priorRes.Limits, r.Limits, diags),
	}
	return objectValue(ctx, resourcesAttrTypes, rm, diags)
}

func workspaceValue(ctx context.Context, prior types.Object, w *agentboxv1alpha1.WorkspaceSpec, diags *diag.Diagnostics) types.Object {
	var wm workspaceModel
	if !prior.IsNull() && !prior.IsUnknown() {
		diags.Append(prior.As(ctx, &wm, objectAsOptions)...)
	}
	wm.Size = keepQuantity(wm.Size, w.Size)
	wm.StorageClassName = stringPtrValue(w.StorageClassName)
	wm.VolumeSnapshotClassName = stringPtrValue(w.VolumeSnapshotClassName)
	wm.MountPath = types.StringValue(w.MountPath)
	return objectValue(ctx, workspaceAttrTypes, wm, diags)
}

func pythonValue(ctx context.Context, prior types.Object, p *agentboxv1alpha1.PythonPolicy, diags *diag.Diagnostics) types.Object {
	var pm pythonModel
	if !prior.IsNull() && !prior.IsUnknown() {
		diags.Append(prior.As(ctx, &pm, objectAsOptions)...)
	}
	pm.DefaultTimeout = keepDuration(pm.DefaultTimeout, p.DefaultTimeout.Duration)
	pm.MaxTimeout = keepDuration(pm.MaxTimeout, p.MaxTimeout.Duration)
	pm.IndexURL = stringOrNull(p.IndexURL)
	pm.ExtraIndexURLs = listValue(ctx, pm.ExtraIndexURLs, p.ExtraIndexURLs, diags)
	pm.TrustedHosts = listValue(ctx, pm.TrustedHosts, p.TrustedHosts, diags)
	pm.AllowedPackages = listValue(ctx, pm.AllowedPackages, p.AllowedPackages, diags)
	pm.Environments = pythonEnvironmentsValue(ctx, pm.Environments, p.Environments, diags)
	return objectValue(ctx, pythonAttrTypes, pm, diags)
}

func pythonEnvironmentsSpec(ctx context.Context, v types.Object, diags *diag.Diagnostics) *agentboxv1alpha1.PythonEnvironments {
	if v.IsNull() || v.IsUnknown() {
		return nil
	}
	var em pythonEnvironmentsModel
	diags.Append(v.As(ctx, &em, objectAsOptions)...)
	e := &agentboxv1alpha1.PythonEnvironments{MaxCount: int32(em.MaxCount.ValueInt64())}
	if !em.MaxSize.IsNull() && !em.MaxSize.IsUnknown() {
		q := parseQuantity(em.MaxSize, "python.environments.max_size", diags)
		e.MaxSize = &q
	}
	if !em.TTL.IsNull() && !em.TTL.IsUnknown() {
		d := parseDuration(em.TTL, "python.environments.ttl", diags)
		e.TTL = &d
	}
	return e
}

// pythonEnvironmentsValue keeps the prior spelling of equal sizes and
// durations.
func pythonEnvironmentsValue(ctx context.Context, prior types.Object, live *agentboxv1alpha1.PythonEnvironments, diags *diag.Diagnostics) types.Object {
	if live == nil {
		return types.ObjectNull(pythonEnvironmentsAttrTypes)
	}
	var em pythonEnvironmentsModel
	if !prior.IsNull() && !prior.IsUnknown() {
		diags.Append(prior.As(ctx, &em, objectAsOptions)...)
	}
	em.MaxCount = types.Int64Null()
	if live.MaxCount > 0 {
		em.MaxCount = types.Int64Value(int64(live.MaxCount))
	}
	if live.MaxSize != nil {
		em.MaxSize = keepQuantity(em.MaxSize, *live.MaxSize)
	} else {
		em.MaxSize = types.StringNull()
	}
	if live.TTL != nil {
		em.TTL = keepDuration(em.TTL, live.TTL.Duration)
	} else {
		em.TTL = types.StringNull()
	}
	return objectValue(ctx, pythonEnvironmentsAttrTypes, em, diags)
}

// mcpServersValue keeps each server's prior spelling of an empty args or
// env, matched by position.
func mcpServersValue(ctx context.Context, prior types.List, live []agentboxv1alpha1.MCPServer, diags *diag.Diagnostics) types.List {
	var priorServers []mcpServerModel
	if !prior.IsNull() && !prior.IsUnknown() {
		diags.Append(prior.ElementsAs(ctx, &priorServers, false)...)
	}
	if len(live) == 0 {
		return types.ListNull(types.ObjectType{AttrTypes: mcpServerAttrTypes})
	}
	servers := make([]mcpServerModel, len(live))
	for i, sv := range live {
		var p mcpServerModel
		if i < len(priorServers) {
			p = priorServers[i]
		}
		servers[i] = mcpServerModel{
			Name: types.StringValue(sv.Name), Command: stringOrNull(sv.Command), URL: stringOrNull(sv.URL),
			Audience: stringOrNull(sv.Audience),
			Args:     listValue(ctx, p.Args, sv.Args, diags), Env: mapValue(ctx, p.Env, sv.Env, diags),
		}
	}
	v, d := types.ListValueFrom(ctx, types.ObjectType{AttrTypes: mcpServerAttrTypes}, servers)
	diags.Append(d...)
	return v
}

func secretFilesValue(ctx context.Context, live []agentboxv1alpha1.SecretFile, diags *diag.Diagnostics) types.List {
	if len(live) == 0 {
		return types.ListNull(types.ObjectType{AttrTypes: secretFileAttrTypes})
	}
	files := make([]secretFileModel, len(live))
	for i, f := range live {
		files[i] = secretFileModel{SecretName: types.StringValue(f.SecretName), MountPath: types.StringValue(f.MountPath)}
	}
	v, d := types.ListValueFrom(ctx, types.ObjectType{AttrTypes: secretFileAttrTypes}, files)
	diags.Append(d...)
	return v
}
