package provider

import (
	"context"
	"fmt"
	"math"
	"strings"
	"time"

	"github.com/hashicorp/terraform-plugin-framework-timeouts/resource/timeouts"
	"github.com/hashicorp/terraform-plugin-framework-validators/int64validator"
	"github.com/hashicorp/terraform-plugin-framework-validators/listvalidator"
	"github.com/hashicorp/terraform-plugin-framework-validators/stringvalidator"
	"github.com/hashicorp/terraform-plugin-framework/attr"
	"github.com/hashicorp/terraform-plugin-framework/diag"
	"github.com/hashicorp/terraform-plugin-framework/path"
	"github.com/hashicorp/terraform-plugin-framework/resource"
	"github.com/hashicorp/terraform-plugin-framework/resource/schema"
	"github.com/hashicorp/terraform-plugin-framework/resource/schema/booldefault"
	"github.com/hashicorp/terraform-plugin-framework/resource/schema/int64default"
	"github.com/hashicorp/terraform-plugin-framework/resource/schema/stringdefault"
	"github.com/hashicorp/terraform-plugin-framework/schema/validator"
	"github.com/hashicorp/terraform-plugin-framework/types"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"

	agentboxv1alpha1 "github.com/agentbox/terraform-provider-agentbox/internal/api/v1alpha1"
)

var (
	_ resource.Resource                     = (*runScheduleResource)(nil)
	_ resource.ResourceWithConfigure        = (*runScheduleResource)(nil)
	_ resource.ResourceWithImportState      = (*runScheduleResource)(nil)
	_ resource.ResourceWithModifyPlan       = (*runScheduleResource)(nil)
	_ resource.ResourceWithConfigValidators = (*runScheduleResource)(nil)
)

// NewRunScheduleResource manages a RunSchedule.
func NewRunScheduleResource() resource.Resource { return &runScheduleResource{} }

type runScheduleResource struct{ data *providerData }

type runScheduleModel struct {
	ID                      types.String   `tfsdk:"id"`
	Name                    types.String   `tfsdk:"name"`
	Namespace               types.String   `tfsdk:"namespace"`
	Schedule                types.String   `tfsdk:"schedule"`
	TimeZone                types.String   `tfsdk:"time_zone"`
	AgentID                 types.String   `tfsdk:"agent_id"`
	Pool                    types.String   `tfsdk:"pool"`
	Template                types.String   `tfsdk:"template"`
	BackoffLimit            types.Int64    `tfsdk:"backoff_limit"`
	ActiveDeadlineSeconds   types.Int64    `tfsdk:"active_deadline_seconds"`
	TTLSecondsAfterFinished types.Int64    `tfsdk:"ttl_seconds_after_finished"`
	Command                 types.List     `tfsdk:"command"`
	Env                     types.Map      `tfsdk:"env"`
	Cwd                     types.String   `tfsdk:"cwd"`
	TimeoutSeconds          types.Int64    `tfsdk:"timeout_seconds"`
	ConcurrencyPolicy       types.String   `tfsdk:"concurrency_policy"`
	StartingDeadlineSeconds types.Int64    `tfsdk:"starting_deadline_seconds"`
	SuccessfulHistoryLimit  types.Int64    `tfsdk:"successful_runs_history_limit"`
	FailedHistoryLimit      types.Int64    `tfsdk:"failed_runs_history_limit"`
	Suspend                 types.Bool     `tfsdk:"suspend"`
	Status                  types.Object   `tfsdk:"status"`
	Timeouts                timeouts.Value `tfsdk:"timeouts"`
}

type runScheduleStatusModel struct {
	LastScheduleTime  types.String `tfsdk:"last_schedule_time"`
	NextScheduleTime  types.String `tfsdk:"next_schedule_time"`
	LastRunID         types.String `tfsdk:"last_run_id"`
	LastRunStatus     types.String `tfsdk:"last_run_status"`
	LastSkippedTime   types.String `tfsdk:"last_skipped_time"`
	LastSkippedReason types.String `tfsdk:"last_skipped_reason"`
	ActiveRunIDs      types.List   `tfsdk:"active_run_ids"`
	ReadyReason       types.String `tfsdk:"ready_reason"`
}

