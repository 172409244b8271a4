package computeapi

import (
	"context"
	"errors"
	"fmt"
	"os"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/go-logr/logr"

	api "github.com/agentbox/terraform-provider-agentbox/internal/computeapi/client"
	"github.com/agentbox/terraform-provider-agentbox/internal/store"
	"github.com/agentbox/terraform-provider-agentbox/internal/supervisor/supervisorapi"
)

// The run executor: it runs a recorded run to completion in its agent's
// sandbox, in the background of the Server (not of the call that started
// it), heartbeats it, stops it when a cancel is asked for, and records how
// it ended. The sweeper ends the runs whose executor died.

const (
	// DefaultRunHeartbeatInterval is how often an executor heartbeats its
	// run; a run not heartbeated for three intervals is failed by the
	// sweeper as lost.
	DefaultRunHeartbeatInterval = 10 * time.Second
	// DefaultRunSweepInterval is how often a Server looks for lost runs.
	DefaultRunSweepInterval = 30 * time.Second
	// DefaultRunRetention is how long the control plane keeps finished
	// runs' records unless told otherwise.
	DefaultRunRetention = 7 * 24 * time.Hour
	// runPruneInterval spaces the sweeper's deletions of expired runs:
	// one DELETE over the runs table every few minutes keeps up with any
	// rate of runs, and a short sweep interval must not repeat it.
	runPruneInterval = 5 * time.Minute

	// runStoreTimeout bounds one store call of an executor or the sweeper.
	runStoreTimeout = 10 * time.Second

	// DefaultRunRetryBackoff is how long a job run waits before its first
	// retry; each next one waits twice as long, up to
	// DefaultRunRetryBackoffMax (the backoff of a Kubernetes Job's pods).
	DefaultRunRetryBackoff    = 10 * time.Second
	DefaultRunRetryBackoffMax = 6 * time.Minute

	// Reasons a run ends with, besides the API's error codes.
	reasonNonZeroExit      = "NonZeroExit"
	reasonDeadlineExceeded = "DeadlineExceeded"
	reasonExecutorLost     = "ExecutorLost"
	reasonExecutorStopped  = "ExecutorStopped"
	reasonSignaled         = "Signaled"
	reasonOutOfMemory      = "OutOfMemory"
)

// runInput is what a run is given but its record never holds: the
// environment's values (maybe secrets) and stdin.
type runInput struct {
	env   map[string]string
	stdin string
}

// cancelled is the cause of an executor's context when someone cancelled
// its run.
type cancelled struct{ by string }

func (c cancelled) Error() string { return "run cancelled by " + c.by }

var (
	// errServerClosing ends the executors of a Server being closed.
	errServerClosing = errors.New("the control plane is shutting down")
	// errRunLost ends an executor whose run another replica took over or
	// ended: it must neither go on nor record anything.
	errRunLost = errors.New("the run is no longer this executor's")
)

// executors are the runs this Server executes, by id, so that a cancel
// that reaches this replica stops its run at once.
type executors struct {
	mu   sync.Mutex
	runs map[string]context.CancelCauseFunc
}

func (e *executors) add(id string, cancel context.CancelCauseFunc) {
	e.mu.Lock()
	defer e.mu.Unlock()
	if e.runs == nil {
		e.runs = map[string]context.CancelCauseFunc{}
	}
	e.runs[id] = cancel
}

func (e *executors) remove(id string) {
	e.mu.Lock()
	defer e.mu.Unlock()
	delete(e.runs, id)
}

// cancel stops the run id if this Server executes it.
func (e *executors) cancel(id, by string) {
	e.mu.Lock()
	defer e.mu.Unlock()
	if c := e.runs[id]; c != nil {
		c(cancelled{by: by})
	}
}

// defaultReplica is the host's name, which in the control plane's pod is
// the pod's.
func defaultReplica() string {
	if h, err := os.Hostname(); err == nil && h != "" {
		return h
	}
	return "agentbox-controlplane"
}

// executeRun starts the executor of a run just recorded. from is the
// starting call's context: its request id and the hold it presented go on
// with the run, its cancellation does not.
func (s *Server) executeRun(from context.Context, run store.Run, in runInput) {
	ctx := context.WithoutCancel(from)
	ctx, cancel := context.WithCancelCause(ctx)
	s.execs.add(run.ID, cancel)
	s.runWork.Go(func() {
		defer s.execs.remove(run.ID)
		defer cancel(nil)
		go func() {
			select {
			case <-s.closing:
				cancel(errServerClosing)
			case <-ctx.Done():
			}
		}()
		s.runExecutor(ctx, cancel, run, in)
	})
}

