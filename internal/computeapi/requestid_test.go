package computeapi

import (
	"context"
	"errors"
	"net/http"
	"net/http/httptest"
	"regexp"
	"strings"
	"testing"
	"time"

	api "github.com/agentbox/terraform-provider-agentbox/internal/computeapi/client"
	"github.com/agentbox/terraform-provider-agentbox/internal/store"
)

// Every call gets a request ID: the client's when it is usable, a new one
// otherwise. The response carries it, and so does the call's audit record.
func TestRequestID(t *testing.T) {
	f := newFixture(t, "")
	srv, st, client := storeAPI(t, f)
	ts := httptest.NewServer(srv.Handler())
	t.Cleanup(ts.Close)
	generated := regexp.MustCompile(`^[0-9a-f]{24}$`)
	for _, tc := range []struct {
		name, sent string
		want       func(string) bool
	}{
		{"client's", "trace-7f3a/run-12", func(id string) bool { return id == "trace-7f3a/run-12" }},
		{"none", "", generated.MatchString},
		{"with a space", "a b", generated.MatchString},
		{"with a quote", `a"b`, generated.MatchString},
		{"too long", strings.Repeat("a", maxRequestIDLength+1), generated.MatchString},
	} {
		req, err := http.NewRequest(http.MethodGet, ts.URL+"/v1/agents/agent-1/status", nil)
		if err != nil {
			t.Fatal(err)
		}
		req.Header.Set("Authorization", "Bearer "+adminToken)
		if tc.sent != "" {
			req.Header.Set(HeaderRequestID, tc.sent)
		}
		resp, err := http.DefaultClient.Do(req)
		if err != nil {
			t.Fatal(err)
		}
		resp.Body.Close()
		id := resp.Header.Get(HeaderRequestID)
		if resp.StatusCode != http.StatusOK || !tc.want(id) {
			t.Errorf("%s: status %d, request ID %q", tc.name, resp.StatusCode, id)
			continue
		}
		// The audit log is written behind the calls.
		for deadline := time.Now().Add(5 * time.Second); ; time.Sleep(20 * time.Millisecond) {
			page, err := st.QueryAudit(context.Background(), store.AuditQuery{Operation: "status", Newest: true, Limit: 1})
			if err != nil {
				t.Fatal(err)
			}
			if len(page.Records) == 1 && page.Records[0].RequestID == id {
				break
			}
			if time.Now().After(deadline) {
				t.Errorf("%s: no audit record with request ID %q (latest: %+v)", tc.name, id, page.Records)
				break
			}
		}
	}

	// The Go client hands the ID of a failed call to its caller.
	_, err := client("wrong-token").Status(context.Background(), "agent-1")
	var e *api.Error
	if !errors.As(err, &e) {
		t.Fatalf("refused call through the client: %v, want an API error", err)
	}
	if !generated.MatchString(e.RequestID) || !strings.Contains(err.Error(), "(request "+e.RequestID+")") {
		t.Errorf("refused call through the client: %v (request ID %q)", err, e.RequestID)
	}
}
