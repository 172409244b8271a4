package provider

import (
	"context"
	"fmt"
	"os"
	"strings"
	"testing"
	"time"

	"github.com/hashicorp/terraform-plugin-framework/diag"
	"github.com/hashicorp/terraform-plugin-testing/helper/resource"
	"github.com/hashicorp/terraform-plugin-testing/knownvalue"
	"github.com/hashicorp/terraform-plugin-testing/plancheck"
	"github.com/hashicorp/terraform-plugin-testing/statecheck"
	"github.com/hashicorp/terraform-plugin-testing/terraform"
	"github.com/hashicorp/terraform-plugin-testing/tfjsonpath"
	corev1 "k8s.io/api/core/v1"
	"k8s.io/apimachinery/pkg/api/meta"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/tools/clientcmd"
	ctrlclient "sigs.k8s.io/controller-runtime/pkg/client"

	agentboxv1alpha1 "github.com/agentbox/terraform-provider-agentbox/internal/api/v1alpha1"
	"github.com/agentbox/terraform-provider-agentbox/internal/chart"
	"github.com/agentbox/terraform-provider-agentbox/internal/computeapi/client"
)

// TestAccPlatformSnapshotCheckFails installs the platform with a snapshot
// driver that cannot work here: volumesnapshot with a VolumeSnapshotClass
// that does not exist (and, on a cluster without the snapshot CRDs, no
// VolumeSnapshot API at all). The control plane still serves; it reports
// the failed check (status ConfigMap, a Warning event on its Deployment,
// the provider's warning), and a sandbox whose idle timeout passes is not
// stopped: it keeps serving calls and says why in its status.
func TestAccPlatformSnapshotCheckFails(t *testing.T) {
	t.Parallel()
	tag := testAccPlatformImageTag(t)
	c, ns := testAccCluster(t)
	const idle = 20 * time.Second
	config := testAccPlatformConfig(ns, tag,
		`  values = yamlencode({ snapshot = { driver = "volumesnapshot", volumeSnapshotClassName = "agentbox-test-no-such-class" } })`) +
		fmt.Sprintf(`
resource "agentbox_sandbox_template" "t" {
  name       = "snapcheck"
  namespace  = %[1]q
  depends_on = [agentbox_platform.test]
}

resource "agentbox_sandbox" "s" {
  name         = "snapcheck"
  namespace    = %[1]q
  agent_id     = "snapcheck-agent"
  template     = agentbox_sandbox_template.t.name
  idle_timeout = %[2]q
}

data "agentbox_platform" "read" {
  namespace  = %[1]q
  depends_on = [agentbox_platform.test]
}
`, ns, idle.String())
	resource.Test(t, resource.TestCase{
		ProtoV6ProviderFactories: testAccProtoV6ProviderFactories,
		CheckDestroy:             platformDestroyed(c, ns),
		Steps: []resource.TestStep{
			{
				Config: config,
				ConfigStateChecks: []statecheck.StateCheck{
					statecheck.ExpectKnownValue(testAccPlatformAddr, tfjsonpath.New("snapshot_driver"), knownvalue.StringExact("volumesnapshot")),
					statecheck.ExpectKnownValue("data.agentbox_platform.read", tfjsonpath.New("snapshot_driver"), knownvalue.StringExact("volumesnapshot")),
					statecheck.ExpectKnownValue(testAccPlatformAddr, tfjsonpath.New("status"), knownvalue.StringExact("deployed")),
				},
				Check: checkStopsHeldBack(t, c, ns, "snapcheck", "snapcheck-agent", idle),
			},
			{
				Config:           config,
				ConfigPlanChecks: resource.ConfigPlanChecks{PreApply: []plancheck.PlanCheck{plancheck.ExpectEmptyPlan()}},
			},
		},
	})
}

