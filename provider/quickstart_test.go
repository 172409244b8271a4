package provider

import (
	"context"
	"fmt"
	"os"
	"path/filepath"
	"regexp"
	"strings"
	"testing"
	"time"

	"github.com/hashicorp/terraform-plugin-testing/config"
	"github.com/hashicorp/terraform-plugin-testing/helper/resource"
	"github.com/hashicorp/terraform-plugin-testing/knownvalue"
	"github.com/hashicorp/terraform-plugin-testing/plancheck"
	"github.com/hashicorp/terraform-plugin-testing/statecheck"
	"github.com/hashicorp/terraform-plugin-testing/terraform"
	"github.com/hashicorp/terraform-plugin-testing/tfjsonpath"
	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	"k8s.io/apimachinery/pkg/api/meta"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/runtime/schema"
	"k8s.io/apimachinery/pkg/types"
	ctrlclient "sigs.k8s.io/controller-runtime/pkg/client"

	agentboxv1alpha1 "github.com/agentbox/terraform-provider-agentbox/internal/api/v1alpha1"
	"github.com/agentbox/terraform-provider-agentbox/internal/chart"
	"github.com/agentbox/terraform-provider-agentbox/internal/computeapi"
	"github.com/agentbox/terraform-provider-agentbox/internal/computeapi/client"
)

// testAccImageTagEnv names the tag of the platform images that `make test`
// built and imported into the test node.
const testAccImageTagEnv = "AGENTBOX_TEST_IMAGE_TAG"

