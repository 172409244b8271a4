package supervisor

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"net/http"
	"slices"
	"strings"
	"sync"
	"syscall"
	"time"
	"unicode/utf8"

	"github.com/agentbox/terraform-provider-agentbox/internal/supervisor/httpcall"
	api "github.com/agentbox/terraform-provider-agentbox/internal/supervisor/supervisorapi"
)

// Background processes keep their output in memory, in a ring per stream,
// rather than in a log file under /tmp: /tmp is writable by the code in
// the sandbox, which could then rewrite or fill what the caller reads, a
// file grows with the process's lifetime on the pod's ephemeral storage
// (and counts against the workspace cap if it lives there), and a process
// that is forgotten would leave it behind. A ring costs at most
// MaxProcesses × 2 × ProcessOutputBytes of memory, and a caller that
// wants everything can redirect to a file it chooses itself.

// bgProcess is a background process: started by one call, watched by a
// goroutine, stopped by another call or by shutdown.
type bgProcess struct {
	id      string
	argv    []string
	pid     int
	started time.Time
	stdout  *ring
	stderr  *ring
	done    chan struct{} // closed once the leader has been waited for

	// The rest is set when done is closed, under Server.mu.
	exit *api.CommandResult
	// sweep is set when the leader ended after Terminate: members of its
	// group that ignored SIGTERM are left for Kill.
	sweep bool
}

func newProcessID() string {
	b := make([]byte, 6)
	_, _ = rand.Read(b)
	return "p-" + hex.EncodeToString(b)
}

// startProcessCall serves POST /v1/processes.
func (s *Server) startProcessCall(w *recorder, r *http.Request, info *requestInfo) {
	var req api.ProcessRequest
	if !s.decode(w, r, info, &req) {
		return
	}
	info.SetProgram(req.Command)
	p, apiErr := s.startProcess(&req)
	if apiErr != nil {
		info.Fail(w, apiErr)
		return
	}
	httpcall.WriteJSON(w, http.StatusCreated, s.describe(p, false))
}

func (s *Server) startProcess(req *api.ProcessRequest) (*bgProcess, *api.Error) {
	// The timeout and output cap prepare checks do not apply: the process
	// runs until stopped and its output goes to rings.
	spec, apiErr := s.runner.Prepare(&api.CommandRequest{Command: req.Command, Cwd: req.Cwd, Env: req.Env, Stdin: req.Stdin},
		s.cfg.DefaultTimeout, s.cfg.MaxTimeout)
	if apiErr != nil {
		return nil, apiErr
	}
	p := &bgProcess{
		id:     newProcessID(),
		argv:   slices.Clone(req.Command),
		stdout: newRing(s.cfg.ProcessOutputBytes),
		stderr: newRing(s.cfg.ProcessOutputBytes),
		done:   make(chan struct{}),
	}
	// The slot is reserved before the spawn, so that concurrent starts
	// cannot pass the limit together; the entry is only listed once it
	// has a PID.
	s.mu.Lock()
	if s.terminating {
		s.mu.Unlock()
		return nil, api.Errorf(api.CodeUnavailable, "the supervisor is shutting down")
	}
	if len(s.procs)+s.procsStarting >= s.cfg.MaxProcesses && !s.evictExitedLocked() {
		s.mu.Unlock()
		return nil, api.Errorf(api.CodeResourceExhausted, "%d background processes are already running", s.cfg.MaxProcesses)
	}
	s.procsStarting++
	// Counted as a request, so that Wait covers it at shutdown.
	s.running++
	s.mu.Unlock()

	// Not the request's context: the process outlives the call. It ends
	// by a signal from DELETE, Terminate or Kill.
	ctx := context.Background()
	proc, apiErr := s.runner.Spawn(ctx, spec, p.stdout, p.stderr)
	s.mu.Lock()
	s.procsStarting--
	if apiErr == nil {
		p.pid, p.started = proc.Pid(), proc.Started
		s.procs = append(s.procs, p)
	}
	s.mu.Unlock()
	if apiErr != nil {
		s.end()
		return nil, apiErr
	}
	go func() {
		defer s.end()
		res, apiErr := s.runner.Wait(ctx, proc)
		if apiErr != nil {
			res = &api.CommandResult{ExitCode: -1, DurationMS: time.Since(p.started).Milliseconds()}
		}
		s.mu.Lock()
		p.exit, p.sweep = res, s.terminating
		s.mu.Unlock()
		close(p.done)
		s.log.Info("background process exited", "id", p.id, "program", p.argv[0], "exit_code", res.ExitCode, "signal", res.Signal)
	}()
	return p, nil
}

// evictExitedLocked forgets the oldest process that has exited, to make
// room for a new one.
func (s *Server) evictExitedLocked() bool {
	for i, p := range s.procs {
		if p.exit != nil {
			s.procs = slices.Delete(s.procs, i, i+1)
			return true
		}
	}
	return false
}

