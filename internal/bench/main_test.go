package bench

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"io"
	"net"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/runtime"
	clientgoscheme "k8s.io/client-go/kubernetes/scheme"
	"sigs.k8s.io/controller-runtime/pkg/client"

	"github.com/agentbox/terraform-provider-agentbox/internal/api/v1alpha1"
	apiclient "github.com/agentbox/terraform-provider-agentbox/internal/computeapi/client"
	"github.com/agentbox/terraform-provider-agentbox/internal/testenv"
)

// EnvBench turns the benchmarks on; `make bench` sets it.
const EnvBench = "AGENTBOX_BENCH"

// EnvImageTag is the tag of the platform images imported into the test
// cluster (`make bench` builds and imports "dev").
const EnvImageTag = "AGENTBOX_TEST_IMAGE_TAG"

// platformNamespace is where the benchmarks install the platform.
const platformNamespace = "agentbox-system"

var (
	platformOnce sync.Once
	shared       *platformEnv
	sharedErr    error
)

// platformEnv is the platform the package's benchmarks share: installed
// once, on first use, by `terraform apply`, and destroyed by TestMain.
type platformEnv struct {
	tf         tfCLI
	kubeconfig string
	imageTag   string
	dir        string // the platform's Terraform working directory
	kube       client.Client

	Endpoint   string
	CA         []byte
	AdminToken string
}

func TestMain(m *testing.M) {
	code := m.Run()
	if shared != nil {
		if err := shared.tf.exec(shared.dir, shared.destroyArgs()...); err != nil {
			fmt.Fprintf(os.Stderr, "bench: destroying the platform: %v\n", err)
			code = max(code, 1)
		}
		_ = os.RemoveAll(filepath.Dir(shared.tf.cliConfig))
		_ = os.RemoveAll(shared.dir)
	}
	os.Exit(code)
}

// platform returns the shared platform, installing it on first use. It
// skips unless AGENTBOX_BENCH is set and a test cluster is there.
func platform(t *testing.T) *platformEnv {
	t.Helper()
	if os.Getenv(EnvBench) == "" {
		t.Skipf("%s is not set: the end-to-end benchmarks run with `make bench`", EnvBench)
	}
	cfg, kubeconfig := testenv.Shared(t)
	platformOnce.Do(func() {
		scheme := runtime.NewScheme()
		if err := clientgoscheme.AddToScheme(scheme); err != nil {
			sharedErr = err
			return
		}
		if err := v1alpha1.AddToScheme(scheme); err != nil {
			sharedErr = err
			return
		}
		kube, err := client.New(cfg, client.Options{Scheme: scheme})
		if err != nil {
			sharedErr = err
			return
		}
		shared, sharedErr = installPlatform(kubeconfig, kube)
	})
	if sharedErr != nil {
		t.Fatalf("installing the platform: %v", sharedErr)
	}
	return shared
}

// configHeader starts every configuration of the package: the provider,
// and the variables applyArgs sets.
const configHeader = `
terraform {
  required_providers {
    agentbox = { source = "agentbox/agentbox" }
  }
}

variable "kubeconfig" { type = string }
variable "image_tag" { type = string }

provider "agentbox" {
  kubernetes = { config_path = var.kubeconfig }
  namespace  = "` + platformNamespace + `"
}
`

// benchNamespaces are the namespaces the benchmarks make their sandboxes,
// pools and templates in: the platform serves them (sandbox_namespaces),
// so they are made before it is installed, and each benchmark deletes its
// own when it is done.
var benchNamespaces = []string{benchNamespace, imagesNamespace, scaleNamespaceName, scaleTFNamespace, leaseNamespace}

var platformConfig = configHeader + `
# --pprof lets the benchmarks profile the control plane while they run.
resource "agentbox_platform" "this" {
  image_tag          = var.image_tag
  values             = yamlencode({ extraArgs = ["--pprof"] })
  sandbox_namespaces = ["` + strings.Join(benchNamespaces, `", "`) + `"]
}

output "api_endpoint" { value = agentbox_platform.this.api_endpoint }
output "ca_certificate" { value = agentbox_platform.this.ca_certificate }
output "admin_token" {
  value     = agentbox_platform.this.admin_token
  sensitive = true
}
`

func installPlatform(kubeconfig string, kube client.Client) (*platformEnv, error) {
	tf, err := newTerraformCLI()
	if err != nil {
		return nil, err
	}
	tag := os.Getenv(EnvImageTag)
	if tag == "" {
		tag = "dev"
	}
	dir, err := os.MkdirTemp("", "agentbox-bench-platform-")
	if err != nil {
		return nil, err
	}
	p := &platformEnv{tf: tf, kubeconfig: kubeconfig, imageTag: tag, dir: dir, kube: kube}
	for _, name := range benchNamespaces {
		ns := &corev1.Namespace{ObjectMeta: metav1.ObjectMeta{Name: name}}
		if err := kube.Create(context.Background(), ns); err != nil && !apierrors.IsAlreadyExists(err) {
			return nil, fmt.Errorf("create namespace %s: %w", name, err)
		}
	}
	if err := os.WriteFile(filepath.Join(dir, "main.tf"), []byte(platformConfig), 0o600); err != nil {
		return nil, err
	}
	// shared is set before apply so that TestMain destroys whatever a
	// failed apply left behind.
	shared = p
	if err := tf.exec(dir, p.applyArgs()...); err != nil {
		return p, err
	}
	out, err := tf.outputs(dir)
	if err != nil {
		return p, err
	}
	p.Endpoint, p.AdminToken = out["api_endpoint"], out["admin_token"]
	p.CA = []byte(out["ca_certificate"])
	return p, nil
}

