package main

import (
	"bytes"
	"context"
	"crypto/tls"
	"encoding/json"
	"encoding/pem"
	"net/http"
	"net/http/httptest"
	"os"
	"path/filepath"
	"strings"
	"testing"

	k8sruntime "k8s.io/apimachinery/pkg/runtime"
	"sigs.k8s.io/controller-runtime/pkg/client/fake"

	"github.com/agentbox/terraform-provider-agentbox/internal/api/v1alpha1"
	"github.com/agentbox/terraform-provider-agentbox/internal/computeapi"
	"github.com/agentbox/terraform-provider-agentbox/internal/computeapi/client"
	"github.com/agentbox/terraform-provider-agentbox/internal/pki"
	"github.com/agentbox/terraform-provider-agentbox/internal/store"
	"github.com/agentbox/terraform-provider-agentbox/internal/usertoken"
)

// realAPI is the real Compute API with a real SQLite store (and an empty
// fake cluster: the admin commands never reach a sandbox).
func realAPI(t *testing.T) (endpoint, caFile string) {
	t.Helper()
	st, err := store.OpenSQLite(context.Background(), filepath.Join(t.TempDir(), "agentbox.db"), store.Options{})
	if err != nil {
		t.Fatal(err)
	}
	scheme := k8sruntime.NewScheme()
	if err := v1alpha1.AddToScheme(scheme); err != nil {
		t.Fatal(err)
	}
	kube := fake.NewClientBuilder().WithScheme(scheme).Build()
	ca, err := pki.NewCA("cli test CA")
	if err != nil {
		t.Fatal(err)
	}
	pool, err := computeapi.NewSupervisorPool(computeapi.StaticCertificate(tls.Certificate{}), ca.Pool())
	if err != nil {
		t.Fatal(err)
	}
	admin, err := computeapi.NewAdminTokenAuthenticator(computeapi.HashToken(token))
	if err != nil {
		t.Fatal(err)
	}
	issuer, err := usertoken.New(usertoken.Options{Issuer: "https://agentbox.test", Store: st})
	if err != nil {
		t.Fatal(err)
	}
	srv, err := computeapi.NewServer(computeapi.Options{Sandboxes: kube, Leases: kube, Supervisors: pool,
		Authenticator: computeapi.ChainAuthenticators(admin, computeapi.NewStoreAuthenticator(st)), Store: st, UserTokens: issuer})
	if err != nil {
		t.Fatal(err)
	}
	ts := httptest.NewTLSServer(srv.Handler())
	t.Cleanup(func() { ts.Close(); srv.Close(); pool.Close(); st.Close() })
	caFile = filepath.Join(t.TempDir(), "ca.crt")
	if err := os.WriteFile(caFile, pem.EncodeToMemory(&pem.Block{Type: "CERTIFICATE", Bytes: ts.Certificate().Raw}), 0o600); err != nil {
		t.Fatal(err)
	}
	return ts.URL, caFile
}

func TestTokensAndAuditCommands(t *testing.T) {
	endpoint, caFile := realAPI(t)
	env := map[string]string{"AGENTBOX_ENDPOINT": endpoint, "AGENTBOX_CA_FILE": caFile, "AGENTBOX_TOKEN": token}
	getenv := func(k string) string { return env[k] }
	cli := func(args ...string) (int, string, string) {
		var out, errOut bytes.Buffer
		code := run(context.Background(), args, getenv, strings.NewReader(""), &out, &errOut)
		return code, out.String(), errOut.String()
	}

	code, out, errOut := cli("tokens", "create", "--agent", "agent-1", "--subject", "ci", "--ttl", "1h")
	if code != 0 || !strings.HasPrefix(out, computeapi.TokenPrefix) || strings.Count(out, "\n") != 1 || !strings.Contains(errOut, "shown once") {
		t.Fatalf("tokens create: %d %q %q", code, out, errOut)
	}
	id := strings.Fields(errOut[strings.Index(errOut, "token ")+len("token "):])[0]
	if code, _, errOut := cli("tokens", "create", "--kind", "root"); code != exitAPIError || !strings.Contains(errOut, "invalid_argument") {
		t.Errorf("bad kind: %d %q", code, errOut)
	}
	if code, out, _ := cli("tokens", "revoke", id); code != 0 || !strings.Contains(out, id) {
		t.Errorf("tokens revoke %s: %d %q", id, code, out)
	}
	if code, _, _ := cli("tokens", "revoke"); code != exitUsage {
		t.Errorf("revoke without an ID: %d", code)
	}

	// The calls above are audited in the background; verify and query
	// until they show.
	var page client.AuditPage
	for range 200 {
		code, out, errOut = cli("audit", "query", "--operation", "create_token", "--since", "1h")
		if code != 0 {
			t.Fatalf("audit query: %d %q", code, errOut)
		}
		if err := json.Unmarshal([]byte(out), &page); err != nil {
			t.Fatalf("audit query output %q: %v", out, err)
		}
		if len(page.Records) == 2 {
			break
		}
	}
	if len(page.Records) != 2 || page.Records[0].Result != string(client.CodeInvalidArgument) || page.Records[1].Result != "ok" {
		t.Fatalf("create_token records, newest first: %+v", page.Records)
	}
	if code, out, _ := cli("audit", "verify"); code != 0 || !strings.Contains(out, "audit log intact") {
		t.Errorf("audit verify: %d %q", code, out)
	}
	if code, _, errOut := cli("audit", "query", "--since", "yesterday"); code != exitUsage || !strings.Contains(errOut, "--since") {
		t.Errorf("bad --since: %d %q", code, errOut)
	}
}

// A broken chain is reported with its own exit code. The break itself is
// the store's to find (its tests tamper with real databases); here the
// API's answer is given.
func TestAuditVerifyBroken(t *testing.T) {
	f := httptest.NewTLSServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		_ = json.NewEncoder(w).Encode(client.AuditVerification{Records: 9, Head: "9:ab",
			Break: &client.AuditBreak{Seq: 5, Kind: "missing-record", Detail: "record 5 is missing"}})
	}))
	defer f.Close()
	caFile := filepath.Join(t.TempDir(), "ca.crt")
	if err := os.WriteFile(caFile, pem.EncodeToMemory(&pem.Block{Type: "CERTIFICATE", Bytes: f.Certificate().Raw}), 0o600); err != nil {
		t.Fatal(err)
	}
	var out bytes.Buffer
	code := run(context.Background(), []string{"audit", "verify", "--endpoint", f.URL, "--ca-file", caFile},
		func(k string) string { return map[string]string{"AGENTBOX_TOKEN": token}[k] }, nil, &out, &bytes.Buffer{})
	if code != 3 || !strings.Contains(out.String(), "BROKEN at record 5") {
		t.Errorf("broken chain: exit %d, %q", code, out.String())
	}
}
