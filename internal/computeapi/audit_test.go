package computeapi

import (
	"context"
	"encoding/pem"
	"net/http"
	"net/http/httptest"
	"net/url"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	dto "github.com/prometheus/client_model/go"

	api "github.com/agentbox/terraform-provider-agentbox/internal/computeapi/client"
	"github.com/agentbox/terraform-provider-agentbox/internal/redact"
	"github.com/agentbox/terraform-provider-agentbox/internal/store"
)

// storeAPI serves the fixture's cluster through a second Server that has a
// real SQLite store: tokens from the store beside the admin token, and
// every call audited.
func storeAPI(t *testing.T, f *fixture) (*Server, *store.Store, func(token string) *api.Client) {
	t.Helper()
	st, err := store.OpenSQLite(context.Background(), filepath.Join(t.TempDir(), "agentbox.db"), store.Options{Now: f.clock.Now})
	if err != nil {
		t.Fatal(err)
	}
	admin, err := NewAdminTokenAuthenticator(HashToken(adminToken))
	if err != nil {
		t.Fatal(err)
	}
	srv, err := NewServer(Options{Sandboxes: f.kube, Leases: f.kube, Supervisors: f.services.supervisors,
		Authenticator: ChainAuthenticators(admin, NewStoreAuthenticator(st)), TrustDomain: testTrustDomain,
		Clock: f.clock, Store: st})
	if err != nil {
		t.Fatal(err)
	}
	ts := httptest.NewTLSServer(contractCheck(t, srv.Handler()))
	t.Cleanup(func() {
		ts.Close()
		srv.Close()
		st.Close()
	})
	caPEM := pem.EncodeToMemory(&pem.Block{Type: "CERTIFICATE", Bytes: ts.Certificate().Raw})
	return srv, st, func(token string) *api.Client {
		c, err := api.New(ts.URL, token, caPEM)
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(c.CloseIdleConnections)
		return c
	}
}