// applyArgs are the arguments of an apply in any of the package's
// configurations, which all take the kubeconfig and image tag.
func (p *platformEnv) applyArgs(extra ...string) []string {
	args := []string{"apply", "-auto-approve", "-input=false", "-no-color",
		"-var", "kubeconfig=" + p.kubeconfig, "-var", "image_tag=" + p.imageTag}
	return append(args, extra...)
}

// destroyArgs are applyArgs' counterpart for terraform destroy.
func (p *platformEnv) destroyArgs() []string {
	return append([]string{"destroy"}, p.applyArgs()[1:]...)
}

// admin returns a Compute API client with the platform's admin token.
func (p *platformEnv) admin(t *testing.T) *apiclient.Client {
	t.Helper()
	c, err := apiclient.New(p.Endpoint, p.AdminToken, p.CA)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(c.CloseIdleConnections)
	return c
}

// workspace writes config into a new Terraform directory whose resources
// are destroyed when the test ends; the platform itself stays.
func (p *platformEnv) workspace(t *testing.T, config string) string {
	t.Helper()
	dir := t.TempDir()
	if err := os.WriteFile(filepath.Join(dir, "main.tf"), []byte(config), 0o600); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		if err := p.tf.exec(dir, p.destroyArgs()...); err != nil {
			t.Errorf("destroying %s: %v", dir, err)
		}
	})
	return dir
}

// tfCLI runs the terraform on PATH with the agentbox provider replaced by
// one built from this tree (dev_overrides), and nothing else installable.
type tfCLI struct {
	path      string
	env       []string
	cliConfig string
}

func newTerraformCLI() (tfCLI, error) {
	path, err := exec.LookPath("terraform")
	if err != nil {
		return tfCLI{}, fmt.Errorf("terraform is not on PATH: %w", err)
	}
	tmp, err := os.MkdirTemp("", "agentbox-bench-tf-")
	if err != nil {
		return tfCLI{}, err
	}
	build := exec.Command("go", "build", "-o", filepath.Join(tmp, "terraform-provider-agentbox"), ".")
	build.Dir = filepath.Join("..", "..")
	if out, err := build.CombinedOutput(); err != nil {
		return tfCLI{}, fmt.Errorf("go build the provider: %w\n%s", err, out)
	}
	cliConfig := filepath.Join(tmp, "terraformrc")
	config := fmt.Sprintf("disable_checkpoint = true\n\nprovider_installation {\n  dev_overrides {\n    %q = %q\n  }\n}\n",
		"registry.terraform.io/agentbox/agentbox", tmp)
	if err := os.WriteFile(cliConfig, []byte(config), 0o600); err != nil {
		return tfCLI{}, err
	}
	// The developer's Terraform and Kubernetes settings must not leak in.
	env := slices.DeleteFunc(os.Environ(), func(kv string) bool {
		for _, prefix := range []string{"TF_CLI_ARGS", "TF_CLI_CONFIG_FILE=", "TF_DATA_DIR=", "TF_WORKSPACE=", "TF_LOG", "KUBE_", "KUBECONFIG=", "AGENTBOX_NAMESPACE="} {
			if strings.HasPrefix(kv, prefix) {
				return true
			}
		}
		return false
	})
	env = append(env, "TF_CLI_CONFIG_FILE="+cliConfig, "CHECKPOINT_DISABLE=1", "TF_IN_AUTOMATION=1")
	return tfCLI{path: path, env: env, cliConfig: cliConfig}, nil
}

// exec runs terraform in dir; the error carries its output.
func (tf tfCLI) exec(dir string, args ...string) error {
	_, err := tf.output(dir, args...)
	return err
}

func (tf tfCLI) output(dir string, args ...string) ([]byte, error) {
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Minute)
	defer cancel()
	cmd := exec.CommandContext(ctx, tf.path, args...)
	cmd.Dir = dir
	cmd.Env = tf.env
	var stdout, stderr bytes.Buffer
	cmd.Stdout, cmd.Stderr = &stdout, &stderr
	if err := cmd.Run(); err != nil {
		return stdout.Bytes(), fmt.Errorf("terraform %s in %s: %w\n%s%s", args[0], dir, err, stdout.Bytes(), stderr.Bytes())
	}
	return stdout.Bytes(), nil
}

