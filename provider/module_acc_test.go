package provider

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"regexp"
	"slices"
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
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/client-go/tools/clientcmd"
	clientcmdapi "k8s.io/client-go/tools/clientcmd/api"
	"sigs.k8s.io/controller-runtime/pkg/client"

	agentboxv1alpha1 "github.com/agentbox/terraform-provider-agentbox/internal/api/v1alpha1"
	"github.com/agentbox/terraform-provider-agentbox/internal/chart"
)

const modulePlatformDir = "../examples/modules/agentbox-platform"

// TestAccModulePlatform applies examples/modules/agentbox-platform as users
// would: the whole platform with a node pool on the test node, a template
// whose sandboxes go through a shared egress proxy, and a warm pool of one,
// all in a fresh namespace under a release name of its own.
func TestAccModulePlatform(t *testing.T) {
	tag := testAccPlatformImageTag(t)
	c, ns := testAccCluster(t)
	suffix := strings.TrimPrefix(ns, "acc-")
	const release, tpl = "acc-module", "acc-python"
	pool, rc, taintKey := "acc-mod-"+suffix, "gvisor-acc-mod-"+suffix, "agentbox.test/acc-mod-"+suffix

	node := testAccRealNode(t, c)
	t.Cleanup(func() { cleanupNodePool(t, c, pool, rc, node.Name, taintKey) })

	vars := config.Variables{
		"namespace":    config.StringVariable(ns),
		"release_name": config.StringVariable(release),
		"image_tag":    config.StringVariable(tag),
		"node_pool": config.ObjectVariable(map[string]config.Variable{
			"name":               config.StringVariable(pool),
			"runtime_class_name": config.StringVariable(rc),
			"node_selector":      config.MapVariable(map[string]config.Variable{corev1.LabelHostname: config.StringVariable(node.Labels[corev1.LabelHostname])}),
			// PreferNoSchedule under a key of its own never keeps other
			// pods off the cluster's only node; the module makes the
			// sandboxes tolerate it.
			"taint": config.ObjectVariable(map[string]config.Variable{
				"key": config.StringVariable(taintKey), "value": config.StringVariable("true"), "effect": config.StringVariable("PreferNoSchedule"),
			}),
		}),
		"template_name": config.StringVariable(tpl),
		"template_resources": config.ObjectVariable(map[string]config.Variable{
			"requests": config.MapVariable(map[string]config.Variable{"cpu": config.StringVariable("50m"), "memory": config.StringVariable("64Mi")}),
		}),
		"workspace_size":  config.StringVariable("256Mi"),
		"warm_pool_size":  config.IntegerVariable(1),
		"allowed_domains": config.ListVariable(config.StringVariable("pypi.org"), config.StringVariable("*.pythonhosted.org")),
		"egress_mode":     config.StringVariable("Shared"),
		"egress_replicas": config.IntegerVariable(1),
		// The test node has runsc already; the installer would overwrite it.
		"install_runsc": config.BoolVariable(false),
	}

	// The module configures no provider, as a module must not; the provider
	// serving this test finds the cluster in the environment instead, as it
	// would for a user with KUBE_CONFIG_PATH exported.
	t.Setenv("KUBE_CONFIG_PATH", os.Getenv(testAccKubeconfigEnv))
	// The module's required_providers names agentbox/agentbox.
	t.Setenv("TF_ACC_PROVIDER_NAMESPACE", "agentbox")
	f := testAccProtoV6ProviderFactories
	dir := config.StaticDirectory(modulePlatformDir)
	str := knownvalue.StringExact
	var start time.Time
	resource.Test(t, resource.TestCase{
		Steps: []resource.TestStep{
			{
				PreConfig:                func() { start = time.Now() },
				ProtoV6ProviderFactories: f,
				ConfigDirectory:          dir,
				ConfigVariables:          vars,
				ConfigStateChecks: []statecheck.StateCheck{
					statecheck.ExpectKnownOutputValue("namespace", str(ns)),
					statecheck.ExpectKnownOutputValue("release_name", str(release)),
					statecheck.ExpectKnownOutputValue("chart_version", str(chart.Version())),
					statecheck.ExpectKnownOutputValue("api_endpoint", knownvalue.StringRegexp(regexp.MustCompile(`^https://[0-9.]+:443$`))),
					statecheck.ExpectKnownOutputValue("api_service_dns", str("agentbox-api."+ns+".svc")),
					statecheck.ExpectKnownOutputValue("ca_certificate", knownvalue.StringRegexp(regexp.MustCompile(`^-----BEGIN CERTIFICATE-----`))),
					statecheck.ExpectKnownOutputValue("admin_token", knownvalue.StringRegexp(regexp.MustCompile(`^\S{16,}$`))),
					statecheck.ExpectKnownOutputValue("node_pool_name", str(pool)),
					statecheck.ExpectKnownOutputValue("runtime_class_name", str(rc)),
					statecheck.ExpectKnownOutputValue("template_name", str(tpl)),
					statecheck.ExpectKnownOutputValue("warm_pool_name", str(tpl)),
					statecheck.ExpectKnownOutputValue("warm_pool_ready_replicas", knownvalue.Int64Exact(1)),
					statecheck.ExpectKnownOutputValue("egress_proxy_name", str(tpl)),
					statecheck.ExpectKnownValue("agentbox_platform.this", tfjsonpath.New("status"), str("deployed")),
				},
				Check: resource.ComposeTestCheckFunc(
					func(*terraform.State) error {
						t.Logf("apply of the module (platform, node pool, egress proxy, template, warm pool of 1, waiting for readiness): %s",
							time.Since(start).Round(time.Millisecond))
						return nil
					},
					checkModuleObjects(c, ns, tpl, pool, rc),
					checkNodeLabelled(c, node.Name, pool, taintKey),
					checkPodsOf(c, ns, rc, 1),
				),
			},
			{
				ProtoV6ProviderFactories: f,
				ConfigDirectory:          dir,
				ConfigVariables:          vars,
				ConfigPlanChecks:         resource.ConfigPlanChecks{PreApply: []plancheck.PlanCheck{plancheck.ExpectEmptyPlan()}},
			},
		},
		CheckDestroy: func(*terraform.State) error {
			ctx := context.Background()
			cfg, err := clientcmd.BuildConfigFromFlags("", os.Getenv(testAccKubeconfigEnv))
			if err != nil {
				return err
			}
			if _, err := chart.New(cfg).Status(ctx, ns, release); !errors.Is(err, chart.ErrNotFound) {
				return fmt.Errorf("release %s/%s still there after destroy: %v", ns, release, err)
			}
			for _, obj := range []client.Object{&agentboxv1alpha1.SandboxWarmPool{}, &agentboxv1alpha1.SandboxTemplate{}, &agentboxv1alpha1.EgressProxy{}} {
				if err := c.Get(ctx, types.NamespacedName{Namespace: ns, Name: tpl}, obj); !apierrors.IsNotFound(err) {
					return fmt.Errorf("%T %s/%s still there after destroy: %v", obj, ns, tpl, err)
				}
			}
			if err := c.Get(ctx, types.NamespacedName{Name: pool}, &agentboxv1alpha1.GVisorNodePool{}); !apierrors.IsNotFound(err) {
				return fmt.Errorf("node pool %s still there after destroy: %v", pool, err)
			}
			var n corev1.Node
			if err := c.Get(ctx, types.NamespacedName{Name: node.Name}, &n); err != nil {
				return err
			}
			if n.Labels[agentboxv1alpha1.LabelNodePool] == pool || slices.ContainsFunc(n.Spec.Taints, func(tt corev1.Taint) bool { return tt.Key == taintKey }) {
				return fmt.Errorf("node %s still carries pool %s's label or taint after destroy", n.Name, pool)
			}
			return nil
		},
	})
}