const (
	runScheduleKind          = "RunSchedule"
	runScheduleTFType        = "run_schedule"
	defaultRunScheduleDelete = 2 * time.Minute
	// The CRD's defaults, which the plan shows.
	defaultConcurrencyPolicy      = string(agentboxv1alpha1.ConcurrencyForbid)
	defaultSuccessfulHistoryLimit = 3
	defaultFailedHistoryLimit     = 1
)

// runScheduleCR deletes without waiting on dependents: a schedule has none
// (its runs are records in the store, and live ones finish on their own).
var runScheduleCR = crKind{kind: runScheduleKind, tfType: runScheduleTFType}

var (
	runScheduleStatusAttrTypes = map[string]attr.Type{
		"last_schedule_time": types.StringType, "next_schedule_time": types.StringType, "last_run_id": types.StringType,
		"last_run_status": types.StringType, "last_skipped_time": types.StringType, "last_skipped_reason": types.StringType,
		"active_run_ids": types.ListType{ElemType: types.StringType}, "ready_reason": types.StringType,
	}
	concurrencyPolicies = []string{string(agentboxv1alpha1.ConcurrencyForbid), string(agentboxv1alpha1.ConcurrencyAllow),
		string(agentboxv1alpha1.ConcurrencyReplace)}
	// The CRD's ranges.
	runTimeoutRange      = int64validator.Between(0, math.MaxInt32)
	runBackoffLimitRange = int64validator.Between(0, 10)
	runDeadlineRange     = int64validator.AtLeast(1)
	runTTLRange          = int64validator.Between(0, math.MaxInt32)
	startingDeadlineMin  = int64validator.AtLeast(1)
	runHistoryLimitRange = int64validator.Between(0, math.MaxInt32)
)

// runScheduleTargets are the attributes that name where a schedule's runs
// go, one per run mode: exactly one is set. The schema's descriptions and
// the config validator are built from this one list.
var runScheduleTargets = []struct{ attr, what string }{
	{"agent_id", "an agent's own sandbox"},
	{"pool", "a sandbox leased from a warm pool"},
	{"template", "a sandbox made from a template for the run (a job run)"},
}

// runScheduleJobOptions are the attributes of a job run, which apply to a
// `template` target only.
var runScheduleJobOptions = []string{"backoff_limit", "active_deadline_seconds", "ttl_seconds_after_finished"}

func runScheduleTargetNames() []string {
	names := make([]string, 0, len(runScheduleTargets))
	for _, t := range runScheduleTargets {
		names = append(names, t.attr)
	}
	return names
}

// runScheduleTargetRule is the rule on the targets, as the docs and the
// error say it.
func runScheduleTargetRule() string {
	return "Exactly one of " + codeAlternatives(runScheduleTargetNames()) + " must be set"
}

// jobOptionOnly is the validator of a job option: it needs `template`.
func jobOptionOnly() validator.Int64 {
	return int64validator.AlsoRequires(path.MatchRoot("template"))
}

func (r *runScheduleResource) ConfigValidators(context.Context) []resource.ConfigValidator {
	return []resource.ConfigValidator{runScheduleTargetCheck{}}
}

// runScheduleTargetCheck refuses a configuration that sets no target or
// several, saying which it set and what each would mean.
type runScheduleTargetCheck struct{}

func (runScheduleTargetCheck) Description(ctx context.Context) string {
	return runScheduleTargetRule()
}

func (runScheduleTargetCheck) MarkdownDescription(ctx context.Context) string {
	return runScheduleTargetRule()
}

