package main

import (
	"bytes"
	"io"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/agentbox/terraform-provider-agentbox/internal/controller"
	"github.com/agentbox/terraform-provider-agentbox/internal/pki"
)

var (
	buildOnce sync.Once
	binary    string
	buildErr  error
)

// buildBinary compiles the control plane once per test run, so the tests
// exercise the real flag parsing and start-up order.
func buildBinary(t *testing.T) string {
	t.Helper()
	buildOnce.Do(func() {
		dir, err := os.MkdirTemp("", "agentbox-controlplane-test")
		if err != nil {
			buildErr = err
			return
		}
		binary = filepath.Join(dir, "agentbox-controlplane")
		out, err := exec.Command("go", "build", "-o", binary, ".").CombinedOutput()
		if err != nil {
			buildErr = &buildError{err: err, out: string(out)}
		}
	})
	if buildErr != nil {
		t.Fatal(buildErr)
	}
	return binary
}

type buildError struct {
	err error
	out string
}

func (e *buildError) Error() string { return "go build: " + e.err.Error() + "\n" + e.out }

func TestMain(m *testing.M) {
	code := m.Run()
	if binary != "" {
		os.RemoveAll(filepath.Dir(binary))
	}
	os.Exit(code)
}

func runBinary(t *testing.T, env []string, args ...string) (string, int) {
	t.Helper()
	cmd := exec.Command(buildBinary(t), args...)
	// A clean environment: no KUBECONFIG or POD_NAMESPACE from the caller
	// may change what the binary does.
	cmd.Env = append([]string{"HOME=" + t.TempDir(), "PATH=" + os.Getenv("PATH")}, env...)
	var out bytes.Buffer
	cmd.Stdout, cmd.Stderr = &out, &out
	err := cmd.Run()
	code := 0
	if ee, ok := err.(*exec.ExitError); ok {
		code = ee.ExitCode()
	} else if err != nil {
		t.Fatal(err)
	}
	return out.String(), code
}

func TestHelpListsTheFlags(t *testing.T) {
	out, code := runBinary(t, nil, "-h")
	if code != 0 {
		t.Errorf("-h exited %d", code)
	}
	for _, f := range []string{"-namespace", "-ca-dir", "-admin-token-file", "-api-listen", "-metrics-listen",
		"-health-listen", "-api-service", "-sandbox-image", "-supervisor-image", "-supervisor-image-pull-policy", "-trust-domain", "-leader-elect", "-kubeconfig"} {
		if !strings.Contains(out, f+" ") && !strings.Contains(out, f+"\n") {
			t.Errorf("-h does not list %s:\n%s", f, out)
		}
	}
}

func TestMissingCADirFailsClearly(t *testing.T) {
	dir := filepath.Join(t.TempDir(), "no-such-ca")
	out, code := runBinary(t, nil, "--ca-dir", dir)
	if code == 0 {
		t.Fatalf("started without a CA:\n%s", out)
	}
	if !strings.Contains(out, "--ca-dir "+dir) || !strings.Contains(out, "no such file or directory") {
		t.Errorf("message does not name the flag and the cause:\n%s", out)
	}
}

func TestEmptyAdminTokenFailsClearly(t *testing.T) {
	caDir := writeCA(t)
	token := filepath.Join(t.TempDir(), "token")
	if err := os.WriteFile(token, []byte("\n"), 0o600); err != nil {
		t.Fatal(err)
	}
	out, code := runBinary(t, nil, "--ca-dir", caDir, "--admin-token-file", token)
	if code == 0 || !strings.Contains(out, "--admin-token-file "+token+" is empty") {
		t.Errorf("exit %d:\n%s", code, out)
	}
}

func TestUnexpectedArgumentsAreRefused(t *testing.T) {
	out, code := runBinary(t, nil, "serve")
	if code != 2 || !strings.Contains(out, "unexpected arguments") {
		t.Errorf("exit %d:\n%s", code, out)
	}
}

