package provider

import (
	"context"
	"errors"
	"fmt"
	"time"

	"github.com/hashicorp/terraform-plugin-framework-timeouts/resource/timeouts"
	"github.com/hashicorp/terraform-plugin-framework/resource"
	"github.com/hashicorp/terraform-plugin-framework/resource/schema"
	"github.com/hashicorp/terraform-plugin-framework/resource/schema/booldefault"
	"github.com/hashicorp/terraform-plugin-framework/resource/schema/planmodifier"
	"github.com/hashicorp/terraform-plugin-framework/resource/schema/stringplanmodifier"
	"github.com/hashicorp/terraform-plugin-framework/schema/validator"
	"github.com/hashicorp/terraform-plugin-framework/types"
	"github.com/hashicorp/terraform-plugin-log/tflog"
	apimeta "k8s.io/apimachinery/pkg/api/meta"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	k8stypes "k8s.io/apimachinery/pkg/types"
	"k8s.io/apimachinery/pkg/util/wait"
	"sigs.k8s.io/controller-runtime/pkg/client"

	agentboxv1alpha1 "github.com/agentbox/terraform-provider-agentbox/internal/api/v1alpha1"
)

var (
	_ resource.Resource                = (*sandboxResource)(nil)
	_ resource.ResourceWithConfigure   = (*sandboxResource)(nil)
	_ resource.ResourceWithImportState = (*sandboxResource)(nil)
	_ resource.ResourceWithModifyPlan  = (*sandboxResource)(nil)
)

// NewSandboxResource manages one agent's Sandbox.
func NewSandboxResource() resource.Resource { return &sandboxResource{} }

type sandboxResource struct{ data *providerData }

type sandboxModel struct {
	sandboxObjectModel
	WaitForReady types.Bool     `tfsdk:"wait_for_ready"`
	Timeouts     timeouts.Value `tfsdk:"timeouts"`
}

// sandboxObjectModel holds the attributes that describe the Sandbox object,
// which the agentbox_sandbox data source reads too.
type sandboxObjectModel struct {
	ID          types.String `tfsdk:"id"`
	Name        types.String `tfsdk:"name"`
	Namespace   types.String `tfsdk:"namespace"`
	AgentID     types.String `tfsdk:"agent_id"`
	Template    types.String `tfsdk:"template"`
	IdleTimeout types.String `tfsdk:"idle_timeout"`
	Ephemeral   types.Bool   `tfsdk:"ephemeral"`
}

const (
	sandboxKind          = "Sandbox"
	sandboxTFType        = "sandbox"
	defaultCreateTimeout = 10 * time.Minute
	defaultDeleteTimeout = 5 * time.Minute
)

// sandboxCR deletes in the foreground: the pod and volume go before the
// Sandbox does, so a finished destroy means the agent's compute is really
// gone.
var sandboxCR = crKind{kind: sandboxKind, tfType: sandboxTFType, foregroundDelete: true}

func (r *sandboxResource) Metadata(_ context.Context, req resource.MetadataRequest, resp *resource.MetadataResponse) {
	resp.TypeName = req.ProviderTypeName + "_" + sandboxTFType
}

func (r *sandboxResource) Schema(ctx context.Context, _ resource.SchemaRequest, resp *resource.SchemaResponse) {
	resp.Schema = schema.Schema{
		MarkdownDescription: "One agent's sandbox: a gVisor pod running the agentbox supervisor, with its workspace volume. " +
			"It becomes a `Sandbox` object that the platform's controller turns into the pod, the volume and the activity " +
			"lease, stops to a snapshot when idle and resumes on the next Compute API call. Requires `agentbox_platform`.",
		Attributes: map[string]schema.Attribute{
			"id":        idAttribute(sandboxKind),
			"name":      nameAttribute(sandboxKind),
			"namespace": namespaceAttribute(sandboxKind),
			"agent_id": schema.StringAttribute{
				Required: true,
				MarkdownDescription: "The agent that owns the sandbox; the Compute API routes the agent's calls here. " +
					"Must be " + agentIDCheck.description + ". Changing it replaces the sandbox. An agent has one sandbox: " +
					"if another Sandbox with this agent ID exists already, in any namespace, the control plane refuses this one " +
					"(phase `Error`, reason `DuplicateAgent`, no pod) until that one is deleted.",
				PlanModifiers: []planmodifier.String{stringplanmodifier.RequiresReplace()},
				Validators:    []validator.String{agentIDCheck},
			},
			"template": schema.StringAttribute{
				Required:            true,
				MarkdownDescription: "Name of the `agentbox_sandbox_template` (same namespace) the sandbox runs. Changing it replaces the sandbox.",
				PlanModifiers:       []planmodifier.String{stringplanmodifier.RequiresReplace()},
				Validators:          []validator.String{dnsSubdomainCheck},
			},
			"idle_timeout": schema.StringAttribute{
				Optional:            true,
				MarkdownDescription: "Overrides the template's idle timeout for this sandbox: " + durationCheck.description + ".",
				Validators:          []validator.String{durationCheck},
			},
			"ephemeral": schema.BoolAttribute{
				Optional: true, Computed: true, Default: booldefault.StaticBool(false),
				MarkdownDescription: "An ephemeral sandbox keeps no state: it is destroyed and replaced after each lease instead of snapshotted. Defaults to `false`.",
			},
			"wait_for_ready": schema.BoolAttribute{
				Optional: true, Computed: true, Default: booldefault.StaticBool(true),
				MarkdownDescription: "Wait on create until the sandbox is Running (its pod Ready). Defaults to `true`. " +
					"If the sandbox fails instead, the error carries the controller's reason, e.g. an image that cannot be pulled " +
					"or `DuplicateAgent`.",
			},
			"timeouts": timeouts.Attributes(ctx, timeouts.Opts{Create: true, Delete: true}),
		},
	}
}

