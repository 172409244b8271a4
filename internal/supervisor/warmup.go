package supervisor

import (
	"context"
	"crypto/sha256"
	"fmt"
	"net/http"
	"runtime/debug"
	"strings"
	"time"

	"github.com/agentbox/terraform-provider-agentbox/internal/supervisor/httpcall"
	api "github.com/agentbox/terraform-provider-agentbox/internal/supervisor/supervisorapi"
)

// WarmUpTimeout bounds WarmUp: a spawn of `true` takes milliseconds, even
// in a fresh gVisor sandbox; one that takes longer is left to the first
// call rather than holding the sandbox back from serving.
const WarmUpTimeout = 10 * time.Second

// warmUpCommand is the request WarmUp runs, as a caller's JSON body: a
// program every image with a shell has, and that does nothing.
const warmUpCommand = `{"command":["true"]}`

// WarmUp runs a throwaway command along the path /v1/commands takes, from
// the decoding of its body to the encoding of its result and record, so
// that the first command a caller sends costs what the tenth does. In a
// fresh gVisor sandbox the first spawn pays for what later ones find
// ready: the supervisor's own code and data faulted in page by page, the
// sandbox kernel's first fork, exec and ptrace of the session, and the
// image's loader and C library read through the gofer; make bench's
// claim loop saw a first echo take 30 ms by the supervisor's clock where
// the second took 20. The supervisor calls it before it listens, since
// the sandbox counts as ready from the moment its port accepts.
//
// Nothing is recorded: no call was made. An error only means the first
// call pays the cost instead (an image without `true` in the commands'
// PATH, say); the caller logs it and serves anyway.
func (s *Server) WarmUp(ctx context.Context) error {
	ctx, cancel := context.WithTimeout(ctx, WarmUpTimeout)
	defer cancel()
	start := time.Now()
	r, err := http.NewRequestWithContext(ctx, http.MethodPost, api.PathCommands, strings.NewReader(warmUpCommand))
	if err != nil {
		return err
	}
	r.Header.Set("Content-Type", "application/json")
	w := &discardResponse{header: http.Header{}}
	var req api.CommandRequest
	if e := httpcall.DecodeJSON(w, r, s.cfg.MaxRequestBytes, &req); e != nil {
		return e
	}
	spec, e := s.runner.Prepare(&req, s.cfg.DefaultTimeout, s.cfg.MaxTimeout)
	if e != nil {
		return e
	}
	res, e := s.runCaptured(ctx, spec)
	if e != nil {
		return e
	}
	if res.ExitCode != 0 || res.Signal != "" {
		return fmt.Errorf("%s exited %d %s", spec.Path, res.ExitCode, res.Signal)
	}
	httpcall.WriteJSON(w, http.StatusOK, res)
	info := &requestInfo{op: "run_command", Info: httpcall.Info{Program: req.Command[0], Result: res}}
	sum := sha256.New()
	sum.Write([]byte(warmUpCommand))
	if _, err := api.EncodeAuditRecord(*s.auditRecord(r, start, http.StatusOK, info, sum)); err != nil {
		return err
	}
	return nil
}

// discardResponse is the ResponseWriter of WarmUp's throwaway command.
type discardResponse struct{ header http.Header }

func (d *discardResponse) Header() http.Header         { return d.header }
func (d *discardResponse) Write(p []byte) (int, error) { return len(p), nil }
func (d *discardResponse) WriteHeader(int)             {}

// DefaultIdleTrim is how long the supervisor waits, once no call is being
// served, before it hands the memory its calls freed back to the sandbox
// (Config.IdleTrim).
const DefaultIdleTrim = 5 * time.Second

// TrimMemory runs a garbage collection and returns every free page of the
// Go heap to the sandbox kernel at once. Go's background scavenger
// returns them slowly and keeps a margin above the heap's goal, and gVisor
// counts a sandbox's anonymous memory in whole 2 MiB units, so a heap
// that briefly grew (a TLS handshake, a file transfer, the start itself)
// stays in the pod's resident memory long after. It costs a collection
// of a small heap, about a millisecond, which is why it waits for idle.
func TrimMemory() { debug.FreeOSMemory() }

// idleTrimmer calls trim once the server has served no call for after
// since the last call ended: once per idle spell, so a sandbox left idle
// is trimmed once, and one probed every 20 s once after each probe (a
// collection of a heap with next to nothing in it).
type idleTrimmer struct {
	after time.Duration
	trim  func()
	timer *time.Timer
}

// newIdleTrimmer returns the trimmer of a server whose idleness idle
// reports; nil when after is not positive (no trim).
func newIdleTrimmer(after time.Duration, trim func(), idle func() bool) *idleTrimmer {
	if after <= 0 {
		return nil
	}
	t := &idleTrimmer{after: after, trim: trim}
	t.timer = time.AfterFunc(time.Hour, func() {
		// A call may have begun since the timer fired; trimming under it
		// is harmless, but pointless while it allocates.
		if idle() {
			t.trim()
		}
	})
	t.timer.Stop()
	return t
}

// busy is called as a call begins: no trim under it.
func (t *idleTrimmer) busy() {
	if t != nil {
		t.timer.Stop()
	}
}

// idle is called when the last call being served ends.
func (t *idleTrimmer) idle() {
	if t != nil {
		t.timer.Reset(t.after)
	}
}

func (t *idleTrimmer) stop() {
	if t != nil {
		t.timer.Stop()
	}
}