func checkStopsHeldBack(t *testing.T, c ctrlclient.Client, ns, name, agent string, idle time.Duration) resource.TestCheckFunc {
	return func(s *terraform.State) error {
		ctx, cancel := context.WithTimeout(context.Background(), 5*time.Minute)
		defer cancel()
		cfg, err := clientcmd.BuildConfigFromFlags("", os.Getenv(testAccKubeconfigEnv))
		if err != nil {
			return err
		}
		cs, err := kubernetes.NewForConfig(cfg)
		if err != nil {
			return err
		}

		// The platform reports the failed check, with the fix.
		rel, err := chart.New(cfg).Status(ctx, ns, chart.DefaultReleaseName)
		if err != nil {
			return err
		}
		check, err := chart.WaitSnapshotCheck(ctx, cs, rel, time.Minute)
		if err != nil {
			return err
		}
		if !check.Current(rel) || check.Ready ||
			(check.Reason != agentboxv1alpha1.ReasonSnapshotAPIMissing && check.Reason != agentboxv1alpha1.ReasonVolumeSnapshotClassNotFound) ||
			!strings.Contains(check.Message, "to fix it") || !strings.Contains(check.Message, "snapshot.driver: archive") {
			return fmt.Errorf("the control plane's snapshot check: %+v", check)
		}
		t.Logf("snapshot check: %s: %s", check.Reason, check.Message)
		var diags diag.Diagnostics
		warnSnapshotCheck(ctx, cs, rel, &diags)
		if diags.WarningsCount() != 1 || !strings.Contains(diags.Warnings()[0].Detail(), check.Message) {
			return fmt.Errorf("agentbox_platform's diagnostics: %v; want the check's warning", diags)
		}
		var events corev1.EventList
		if err := c.List(ctx, &events, ctrlclient.InNamespace(ns)); err != nil {
			return err
		}
		warned := false
		for _, e := range events.Items {
			if e.InvolvedObject.Kind == "Deployment" && e.InvolvedObject.Name == chart.ControlPlaneDeployment &&
				e.Reason == "SnapshotCheckFailed" && e.Type == corev1.EventTypeWarning {
				warned = true
			}
		}
		if !warned {
			return fmt.Errorf("no SnapshotCheckFailed Warning event on the control plane Deployment among %d events", len(events.Items))
		}

		// The sandbox outlives its idle timeout without being stopped, and
		// says why.
		key := types.NamespacedName{Namespace: ns, Name: name}
		var sbx agentboxv1alpha1.Sandbox
		var blocked *metav1.Condition
		deadline := time.Now().Add(idle + 2*time.Minute)
		for {
			if err := c.Get(ctx, key, &sbx); err != nil {
				return err
			}
			if sbx.Status.Phase != agentboxv1alpha1.SandboxPhaseRunning {
				return fmt.Errorf("the sandbox left Running: phase %s (%v)", sbx.Status.Phase, sbx.Status.Conditions)
			}
			if blocked = meta.FindStatusCondition(sbx.Status.Conditions, agentboxv1alpha1.ConditionIdleStopBlocked); blocked != nil {
				break
			}
			if time.Now().After(deadline) {
				return fmt.Errorf("no IdleStopBlocked condition 2m after the idle timeout of %s (conditions %+v)", idle, sbx.Status.Conditions)
			}
			time.Sleep(time.Second)
		}
		if blocked.Status != metav1.ConditionTrue || blocked.Reason != check.Reason || !strings.Contains(blocked.Message, "keeps running and serving") {
			return fmt.Errorf("IdleStopBlocked %+v; want True with the check's reason %s", blocked, check.Reason)
		}
		t.Logf("sandbox %s: IdleStopBlocked %s: %s", name, blocked.Reason, blocked.Message)

		// Calls are served, at once, by the sandbox that was not stopped.
		api, err := platformAPI(s, testAccPlatformAddr)
		if err != nil {
			return err
		}
		defer api.CloseIdleConnections()
		st, err := api.Status(ctx, agent)
		if err != nil {
			return err
		}
		if st.IdleStopBlocked == nil || st.IdleStopBlocked.Reason != check.Reason || !st.Ready {
			return fmt.Errorf("the Compute API's status: %+v", st)
		}
		start := time.Now()
		res, err := api.RunCommand(ctx, agent, client.RunCommandRequest{Command: []string{"echo", "still serving"}})
		if err != nil || res.ExitCode != 0 || res.Stdout != "still serving\n" {
			return fmt.Errorf("run_command past the idle timeout: %+v, %v", res, err)
		}
		t.Logf("run_command on the sandbox whose idle stop is held back: %s", time.Since(start).Round(time.Millisecond))
		return nil
	}
}
