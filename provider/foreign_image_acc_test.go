package provider

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"os"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/hashicorp/terraform-plugin-testing/helper/resource"
	"github.com/hashicorp/terraform-plugin-testing/knownvalue"
	"github.com/hashicorp/terraform-plugin-testing/plancheck"
	"github.com/hashicorp/terraform-plugin-testing/statecheck"
	"github.com/hashicorp/terraform-plugin-testing/terraform"
	"github.com/hashicorp/terraform-plugin-testing/tfjsonpath"
	"k8s.io/apimachinery/pkg/types"
	ctrlclient "sigs.k8s.io/controller-runtime/pkg/client"

	agentboxv1alpha1 "github.com/agentbox/terraform-provider-agentbox/internal/api/v1alpha1"
	"github.com/agentbox/terraform-provider-agentbox/internal/computeapi/client"
)

// foreignImage is one of the images that `make test-images` builds the way
// public images are made: their own entrypoint, command, user and
// environment, no sandbox user, no /workspace and no agentbox supervisor.
type foreignImage struct {
	// name is the image's name under agentbox-test/, and the template's.
	name string
	// python says whether the image has python3, so that python_exec runs.
	python bool
	// own is a command only this image has, and what it prints.
	own     []string
	ownWant string
	// uid is the image's own user, which its template runs the sandbox as
	// (run_as_image_user); zero for an image whose user is root, whose
	// template keeps the platform's user 65532.
	uid int
}

var foreignImages = []foreignImage{
	{name: "debian-python", python: true, own: []string{"python3", "-c", "print(6*7)"}, ownWant: "42\n"},
	{name: "node", own: []string{"node", "-e", "console.log(6*7)"}, ownWant: "42\n", uid: 1000},
	{name: "busybox", own: []string{"sh", "-c", "busybox true && echo 42"}, ownWant: "42\n"},
}

// foreignIdle is as short as a test can see a stop with.
const foreignIdle = 30 * time.Second

// TestAccForeignImages: templates on three images that nobody here wrote
// for agentbox, applied with the terraform CLI on the platform's default
// install, each serve the same operations through the Compute API: a
// command (with the image's own tool and environment), a file round trip,
// a terminal, python_exec where the image has Python (a clear error naming
// the interpreter where it has not), the stdio MCP server the template
// runs, and an idle stop and resume that keep the workspace. The node
// image's template runs it as the image's own user 1000
// (run_as_image_user), the others as the platform's user.
func TestAccForeignImages(t *testing.T) {
	t.Parallel()
	tag := testAccPlatformImageTag(t)
	c, ns := testAccCluster(t)
	tools := settingsTools(t)
	cfg := testAccForeignImagesConfig(ns, tag)
	checks := []statecheck.StateCheck{
		statecheck.ExpectKnownValue("agentbox_platform.this", tfjsonpath.New("status"), knownvalue.StringExact("deployed")),
	}
	for _, im := range foreignImages {
		checks = append(checks,
			statecheck.ExpectKnownValue("agentbox_sandbox_template."+foreignResource(im.name), tfjsonpath.New("image"),
				knownvalue.StringExact("agentbox-test/"+im.name+":"+tag)),
			statecheck.ExpectKnownValue("agentbox_sandbox."+foreignResource(im.name), tfjsonpath.New("agent_id"),
				knownvalue.StringExact(foreignAgent(im.name))))
	}
	resource.Test(t, resource.TestCase{
		ProtoV6ProviderFactories: testAccProtoV6ProviderFactories,
		CheckDestroy:             platformDestroyed(c, ns),
		Steps: []resource.TestStep{
			{
				Config:            cfg,
				ConfigStateChecks: checks,
				Check: func(s *terraform.State) error {
					api, err := platformAPI(s, "agentbox_platform.this")
					if err != nil {
						return err
					}
					defer api.CloseIdleConnections()
					ctx, cancel := context.WithTimeout(context.Background(), 20*time.Minute)
					defer cancel()
					return checkForeignImages(ctx, t, c, ns, api, tools.mcpcalc)
				},
			},
			{
				Config:           cfg,
				ConfigPlanChecks: resource.ConfigPlanChecks{PreApply: []plancheck.PlanCheck{plancheck.ExpectEmptyPlan()}},
			},
			{
				Config:            cfg,
				ResourceName:      "agentbox_sandbox_template.busybox",
				ImportState:       true,
				ImportStateId:     ns + "/busybox",
				ImportStateVerify: true,
			},
		},
	})
}