// TestAccQuickstart is the main job end to end: examples/quickstart applied
// with the real terraform CLI gives an agent a gVisor sandbox, and the
// Compute API runs the agent's code in it. Then, as the README shows, the
// sandbox's idle timeout is shortened: it idles out, is stopped into the
// platform's default snapshot store (the embedded archive store, which
// needs no VolumeSnapshot CRDs or anything else outside the cluster), and
// the next call through the Compute API resumes it with its workspace.
func TestAccQuickstart(t *testing.T) {
	tag := testAccPlatformImageTag(t)
	c, _ := testAccCluster(t)
	const agent = "quickstart-agent"
	vars := config.Variables{
		"kubeconfig": config.StringVariable(os.Getenv(testAccKubeconfigEnv)),
		"image_tag":  config.StringVariable(tag),
		"agent_id":   config.StringVariable(agent),
	}
	// Short, so that the test sees a stop; the README suggests 1m.
	idleVars := config.Variables{"idle_timeout": config.StringVariable("30s")}
	for k, v := range vars {
		idleVars[k] = v
	}
	dir := config.StaticDirectory("../examples/quickstart")
	// Import steps leave the outputs null, which the framework's state shim
	// cannot read, so they use the resources without outputs.tf.
	resources := config.StaticFile("../examples/quickstart/main.tf")
	sandboxKey := types.NamespacedName{Namespace: DefaultNamespace, Name: "quickstart-agent"}
	// The example has its own required_providers block, which the testing
	// framework counts as providers given per step, and whose source is
	// agentbox/agentbox rather than the framework's default namespace.
	t.Setenv("TF_ACC_PROVIDER_NAMESPACE", "agentbox")
	f := testAccProtoV6ProviderFactories
	resource.Test(t, resource.TestCase{
		Steps: []resource.TestStep{
			{
				ProtoV6ProviderFactories: f,
				ConfigDirectory:          dir,
				ConfigVariables:          vars,
				ConfigStateChecks: []statecheck.StateCheck{
					statecheck.ExpectKnownValue("agentbox_platform.this", tfjsonpath.New("revision"), knownvalue.Int64Exact(1)),
					statecheck.ExpectKnownValue("agentbox_platform.this", tfjsonpath.New("status"), knownvalue.StringExact("deployed")),
					statecheck.ExpectKnownValue("agentbox_sandbox_template.python", tfjsonpath.New("runtime_class_name"), knownvalue.StringExact("gvisor")),
					statecheck.ExpectKnownValue("agentbox_sandbox.agent", tfjsonpath.New("agent_id"), knownvalue.StringExact(agent)),
					statecheck.ExpectKnownValue("agentbox_sandbox.agent", tfjsonpath.New("id"), knownvalue.StringExact(DefaultNamespace+"/quickstart-agent")),
					statecheck.ExpectKnownValue("agentbox_platform.this", tfjsonpath.New("snapshot_driver"), knownvalue.StringExact("archive/embedded")),
				},
				Check: resource.ComposeTestCheckFunc(checkRunsInGVisor(t, agent), writeWorkspaceNote(t, agent), checkRestrictedNamespace(c, sandboxKey)),
			},
			{
				ProtoV6ProviderFactories: f,
				ConfigDirectory:          dir,
				ConfigVariables:          vars,
				ConfigPlanChecks:         resource.ConfigPlanChecks{PreApply: []plancheck.PlanCheck{plancheck.ExpectEmptyPlan()}},
			},
			{
				// The README's walk-through: a shorter idle timeout, a wait,
				// and a call that resumes the sandbox with its workspace.
				ProtoV6ProviderFactories: f,
				ConfigDirectory:          dir,
				ConfigVariables:          idleVars,
				ConfigPlanChecks: resource.ConfigPlanChecks{
					PreApply: []plancheck.PlanCheck{plancheck.ExpectResourceAction("agentbox_sandbox.agent", plancheck.ResourceActionUpdate)},
				},
				ConfigStateChecks: []statecheck.StateCheck{
					statecheck.ExpectKnownValue("agentbox_sandbox.agent", tfjsonpath.New("idle_timeout"), knownvalue.StringExact("30s")),
				},
				Check: checkIdleStopAndResume(t, c, sandboxKey, agent),
			},
			{
				ProtoV6ProviderFactories: f,
				ConfigDirectory:          dir,
				ConfigVariables:          idleVars,
				ConfigPlanChecks:         resource.ConfigPlanChecks{PreApply: []plancheck.PlanCheck{plancheck.ExpectEmptyPlan()}},
			},
			{
				ProtoV6ProviderFactories: f,
				ConfigFile:               resources,
				ConfigVariables:          vars,
				ResourceName:             "agentbox_sandbox.agent",
				ImportState:              true,
				ImportStateId:            DefaultNamespace + "/quickstart-agent",
				ImportStateVerify:        true,
				ImportStateVerifyIgnore:  []string{"wait_for_ready", "timeouts"},
			},
			{
				ProtoV6ProviderFactories: f,
				ConfigFile:               resources,
				ConfigVariables:          vars,
				ResourceName:             "agentbox_sandbox_template.python",
				ImportState:              true,
				ImportStateId:            DefaultNamespace + "/python",
				ImportStateVerify:        true,
			},
			{
				// The Sandbox deleted out of band is re-created, and the
				// agent's sandbox runs code again.
				PreConfig: func() {
					ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
					defer cancel()
					if err := c.Delete(ctx, &agentboxv1alpha1.Sandbox{ObjectMeta: objectMeta(sandboxKey)}); err != nil {
						t.Fatal(err)
					}
					if err := waitGone(ctx, c, sandboxKey, &agentboxv1alpha1.Sandbox{}, time.Minute); err != nil {
						t.Fatal(err)
					}
				},
				ProtoV6ProviderFactories: f,
				ConfigDirectory:          dir,
				ConfigVariables:          vars,
				ConfigPlanChecks: resource.ConfigPlanChecks{
					PreApply: []plancheck.PlanCheck{plancheck.ExpectResourceAction("agentbox_sandbox.agent", plancheck.ResourceActionCreate)},
				},
				Check: checkRunsInGVisor(t, agent),
			},
			{
				// A second sandbox for the agent: the control plane refuses
				// it (an agent has one sandbox), and wait_for_ready fails the
				// apply with the reason at once instead of waiting out the
				// create timeout.
				ProtoV6ProviderFactories: f,
				ConfigDirectory:          config.StaticDirectory(quickstartWithTwin(t)),
				ConfigVariables:          vars,
				ExpectError:              regexp.MustCompile(`DuplicateAgent:\s+agent\s+"quickstart-agent"\s+already\s+has\s+Sandbox\s+agentbox-system/quickstart-agent`),
			},
			{
				// The refused twin has no pod; going back to the quickstart
				// destroys it, and the agent's own sandbox runs code as before.
				PreConfig: func() {
					ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
					defer cancel()
					var twin agentboxv1alpha1.Sandbox
					if err := c.Get(ctx, types.NamespacedName{Namespace: DefaultNamespace, Name: "quickstart-twin"}, &twin); err != nil {
						t.Fatal(err)
					}
					ready := meta.FindStatusCondition(twin.Status.Conditions, agentboxv1alpha1.ConditionReady)
					if twin.Status.Phase != agentboxv1alpha1.SandboxPhaseError || ready == nil || ready.Reason != agentboxv1alpha1.ReasonDuplicateAgent ||
						twin.Status.PodName != "" {
						t.Fatalf("the twin: phase %s, pod %q, Ready %+v", twin.Status.Phase, twin.Status.PodName, ready)
					}
				},
				ProtoV6ProviderFactories: f,
				ConfigDirectory:          dir,
				ConfigVariables:          vars,
				ConfigPlanChecks: resource.ConfigPlanChecks{
					PreApply: []plancheck.PlanCheck{plancheck.ExpectResourceAction("agentbox_sandbox.twin", plancheck.ResourceActionDestroy)},
				},
				Check: checkRunsInGVisor(t, agent),
			},
		},
	})
}

