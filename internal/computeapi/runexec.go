package computeapi

import (
	"context"
	"errors"
	"fmt"
	"os"
	"strings"
	"sync"
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

// runExecutor does a run's attempt and records how it ended.
func (s *Server) runExecutor(ctx context.Context, cancel context.CancelCauseFunc, run store.Run, in runInput) {
	log := s.log.WithName("runs").WithValues("run", run.ID, "agent", run.AgentID)
	if id := requestID(ctx); id != "" {
		log = log.WithValues("request_id", id)
	}
	res := s.attemptRun(ctx, cancel, run, in, log)
	if errors.Is(context.Cause(ctx), errRunLost) {
		log.Info("run taken over or ended elsewhere; not recording its end here")
		return
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
		metricRunsFinished.WithLabelValues(string(ended.Status), string(ended.Mode)).Inc()
		// A run cancelled while queued never started, and has no
		// duration.
		if ended.StartedAt != nil && ended.FinishedAt != nil {
			metricRunSeconds.WithLabelValues(string(ended.Mode)).Observe(ended.FinishedAt.Sub(*ended.StartedAt).Seconds())
		}
	}
}

// attemptRun starts the attempt, runs the command and says how it ended.
func (s *Server) attemptRun(ctx context.Context, cancel context.CancelCauseFunc, run store.Run, in runInput, log logr.Logger) store.RunResult {
	// The sandbox is looked up before the attempt starts so that the
	// record names it; the wait for it to serve (reach) comes after, while
	// the run heartbeats, since a resume can outlast the sweeper's bound.
	sb, apiErr := s.agentSandbox(ctx, run.AgentID)
	if apiErr != nil {
		return apiFailure(apiErr)
	}
	sctx, done := context.WithTimeout(context.WithoutCancel(ctx), runStoreTimeout)
	started, err := s.store.StartRunAttempt(sctx, run.ID, s.replica, sb.Namespace+"/"+sb.Name)
	done()
	if err != nil {
		if errors.Is(err, store.ErrRunFinished) {
			// Cancelled while queued.
			cancel(errRunLost)
			return store.RunResult{}
		}
		log.Error(err, "start run attempt")
		return store.RunResult{Status: store.RunFailed, Reason: "Internal", Message: "could not record the start of the run"}
	}
	s.runNotes.notify(run.ID)
	metricRunAttempts.WithLabelValues(string(started.Mode)).Inc()
	if started.CancelRequestedBy != "" {
		cancel(cancelled{by: started.CancelRequestedBy})
	}
	// The heartbeats end before the run's end is recorded (and before
	// Close returns, which the store's closing follows).
	var beats sync.WaitGroup
	defer beats.Wait()
	hctx, stopBeats := context.WithCancel(ctx)
	defer stopBeats()
	// The heartbeats get the logger as it is now: reach below replaces
	// log, which the goroutine must not read meanwhile.
	beatLog := log
	beats.Go(func() { s.heartbeatRun(hctx, cancel, run.ID, beatLog) })

	var outBytes int64
	result := func(r store.RunResult) store.RunResult {
		r.OutputBytes = outBytes
		var c cancelled
		switch cause := context.Cause(ctx); {
		case errors.As(cause, &c):
			return store.RunResult{Status: store.RunCancelled, Reason: "Cancelled", CancelledBy: c.by,
				Message: "cancelled by " + c.by, OutputBytes: outBytes}
		case errors.Is(cause, errServerClosing):
			return store.RunResult{Status: store.RunFailed, Reason: reasonExecutorStopped,
				Message: "the control plane running it shut down before it finished; the command was stopped", OutputBytes: outBytes}
		}
		return r
	}
	sup, _, log, apiErr := s.reach(ctx, run.AgentID, log)
	if apiErr != nil {
		return result(apiFailure(apiErr))
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
	ended := s.commandEvents(sb.Namespace, sb.Name, run.AgentID, run.Command.Argv, run.ID)
	res, err := sup.RunCommandStream(cctx, req, func(ev supervisorapi.CommandEvent) error {
		outBytes += int64(len(ev.Data))
		if ev.Truncated {
			output.sandboxTruncated()
		}
		output.write(ev.Stream, []byte(ev.Data))
		return nil
	})
	ended(res, err)
	if err != nil {
		if ctx.Err() == nil && errors.Is(cctx.Err(), context.DeadlineExceeded) {
			return result(store.RunResult{Status: store.RunTimedOut, Reason: reasonDeadlineExceeded,
				Message: fmt.Sprintf("the sandbox did not answer within the timeout (%s) and a grace of %s", timeout, supervisorGrace)})
		}
		apiErr := supervisorError(cctx, err)
		s.logFailure(log, apiErr, err)
		return result(apiFailure(apiErr))
	}
	// The supervisor answered, so the command ended on its own (or by its
	// timeout), whatever cancel may have come meanwhile: the record says
	// what happened.
	out := store.RunResult{OutputBytes: outBytes}
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
// this executor's.
func (s *Server) heartbeatRun(ctx context.Context, cancel context.CancelCauseFunc, id string, log logr.Logger) {
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
// runs whose executor stopped heartbeating, and deletes the runs that
// finished longer than RunRetention ago (on its first tick and then at
// most every runPruneInterval). The store's updates are conditional and
// its deletion idempotent, so replicas sweeping together fail each run
// once and count each deleted run once.
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
		metricRunsFinished.WithLabelValues(string(r.Status), string(r.Mode)).Inc()
		log.Info("failed a run whose executor was lost", "run", r.ID, "agent", r.AgentID,
			"executor", r.Executor, "last_heartbeat", r.HeartbeatAt)
	}
}

// pruneRuns deletes the runs that finished more than RunRetention ago;
// without a retention it deletes nothing.
func (s *Server) pruneRuns(now time.Time, log logr.Logger) {
	if s.runRetention <= 0 {
		return
	}
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
