package provider

import (
	"context"
	"crypto/tls"
	"encoding/pem"
	"errors"
	"fmt"
	"net"
	"net/http/httptest"
	"path/filepath"
	"syscall"
	"testing"
	"time"

	tfjson "github.com/hashicorp/terraform-json"
	"github.com/hashicorp/terraform-plugin-framework/ephemeral"
	"github.com/hashicorp/terraform-plugin-go/tfprotov6"
	"github.com/hashicorp/terraform-plugin-testing/echoprovider"
	"github.com/hashicorp/terraform-plugin-testing/helper/resource"
	"github.com/hashicorp/terraform-plugin-testing/plancheck"
	"github.com/hashicorp/terraform-plugin-testing/statecheck"
	"github.com/hashicorp/terraform-plugin-testing/tfversion"
	k8sruntime "k8s.io/apimachinery/pkg/runtime"
	"sigs.k8s.io/controller-runtime/pkg/client/fake"

	"github.com/agentbox/terraform-provider-agentbox/internal/api/v1alpha1"
	"github.com/agentbox/terraform-provider-agentbox/internal/computeapi"
	"github.com/agentbox/terraform-provider-agentbox/internal/pki"
	"github.com/agentbox/terraform-provider-agentbox/internal/store"
	"github.com/agentbox/terraform-provider-agentbox/internal/usertoken"
)

func TestUserTokenEphemeralSchema(t *testing.T) {
	var resp ephemeral.SchemaResponse
	NewUserTokenEphemeralResource().Schema(context.Background(), ephemeral.SchemaRequest{}, &resp)
	if resp.Diagnostics.HasError() || resp.Schema.MarkdownDescription == "" {
		t.Fatalf("schema: %v", resp.Diagnostics)
	}
	for name, a := range resp.Schema.Attributes {
		if a.GetMarkdownDescription() == "" {
			t.Errorf("%s has no description", name)
		}
	}
	if !resp.Schema.Attributes["access_token"].IsSensitive() || !resp.Schema.Attributes["token"].IsSensitive() {
		t.Error("access_token and token must be sensitive")
	}
}

// localComputeAPI is the real Compute API with a SQLite store and a user
// token issuer, on loopback (no cluster: the exchange reaches no sandbox).
func localComputeAPI(t *testing.T, adminToken string) (*usertoken.Issuer, *httptest.Server) {
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
	ca, err := pki.NewCA("provider test CA")
	if err != nil {
		t.Fatal(err)
	}
	pool, err := computeapi.NewSupervisorPool(computeapi.StaticCertificate(tls.Certificate{}), ca.Pool())
	if err != nil {
		t.Fatal(err)
	}
	admin, err := computeapi.NewAdminTokenAuthenticator(computeapi.HashToken(adminToken))
	if err != nil {
		t.Fatal(err)
	}
	issuer, err := usertoken.New(usertoken.Options{Issuer: "https://agentbox.test", Store: st})
	if err != nil {
		t.Fatal(err)
	}
	srv, err := computeapi.NewServer(computeapi.Options{Sandboxes: kube, Leases: kube, Supervisors: pool,
		Authenticator: admin, Store: st, UserTokens: issuer})
	if err != nil {
		t.Fatal(err)
	}
	ts := httptest.NewTLSServer(srv.Handler())
	t.Cleanup(func() { ts.Close(); srv.Close(); pool.Close(); st.Close() })
	return issuer, ts
}

