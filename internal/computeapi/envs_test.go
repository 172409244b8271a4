package computeapi

import (
	"context"
	"net/http"
	"os/exec"
	"testing"

	api "github.com/agentbox/terraform-provider-agentbox/internal/computeapi/client"
	"github.com/agentbox/terraform-provider-agentbox/internal/supervisor"
	"github.com/agentbox/terraform-provider-agentbox/internal/supervisor/pyenv"
	"github.com/agentbox/terraform-provider-agentbox/internal/supervisor/pyenv/pyenvtest"
)

// /v1/agents/{id}/envs in front of the real supervisor and its real
// environment builds (from a package index on loopback): built ahead,
// found cached, listed with what routing and eviction read, deleted, and
// each failure under its documented code. Every request and response is
// checked against the OpenAPI document.
func TestEnvs(t *testing.T) {
	py, err := exec.LookPath("python3")
	if err != nil || exec.Command(py, "-c", "import venv, ensurepip").Run() != nil {
		t.Skip("no python3 with venv and ensurepip")
	}
	ix := pyenvtest.NewIndex(t, pyenvtest.Package{Name: "agentbox-greet", Version: "1.0", Files: map[string][]byte{
		"agentbox_greet.py": []byte("def hello(who):\n    return 'hello ' + who\n"),
	}})
	c := realSupervisorAPI(t, nil, func(cfg *supervisor.Config) {
		cfg.Python = py
		cfg.Execute.Envs = &pyenv.Config{Dir: t.TempDir(), IndexURL: ix.URL, TTL: 0}
	})(adminToken)
	ctx := context.Background()

	res, err := c.CreateEnv(ctx, "agent-1", api.EnvRequest{Requirements: []string{"agentbox-greet"}})
	if err != nil {
		t.Fatal(err)
	}
	if !res.Created || len(res.Name) < len("reqs-") || res.Name[:5] != "reqs-" || res.State != "ready" ||
		len(res.Packages) != 1 || res.Packages[0] != "agentbox-greet==1.0" || res.SizeBytes <= 0 {
		t.Fatalf("first build: %+v", res)
	}
	again, err := c.CreateEnv(ctx, "agent-1", api.EnvRequest{Requirements: []string{"agentbox-greet"}})
	if err != nil || again.Created || again.Name != res.Name {
		t.Fatalf("second request: %+v, %v", again, err)
	}
	list, err := c.ListEnvs(ctx, "agent-1")
	if err != nil {
		t.Fatal(err)
	}
	if len(list.Environments) != 1 || list.Environments[0].Name != res.Name || list.Environments[0].Requirements[0] != "agentbox-greet" ||
		list.Environments[0].LastUsedAt.IsZero() || list.Count != 1 || list.TotalBytes != res.SizeBytes {
		t.Fatalf("list: %+v", list)
	}

	_, err = c.CreateEnv(ctx, "agent-1", api.EnvRequest{Requirements: []string{"agentbox-missing"}})
	wantAPIError(t, err, api.CodeEnvBuildFailed, http.StatusUnprocessableEntity)
	_, err = c.CreateEnv(ctx, "agent-1", api.EnvRequest{Requirements: []string{"x @ https://example.invalid/x.whl"}})
	wantAPIError(t, err, api.CodeInvalidArgument, http.StatusBadRequest)
	_, err = c.CreateEnv(ctx, "agent-1", api.EnvRequest{})
	wantAPIError(t, err, api.CodeInvalidArgument, http.StatusBadRequest)

	gone, err := c.DeleteEnv(ctx, "agent-1", res.Name)
	if err != nil || gone.Name != res.Name {
		t.Fatalf("delete: %+v, %v", gone, err)
	}
	_, err = c.DeleteEnv(ctx, "agent-1", res.Name)
	wantAPIError(t, err, api.CodeEnvNotFound, http.StatusNotFound)
	if list, err := c.ListEnvs(ctx, "agent-1"); err != nil || len(list.Environments) != 0 {
		t.Fatalf("list after delete: %+v, %v", list, err)
	}
	_, err = c.ListEnvs(ctx, "agent-nobody")
	wantAPIError(t, err, api.CodeSandboxNotFound, http.StatusNotFound)
}