// quickstartWithTwin is examples/quickstart with a second sandbox for the
// same agent.
func quickstartWithTwin(t *testing.T) string {
	t.Helper()
	dir := t.TempDir()
	main, err := os.ReadFile("../examples/quickstart/main.tf")
	if err != nil {
		t.Fatal(err)
	}
	twin := `
resource "agentbox_sandbox" "twin" {
  name     = "quickstart-twin"
  agent_id = var.agent_id
  template = agentbox_sandbox_template.python.name
  timeouts = {
    create = "10m"
  }

  depends_on = [agentbox_sandbox.agent]
}
`
	for name, data := range map[string][]byte{"main.tf": main, "twin.tf": []byte(twin)} {
		if err := os.WriteFile(filepath.Join(dir, name), data, 0o600); err != nil {
			t.Fatal(err)
		}
	}
	return dir
}

// quickstartAPI is a client of the Compute API with the endpoint, CA and
// token that the quickstart's agentbox_platform reports.
func quickstartAPI(s *terraform.State) (*client.Client, error) {
	return platformAPI(s, "agentbox_platform.this")
}

// platformAPI is a client of the Compute API with the endpoint, CA and
// token that the agentbox_platform at addr reports.
func platformAPI(s *terraform.State, addr string) (*client.Client, error) {
	platform, ok := s.RootModule().Resources[addr]
	if !ok {
		return nil, fmt.Errorf("%s not in state", addr)
	}
	attrs := platform.Primary.Attributes
	return client.New(attrs["api_endpoint"], attrs["admin_token"], []byte(attrs["ca_certificate"]))
}

// callTimeout bounds a test's call through the Compute API: longer than
// the API's own bound on waiting for a resume, so that the test sees the
// API's answer rather than giving up first.
const callTimeout = computeapi.DefaultResumeTimeout + time.Minute