// runExecutor executes a run in the sandbox its mode says, and records
// how it ended.
func (s *Server) runExecutor(ctx context.Context, cancel context.CancelCauseFunc, run store.Run, in runInput) {
	log := s.log.WithName("runs").WithValues("run", run.ID, "mode", string(run.Mode), "agent", run.AgentID)
	if id := requestID(ctx); id != "" {
		log = log.WithValues("request_id", id)
	}
	// The active deadline runs from the run's creation and bounds all of
	// it: the waits for a sandbox, every attempt and the backoffs between.
	if run.ActiveDeadlineSeconds > 0 {
		var stop context.CancelFunc
		d := time.Duration(run.ActiveDeadlineSeconds) * time.Second
		ctx, stop = context.WithDeadlineCause(ctx, run.CreatedAt.Add(d), activeDeadline{d})
		defer stop()
	}
	e := &runExecution{s: s, cancel: cancel, run: run, in: in, log: log}
	defer e.stopBeats()
	var res store.RunResult
	switch run.Mode {
	case store.RunModePool:
		res = e.poolRun(ctx)
	case store.RunModeJob:
		res = e.jobRun(ctx)
	default:
		res = e.agentRun(ctx)
	}
	e.stopBeats()
	if e.cleanup != nil {
		// The run's own sandbox goes (a pool lease released, a job's
		// sandbox deleted) once the heartbeats (which renew a pool lease)
		// are over, and before the end is recorded: whoever reads the
		// run's end finds the sandbox on its way out. This is also where
		// an attempt's aftermath has the sandbox still.
		e.cleanup()
	}
	if errors.Is(context.Cause(ctx), errRunLost) {
		log.Info("run taken over or ended elsewhere; not recording its end here")
		return
	}
	// A run changes the agent's workspace as run_command does, so its end
	// schedules the push into the agent's filespace.
	if run.Mode == store.RunModeAgent && s.pushes != nil {
		s.pushes.touch(run.AgentID)
	}
	fctx, done := context.WithTimeout(context.WithoutCancel(ctx), runStoreTimeout)
	defer done()
	ended, err := s.store.FinishRun(fctx, run.ID, res)
	s.runNotes.notify(run.ID)
	switch {
	case errors.Is(err, store.ErrRunFinished):
		log.Info("run had already ended", "status", string(ended.Status), "reason", ended.Reason)
	case err != nil:
		log.Error(err, "record the end of a run; the sweeper will fail it")
	default:
		log.V(1).Info("run ended", "status", string(ended.Status), "reason", ended.Reason, "output_bytes", ended.OutputBytes)
		countRun(metricRunsFinished, ended, string(ended.Status), string(ended.Mode))
		// A run cancelled while queued never started, and has no
		// duration.
		if ended.StartedAt != nil && ended.FinishedAt != nil {
			observeRun(metricRunSeconds, ended, ended.FinishedAt.Sub(*ended.StartedAt).Seconds(), string(ended.Mode))
		}
	}
}

// activeDeadline is the cause of an executor's context when the run's
// active deadline passed.
type activeDeadline struct{ d time.Duration }

func (a activeDeadline) Error() string {
	return fmt.Sprintf("the run's active deadline of %s passed", a.d)
}

// runExecution is one executor's state of its run: what the attempts
// share (the heartbeats, a pool lease to release, the output counted so
// far).
type runExecution struct {
	s      *Server
	cancel context.CancelCauseFunc
	run    store.Run
	in     runInput
	log    logr.Logger

	// beats heartbeats the run from its first attempt's start to its
	// end, across attempts and the waits between them.
	beats     sync.WaitGroup
	stopBeat  context.CancelFunc
	keepAlive atomic.Pointer[func(context.Context)]
	// cleanup, when set, lets the run's own sandbox go: it releases a
	// pool run's lease, deletes a job run's sandbox.
	cleanup func()
	// outBytes is the output of the attempts so far.
	outBytes int64
	// attempt is a job run's attempt under way, from 1; 0 in the other
	// modes, which have one.
	attempt int
}

