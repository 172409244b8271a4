package provider

import (
	"bytes"
	"encoding/json"
	"fmt"
	"io"
	"io/fs"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strings"
	"testing"
)

// examplesDir holds the configurations that the docs show and users copy.
const examplesDir = "../examples"

// The provider addresses the examples use: "agentbox/agentbox" where they
// declare required_providers, and the implied "hashicorp/agentbox" in
// resource fragments, which tfplugindocs shows without a terraform block.
var exampleProviderAddresses = []string{
	"registry.terraform.io/agentbox/agentbox",
	"registry.terraform.io/hashicorp/agentbox",
}

// TestExamplesValidate runs `terraform validate` on every example with the
// provider built from this tree, so that an example that no longer matches
// the schema, or a fragment that references something it does not declare,
// fails here instead of in a user's hands, and `terraform test` where an
// example has tests. No registry is contacted: the provider comes from
// dev_overrides and modules from local paths.
func TestExamplesValidate(t *testing.T) {
	t.Parallel()
	tf := terraformCLI(t)
	work := copyExamples(t)
	dirs := terraformDirs(t, work)
	if len(dirs) == 0 {
		t.Fatalf("no directory under %s has .tf files", examplesDir)
	}
	for _, dir := range dirs {
		rel, _ := filepath.Rel(work, dir)
		t.Run(filepath.ToSlash(rel), func(t *testing.T) {
			// Installs modules from local paths only; unlike init it does
			// not look up providers in a registry.
			tf.run(t, dir, "get", "-no-color")
			// Exits 1 on an invalid configuration; the JSON says why.
			out, runErr := tf.output(dir, "validate", "-json", "-no-color")
			var res struct {
				Valid       bool `json:"valid"`
				Diagnostics []struct {
					Severity string `json:"severity"`
					Summary  string `json:"summary"`
					Detail   string `json:"detail"`
					Range    *struct {
						Filename string `json:"filename"`
						Start    struct {
							Line int `json:"line"`
						} `json:"start"`
					} `json:"range"`
				} `json:"diagnostics"`
			}
			if err := json.Unmarshal(out, &res); err != nil {
				t.Fatalf("terraform validate -json: %v (%v)", err, runErr)
			}
			for _, d := range res.Diagnostics {
				if d.Summary == "Provider development overrides are in effect" {
					continue
				}
				where := ""
				if d.Range != nil {
					where = fmt.Sprintf("%s:%d: ", d.Range.Filename, d.Range.Start.Line)
				}
				// Warnings count too: an example should show clean usage.
				t.Errorf("%s%s: %s: %s", where, d.Severity, d.Summary, d.Detail)
			}
			if !res.Valid {
				t.Fatal("terraform validate: invalid")
			}
			// A module's own tests plan it against a mock of the provider.
			if tests, _ := filepath.Glob(filepath.Join(dir, "tests", "*.tftest.hcl")); len(tests) > 0 {
				t.Logf("terraform test: %s", tf.run(t, dir, "test", "-no-color"))
			}
		})
	}
	t.Run("fmt", func(t *testing.T) {
		// Lists the files it would change, and exits 3 if there are any.
		if _, err := tf.output(work, "fmt", "-check", "-recursive", "-no-color"); err != nil {
			t.Errorf("examples not formatted with `terraform fmt`: %v", err)
		}
	})
}

// tfCLI runs the terraform CLI with a CLI configuration that overrides
// the agentbox provider with a binary built from this tree.
type tfCLI struct {
	path string
	env  []string
}