func (runScheduleTargetCheck) ValidateResource(ctx context.Context, req resource.ValidateConfigRequest, resp *resource.ValidateConfigResponse) {
	var set, choices []string
	for _, t := range runScheduleTargets {
		var v types.String
		resp.Diagnostics.Append(req.Config.GetAttribute(ctx, path.Root(t.attr), &v)...)
		if v.IsUnknown() {
			// Known at apply; the CRD's rule checks it then.
			return
		}
		if !v.IsNull() {
			set = append(set, t.attr)
		}
		choices = append(choices, fmt.Sprintf("`%s` (%s)", t.attr, t.what))
	}
	if len(set) == 1 {
		return
	}
	got := "none is set"
	if len(set) > 1 {
		got = codeList(set) + " are set"
	}
	resp.Diagnostics.AddError("Invalid run schedule target",
		fmt.Sprintf("%s: where the runs go, %s; %s.", runScheduleTargetRule(), strings.Join(choices, ", "), got))
}

func (r *runScheduleResource) Metadata(_ context.Context, req resource.MetadataRequest, resp *resource.MetadataResponse) {
	resp.TypeName = req.ProviderTypeName + "_" + runScheduleTFType
}

func (r *runScheduleResource) Schema(ctx context.Context, _ resource.SchemaRequest, resp *resource.SchemaResponse) {
	computedString := func(desc string) schema.StringAttribute {
		return schema.StringAttribute{Computed: true, MarkdownDescription: desc}
	}
	resp.Schema = schema.Schema{
		MarkdownDescription: "A run schedule: the control plane starts a run of a command at the times of a cron " +
			"schedule, through the Compute API's runs (`GET /v1/runs?schedule=<namespace>/<name>` lists them), in one of " +
			"the runs' modes: in an agent's sandbox (`agent_id`), in a sandbox leased from a warm pool (`pool`), or in a " +
			"sandbox made from a template for the run (`template`, a job run). It becomes a `RunSchedule` object. Each " +
			"due time starts at most one run, across control plane restarts and replicas. Requires `agentbox_platform` " +
			"(with its store, the default) and the agent's `agentbox_sandbox`, the `agentbox_warm_pool` or the " +
			"`agentbox_sandbox_template` in the same namespace: a schedule reaches nothing outside its namespace. " +
			"Destroying it cancels its live runs; their records stay for the platform's run retention.",
		Attributes: map[string]schema.Attribute{
			"id":        idAttribute(runScheduleKind),
			"name":      nameAttribute(runScheduleKind),
			"namespace": namespaceAttribute(runScheduleKind),
			"schedule": schema.StringAttribute{
				Required:            true,
				MarkdownDescription: "When runs start: " + cronCheck.description + ". Read in `time_zone`.",
				Validators:          []validator.String{cronCheck},
			},
			"time_zone": schema.StringAttribute{
				Optional:            true,
				MarkdownDescription: "The time zone `schedule` is read in: " + timeZoneCheck.description + ". Unset means UTC.",
				Validators:          []validator.String{timeZoneCheck},
			},
			"agent_id": schema.StringAttribute{
				Optional: true,
				MarkdownDescription: "The agent whose sandbox runs the command (run mode `agent`): " + agentIDCheck.description +
					". Its sandbox must be in the schedule's namespace; a stopped one is woken for the run. " +
					runScheduleTargetRule() + ".",
				Validators: []validator.String{agentIDCheck},
			},
			"pool": schema.StringAttribute{
				Optional: true,
				MarkdownDescription: "Name of the `agentbox_warm_pool` (same namespace) each run leases a ready sandbox from " +
					"(run mode `pool`), waiting for one if none is free; the pool recycles it once the run ends. Must be " +
					dnsSubdomainCheck.description + ". " + runScheduleTargetRule() + ".",
				Validators: []validator.String{dnsSubdomainCheck},
			},
			"template": schema.StringAttribute{
				Optional: true,
				MarkdownDescription: "Name of the `agentbox_sandbox_template` (same namespace) each run gets a sandbox made " +
					"from, for the run alone (run mode `job`), deleted once the run ends; " + codeList(runScheduleJobOptions) +
					" tune it. Must be " + dnsSubdomainCheck.description + ". " + runScheduleTargetRule() + ".",
				Validators: []validator.String{dnsSubdomainCheck},
			},
			"backoff_limit": schema.Int64Attribute{
				Optional: true,
				MarkdownDescription: "How many times a failed attempt of a job run is retried, in the same sandbox, after a " +
					"backoff that doubles from attempt to attempt. Unset means no retry. The " +
					runBackoffLimitRange.MarkdownDescription(ctx) + "; with `template` only.",
				Validators: []validator.Int64{runBackoffLimitRange, jobOptionOnly()},
			},
			"active_deadline_seconds": schema.Int64Attribute{
				Optional: true,
				MarkdownDescription: "Bounds each job run from its start, the sandbox's start and retries included: when it " +
					"passes, the run ends `timed_out`. Unset means no bound beyond `timeout_seconds` per attempt. The " +
					runDeadlineRange.MarkdownDescription(ctx) + "; with `template` only.",
				Validators: []validator.Int64{runDeadlineRange, jobOptionOnly()},
			},
			"ttl_seconds_after_finished": schema.Int64Attribute{
				Optional: true,
				MarkdownDescription: "How long a job run's record (and its artifacts) is kept after it ends, instead of the " +
					"platform's run retention; `0` removes it as soon as it ends. The history limits may delete it earlier. The " +
					runTTLRange.MarkdownDescription(ctx) + "; with `template` only.",
				Validators: []validator.Int64{runTTLRange, jobOptionOnly()},
			},
			"command": schema.ListAttribute{
				Required: true, ElementType: types.StringType,
				MarkdownDescription: "The command and its arguments, run without a shell (use `[\"sh\", \"-c\", \"...\"]` for one).",
				Validators:          []validator.List{listvalidator.SizeAtLeast(1)},
			},
			"env": schema.MapAttribute{
				Optional: true, Sensitive: true, ElementType: types.StringType,
				MarkdownDescription: "Environment variables of the command. The run records keep only their names; the " +
					"values are in the `RunSchedule` object, readable by whoever may read it.",
			},
			"cwd": schema.StringAttribute{
				Optional:            true,
				MarkdownDescription: "Working directory of the command; unset means the sandbox's workspace.",
			},
			"timeout_seconds": schema.Int64Attribute{
				Optional: true,
				MarkdownDescription: "Bounds each run; unset means the supervisor's default (60 seconds). The " +
					runTimeoutRange.MarkdownDescription(ctx) + ".",
				Validators: []validator.Int64{runTimeoutRange},
			},
			"concurrency_policy": schema.StringAttribute{
				Optional: true, Computed: true, Default: stringdefault.StaticString(defaultConcurrencyPolicy),
				MarkdownDescription: "What a due time does while a run of this schedule is still live: `Forbid` skips it " +
					"(`status.last_skipped_reason` `Forbid`), `Allow` starts another beside it, `Replace` cancels the live run " +
					"and starts the new one. One of " + codeAlternatives(concurrencyPolicies) + "; defaults to `" +
					defaultConcurrencyPolicy + "`.",
				Validators: []validator.String{stringvalidator.OneOf(concurrencyPolicies...)},
			},
			"starting_deadline_seconds": schema.Int64Attribute{
				Optional: true,
				MarkdownDescription: "How late a due time may still start its run, for times missed while the control plane " +
					"was down or the schedule suspended; a later one is skipped (`status.last_skipped_reason` " +
					"`MissedDeadline`). Unset means however late. Only the latest missed time ever starts. The " +
					startingDeadlineMin.MarkdownDescription(ctx) + ".",
				Validators: []validator.Int64{startingDeadlineMin},
			},
			"successful_runs_history_limit": schema.Int64Attribute{
				Optional: true, Computed: true, Default: int64default.StaticInt64(defaultSuccessfulHistoryLimit),
				MarkdownDescription: "How many records of succeeded runs of this schedule the store keeps; older ones are " +
					"deleted. The " + runHistoryLimitRange.MarkdownDescription(ctx) + "; defaults to `3`.",
				Validators: []validator.Int64{runHistoryLimitRange},
			},
			"failed_runs_history_limit": schema.Int64Attribute{
				Optional: true, Computed: true, Default: int64default.StaticInt64(defaultFailedHistoryLimit),
				MarkdownDescription: "How many records of this schedule's runs that did not succeed (failed, timed out, " +
					"cancelled) the store keeps; older ones are deleted. The " + runHistoryLimitRange.MarkdownDescription(ctx) +
					"; defaults to `1`.",
				Validators: []validator.Int64{runHistoryLimitRange},
			},
			"suspend": schema.BoolAttribute{
				Optional: true, Computed: true, Default: booldefault.StaticBool(false),
				MarkdownDescription: "Stop starting runs; live ones go on. Due times that pass meanwhile are missed: on " +
					"resuming, the latest starts if `starting_deadline_seconds` allows. Defaults to `false`.",
			},
			"status": schema.SingleNestedAttribute{
				Computed: true,
				MarkdownDescription: "What the control plane last reported. Refreshed on every read; it never causes a change " +
					"by itself.",
				Attributes: map[string]schema.Attribute{
					"last_schedule_time": computedString("The last due time acted on (a run started or a skip), RFC 3339."),
					"next_schedule_time": computedString("The next due time, RFC 3339; null while suspended or invalid."),
					"last_run_id":        computedString("The id of the last run started, for the Compute API's `GET /v1/runs/{id}`."),
					"last_run_status": computedString("That run's status as last seen: `queued`, `running`, `succeeded`, " +
						"`failed`, `timed_out` or `cancelled`."),
					"last_skipped_time": computedString("The last due time that started no run, RFC 3339."),
					"last_skipped_reason": computedString("Why: `Forbid` (a run was live), `MissedDeadline` (found later " +
						"than `starting_deadline_seconds`) or `Refused` (the Compute API refused the run)."),
					"active_run_ids": schema.ListAttribute{Computed: true, ElementType: types.StringType,
						MarkdownDescription: "The ids of the schedule's runs that are queued or running."},
					"ready_reason": computedString("The reason of the Ready condition: `Scheduled` when runs start at their " +
						"times, otherwise `Suspended`, `InvalidSchedule`, `InvalidTimeZone`, `RunsUnavailable`, " +
						"`NamespaceNotServed` or `ReconcileError`."),
				},
			},
			"timeouts": timeoutsAttribute(ctx, nil, nil,
				&timeoutDoc{"the destroy, which waits until the object is gone", defaultRunScheduleDelete}),
		},
	}
}