// checkModuleObjects requires the objects the module wired together: the
// template on the node pool and behind the egress proxy, the proxy shared
// and limited to the allowlist, the warm pool keeping the template warm.
func checkModuleObjects(c client.Client, ns, name, pool, rc string) resource.TestCheckFunc {
	return func(*terraform.State) error {
		ctx := context.Background()
		key := types.NamespacedName{Namespace: ns, Name: name}
		var tp agentboxv1alpha1.SandboxTemplate
		if err := c.Get(ctx, key, &tp); err != nil {
			return err
		}
		if tp.Spec.NodePoolRef == nil || *tp.Spec.NodePoolRef != pool {
			return fmt.Errorf("template nodePoolRef %v, want %s", tp.Spec.NodePoolRef, pool)
		}
		if tp.Spec.EgressProxyRef == nil || tp.Spec.EgressProxyRef.Name != name {
			return fmt.Errorf("template egressProxyRef %v, want %s", tp.Spec.EgressProxyRef, name)
		}
		var ep agentboxv1alpha1.EgressProxy
		if err := c.Get(ctx, key, &ep); err != nil {
			return err
		}
		if ep.Spec.Mode != agentboxv1alpha1.EgressProxyModeShared {
			return fmt.Errorf("egress proxy mode %q, want Shared", ep.Spec.Mode)
		}
		got := make([]string, 0, len(ep.Spec.AllowedDomains))
		for _, d := range ep.Spec.AllowedDomains {
			got = append(got, string(d))
		}
		slices.Sort(got)
		if want := []string{"*.pythonhosted.org", "pypi.org"}; !slices.Equal(got, want) {
			return fmt.Errorf("egress proxy allowedDomains %v, want %v", got, want)
		}
		var wp agentboxv1alpha1.SandboxWarmPool
		if err := c.Get(ctx, key, &wp); err != nil {
			return err
		}
		if wp.Spec.TemplateRef.Name != name {
			return fmt.Errorf("warm pool templateRef %q, want %s", wp.Spec.TemplateRef.Name, name)
		}
		var np agentboxv1alpha1.GVisorNodePool
		if err := c.Get(ctx, types.NamespacedName{Name: pool}, &np); err != nil {
			return err
		}
		if np.Spec.RuntimeClassName != rc {
			return fmt.Errorf("node pool runtimeClassName %q, want %s", np.Spec.RuntimeClassName, rc)
		}
		return nil
	}
}

