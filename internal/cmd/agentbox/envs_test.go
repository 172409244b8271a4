package main

import (
	"encoding/json"
	"os/exec"
	"strings"
	"testing"

	"github.com/agentbox/terraform-provider-agentbox/internal/computeapi/apitest"
	"github.com/agentbox/terraform-provider-agentbox/internal/computeapi/client"
	"github.com/agentbox/terraform-provider-agentbox/internal/supervisor"
	"github.com/agentbox/terraform-provider-agentbox/internal/supervisor/pyenv"
	"github.com/agentbox/terraform-provider-agentbox/internal/supervisor/pyenv/pyenvtest"
)

// agentbox envs create|list|delete against the real API and supervisor,
// with real builds from a package index on loopback.
func TestEnvsCreateListDelete(t *testing.T) {
	py, err := exec.LookPath("python3")
	if err != nil || exec.Command(py, "-c", "import venv, ensurepip").Run() != nil {
		t.Skip("no python3 with venv and ensurepip")
	}
	ix := pyenvtest.NewIndex(t, pyenvtest.Package{Name: "agentbox-greet", Version: "1.0", Files: map[string][]byte{
		"agentbox_greet.py": []byte("def hello(who):\n    return 'hello ' + who\n"),
	}})
	s, env := realAgentAPI(t, apitest.Options{Supervisor: supervisor.Config{
		Python:  py,
		Execute: supervisor.ExecuteConfig{RunDir: t.TempDir(), Envs: &pyenv.Config{Dir: t.TempDir(), IndexURL: ix.URL}},
	}})
	a := s.AgentID

	r := runCLI(t, env, "", "envs", "create", a, "agentbox-greet")
	if r.code != 0 || !strings.HasPrefix(r.stdout, "reqs-") || !strings.Contains(r.stdout, ": built in ") || !strings.Contains(r.stdout, "agentbox-greet==1.0") {
		t.Fatalf("create: code %d, stdout %q, stderr %q", r.code, r.stdout, r.stderr)
	}
	name, _, _ := strings.Cut(r.stdout, ":")
	r = runCLI(t, env, "", "envs", "create", "--json", a, "agentbox-greet")
	var res client.EnvResult
	if r.code != 0 || json.Unmarshal([]byte(r.stdout), &res) != nil || res.Created || res.Name != name {
		t.Fatalf("create again: code %d, stdout %q, stderr %q", r.code, r.stdout, r.stderr)
	}
	r = runCLI(t, env, "", "envs", "list", a)
	if r.code != 0 || !strings.Contains(r.stdout, name+"  ready") || !strings.Contains(r.stdout, "agentbox-greet\n") ||
		!strings.Contains(r.stdout, "1 of 8 environments") {
		t.Fatalf("list: code %d, stdout %q, stderr %q", r.code, r.stdout, r.stderr)
	}
	r = runCLI(t, env, "", "envs", "create", a)
	if r.code != exitUsage || !strings.Contains(r.stderr, "give requirements, --name, or both") {
		t.Errorf("create without anything: code %d, stderr %q", r.code, r.stderr)
	}
	r = runCLI(t, env, "", "envs", "delete", a, name)
	if r.code != 0 || !strings.HasPrefix(r.stdout, "deleted "+name) {
		t.Fatalf("delete: code %d, stdout %q, stderr %q", r.code, r.stdout, r.stderr)
	}
	r = runCLI(t, env, "", "envs", "delete", a, name)
	if r.code != exitAPIError || !strings.Contains(r.stderr, "env_not_found") {
		t.Errorf("delete again: code %d, stderr %q", r.code, r.stderr)
	}
}