func foreignAgent(image string) string { return "foreign-" + image }

func testAccForeignImagesConfig(ns, tag string) string {
	return fmt.Sprintf(`
provider "agentbox" {
  kubernetes = {
    config_path = %[1]q
  }
  namespace = %[2]q
}

# The chart's defaults: only the image tag, as the quickstart.
resource "agentbox_platform" "this" {
  image_tag = %[3]q
}

%[4]s`, os.Getenv(testAccKubeconfigEnv), ns, tag, foreignBlocks(tag))
}

// foreignBlocks declares a template and a sandbox per foreign image, as
// separate blocks: the test framework's state checks and import steps
// name resources without for_each keys.
func foreignBlocks(tag string) string {
	var b strings.Builder
	for _, im := range foreignImages {
		fmt.Fprintf(&b, `
resource "agentbox_sandbox_template" %[6]q {
  name              = %[1]q
  image             = "agentbox-test/%[1]s:%[2]s"
  run_as_image_user = %[7]t
  idle_timeout      = %[3]q
  env = {
    GREETING = "hello from the template"
  }
  mcp_servers = [{
    name    = "calc"
    command = %[4]q
  }]

  depends_on = [agentbox_platform.this]
}

resource "agentbox_sandbox" %[6]q {
  name     = %[1]q
  agent_id = %[5]q
  template = agentbox_sandbox_template.%[6]s.name
}
`, im.name, tag, foreignIdle.String(), settingsMCPPath, foreignAgent(im.name), foreignResource(im.name), im.uid != 0)
	}
	return b.String()
}

// foreignResource is the resource name of an image's template and sandbox.
func foreignResource(image string) string { return strings.ReplaceAll(image, "-", "_") }

// checkForeignImages runs the operations on every image's sandbox side by
// side (they are independent, and the idle stops overlap), and reports
// every image's failure.
func checkForeignImages(ctx context.Context, t *testing.T, c ctrlclient.Client, ns string, api *client.Client, mcpcalc string) error {
	errs := make([]error, len(foreignImages))
	var wg sync.WaitGroup
	for i, im := range foreignImages {
		wg.Add(1)
		go func() {
			defer wg.Done()
			r := &foreignRun{t: t, c: c, api: api, im: im, agent: foreignAgent(im.name),
				key: types.NamespacedName{Namespace: ns, Name: im.name}, mcpcalc: mcpcalc}
			if err := r.check(ctx); err != nil {
				errs[i] = fmt.Errorf("image %s: %w", im.name, err)
			}
		}()
	}
	wg.Wait()
	var failed []string
	for _, err := range errs {
		if err != nil {
			failed = append(failed, err.Error())
		}
	}
	if len(failed) > 0 {
		return fmt.Errorf("%s", strings.Join(failed, "\n"))
	}
	return nil
}

// foreignRun is the checks on one image's sandbox.
type foreignRun struct {
	t       *testing.T
	c       ctrlclient.Client
	api     *client.Client
	im      foreignImage
	agent   string
	key     types.NamespacedName
	mcpcalc string
}

func (r *foreignRun) check(ctx context.Context) error {
	for _, step := range []struct {
		name string
		fn   func(context.Context) error
	}{
		{"commands", r.checkCommands},
		{"a file round trip", r.checkFiles},
		{"a terminal", r.checkTerminal},
		{"python_exec", r.checkPython},
		{"the stdio MCP server", r.checkMCP},
		{"an idle stop and resume", r.checkStopResume},
	} {
		start := time.Now()
		if err := step.fn(ctx); err != nil {
			return fmt.Errorf("%s: %w", step.name, err)
		}
		r.t.Logf("%s: checked %s in %s", r.im.name, step.name, time.Since(start).Round(time.Millisecond))
	}
	return nil
}

