package provider

import (
	"context"
	"fmt"
	"math"
	"regexp"
	"time"

	"github.com/hashicorp/terraform-plugin-framework-timeouts/resource/timeouts"
	"github.com/hashicorp/terraform-plugin-framework-validators/int64validator"
	"github.com/hashicorp/terraform-plugin-framework-validators/listvalidator"
	"github.com/hashicorp/terraform-plugin-framework-validators/stringvalidator"
	"github.com/hashicorp/terraform-plugin-framework/attr"
	"github.com/hashicorp/terraform-plugin-framework/diag"
	"github.com/hashicorp/terraform-plugin-framework/resource"
	"github.com/hashicorp/terraform-plugin-framework/resource/schema"
	"github.com/hashicorp/terraform-plugin-framework/resource/schema/booldefault"
	"github.com/hashicorp/terraform-plugin-framework/resource/schema/stringdefault"
	"github.com/hashicorp/terraform-plugin-framework/schema/validator"
	"github.com/hashicorp/terraform-plugin-framework/types"
	apimeta "k8s.io/apimachinery/pkg/api/meta"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	k8stypes "k8s.io/apimachinery/pkg/types"
	"sigs.k8s.io/controller-runtime/pkg/client"

	agentboxv1alpha1 "github.com/agentbox/terraform-provider-agentbox/internal/api/v1alpha1"
)

var (
	_ resource.Resource                = (*warmPoolResource)(nil)
	_ resource.ResourceWithConfigure   = (*warmPoolResource)(nil)
	_ resource.ResourceWithImportState = (*warmPoolResource)(nil)
	_ resource.ResourceWithModifyPlan  = (*warmPoolResource)(nil)
)

// NewWarmPoolResource manages a SandboxWarmPool.
func NewWarmPoolResource() resource.Resource { return &warmPoolResource{} }

type warmPoolResource struct{ data *providerData }

type warmPoolModel struct {
	ID           types.String   `tfsdk:"id"`
	Name         types.String   `tfsdk:"name"`
	Namespace    types.String   `tfsdk:"namespace"`
	Template     types.String   `tfsdk:"template"`
	Replicas     types.Int64    `tfsdk:"replicas"`
	ColdStart    types.Bool     `tfsdk:"cold_start_when_exhausted"`
	PythonEnvs   []warmPoolEnv  `tfsdk:"python_environments"`
	Release      types.String   `tfsdk:"release_policy"`
	WaitForReady types.Bool     `tfsdk:"wait_for_ready"`
	Status       types.Object   `tfsdk:"status"`
	Timeouts     timeouts.Value `tfsdk:"timeouts"`
}

// warmPoolEnv is one of python_environments.
type warmPoolEnv struct {
	Name         types.String `tfsdk:"name"`
	Requirements []string     `tfsdk:"requirements"`
}

type warmPoolStatusModel struct {
	Replicas       types.Int64 `tfsdk:"replicas"`
	ReadyReplicas  types.Int64 `tfsdk:"ready_replicas"`
	LeasedReplicas types.Int64 `tfsdk:"leased_replicas"`
}

const (
	warmPoolKind          = "SandboxWarmPool"
	warmPoolTFType        = "warm_pool"
	defaultWarmPoolWait   = 10 * time.Minute
	defaultWarmPoolDelete = 5 * time.Minute
)

// warmPoolCR deletes in the foreground: the warm sandboxes go before the
// pool does, so that a destroy of the template right after does not strand
// them.
var warmPoolCR = crKind{kind: warmPoolKind, tfType: warmPoolTFType, foregroundDelete: true}

var (
	warmPoolStatusAttrTypes = map[string]attr.Type{
		"replicas": types.Int64Type, "ready_replicas": types.Int64Type, "leased_replicas": types.Int64Type,
	}
	// replicasRange is the CRD's: at least 0, and an int32.
	replicasRange = int64validator.Between(0, math.MaxInt32)
)

func (r *warmPoolResource) Metadata(_ context.Context, req resource.MetadataRequest, resp *resource.MetadataResponse) {
	resp.TypeName = req.ProviderTypeName + "_" + warmPoolTFType
}

