package provider

import (
	"context"
	"fmt"
	"strings"
	"time"

	"github.com/hashicorp/terraform-plugin-framework-timeouts/resource/timeouts"
	"github.com/hashicorp/terraform-plugin-framework-validators/mapvalidator"
	"github.com/hashicorp/terraform-plugin-framework-validators/stringvalidator"
	"github.com/hashicorp/terraform-plugin-framework/attr"
	"github.com/hashicorp/terraform-plugin-framework/diag"
	"github.com/hashicorp/terraform-plugin-framework/path"
	"github.com/hashicorp/terraform-plugin-framework/resource"
	"github.com/hashicorp/terraform-plugin-framework/resource/schema"
	"github.com/hashicorp/terraform-plugin-framework/resource/schema/booldefault"
	"github.com/hashicorp/terraform-plugin-framework/resource/schema/planmodifier"
	"github.com/hashicorp/terraform-plugin-framework/resource/schema/stringdefault"
	"github.com/hashicorp/terraform-plugin-framework/resource/schema/stringplanmodifier"
	"github.com/hashicorp/terraform-plugin-framework/schema/validator"
	"github.com/hashicorp/terraform-plugin-framework/types"
	corev1 "k8s.io/api/core/v1"
	apimeta "k8s.io/apimachinery/pkg/api/meta"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	k8stypes "k8s.io/apimachinery/pkg/types"
	"sigs.k8s.io/controller-runtime/pkg/client"

	agentboxv1alpha1 "github.com/agentbox/terraform-provider-agentbox/internal/api/v1alpha1"
)

var (
	_ resource.Resource                   = (*nodePoolResource)(nil)
	_ resource.ResourceWithConfigure      = (*nodePoolResource)(nil)
	_ resource.ResourceWithImportState    = (*nodePoolResource)(nil)
	_ resource.ResourceWithModifyPlan     = (*nodePoolResource)(nil)
	_ resource.ResourceWithValidateConfig = (*nodePoolResource)(nil)
)

// NewNodePoolResource manages a GVisorNodePool.
func NewNodePoolResource() resource.Resource { return &nodePoolResource{} }

type nodePoolResource struct{ data *providerData }

type nodePoolModel struct {
	nodePoolObjectModel
	WaitForReady types.Bool     `tfsdk:"wait_for_ready"`
	Status       types.Object   `tfsdk:"status"`
	Timeouts     timeouts.Value `tfsdk:"timeouts"`
}

// nodePoolObjectModel holds the attributes that describe the GVisorNodePool
// object, which the agentbox_node_pool data source reads too.
type nodePoolObjectModel struct {
	ID               types.String `tfsdk:"id"`
	Name             types.String `tfsdk:"name"`
	Mode             types.String `tfsdk:"mode"`
	RuntimeClassName types.String `tfsdk:"runtime_class_name"`
	NodeSelector     types.Map    `tfsdk:"node_selector"`
	Tolerations      types.List   `tfsdk:"tolerations"`
	Taint            types.Object `tfsdk:"taint"`
	Overhead         types.Map    `tfsdk:"overhead"`
}

type taintModel struct {
	Key    types.String `tfsdk:"key"`
	Value  types.String `tfsdk:"value"`
	Effect types.String `tfsdk:"effect"`
}

type nodePoolStatusModel struct {
	Nodes      types.List  `tfsdk:"nodes"`
	ReadyNodes types.Int64 `tfsdk:"ready_nodes"`
}

const (
	nodePoolKind          = "GVisorNodePool"
	nodePoolTFType        = "node_pool"
	defaultNodePoolWait   = 15 * time.Minute
	defaultNodePoolDelete = 5 * time.Minute
)

// nodePoolCR waits on destroy for the controller's finalizer, which takes
// the pool's labels and taint off the nodes, so that a finished destroy
// leaves the nodes clean.
var nodePoolCR = crKind{
	kind: nodePoolKind, tfType: nodePoolTFType, clusterScoped: true,
	deleteTimeoutHint: "\n\nIf the platform was uninstalled first, nothing removes the pool's finalizer " + agentboxv1alpha1.Finalizer + ".",
}