// terraformCLI skips the test when terraform is not installed (CI has it),
// and builds the provider for it.
func terraformCLI(t *testing.T) tfCLI {
	t.Helper()
	path, err := exec.LookPath("terraform")
	if err != nil {
		t.Skip("terraform is not on PATH: install Terraform 1.11 or newer to check the examples")
	}
	goTool, err := exec.LookPath("go")
	if err != nil {
		t.Skip("go is not on PATH: it is needed to build the provider for terraform")
	}
	bin := t.TempDir()
	build := exec.Command(goTool, "build", "-o", filepath.Join(bin, "terraform-provider-agentbox"), ".")
	build.Dir = ".."
	if out, err := build.CombinedOutput(); err != nil {
		t.Fatalf("go build: %v\n%s", err, out)
	}

	var overrides strings.Builder
	for _, addr := range exampleProviderAddresses {
		fmt.Fprintf(&overrides, "    %q = %q\n", addr, bin)
	}
	// dev_overrides and no installation method: nothing can be downloaded.
	cliConfig := filepath.Join(t.TempDir(), "terraformrc")
	config := "disable_checkpoint = true\n\nprovider_installation {\n  dev_overrides {\n" + overrides.String() + "  }\n}\n"
	if err := os.WriteFile(cliConfig, []byte(config), 0o600); err != nil {
		t.Fatal(err)
	}

	// The developer's Terraform and Kubernetes settings must not leak into
	// the run: TF_CLI_ARGS could add flags, KUBE_* would be read by the
	// provider's validation.
	env := slices.DeleteFunc(os.Environ(), func(kv string) bool {
		for _, prefix := range []string{"TF_CLI_ARGS", "TF_CLI_CONFIG_FILE=", "TF_DATA_DIR=", "TF_WORKSPACE=", "KUBE_", "KUBECONFIG=", "AGENTBOX_NAMESPACE="} {
			if strings.HasPrefix(kv, prefix) {
				return true
			}
		}
		return false
	})
	env = append(env, "TF_CLI_CONFIG_FILE="+cliConfig, "CHECKPOINT_DISABLE=1", "TF_IN_AUTOMATION=1")
	return tfCLI{path: path, env: env}
}

// run runs terraform in dir and returns its stdout, failing the test if it
// fails.
func (tf tfCLI) run(t *testing.T, dir string, args ...string) []byte {
	t.Helper()
	out, err := tf.output(dir, args...)
	if err != nil {
		t.Fatal(err)
	}
	return out
}

func (tf tfCLI) output(dir string, args ...string) ([]byte, error) {
	cmd := exec.Command(tf.path, args...)
	cmd.Dir = dir
	cmd.Env = tf.env
	var stdout, stderr bytes.Buffer
	cmd.Stdout, cmd.Stderr = &stdout, &stderr
	if err := cmd.Run(); err != nil {
		return stdout.Bytes(), fmt.Errorf("terraform %s in %s: %w\n%s%s", strings.Join(args, " "), dir, err, stdout.Bytes(), stderr.Bytes())
	}
	return stdout.Bytes(), nil
}

// copyExamples copies the examples into a temporary directory, so that the
// .terraform directories that `terraform get` writes stay out of the tree,
// and leaves out what earlier local runs left there (state, .terraform).
func copyExamples(t *testing.T) string {
	t.Helper()
	dst := filepath.Join(t.TempDir(), "examples")
	err := filepath.WalkDir(examplesDir, func(path string, d fs.DirEntry, err error) error {
		if err != nil {
			return err
		}
		rel, err := filepath.Rel(examplesDir, path)
		if err != nil {
			return err
		}
		target := filepath.Join(dst, rel)
		name := d.Name()
		switch {
		case d.IsDir() && name == ".terraform":
			return filepath.SkipDir
		case d.IsDir():
			return os.MkdirAll(target, 0o755)
		case !d.Type().IsRegular(), strings.HasPrefix(name, "terraform.tfstate"), name == ".terraform.lock.hcl":
			return nil
		}
		return copyFile(path, target)
	})
	if err != nil {
		t.Fatal(err)
	}
	return dst
}

func copyFile(src, dst string) error {
	in, err := os.Open(src)
	if err != nil {
		return err
	}
	defer in.Close()
	info, err := in.Stat()
	if err != nil {
		return err
	}
	out, err := os.OpenFile(dst, os.O_CREATE|os.O_EXCL|os.O_WRONLY, info.Mode().Perm())
	if err != nil {
		return err
	}
	if _, err := io.Copy(out, in); err != nil {
		out.Close()
		return fmt.Errorf("copy %s: %w", src, err)
	}
	return out.Close()
}

// terraformDirs lists the directories under root that hold .tf files: each
// is a configuration terraform can validate on its own.
func terraformDirs(t *testing.T, root string) []string {
	t.Helper()
	var dirs []string
	err := filepath.WalkDir(root, func(path string, d fs.DirEntry, err error) error {
		if err != nil {
			return err
		}
		if d.IsDir() && d.Name() == ".terraform" {
			return filepath.SkipDir
		}
		if !d.IsDir() && filepath.Ext(path) == ".tf" {
			if dir := filepath.Dir(path); !slices.Contains(dirs, dir) {
				dirs = append(dirs, dir)
			}
		}
		return nil
	})
	if err != nil {
		t.Fatal(err)
	}
	return dirs
}