func (r *foreignRun) run(ctx context.Context, command ...string) (*client.CommandResult, error) {
	res, err := r.api.RunCommand(ctx, r.agent, client.RunCommandRequest{Command: command, TimeoutSeconds: 120})
	if err != nil {
		return nil, fmt.Errorf("run_command %q: %w", command, err)
	}
	return res, nil
}

// checkCommands: a shell command as the platform's non-root user (or the
// image's own, where its template says so) in the workspace, with the workspace as HOME, the image's own environment and
// the template's, and the image's own tool.
func (r *foreignRun) checkCommands(ctx context.Context) error {
	res, err := r.run(ctx, "sh", "-c", `echo "uid=$(id -u) pwd=$(pwd) home=$HOME image=$FOREIGN_IMAGE template=$GREETING"`)
	if err != nil {
		return err
	}
	uid := 65532
	if r.im.uid != 0 {
		uid = r.im.uid
	}
	want := fmt.Sprintf("uid=%d pwd=/workspace home=/workspace image=%s template=hello from the template\n", uid, r.im.name)
	if res.ExitCode != 0 || res.Stdout != want {
		return fmt.Errorf("sh -c: %+v; want stdout %q", res, want)
	}
	res, err = r.run(ctx, r.im.own...)
	if err != nil {
		return err
	}
	if res.ExitCode != 0 || res.Stdout != r.im.ownWant {
		return fmt.Errorf("the image's own %q: %+v; want stdout %q", r.im.own, res, r.im.ownWant)
	}
	return nil
}

// checkFiles: a file written through the API is what a command reads, and
// what a command writes is what the API reads.
func (r *foreignRun) checkFiles(ctx context.Context) error {
	body := "written through the file API into " + r.im.name + "\n"
	if _, err := r.api.PutFile(ctx, r.agent, "notes/in.txt", strings.NewReader(body), 0o644); err != nil {
		return fmt.Errorf("put notes/in.txt: %w", err)
	}
	res, err := r.run(ctx, "sh", "-c", "cat notes/in.txt && cat notes/in.txt notes/in.txt > notes/out.txt")
	if err != nil {
		return err
	}
	if res.ExitCode != 0 || res.Stdout != body {
		return fmt.Errorf("cat of the put file: %+v; want %q", res, body)
	}
	rc, err := r.api.GetFile(ctx, r.agent, "notes/out.txt")
	if err != nil {
		return fmt.Errorf("get notes/out.txt: %w", err)
	}
	got, err := io.ReadAll(rc)
	rc.Close()
	if err != nil {
		return err
	}
	if string(got) != body+body {
		return fmt.Errorf("notes/out.txt read through the API: %q; want %q", got, body+body)
	}
	return nil
}

// checkTerminal types into a shell and reads its answer.
func (r *foreignRun) checkTerminal(ctx context.Context) error {
	term, err := r.api.OpenPTY(ctx, r.agent, client.PTYOptions{Command: []string{"sh"}, Cols: 100, Rows: 30})
	if err != nil {
		return fmt.Errorf("open a terminal: %w", err)
	}
	defer term.Close()
	var mu sync.Mutex
	var out bytes.Buffer
	go func() {
		buf := make([]byte, 4096)
		for {
			n, err := term.Read(buf)
			mu.Lock()
			out.Write(buf[:n])
			mu.Unlock()
			if err != nil {
				return
			}
		}
	}()
	// The typed line holds the sum, not its value, so only the shell's
	// answer matches.
	if _, err := term.Write([]byte("echo pty-$((40+2))\n")); err != nil {
		return fmt.Errorf("type into the terminal: %w", err)
	}
	for deadline := time.Now().Add(30 * time.Second); ; {
		mu.Lock()
		text := out.String()
		mu.Unlock()
		if strings.Contains(text, "pty-42") {
			return nil
		}
		if time.Now().After(deadline) {
			return fmt.Errorf("the terminal did not answer: %q", text)
		}
		time.Sleep(200 * time.Millisecond)
	}
}