// nodePoolMode is one value of `mode`: the validator, the attribute's
// documentation and the configuration checks all come from this list.
type nodePoolMode struct {
	name                 agentboxv1alpha1.GVisorNodePoolMode
	description          string
	requiresNodeSelector bool
	usesTaint            bool
}

var nodePoolModes = []nodePoolMode{
	{
		name: agentboxv1alpha1.GVisorNodePoolModeManaged, requiresNodeSelector: true, usesTaint: true,
		description: "the platform installs runsc on the selected nodes with its installer DaemonSet, labels (and, with " +
			"`taint`, taints) them, and creates the RuntimeClass with handler `runsc`. `node_selector` is required, so " +
			"that runsc is not installed on every node by accident",
	},
	{
		name: agentboxv1alpha1.GVisorNodePoolModeGKE,
		description: "GKE Sandbox already provides gVisor: the pool adopts its RuntimeClass (which must exist) and runs no " +
			"installer; `taint` is not used",
	},
}

func nodePoolModeNames() []string {
	names := make([]string, len(nodePoolModes))
	for i, m := range nodePoolModes {
		names[i] = string(m.name)
	}
	return names
}

func modesRequiringNodeSelector() []string {
	var names []string
	for _, m := range nodePoolModes {
		if m.requiresNodeSelector {
			names = append(names, string(m.name))
		}
	}
	return names
}

func modesUsingTaint() []string {
	var names []string
	for _, m := range nodePoolModes {
		if m.usesTaint {
			names = append(names, string(m.name))
		}
	}
	return names
}

func findNodePoolMode(name string) (nodePoolMode, bool) {
	for _, m := range nodePoolModes {
		if string(m.name) == name {
			return m, true
		}
	}
	return nodePoolMode{}, false
}

var (
	taintAttrTypes          = map[string]attr.Type{"key": types.StringType, "value": types.StringType, "effect": types.StringType}
	nodePoolStatusAttrTypes = map[string]attr.Type{"nodes": types.ListType{ElemType: types.StringType}, "ready_nodes": types.Int64Type}
)

func (r *nodePoolResource) Metadata(_ context.Context, req resource.MetadataRequest, resp *resource.MetadataResponse) {
	resp.TypeName = req.ProviderTypeName + "_" + nodePoolTFType
}