// startAttempt records the start of an attempt in sandbox (namespace/name,
// or empty when not known yet) and starts the heartbeats with the first.
// A false ok ends the run with res.
func (e *runExecution) startAttempt(ctx context.Context, sandbox string) (started store.Run, res store.RunResult, ok bool) {
	s := e.s
	sctx, done := context.WithTimeout(context.WithoutCancel(ctx), runStoreTimeout)
	started, err := s.store.StartRunAttempt(sctx, e.run.ID, s.replica, sandbox)
	done()
	if err != nil {
		if errors.Is(err, store.ErrRunFinished) {
			// Cancelled while queued, or failed by a sweeper meanwhile.
			e.cancel(errRunLost)
			return started, store.RunResult{}, false
		}
		e.log.Error(err, "start run attempt")
		return started, store.RunResult{Status: store.RunFailed, Reason: "Internal", Message: "could not record the start of the run"}, false
	}
	s.runNotes.notify(e.run.ID)
	countRun(metricRunAttempts, started, string(started.Mode))
	if started.CancelRequestedBy != "" {
		e.cancel(cancelled{by: started.CancelRequestedBy})
	}
	if e.stopBeat == nil {
		// The heartbeats end before the run's end is recorded (and before
		// Close returns, which the store's closing follows).
		// The executor's own end (cancel, deadline, shutdown) stops them
		// too.
		hctx, stop := context.WithCancel(ctx)
		e.stopBeat = stop
		log := e.log
		e.beats.Go(func() { s.heartbeatRun(hctx, e.cancel, e.run.ID, log, e.keepAlive.Load) })
	}
	return started, store.RunResult{}, true
}

// stopBeats ends the heartbeats and waits for them; again is a no-op.
func (e *runExecution) stopBeats() {
	if e.stopBeat != nil {
		e.stopBeat()
	}
	e.beats.Wait()
}

// agentRun runs the command in its agent's sandbox, once.
func (e *runExecution) agentRun(ctx context.Context) store.RunResult {
	// The sandbox is looked up before the attempt starts so that the
	// record names it; the wait for it to serve (reach) comes after, while
	// the run heartbeats, since a resume can outlast the sweeper's bound.
	sb, apiErr := e.s.agentSandbox(ctx, e.run.AgentID)
	if apiErr != nil {
		return apiFailure(apiErr)
	}
	if _, res, ok := e.startAttempt(ctx, sb.Namespace+"/"+sb.Name); !ok {
		return res
	}
	return e.command(ctx, e.run.AgentID, e.in)
}

// ended is res, unless the executor's context says otherwise: a cancel,
// the active deadline or the control plane's shutdown end the run so,
// whatever the attempt's failure was. The output counted so far goes with
// it.
func (e *runExecution) ended(ctx context.Context, res store.RunResult) store.RunResult {
	res.OutputBytes = e.outBytes
	var (
		c cancelled
		d activeDeadline
	)
	switch cause := context.Cause(ctx); {
	case errors.As(cause, &c):
		return store.RunResult{Status: store.RunCancelled, Reason: "Cancelled", CancelledBy: c.by,
			Message: "cancelled by " + c.by, OutputBytes: e.outBytes}
	case errors.As(cause, &d):
		return store.RunResult{Status: store.RunTimedOut, Reason: reasonDeadlineExceeded,
			Message: d.Error() + "; the command was stopped", OutputBytes: e.outBytes}
	case errors.Is(cause, errServerClosing):
		return store.RunResult{Status: store.RunFailed, Reason: reasonExecutorStopped,
			Message: "the control plane running it shut down before it finished; the command was stopped", OutputBytes: e.outBytes}
	}
	return res
}

// command runs the run's command in agentID's sandbox (one attempt's
// command) and says how it ended, its output counted in e.outBytes. The
// hold the context presents, if any, is the one the run holds.
func (e *runExecution) command(ctx context.Context, agentID string, in runInput) store.RunResult {
	s, run, log := e.s, e.run, e.log
	sup, sb, log, apiErr := s.reach(ctx, agentID, log)
	if apiErr != nil {
		return e.ended(ctx, apiFailure(apiErr))
	}
	timeout := time.Duration(run.Command.TimeoutSeconds) * time.Second
	cctx, ccancel := context.WithTimeout(ctx, timeout+supervisorGrace)
	defer ccancel()
	req := supervisorapi.CommandRequest{Command: run.Command.Argv, Cwd: run.Command.Cwd, Env: in.env, Stdin: in.stdin,
		TimeoutSeconds: run.Command.TimeoutSeconds}
	// Streamed, so that the output is counted as it comes and goes to the
	// run's event log line by line, redacted; the record keeps its size.
	// Cancelling cctx ends the supervisor's call, and the supervisor then
	// kills the command's process group. The log's last lines are written
	// before the run's end is.
	output := s.newRunOutput(run.ID, log)
	defer output.close()
	ended := s.commandEvents(sb.Namespace, sb.Name, agentID, run.Command.Argv, run.ID)
	res, err := sup.RunCommandStream(cctx, req, func(ev supervisorapi.CommandEvent) error {
		e.outBytes += int64(len(ev.Data))
		if ev.Truncated {
			output.sandboxTruncated()
		}
		output.write(ev.Stream, []byte(ev.Data))
		return nil
	})
	ended(res, err)
	out := e.commandResult(ctx, cctx, res, err, timeout, log)
	// The artifacts are the run's, kept once: after the attempt whose
	// end is the run's, not after one that is retried in the same sandbox.
	if !e.retries(ctx, out) {
		s.collectRunArtifacts(ctx, run, sup, output, err, log)
	}
	return out
}