func (r *warmPoolResource) Schema(ctx context.Context, _ resource.SchemaRequest, resp *resource.SchemaResponse) {
	computedInt := func(desc string) schema.Int64Attribute {
		return schema.Int64Attribute{Computed: true, MarkdownDescription: desc}
	}
	resp.Schema = schema.Schema{
		MarkdownDescription: "A warm pool: a number of started, unassigned sandboxes of one template, so that a new " +
			"`agentbox_sandbox` (or an ephemeral lease) of that template adopts a ready one instead of starting cold. " +
			"It becomes a `SandboxWarmPool` object, whose `replicas` is also its scale subresource. Requires `agentbox_platform`.",
		Attributes: map[string]schema.Attribute{
			"id":        idAttribute(warmPoolKind),
			"name":      nameAttribute(warmPoolKind),
			"namespace": namespaceAttribute(warmPoolKind),
			"template": schema.StringAttribute{
				Required: true,
				MarkdownDescription: "Name of the `agentbox_sandbox_template` (same namespace) whose sandboxes the pool keeps warm. " +
					"Must be " + dnsSubdomainCheck.description + ". Changing it makes the pool replace its warm sandboxes.",
				Validators: []validator.String{dnsSubdomainCheck},
			},
			"replicas": schema.Int64Attribute{
				Required: true,
				MarkdownDescription: "How many ready, unassigned sandboxes the pool keeps; an adopted one is replaced. " +
					"The " + replicasRange.MarkdownDescription(ctx) + ". A change made with `kubectl scale` or an " +
					"autoscaler shows as drift; add `replicas` to `lifecycle.ignore_changes` if something else owns it.",
				Validators: []validator.Int64{replicasRange},
			},
			"cold_start_when_exhausted": schema.BoolAttribute{
				Optional: true, Computed: true, Default: booldefault.StaticBool(false),
				MarkdownDescription: "When a Compute API pool lease that may wait (`wait_seconds`) finds no ready sandbox free, " +
					"start one from the template for it instead of waiting for the pool to refill: an ephemeral sandbox of the " +
					"pool, handed out once ready and deleted when its lease ends, like any leased one. A lease without " +
					"`wait_seconds` is still refused at once (`pool_exhausted`). Defaults to `false`.",
			},
			"python_environments": schema.ListNestedAttribute{
				Optional: true,
				MarkdownDescription: "Python environments every warm sandbox of the pool builds (through its supervisor, " +
					"bounded by the build timeout) before a pool lease may take it, so that the first `execute` of a leased " +
					"sandbox finds them cached; a pool lease that names one is routed to a sandbox holding it. At most 8. " +
					"A change builds the new environments in the warm sandboxes the pool has; none is replaced. A build that " +
					"fails shows in the pool's and the sandbox's `PythonEnvironmentsReady` condition (reason `PrewarmFailed`) " +
					"and an event, and the sandbox is leased without it. A warm sandbox counts as ready (`status.ready_replicas`, " +
					"`wait_for_ready`) only once its environments are built or their build has failed; an apply that waited " +
					"for a pool with a failed build returns with a warning naming the environment.",
				Validators: []validator.List{listvalidator.SizeAtMost(8)},
				NestedObject: schema.NestedAttributeObject{Attributes: map[string]schema.Attribute{
					"name": schema.StringAttribute{
						Optional: true,
						MarkdownDescription: "Names the environment (as `env_name` does in `execute`). Unset, it is the " +
							"environment of its requirement set, the one an `execute` with the same `requirements` uses.",
						Validators: []validator.String{stringvalidator.LengthBetween(1, 63),
							stringvalidator.RegexMatches(regexp.MustCompile(`^[A-Za-z0-9][A-Za-z0-9._-]*$`), "must start with a letter or digit and hold only letters, digits, '.', '_' and '-'")},
					},
					"requirements": schema.ListAttribute{
						Required: true, ElementType: types.StringType,
						MarkdownDescription: "Requirements to install: names with version specifiers from the template's " +
							"package index (`pandas>=2.0`), never URLs or paths. 1 to 100.",
						Validators: []validator.List{listvalidator.SizeBetween(1, 100),
							listvalidator.ValueStringsAre(stringvalidator.LengthBetween(1, 256))},
					},
				}},
			},
			"release_policy": schema.StringAttribute{
				Optional: true, Computed: true, Default: stringdefault.StaticString(string(agentboxv1alpha1.ReleasePolicyDelete)),
				MarkdownDescription: "What becomes of a sandbox when its pool lease is released or expires. `Delete` (the default) " +
					"deletes it with its workspace. `Reuse` returns it to the pool: its pod is made anew, so no process, `/tmp` file, " +
					"terminal, MCP server state or variable of the holder survives, and its workspace is emptied and checked empty " +
					"before the new supervisor starts. Only the cached Python environments are kept, each only if its files still " +
					"match the seal its build recorded under a key the sandbox's commands cannot read; a changed or unsealed one is " +
					"removed, as are the installer environment and all bytecode caches. A sandbox whose reset fails, or takes more " +
					"than five minutes, is deleted with an event saying why. A holder that tampers with an environment while it is " +
					"being built is not detected: reuse only between holders that may share the environments they build.",
				Validators: []validator.String{stringvalidator.OneOf(string(agentboxv1alpha1.ReleasePolicyDelete), string(agentboxv1alpha1.ReleasePolicyReuse))},
			},
			"wait_for_ready": schema.BoolAttribute{
				Optional: true, Computed: true, Default: booldefault.StaticBool(true),
				MarkdownDescription: "Wait on create and update until the pool has `replicas` ready sandboxes, within the " +
					"`timeouts`. With `python_environments`, a sandbox is ready once they are built in it, or once their build " +
					"has failed (it serves without them; the apply then ends with a warning naming the failed environment). " +
					"Defaults to `true`. On timeout the error carries the pool's Ready condition.",
			},
			"status": schema.SingleNestedAttribute{
				Computed: true,
				MarkdownDescription: "What the control plane last reported. Refreshed on every read; it never causes a change " +
					"by itself.",
				Attributes: map[string]schema.Attribute{
					"replicas": computedInt("Unassigned sandboxes the pool has, ready or not."),
					"ready_replicas": computedInt("How many of them are ready to be adopted: running, and done with the pool's " +
						"`python_environments` (built, or their build failed)."),
					"leased_replicas": computedInt("Sandboxes of the pool leased out for an ephemeral run; not counted in `replicas`."),
				},
			},
			"timeouts": timeoutsAttribute(ctx,
				&timeoutDoc{"the create, including the wait for ready sandboxes", defaultWarmPoolWait},
				&timeoutDoc{"an update, including the wait for ready sandboxes", defaultWarmPoolWait},
				&timeoutDoc{"the destroy, which waits until the pool's sandboxes are gone", defaultWarmPoolDelete}),
		},
	}
}