func (r *runScheduleResource) Configure(_ context.Context, req resource.ConfigureRequest, resp *resource.ConfigureResponse) {
	r.data = providerDataFrom(req.ProviderData, &resp.Diagnostics)
}

// ModifyPlan plans the namespace and ID, known before apply.
func (r *runScheduleResource) ModifyPlan(ctx context.Context, req resource.ModifyPlanRequest, resp *resource.ModifyPlanResponse) {
	planObjectID(ctx, r.data, req, resp)
}

func (r *runScheduleResource) Create(ctx context.Context, req resource.CreateRequest, resp *resource.CreateResponse) {
	var plan runScheduleModel
	c := modelAndClient(ctx, r.data, req.Plan, &plan, &resp.Diagnostics)
	if c == nil {
		return
	}
	ns := resolveNamespace(plan.Namespace, r.data)
	obj := &agentboxv1alpha1.RunSchedule{ObjectMeta: metav1.ObjectMeta{Name: plan.Name.ValueString(), Namespace: ns},
		Spec: plan.spec(ctx, &resp.Diagnostics)}
	if resp.Diagnostics.HasError() || !runScheduleCR.create(ctx, c, obj, &resp.Diagnostics) {
		return
	}
	plan.ID = types.StringValue(objectID(ns, obj.Name))
	plan.Namespace = types.StringValue(ns)
	plan.setStatus(ctx, &obj.Status, &resp.Diagnostics)
	resp.Diagnostics.Append(resp.State.Set(ctx, &plan)...)
}

