package main

import (
	"context"
	"fmt"

	ctrl "sigs.k8s.io/controller-runtime"

	"github.com/agentbox/terraform-provider-agentbox/internal/computeapi"
	"github.com/agentbox/terraform-provider-agentbox/internal/controller"
	"github.com/agentbox/terraform-provider-agentbox/internal/store"
)

// scheduleRuns starts a schedule's runs through the Compute API of this
// replica, in process: the run's executor is the replica's, as for a run
// started over HTTP, and the leader that starts a run is the one whose
// cancel (concurrencyPolicy Replace) stops it at once.
type scheduleRuns struct{ api *computeapi.Server }

func (s scheduleRuns) StartRun(ctx context.Context, run controller.ScheduledRun) (store.Run, error) {
	r, _, err := s.api.StartRunInProcess(ctx, computeapi.InProcessRun{
		Caller: run.Caller, RequestID: run.RequestID, Schedule: run.Schedule, Namespace: run.Namespace,
		Mode: string(run.Mode), AgentID: run.AgentID, Pool: run.Pool, Template: run.Template, BackoffLimit: run.BackoffLimit,
		ActiveDeadlineSeconds: run.ActiveDeadlineSeconds, TTLSecondsAfterFinished: run.TTLSecondsAfterFinished,
		Command: run.Command, Env: run.Env, Cwd: run.Cwd, TimeoutSeconds: run.TimeoutSeconds,
	})
	return r, err
}

func (s scheduleRuns) CancelRun(ctx context.Context, id, by string) error {
	_, err := s.api.CancelRunInProcess(ctx, id, by)
	return err
}

// addRunSchedules registers the RunSchedule controller. Without a store it
// still runs, to tell each schedule that no run can start
// (RunsUnavailable); the interfaces stay nil then.
func addRunSchedules(mgr ctrl.Manager, o *options, st *store.Store, api *computeapi.Server) error {
	r := &controller.RunScheduleReconciler{Namespaces: o.sandboxNamespaces}
	if st != nil {
		r.Runs, r.Records = scheduleRuns{api: api}, st
	}
	if err := r.SetupWithManager(mgr); err != nil {
		return fmt.Errorf("set up the run schedule controller: %w", err)
	}
	return nil
}
