package failover

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"errors"
	"fmt"
	"net/http"
	"net/url"
	"sort"
	"strings"
	"sync"
	"testing"
	"time"

	apiclient "github.com/agentbox/terraform-provider-agentbox/internal/computeapi/client"
)

// Client-side bounds of the calls. Each is far above what the call takes
// on a quiet cluster, so a call that reaches one has hung.
const (
	commandTimeout = 60 * time.Second
	leaseTimeout   = 60 * time.Second
	// resumeTimeout covers the Compute API's own bound on a call's wait
	// for a resume (3 minutes) and the answer after it.
	resumeTimeout = 4 * time.Minute
	// poolWaitSeconds is how long a pool lease waits for a free sandbox.
	poolWaitSeconds = 20
	// poolLeaseTTL is short so that a lease whose release was lost in a
	// fault ends soon.
	poolLeaseTTL = 30
)

// retryable are the documented codes a call may fail with while a part of
// the platform is away, and that a client retries.
var retryable = map[apiclient.Code]bool{
	apiclient.CodeUnavailable:           true,
	apiclient.CodeSupervisorUnavailable: true,
	apiclient.CodeTimeout:               true,
	apiclient.CodeSandboxNotReady:       true,
	apiclient.CodePoolExhausted:         true,
	apiclient.CodeResourceExhausted:     true,
}

// call is one Compute API call the load made.
type call struct {
	Op, Agent  string
	Start, End time.Time
	Timeout    time.Duration
	RequestID  string
	// Code is "" for a success, the API's error code, "transport" for a
	// connection that failed or broke (no answer from the API: a replica
	// went away under it), "tls" for a serving certificate the client
	// refused, or "hung" when the client's bound ran out.
	Code string
	Err  string
}

func (c call) ok() bool { return c.Code == "" }

// down reports whether the call failed for want of the API: a pool without
// a free sandbox, or a sandbox busy with commands, are answers of an API
// that works.
func (c call) down() bool {
	return !c.ok() && c.Code != string(apiclient.CodePoolExhausted) && c.Code != string(apiclient.CodeResourceExhausted)
}

// grant is one pool lease as its holder saw it: held for sure from the
// acquire's answer (Got) to the sending of its release (Released), or to
// the end of the load when the release never succeeded.
type grant struct {
	Holder, LeaseID, Agent, Sandbox string
	Got, Released                   time.Time
	ReleaseOK                       bool
}

// recorder collects the load's calls and lease grants.
type recorder struct {
	mu     sync.Mutex
	calls  []call
	grants []grant
}

type requestIDKey struct{}

// idTransport sets each call's X-Request-Id from its context, so that the
// audit records of succeeded calls can be looked up one by one.
type idTransport struct{ base http.RoundTripper }

func (t idTransport) RoundTrip(r *http.Request) (*http.Response, error) {
	if id, ok := r.Context().Value(requestIDKey{}).(string); ok {
		r = r.Clone(r.Context())
		r.Header.Set("X-Request-Id", id)
	}
	return t.base.RoundTrip(r)
}

func newID(prefix string) string {
	b := make([]byte, 8)
	_, _ = rand.Read(b)
	return prefix + "-" + hex.EncodeToString(b)
}

// do runs fn as one recorded call with its own request ID and timeout.
func (r *recorder) do(ctx context.Context, op, agent string, timeout time.Duration, fn func(ctx context.Context) error) error {
	id := newID("fo")
	cctx, cancel := context.WithTimeout(context.WithValue(ctx, requestIDKey{}, id), timeout)
	defer cancel()
	c := call{Op: op, Agent: agent, Start: time.Now(), Timeout: timeout, RequestID: id}
	err := fn(cctx)
	c.End = time.Now()
	if err != nil {
		c.Err = err.Error()
		var apiErr *apiclient.Error
		switch {
		case errors.As(err, &apiErr):
			c.Code = string(apiErr.Code)
		case strings.Contains(err.Error(), "x509: "):
			// A replica whose certificate the client refuses is not away:
			// it answers, wrongly, and a retry may reach it again.
			c.Code = "tls"
		case cctx.Err() != nil && ctx.Err() == nil:
			c.Code = "hung"
		case ctx.Err() != nil:
			// The load was stopped under the call: not the platform's doing.
			return err
		default:
			c.Code = "transport"
		}
	}
	r.mu.Lock()
	r.calls = append(r.calls, c)
	r.mu.Unlock()
	return err
}