func (r *nodePoolResource) Schema(ctx context.Context, _ resource.SchemaRequest, resp *resource.SchemaResponse) {
	modes := make([]string, len(nodePoolModes))
	for i, m := range nodePoolModes {
		modes[i] = "`" + string(m.name) + "`: " + m.description + "."
	}
	resp.Schema = schema.Schema{
		MarkdownDescription: "A gVisor node pool: a set of nodes prepared to run sandboxes under gVisor, and the RuntimeClass " +
			"(handler `runsc`, scheduling node selector and tolerations, pod overhead) that schedules sandbox pods onto them. " +
			"It becomes a cluster-scoped `GVisorNodePool` object. Templates name it in `node_pool`. Requires `agentbox_platform`; " +
			"on destroy the platform removes its labels and taint from the nodes before the object goes.",
		Attributes: map[string]schema.Attribute{
			"id": schema.StringAttribute{
				Computed:            true,
				MarkdownDescription: "Name of the " + nodePoolKind + " (it is cluster-scoped); also the import ID.",
				PlanModifiers:       []planmodifier.String{stringplanmodifier.UseStateForUnknown()},
			},
			"name": nameAttribute(nodePoolKind),
			"mode": schema.StringAttribute{
				Required:            true,
				MarkdownDescription: "Who provides gVisor on the pool's nodes. " + strings.Join(modes, " "),
				Validators:          []validator.String{stringvalidator.OneOf(nodePoolModeNames()...)},
			},
			"runtime_class_name": schema.StringAttribute{
				Optional: true, Computed: true, Default: stringdefault.StaticString(defaultRuntimeClass),
				MarkdownDescription: "RuntimeClass that sandboxes on this pool use: created by the platform in `Managed` mode, " +
					"adopted in `GKE` mode. Must be " + dnsSubdomainCheck.description + ". Defaults to `" + defaultRuntimeClass + "`.",
				Validators: []validator.String{dnsSubdomainCheck},
			},
			"node_selector": schema.MapAttribute{
				ElementType: types.StringType, Optional: true,
				MarkdownDescription: "Node labels that select the pool's nodes; it becomes the RuntimeClass's scheduling node " +
					"selector, so sandbox pods land only on these nodes. Keys must be " + qualifiedNameCheck.description +
					"; values " + labelValueCheck.description + ". Required in " + codeList(modesRequiringNodeSelector()) + " mode.",
				Validators: []validator.Map{
					mapvalidator.KeysAre(qualifiedNameCheck),
					mapvalidator.ValueStringsAre(labelValueCheck),
				},
			},
			"tolerations": tolerationsAttribute("The RuntimeClass's scheduling tolerations, added to every sandbox pod; they should tolerate the pool's `taint`."),
			"taint": schema.SingleNestedAttribute{
				Optional: true,
				MarkdownDescription: "Taint put on the pool's nodes in " + codeList(modesUsingTaint()) + " mode to keep other pods " +
					"off them; sandbox pods tolerate it through `tolerations`.",
				Attributes: map[string]schema.Attribute{
					"key": schema.StringAttribute{
						Required: true, MarkdownDescription: "Taint key. Must be " + qualifiedNameCheck.description + ".",
						Validators: []validator.String{qualifiedNameCheck},
					},
					"value": schema.StringAttribute{
						Optional: true, MarkdownDescription: "Taint value. Must be " + labelValueCheck.description + ".",
						Validators: []validator.String{labelValueCheck},
					},
					"effect": schema.StringAttribute{
						Required: true, MarkdownDescription: "Taint effect. " + taintEffectDesc,
						Validators: []validator.String{stringvalidator.OneOf(taintEffects...)},
					},
				},
			},
			"overhead": schema.MapAttribute{
				ElementType: types.StringType, Optional: true,
				MarkdownDescription: "The RuntimeClass's pod overhead: what gVisor itself needs per pod, added to every sandbox " +
					"pod's requests, e.g. `{ cpu = \"50m\", memory = \"32Mi\" }`. Each value must be " + quantityCheck.description + ".",
				Validators: []validator.Map{mapvalidator.ValueStringsAre(quantityCheck)},
			},
			"wait_for_ready": schema.BoolAttribute{
				Optional: true, Computed: true, Default: booldefault.StaticBool(true),
				MarkdownDescription: "Wait on create and update until the platform reports the pool Ready (at least one selected " +
					"node can run gVisor pods), within the `timeouts`. Defaults to `true`. On timeout the error carries the " +
					"pool's Ready condition, e.g. no node matching the selector. A `Managed` pool on a platform installed " +
					"with the chart value `managedNodePools: false` fails at once with the reason `ManagedModeDisabled`.",
			},
			"status": schema.SingleNestedAttribute{
				Computed: true,
				MarkdownDescription: "What the control plane last reported. Refreshed on every read; it never causes a change " +
					"by itself.",
				Attributes: map[string]schema.Attribute{
					"nodes": schema.ListAttribute{
						ElementType: types.StringType, Computed: true,
						MarkdownDescription: "Names of the nodes the pool selects, sorted.",
					},
					"ready_nodes": schema.Int64Attribute{
						Computed: true, MarkdownDescription: "How many of them can run gVisor pods.",
					},
				},
			},
			"timeouts": timeoutsAttribute(ctx,
				&timeoutDoc{"the create, including the wait for ready nodes", defaultNodePoolWait},
				&timeoutDoc{"an update, including the wait for ready nodes", defaultNodePoolWait},
				&timeoutDoc{"the destroy, which waits until the platform has taken the pool's labels and taint off the nodes", defaultNodePoolDelete}),
		},
	}
}

