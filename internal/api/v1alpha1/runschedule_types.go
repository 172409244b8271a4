package v1alpha1

import (
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
)

// ConcurrencyPolicy says what a schedule does at a due time while a run it
// started earlier is still live (queued or running).
// +kubebuilder:validation:Enum=Forbid;Allow;Replace
type ConcurrencyPolicy string

const (
	// ConcurrencyForbid skips the due time and records the skip.
	ConcurrencyForbid ConcurrencyPolicy = "Forbid"
	// ConcurrencyAllow starts the new run beside the live ones.
	ConcurrencyAllow ConcurrencyPolicy = "Allow"
	// ConcurrencyReplace cancels the live runs and starts the new one.
	ConcurrencyReplace ConcurrencyPolicy = "Replace"
)

// RunScheduleTarget is where a schedule's runs execute, one of the
// Compute API's run modes: an agent's own sandbox (agentID, mode agent), a
// sandbox leased from a warm pool for the run (pool, mode pool), or a
// sandbox made from a template for the run (template, mode job). Pools and
// templates are those of the schedule's namespace: a schedule is in-cluster
// configuration, and its namespace bounds what it reaches.
// +kubebuilder:validation:XValidation:rule="[has(self.agentID), has(self.pool), has(self.template)].filter(x, x).size() == 1",message="set exactly one of agentID, pool and template"
// +kubebuilder:validation:XValidation:rule="!has(self.job) || has(self.template)",message="job applies only to a template target (a job run)"
type RunScheduleTarget struct {
	// agentID is the agent whose sandbox runs the command, as the Compute
	// API's runs take it (mode agent): a stopped sandbox is woken for the
	// run, as for any call. Its sandbox must be in the schedule's
	// namespace.
	// +optional
	// +kubebuilder:validation:MinLength=1
	// +kubebuilder:validation:MaxLength=253
	AgentID string `json:"agentID,omitempty"`

	// pool is the name of a SandboxWarmPool in the schedule's namespace:
	// each run leases a ready sandbox from it (mode pool), waiting for one
	// if none is free, and the pool recycles the sandbox once the run ends.
	// +optional
	// +kubebuilder:validation:MinLength=1
	// +kubebuilder:validation:MaxLength=253
	// +kubebuilder:validation:Pattern=`^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$`
	Pool string `json:"pool,omitempty"`

	// template is the name of a SandboxTemplate in the schedule's
	// namespace: each run gets a sandbox made from it for the run alone
	// (mode job), deleted once the run ends; job tunes its retries and
	// bounds.
	// +optional
	// +kubebuilder:validation:MinLength=1
	// +kubebuilder:validation:MaxLength=253
	// +kubebuilder:validation:Pattern=`^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$`
	Template string `json:"template,omitempty"`

	// job holds the options of a job run, with a template target only.
	// +optional
	Job *RunScheduleJob `json:"job,omitempty"`
}

// RunScheduleJob holds the options of a schedule's job runs (a template
// target), named as in a Kubernetes Job's spec, whose meaning they share.
type RunScheduleJob struct {
	// backoffLimit is how many times a failed attempt of a run is retried,
	// in the same sandbox, after a backoff that doubles from attempt to
	// attempt up to a cap. Unset means 0: no retry.
	// +optional
	// +kubebuilder:validation:Minimum=0
	// +kubebuilder:validation:Maximum=10
	BackoffLimit *int32 `json:"backoffLimit,omitempty"`

	// activeDeadlineSeconds bounds each run from its start, the sandbox's
	// start and retries included: when it passes, the command is killed
	// and the run ends timed_out (reason DeadlineExceeded). Unset means no
	// bound beyond command.timeoutSeconds per attempt.
	// +optional
	// +kubebuilder:validation:Minimum=1
	ActiveDeadlineSeconds *int64 `json:"activeDeadlineSeconds,omitempty"`

	// ttlSecondsAfterFinished is how long a run's record (and its
	// artifacts) is kept after it ends, instead of the platform's run
	// retention; 0 removes it as soon as it ends. The history limits
	// still delete records beyond them earlier.
	// +optional
	// +kubebuilder:validation:Minimum=0
	TTLSecondsAfterFinished *int32 `json:"ttlSecondsAfterFinished,omitempty"`
}