func (r *sandboxResource) Configure(_ context.Context, req resource.ConfigureRequest, resp *resource.ConfigureResponse) {
	r.data = providerDataFrom(req.ProviderData, &resp.Diagnostics)
}

// ModifyPlan plans the namespace and ID, known before apply.
func (r *sandboxResource) ModifyPlan(ctx context.Context, req resource.ModifyPlanRequest, resp *resource.ModifyPlanResponse) {
	planObjectID(ctx, r.data, req, resp)
}

func (r *sandboxResource) Create(ctx context.Context, req resource.CreateRequest, resp *resource.CreateResponse) {
	var plan sandboxModel
	c := modelAndClient(ctx, r.data, req.Plan, &plan, &resp.Diagnostics)
	if c == nil {
		return
	}
	timeout, diags := plan.Timeouts.Create(ctx, defaultCreateTimeout)
	resp.Diagnostics.Append(diags...)
	ns := resolveNamespace(plan.Namespace, r.data)
	obj := &agentboxv1alpha1.Sandbox{ObjectMeta: metav1.ObjectMeta{Name: plan.Name.ValueString(), Namespace: ns}}
	obj.Spec = plan.spec(&resp.Diagnostics)
	if resp.Diagnostics.HasError() || !sandboxCR.create(ctx, c, obj, &resp.Diagnostics) {
		return
	}
	plan.ID = types.StringValue(objectID(ns, obj.Name))
	plan.Namespace = types.StringValue(ns)
	// Save before waiting: a sandbox that never becomes ready still exists
	// and must be in state so that destroy removes it.
	resp.Diagnostics.Append(resp.State.Set(ctx, &plan)...)
	if plan.WaitForReady.ValueBool() {
		key := client.ObjectKeyFromObject(obj)
		if err := waitSandboxRunning(ctx, c, key, timeout); err != nil {
			resp.Diagnostics.AddError(fmt.Sprintf("%s %s did not become ready", sandboxKind, key), err.Error())
		}
	}
}

func (r *sandboxResource) Read(ctx context.Context, req resource.ReadRequest, resp *resource.ReadResponse) {
	var state sandboxModel
	c := modelAndClient(ctx, r.data, req.State, &state, &resp.Diagnostics)
	if c == nil {
		return
	}
	var obj agentboxv1alpha1.Sandbox
	if !sandboxCR.read(ctx, c, objectKey(state.Namespace, state.Name), &obj, resp) {
		return
	}
	state.ID = types.StringValue(objectID(obj.Namespace, obj.Name))
	state.fromSpec(&obj.Spec)
	defaultWaitForReady(&state.WaitForReady)
	resp.Diagnostics.Append(resp.State.Set(ctx, &state)...)
}

func (r *sandboxResource) Update(ctx context.Context, req resource.UpdateRequest, resp *resource.UpdateResponse) {
	var plan sandboxModel
	c := modelAndClient(ctx, r.data, req.Plan, &plan, &resp.Diagnostics)
	if c == nil {
		return
	}
	key := objectKey(plan.Namespace, plan.Name)
	spec := plan.spec(&resp.Diagnostics)
	if resp.Diagnostics.HasError() {
		return
	}
	var obj agentboxv1alpha1.Sandbox
	if !updateObject(ctx, sandboxCR, c, key, &obj, func() {
		obj.Spec.IdleTimeout = spec.IdleTimeout
		obj.Spec.Ephemeral = spec.Ephemeral
	}, &resp.Diagnostics) {
		return
	}
	resp.Diagnostics.Append(resp.State.Set(ctx, &plan)...)
}