func (r *nodePoolResource) Configure(_ context.Context, req resource.ConfigureRequest, resp *resource.ConfigureResponse) {
	r.data = providerDataFrom(req.ProviderData, &resp.Diagnostics)
}

// ValidateConfig applies the rules of nodePoolModes before plan, so a pool
// the API server would reject (Managed without a selector) fails early.
func (r *nodePoolResource) ValidateConfig(ctx context.Context, req resource.ValidateConfigRequest, resp *resource.ValidateConfigResponse) {
	var m nodePoolModel
	resp.Diagnostics.Append(req.Config.Get(ctx, &m)...)
	if resp.Diagnostics.HasError() || m.Mode.IsUnknown() || m.Mode.IsNull() {
		return
	}
	mode, ok := findNodePoolMode(m.Mode.ValueString())
	if !ok {
		return // the attribute's validator reports it
	}
	if mode.requiresNodeSelector && !m.NodeSelector.IsUnknown() && len(m.NodeSelector.Elements()) == 0 {
		resp.Diagnostics.AddAttributeError(path.Root("node_selector"), "Missing node_selector",
			fmt.Sprintf("mode %q installs runsc on the nodes that node_selector selects: set it to labels of the nodes meant "+
				"for sandboxes, so that runsc is not installed on every node by accident.", mode.name))
	}
	if !mode.usesTaint && !m.Taint.IsNull() && !m.Taint.IsUnknown() {
		resp.Diagnostics.AddAttributeWarning(path.Root("taint"), "taint is not used",
			fmt.Sprintf("mode %q does not taint nodes; only %s mode does.", mode.name, codeList(modesUsingTaint())))
	}
}

// ModifyPlan plans the ID, which is the name.
func (r *nodePoolResource) ModifyPlan(ctx context.Context, req resource.ModifyPlanRequest, resp *resource.ModifyPlanResponse) {
	if req.Plan.Raw.IsNull() {
		return
	}
	var name types.String
	resp.Diagnostics.Append(req.Plan.GetAttribute(ctx, path.Root("name"), &name)...)
	if !resp.Diagnostics.HasError() && !name.IsUnknown() {
		resp.Diagnostics.Append(resp.Plan.SetAttribute(ctx, path.Root("id"), name)...)
	}
}

func (r *nodePoolResource) Create(ctx context.Context, req resource.CreateRequest, resp *resource.CreateResponse) {
	var plan nodePoolModel
	c := modelAndClient(ctx, r.data, req.Plan, &plan, &resp.Diagnostics)
	if c == nil {
		return
	}
	timeout, diags := plan.Timeouts.Create(ctx, defaultNodePoolWait)
	resp.Diagnostics.Append(diags...)
	obj := &agentboxv1alpha1.GVisorNodePool{ObjectMeta: metav1.ObjectMeta{Name: plan.Name.ValueString()}}
	obj.Spec = plan.spec(ctx, &resp.Diagnostics)
	if resp.Diagnostics.HasError() || !nodePoolCR.create(ctx, c, obj, &resp.Diagnostics) {
		return
	}
	plan.ID = types.StringValue(obj.Name)
	plan.setStatus(ctx, &obj.Status, &resp.Diagnostics)
	// Saved before waiting: a pool that never becomes ready still exists
	// and must be in state so that destroy removes it.
	resp.Diagnostics.Append(resp.State.Set(ctx, &plan)...)
	r.waitAndRefresh(ctx, c, client.ObjectKeyFromObject(obj), &plan, timeout, &resp.Diagnostics)
	resp.Diagnostics.Append(resp.State.Set(ctx, &plan)...)
}

