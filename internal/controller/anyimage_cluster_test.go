package controller

import (
	"bytes"
	"context"
	"errors"
	"io"
	"os"
	"strings"
	"testing"
	"time"

	corev1 "k8s.io/api/core/v1"
	"k8s.io/apimachinery/pkg/api/meta"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"

	"github.com/agentbox/terraform-provider-agentbox/internal/api/v1alpha1"
	"github.com/agentbox/terraform-provider-agentbox/internal/computeapi"
	apiclient "github.com/agentbox/terraform-provider-agentbox/internal/computeapi/client"
	"github.com/agentbox/terraform-provider-agentbox/internal/snapshot/archive"
	"github.com/agentbox/terraform-provider-agentbox/internal/testenv/toolchain"
)

// TestAnyImageIsASandbox runs sandboxes, on the real cluster, from two
// images that know nothing of agentbox: the test node's busybox (sh and a
// few applets in /bin, PATH=/bin, no python3, no bash) and its pause image
// (one static binary, no shell at all). The injected supervisor serves
// both through the Compute API: commands with the image's own environment,
// python_exec and execute refused with what the image lacks, a terminal
// (sh, or a clear refusal without a shell), and an idle stop and resume
// that keep the workspace without any tool of the image's.
func TestAnyImageIsASandbox(t *testing.T) {
	t.Parallel()
	if os.Getenv(EnvSupervisorImage) == "" && os.Getenv(EnvImageTag) == "" {
		t.Skipf("neither %s nor %s is set: no supervisor image on the test node (make test imports one)", EnvSupervisorImage, EnvImageTag)
	}
	drv, err := archive.New(archive.Config{Dir: t.TempDir()})
	must(t, err)
	t.Cleanup(drv.Close)
	var pool *computeapi.SupervisorPool
	e := newClusterEnv(t, withSnapshots(t, drv, &pool))
	api := e.computeAPI(pool)
	ctx := e.ctx

	create := func(name, image string, imageUser bool) {
		t.Helper()
		e.template(name, func(tpl *v1alpha1.SandboxTemplate) {
			tpl.Spec.Image = image
			tpl.Spec.RunAsImageUser = imageUser
			// Longer than the test: only setActivity makes it idle.
			tpl.Spec.IdleTimeout = metav1.Duration{Duration: time.Hour}
		})
		e.sandbox(name, name)
	}
	start := func(name, image string) string {
		t.Helper()
		create(name, image, false)
		sbx, took := e.waitPhase(name, v1alpha1.SandboxPhaseRunning, v1alpha1.ReasonRunning)
		t.Logf("%s: Running %s after creation", image, took.Round(time.Millisecond))
		return sbx.Spec.AgentID
	}
	refused := func(what string, err error, code apiclient.Code, says string) {
		t.Helper()
		var apiErr *apiclient.Error
		if !errors.As(err, &apiErr) || apiErr.Code != code || !strings.Contains(apiErr.Message, says) {
			t.Errorf("%s: %v, want %s saying %q", what, err, code, says)
			return
		}
		t.Logf("%s: %s: %s", what, apiErr.Code, apiErr.Message)
	}
	noPython := func(agent string) {
		t.Helper()
		_, err := api.ToolRequest(ctx, agent, "python_exec", map[string]any{"code": "print(1)"})
		refused("python_exec", err, apiclient.CodeInvalidArgument, "python_exec needs python3 on the sandbox image's PATH")
		_, err = api.Execute(ctx, agent, map[string]any{"code": "print(1)"})
		refused("execute", err, apiclient.CodeInvalidArgument, "python_execute needs python3 on the sandbox image's PATH")
	}
	// stopAndResume idle-stops the sandbox, wakes it with wake and checks
	// that the file put before the stop came back.
	stopAndResume := func(name, agent string, wake func()) {
		t.Helper()
		const content = "kept across an idle stop\n"
		if _, err := api.PutFile(ctx, agent, "notes/kept.txt", strings.NewReader(content), 0o644); err != nil {
			t.Fatalf("put a file: %v", err)
		}
		e.setActivity(name, time.Now().Add(-2*time.Hour))
		sbx, took := e.waitPhase(name, v1alpha1.SandboxPhaseStopped, v1alpha1.ReasonStopped)
		if sbx.Status.Snapshot == nil {
			t.Fatalf("stopped without a snapshot: %+v", sbx.Status)
		}
		t.Logf("idle stop took %s", took.Round(time.Millisecond))
		wake()
		e.waitPhase(name, v1alpha1.SandboxPhaseRunning, v1alpha1.ReasonRunning)
		rc, err := api.GetFile(ctx, agent, "notes/kept.txt")
		if err != nil {
			t.Fatalf("get the file after the resume: %v", err)
		}
		got, err := io.ReadAll(rc)
		rc.Close()
		if err != nil || string(got) != content {
			t.Errorf("after the resume the file holds %q (%v), want %q", got, err, content)
		}
	}

	t.Run("busybox", func(t *testing.T) {
		agent := start("busybox", toolchain.BusyboxImage)
		res, err := api.RunCommand(ctx, agent, apiclient.RunCommandRequest{
			Command: []string{"sh", "-c", `echo "path=$PATH home=$HOME uid=$(id -u) pwd=$(pwd)"; export -p`},
		})
		if err != nil || res.ExitCode != 0 {
			t.Fatalf("a command: %+v, %v", res, err)
		}
		// The image's PATH (busybox's is /bin alone), not the
		// supervisor's default; HOME the workspace.
		if first, _, _ := strings.Cut(res.Stdout, "\n"); first != "path=/bin home=/workspace uid=65532 pwd=/workspace" {
			t.Errorf("the command saw %q, want the image's PATH, HOME the workspace, uid 65532 in the workspace", first)
		}
		for _, not := range []string{"AGENTBOX_", "GODEBUG", "KUBERNETES_"} {
			if strings.Contains(res.Stdout, not) {
				t.Errorf("%s reached the command:\n%s", not, res.Stdout)
			}
		}
		noPython(agent)

		// A terminal without a command: busybox has no bash, so sh.
		pty, err := api.OpenPTY(ctx, agent, apiclient.PTYOptions{})
		if err != nil {
			t.Fatalf("a terminal: %v", err)
		}
		if _, err := pty.Write([]byte("echo shell-$((6*7))\nexit 3\n")); err != nil {
			t.Fatal(err)
		}
		out, _ := io.ReadAll(pty)
		waitCtx, cancel := context.WithTimeout(ctx, 30*time.Second)
		exit, err := pty.Wait(waitCtx)
		cancel()
		pty.Close()
		if err != nil || exit.ExitCode != 3 || !bytes.Contains(out, []byte("shell-42")) {
			t.Errorf("terminal: exit %+v, %v, output %q", exit, err, out)
		}

		stopAndResume("busybox", agent, func() {
			res, err := api.RunCommand(ctx, agent, apiclient.RunCommandRequest{Command: []string{"cat", "notes/kept.txt"}})
			if err != nil || res.ExitCode != 0 {
				t.Fatalf("a command on the stopped sandbox: %+v, %v", res, err)
			}
		})
	})

	// The image's own user: busybox's is root, which kubelet refuses under
	// runAsNonRoot, and the sandbox says so; the pause image's is
	// 65535:65535, which runs and reaches the workspace through the
	// platform's group.
	t.Run("image user root", func(t *testing.T) {
		create("imageuser-root", toolchain.BusyboxImage, true)
		sbx, _ := e.waitPhase("imageuser-root", v1alpha1.SandboxPhaseError, v1alpha1.ReasonImageRunsAsRoot)
		c := meta.FindStatusCondition(sbx.Status.Conditions, v1alpha1.ConditionReady)
		if c == nil || !strings.Contains(c.Message, "image will run as root") {
			t.Errorf("Ready condition %+v does not carry kubelet's words", c)
		}
		t.Logf("%s: %s", c.Reason, c.Message)
	})
	t.Run("image user", func(t *testing.T) {
		create("imageuser", toolchain.PauseImage, true)
		sbx, _ := e.waitPhase("imageuser", v1alpha1.SandboxPhaseRunning, v1alpha1.ReasonRunning)
		agent := sbx.Spec.AgentID
		if _, err := api.PutFile(ctx, agent, "mine.txt", strings.NewReader("written as 65535\n"), 0o644); err != nil {
			t.Fatalf("put a file as the image's user: %v", err)
		}
		rc, err := api.GetFile(ctx, agent, "mine.txt")
		if err != nil {
			t.Fatalf("get it back: %v", err)
		}
		got, _ := io.ReadAll(rc)
		rc.Close()
		if string(got) != "written as 65535\n" {
			t.Errorf("read back %q", got)
		}
		var pod corev1.Pod
		must(t, e.c.Get(ctx, types.NamespacedName{Namespace: sbx.Namespace, Name: sbx.Status.PodName}, &pod))
		if sc := pod.Spec.Containers[0].SecurityContext; sc.RunAsUser != nil {
			t.Errorf("the sandbox container runs as %d, not the image's user", *sc.RunAsUser)
		}
	})

	t.Run("no shell", func(t *testing.T) {
		agent := start("noshell", toolchain.PauseImage)
		// Nothing to run but what the platform put there.
		res, err := api.RunCommand(ctx, agent, apiclient.RunCommandRequest{Command: []string{"/agentbox/bin/agentbox-supervisor", "-version"}})
		if err != nil || res.ExitCode != 0 || strings.TrimSpace(res.Stdout) == "" {
			t.Fatalf("the supervisor's -version as a command: %+v, %v", res, err)
		}
		_, err = api.RunCommand(ctx, agent, apiclient.RunCommandRequest{Command: []string{"sh", "-c", "true"}})
		refused("sh in an image without one", err, apiclient.CodeInvalidArgument, `"sh" not found`)
		noPython(agent)
		_, err = api.OpenPTY(ctx, agent, apiclient.PTYOptions{})
		refused("a terminal without a shell", err, apiclient.CodeInvalidArgument, "neither bash nor sh")

		stopAndResume("noshell", agent, func() {
			if _, err := api.RunCommand(ctx, agent, apiclient.RunCommandRequest{Command: []string{"/agentbox/bin/agentbox-supervisor", "-version"}}); err != nil {
				t.Fatalf("a command on the stopped sandbox: %v", err)
			}
		})
	})
}