// TestUserTokenEphemeral runs Terraform with agentbox_user_token against
// the local Compute API. The whole token is echoed into state here, which
// only the echo provider can do, to verify it with the platform's own
// verification; the plan never holds it.
func TestUserTokenEphemeral(t *testing.T) {
	const admin = "abx_provider-test-admin-token"
	issuer, ts := localComputeAPI(t, admin)
	caPEM := pem.EncodeToMemory(&pem.Block{Type: "CERTIFICATE", Bytes: ts.Certificate().Raw})
	config := fmt.Sprintf(`
provider "agentbox" {
  kubernetes = {
    host     = "https://127.0.0.1:1"
    insecure = true
  }
}

ephemeral "agentbox_user_token" "t" {
  api_endpoint   = %q
  ca_certificate = %q
  token          = %q
  user           = "user-7"
  agent_id       = "agent-1"
  audience       = "mcp://github"
  scope          = "repo:read"
  run_id         = "run-1"
}

provider "echo" {
  data = ephemeral.agentbox_user_token.t
}

resource "echo" "t" {}
`, ts.URL, caPEM, admin)
	resource.UnitTest(t, resource.TestCase{
		TerraformVersionChecks: []tfversion.TerraformVersionCheck{tfversion.SkipBelow(tfversion.Version1_10_0)},
		ProtoV6ProviderFactories: map[string]func() (tfprotov6.ProviderServer, error){
			"agentbox": testAccProtoV6ProviderFactories["agentbox"],
			"echo":     echoprovider.NewProviderServer(),
		},
		Steps: []resource.TestStep{{
			Config:            config,
			ConfigPlanChecks:  resource.ConfigPlanChecks{PreApply: []plancheck.PlanCheck{noJWT{}}},
			ConfigStateChecks: []statecheck.StateCheck{verifiedToken{issuer: issuer}},
		}},
	})
}

// verifiedToken verifies the token echo.t recorded.
type verifiedToken struct{ issuer *usertoken.Issuer }

func (v verifiedToken) CheckState(ctx context.Context, req statecheck.CheckStateRequest, resp *statecheck.CheckStateResponse) {
	resp.Error = v.check(ctx, req.State)
}

func (v verifiedToken) check(ctx context.Context, s *tfjson.State) error {
	for _, r := range s.Values.RootModule.Resources {
		if r.Address != "echo.t" {
			continue
		}
		data, _ := r.AttributeValues["data"].(map[string]any)
		tok, _ := data["access_token"].(string)
		c, err := v.issuer.Verify(ctx, tok, usertoken.Expectation{Audience: "mcp://github", Agent: "agent-1"})
		if err != nil {
			return fmt.Errorf("the token Terraform minted does not verify: %w", err)
		}
		if c.Subject != "user-7" || c.Scope != "repo:read" || c.RunID != "run-1" || c.ID != data["jti"] {
			return fmt.Errorf("claims %+v, echoed %v", c, data)
		}
		return nil
	}
	return fmt.Errorf("echo.t not in the state")
}

// TestRetryRefused dials a loopback port that refuses until a listener
// opens on it 600 ms later: the call is tried again until it connects.
// Any other error is returned at once.
func TestRetryRefused(t *testing.T) {
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	addr := l.Addr().String()
	l.Close()
	opened := make(chan net.Listener, 1)
	go func() {
		time.Sleep(600 * time.Millisecond)
		l, err := net.Listen("tcp", addr)
		if err != nil {
			t.Error(err)
		}
		opened <- l
	}()
	tries := 0
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()
	err = retryRefused(ctx, func() error {
		tries++
		c, err := net.Dial("tcp", addr)
		if err == nil {
			c.Close()
		}
		return err
	})
	if l := <-opened; l != nil {
		l.Close()
	}
	if err != nil || tries < 2 {
		t.Fatalf("after %d tries: %v", tries, err)
	}

	tries = 0
	other := errors.New("forbidden")
	if err := retryRefused(ctx, func() error { tries++; return other }); err != other || tries != 1 {
		t.Fatalf("a refusal by the API: %d tries, %v", tries, err)
	}
	short, cancel := context.WithTimeout(context.Background(), 300*time.Millisecond)
	defer cancel()
	if err := retryRefused(short, func() error { return syscall.ECONNREFUSED }); !errors.Is(err, syscall.ECONNREFUSED) {
		t.Fatalf("past the deadline: %v", err)
	}
}
