package computeapi

import (
	"context"
	"errors"
	"maps"
	"strconv"
	"strings"
	"time"

	"github.com/go-logr/logr"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"
	"sigs.k8s.io/controller-runtime/pkg/client"

	"github.com/agentbox/terraform-provider-agentbox/internal/api/v1alpha1"
	api "github.com/agentbox/terraform-provider-agentbox/internal/computeapi/client"
	"github.com/agentbox/terraform-provider-agentbox/internal/computeapi/holds"
	"github.com/agentbox/terraform-provider-agentbox/internal/store"
)

// Pool and job runs: where a run gets a sandbox of its own, and how that
// sandbox goes when the run ends (its pool lease released, so that the
// pool recycles it; the job's sandbox deleted), also when the control
// plane running it dies (the sweeper).

// poolRunHoldTTL is the TTL of a pool run's lease, renewed at every run
// heartbeat. Should the control plane running it die, the sweeper
// releases the lease when it fails the run; if nobody does, the lease
// expires within this and the pool's controller recycles the sandbox all
// the same.
func (s *Server) poolRunHoldTTL() int {
	return min(max(int((3*s.runHeartbeat)/time.Second)+1, 120), api.MaxLeaseTTLSeconds)
}

// poolRun leases a ready sandbox from the run's warm pool, waiting for
// one up to api.MaxPoolLeaseWaitSeconds (and the active deadline), runs
// the command in it, and leaves the release of the lease to the
// executor's end (e.cleanup).
func (e *runExecution) poolRun(ctx context.Context) store.RunResult {
	s, run := e.s, e.run
	// The attempt starts before the lease: the wait for a free sandbox
	// may outlast the sweeper's bound on a queued run, and the heartbeats
	// must cover it.
	if _, res, ok := e.startAttempt(ctx, ""); !ok {
		return res
	}
	// Set before the acquire: an acquire that fails after its take (a
	// cold start that did not become ready) leaves a take to release too.
	e.cleanup = func() { s.releasePoolRun(run, e.log) }
	ns, pool, _ := strings.Cut(run.Pool, "/")
	// The run is the lease's holder and request, so that a retried
	// acquire (and the sweeper) finds the run's take in the store.
	req := api.AcquireLeaseRequest{Holder: run.ID, RequestID: run.ID, TTLSeconds: s.poolRunHoldTTL(),
		WaitSeconds: api.MaxPoolLeaseWaitSeconds, Requirements: run.Command.PoolRequirements, EnvName: run.Command.PoolEnvName}
	pl, apiErr := s.holds.AcquirePoolLease(ctx, ns, pool, req, s.conns.Warm)
	if apiErr != nil {
		return e.ended(ctx, apiFailure(apiErr))
	}
	if pl.Routing != nil {
		metricPoolLeaseEnvRouting.WithLabelValues(pl.Routing.Result).Inc()
		e.log.Info("pool run routed by environment", "sandbox", pl.Sandbox.Name, "result", pl.Routing.Result, "env_key", pl.Routing.EnvKey)
	}
	sb, leaseID := pl.Sandbox, pl.Lease.LeaseID
	renew := func(ctx context.Context) {
		if _, apiErr := s.holds.Heartbeat(ctx, sb, run.ID, leaseID); apiErr != nil {
			e.log.Info("could not renew the pool run's lease", "sandbox", sb.Name, "error", apiErr.Message)
		}
	}
	e.keepAlive.Store(&renew)
	agentID := sb.Spec.AgentID
	pctx, done := context.WithTimeout(context.WithoutCancel(ctx), runStoreTimeout)
	_, err := s.store.PlaceRun(pctx, run.ID, s.replica, agentID, sb.Namespace+"/"+sb.Name)
	done()
	switch {
	case errors.Is(err, store.ErrConflict):
		e.cancel(errRunLost)
		return store.RunResult{}
	case err != nil:
		// The record misses its sandbox; the run goes on all the same.
		e.log.Error(err, "record the pool run's sandbox", "sandbox", sb.Name)
	}
	s.runNotes.notify(run.ID)
	e.log = e.log.WithValues("agent", agentID)
	// The command presents the run's lease, as its holder's calls would.
	return e.command(context.WithValue(ctx, holdIDKey{}, leaseID), agentID, e.in)
}