// checkRunsInGVisor runs Python in the agent's sandbox through the Compute
// API, with the endpoint, CA and token that agentbox_platform reports, and
// requires the gVisor kernel.
func checkRunsInGVisor(t *testing.T, agent string) resource.TestCheckFunc {
	return func(s *terraform.State) error {
		api, err := quickstartAPI(s)
		if err != nil {
			return err
		}
		defer api.CloseIdleConnections()
		ctx, cancel := context.WithTimeout(context.Background(), callTimeout)
		defer cancel()
		res, err := api.RunCommand(ctx, agent, client.RunCommandRequest{
			Command: []string{"python3", "-c", "import platform; print(platform.release())"},
		})
		if err != nil {
			return fmt.Errorf("run_command: %w", err)
		}
		t.Logf("run_command: exit %d in %d ms, stdout %q, stderr %q", res.ExitCode, res.DurationMS, res.Stdout, res.Stderr)
		if res.ExitCode != 0 || !strings.Contains(res.Stdout, "gvisor") {
			return fmt.Errorf("python3 in the sandbox: exit %d, stdout %q, stderr %q; want the gVisor kernel release", res.ExitCode, res.Stdout, res.Stderr)
		}
		return nil
	}
}

// quickstartNote is what writeWorkspaceNote leaves in the workspace.
const quickstartNote = "kept across an idle stop\n"

// writeWorkspaceNote writes a file into the agent's workspace through the
// Compute API, for checkIdleStopAndResume to find after the resume.
func writeWorkspaceNote(t *testing.T, agent string) resource.TestCheckFunc {
	return func(s *terraform.State) error {
		api, err := quickstartAPI(s)
		if err != nil {
			return err
		}
		defer api.CloseIdleConnections()
		ctx, cancel := context.WithTimeout(context.Background(), callTimeout)
		defer cancel()
		res, err := api.RunCommand(ctx, agent, client.RunCommandRequest{Command: []string{"sh", "-c", "echo '" + strings.TrimSuffix(quickstartNote, "\n") + "' > notes.txt && cat notes.txt"}})
		if err != nil {
			return fmt.Errorf("write the note: %w", err)
		}
		if res.ExitCode != 0 || res.Stdout != quickstartNote {
			return fmt.Errorf("write the note: exit %d, stdout %q, stderr %q", res.ExitCode, res.Stdout, res.Stderr)
		}
		return nil
	}
}