// The supervisor image defaults to the one built with the control plane,
// and a pull policy Kubernetes does not know, or no image, is refused at
// start rather than at the first sandbox.
func TestParseOptionsSupervisorImage(t *testing.T) {
	none := func(string) string { return "" }
	o, err := parseOptions(nil, none, io.Discard)
	if err != nil || o.supervisorImage != "agentbox/agentbox-supervisor:dev" || o.supervisorPullPolicy != "IfNotPresent" {
		t.Errorf("defaults: %q %q, %v", o.supervisorImage, o.supervisorPullPolicy, err)
	}
	o, err = parseOptions([]string{"--supervisor-image=mirror.example/sup:1", "--supervisor-image-pull-policy=Always"}, none, io.Discard)
	if err != nil || o.supervisorImage != "mirror.example/sup:1" || o.supervisorPullPolicy != "Always" {
		t.Errorf("set: %q %q, %v", o.supervisorImage, o.supervisorPullPolicy, err)
	}
	for _, args := range [][]string{{"--supervisor-image="}, {"--supervisor-image-pull-policy=Sometimes"}} {
		if _, err := parseOptions(args, none, io.Discard); err == nil || !strings.Contains(err.Error(), strings.SplitN(args[0], "=", 2)[0]) {
			t.Errorf("%q: %v, want a refusal naming the flag", args, err)
		}
	}
}

// The chart's image.sandbox.pullPolicy arrives as a variable; the flag
// wins over it, and a policy Kubernetes does not know is refused at start.
func TestParseOptionsSandboxPullPolicy(t *testing.T) {
	env := func(k string) string {
		if k == "AGENTBOX_SANDBOX_IMAGE_PULL_POLICY" {
			return "Never"
		}
		return ""
	}
	if o, err := parseOptions(nil, func(string) string { return "" }, io.Discard); err != nil || o.sandboxPullPolicy != "IfNotPresent" {
		t.Errorf("default: %v, %v", o, err)
	}
	if o, err := parseOptions(nil, env, io.Discard); err != nil || o.sandboxPullPolicy != "Never" {
		t.Errorf("from the variable: %v, %v", o, err)
	}
	if o, err := parseOptions([]string{"--sandbox-image-pull-policy=Always"}, env, io.Discard); err != nil || o.sandboxPullPolicy != "Always" {
		t.Errorf("flag over variable: %v, %v", o, err)
	}
	if _, err := parseOptions([]string{"--sandbox-image-pull-policy=Sometimes"}, env, io.Discard); err == nil || !strings.Contains(err.Error(), "--sandbox-image-pull-policy") {
		t.Errorf("unknown policy: %v", err)
	}
}

// The chart's computeApi.runRetention arrives as a variable; the flag wins
// over it, 0 keeps runs forever, and a negative or malformed one is refused.
func TestParseOptionsRunRetention(t *testing.T) {
	none := func(string) string { return "" }
	env := func(k string) string {
		if k == "AGENTBOX_RUN_RETENTION" {
			return "24h"
		}
		return ""
	}
	if o, err := parseOptions(nil, none, io.Discard); err != nil || o.runRetention != 168*time.Hour {
		t.Errorf("default: %v, %v", o, err)
	}
	if o, err := parseOptions(nil, env, io.Discard); err != nil || o.runRetention != 24*time.Hour {
		t.Errorf("from the variable: %v, %v", o, err)
	}
	if o, err := parseOptions([]string{"--run-retention=0"}, env, io.Discard); err != nil || o.runRetention != 0 {
		t.Errorf("flag over variable, 0: %v, %v", o, err)
	}
	for _, bad := range []string{"-1h", "a week"} {
		if _, err := parseOptions([]string{"--run-retention=" + bad}, none, io.Discard); err == nil || !strings.Contains(err.Error(), "--run-retention") {
			t.Errorf("--run-retention=%s: %v", bad, err)
		}
	}
}

func TestParseOptionsNamespaceFromEnvironment(t *testing.T) {
	env := map[string]string{"POD_NAMESPACE": "platform"}
	o, err := parseOptions(nil, func(k string) string { return env[k] }, io.Discard)
	if err != nil {
		t.Fatal(err)
	}
	if o.namespace != "platform" || o.caDir != "/etc/agentbox/ca" || o.apiListen != ":8443" || o.leaderElect {
		t.Errorf("options %+v", o)
	}
	o, err = parseOptions([]string{"--namespace", "other"}, func(k string) string { return env[k] }, io.Discard)
	if err != nil || o.namespace != "other" {
		t.Errorf("--namespace does not override POD_NAMESPACE: %+v, %v", o, err)
	}
	o, err = parseOptions(nil, func(string) string { return "" }, io.Discard)
	if err != nil || o.namespace != defaultNamespace {
		t.Errorf("default namespace: %+v, %v", o, err)
	}
}

