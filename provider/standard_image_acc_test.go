package provider

import (
	"context"
	"fmt"
	"slices"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/hashicorp/terraform-plugin-testing/helper/resource"
	"github.com/hashicorp/terraform-plugin-testing/knownvalue"
	"github.com/hashicorp/terraform-plugin-testing/statecheck"
	"github.com/hashicorp/terraform-plugin-testing/terraform"
	"github.com/hashicorp/terraform-plugin-testing/tfjsonpath"
	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/util/wait"
	"k8s.io/utils/ptr"
	"sigs.k8s.io/controller-runtime/pkg/client"

	apiclient "github.com/agentbox/terraform-provider-agentbox/internal/computeapi/client"
	"github.com/agentbox/terraform-provider-agentbox/internal/supervisor/pyenv/pyenvtest"
	"github.com/agentbox/terraform-provider-agentbox/internal/testenv/toolchain"
)

// standardTool is one thing an agent reaches for first, as a bash script
// run in the workspace, and what it must print.
type standardTool struct {
	name, script, want string
}

// TestAccStandardImageTools: in a sandbox of the platform's default image,
// on the default install, the tools an agent's first commands use all
// work: bash, grep -r, find, sed -i, awk, git init and commit, curl to a
// web server through the sandbox's egress proxy, and pip install from a
// package index, both served by a pod this test made (the only
// destination the proxy allows).
func TestAccStandardImageTools(t *testing.T) {
	t.Parallel()
	tag := testAccPlatformImageTag(t)
	c, ns := testAccCluster(t)
	ctx, cancel := context.WithTimeout(context.Background(), 15*time.Minute)
	defer cancel()

	pkg := pyenvtest.Package{Name: "agentbox-greet", Version: "1.0",
		Files: map[string][]byte{"agentbox_greet/__init__.py": []byte("def hi():\n    return 'hi from the test index'\n")}}
	files, err := pyenvtest.StaticTree(pkg)
	if err != nil {
		t.Fatal(err)
	}
	files["index.html"] = []byte("hello-through-the-proxy\n")
	web := startFileServerPod(ctx, t, c, ns, "web", files)
	base := "http://" + web + ":8080/"

	const agent = "standard-agent"
	cfg := testAccProviderConfig() + fmt.Sprintf(`
resource "agentbox_platform" "this" {
  namespace    = %[1]q
  release_name = "acc-standard"
  image_tag    = %[2]q
}

resource "agentbox_egress_proxy" "web" {
  name            = "web"
  namespace       = agentbox_platform.this.namespace
  mode            = "PerAgent"
  allowed_domains = [%[3]q]
  allowed_cidrs   = ["%[3]s/32"]
}

# No image: the platform's default, the standard sandbox image.
resource "agentbox_sandbox_template" "standard" {
  name         = "standard"
  namespace    = agentbox_platform.this.namespace
  egress_proxy = agentbox_egress_proxy.web.name
}

resource "agentbox_sandbox" "agent" {
  name      = %[4]q
  namespace = agentbox_platform.this.namespace
  agent_id  = %[4]q
  template  = agentbox_sandbox_template.standard.name
}
`, ns, tag, web, agent)

	tools := []standardTool{
		{"bash", `echo "bash ${BASH_VERSINFO[0]}" | cut -c1-4`, "bash\n"},
		{"grep -r", `mkdir -p src/a src/b && echo 'needle one' > src/a/x.txt && echo hay > src/b/y.txt && grep -rl needle src`, "src/a/x.txt\n"},
		{"find", `find src -name '*.txt' | sort`, "src/a/x.txt\nsrc/b/y.txt\n"},
		{"sed -i", `sed -i 's/needle/thread/' src/a/x.txt && cat src/a/x.txt`, "thread one\n"},
		{"awk", `printf '1 a\n2 b\n39 c\n' | awk '{s += $1} END {print s}'`, "42\n"},
		{"git", `git init -q repo && cd repo && git config user.email agent@example.invalid && git config user.name agent &&
echo first > f && git add f && git commit -qm first && git log --format=%s`, "first\n"},
		{"curl through the egress proxy", `curl -fsS ` + base + `index.html`, "hello-through-the-proxy\n"},
		{"pip install from the index", `pip install -q --disable-pip-version-check --no-cache-dir --index-url ` + base + `simple/ --trusted-host ` + web + ` agentbox-greet >/dev/null &&
python3 -c 'import agentbox_greet; print(agentbox_greet.hi())'`, "hi from the test index\n"},
		{"the rest of the standard tools", `for t in diff patch less ps jq zip unzip xz ssh gcc make python3; do command -v $t >/dev/null || echo "missing $t"; done; echo checked`, "checked\n"},
	}
	resource.Test(t, resource.TestCase{
		ProtoV6ProviderFactories: testAccProtoV6ProviderFactories,
		Steps: []resource.TestStep{{
			Config: cfg,
			ConfigStateChecks: []statecheck.StateCheck{
				statecheck.ExpectKnownValue("agentbox_sandbox_template.standard", tfjsonpath.New("image"), knownvalue.Null()),
				statecheck.ExpectKnownValue("agentbox_sandbox.agent", tfjsonpath.New("agent_id"), knownvalue.StringExact(agent)),
			},
			Check: func(s *terraform.State) error {
				api, err := platformAPI(s, "agentbox_platform.this")
				if err != nil {
					return err
				}
				defer api.CloseIdleConnections()
				var failed []string
				for _, tool := range tools {
					res, err := api.RunCommand(ctx, agent, apiclient.RunCommandRequest{Command: []string{"bash", "-c", tool.script}, TimeoutSeconds: 300})
					switch {
					case err != nil:
						failed = append(failed, fmt.Sprintf("%s: %v", tool.name, err))
					case res.ExitCode != 0 || res.Stdout != tool.want:
						failed = append(failed, fmt.Sprintf("%s: exit %d, stdout %q, stderr %q; want stdout %q", tool.name, res.ExitCode, res.Stdout, strings.TrimSpace(res.Stderr), tool.want))
					default:
						t.Logf("%s: ok in %d ms", tool.name, res.DurationMS)
					}
				}
				if len(failed) > 0 {
					return fmt.Errorf("in the standard image:\n%s", strings.Join(failed, "\n"))
				}
				return nil
			},
		}},
	})
}