// RunScheduleCommand is the command each run executes.
type RunScheduleCommand struct {
	// argv is the command and its arguments, run without a shell.
	// +required
	// +kubebuilder:validation:MinItems=1
	// +listType=atomic
	Argv []string `json:"argv"`

	// env is given to the command. The run records keep only the names;
	// the values are in this object, so keep secrets out of it.
	// +optional
	Env map[string]string `json:"env,omitempty"`

	// cwd is the working directory; empty means the sandbox's workspace.
	// +optional
	Cwd string `json:"cwd,omitempty"`

	// timeoutSeconds bounds each run; 0 or unset means the supervisor's
	// default (60 s).
	// +optional
	// +kubebuilder:validation:Minimum=0
	TimeoutSeconds int32 `json:"timeoutSeconds,omitempty"`
}

// RunScheduleSpec is the desired state of a schedule.
type RunScheduleSpec struct {
	// schedule is a standard five-field cron expression (minute hour
	// day-of-month month day-of-week), or one of @yearly, @annually,
	// @monthly, @weekly, @daily, @midnight, @hourly. The time zone is
	// spec.timeZone, never a TZ= or CRON_TZ= prefix.
	// +required
	// +kubebuilder:validation:MinLength=1
	// +kubebuilder:validation:MaxLength=256
	// +kubebuilder:validation:XValidation:rule="!self.contains('TZ=')",message="set the time zone in spec.timeZone, not with a TZ= or CRON_TZ= prefix"
	// +kubebuilder:validation:XValidation:rule="!self.startsWith('@every')",message="@every is not a cron schedule; use five fields, such as */5 * * * *"
	// +kubebuilder:validation:XValidation:rule="self.startsWith('@') || self.trim().split(' ').filter(f, f != '').size() == 5",message="must have five fields: minute hour day-of-month month day-of-week"
	Schedule string `json:"schedule"`

	// timeZone is the IANA name of the time zone the schedule is read in,
	// such as Europe/Berlin; unset means UTC.
	// +optional
	// +kubebuilder:validation:MaxLength=64
	TimeZone string `json:"timeZone,omitempty"`

	// target is where the runs execute.
	// +required
	Target RunScheduleTarget `json:"target"`

	// command is what each run executes.
	// +required
	Command RunScheduleCommand `json:"command"`

	// concurrencyPolicy says what a due time does while a run of this
	// schedule is still live: Forbid skips it (status.lastSkipped, reason
	// Forbid), Allow starts another run beside it, Replace cancels the live
	// runs and starts the new one.
	// +optional
	// +kubebuilder:default=Forbid
	ConcurrencyPolicy ConcurrencyPolicy `json:"concurrencyPolicy,omitempty"`

	// startingDeadlineSeconds is how late a due time may still start a
	// run, for times missed while the control plane was down or the
	// schedule suspended: a later start is skipped (status.lastSkipped,
	// reason MissedDeadline). Unset means a missed time starts however
	// late; only the latest missed time is ever started.
	// +optional
	// +kubebuilder:validation:Minimum=1
	StartingDeadlineSeconds *int64 `json:"startingDeadlineSeconds,omitempty"`

	// successfulRunsHistoryLimit is how many records of this schedule's
	// succeeded runs the store keeps; older ones are deleted.
	// +optional
	// +kubebuilder:default=3
	// +kubebuilder:validation:Minimum=0
	SuccessfulRunsHistoryLimit *int32 `json:"successfulRunsHistoryLimit,omitempty"`

	// failedRunsHistoryLimit is how many records of this schedule's runs
	// that did not succeed (failed, timed out, cancelled) the store keeps;
	// older ones are deleted.
	// +optional
	// +kubebuilder:default=1
	// +kubebuilder:validation:Minimum=0
	FailedRunsHistoryLimit *int32 `json:"failedRunsHistoryLimit,omitempty"`

	// suspend stops new runs; live ones go on. Due times that pass while
	// suspended are missed: on resuming, the latest of them starts if
	// startingDeadlineSeconds allows.
	// +optional
	Suspend bool `json:"suspend,omitempty"`
}

// RunScheduleSkip is a due time that started no run.
type RunScheduleSkip struct {
	// time is the due time skipped.
	// +required
	Time metav1.Time `json:"time"`

	// reason is why: Forbid (a run was live under concurrencyPolicy
	// Forbid), MissedDeadline (the time was found later than
	// startingDeadlineSeconds allows) or Refused (the control plane
	// refused the run, such as for an agent whose sandbox is in another
	// namespace).
	// +required
	Reason string `json:"reason"`

	// message says it in words.
	// +optional
	Message string `json:"message,omitempty"`
}