// releasePoolRun releases the pool lease run took, if it took one, so
// that the pool's controller recycles the sandbox: the run's take is found
// in the store (the run is its holder and request), and the hold is
// written into the sandbox first if its acquire had not yet, or the
// release would find nothing to release and the hold come after it.
func (s *Server) releasePoolRun(run store.Run, log logr.Logger) {
	ctx, done := context.WithTimeout(context.Background(), 2*holds.WriteTimeout)
	defer done()
	ns, pool, _ := strings.Cut(run.Pool, "/")
	t, err := s.store.FindWarmLease(ctx, ns, pool, run.ID, run.ID)
	if errors.Is(err, store.ErrNotFound) {
		return
	}
	if err != nil {
		log.Error(err, "find the pool run's lease; it expires by itself")
		return
	}
	var sb v1alpha1.Sandbox
	if err := s.kubeDirect.Get(ctx, types.NamespacedName{Namespace: ns, Name: t.Sandbox}, &sb); apierrors.IsNotFound(err) {
		return
	} else if err != nil {
		log.Error(err, "get the pool run's sandbox; its lease expires by itself", "sandbox", t.Sandbox)
		return
	}
	if string(sb.UID) != t.SandboxUID || !sb.DeletionTimestamp.IsZero() {
		return
	}
	apiErr := s.holds.SettlePending(ctx, &sb)
	if apiErr == nil {
		apiErr = s.holds.Release(ctx, &sb, t.Holder, t.LeaseID)
	}
	if apiErr != nil {
		log.Info("could not release the pool run's lease; it expires by itself", "sandbox", t.Sandbox, "error", apiErr.Message)
		return
	}
	log.V(1).Info("pool run's lease released", "sandbox", t.Sandbox)
}

// jobRun makes the run's sandbox from its template, runs the command in
// it, retries a failed attempt up to the run's backoff limit, and leaves
// the deletion of the sandbox to the executor's end (e.cleanup).
//
// A retry reuses the job's sandbox rather than making a fresh one. The
// failures a retry is for are the command's (a non-zero exit, its
// timeout, a flaky download): the sandbox was made for this run alone, so
// nothing but the run's own earlier attempts is in it, and what they left
// in the workspace (a fetched dependency, a checkpoint) is often what
// lets the next attempt get further. A fresh sandbox per attempt would
// cost a sandbox start (seconds to tens of seconds under gVisor) per
// retry, out of the active deadline. A sandbox that itself fails is not
// served by the retry either way: the attempt waits for it to serve again
// (reach), as any call does, and fails if it does not. Every attempt gets
// its number in AGENTBOX_RUN_ATTEMPT, so a command can tell a retry.
func (e *runExecution) jobRun(ctx context.Context) store.RunResult {
	s, run := e.s, e.run
	ns, tpl, _ := strings.Cut(run.Template, "/")
	name := jobSandboxName(run.ID)
	for n := 1; ; n++ {
		e.attempt = n
		started, res, ok := e.startAttempt(ctx, ns+"/"+name)
		if !ok {
			return res
		}
		if n == 1 {
			e.cleanup = func() { s.deleteJobSandbox(ns, name, run.ID, e.log) }
			if apiErr := s.createJobSandbox(ctx, run, types.NamespacedName{Namespace: ns, Name: tpl}, name); apiErr != nil {
				return e.ended(ctx, apiFailure(apiErr))
			}
		}
		before := e.outBytes
		if sb, apiErr := s.awaitCreated(ctx, run.AgentID, time.Now()); apiErr != nil {
			res = e.ended(ctx, apiFailure(apiErr))
		} else {
			if n == 1 {
				e.noteJobRouting(sb)
			}
			in := e.in
			in.env = maps.Clone(in.env)
			if in.env == nil {
				in.env = map[string]string{}
			}
			in.env[api.EnvRunAttempt] = strconv.Itoa(started.Attempts)
			res = e.command(ctx, run.AgentID, in)
		}
		// The attempt has ended here.
		if !e.retries(ctx, res) {
			return res
		}
		attempt := res
		attempt.OutputBytes = e.outBytes - before
		fctx, done := context.WithTimeout(context.WithoutCancel(ctx), runStoreTimeout)
		err := s.store.FinishRunAttempt(fctx, run.ID, started.Attempts, attempt)
		done()
		if errors.Is(err, store.ErrRunFinished) {
			e.cancel(errRunLost)
			return res
		} else if err != nil {
			e.log.Error(err, "record the end of an attempt", "attempt", started.Attempts)
		}
		wait := s.retryBackoff(n)
		e.log.V(1).Info("run attempt failed; retrying", "attempt", started.Attempts, "reason", res.Reason, "backoff", wait.String())
		t := time.NewTimer(wait)
		select {
		case <-ctx.Done():
			t.Stop()
			return e.ended(ctx, res)
		case <-t.C:
		}
	}
}