func (r *nodePoolResource) Read(ctx context.Context, req resource.ReadRequest, resp *resource.ReadResponse) {
	var state nodePoolModel
	c := modelAndClient(ctx, r.data, req.State, &state, &resp.Diagnostics)
	if c == nil {
		return
	}
	var obj agentboxv1alpha1.GVisorNodePool
	if !nodePoolCR.read(ctx, c, k8stypes.NamespacedName{Name: state.Name.ValueString()}, &obj, resp) {
		return
	}
	state.ID = types.StringValue(obj.Name)
	state.fromSpec(ctx, &obj.Spec, &resp.Diagnostics)
	state.setStatus(ctx, &obj.Status, &resp.Diagnostics)
	defaultWaitForReady(&state.WaitForReady)
	resp.Diagnostics.Append(resp.State.Set(ctx, &state)...)
}

func (r *nodePoolResource) Update(ctx context.Context, req resource.UpdateRequest, resp *resource.UpdateResponse) {
	var plan nodePoolModel
	c := modelAndClient(ctx, r.data, req.Plan, &plan, &resp.Diagnostics)
	if c == nil {
		return
	}
	timeout, diags := plan.Timeouts.Update(ctx, defaultNodePoolWait)
	resp.Diagnostics.Append(diags...)
	spec := plan.spec(ctx, &resp.Diagnostics)
	if resp.Diagnostics.HasError() {
		return
	}
	key := k8stypes.NamespacedName{Name: plan.Name.ValueString()}
	var obj agentboxv1alpha1.GVisorNodePool
	// The whole spec is Terraform's: replacing it undoes out-of-band edits.
	// The controller adds a finalizer, hence the retry on conflict.
	if !updateObject(ctx, nodePoolCR, c, key, &obj, func() { obj.Spec = spec }, &resp.Diagnostics) {
		return
	}
	plan.setStatus(ctx, &obj.Status, &resp.Diagnostics)
	resp.Diagnostics.Append(resp.State.Set(ctx, &plan)...)
	r.waitAndRefresh(ctx, c, key, &plan, timeout, &resp.Diagnostics)
	resp.Diagnostics.Append(resp.State.Set(ctx, &plan)...)
}

func (r *nodePoolResource) Delete(ctx context.Context, req resource.DeleteRequest, resp *resource.DeleteResponse) {
	var state nodePoolModel
	c := modelAndClient(ctx, r.data, req.State, &state, &resp.Diagnostics)
	if c == nil {
		return
	}
	timeout, diags := state.Timeouts.Delete(ctx, defaultNodePoolDelete)
	resp.Diagnostics.Append(diags...)
	obj := &agentboxv1alpha1.GVisorNodePool{ObjectMeta: metav1.ObjectMeta{Name: state.Name.ValueString()}}
	nodePoolCR.delete(ctx, c, obj, timeout, &resp.Diagnostics)
}

func (r *nodePoolResource) ImportState(ctx context.Context, req resource.ImportStateRequest, resp *resource.ImportStateResponse) {
	if req.ID == "" || strings.Contains(req.ID, "/") {
		resp.Diagnostics.AddError("Invalid import ID",
			fmt.Sprintf("import ID %q is not a node pool name: %s objects are cluster-scoped, so the ID is the name alone.", req.ID, nodePoolKind))
		return
	}
	resp.Diagnostics.Append(resp.State.SetAttribute(ctx, path.Root("id"), req.ID)...)
	resp.Diagnostics.Append(resp.State.SetAttribute(ctx, path.Root("name"), req.ID)...)
}