func (r *recorder) addGrant(g grant) {
	r.mu.Lock()
	r.grants = append(r.grants, g)
	r.mu.Unlock()
}

// poolWorker leases a sandbox from the pool, runs a command in it and
// releases it, over and over. An acquire that fails is retried with the
// same request ID, so that a lease granted while its answer was lost is
// picked up, not left behind.
func poolWorker(ctx context.Context, rec *recorder, api *apiclient.Client, ns, pool, holder string) {
	for ctx.Err() == nil {
		reqID := newID(holder)
		var l *apiclient.PoolLease
		for attempt := 0; attempt < 5 && ctx.Err() == nil; attempt++ {
			err := rec.do(ctx, "pool_lease", "", leaseTimeout, func(ctx context.Context) error {
				var err error
				l, err = api.AcquirePoolLease(ctx, ns, pool, apiclient.AcquireLeaseRequest{
					Holder: holder, RequestID: reqID, TTLSeconds: poolLeaseTTL, WaitSeconds: poolWaitSeconds})
				return err
			})
			if err == nil {
				break
			}
			l = nil
			sleep(ctx, time.Second)
		}
		if l == nil {
			continue
		}
		g := grant{Holder: holder, LeaseID: l.LeaseID, Agent: l.AgentID, Sandbox: l.Sandbox, Got: time.Now()}
		var out string
		_ = rec.do(ctx, "pool_run_command", l.AgentID, commandTimeout, func(ctx context.Context) error {
			res, err := api.RunCommand(ctx, l.AgentID, apiclient.RunCommandRequest{Command: []string{"sh", "-c", "echo " + holder}})
			if err == nil {
				out = strings.TrimSpace(res.Stdout)
				if out != holder {
					return fmt.Errorf("pool sandbox answered %q, want %q", out, holder)
				}
			}
			return err
		})
		g.Released = time.Now()
		for attempt := 0; attempt < 5; attempt++ {
			// The release goes out even when the load is stopping: a
			// holder that walks away leaves its sandbox to the TTL.
			err := rec.do(context.WithoutCancel(ctx), "pool_release", l.AgentID, leaseTimeout, func(ctx context.Context) error {
				return api.ReleaseLease(ctx, l.AgentID, apiclient.ReleaseLeaseRequest{Holder: holder, LeaseID: l.LeaseID})
			})
			if err == nil {
				g.ReleaseOK = true
				break
			}
			sleep(context.Background(), time.Second)
		}
		rec.addGrant(g)
		sleep(ctx, 500*time.Millisecond)
	}
}

// agentWorker runs commands on one agent's sandbox, each appending a line
// to a file of its workspace and counting the lines: a count that does not
// grow by one means the workspace lost a write that succeeded.
func agentWorker(ctx context.Context, rec *recorder, api *apiclient.Client, agent string, pause, timeout time.Duration, lost *[]string, mu *sync.Mutex) {
	want := 0
	for ctx.Err() == nil {
		var res *apiclient.CommandResult
		err := rec.do(ctx, "run_command", agent, timeout, func(ctx context.Context) error {
			var err error
			res, err = api.RunCommand(ctx, agent, apiclient.RunCommandRequest{Command: []string{"sh", "-c", "echo x >> failover.log && wc -l < failover.log"}})
			return err
		})
		if err == nil {
			var n int
			_, _ = fmt.Sscanf(strings.TrimSpace(res.Stdout), "%d", &n)
			// A call whose answer was lost may still have run: the count
			// may run ahead, never behind.
			if n < want+1 {
				mu.Lock()
				*lost = append(*lost, fmt.Sprintf("%s: %d lines after a succeeded append, want at least %d", agent, n, want+1))
				mu.Unlock()
			}
			want = n
		}
		sleep(ctx, pause)
	}
}