// checkPython: python_exec runs where the image has python3, and says
// which interpreter is missing where it has not.
func (r *foreignRun) checkPython(ctx context.Context) error {
	raw, err := r.api.ToolRequest(ctx, r.agent, "python_exec", map[string]any{"code": "print(6*7)"})
	if !r.im.python {
		if err == nil {
			return fmt.Errorf("python_exec in an image without Python answered %s; want an error", raw)
		}
		var apiErr *client.Error
		if !errors.As(err, &apiErr) || apiErr.Code != client.CodeInvalidArgument || !strings.Contains(apiErr.Message, "python3") {
			return fmt.Errorf("python_exec in an image without Python: %v; want invalid_argument naming python3", err)
		}
		r.t.Logf("%s: python_exec without Python: %v", r.im.name, err)
		return nil
	}
	if err != nil {
		return fmt.Errorf("python_exec: %w", err)
	}
	var py client.CommandResult
	if err := json.Unmarshal(raw, &py); err != nil || py.ExitCode != 0 || py.Stdout != "42\n" {
		return fmt.Errorf("python_exec: %s (%v); want 42", raw, err)
	}
	return nil
}

// checkMCP puts the static MCP server where the template runs it from;
// the supervisor's bridge starts it once it is there.
func (r *foreignRun) checkMCP(ctx context.Context) error {
	f, err := os.Open(r.mcpcalc)
	if err != nil {
		return err
	}
	_, err = r.api.PutFile(ctx, r.agent, strings.TrimPrefix(settingsMCPPath, "/workspace/"), f, 0o755)
	f.Close()
	if err != nil {
		return fmt.Errorf("put the MCP server's binary: %w", err)
	}
	env, err := mcpGetenv(ctx, r.api, r.agent, "FOREIGN_IMAGE")
	if err != nil {
		return err
	}
	if env["FOREIGN_IMAGE"] != r.im.name {
		return fmt.Errorf("the MCP server's environment: %v; want the image's FOREIGN_IMAGE=%s", env, r.im.name)
	}
	return nil
}

// checkStopResume writes a file, waits for the idle stop, and reads the
// file back through the call that resumes the sandbox.
func (r *foreignRun) checkStopResume(ctx context.Context) error {
	body := fmt.Sprintf("kept across the idle stop of %s at %s", r.im.name, time.Now().Format(time.RFC3339Nano))
	if _, err := r.api.PutFile(ctx, r.agent, "keep.txt", strings.NewReader(body), 0o644); err != nil {
		return fmt.Errorf("put keep.txt: %w", err)
	}
	from := time.Now()
	for {
		var sbx agentboxv1alpha1.Sandbox
		if err := r.c.Get(ctx, r.key, &sbx); err != nil {
			return err
		}
		if sbx.Status.Phase == agentboxv1alpha1.SandboxPhaseStopped {
			break
		}
		if sbx.Status.Phase == agentboxv1alpha1.SandboxPhaseError {
			return fmt.Errorf("the idle stop failed: %s", readyMessage(&sbx))
		}
		if time.Since(from) > foreignIdle+10*time.Minute {
			return fmt.Errorf("not stopped %s after the last call (phase %s: %s)", time.Since(from).Round(time.Second), sbx.Status.Phase, readyMessage(&sbx))
		}
		select {
		case <-ctx.Done():
			return ctx.Err()
		case <-time.After(time.Second):
		}
	}
	r.t.Logf("%s: idle-stopped %s after the last call", r.im.name, time.Since(from).Round(time.Second))
	start := time.Now()
	res, err := r.run(ctx, "cat", "keep.txt")
	if err != nil {
		return fmt.Errorf("the call that resumes: %w; %s", err, sandboxPodState(ctx, r.c, r.key))
	}
	if res.ExitCode != 0 || res.Stdout != body {
		return fmt.Errorf("keep.txt after the resume: %+v; want %q", res, body)
	}
	r.t.Logf("%s: resumed with the workspace by the next call in %s", r.im.name, time.Since(start).Round(time.Millisecond))
	return nil
}