func (s *Server) describe(p *bgProcess, output bool) api.ProcessInfo {
	s.mu.Lock()
	info := api.ProcessInfo{ID: p.id, Command: p.argv, PID: p.pid, StartedAt: p.started.UTC(), Running: p.exit == nil}
	if p.exit != nil {
		exit := *p.exit
		info.Exit = &exit
	}
	s.mu.Unlock()
	if output {
		var cutOut, cutErr bool
		info.Stdout, cutOut = p.stdout.text()
		info.Stderr, cutErr = p.stderr.text()
		info.Truncated = cutOut || cutErr
	}
	return info
}

func (s *Server) lookupProcess(id string) *bgProcess {
	s.mu.Lock()
	defer s.mu.Unlock()
	for _, p := range s.procs {
		if p.id == id {
			return p
		}
	}
	return nil
}

// listProcesses serves GET /v1/processes.
func (s *Server) listProcesses(w *recorder, _ *http.Request, _ *requestInfo) {
	s.mu.Lock()
	procs := slices.Clone(s.procs)
	s.mu.Unlock()
	list := api.ProcessList{Processes: make([]api.ProcessInfo, 0, len(procs))}
	for _, p := range procs {
		list.Processes = append(list.Processes, s.describe(p, false))
	}
	httpcall.WriteJSON(w, http.StatusOK, list)
}

// serveProcess serves GET and DELETE /v1/processes/{id}.
func (s *Server) serveProcess(w *recorder, r *http.Request, info *requestInfo) {
	id := strings.TrimPrefix(r.URL.Path, api.PathProcesses+"/")
	p := s.lookupProcess(id)
	if p == nil {
		info.Fail(w, api.Errorf(api.CodeNotFound, "no background process %q", id))
		return
	}
	info.Program = p.argv[0]
	if r.Method == http.MethodDelete {
		s.stopProcess(p)
		s.mu.Lock()
		s.procs = slices.DeleteFunc(s.procs, func(q *bgProcess) bool { return q == p })
		s.mu.Unlock()
	}
	desc := s.describe(p, true)
	if r.Method == http.MethodDelete {
		// The outcome of this call is how the process ended; a GET only
		// looks at it.
		info.Result = desc.Exit
	}
	httpcall.WriteJSON(w, http.StatusOK, desc)
}

// stopProcess sends SIGTERM to the process's group, SIGKILL after
// ProcessKillGrace if the leader has not exited, and waits for it. The
// group is swept with SIGKILL once the leader is gone, for members that
// ignored SIGTERM: the group ID cannot be reused while any of them lives.
func (s *Server) stopProcess(p *bgProcess) {
	select {
	case <-p.done:
		// Exited before: its group ID may since belong to someone else.
		return
	default:
	}
	_ = syscall.Kill(-p.pid, syscall.SIGTERM)
	t := time.NewTimer(s.cfg.ProcessKillGrace)
	defer t.Stop()
	select {
	case <-p.done:
	case <-t.C:
	}
	_ = syscall.Kill(-p.pid, syscall.SIGKILL)
	<-p.done
}

// ring keeps the last size bytes written to it.
type ring struct {
	mu    sync.Mutex
	buf   []byte
	next  int  // where the next byte goes once buf is full
	full  bool // buf has wrapped: older bytes were dropped
	limit int
}

func newRing(size int) *ring { return &ring{limit: size} }

func (r *ring) Write(p []byte) (int, error) {
	r.mu.Lock()
	defer r.mu.Unlock()
	n := len(p)
	if len(p) >= r.limit {
		// Only the tail survives; keep the buffer at its full size.
		r.full = r.full || len(r.buf) > 0 || len(p) > r.limit
		r.buf = append(r.buf[:0], p[len(p)-r.limit:]...)
		r.next = 0
		return n, nil
	}
	// Grow lazily, so that a quiet process costs little.
	if !r.full {
		room := r.limit - len(r.buf)
		if len(p) <= room {
			r.buf = append(r.buf, p...)
			return n, nil
		}
		r.buf = append(r.buf, p[:room]...)
		p = p[room:]
		r.full, r.next = true, 0
	}
	for len(p) > 0 {
		c := copy(r.buf[r.next:], p)
		p = p[c:]
		r.next = (r.next + c) % r.limit
	}
	return n, nil
}

// text returns the buffered bytes, oldest first, as valid UTF-8, and
// whether older bytes were dropped.
func (r *ring) text() (string, bool) {
	r.mu.Lock()
	var b strings.Builder
	b.Grow(len(r.buf))
	b.Write(r.buf[r.next:])
	b.Write(r.buf[:r.next])
	full := r.full
	r.mu.Unlock()
	s := b.String()
	if full {
		// The oldest bytes may be the end of a character whose start was
		// dropped; they would only show up as replacement characters.
		for i := 0; i < utf8.UTFMax-1 && len(s) > 0 && !utf8.RuneStart(s[0]); i++ {
			s = s[1:]
		}
	}
	return strings.ToValidUTF8(s, "\uFFFD"), full
}