// checkPodsOf requires at least n running pods of the RuntimeClass in ns:
// the warm sandboxes, started under gVisor on the pool's node.
func checkPodsOf(c client.Client, ns, runtimeClass string, n int) resource.TestCheckFunc {
	return func(*terraform.State) error {
		var pods corev1.PodList
		if err := c.List(context.Background(), &pods, client.InNamespace(ns)); err != nil {
			return err
		}
		running := 0
		for _, p := range pods.Items {
			if p.Spec.RuntimeClassName != nil && *p.Spec.RuntimeClassName == runtimeClass && p.Status.Phase == corev1.PodRunning &&
				p.DeletionTimestamp == nil {
				running++
			}
		}
		if running < n {
			return fmt.Errorf("%d running pods with RuntimeClass %s in %s, want at least %d", running, runtimeClass, ns, n)
		}
		return nil
	}
}

// TestAccTwoClustersPlan plans examples/two-clusters with the terraform CLI
// against the test cluster, reached through two kubeconfig contexts. Two
// control planes cannot share one cluster (each watches every namespace),
// so it is not applied; the plan shows that each provider alias reaches its
// cluster and that the module's values pass the chart's checks.
func TestAccTwoClustersPlan(t *testing.T) {
	t.Parallel()
	testAccPreCheck(t)
	tf := terraformCLI(t)
	work := copyExamples(t)
	dir := filepath.Join(work, "two-clusters")

	// Two contexts on the one test cluster, so that each alias selects its
	// own with config_context.
	kc, err := clientcmd.LoadFromFile(os.Getenv(testAccKubeconfigEnv))
	if err != nil {
		t.Fatal(err)
	}
	current, ok := kc.Contexts[kc.CurrentContext]
	if !ok {
		t.Fatalf("kubeconfig %s has no current context", os.Getenv(testAccKubeconfigEnv))
	}
	kc.Contexts = map[string]*clientcmdapi.Context{"east": current.DeepCopy(), "west": current.DeepCopy()}
	kc.CurrentContext = ""
	kubeconfig := filepath.Join(t.TempDir(), "kubeconfig")
	if err := clientcmd.WriteToFile(*kc, kubeconfig); err != nil {
		t.Fatal(err)
	}

	tf.run(t, dir, "get", "-no-color")
	tf.run(t, dir, "plan", "-input=false", "-lock=false", "-no-color", "-out=tfplan",
		"-var=kubeconfig="+kubeconfig, "-var=east_context=east", "-var=west_context=west",
		"-var=east_namespace=agentbox-east", "-var=west_namespace=agentbox-west",
		"-var=east_release_name=east", "-var=west_release_name=west")
	out := tf.run(t, dir, "show", "-json", "tfplan")
	var plan struct {
		ResourceChanges []struct {
			Address string `json:"address"`
			Change  struct {
				Actions []string       `json:"actions"`
				After   map[string]any `json:"after"`
			} `json:"change"`
		} `json:"resource_changes"`
		Configuration struct {
			RootModule struct {
				ModuleCalls map[string]struct {
					Module struct {
						Resources []struct {
							Address           string `json:"address"`
							ProviderConfigKey string `json:"provider_config_key"`
						} `json:"resources"`
					} `json:"module"`
				} `json:"module_calls"`
			} `json:"root_module"`
		} `json:"configuration"`
	}
	if err := json.Unmarshal(out, &plan); err != nil {
		t.Fatal(err)
	}
	var creates []string
	for _, rc := range plan.ResourceChanges {
		if !slices.Equal(rc.Change.Actions, []string{"create"}) {
			t.Errorf("%s: actions %v, want create", rc.Address, rc.Change.Actions)
		}
		creates = append(creates, rc.Address)
		for _, cluster := range []string{"east", "west"} {
			if rc.Address == "module."+cluster+".agentbox_platform.this" {
				if got := rc.Change.After["namespace"]; got != "agentbox-"+cluster {
					t.Errorf("%s: namespace %v, want agentbox-%s", rc.Address, got, cluster)
				}
				if got := rc.Change.After["release_name"]; got != cluster {
					t.Errorf("%s: release_name %v, want %s", rc.Address, got, cluster)
				}
			}
		}
	}
	slices.Sort(creates)
	var want []string
	for _, cluster := range []string{"east", "west"} {
		for _, r := range []string{"agentbox_egress_proxy.this[0]", "agentbox_node_pool.this", "agentbox_platform.this", "agentbox_sandbox_template.this", "agentbox_warm_pool.this"} {
			want = append(want, "module."+cluster+"."+r)
		}
	}
	if !slices.Equal(creates, want) {
		t.Errorf("planned creates:\n%s\nwant:\n%s", strings.Join(creates, "\n"), strings.Join(want, "\n"))
	}
	// Each module's resources use the provider configuration passed in.
	calls := plan.Configuration.RootModule.ModuleCalls
	if len(calls) != 2 {
		t.Fatalf("%d module calls in the plan's configuration, want east and west", len(calls))
	}
	for cluster, call := range calls {
		if len(call.Module.Resources) != 5 {
			t.Errorf("module.%s has %d resources in the plan's configuration, want 5", cluster, len(call.Module.Resources))
		}
		for _, r := range call.Module.Resources {
			if r.ProviderConfigKey != "agentbox."+cluster {
				t.Errorf("module.%s.%s uses provider %q, want agentbox.%s", cluster, r.Address, r.ProviderConfigKey, cluster)
			}
		}
	}
}