// checkIdleStopAndResume waits for the sandbox to idle out and stop into
// the platform's default store, then resumes it with a call through the
// Compute API and finds the workspace's note.
func checkIdleStopAndResume(t *testing.T, c ctrlclient.Client, key types.NamespacedName, agent string) resource.TestCheckFunc {
	return func(s *terraform.State) error {
		ctx, cancel := context.WithTimeout(context.Background(), 10*time.Minute)
		defer cancel()
		// Whatever the cluster has: the default store needs no snapshot API.
		_, noCRD := c.RESTMapper().RESTMapping(schema.GroupKind{Group: "snapshot.storage.k8s.io", Kind: "VolumeSnapshot"}, "v1")
		t.Logf("VolumeSnapshot CRDs installed in the test cluster: %v", noCRD == nil)

		// The control plane's check found the embedded store usable.
		var cm corev1.ConfigMap
		if err := c.Get(ctx, types.NamespacedName{Namespace: key.Namespace, Name: agentboxv1alpha1.ControlPlaneStatusConfigMap}, &cm); err != nil {
			return fmt.Errorf("the control plane's status: %w", err)
		}
		if d := cm.Data; d[agentboxv1alpha1.StatusKeySnapshotDriver] != "archive/embedded" || d[agentboxv1alpha1.StatusKeySnapshotReady] != "true" {
			return fmt.Errorf("the control plane's snapshot check: %v", d)
		}

		var sbx agentboxv1alpha1.Sandbox
		var stopping, stopped time.Time
		start := time.Now()
		for stopped.IsZero() {
			if err := c.Get(ctx, key, &sbx); err != nil {
				return err
			}
			switch sbx.Status.Phase {
			case agentboxv1alpha1.SandboxPhaseIdleStopping:
				if stopping.IsZero() {
					stopping = time.Now()
				}
			case agentboxv1alpha1.SandboxPhaseStopped:
				stopped = time.Now()
			}
			if blocked := meta.FindStatusCondition(sbx.Status.Conditions, agentboxv1alpha1.ConditionIdleStopBlocked); blocked != nil {
				return fmt.Errorf("the idle stop is blocked: %s: %s", blocked.Reason, blocked.Message)
			}
			select {
			case <-ctx.Done():
				return fmt.Errorf("the sandbox did not stop (phase %s): %w", sbx.Status.Phase, ctx.Err())
			case <-time.After(250 * time.Millisecond):
			}
		}
		snap := sbx.Status.Snapshot
		if snap == nil || snap.Driver != "archive/embedded" || snap.SizeBytes <= 0 {
			return fmt.Errorf("stopped with snapshot %+v; want one in the embedded store", snap)
		}
		// Gone, or going: a pod ends within its grace period.
		var pod corev1.Pod
		if err := c.Get(ctx, types.NamespacedName{Namespace: key.Namespace, Name: key.Name}, &pod); err == nil && pod.DeletionTimestamp == nil {
			return fmt.Errorf("the pod of the stopped sandbox is still running")
		} else if err != nil && !apierrors.IsNotFound(err) {
			return err
		}
		stopTook := "not seen"
		if !stopping.IsZero() {
			stopTook = stopped.Sub(stopping).Round(100 * time.Millisecond).String()
		}

		api, err := quickstartAPI(s)
		if err != nil {
			return err
		}
		defer api.CloseIdleConnections()
		callCtx, callCancel := context.WithTimeout(ctx, callTimeout)
		defer callCancel()
		callStart := time.Now()
		res, err := api.RunCommand(callCtx, agent, client.RunCommandRequest{Command: []string{"cat", "notes.txt"}})
		resumeTook := time.Since(callStart)
		if err != nil {
			return fmt.Errorf("run_command on the stopped sandbox: %w", err)
		}
		if res.ExitCode != 0 || res.Stdout != quickstartNote {
			return fmt.Errorf("after the resume: exit %d, stdout %q, stderr %q; want the note", res.ExitCode, res.Stdout, res.Stderr)
		}
		t.Logf("idle stop into %s: stopped %s after the idle timeout was shortened (the stop itself, IdleStopping to Stopped as polled: %s; archive %d bytes); "+
			"run_command on the stopped sandbox, resume included: %s", snap.Driver, stopped.Sub(start).Round(100*time.Millisecond), stopTook,
			snap.SizeBytes, resumeTook.Round(time.Millisecond))
		// What the README has people look at: the controller's own timings.
		var events corev1.EventList
		if err := c.List(ctx, &events, ctrlclient.InNamespace(key.Namespace)); err != nil {
			return err
		}
		for _, e := range events.Items {
			if e.InvolvedObject.Kind == "Sandbox" && e.InvolvedObject.Name == key.Name && (e.Reason == "IdleStopped" || e.Reason == "Resumed") {
				t.Logf("event %s: %s", e.Reason, e.Message)
			}
		}
		return nil
	}
}

// checkRestrictedNamespace checks that the namespace the platform created
// enforces the restricted Pod Security Standard, which the API server then
// applied to the sandbox's pod, and that the sandbox reports it so.
func checkRestrictedNamespace(c ctrlclient.Client, sandbox types.NamespacedName) resource.TestCheckFunc {
	return func(*terraform.State) error {
		ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
		defer cancel()
		var ns corev1.Namespace
		if err := c.Get(ctx, types.NamespacedName{Name: sandbox.Namespace}, &ns); err != nil {
			return err
		}
		for k, v := range chart.RestrictedNamespaceLabels() {
			if ns.Labels[k] != v {
				return fmt.Errorf("namespace %s: label %s=%q, want %q (labels %v)", ns.Name, k, ns.Labels[k], v, ns.Labels)
			}
		}
		var sb agentboxv1alpha1.Sandbox
		if err := c.Get(ctx, sandbox, &sb); err != nil {
			return err
		}
		cond := meta.FindStatusCondition(sb.Status.Conditions, agentboxv1alpha1.ConditionPodSecurity)
		if cond == nil || cond.Status != metav1.ConditionTrue {
			return fmt.Errorf("sandbox %s: PodSecurity condition %+v, want True", sandbox, cond)
		}
		return nil
	}
}