// TestTokensScopeAndAudit mints agent tokens through the API and shows
// that one agent reaches only its own sandbox, that refused calls look the
// same whether or not the other sandbox exists, and that every call,
// refused ones included, lands in a verifiable audit chain.
func TestTokensScopeAndAudit(t *testing.T) {
	f := newFixture(t, "", readySandbox("team-b", "sb-2", "agent-2", "https://127.0.0.1:1"))
	_, st, client := storeAPI(t, f)
	ctx := context.Background()
	admin := client(adminToken)

	tok1, err := admin.CreateToken(ctx, api.CreateTokenRequest{Kind: api.TokenKindAgent, AgentID: "agent-1", Subject: "agent one"})
	if err != nil {
		t.Fatal(err)
	}
	if !strings.HasPrefix(tok1.Token, TokenPrefix) || tok1.ID == "" || tok1.AgentID != "agent-1" {
		t.Fatalf("created token %+v", tok1)
	}
	if got := redact.String("AGENTBOX_TOKEN=" + tok1.Token); strings.Contains(got, tok1.Token) {
		t.Errorf("the supervisor's log redaction does not know the API's tokens: %q", got)
	}
	for _, bad := range []api.CreateTokenRequest{
		{Kind: "root"}, {Kind: api.TokenKindAgent}, {Kind: api.TokenKindAdmin, AgentID: "agent-1"},
		{Kind: api.TokenKindStaff, TTLSeconds: -1},
	} {
		_, err := admin.CreateToken(ctx, bad)
		wantAPIError(t, err, api.CodeInvalidArgument, http.StatusBadRequest)
	}

	agent1 := client(tok1.Token)
	res, err := agent1.RunCommand(ctx, "agent-1", api.RunCommandRequest{Command: []string{"echo", "hi"}})
	if err != nil || res.ExitCode != 0 {
		t.Fatalf("agent-1 on its own sandbox: %+v, %v", res, err)
	}
	for _, other := range []string{"agent-2", "agent-404"} {
		_, err := agent1.RunCommand(ctx, other, api.RunCommandRequest{Command: []string{"true"}})
		wantAPIError(t, err, api.CodePermissionDenied, http.StatusForbidden)
	}
	_, err = agent1.CreateToken(ctx, api.CreateTokenRequest{Kind: api.TokenKindAdmin})
	wantAPIError(t, err, api.CodePermissionDenied, http.StatusForbidden)
	_, err = agent1.VerifyAudit(ctx)
	wantAPIError(t, err, api.CodePermissionDenied, http.StatusForbidden)

	// Revoked and expired tokens are refused like unknown ones.
	if err := admin.RevokeToken(ctx, tok1.ID); err != nil {
		t.Fatal(err)
	}
	_, err = agent1.RunCommand(ctx, "agent-1", api.RunCommandRequest{Command: []string{"true"}})
	wantAPIError(t, err, api.CodeUnauthenticated, http.StatusUnauthorized)
	short, err := admin.CreateToken(ctx, api.CreateTokenRequest{Kind: api.TokenKindAgent, AgentID: "agent-2", TTLSeconds: 60})
	if err != nil {
		t.Fatal(err)
	}
	f.clock.Step(61 * time.Second)
	_, err = client(short.Token).RunCommand(ctx, "agent-2", api.RunCommandRequest{Command: []string{"true"}})
	wantAPIError(t, err, api.CodeUnauthenticated, http.StatusUnauthorized)
	err = admin.RevokeToken(ctx, "no-such-token")
	wantAPIError(t, err, api.CodeNotFound, http.StatusNotFound)

	// The audit log: appended in the background, so wait for the calls.
	const calls = 14 // 1 + 4 refused creates + 1 run + 2 cross-agent + 2 refused admin + revoke + refused run + create + expired run
	var page *api.AuditPage
	deadline := time.Now().Add(10 * time.Second)
	for {
		page, err = admin.QueryAudit(ctx, url.Values{"limit": {"100"}})
		if err != nil {
			t.Fatal(err)
		}
		if len(page.Records) >= calls || time.Now().After(deadline) {
			break
		}
		time.Sleep(20 * time.Millisecond)
	}
	if len(page.Records) < calls {
		t.Fatalf("%d audit records, want at least %d", len(page.Records), calls)
	}
	crossAgent := 0
	for _, rec := range page.Records {
		if rec.ParamsHash == "" || rec.Hash == "" || rec.PrevHash == "" {
			t.Errorf("record %d lacks hashes: %+v", rec.Seq, rec)
		}
		if rec.Operation == "run_command" && rec.Caller == "agent:"+tok1.ID && rec.Result == string(api.CodePermissionDenied) {
			crossAgent++
			if rec.AgentID != "agent-2" && rec.AgentID != "agent-404" {
				t.Errorf("cross-agent record names agent %q", rec.AgentID)
			}
		}
	}
	if crossAgent != 2 {
		t.Errorf("%d audited cross-agent attempts, want 2", crossAgent)
	}
	denied, err := admin.QueryAudit(ctx, url.Values{"agent_id": {"agent-404"}})
	if err != nil || len(denied.Records) != 1 || denied.Records[0].Status != http.StatusForbidden || denied.Records[0].CallerKind != "agent" {
		t.Errorf("audit query by agent: %+v, %v", denied, err)
	}
	_, err = admin.QueryAudit(ctx, url.Values{"agnet_id": {"x"}})
	wantAPIError(t, err, api.CodeInvalidArgument, http.StatusBadRequest)

	v, err := admin.VerifyAudit(ctx)
	if err != nil || !v.OK || v.Records < calls {
		t.Fatalf("verify: %+v, %v", v, err)
	}
	// The store holds the token's hash (its own tests show the token
	// itself is in no column), and the revocation.
	rec, err := st.GetToken(ctx, tok1.ID)
	if err != nil || rec.Hash != store.TokenHash(HashToken(tok1.Token)) || rec.RevokedAt == nil || rec.AgentID != "agent-1" {
		t.Fatalf("stored token %+v, %v", rec, err)
	}
}

func TestAuditUnauthenticatedCalls(t *testing.T) {
	f := newFixture(t, "")
	_, _, client := storeAPI(t, f)
	ctx := context.Background()
	_, err := client("not-a-token").RunCommand(ctx, "agent-1", api.RunCommandRequest{Command: []string{"true"}})
	wantAPIError(t, err, api.CodeUnauthenticated, http.StatusUnauthorized)
	admin := client(adminToken)
	deadline := time.Now().Add(10 * time.Second)
	for {
		page, err := admin.QueryAudit(ctx, url.Values{"caller": {"anonymous"}})
		if err != nil {
			t.Fatal(err)
		}
		if len(page.Records) == 1 {
			rec := page.Records[0]
			if rec.Operation != "run_command" || rec.Result != string(api.CodeUnauthenticated) || rec.AgentID != "agent-1" {
				t.Errorf("anonymous record %+v", rec)
			}
			return
		}
		if time.Now().After(deadline) {
			t.Fatalf("anonymous call not audited: %+v", page)
		}
		time.Sleep(20 * time.Millisecond)
	}
}