func (r *sandboxResource) Delete(ctx context.Context, req resource.DeleteRequest, resp *resource.DeleteResponse) {
	var state sandboxModel
	c := modelAndClient(ctx, r.data, req.State, &state, &resp.Diagnostics)
	if c == nil {
		return
	}
	timeout, diags := state.Timeouts.Delete(ctx, defaultDeleteTimeout)
	resp.Diagnostics.Append(diags...)
	obj := &agentboxv1alpha1.Sandbox{ObjectMeta: namedObjectMeta(state.Namespace, state.Name)}
	sandboxCR.delete(ctx, c, obj, timeout, &resp.Diagnostics)
}

func (r *sandboxResource) ImportState(ctx context.Context, req resource.ImportStateRequest, resp *resource.ImportStateResponse) {
	importObject(ctx, r.data, req, resp)
}

func (m *sandboxObjectModel) spec(diags interface{ AddError(string, string) }) agentboxv1alpha1.SandboxSpec {
	s := agentboxv1alpha1.SandboxSpec{
		AgentID:     m.AgentID.ValueString(),
		TemplateRef: agentboxv1alpha1.LocalObjectReference{Name: m.Template.ValueString()},
		Ephemeral:   m.Ephemeral.ValueBool(),
	}
	if !m.IdleTimeout.IsNull() && !m.IdleTimeout.IsUnknown() {
		d, err := time.ParseDuration(m.IdleTimeout.ValueString())
		if err != nil {
			diags.AddError("Invalid idle_timeout", err.Error())
		}
		s.IdleTimeout = &metav1.Duration{Duration: d}
	}
	return s
}

// fromSpec sets the attributes from the live spec, keeping the prior
// spelling of an equal idle timeout (see keepDuration).
func (m *sandboxObjectModel) fromSpec(s *agentboxv1alpha1.SandboxSpec) {
	m.AgentID = types.StringValue(s.AgentID)
	m.Template = types.StringValue(s.TemplateRef.Name)
	m.Ephemeral = types.BoolValue(s.Ephemeral)
	if s.IdleTimeout == nil {
		m.IdleTimeout = types.StringNull()
	} else {
		m.IdleTimeout = keepDuration(m.IdleTimeout, s.IdleTimeout.Duration)
	}
}

// errSandboxFailed stops the wait early: the controller has said why the
// sandbox cannot run, and waiting longer would only hide it.
var errSandboxFailed = errors.New("sandbox failed")

// waitSandboxRunning polls the Sandbox until the controller reports it
// Running, and logs each change of its Ready condition so `TF_LOG=info`
// shows progress.
func waitSandboxRunning(ctx context.Context, c client.Client, key k8stypes.NamespacedName, timeout time.Duration) error {
	var last string
	var lastErr error
	err := wait.PollUntilContextTimeout(ctx, 500*time.Millisecond, timeout, true, func(ctx context.Context) (bool, error) {
		var sb agentboxv1alpha1.Sandbox
		if err := c.Get(ctx, key, &sb); err != nil {
			lastErr = err
			return false, ignoreTransient(err)
		}
		ready := apimeta.FindStatusCondition(sb.Status.Conditions, agentboxv1alpha1.ConditionReady)
		status := string(sb.Status.Phase)
		if ready != nil {
			status = fmt.Sprintf("%s (%s: %s)", sb.Status.Phase, ready.Reason, ready.Message)
		}
		if status != last {
			tflog.Info(ctx, "sandbox status", map[string]any{"sandbox": key.String(), "status": status})
			last = status
		}
		switch {
		case sb.Status.Phase == agentboxv1alpha1.SandboxPhaseRunning && ready != nil && ready.Status == metav1.ConditionTrue:
			return true, nil
		case sb.Status.Phase == agentboxv1alpha1.SandboxPhaseError:
			return false, fmt.Errorf("%w: %s", errSandboxFailed, status)
		}
		return false, nil
	})
	if err != nil && !errors.Is(err, errSandboxFailed) {
		if last == "" {
			last = "no status yet: is the agentbox control plane running?"
		}
		if lastErr != nil {
			last += fmt.Sprintf("; last error: %v", lastErr)
		}
		return fmt.Errorf("still not Running after %s; last status: %s", timeout, last)
	}
	return err
}