func sleep(ctx context.Context, d time.Duration) {
	select {
	case <-ctx.Done():
	case <-time.After(d):
	}
}

// fault is one fault the test injected, and when.
type fault struct {
	Name string
	At   time.Time
}

// unavailability is, for the calls that started after the fault (and
// before the next one), the time from the first failure (see call.down) a
// caller saw to the end of the first call that started after it and
// succeeded: how long callers saw the API away. It counts from a failure's
// answer, not its start, so that a pool lease that waited long and was
// then cut does not count its wait. Zero when no call failed; negative
// when none succeeded after.
func unavailability(calls []call, from, to time.Time) (time.Duration, int) {
	var seen time.Time
	n := 0
	for _, c := range calls {
		if !c.Start.Before(from) && c.Start.Before(to) && c.down() {
			n++
			if seen.IsZero() || c.End.Before(seen) {
				seen = c.End
			}
		}
	}
	if n == 0 {
		return 0, 0
	}
	var back time.Time
	for _, c := range calls {
		if c.ok() && !c.Start.Before(seen) && (back.IsZero() || c.End.Before(back)) {
			back = c.End
		}
	}
	if back.IsZero() {
		return -1, n
	}
	return back.Sub(seen), n
}

// checkCalls asserts that every call succeeded or failed with a retryable
// code within its bound, and logs the figures per operation.
func checkCalls(t *testing.T, calls []call) {
	t.Helper()
	type stat struct {
		n, ok int
		codes map[string]int
		max   time.Duration
	}
	stats := map[string]*stat{}
	transport := map[string]int{}
	for _, c := range calls {
		if c.Code == "transport" {
			transport[c.Err]++
		}
		s := stats[c.Op]
		if s == nil {
			s = &stat{codes: map[string]int{}}
			stats[c.Op] = s
		}
		s.n++
		d := c.End.Sub(c.Start)
		s.max = max(s.max, d)
		if c.ok() {
			s.ok++
			continue
		}
		s.codes[c.Code]++
		switch {
		case c.Code == "hung":
			t.Errorf("INVARIANT hung call: %s %s (request %s) started %s had no answer within %s: %s",
				c.Op, c.Agent, c.RequestID, c.Start.Format(time.RFC3339Nano), c.Timeout, c.Err)
		case c.Code == "transport", retryable[apiclient.Code(c.Code)]:
		default:
			t.Errorf("INVARIANT call failed with a code that is not retryable: %s %s (request %s) at %s: %s: %s",
				c.Op, c.Agent, c.RequestID, c.Start.Format(time.RFC3339Nano), c.Code, c.Err)
		}
	}
	ops := make([]string, 0, len(stats))
	for op := range stats {
		ops = append(ops, op)
	}
	sort.Strings(ops)
	for _, op := range ops {
		s := stats[op]
		t.Logf("FIGURE calls %-17s %5d, %5d ok, longest %8s, failures %v", op, s.n, s.ok, s.max.Round(time.Millisecond), s.codes)
	}
	shown := 0
	for msg, n := range transport {
		if shown++; shown > 10 {
			t.Logf("... and %d more transport failure messages", len(transport)-10)
			break
		}
		t.Logf("transport failure (%d): %s", n, msg)
	}
}

// checkGrants asserts that no pool sandbox was held by two leases at once.
func checkGrants(t *testing.T, grants []grant, end time.Time) {
	t.Helper()
	for _, v := range grantViolations(grants, end) {
		t.Errorf("INVARIANT %s", v)
	}
	released, sandboxes := 0, map[string]bool{}
	for _, g := range grants {
		sandboxes[g.Agent] = true
		if g.ReleaseOK {
			released++
		}
	}
	t.Logf("FIGURE pool leases granted %d, released %d, sandboxes %d", len(grants), released, len(sandboxes))
}