func (r *runScheduleResource) Read(ctx context.Context, req resource.ReadRequest, resp *resource.ReadResponse) {
	var state runScheduleModel
	c := modelAndClient(ctx, r.data, req.State, &state, &resp.Diagnostics)
	if c == nil {
		return
	}
	var obj agentboxv1alpha1.RunSchedule
	if !runScheduleCR.read(ctx, c, objectKey(state.Namespace, state.Name), &obj, resp) {
		return
	}
	s := &obj.Spec
	state.ID = types.StringValue(objectID(obj.Namespace, obj.Name))
	state.Schedule = types.StringValue(s.Schedule)
	state.TimeZone = stringOrNull(s.TimeZone)
	state.AgentID = stringOrNull(s.Target.AgentID)
	state.Pool = stringOrNull(s.Target.Pool)
	state.Template = stringOrNull(s.Target.Template)
	state.BackoffLimit, state.ActiveDeadlineSeconds, state.TTLSecondsAfterFinished = types.Int64Null(), types.Int64Null(), types.Int64Null()
	if j := s.Target.Job; j != nil {
		state.BackoffLimit = int32OrNull(j.BackoffLimit)
		state.ActiveDeadlineSeconds = types.Int64PointerValue(j.ActiveDeadlineSeconds)
		state.TTLSecondsAfterFinished = int32OrNull(j.TTLSecondsAfterFinished)
	}
	state.Command = listValue(ctx, state.Command, s.Command.Argv, &resp.Diagnostics)
	state.Env = mapValue(ctx, state.Env, s.Command.Env, &resp.Diagnostics)
	state.Cwd = stringOrNull(s.Command.Cwd)
	state.TimeoutSeconds = types.Int64Null()
	if s.Command.TimeoutSeconds != 0 {
		state.TimeoutSeconds = types.Int64Value(int64(s.Command.TimeoutSeconds))
	}
	state.ConcurrencyPolicy = types.StringValue(string(s.ConcurrencyPolicy))
	if s.ConcurrencyPolicy == "" {
		state.ConcurrencyPolicy = types.StringValue(defaultConcurrencyPolicy)
	}
	state.StartingDeadlineSeconds = types.Int64PointerValue(s.StartingDeadlineSeconds)
	state.SuccessfulHistoryLimit = int32OrDefault(s.SuccessfulRunsHistoryLimit, defaultSuccessfulHistoryLimit)
	state.FailedHistoryLimit = int32OrDefault(s.FailedRunsHistoryLimit, defaultFailedHistoryLimit)
	state.Suspend = types.BoolValue(s.Suspend)
	state.setStatus(ctx, &obj.Status, &resp.Diagnostics)
	resp.Diagnostics.Append(resp.State.Set(ctx, &state)...)
}

