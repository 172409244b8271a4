package main

import (
	"context"
	"encoding/json"
	"errors"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/agentbox/terraform-provider-agentbox/internal/pki"
	"github.com/agentbox/terraform-provider-agentbox/internal/supervisor"
	api "github.com/agentbox/terraform-provider-agentbox/internal/supervisor/supervisorapi"
)

// TestSupervisorProcessTools calls every sandboxed tool through the real
// binary over mTLS, as the Compute API's tool_request will.
func TestSupervisorProcessTools(t *testing.T) {
	bin := buildSupervisor(t)
	ca, err := pki.NewCA("agentbox-test-ca")
	if err != nil {
		t.Fatal(err)
	}
	sandboxID := pki.SandboxID("", "agents", "sb-tools").String()
	tlsDir := writeTLSDir(t, ca, issue(t, ca, sandboxID, pki.UsageServer))
	controlPlane := issue(t, ca, pki.ControlPlaneID("", "platform").String(), pki.UsageClient)
	workdir := t.TempDir()
	auditPath := filepath.Join(t.TempDir(), "audit.jsonl")
	p := startSupervisor(t, bin,
		[]string{"-listen", "127.0.0.1:0", "-tls-dir", tlsDir, "-workdir", workdir, "-audit-log", auditPath, "-workspace-cap", "1MiB"},
		[]string{"AGENTBOX_NAMESPACE=platform", "PATH=" + os.Getenv("PATH")})
	client := clientFor(t, p.addr, controlPlane, ca, sandboxID)
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()

	catalog, err := client.ListTools(ctx)
	if err != nil {
		t.Fatal(err)
	}
	var names []string
	for _, tool := range catalog {
		names = append(names, tool.Name)
	}
	want := []string{api.ToolCreateFile, api.ToolReadFile, api.ToolEditFile, api.ToolListFiles, api.ToolStatFile,
		api.ToolDeleteFile, api.ToolRunCommand, api.ToolPythonExec}
	if !slices.Equal(names, want) {
		t.Fatalf("catalog %q, want %q", names, want)
	}

	callTool := func(name string, in, out any) error {
		t.Helper()
		start := time.Now()
		raw, err := client.CallTool(ctx, name, in)
		if err != nil {
			return err
		}
		t.Logf("%s in %s: %.200s", name, time.Since(start), raw)
		if out != nil {
			if err := json.Unmarshal(raw, out); err != nil {
				t.Fatalf("%s output: %v", name, err)
			}
		}
		return nil
	}
	must := func(name string, in, out any) {
		t.Helper()
		if err := callTool(name, in, out); err != nil {
			t.Fatalf("%s: %v", name, err)
		}
	}

	must(api.ToolCreateFile, api.CreateFileInput{Path: "app/main.py", Content: "print('hi from a file')\n"}, nil)
	var edited api.EditFileOutput
	must(api.ToolEditFile, api.EditFileInput{Path: "app/main.py", OldText: "hi", NewText: "hello"}, &edited)
	var read api.ReadFileOutput
	must(api.ToolReadFile, api.ReadFileInput{Path: "app/main.py"}, &read)
	if edited.Replacements != 1 || read.Content != "print('hello from a file')\n" {
		t.Fatalf("after the edit: %+v, read %+v", edited, read)
	}
	var list api.ListResult
	must(api.ToolListFiles, api.ListFilesInput{Path: "app"}, &list)
	var fi api.FileInfo
	must(api.ToolStatFile, api.StatFileInput{Path: "app/main.py"}, &fi)
	if len(list.Entries) != 1 || list.Entries[0].Name != "main.py" || fi.Size != int64(len(read.Content)) {
		t.Fatalf("list %+v, stat %+v", list, fi)
	}

	// Commands get the supervisor's default PATH, so look where they will.
	python := false
	for _, dir := range filepath.SplitList(supervisor.DefaultPath) {
		if _, err := os.Stat(filepath.Join(dir, "python3")); err == nil {
			python = true
		}
	}
	var res api.CommandResult
	if python {
		must(api.ToolRunCommand, api.CommandRequest{Command: []string{"python3", "app/main.py"}}, &res)
		if res.ExitCode != 0 || res.Stdout != "hello from a file\n" {
			t.Fatalf("run_command = %+v", res)
		}
		must(api.ToolPythonExec, api.PythonRequest{Code: "import sys; print(sum(range(10))); sys.exit(2)"}, &res)
		if res.ExitCode != 2 || res.Stdout != "45\n" {
			t.Fatalf("python_exec = %+v", res)
		}
	} else {
		t.Log("no python3 in the default PATH; python_exec not exercised")
		must(api.ToolRunCommand, api.CommandRequest{Command: []string{"sh", "-c", "cat app/main.py; exit 2"}}, &res)
		if res.ExitCode != 2 || res.Stdout != read.Content {
			t.Fatalf("run_command = %+v", res)
		}
	}

	// The cap and confinement are the file endpoints'.
	big := strings.Repeat("x", 2<<20)
	if err := callTool(api.ToolCreateFile, api.CreateFileInput{Path: "big", Content: big}, nil); api.CodeOf(err) != api.CodeWorkspaceFull {
		t.Fatalf("create_file past the cap: %v", err)
	}
	if err := callTool(api.ToolReadFile, api.ReadFileInput{Path: "../../etc/passwd"}, nil); api.CodeOf(err) != api.CodePathEscapesWorkspace {
		t.Fatalf("read_file ../../etc/passwd: %v", err)
	}
	err = callTool(api.ToolCreateFile, json.RawMessage(`{"path":"x","contents":"typo"}`), nil)
	var apiErr *api.Error
	if !errors.As(err, &apiErr) || apiErr.Code != api.CodeInvalidArgument ||
		!strings.Contains(apiErr.Message, "'contents'") || !strings.Contains(apiErr.Message, "missing property 'content'") {
		t.Fatalf("misspelt field: %v", err)
	}
	t.Logf("misspelt field refused: %s", apiErr.Message)
	must(api.ToolDeleteFile, api.DeleteFileInput{Path: "app", Recursive: true}, nil)
	if entries, _ := os.ReadDir(workdir); len(entries) != 0 {
		t.Fatalf("workspace not empty after delete_file: %v", entries)
	}

	sigterm(t, p, 15*time.Second)
	var audited []string
	for _, e := range readAudit(t, auditPath) {
		audited = append(audited, asString(e["tool"]))
	}
	wantAudit := []string{"list_tools", "create_file", "edit_file", "read_file", "list_files", "stat_file", "run_command"}
	if python {
		wantAudit = append(wantAudit, "python_exec")
	}
	wantAudit = append(wantAudit, "create_file", "read_file", "create_file", "delete_file")
	if !slices.Equal(audited, wantAudit) {
		t.Fatalf("audited %q, want %q", audited, wantAudit)
	}
}