// Skip reasons of a RunSchedule (status.lastSkipped.reason).
const (
	// SkipForbid: a run of the schedule was live under Forbid.
	SkipForbid = "Forbid"
	// SkipMissedDeadline: the due time was found later than
	// startingDeadlineSeconds allows.
	SkipMissedDeadline = "MissedDeadline"
	// SkipRefused: the control plane refused to start the run, such as
	// for an agent whose sandbox is in another namespace; the message
	// says why.
	SkipRefused = "Refused"
)

// RunScheduleStatus is the observed state of a schedule.
type RunScheduleStatus struct {
	// lastScheduleTime is the last due time the schedule acted on, by
	// starting a run or by skipping it.
	// +optional
	LastScheduleTime *metav1.Time `json:"lastScheduleTime,omitempty"`

	// nextScheduleTime is the next due time; unset while suspended or
	// invalid.
	// +optional
	NextScheduleTime *metav1.Time `json:"nextScheduleTime,omitempty"`

	// lastRunID is the id of the last run the schedule started, as the
	// Compute API's GET /v1/runs/{id} takes it.
	// +optional
	LastRunID string `json:"lastRunID,omitempty"`

	// lastRunStatus is that run's status as last seen: queued, running,
	// succeeded, failed, timed_out or cancelled.
	// +optional
	LastRunStatus string `json:"lastRunStatus,omitempty"`

	// lastSkipped is the last due time that started no run, and why.
	// +optional
	LastSkipped *RunScheduleSkip `json:"lastSkipped,omitempty"`

	// active are the ids of the schedule's runs that are still live.
	// +optional
	// +listType=atomic
	Active []string `json:"active,omitempty"`

	// conditions hold the Ready condition: True while the schedule starts
	// runs at its times; its reason says why not otherwise.
	// +optional
	// +listType=map
	// +listMapKey=type
	// +patchStrategy=merge
	// +patchMergeKey=type
	Conditions []metav1.Condition `json:"conditions,omitempty" patchStrategy:"merge" patchMergeKey:"type"`

	// observedGeneration is the metadata.generation the status describes.
	// +optional
	ObservedGeneration int64 `json:"observedGeneration,omitempty"`
}

// RunSchedule starts a run of a command at the times of a cron schedule, in
// an agent's sandbox, a sandbox leased from a warm pool, or one made from a
// template for the run (spec.target), through the Compute API's runs. Only the control
// plane's leader starts runs, and each due time starts at most one run,
// across restarts and replicas. Deleting a schedule cancels its live runs.
//
// +kubebuilder:object:root=true
// +kubebuilder:subresource:status
// +kubebuilder:resource:scope=Namespaced,shortName=runsched,categories=agentbox
// +kubebuilder:printcolumn:name="Schedule",type=string,JSONPath=`.spec.schedule`
// +kubebuilder:printcolumn:name="Agent",type=string,JSONPath=`.spec.target.agentID`
// +kubebuilder:printcolumn:name="Pool",type=string,JSONPath=`.spec.target.pool`,priority=1
// +kubebuilder:printcolumn:name="Template",type=string,JSONPath=`.spec.target.template`,priority=1
// +kubebuilder:printcolumn:name="Suspend",type=boolean,JSONPath=`.spec.suspend`
// +kubebuilder:printcolumn:name="Last",type=date,JSONPath=`.status.lastScheduleTime`
// +kubebuilder:printcolumn:name="Next",type=string,JSONPath=`.status.nextScheduleTime`
// +kubebuilder:printcolumn:name="Ready",type=string,JSONPath=`.status.conditions[?(@.type=="Ready")].reason`
// +kubebuilder:printcolumn:name="Age",type=date,JSONPath=`.metadata.creationTimestamp`
type RunSchedule struct {
	metav1.TypeMeta `json:",inline"`
	// +optional
	metav1.ObjectMeta `json:"metadata,omitempty"`

	// spec is the desired schedule.
	// +required
	Spec RunScheduleSpec `json:"spec"`

	// status is written by the control plane.
	// +optional
	Status RunScheduleStatus `json:"status,omitzero"`
}

// RunScheduleList is a list of RunSchedules.
//
// +kubebuilder:object:root=true
type RunScheduleList struct {
	metav1.TypeMeta `json:",inline"`
	// +optional
	metav1.ListMeta `json:"metadata,omitempty"`
	// items are the schedules.
	Items []RunSchedule `json:"items"`
}