func (r *runScheduleResource) Update(ctx context.Context, req resource.UpdateRequest, resp *resource.UpdateResponse) {
	var plan runScheduleModel
	c := modelAndClient(ctx, r.data, req.Plan, &plan, &resp.Diagnostics)
	if c == nil {
		return
	}
	spec := plan.spec(ctx, &resp.Diagnostics)
	if resp.Diagnostics.HasError() {
		return
	}
	key := objectKey(plan.Namespace, plan.Name)
	var obj agentboxv1alpha1.RunSchedule
	if !updateObject(ctx, runScheduleCR, c, key, &obj, func() { obj.Spec = spec }, &resp.Diagnostics) {
		return
	}
	plan.setStatus(ctx, &obj.Status, &resp.Diagnostics)
	resp.Diagnostics.Append(resp.State.Set(ctx, &plan)...)
}

func (r *runScheduleResource) Delete(ctx context.Context, req resource.DeleteRequest, resp *resource.DeleteResponse) {
	var state runScheduleModel
	c := modelAndClient(ctx, r.data, req.State, &state, &resp.Diagnostics)
	if c == nil {
		return
	}
	timeout, diags := state.Timeouts.Delete(ctx, defaultRunScheduleDelete)
	resp.Diagnostics.Append(diags...)
	obj := &agentboxv1alpha1.RunSchedule{ObjectMeta: namedObjectMeta(state.Namespace, state.Name)}
	runScheduleCR.delete(ctx, c, obj, timeout, &resp.Diagnostics)
}

func (r *runScheduleResource) ImportState(ctx context.Context, req resource.ImportStateRequest, resp *resource.ImportStateResponse) {
	importObject(ctx, r.data, req, resp)
}

