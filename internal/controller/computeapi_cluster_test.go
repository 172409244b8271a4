package controller

import (
	"bytes"
	"crypto/rand"
	"crypto/sha256"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net/url"
	"os"
	"strings"
	"testing"
	"time"

	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"

	"github.com/agentbox/terraform-provider-agentbox/internal/api/v1alpha1"
	apiclient "github.com/agentbox/terraform-provider-agentbox/internal/computeapi/client"
)

// TestComputeAPIOnCluster drives the Compute API's operations against a
// real gVisor sandbox on the cluster, with the controller, the real store
// and the archive snapshot driver behind them: commands (plain and
// streamed), files in and out byte for byte, the sandboxed tools, /execute, status, a filespace push,
// the audit chain, and terminate with a snapshot (then a call resumes the
// sandbox with its workspace) and without (the sandbox is gone).
func TestComputeAPIOnCluster(t *testing.T) {
	t.Parallel()
	image := os.Getenv(EnvSandboxImage)
	if image == "" {
		t.Skipf("%s is not set: the operations need the real sandbox image's supervisor", EnvSandboxImage)
	}
	e, st, pool := platformEnv(t)
	api := e.computeAPIWithStore(pool, st)
	e.template("tpl", func(tpl *v1alpha1.SandboxTemplate) {
		tpl.Spec.Image = image
		tpl.Spec.IdleTimeout = metav1.Duration{Duration: time.Hour}
	})
	sbx := e.sandbox("ops", "tpl")
	agent := sbx.Spec.AgentID
	sbx, _ = e.waitPhase("ops", v1alpha1.SandboxPhaseRunning, v1alpha1.ReasonRunning)
	if !e.workspaceWritable(t, e.supervisor(t, sbx)) {
		t.Skip("the operations write the workspace")
	}
	ctx := e.ctx

	res, err := api.RunCommand(ctx, agent, apiclient.RunCommandRequest{Command: []string{"sh", "-c", "echo out; echo err >&2; exit 3"}})
	if err != nil || res.ExitCode != 3 || res.Stdout != "out\n" || res.Stderr != "err\n" {
		t.Fatalf("run_command: %+v, %v", res, err)
	}

	var streamed strings.Builder
	res, err = api.RunCommandStream(ctx, agent, apiclient.RunCommandRequest{Command: []string{"sh", "-c", "echo a; echo b"}},
		func(ev apiclient.CommandEvent) error {
			streamed.WriteString(ev.Data)
			return nil
		})
	if err != nil || res.ExitCode != 0 || streamed.String() != "a\nb\n" {
		t.Fatalf("run_command_stream: %+v, %v, streamed %q", res, err, streamed.String())
	}

	// A binary file in and out, byte for byte.
	data := make([]byte, 1<<20)
	_, _ = rand.Read(data)
	if fi, err := api.PutFile(ctx, agent, "data/in.bin", bytes.NewReader(data), 0o640); err != nil || fi.Size != int64(len(data)) {
		t.Fatalf("put_file: %+v, %v", fi, err)
	}
	body, err := api.GetFile(ctx, agent, "data/in.bin")
	must(t, err)
	back, err := io.ReadAll(body)
	body.Close()
	must(t, err)
	if !bytes.Equal(back, data) {
		t.Fatalf("get_file returned %d bytes, not the %d put", len(back), len(data))
	}

	// The sandboxed tools and /execute.
	if _, err := api.ToolRequest(ctx, agent, "create_file", map[string]any{"path": "notes.txt", "content": "hello"}); err != nil {
		t.Fatalf("create_file: %v", err)
	}
	raw, err := api.ToolRequest(ctx, agent, "python_exec", map[string]any{"code": "print(open('notes.txt').read() * 2)"})
	if err != nil || !strings.Contains(string(raw), `hellohello\n`) {
		t.Fatalf("python_exec: %s, %v", raw, err)
	}
	raw, err = api.Execute(ctx, agent, map[string]any{
		"code":  "print(open('in.txt').read().upper()); open('out.txt','w').write('made')",
		"files": map[string][]byte{"in.txt": []byte("inline")},
	})
	must(t, err)
	var ex struct {
		Status        string            `json:"status"`
		Output        string            `json:"output"`
		FilesProduced map[string][]byte `json:"files_produced"`
	}
	if err := json.Unmarshal(raw, &ex); err != nil || ex.Status != "success" || ex.Output != "INLINE\n" || string(ex.FilesProduced["out.txt"]) != "made" {
		t.Fatalf("execute: %s (%v)", raw, err)
	}
	must(t, api.DeleteFile(ctx, agent, "notes.txt", false))
	if _, err := api.GetFile(ctx, agent, "notes.txt"); apiclient.CodeOf(err) != apiclient.CodeFileNotFound {
		t.Errorf("get_file after delete_file: %v, want file_not_found", err)
	}

	status, err := api.Status(ctx, agent)
	if err != nil || status.Phase != string(v1alpha1.SandboxPhaseRunning) {
		t.Fatalf("status: %+v, %v", status, err)
	}
	sum, err := api.SyncFilespace(ctx, agent, apiclient.SyncPush)
	if err != nil || sum.Pushed == 0 {
		t.Fatalf("sync_filespace push: %+v, %v", sum, err)
	}
	if n, err := st.GetFile(ctx, agent, "data/in.bin"); err != nil || n.SizeBytes != int64(len(data)) || n.Mode != 0o640 {
		t.Errorf("data/in.bin in the filespace: %+v, %v", n, err)
	}

	// Terminate with a snapshot stops the sandbox; the next call resumes
	// it with its workspace.
	term, err := api.Terminate(ctx, agent, apiclient.TerminateRequest{Reason: "test: stop with a snapshot", Snapshot: true})
	if err != nil {
		t.Fatalf("terminate with a snapshot: %v", err)
	}
	t.Logf("terminate with a snapshot: %s (%s)", term.Action, term.Status.Phase)
	e.waitPhase("ops", v1alpha1.SandboxPhaseStopped, v1alpha1.ReasonStopped)
	res, err = api.RunCommand(ctx, agent, apiclient.RunCommandRequest{Command: []string{"sha256sum", "data/in.bin"}})
	if err != nil || res.ExitCode != 0 {
		t.Fatalf("run_command after the stop: %+v, %v", res, err)
	}
	if want := fmt.Sprintf("%x  data/in.bin\n", sha256.Sum256(data)); res.Stdout != want {
		t.Errorf("after the resume: %q, want %q", res.Stdout, want)
	}
	var resumed v1alpha1.Sandbox
	must(t, e.get("ops", &resumed))
	if resumed.Status.Phase != v1alpha1.SandboxPhaseRunning {
		t.Errorf("after the call that resumed it, the sandbox is %s", resumed.Status.Phase)
	}

	// The audit chain holds every call and verifies.
	page, err := api.QueryAudit(ctx, url.Values{"agent_id": {agent}})
	must(t, err)
	ops := map[string]bool{}
	for _, r := range page.Records {
		ops[r.Operation] = true
	}
	for _, op := range []string{"run_command", "run_command_stream", "put_file", "get_file", "tool_request", "execute", "delete_file", "status", "sync_filespace", "terminate"} {
		if !ops[op] {
			t.Errorf("no audit record of %s (have %v)", op, ops)
		}
	}
	if v, err := api.VerifyAudit(ctx); err != nil || !v.OK {
		t.Errorf("audit verify: %+v, %v", v, err)
	}

	// Terminate without a snapshot deletes the sandbox.
	if _, err := api.Terminate(ctx, agent, apiclient.TerminateRequest{Reason: "test: done"}); err != nil {
		t.Fatalf("terminate: %v", err)
	}
	e.gone(&v1alpha1.Sandbox{}, "ops")
	if _, err := api.Status(ctx, agent); !errors.Is(err, &apiclient.Error{Code: apiclient.CodeSandboxNotFound}) {
		t.Errorf("status after terminate: %v, want sandbox_not_found", err)
	}
}