// startFileServerPod runs busybox's web server on port 8080 serving files
// (path -> content, from a ConfigMap; a folder's index.html answers for the
// folder) and returns its pod IP.
func startFileServerPod(ctx context.Context, t *testing.T, c client.Client, ns, name string, files map[string][]byte) string {
	t.Helper()
	cm := &corev1.ConfigMap{ObjectMeta: metav1.ObjectMeta{Name: name + "-files", Namespace: ns}, BinaryData: map[string][]byte{}}
	var items []corev1.KeyToPath
	paths := make([]string, 0, len(files))
	for p := range files {
		paths = append(paths, p)
	}
	slices.Sort(paths)
	for i, p := range paths {
		// ConfigMap keys cannot hold a slash; the volume's items put each
		// key at its path.
		key := "f" + strconv.Itoa(i)
		cm.BinaryData[key] = files[p]
		items = append(items, corev1.KeyToPath{Key: key, Path: p})
	}
	if err := c.Create(ctx, cm); err != nil {
		t.Fatal(err)
	}
	pod := &corev1.Pod{
		ObjectMeta: metav1.ObjectMeta{Name: name, Namespace: ns, Labels: map[string]string{"app": name}},
		Spec: corev1.PodSpec{
			TerminationGracePeriodSeconds: ptr.To[int64](0),
			Containers: []corev1.Container{{
				Name: "httpd", Image: toolchain.BusyboxImage, ImagePullPolicy: corev1.PullNever,
				Command:      []string{"/bin/httpd", "-f", "-vv", "-p", "8080", "-h", "/www"},
				VolumeMounts: []corev1.VolumeMount{{Name: "files", MountPath: "/www", ReadOnly: true}},
			}},
			Volumes: []corev1.Volume{{Name: "files", VolumeSource: corev1.VolumeSource{ConfigMap: &corev1.ConfigMapVolumeSource{
				LocalObjectReference: corev1.LocalObjectReference{Name: cm.Name}, Items: items,
			}}}},
		},
	}
	if err := c.Create(ctx, pod); err != nil {
		t.Fatal(err)
	}
	err := wait.PollUntilContextTimeout(ctx, 500*time.Millisecond, 2*time.Minute, true, func(ctx context.Context) (bool, error) {
		if err := c.Get(ctx, client.ObjectKeyFromObject(pod), pod); err != nil {
			return false, nil
		}
		return pod.Status.Phase == corev1.PodRunning && pod.Status.PodIP != "", nil
	})
	if err != nil {
		t.Fatalf("file server pod %s: %v (phase %s)", name, err, pod.Status.Phase)
	}
	return pod.Status.PodIP
}
