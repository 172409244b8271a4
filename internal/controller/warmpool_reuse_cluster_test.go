package controller

import (
	"context"
	"encoding/base64"
	"encoding/json"
	"fmt"
	"os"
	"path"
	"path/filepath"
	"slices"
	"strings"
	"testing"
	"time"

	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"sigs.k8s.io/controller-runtime/pkg/client"

	"github.com/agentbox/terraform-provider-agentbox/internal/api/v1alpha1"
	"github.com/agentbox/terraform-provider-agentbox/internal/computeapi"
	apiclient "github.com/agentbox/terraform-provider-agentbox/internal/computeapi/client"
	"github.com/agentbox/terraform-provider-agentbox/internal/store"
	"github.com/agentbox/terraform-provider-agentbox/internal/supervisor/pyenv/pyenvtest"
	"github.com/agentbox/terraform-provider-agentbox/internal/supervisor/supervisorapi"
)

// TestReusePoolLease runs a warm pool with releasePolicy Reuse on real
// gVisor sandboxes through the real Compute API: holder A leaves files in
// the workspace, /tmp and its HOME, a background process and two built
// environments, one of which it tampers with; once A releases, holder B
// gets the same sandbox (same name and UID) and finds none of A's files,
// processes or variables, the untouched environment cached (no install,
// A's package index being gone with A's pod) and the tampered one dropped.
func TestReusePoolLease(t *testing.T) {
	t.Parallel()
	image := os.Getenv(EnvSandboxImage)
	if image == "" {
		t.Skipf("%s is not set: reuse is about real processes, files and environments in a real sandbox", EnvSandboxImage)
	}
	var supervisors *computeapi.SupervisorPool
	st, err := store.Open(context.Background(), filepath.Join(t.TempDir(), "agentbox.db"), store.Options{})
	must(t, err)
	t.Cleanup(func() { st.Close() })
	e := newClusterEnv(t, withSnapshots(t, nil, &supervisors), func(r *SandboxReconciler) { r.WarmTakes = st })
	api := e.computeAPIWithStore(supervisors, st)
	ctx := e.ctx
	e.template("reuse", func(tpl *v1alpha1.SandboxTemplate) {
		tpl.Spec.Image = image
		tpl.Spec.IdleTimeout = metav1.Duration{Duration: time.Hour}
		tpl.Spec.Python.IndexURL = "http://127.0.0.1:" + pyenvIndexPort + "/simple/"
		tpl.Spec.Python.Environments = &v1alpha1.PythonEnvironments{MaxCount: 4}
	})
	must(t, e.c.Create(ctx, &v1alpha1.SandboxWarmPool{
		ObjectMeta: metav1.ObjectMeta{Name: "pool", Namespace: e.ns},
		Spec: v1alpha1.SandboxWarmPoolSpec{TemplateRef: v1alpha1.LocalObjectReference{Name: "reuse"}, Replicas: 1,
			ReleasePolicy: v1alpha1.ReleasePolicyReuse},
	}))
	e.waitPoolFull("pool", 1)

	a, err := api.AcquirePoolLease(ctx, e.ns, "pool", apiclient.AcquireLeaseRequest{Holder: "holder-a", RequestID: "req-a", TTLSeconds: 900})
	must(t, err)
	var sbxA v1alpha1.Sandbox
	must(t, e.get(a.Sandbox, &sbxA))

	// A's package index, served from /tmp by a background process.
	tree, err := pyenvtest.StaticTree(pyenvtest.Package{Name: "agentbox-greet", Version: "1.0", Files: map[string][]byte{
		"agentbox_greet/__init__.py": []byte("def hello(who):\n    return 'hello ' + who\n"),
	}})
	must(t, err)
	var script strings.Builder
	for p, data := range tree {
		fmt.Fprintf(&script, "mkdir -p %q && echo %s | base64 -d > %q\n", path.Dir(path.Join("/tmp/pyindex", p)),
			base64.StdEncoding.EncodeToString(data), path.Join("/tmp/pyindex", p))
	}
	e.runVia(api, a.AgentID, script.String())
	e.runVia(api, a.AgentID, "(setsid python3 -m http.server "+pyenvIndexPort+" --bind 127.0.0.1 --directory /tmp/pyindex >/dev/null 2>&1 </dev/null &)")
	e.runVia(api, a.AgentID, `for i in $(seq 100); do python3 -c "import urllib.request as u; u.urlopen('http://127.0.0.1:`+pyenvIndexPort+`/simple/agentbox-greet/')" 2>/dev/null && exit 0; sleep 0.2; done; exit 1`)

	// A's state: files in the workspace, /tmp and HOME (the workspace), a
	// variable exported in a command and written to the profile.
	e.runVia(api, a.AgentID, `export A_SECRET=secret-of-a && echo "export A_SECRET=$A_SECRET" >> "$HOME/.profile" && `+
		`echo a > /workspace/notes.txt && mkdir -p /workspace/src/deep && echo a > /workspace/src/deep/main.py && chmod 500 /workspace/src && `+
		`echo a > /tmp/left-in-tmp && mkdir -p /workspace/.agentbox/other && echo a > /workspace/.agentbox/other/state`)
	requirements := []string{"agentbox-greet==1.0"}
	built, err := api.CreateEnv(ctx, a.AgentID, apiclient.EnvRequest{Requirements: requirements})
	must(t, err)
	tampered, err := api.CreateEnv(ctx, a.AgentID, apiclient.EnvRequest{Name: "tampered", Requirements: requirements})
	must(t, err)
	if !built.Created || !tampered.Created {
		t.Fatalf("A's builds: %+v %+v", built, tampered)
	}
	e.runVia(api, a.AgentID, `f=$(ls /workspace/.agentbox/envs/tampered.*/lib/python3*/site-packages/agentbox_greet/__init__.py) && `+
		`printf 'def hello(who):\n    return "pwned"\n' > "$f"`)
	if out := e.runVia(api, a.AgentID, "ps -eo args | grep -c '[h]ttp.server'"); out != "1\n" {
		t.Fatalf("A's background index server: %q running", out)
	}
	// The seal key: its file is gone, and the supervisor's memory, which
	// holds it, is closed to the commands though they run as its user.
	if out := e.runVia(api, a.AgentID, `ls -A /tmp | grep -c seal; `+
		`for p in $(pgrep -f 'agentbox-supervisor$' || pgrep agentbox-superv); do `+
		`python3 -c "import sys; open('/proc/%s/mem' % sys.argv[1], 'rb')" $p 2>/dev/null && echo "read $p" || echo "refused $p"; done; true`); !strings.Contains(out, "refused") || strings.Contains(out, "read ") || !strings.HasPrefix(out, "0\n") {
		t.Fatalf("the seal key within reach of commands: %q", out)
	}

	released := time.Now()
	must(t, api.ReleaseLease(ctx, a.AgentID, apiclient.ReleaseLeaseRequest{Holder: a.Holder, LeaseID: a.LeaseID}))
	e.eventually("the released sandbox to come back to its pool", func() error {
		var sbx v1alpha1.Sandbox
		if err := e.get(a.Sandbox, &sbx); err != nil {
			return err
		}
		if sbx.UID != sbxA.UID {
			return fmt.Errorf("sandbox %s has UID %s, not %s", sbx.Name, sbx.UID, sbxA.UID)
		}
		if v1alpha1.PoolLeased(&sbx) || sbx.Annotations[v1alpha1.AnnotationPoolReusedAt] == "" {
			return fmt.Errorf("annotations %v", sbx.Annotations)
		}
		return nil
	})
	backIn := time.Since(released)

	// B: the same sandbox (the older of the pool's, once it serves).
	var b *apiclient.PoolLease
	e.eventually("holder B to lease the reused sandbox", func() error {
		l, err := api.AcquirePoolLease(ctx, e.ns, "pool", apiclient.AcquireLeaseRequest{Holder: "holder-b", RequestID: fmt.Sprintf("req-b-%d", time.Now().UnixNano()), TTLSeconds: 900})
		if err != nil {
			return err
		}
		if l.Sandbox != a.Sandbox {
			// The pool's replacement: give it back, it is deleted or
			// reset, and try again.
			_ = api.ReleaseLease(ctx, l.AgentID, apiclient.ReleaseLeaseRequest{Holder: l.Holder, LeaseID: l.LeaseID})
			return fmt.Errorf("got sandbox %s, not %s", l.Sandbox, a.Sandbox)
		}
		b = l
		return nil
	})
	var sbxB v1alpha1.Sandbox
	must(t, e.get(b.Sandbox, &sbxB))
	if sbxB.UID != sbxA.UID || b.AgentID != a.AgentID {
		t.Fatalf("B's sandbox %s (%s, agent %s), A's %s (%s, agent %s)", sbxB.Name, sbxB.UID, b.AgentID, sbxA.Name, sbxA.UID, a.AgentID)
	}

	out := e.runVia(api, b.AgentID, `ls -A /workspace; echo ---; ls -A /workspace/.agentbox; echo ---; ls -A /tmp; echo ---; `+
		`ps -eo args | grep -c '[h]ttp.server'; echo ---; echo "${A_SECRET:-unset}"; if [ -f "$HOME/.profile" ]; then . "$HOME/.profile"; fi; echo "${A_SECRET:-unset}"`)
	want := ".agentbox\n---\nenvs\n---\n---\n0\n---\nunset\nunset\n"
	if out != want {
		t.Fatalf("B sees:\n%s\nwant:\n%s", out, want)
	}
	list, err := api.ListEnvs(ctx, b.AgentID)
	must(t, err)
	var names []string
	for _, env := range list.Environments {
		names = append(names, env.Name)
	}
	if !slices.Equal(names, []string{built.Name}) {
		t.Fatalf("B's environments %v, want only the untouched %s (not the tampered one)", names, built.Name)
	}
	cached, err := api.CreateEnv(ctx, b.AgentID, apiclient.EnvRequest{Requirements: requirements})
	must(t, err)
	if cached.Created || cached.Name != built.Name {
		t.Fatalf("B's create_env: %+v, want A's %s from the cache", cached, built.Name)
	}
	raw, err := api.Execute(ctx, b.AgentID, supervisorapi.ExecuteRequest{Requirements: requirements,
		Code: "import agentbox_greet; print(agentbox_greet.hello('b'))"})
	must(t, err)
	var res supervisorapi.ExecuteResult
	must(t, json.Unmarshal(raw, &res))
	if res.Status != supervisorapi.ExecuteSuccess || res.Output != "hello b\n" || res.Env == nil || res.Env.Created {
		t.Fatalf("B's execute: %s", raw)
	}
	_, err = api.CreateEnv(ctx, b.AgentID, apiclient.EnvRequest{Name: "tampered", Requirements: requirements})
	if err == nil {
		t.Fatalf("B's build of the tampered environment's name succeeded with A's index gone: it came from somewhere")
	}

	// The reset was reported.
	var events corev1.EventList
	must(t, e.c.List(ctx, &events, client.InNamespace(e.ns)))
	var reused bool
	for _, ev := range events.Items {
		reused = reused || (ev.InvolvedObject.Name == a.Sandbox && ev.Reason == EventPoolReused)
	}
	if !reused {
		t.Errorf("no %s event on %s", EventPoolReused, a.Sandbox)
	}
	t.Logf("released sandbox %s back in its pool %s after the release; B's execute in A's environment: env setup %d ms",
		a.Sandbox, backIn.Round(time.Millisecond), res.EnvSetupMS)
	must(t, api.ReleaseLease(ctx, b.AgentID, apiclient.ReleaseLeaseRequest{Holder: b.Holder, LeaseID: b.LeaseID}))
}