func int32OrNull(p *int32) types.Int64 {
	if p == nil {
		return types.Int64Null()
	}
	return types.Int64Value(int64(*p))
}

func int32Pointer(v types.Int64) *int32 {
	if v.IsNull() || v.IsUnknown() {
		return nil
	}
	n := int32(v.ValueInt64())
	return &n
}

// target is the schedule's spec.target; the job's options go into its
// job block, which is left out when none is set.
func (m *runScheduleModel) target() agentboxv1alpha1.RunScheduleTarget {
	t := agentboxv1alpha1.RunScheduleTarget{AgentID: m.AgentID.ValueString(), Pool: m.Pool.ValueString(),
		Template: m.Template.ValueString()}
	job := agentboxv1alpha1.RunScheduleJob{BackoffLimit: int32Pointer(m.BackoffLimit),
		ActiveDeadlineSeconds: m.ActiveDeadlineSeconds.ValueInt64Pointer(), TTLSecondsAfterFinished: int32Pointer(m.TTLSecondsAfterFinished)}
	if job != (agentboxv1alpha1.RunScheduleJob{}) {
		t.Job = &job
	}
	return t
}

func int32OrDefault(p *int32, def int64) types.Int64 {
	if p == nil {
		return types.Int64Value(def)
	}
	return types.Int64Value(int64(*p))
}

func (m *runScheduleModel) spec(ctx context.Context, diags *diag.Diagnostics) agentboxv1alpha1.RunScheduleSpec {
	ok, failed := int32(m.SuccessfulHistoryLimit.ValueInt64()), int32(m.FailedHistoryLimit.ValueInt64())
	return agentboxv1alpha1.RunScheduleSpec{
		Schedule: m.Schedule.ValueString(),
		TimeZone: m.TimeZone.ValueString(),
		Target:   m.target(),
		Command: agentboxv1alpha1.RunScheduleCommand{
			Argv: goStrings(ctx, m.Command, diags), Env: goMap(ctx, m.Env, diags), Cwd: m.Cwd.ValueString(),
			TimeoutSeconds: int32(m.TimeoutSeconds.ValueInt64()),
		},
		ConcurrencyPolicy:          agentboxv1alpha1.ConcurrencyPolicy(m.ConcurrencyPolicy.ValueString()),
		StartingDeadlineSeconds:    m.StartingDeadlineSeconds.ValueInt64Pointer(),
		SuccessfulRunsHistoryLimit: &ok,
		FailedRunsHistoryLimit:     &failed,
		Suspend:                    m.Suspend.ValueBool(),
	}
}

func rfc3339OrNull(t *metav1.Time) types.String {
	if t == nil {
		return types.StringNull()
	}
	return types.StringValue(t.UTC().Format(time.RFC3339))
}

func (m *runScheduleModel) setStatus(ctx context.Context, s *agentboxv1alpha1.RunScheduleStatus, diags *diag.Diagnostics) {
	sm := runScheduleStatusModel{
		LastScheduleTime:  rfc3339OrNull(s.LastScheduleTime),
		NextScheduleTime:  rfc3339OrNull(s.NextScheduleTime),
		LastRunID:         stringOrNull(s.LastRunID),
		LastRunStatus:     stringOrNull(s.LastRunStatus),
		LastSkippedTime:   types.StringNull(),
		LastSkippedReason: types.StringNull(),
		ReadyReason:       types.StringNull(),
	}
	if sk := s.LastSkipped; sk != nil {
		sm.LastSkippedTime = rfc3339OrNull(&sk.Time)
		sm.LastSkippedReason = types.StringValue(sk.Reason)
	}
	for _, c := range s.Conditions {
		if c.Type == agentboxv1alpha1.ConditionReady {
			sm.ReadyReason = types.StringValue(c.Reason)
		}
	}
	active, d := types.ListValueFrom(ctx, types.StringType, append([]string{}, s.Active...))
	diags.Append(d...)
	sm.ActiveRunIDs = active
	m.Status = objectValue(ctx, runScheduleStatusAttrTypes, sm, diags)
}