func (r *warmPoolResource) Configure(_ context.Context, req resource.ConfigureRequest, resp *resource.ConfigureResponse) {
	r.data = providerDataFrom(req.ProviderData, &resp.Diagnostics)
}

// ModifyPlan plans the namespace and ID, known before apply.
func (r *warmPoolResource) ModifyPlan(ctx context.Context, req resource.ModifyPlanRequest, resp *resource.ModifyPlanResponse) {
	planObjectID(ctx, r.data, req, resp)
}

func (r *warmPoolResource) Create(ctx context.Context, req resource.CreateRequest, resp *resource.CreateResponse) {
	var plan warmPoolModel
	c := modelAndClient(ctx, r.data, req.Plan, &plan, &resp.Diagnostics)
	if c == nil {
		return
	}
	timeout, diags := plan.Timeouts.Create(ctx, defaultWarmPoolWait)
	resp.Diagnostics.Append(diags...)
	ns := resolveNamespace(plan.Namespace, r.data)
	obj := &agentboxv1alpha1.SandboxWarmPool{ObjectMeta: metav1.ObjectMeta{Name: plan.Name.ValueString(), Namespace: ns}, Spec: plan.spec()}
	if !warmPoolCR.create(ctx, c, obj, &resp.Diagnostics) {
		return
	}
	plan.ID = types.StringValue(objectID(ns, obj.Name))
	plan.Namespace = types.StringValue(ns)
	plan.setStatus(ctx, &obj.Status, &resp.Diagnostics)
	// Saved before waiting: a pool that never fills still exists and must be
	// in state so that destroy removes it.
	resp.Diagnostics.Append(resp.State.Set(ctx, &plan)...)
	r.waitAndRefresh(ctx, c, client.ObjectKeyFromObject(obj), &plan, timeout, &resp.Diagnostics)
	resp.Diagnostics.Append(resp.State.Set(ctx, &plan)...)
}