func TestParseOptionsKubeAPIRate(t *testing.T) {
	none := func(string) string { return "" }
	o, err := parseOptions([]string{"--kube-api-qps", "7.5", "--kube-api-burst", "9"}, none, io.Discard)
	if err != nil || o.kubeQPS != 7.5 || o.kubeBurst != 9 {
		t.Errorf("flags not applied: %+v, %v", o, err)
	}
	_, err = parseOptions([]string{"--kube-api-qps", "0"}, none, io.Discard)
	if err == nil || !strings.Contains(err.Error(), "--kube-api-qps") {
		t.Errorf("zero QPS accepted or unclear: %v", err)
	}
}

// The Sandbox controller's workers: the default, the chart's variable, the
// flag over it, and a refusal of what is not a sensible count.
func TestParseOptionsSandboxWorkers(t *testing.T) {
	none := func(string) string { return "" }
	o, err := parseOptions(nil, none, io.Discard)
	if err != nil || o.sandboxWorkers != controller.DefaultSandboxWorkers {
		t.Errorf("default: %d, %v; want %d", o.sandboxWorkers, err, controller.DefaultSandboxWorkers)
	}
	env := func(k string) string {
		if k == "AGENTBOX_SANDBOX_WORKERS" {
			return "4"
		}
		return ""
	}
	if o, err = parseOptions(nil, env, io.Discard); err != nil || o.sandboxWorkers != 4 {
		t.Errorf("from the environment: %d, %v", o.sandboxWorkers, err)
	}
	if o, err = parseOptions([]string{"--sandbox-workers=32"}, env, io.Discard); err != nil || o.sandboxWorkers != 32 {
		t.Errorf("the flag over the environment: %d, %v", o.sandboxWorkers, err)
	}
	for _, v := range []string{"0", "-1", "many", "1000"} {
		if _, err := parseOptions([]string{"--sandbox-workers=" + v}, none, io.Discard); err == nil || !strings.Contains(err.Error(), "--sandbox-workers") {
			t.Errorf("%q: %v, want a refusal naming the flag", v, err)
		}
	}
}

func TestParseOptionsDefaultTemplate(t *testing.T) {
	env := map[string]string{"AGENTBOX_DEFAULT_TEMPLATE": "agents/python"}
	o, err := parseOptions(nil, func(k string) string { return env[k] }, io.Discard)
	if err != nil || o.defaultTemplate.String() != "agents/python" {
		t.Errorf("from the environment: %+v, %v", o, err)
	}
	o, err = parseOptions([]string{"--default-template", "team-b/node"}, func(k string) string { return env[k] }, io.Discard)
	if err != nil || o.defaultTemplate.String() != "team-b/node" {
		t.Errorf("--default-template does not override the environment: %+v, %v", o, err)
	}
	o, err = parseOptions(nil, func(string) string { return "" }, io.Discard)
	if err != nil || o.defaultTemplate.Name != "" {
		t.Errorf("no default template: %+v, %v", o, err)
	}
	for _, bad := range []string{"python", "Agents/python", "agents/", "/python", "a/b/c"} {
		if _, err := parseOptions([]string{"--default-template", bad}, func(string) string { return "" }, io.Discard); err == nil ||
			!strings.Contains(err.Error(), "--default-template") {
			t.Errorf("--default-template %q: %v", bad, err)
		}
	}
}

// writeCA writes a fresh CA in the layout of the mounted agentbox-ca Secret.
func writeCA(t *testing.T) string {
	t.Helper()
	ca, err := pki.NewCA("test CA")
	if err != nil {
		t.Fatal(err)
	}
	keyPEM, err := ca.KeyPEM()
	if err != nil {
		t.Fatal(err)
	}
	dir := t.TempDir()
	if err := os.WriteFile(filepath.Join(dir, "tls.crt"), ca.CertPEM, 0o600); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(filepath.Join(dir, "tls.key"), keyPEM, 0o600); err != nil {
		t.Fatal(err)
	}
	return dir
}