// retries reports whether the run goes on to another attempt after one
// that ended with res: a job run's failed attempt, within its backoff
// limit, with nothing (cancel, deadline, shutdown) ending the run.
func (e *runExecution) retries(ctx context.Context, res store.RunResult) bool {
	return e.run.Mode == store.RunModeJob && res.Status != store.RunSucceeded && res.Status != store.RunCancelled &&
		e.attempt <= e.run.BackoffLimit && ctx.Err() == nil
}

// commandResult says how an attempt's command ended, from the
// supervisor's answer or its call's error.
func (e *runExecution) commandResult(ctx, cctx context.Context, res *supervisorapi.CommandResult, err error, timeout time.Duration,
	log logr.Logger) store.RunResult {
	if err != nil {
		if ctx.Err() == nil && errors.Is(cctx.Err(), context.DeadlineExceeded) {
			return e.ended(ctx, store.RunResult{Status: store.RunTimedOut, Reason: reasonDeadlineExceeded,
				Message: fmt.Sprintf("the sandbox did not answer within the timeout (%s) and a grace of %s", timeout, supervisorGrace)})
		}
		apiErr := supervisorError(cctx, err)
		e.s.logFailure(log, apiErr, err)
		return e.ended(ctx, apiFailure(apiErr))
	}
	// The supervisor answered, so the command ended on its own (or by its
	// timeout), whatever cancel may have come meanwhile: the record says
	// what happened.
	out := store.RunResult{OutputBytes: e.outBytes}
	switch {
	case res.TimedOut:
		out.Status, out.Reason = store.RunTimedOut, reasonDeadlineExceeded
		out.Message = fmt.Sprintf("the command outlived its timeout of %s and was stopped", timeout)
	case res.OutOfMemory:
		out.Status, out.Reason = store.RunFailed, reasonOutOfMemory
		out.Message = "the sandbox neared its memory limit and this command held the most memory; it was killed"
	case res.Signal != "":
		out.Status, out.Reason = store.RunFailed, reasonSignaled
		out.Message = "the command was ended by " + res.Signal
	case res.ExitCode != 0:
		code := res.ExitCode
		out.Status, out.ExitCode, out.Reason = store.RunFailed, &code, reasonNonZeroExit
		out.Message = fmt.Sprintf("the command exited with status %d", code)
	default:
		code := 0
		out.Status, out.ExitCode = store.RunSucceeded, &code
	}
	return out
}

// heartbeatRun heartbeats the run until ctx ends, and cancels ctx when
// the heartbeat reports a cancel request, or that the run is no longer
// this executor's. alsoEach, when it returns a function, is called at
// every heartbeat too (a pool run renews its lease so).
func (s *Server) heartbeatRun(ctx context.Context, cancel context.CancelCauseFunc, id string, log logr.Logger,
	alsoEach func() *func(context.Context)) {
	t := time.NewTicker(s.runHeartbeat)
	defer t.Stop()
	for {
		select {
		case <-ctx.Done():
			return
		case <-t.C:
		}
		hctx, done := context.WithTimeout(context.WithoutCancel(ctx), runStoreTimeout)
		run, err := s.store.HeartbeatRun(hctx, id, s.replica)
		if f := alsoEach(); f != nil && err == nil {
			(*f)(hctx)
		}
		done()
		switch {
		case err == nil && run.CancelRequestedBy != "":
			cancel(cancelled{by: run.CancelRequestedBy})
			return
		case errors.Is(err, store.ErrConflict), errors.Is(err, store.ErrNotFound):
			log.Info("run heartbeat refused; stopping the command", "reason", err.Error())
			cancel(errRunLost)
			return
		case err != nil:
			// A store that does not answer for three intervals gets the
			// run failed by a sweeper; until then keep trying.
			log.Error(err, "heartbeat run")
		}
	}
}