func (r *warmPoolResource) Read(ctx context.Context, req resource.ReadRequest, resp *resource.ReadResponse) {
	var state warmPoolModel
	c := modelAndClient(ctx, r.data, req.State, &state, &resp.Diagnostics)
	if c == nil {
		return
	}
	var obj agentboxv1alpha1.SandboxWarmPool
	if !warmPoolCR.read(ctx, c, objectKey(state.Namespace, state.Name), &obj, resp) {
		return
	}
	state.ID = types.StringValue(objectID(obj.Namespace, obj.Name))
	state.Template = types.StringValue(obj.Spec.TemplateRef.Name)
	state.Replicas = types.Int64Value(int64(obj.Spec.Replicas))
	state.ColdStart = types.BoolValue(obj.Spec.ColdStartWhenExhausted)
	state.PythonEnvs = warmPoolEnvsOf(obj.Spec.PythonEnvironments)
	state.Release = types.StringValue(string(releasePolicyOrDefault(obj.Spec.ReleasePolicy)))
	state.setStatus(ctx, &obj.Status, &resp.Diagnostics)
	defaultWaitForReady(&state.WaitForReady)
	resp.Diagnostics.Append(resp.State.Set(ctx, &state)...)
}

func (r *warmPoolResource) Update(ctx context.Context, req resource.UpdateRequest, resp *resource.UpdateResponse) {
	var plan warmPoolModel
	c := modelAndClient(ctx, r.data, req.Plan, &plan, &resp.Diagnostics)
	if c == nil {
		return
	}
	timeout, diags := plan.Timeouts.Update(ctx, defaultWarmPoolWait)
	resp.Diagnostics.Append(diags...)
	key := objectKey(plan.Namespace, plan.Name)
	var obj agentboxv1alpha1.SandboxWarmPool
	// The controller writes only status, but a scaler may write
	// spec.replicas at any time.
	if !updateObject(ctx, warmPoolCR, c, key, &obj, func() { obj.Spec = plan.spec() }, &resp.Diagnostics) {
		return
	}
	plan.setStatus(ctx, &obj.Status, &resp.Diagnostics)
	resp.Diagnostics.Append(resp.State.Set(ctx, &plan)...)
	r.waitAndRefresh(ctx, c, key, &plan, timeout, &resp.Diagnostics)
	resp.Diagnostics.Append(resp.State.Set(ctx, &plan)...)
}

func (r *warmPoolResource) Delete(ctx context.Context, req resource.DeleteRequest, resp *resource.DeleteResponse) {
	var state warmPoolModel
	c := modelAndClient(ctx, r.data, req.State, &state, &resp.Diagnostics)
	if c == nil {
		return
	}
	timeout, diags := state.Timeouts.Delete(ctx, defaultWarmPoolDelete)
	resp.Diagnostics.Append(diags...)
	obj := &agentboxv1alpha1.SandboxWarmPool{ObjectMeta: namedObjectMeta(state.Namespace, state.Name)}
	warmPoolCR.delete(ctx, c, obj, timeout, &resp.Diagnostics)
}

func (r *warmPoolResource) ImportState(ctx context.Context, req resource.ImportStateRequest, resp *resource.ImportStateResponse) {
	importObject(ctx, r.data, req, resp)
}