// grantViolations lists the pool sandboxes held by two leases at once, and
// those leased more than once at all: a released pool sandbox is deleted,
// so a second lease on it is a second holder even without an overlap. A
// lease whose release never succeeded counts as held until end.
func grantViolations(grants []grant, end time.Time) []string {
	bySandbox := map[string][]grant{}
	for _, g := range grants {
		if !g.ReleaseOK {
			g.Released = end
		}
		bySandbox[g.Agent] = append(bySandbox[g.Agent], g)
	}
	agents := make([]string, 0, len(bySandbox))
	for a := range bySandbox {
		agents = append(agents, a)
	}
	sort.Strings(agents)
	var out []string
	for _, agent := range agents {
		gs := bySandbox[agent]
		sort.Slice(gs, func(i, j int) bool { return gs[i].Got.Before(gs[j].Got) })
		for i := 1; i < len(gs); i++ {
			if gs[i].Got.Before(gs[i-1].Released) {
				out = append(out, fmt.Sprintf("double pool lease: sandbox %s (%s) held by %s (lease %s, %s to %s) and %s (lease %s from %s)",
					gs[i].Sandbox, agent, gs[i-1].Holder, gs[i-1].LeaseID, gs[i-1].Got.Format(time.RFC3339Nano), gs[i-1].Released.Format(time.RFC3339Nano),
					gs[i].Holder, gs[i].LeaseID, gs[i].Got.Format(time.RFC3339Nano)))
			}
		}
		if len(gs) > 1 {
			out = append(out, fmt.Sprintf("pool sandbox %s (%s) was leased %d times", gs[0].Sandbox, agent, len(gs)))
		}
	}
	return out
}

// checkAudit asserts that the audit chain verifies and that every succeeded
// call has its audit record.
func checkAudit(t *testing.T, ctx context.Context, api *apiclient.Client, calls []call, since time.Time) {
	t.Helper()
	v, err := api.VerifyAudit(ctx)
	if err != nil {
		t.Errorf("verify the audit chain: %v", err)
	} else if !v.OK {
		t.Errorf("INVARIANT the audit chain does not verify: %+v", v.Break)
	} else {
		t.Logf("FIGURE audit chain verifies: %d records, head %.12s", v.Records, v.Head)
	}
	seen := map[string]string{}
	q := url.Values{"since": {since.UTC().Format(time.RFC3339Nano)}, "limit": {"1000"}}
	for pages := 0; pages < 1000; pages++ {
		var p *apiclient.AuditPage
		if err := retry(ctx, func(ctx context.Context) error {
			var err error
			p, err = api.QueryAudit(ctx, q)
			return err
		}); err != nil {
			t.Errorf("query the audit log: %v", err)
			return
		}
		for _, r := range p.Records {
			// The supervisor's records of a call carry its request ID too.
			if r.RequestID != "" && !strings.HasPrefix(r.Operation, "supervisor:") {
				seen[r.RequestID] = r.Result
			}
		}
		if p.Next == 0 {
			break
		}
		q.Set("cursor", fmt.Sprint(p.Next))
	}
	missing, okCalls := 0, 0
	for _, c := range calls {
		if !c.ok() {
			continue
		}
		okCalls++
		res, found := seen[c.RequestID]
		switch {
		case !found:
			missing++
			if missing <= 10 {
				t.Errorf("INVARIANT no audit record for the succeeded call %s %s (request %s) at %s", c.Op, c.Agent, c.RequestID, c.Start.Format(time.RFC3339Nano))
			}
		case res != "ok":
			t.Errorf("INVARIANT the audit record of the succeeded call %s %s (request %s) says %q", c.Op, c.Agent, c.RequestID, res)
		}
	}
	if missing > 10 {
		t.Errorf("INVARIANT ... and %d more succeeded calls without an audit record", missing-10)
	}
	t.Logf("FIGURE audit records found for %d of %d succeeded calls", okCalls-missing, okCalls)
}

// retry runs fn until it succeeds, for up to a minute: checks made after
// the faults must not fail on a platform that is still settling.
func retry(ctx context.Context, fn func(ctx context.Context) error) error {
	deadline := time.Now().Add(time.Minute)
	for {
		cctx, cancel := context.WithTimeout(ctx, 20*time.Second)
		err := fn(cctx)
		cancel()
		if err == nil || time.Now().After(deadline) || ctx.Err() != nil {
			return err
		}
		sleep(ctx, 2*time.Second)
	}
}