// waitAndRefresh waits, if asked to, until the controller reports the
// current spec Ready, and takes the status it ends with.
func (r *nodePoolResource) waitAndRefresh(ctx context.Context, c client.Client, key k8stypes.NamespacedName, m *nodePoolModel,
	timeout time.Duration, diags *diag.Diagnostics) {
	if !m.WaitForReady.ValueBool() {
		return
	}
	var pool agentboxv1alpha1.GVisorNodePool
	var refused *metav1.Condition
	waitReady(ctx, nodePoolCR, c, key, &pool, timeout, func() (bool, string) {
		cond := apimeta.FindStatusCondition(pool.Status.Conditions, agentboxv1alpha1.ConditionReady)
		// A condition about an older spec says nothing about this one.
		current := cond != nil && cond.ObservedGeneration >= pool.Generation
		progress := fmt.Sprintf("%d of %d selected nodes ready; %s", pool.Status.ReadyNodes, len(pool.Status.Nodes),
			readyConditionText(pool.Status.Conditions, agentboxv1alpha1.ConditionReady))
		if current && cond.Status == metav1.ConditionFalse && cond.Reason == agentboxv1alpha1.ReasonManagedModeDisabled {
			// Only a change of the platform lifts this refusal: waiting
			// out the timeout would change nothing.
			refused = cond.DeepCopy()
			return true, progress
		}
		return current && cond.Status == metav1.ConditionTrue, progress
	}, func() { m.setStatus(ctx, &pool.Status, diags) }, diags)
	if refused != nil {
		diags.AddError(fmt.Sprintf("%s %s is refused by the platform", nodePoolKind, key.Name),
			fmt.Sprintf("Ready=False, reason %s: %s. The chart value is set in agentbox_platform's `values`.", refused.Reason, refused.Message))
	}
}

func (m *nodePoolObjectModel) spec(ctx context.Context, diags *diag.Diagnostics) agentboxv1alpha1.GVisorNodePoolSpec {
	s := agentboxv1alpha1.GVisorNodePoolSpec{
		Mode:             agentboxv1alpha1.GVisorNodePoolMode(m.Mode.ValueString()),
		RuntimeClassName: m.RuntimeClassName.ValueString(),
		NodeSelector:     goMap(ctx, m.NodeSelector, diags),
		Overhead:         resourceList(goMap(ctx, m.Overhead, diags), "overhead", diags),
	}
	s.Tolerations = tolerationsSpec(ctx, m.Tolerations, diags)
	if !m.Taint.IsNull() && !m.Taint.IsUnknown() {
		var tm taintModel
		diags.Append(m.Taint.As(ctx, &tm, objectAsOptions)...)
		s.Taint = &corev1.Taint{Key: tm.Key.ValueString(), Value: tm.Value.ValueString(), Effect: corev1.TaintEffect(tm.Effect.ValueString())}
	}
	return s
}

// fromSpec sets the attributes from the live spec, keeping the prior
// spelling of equal quantities (see keepQuantity).
func (m *nodePoolObjectModel) fromSpec(ctx context.Context, s *agentboxv1alpha1.GVisorNodePoolSpec, diags *diag.Diagnostics) {
	m.Mode = types.StringValue(string(s.Mode))
	rc := s.RuntimeClassName
	if rc == "" {
		rc = defaultRuntimeClass
	}
	m.RuntimeClassName = types.StringValue(rc)
	m.NodeSelector = mapValue(ctx, m.NodeSelector, s.NodeSelector, diags)
	m.Overhead = quantityMap(ctx, m.Overhead, s.Overhead, diags)

	m.Tolerations = tolerationsValue(ctx, m.Tolerations, s.Tolerations, diags)

	if s.Taint == nil {
		m.Taint = types.ObjectNull(taintAttrTypes)
	} else {
		m.Taint = objectValue(ctx, taintAttrTypes, taintModel{
			Key: types.StringValue(s.Taint.Key), Value: stringOrNull(s.Taint.Value), Effect: types.StringValue(string(s.Taint.Effect)),
		}, diags)
	}
}

func (m *nodePoolModel) setStatus(ctx context.Context, s *agentboxv1alpha1.GVisorNodePoolStatus, diags *diag.Diagnostics) {
	m.Status = nodePoolStatus(ctx, s, diags)
}

func nodePoolStatus(ctx context.Context, s *agentboxv1alpha1.GVisorNodePoolStatus, diags *diag.Diagnostics) types.Object {
	nodes := s.Nodes
	if nodes == nil {
		nodes = []string{}
	}
	list, d := types.ListValueFrom(ctx, types.StringType, nodes)
	diags.Append(d...)
	return objectValue(ctx, nodePoolStatusAttrTypes, nodePoolStatusModel{Nodes: list, ReadyNodes: types.Int64Value(int64(s.ReadyNodes))}, diags)
}
