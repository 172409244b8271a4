package controller

import (
	"encoding/json"
	"errors"
	"os"
	"strings"
	"testing"
	"time"

	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"

	"github.com/agentbox/terraform-provider-agentbox/internal/api/v1alpha1"
	"github.com/agentbox/terraform-provider-agentbox/internal/computeapi"
	apiclient "github.com/agentbox/terraform-provider-agentbox/internal/computeapi/client"
	"github.com/agentbox/terraform-provider-agentbox/internal/snapshot/archive"
	"github.com/agentbox/terraform-provider-agentbox/internal/supervisor/pyenv/pyenvtest"
	"github.com/agentbox/terraform-provider-agentbox/internal/supervisor/supervisorapi"
)

// pyenvIndexPort is where the test's package index listens, on the
// sandbox's own loopback.
const pyenvIndexPort = "18765"

// TestPythonEnvironmentsSurviveIdleStop, on the real cluster with the
// default install's snapshot driver (the archive driver on the embedded
// store, a directory): an environment built through the Compute API lives
// on the workspace volume, owned like the agent's files and out of the
// filespace's manifest; an idle stop and the resume carry it, venv links
// to the image's interpreter included; an execute with its requirements
// after the resume runs without installing (the package index, served on
// the sandbox's loopback from /tmp, went with the pod), and the API lists
// and deletes it.
func TestPythonEnvironmentsSurviveIdleStop(t *testing.T) {
	t.Parallel()
	image := os.Getenv(EnvSandboxImage)
	if image == "" {
		t.Skipf("%s is not set: environments need the standard sandbox image's python3 with venv and pip", EnvSandboxImage)
	}
	drv, err := archive.New(archive.Config{Dir: t.TempDir()})
	must(t, err)
	t.Cleanup(drv.Close)
	var pool *computeapi.SupervisorPool
	e := newClusterEnv(t, withSnapshots(t, drv, &pool))
	api := e.computeAPI(pool)
	ctx := e.ctx
	e.template("py", func(tpl *v1alpha1.SandboxTemplate) {
		tpl.Spec.Image = image
		// Longer than the test: only setActivity makes the sandbox idle.
		tpl.Spec.IdleTimeout = metav1.Duration{Duration: time.Hour}
		tpl.Spec.Python.IndexURL = "http://127.0.0.1:" + pyenvIndexPort + "/simple/"
		tpl.Spec.Python.Environments = &v1alpha1.PythonEnvironments{MaxCount: 4, TTL: &metav1.Duration{Duration: 24 * time.Hour}}
	})
	e.sandbox("py", "py")
	sbx, _ := e.waitPhase("py", v1alpha1.SandboxPhaseRunning, v1alpha1.ReasonRunning)
	agent := sbx.Spec.AgentID
	sup := e.supervisor(t, sbx)

	// The package index: a static tree in /tmp (the pod's emptyDir, gone
	// after the stop) served by the image's python3 on loopback.
	serveTestIndex(t, ctx, sup, pyenvtest.Package{Name: "agentbox-greet", Version: "1.0", Files: map[string][]byte{
		"agentbox_greet/__init__.py": []byte("def hello(who):\n    return 'hello ' + who\n"),
	}})

	requirements := []string{"agentbox-greet==1.0"}
	start := time.Now()
	built, err := api.CreateEnv(ctx, agent, apiclient.EnvRequest{Requirements: requirements})
	firstBuild := time.Since(start)
	if err != nil {
		t.Fatalf("create_env: %v", err)
	}
	if !built.Created || built.State != supervisorapi.EnvStateReady || len(built.Packages) != 1 || built.Packages[0] != "agentbox-greet==1.0" {
		t.Fatalf("create_env: %+v", built)
	}
	execute := func(when string) (*supervisorapi.ExecuteResult, time.Duration) {
		t.Helper()
		start := time.Now()
		raw, err := api.Execute(ctx, agent, supervisorapi.ExecuteRequest{Requirements: requirements,
			Code: "import agentbox_greet, sys; print(agentbox_greet.hello('env'), sys.prefix)"})
		took := time.Since(start)
		if err != nil {
			t.Fatalf("execute %s: %v", when, err)
		}
		var res supervisorapi.ExecuteResult
		must(t, json.Unmarshal(raw, &res))
		if res.Status != supervisorapi.ExecuteSuccess || !strings.HasPrefix(res.Output, "hello env /workspace/.agentbox/envs/"+built.Name+".") {
			t.Fatalf("execute %s: %s", when, raw)
		}
		if res.Env == nil || res.Env.Created || res.Env.Name != built.Name {
			t.Fatalf("execute %s did not run in the cached environment %s: env %+v", when, built.Name, res.Env)
		}
		return &res, took
	}
	cachedBefore, cachedBeforeTook := execute("before the stop")

	// On the workspace volume, owned as the agent's files are, and not in
	// the manifest the filespace syncs read.
	owners := run(t, ctx, sup, `touch mine && stat -c '%u:%g' mine .agentbox .agentbox/envs .agentbox/envs/`+built.Name+`.*/bin/python3* | sort -u`)
	if strings.Contains(owners, "\n") {
		t.Errorf("owners of the agent's file and the environments differ:\n%s", owners)
	}
	m, err := sup.Manifest(ctx, ".")
	must(t, err)
	for _, f := range m.Files {
		if strings.HasPrefix(f.Path, supervisorapi.PlatformDir+"/") {
			t.Fatalf("the manifest lists %s", f.Path)
		}
	}
	link := run(t, ctx, sup, `readlink .agentbox/envs/`+built.Name+`.*/bin/python`)

	// Idle stop and resume.
	e.setActivity("py", time.Now().Add(-2*time.Hour))
	sbx, stopTook := e.waitPhase("py", v1alpha1.SandboxPhaseStopped, v1alpha1.ReasonStopped)
	e.gone(&corev1.PersistentVolumeClaim{}, WorkspaceClaimName("py"))
	start = time.Now()
	list, err := api.ListEnvs(ctx, agent)
	resumeTook := time.Since(start)
	if err != nil {
		t.Fatalf("list_envs on the stopped sandbox: %v", err)
	}
	if len(list.Environments) != 1 || list.Environments[0].Name != built.Name || list.Environments[0].State != supervisorapi.EnvStateUnverified ||
		strings.Join(list.Environments[0].Requirements, " ") != "agentbox-greet==1.0" || list.MaxCount != 4 || list.TTLSeconds != 24*3600 {
		t.Fatalf("list_envs after the resume: %+v", list)
	}
	sbx, _ = e.waitPhase("py", v1alpha1.SandboxPhaseRunning, v1alpha1.ReasonRunning)
	sup = e.supervisor(t, sbx)
	if got := run(t, ctx, sup, `readlink .agentbox/envs/`+built.Name+`.*/bin/python; test -e /tmp/pyindex && echo index-still-there || true`); got != link {
		t.Fatalf("after the resume: %q, want the interpreter link %q and no index", got, link)
	}
	cachedAfter, cachedAfterTook := execute("after the resume")
	list, err = api.ListEnvs(ctx, agent)
	must(t, err)
	if len(list.Environments) != 1 || list.Environments[0].State != supervisorapi.EnvStateReady || !list.Environments[0].LastUsedAt.After(built.LastUsedAt) {
		t.Fatalf("list_envs after the run: %+v", list)
	}

	gone, err := api.DeleteEnv(ctx, agent, built.Name)
	if err != nil || gone.Name != built.Name {
		t.Fatalf("delete_env: %+v, %v", gone, err)
	}
	if left := run(t, ctx, sup, `ls -A .agentbox/envs`); left != "" {
		t.Errorf("after delete_env the environment directory holds %q", left)
	}
	_, err = api.DeleteEnv(ctx, agent, built.Name)
	if apiErr, ok := errors.AsType[*apiclient.Error](err); !ok || apiErr.Code != apiclient.CodeEnvNotFound {
		t.Errorf("delete_env again: %v, want env_not_found", err)
	}
	t.Logf("first build through the API %s (supervisor %d ms); execute, cached, before the stop %s (env setup %d ms); "+
		"idle stop %s; list_envs waking the stopped sandbox %s; execute, cached, after the resume %s (env setup %d ms, interpreter check included)",
		firstBuild.Round(time.Millisecond), built.DurationMS, cachedBeforeTook.Round(time.Millisecond), cachedBefore.EnvSetupMS,
		stopTook.Round(time.Millisecond), resumeTook.Round(time.Millisecond), cachedAfterTook.Round(time.Millisecond), cachedAfter.EnvSetupMS)
}