// retryBackoff is the wait after the n-th failed attempt: the base,
// doubled for every attempt before, at most the cap.
func (s *Server) retryBackoff(n int) time.Duration {
	d := s.runRetryBackoff
	for i := 1; i < n && d < s.runRetryBackoffMax; i++ {
		d *= 2
	}
	return min(d, s.runRetryBackoffMax)
}

// jobSandboxName is the name of a job run's sandbox: the run id, which is
// unique, short ("run-" and 20 hex digits) and a DNS label.
func jobSandboxName(runID string) string { return runID }

// createJobSandbox makes the job run's sandbox from tpl, labelled with the
// run's id (v1alpha1.LabelRunID), unless it exists already (a takeover
// of the run).
func (s *Server) createJobSandbox(ctx context.Context, run store.Run, tpl types.NamespacedName, name string) *api.Error {
	if apiErr := s.templateExists(ctx, tpl); apiErr != nil {
		return apiErr
	}
	sb := &v1alpha1.Sandbox{
		ObjectMeta: metav1.ObjectMeta{
			Namespace: tpl.Namespace,
			Name:      name,
			Labels: map[string]string{
				v1alpha1.LabelAgentIDHash: v1alpha1.AgentIDHash(run.AgentID),
				v1alpha1.LabelRunID:       run.ID,
			},
			Annotations: jobSandboxAnnotations(run),
		},
		Spec: v1alpha1.SandboxSpec{AgentID: run.AgentID, TemplateRef: v1alpha1.LocalObjectReference{Name: tpl.Name}},
	}
	wctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), holds.WriteTimeout)
	defer cancel()
	err := s.kube.Create(wctx, sb)
	if err == nil || apierrors.IsAlreadyExists(err) {
		return nil
	}
	s.log.Error(err, "create job sandbox", "run", run.ID, "sandbox", tpl.Namespace+"/"+name)
	return api.Errorf(api.CodeInternal, "could not create the sandbox of run %s from SandboxTemplate %s", run.ID, tpl)
}

// jobSandboxAnnotations are the annotations of run's job sandbox: the
// request that made it, and the Python environment the run named, by which
// the sandbox adopts a warm sandbox of its template holding it (see
// v1alpha1.AnnotationPythonEnvName).
func jobSandboxAnnotations(run store.Run) map[string]string {
	a := map[string]string{v1alpha1.AnnotationCreatedByRequest: run.ID}
	if run.Command.PoolEnvName != "" {
		a[v1alpha1.AnnotationPythonEnvName] = run.Command.PoolEnvName
	}
	if len(run.Command.PoolRequirements) > 0 {
		// Checked as requirements, which hold no whitespace.
		a[v1alpha1.AnnotationPythonRequirements] = strings.Join(run.Command.PoolRequirements, " ")
	}
	return a
}