func TestAdminEndpointsWithoutStore(t *testing.T) {
	f := newFixture(t, "")
	_, err := f.client(t, adminToken).VerifyAudit(context.Background())
	wantAPIError(t, err, api.CodeUnavailable, http.StatusServiceUnavailable)
}

// TestRequestMetrics checks that calls are counted by operation and result
// code, with or without a store.
func TestRequestMetrics(t *testing.T) {
	count := func(op, result string) uint64 {
		var m dto.Metric
		if err := metricRequestSeconds.WithLabelValues(op, result).(prometheus.Histogram).Write(&m); err != nil {
			t.Fatal(err)
		}
		return m.GetHistogram().GetSampleCount()
	}
	before := count("run_command", string(api.CodeSandboxNotFound))
	beforeAuth := count("acquire_lease", string(api.CodeUnauthenticated))
	f := newFixture(t, "")
	ctx := context.Background()
	_, err := f.client(t, adminToken).RunCommand(ctx, "agent-404", api.RunCommandRequest{Command: []string{"true"}})
	wantAPIError(t, err, api.CodeSandboxNotFound, http.StatusNotFound)
	_, err = f.client(t, "wrong").AcquireLease(ctx, "agent-1", api.AcquireLeaseRequest{Holder: "h", RequestID: "r"})
	wantAPIError(t, err, api.CodeUnauthenticated, http.StatusUnauthorized)
	if got := count("run_command", string(api.CodeSandboxNotFound)) - before; got != 1 {
		t.Errorf("run_command/sandbox_not_found observed %d times, want 1", got)
	}
	if got := count("acquire_lease", string(api.CodeUnauthenticated)) - beforeAuth; got != 1 {
		t.Errorf("acquire_lease/unauthenticated observed %d times, want 1", got)
	}
}

// TestLeaseHistory: acquire, heartbeat and release land in the store's
// lease history; a retried acquire does not add another.
func TestLeaseHistory(t *testing.T) {
	f := newFixture(t, "")
	_, st, client := storeAPI(t, f)
	c := client(adminToken)
	ctx := context.Background()
	req := api.AcquireLeaseRequest{Holder: "run-1", RequestID: "req-1", TTLSeconds: 30}
	l, err := c.AcquireLease(ctx, "agent-1", req)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := c.AcquireLease(ctx, "agent-1", req); err != nil {
		t.Fatal(err)
	}
	if _, err := c.HeartbeatLease(ctx, "agent-1", api.HeartbeatLeaseRequest{Holder: "run-1", LeaseID: l.LeaseID}); err != nil {
		t.Fatal(err)
	}
	if err := c.ReleaseLease(ctx, "agent-1", api.ReleaseLeaseRequest{Holder: "run-1", LeaseID: l.LeaseID}); err != nil {
		t.Fatal(err)
	}
	events, err := st.ListLeaseEvents(ctx, store.LeaseQuery{AgentID: "agent-1"})
	if err != nil {
		t.Fatal(err)
	}
	var kinds []string
	for _, e := range events {
		kinds = append(kinds, string(e.Event))
		if e.LeaseID != l.LeaseID || e.Holder != "run-1" {
			t.Errorf("event %+v, want lease %s of run-1", e, l.LeaseID)
		}
	}
	if strings.Join(kinds, ",") != "acquire,heartbeat,release" {
		t.Errorf("lease history %v", kinds)
	}
}

// TestKubeWriteMetrics: a lease acquire's write of the Lease is timed by
// verb and kind.
func TestKubeWriteMetrics(t *testing.T) {
	count := func() uint64 {
		var m dto.Metric
		if err := metricKubeWriteSeconds.WithLabelValues("update", "Lease").(prometheus.Histogram).Write(&m); err != nil {
			t.Fatal(err)
		}
		return m.GetHistogram().GetSampleCount()
	}
	before := count()
	f := newFixture(t, "")
	if _, err := f.client(t, adminToken).AcquireLease(context.Background(), "agent-1", api.AcquireLeaseRequest{Holder: "h", RequestID: "r"}); err != nil {
		t.Fatal(err)
	}
	if got := count() - before; got != 1 {
		t.Errorf("Lease updates observed %d times, want 1", got)
	}
}