// apiFailure is a run failed with an API error: its code, in CamelCase,
// is the reason.
func apiFailure(e *api.Error) store.RunResult {
	return store.RunResult{Status: store.RunFailed, Reason: camelCase(string(e.Code)), Message: e.Message}
}

// camelCase turns an error code such as sandbox_not_found into
// SandboxNotFound.
func camelCase(code string) string {
	var b strings.Builder
	for _, part := range strings.Split(code, "_") {
		if part != "" {
			b.WriteString(strings.ToUpper(part[:1]) + part[1:])
		}
	}
	return b.String()
}

// sweepRuns fails, every RunSweepInterval until the Server closes, the
// runs whose executor stopped heartbeating (releasing a pool run's
// lease), deletes the job sandboxes whose run has ended or is gone and
// the runs past their own TTL, and deletes the runs that finished longer
// than RunRetention ago (on its first tick and then at most every
// runPruneInterval). The store's updates are conditional and its
// deletion idempotent, so replicas sweeping together fail each run once
// and count each deleted run once.
func (s *Server) sweepRuns() {
	t := time.NewTicker(s.runSweep)
	defer t.Stop()
	log := s.log.WithName("runs")
	var lastPrune time.Time
	for {
		select {
		case <-s.closing:
			return
		case <-t.C:
		}
		// The store stamps heartbeats and ends with the wall clock, so
		// the bounds are taken from it too.
		now := time.Now()
		s.failStaleRuns(now, log)
		// A run's own TTL is kept to the sweep's interval: its DELETE
		// reads only the runs that have one, by index.
		s.deleteExpiredRuns(now, log)
		s.sweepRunSandboxes(log)
		if lastPrune.IsZero() || now.Sub(lastPrune) >= runPruneInterval {
			lastPrune = now
			s.pruneRuns(now, log)
			s.pruneAgentEvents(now, log)
		}
	}
}

// failStaleRuns fails the runs not heartbeated for three intervals.
func (s *Server) failStaleRuns(now time.Time, log logr.Logger) {
	ctx, done := context.WithTimeout(context.Background(), runStoreTimeout)
	failed, err := s.store.FailStaleRuns(ctx, now.Add(-3*s.runHeartbeat), reasonExecutorLost,
		"the control plane running it stopped before it finished")
	done()
	if err != nil {
		log.Error(err, "fail stale runs")
		return
	}
	for _, r := range failed {
		s.runNotes.notify(r.ID)
		countRun(metricRunsFinished, r, string(r.Status), string(r.Mode))
		log.Info("failed a run whose executor was lost", "run", r.ID, "agent", r.AgentID,
			"executor", r.Executor, "last_heartbeat", r.HeartbeatAt)
		if r.Mode == store.RunModePool {
			// Its sandbox goes back to be recycled now rather than when
			// the lease expires. (A job run's sandbox goes with the
			// sweep of job sandboxes that follows.)
			s.releasePoolRun(r, log.WithValues("run", r.ID))
		}
	}
}

// deleteExpiredRuns deletes the runs whose own TTL after they finished
// has passed.
func (s *Server) deleteExpiredRuns(now time.Time, log logr.Logger) {
	// Their artifacts' objects first, as for retention: the records are
	// what finds them.
	s.deleteExpiredArtifacts(time.Time{}, now, log)
	ctx, done := context.WithTimeout(context.Background(), runStoreTimeout)
	n, err := s.store.DeleteExpiredRuns(ctx, now)
	done()
	if err != nil {
		log.Error(err, "delete runs past their TTL")
		return
	}
	metricRunsDeleted.Add(float64(n))
	if n > 0 {
		log.V(1).Info("deleted the records of runs past their TTL", "runs", n)
	}
}

// pruneRuns deletes the runs that finished more than RunRetention ago;
// without a retention it deletes nothing.
func (s *Server) pruneRuns(now time.Time, log logr.Logger) {
	if s.runRetention <= 0 {
		return
	}
	s.deleteExpiredArtifacts(now.Add(-s.runRetention), now, log)
	ctx, done := context.WithTimeout(context.Background(), runStoreTimeout)
	n, err := s.store.DeleteFinishedRuns(ctx, now.Add(-s.runRetention))
	done()
	if err != nil {
		log.Error(err, "delete expired runs")
		return
	}
	metricRunsDeleted.Add(float64(n))
	if n > 0 {
		log.Info("deleted the records of runs past their retention", "runs", n, "retention", s.runRetention.String())
	}
}