// noteJobRouting reports how the job run's sandbox adopted a warm one by
// the run's environment, once the controller has written it, as a pool
// run reports its lease's routing.
func (e *runExecution) noteJobRouting(sb *v1alpha1.Sandbox) {
	if sb == nil || (e.run.Command.PoolEnvName == "" && len(e.run.Command.PoolRequirements) == 0) {
		return
	}
	if routing := sb.Annotations[v1alpha1.AnnotationPythonEnvRouting]; routing != "" {
		e.log.Info("job run's sandbox adopted a warm sandbox routed by environment", "sandbox", sb.Name, "workload", sb.WorkloadName(), "result", routing)
	} else {
		e.log.Info("job run's sandbox started without adopting a warm sandbox", "sandbox", sb.Name)
	}
}

// deleteJobSandbox deletes the job run's sandbox, if it is the run's.
func (s *Server) deleteJobSandbox(ns, name, runID string, log logr.Logger) {
	ctx, cancel := context.WithTimeout(context.Background(), holds.WriteTimeout)
	defer cancel()
	var sb v1alpha1.Sandbox
	if err := s.kubeDirect.Get(ctx, types.NamespacedName{Namespace: ns, Name: name}, &sb); apierrors.IsNotFound(err) {
		return
	} else if err != nil {
		log.Error(err, "get the job run's sandbox; the sweeper deletes it", "sandbox", ns+"/"+name)
		return
	}
	s.deleteRunSandbox(ctx, &sb, runID, log)
}

// deleteRunSandbox deletes sb if it is runID's job sandbox.
func (s *Server) deleteRunSandbox(ctx context.Context, sb *v1alpha1.Sandbox, runID string, log logr.Logger) {
	if sb.Labels[v1alpha1.LabelRunID] != runID || !sb.DeletionTimestamp.IsZero() {
		return
	}
	uid := sb.UID
	if err := s.kube.Delete(ctx, sb, client.Preconditions{UID: &uid}); err != nil && !apierrors.IsNotFound(err) {
		log.Error(err, "delete the job run's sandbox; the sweeper deletes it", "sandbox", sb.Namespace+"/"+sb.Name)
		return
	}
	log.V(1).Info("job run's sandbox deleted", "sandbox", sb.Namespace+"/"+sb.Name)
}

// sweepRunSandboxes deletes the job sandboxes whose run has ended or is
// gone: those whose executor died with them, or failed to delete them.
func (s *Server) sweepRunSandboxes(log logr.Logger) {
	ctx, done := context.WithTimeout(context.Background(), runStoreTimeout)
	defer done()
	var list v1alpha1.SandboxList
	if err := s.sandboxes.List(ctx, &list, client.HasLabels{v1alpha1.LabelRunID}); err != nil {
		log.Error(err, "list job run sandboxes")
		return
	}
	for i := range list.Items {
		sb := &list.Items[i]
		id := sb.Labels[v1alpha1.LabelRunID]
		if !sb.DeletionTimestamp.IsZero() || !s.serves(sb.Namespace) {
			continue
		}
		run, err := s.store.GetRun(ctx, id)
		switch {
		case errors.Is(err, store.ErrNotFound):
		case err != nil:
			log.Error(err, "read the run of a job sandbox", "run", id)
			continue
		case !run.Status.Terminal():
			continue
		}
		log.Info("deleting the sandbox of a job run that has ended or is gone", "run", id, "sandbox", sb.Namespace+"/"+sb.Name)
		s.deleteRunSandbox(ctx, sb, id, log)
	}
}