// waitAndRefresh waits, if asked to, until the pool is full, and takes the
// status it ends with.
func (r *warmPoolResource) waitAndRefresh(ctx context.Context, c client.Client, key k8stypes.NamespacedName, m *warmPoolModel,
	timeout time.Duration, diags *diag.Diagnostics) {
	if !m.WaitForReady.ValueBool() {
		return
	}
	var pool agentboxv1alpha1.SandboxWarmPool
	waitReady(ctx, warmPoolCR, c, key, &pool, timeout, func() (bool, string) {
		// A status older than the spec may count replicas the pool no
		// longer wants.
		current := pool.Status.ObservedGeneration >= pool.Generation
		progress := fmt.Sprintf("%d of %d ready (observed generation %d of %d); %s", pool.Status.ReadyReplicas, pool.Spec.Replicas,
			pool.Status.ObservedGeneration, pool.Generation, readyConditionText(pool.Status.Conditions, agentboxv1alpha1.ConditionReady))
		return current && pool.Status.ReadyReplicas >= pool.Spec.Replicas, progress
	}, func() { m.setStatus(ctx, &pool.Status, diags) }, diags)
	if summary, detail, failed := prewarmFailure(&pool); failed && !diags.HasError() {
		diags.AddWarning(summary, detail)
	}
}

// prewarmFailure describes a pool whose python_environments failed to
// build in some warm sandboxes. Those count as ready (they serve, without
// the environments), so the wait ends; the apply says what is broken.
func prewarmFailure(pool *agentboxv1alpha1.SandboxWarmPool) (summary, detail string, failed bool) {
	c := apimeta.FindStatusCondition(pool.Status.Conditions, agentboxv1alpha1.ConditionPythonEnvironmentsReady)
	if c == nil || c.Reason != agentboxv1alpha1.ReasonPrewarmFailed || c.ObservedGeneration < pool.Generation {
		return "", "", false
	}
	return fmt.Sprintf("Warm pool %s/%s: python_environments failed to build", pool.Namespace, pool.Name),
		c.Message + "\n\nThe pool is ready: its sandboxes serve without the failed environment, and an execute that " +
			"asks for it builds it then. Fix the requirements (or the template's package index) and apply again.", true
}

func (m *warmPoolModel) spec() agentboxv1alpha1.SandboxWarmPoolSpec {
	return agentboxv1alpha1.SandboxWarmPoolSpec{
		TemplateRef:            agentboxv1alpha1.LocalObjectReference{Name: m.Template.ValueString()},
		Replicas:               int32(m.Replicas.ValueInt64()),
		ColdStartWhenExhausted: m.ColdStart.ValueBool(),
		PythonEnvironments:     m.pythonEnvironments(),
		ReleasePolicy:          agentboxv1alpha1.ReleasePolicy(m.Release.ValueString()),
	}
}

func (m *warmPoolModel) pythonEnvironments() []agentboxv1alpha1.WarmPythonEnvironment {
	var out []agentboxv1alpha1.WarmPythonEnvironment
	for _, e := range m.PythonEnvs {
		out = append(out, agentboxv1alpha1.WarmPythonEnvironment{Name: e.Name.ValueString(), Requirements: e.Requirements})
	}
	return out
}

// warmPoolEnvsOf is python_environments as the pool's spec holds them; nil
// (null) for none.
func warmPoolEnvsOf(envs []agentboxv1alpha1.WarmPythonEnvironment) []warmPoolEnv {
	var out []warmPoolEnv
	for _, e := range envs {
		name := types.StringNull()
		if e.Name != "" {
			name = types.StringValue(e.Name)
		}
		out = append(out, warmPoolEnv{Name: name, Requirements: e.Requirements})
	}
	return out
}

// releasePolicyOrDefault is the policy the cluster applies: an object
// written before the field existed has none, which means Delete.
func releasePolicyOrDefault(p agentboxv1alpha1.ReleasePolicy) agentboxv1alpha1.ReleasePolicy {
	if p == "" {
		return agentboxv1alpha1.ReleasePolicyDelete
	}
	return p
}

func (m *warmPoolModel) setStatus(ctx context.Context, s *agentboxv1alpha1.SandboxWarmPoolStatus, diags *diag.Diagnostics) {
	m.Status = objectValue(ctx, warmPoolStatusAttrTypes, warmPoolStatusModel{
		Replicas:       types.Int64Value(int64(s.Replicas)),
		ReadyReplicas:  types.Int64Value(int64(s.ReadyReplicas)),
		LeasedReplicas: types.Int64Value(int64(s.LeasedReplicas)),
	}, diags)
}