// outputs returns the string outputs of dir's state, sensitive ones too.
func (tf tfCLI) outputs(dir string) (map[string]string, error) {
	raw, err := tf.output(dir, "output", "-json")
	if err != nil {
		return nil, err
	}
	var outs map[string]struct {
		Value any `json:"value"`
	}
	if err := json.Unmarshal(raw, &outs); err != nil {
		return nil, fmt.Errorf("terraform output -json: %w", err)
	}
	m := make(map[string]string, len(outs))
	for k, v := range outs {
		if s, ok := v.Value.(string); ok {
			m[k] = s
		}
	}
	return m, nil
}

// controlPlaneMetricsURL is the base URL of the control plane's metrics
// port (its /metrics and /debug/pprof): plain HTTP inside the cluster, on
// the pod IP, which is on the test node's bridge.
func (p *platformEnv) controlPlaneMetricsURL(t *testing.T) (string, error) {
	t.Helper()
	var pods corev1.PodList
	err := p.kube.List(t.Context(), &pods, client.InNamespace(platformNamespace),
		client.MatchingLabels{"app.kubernetes.io/component": "controlplane"})
	if err != nil || len(pods.Items) == 0 || pods.Items[0].Status.PodIP == "" {
		return "", fmt.Errorf("no control plane pod (%v)", err)
	}
	return "http://" + net.JoinHostPort(pods.Items[0].Status.PodIP, "8080"), nil
}

// EnvProfileDir is where profiles of the control plane go; `make bench`
// points it at .build/bench. Unset, profiles go to the test's temp dir.
const EnvProfileDir = "AGENTBOX_BENCH_PROFILE_DIR"

// profile records a CPU profile of the control plane for as long as the
// returned function is not called (at most max), writes it to the profile
// directory as name.pprof and logs its top functions: the figures of a
// missed target come with where the time went.
func (p *platformEnv) profile(t *testing.T, name string, max time.Duration) (stop func()) {
	t.Helper()
	base, err := p.controlPlaneMetricsURL(t)
	if err != nil {
		t.Logf("profile %s: %v", name, err)
		return func() {}
	}
	url := fmt.Sprintf("%s/debug/pprof/profile?seconds=%d", base, int(max.Seconds()))
	dir := os.Getenv(EnvProfileDir)
	if dir == "" {
		dir = t.TempDir()
	}
	if err := os.MkdirAll(dir, 0o755); err != nil {
		t.Fatal(err)
	}
	path := filepath.Join(dir, name+".pprof")
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() {
		req, err := http.NewRequestWithContext(ctx, http.MethodGet, url, nil)
		if err != nil {
			done <- err
			return
		}
		resp, err := http.DefaultClient.Do(req)
		if err != nil {
			done <- err
			return
		}
		defer resp.Body.Close()
		if resp.StatusCode != http.StatusOK {
			done <- fmt.Errorf("%s: %s", url, resp.Status)
			return
		}
		data, err := io.ReadAll(resp.Body)
		if err == nil {
			err = os.WriteFile(path, data, 0o644)
		}
		done <- err
	}()
	return func() {
		t.Helper()
		// The profile endpoint only returns at the end of its window, so
		// a shorter run ends it early by dropping the request: that loses
		// the profile. Windows are sized to the work instead; wait.
		err := <-done
		cancel()
		if err != nil {
			t.Logf("profile %s: %v", name, err)
			return
		}
		out, err := exec.Command("go", "tool", "pprof", "-top", "-nodecount=30", path).CombinedOutput()
		if err != nil {
			t.Logf("profile %s: go tool pprof: %v\n%s", name, err, out)
			return
		}
		t.Logf("control plane CPU profile %s (%s):\n%s", name, path, out)
	}
}

// heapProfile writes the control plane's heap profile to the profile
// directory as name.pprof and logs where its in-use memory is: the figures
// of a memory target come with what holds the memory.
func (p *platformEnv) heapProfile(t *testing.T, name string) {
	t.Helper()
	base, err := p.controlPlaneMetricsURL(t)
	if err != nil {
		t.Logf("heap profile %s: %v", name, err)
		return
	}
	dir := os.Getenv(EnvProfileDir)
	if dir == "" {
		dir = t.TempDir()
	}
	if err := os.MkdirAll(dir, 0o755); err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithTimeout(t.Context(), time.Minute)
	defer cancel()
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, base+"/debug/pprof/heap", nil)
	if err != nil {
		t.Fatal(err)
	}
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		t.Logf("heap profile %s: %v", name, err)
		return
	}
	defer resp.Body.Close()
	data, err := io.ReadAll(resp.Body)
	if err != nil || resp.StatusCode != http.StatusOK {
		t.Logf("heap profile %s: %s, %v", name, resp.Status, err)
		return
	}
	path := filepath.Join(dir, name+".pprof")
	if err := os.WriteFile(path, data, 0o644); err != nil {
		t.Fatal(err)
	}
	out, err := exec.Command("go", "tool", "pprof", "-top", "-sample_index=inuse_space", "-nodecount=25", path).CombinedOutput()
	if err != nil {
		t.Logf("heap profile %s: go tool pprof: %v\n%s", name, err, out)
		return
	}
	t.Logf("control plane heap profile %s (%s):\n%s", name, path, out)
}
