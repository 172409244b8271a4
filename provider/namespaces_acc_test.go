package provider

import (
	"context"
	"errors"
	"fmt"
	"os"
	"regexp"
	"strings"
	"testing"
	"time"

	"github.com/hashicorp/terraform-plugin-testing/helper/resource"
	"github.com/hashicorp/terraform-plugin-testing/knownvalue"
	"github.com/hashicorp/terraform-plugin-testing/plancheck"
	"github.com/hashicorp/terraform-plugin-testing/statecheck"
	"github.com/hashicorp/terraform-plugin-testing/terraform"
	"github.com/hashicorp/terraform-plugin-testing/tfjsonpath"
	authorizationv1 "k8s.io/api/authorization/v1"
	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	"k8s.io/apimachinery/pkg/api/meta"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	k8stypes "k8s.io/apimachinery/pkg/types"
	"k8s.io/apimachinery/pkg/util/wait"
	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/rest"
	"k8s.io/client-go/tools/clientcmd"
	"sigs.k8s.io/controller-runtime/pkg/client"

	"github.com/agentbox/terraform-provider-agentbox/internal/api/v1alpha1"
	apiclient "github.com/agentbox/terraform-provider-agentbox/internal/computeapi/client"
	"github.com/agentbox/terraform-provider-agentbox/internal/testenv"
)

// TestAccPlatform_sandboxNamespaces installs the real control plane with
// sandbox_namespaces naming one namespace besides its own, and checks what
// least privilege means on the cluster:
//   - a sandbox in the served namespace runs and answers through the Compute
//     API (the control plane's Role there and its namespaced cache work);
//   - a Sandbox in a namespace that is not served gets Ready=False with
//     reason NamespaceNotServed and an event, no pod or Secret is made
//     there, and the Compute API answers for its agent at once with the
//     reason;
//   - the control plane's ServiceAccount may not read a Secret or create a
//     pod there, nor list Secrets cluster-wide (SubjectAccessReviews, and a
//     real read impersonating it);
//   - adding the namespace to sandbox_namespaces serves it: the waiting
//     sandbox then runs.
//
// The platform is installed with managedNodePools: false (through
// `values`), which takes away its right to patch nodes and write
// RuntimeClasses; everything above works without it. A Managed
// agentbox_node_pool that selects the test node is then refused: its
// apply fails at once naming ManagedModeDisabled, the pool's Ready
// condition says why, and the node gets no label or taint and no
// RuntimeClass is made.
func TestAccPlatform_sandboxNamespaces(t *testing.T) {
	tag := testAccPlatformImageTag(t)
	c, ns := testAccCluster(t)
	cfg, err := clientcmd.BuildConfigFromFlags("", os.Getenv(testAccKubeconfigEnv))
	if err != nil {
		t.Fatal(err)
	}
	cs, err := kubernetes.NewForConfig(cfg)
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Minute)
	defer cancel()
	served, other := ns+"-served", ns+"-other"
	for _, n := range []string{served, other} {
		createTestNamespace(ctx, t, c, n)
	}
	const servedAgent, otherAgent = "served-agent", "unserved-agent"

	config := func(namespaces ...string) string {
		return testAccProviderConfig() + fmt.Sprintf(`
resource "agentbox_platform" "this" {
  namespace          = %[1]q
  release_name       = "acc-namespaces"
  image_tag          = %[2]q
  sandbox_namespaces = [%[3]s]
  values             = <<-EOT
    managedNodePools: false
  EOT
}

resource "agentbox_sandbox_template" "served" {
  name      = "python"
  namespace = %[4]q
  workspace = {
    size = "256Mi"
  }
  depends_on = [agentbox_platform.this]
}

resource "agentbox_sandbox" "served" {
  name      = %[5]q
  namespace = %[4]q
  agent_id  = %[5]q
  template  = agentbox_sandbox_template.served.name
}
`, ns, tag, `"`+strings.Join(namespaces, `", "`)+`"`, served, servedAgent)
	}
	one, both := config(served), config(served, other)
	// A Managed pool on the test node, under names of this test's own.
	pool := ns + "-refused"
	t.Cleanup(func() { deleteNodePool(t, c, pool) })
	withPool := func(wait bool) string {
		return both + fmt.Sprintf(`
resource "agentbox_node_pool" "refused" {
  name               = %[1]q
  mode               = "Managed"
  runtime_class_name = %[1]q
  node_selector      = { "kubernetes.io/hostname" = %[2]q }
  taint              = { key = "agentbox.test/%[1]s", value = "true", effect = "PreferNoSchedule" }
  tolerations        = [{ key = "agentbox.test/%[1]s", operator = "Exists" }]
  wait_for_ready     = %[3]t
  # Bounds the wait if the refusal did not end it.
  timeouts = { create = "2m" }

  depends_on = [agentbox_platform.this]
}
`, pool, testenv.NodeName, wait)
	}
	sa := "system:serviceaccount:" + ns + ":agentbox-controlplane"
	namespacesAre := func(want ...string) statecheck.StateCheck {
		var checks []knownvalue.Check
		for _, n := range want {
			checks = append(checks, knownvalue.StringExact(n))
		}
		return statecheck.ExpectKnownValue("agentbox_platform.this", tfjsonpath.New("sandbox_namespaces"), knownvalue.SetExact(checks))
	}

	resource.Test(t, resource.TestCase{
		ProtoV6ProviderFactories: testAccProtoV6ProviderFactories,
		Steps: []resource.TestStep{
			{
				Config: one,
				ConfigStateChecks: []statecheck.StateCheck{
					namespacesAre(served),
					statecheck.ExpectKnownValue("agentbox_sandbox.served", tfjsonpath.New("namespace"), knownvalue.StringExact(served)),
				},
				Check: resource.ComposeTestCheckFunc(
					// The served namespace: the sandbox runs and answers.
					func(s *terraform.State) error { return echoThroughAPI(ctx, s, servedAgent) },
					// The control plane's rights, as the API server decides them.
					func(*terraform.State) error {
						return expectAccess(ctx, cs, sa, []access{
							{served, "", "secrets", "get", true},
							{served, "", "pods", "create", true},
							{ns, "", "secrets", "get", true},
							{ns, "coordination.k8s.io", "leases", "update", true},
							{other, "", "secrets", "get", false},
							{other, "", "secrets", "list", false},
							{other, "", "pods", "create", false},
							{other, "coordination.k8s.io", "leases", "create", false},
							{"", "", "secrets", "list", false},
							{"", "", "secrets", "get", false},
							{"", "", "pods", "create", false},
							// What stays cluster-wide: its own kinds and events.
							{other, "agentbox.dev", "sandboxes", "watch", true},
							{other, "", "events", "create", true},
						})
					},
					// And a real read as the control plane.
					func(*terraform.State) error { return secretReadForbidden(ctx, cfg, sa, other) },
					// A sandbox where the platform does not serve.
					func(*terraform.State) error { return expectNotServed(ctx, c, cs, other, otherAgent) },
					func(s *terraform.State) error { return expectAPINotServed(ctx, s, otherAgent) },
				),
			},
			{
				Config:           one,
				ConfigPlanChecks: resource.ConfigPlanChecks{PreApply: []plancheck.PlanCheck{plancheck.ExpectEmptyPlan()}},
			},
			{
				ResourceName:            "agentbox_platform.this",
				ImportState:             true,
				ImportStateId:           ns + "/acc-namespaces",
				ImportStateVerify:       true,
				ImportStateVerifyIgnore: []string{"wait"},
			},
			{
				// Serving the namespace is the fix the condition names: the
				// control plane restarts with it and runs the sandbox.
				Config: both,
				ConfigPlanChecks: resource.ConfigPlanChecks{PreApply: []plancheck.PlanCheck{
					plancheck.ExpectResourceAction("agentbox_platform.this", plancheck.ResourceActionUpdate),
				}},
				ConfigStateChecks: []statecheck.StateCheck{namespacesAre(served, other)},
				Check: resource.ComposeTestCheckFunc(
					func(*terraform.State) error {
						return expectAccess(ctx, cs, sa, []access{
							{other, "", "secrets", "get", true},
							{other, "", "pods", "create", true},
							{"", "", "secrets", "list", false},
						})
					},
					func(s *terraform.State) error {
						if err := waitServedSandboxRunning(ctx, c, other, otherAgent); err != nil {
							return err
						}
						if err := echoThroughAPI(ctx, s, otherAgent); err != nil {
							return err
						}
						// Gone while the control plane runs, which removes
						// its finalizer.
						return deleteSandboxAndWait(ctx, c, other, otherAgent)
					},
				),
			},
			{
				// What a user sees: the apply fails at once with the reason.
				Config:      withPool(true),
				ExpectError: regexp.MustCompile(`(?s)is refused by\s+the\s+platform.*ManagedModeDisabled.*managedNodePools:\s+true`),
			},
			{
				// Kept without waiting: the platform leaves the node alone.
				Config: withPool(false),
				Check:  func(*terraform.State) error { return expectPoolRefused(ctx, c, cs, pool) },
			},
			{
				Config:           withPool(false),
				ConfigPlanChecks: resource.ConfigPlanChecks{PreApply: []plancheck.PlanCheck{plancheck.ExpectEmptyPlan()}},
				ConfigStateChecks: []statecheck.StateCheck{
					statecheck.ExpectKnownValue("agentbox_node_pool.refused", tfjsonpath.New("status"), knownvalue.ObjectExact(map[string]knownvalue.Check{
						"nodes":       knownvalue.ListExact([]knownvalue.Check{}),
						"ready_nodes": knownvalue.Int64Exact(0),
					})),
				},
			},
		},
	})
}

// expectPoolRefused waits for the Managed pool's Ready condition to say
// ManagedModeDisabled, and wants the test node without the pool's label
// and taint, and no RuntimeClass of the pool.
func expectPoolRefused(ctx context.Context, c client.Client, cs kubernetes.Interface, name string) error {
	var pool v1alpha1.GVisorNodePool
	var ready *metav1.Condition
	err := wait.PollUntilContextTimeout(ctx, time.Second, time.Minute, true, func(ctx context.Context) (bool, error) {
		if err := c.Get(ctx, k8stypes.NamespacedName{Name: name}, &pool); err != nil {
			return false, err
		}
		ready = meta.FindStatusCondition(pool.Status.Conditions, v1alpha1.ConditionReady)
		return ready != nil && ready.ObservedGeneration >= pool.Generation, nil
	})
	if err != nil {
		return fmt.Errorf("node pool %s: no Ready condition for generation %d: %w", name, pool.Generation, err)
	}
	if ready.Status != metav1.ConditionFalse || ready.Reason != v1alpha1.ReasonManagedModeDisabled ||
		!strings.Contains(ready.Message, "managedNodePools: true") {
		return fmt.Errorf("node pool %s: Ready %s (%s: %s), want False with reason %s naming managedNodePools: true",
			name, ready.Status, ready.Reason, ready.Message, v1alpha1.ReasonManagedModeDisabled)
	}
	if len(pool.Status.Nodes) > 0 || len(pool.Finalizers) > 0 {
		return fmt.Errorf("node pool %s: nodes %v, finalizers %v; want none", name, pool.Status.Nodes, pool.Finalizers)
	}
	node, err := cs.CoreV1().Nodes().Get(ctx, testenv.NodeName, metav1.GetOptions{})
	if err != nil {
		return err
	}
	if v, ok := node.Labels[v1alpha1.LabelNodePool]; ok && v == name {
		return fmt.Errorf("node %s is labelled %s=%s", node.Name, v1alpha1.LabelNodePool, v)
	}
	for _, taint := range node.Spec.Taints {
		if taint.Key == "agentbox.test/"+name {
			return fmt.Errorf("node %s has the pool's taint %s", node.Name, taint.ToString())
		}
	}
	if _, err := cs.NodeV1().RuntimeClasses().Get(ctx, name, metav1.GetOptions{}); !apierrors.IsNotFound(err) {
		return fmt.Errorf("RuntimeClass %s: %v, want not found", name, err)
	}
	return nil
}

func createTestNamespace(ctx context.Context, t *testing.T, c client.Client, name string) {
	t.Helper()
	if err := c.Create(ctx, &corev1.Namespace{ObjectMeta: metav1.ObjectMeta{Name: name}}); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		_ = c.Delete(context.Background(), &corev1.Namespace{ObjectMeta: metav1.ObjectMeta{Name: name}})
	})
}

// echoThroughAPI runs a command in agent's sandbox through the Compute API
// of agentbox_platform.this.
func echoThroughAPI(ctx context.Context, s *terraform.State, agent string) error {
	api, err := platformAPI(s, "agentbox_platform.this")
	if err != nil {
		return err
	}
	defer api.CloseIdleConnections()
	callCtx, cancel := context.WithTimeout(ctx, 4*time.Minute)
	defer cancel()
	res, err := api.RunCommand(callCtx, agent, apiclient.RunCommandRequest{Command: []string{"echo", "served"}})
	if err != nil {
		return fmt.Errorf("run_command in %s's sandbox: %w", agent, err)
	}
	if res.ExitCode != 0 || res.Stdout != "served\n" {
		return fmt.Errorf("run_command in %s's sandbox: exit %d, stdout %q", agent, res.ExitCode, res.Stdout)
	}
	return nil
}

type access struct {
	namespace, group, resource, verb string
	allowed                          bool
}

// expectAccess asks the API server, as `kubectl auth can-i --as` does,
// whether user may do each thing.
func expectAccess(ctx context.Context, cs kubernetes.Interface, user string, want []access) error {
	ns := strings.Split(user, ":")[2]
	var errs []error
	for _, w := range want {
		sar := &authorizationv1.SubjectAccessReview{Spec: authorizationv1.SubjectAccessReviewSpec{
			User:   user,
			Groups: []string{"system:serviceaccounts", "system:serviceaccounts:" + ns, "system:authenticated"},
			ResourceAttributes: &authorizationv1.ResourceAttributes{
				Namespace: w.namespace, Group: w.group, Resource: w.resource, Verb: w.verb,
			},
		}}
		got, err := cs.AuthorizationV1().SubjectAccessReviews().Create(ctx, sar, metav1.CreateOptions{})
		if err != nil {
			return fmt.Errorf("SubjectAccessReview: %w", err)
		}
		if got.Status.Allowed != w.allowed {
			where := "every namespace"
			if w.namespace != "" {
				where = "namespace " + w.namespace
			}
			errs = append(errs, fmt.Errorf("%s may %s %s %q in %s: %v, want %v (%s)", user, w.verb, w.resource, w.group, where,
				got.Status.Allowed, w.allowed, got.Status.Reason))
		}
	}
	return errors.Join(errs...)
}

// secretReadForbidden reads a Secret of namespace ns impersonating user,
// and wants the API server to refuse it.
func secretReadForbidden(ctx context.Context, cfg *rest.Config, user, ns string) error {
	c := rest.CopyConfig(cfg)
	c.Impersonate = rest.ImpersonationConfig{UserName: user,
		Groups: []string{"system:serviceaccounts", "system:serviceaccounts:" + strings.Split(user, ":")[2], "system:authenticated"}}
	cs, err := kubernetes.NewForConfig(c)
	if err != nil {
		return err
	}
	if _, err := cs.CoreV1().Secrets(ns).List(ctx, metav1.ListOptions{}); !apierrors.IsForbidden(err) {
		return fmt.Errorf("listing Secrets in %s as %s: %v, want forbidden", ns, user, err)
	}
	if _, err := cs.CoreV1().Secrets(ns).Get(ctx, "anything", metav1.GetOptions{}); !apierrors.IsForbidden(err) {
		return fmt.Errorf("reading a Secret in %s as %s: %v, want forbidden", ns, user, err)
	}
	return nil
}

// expectNotServed creates a template and a Sandbox in ns, which the
// platform does not serve, and waits for the NamespaceNotServed condition
// and event; nothing may be made for the sandbox there.
func expectNotServed(ctx context.Context, c client.Client, cs kubernetes.Interface, ns, agent string) error {
	tpl := &v1alpha1.SandboxTemplate{ObjectMeta: metav1.ObjectMeta{Namespace: ns, Name: "python"},
		Spec: v1alpha1.SandboxTemplateSpec{}}
	if err := c.Create(ctx, tpl); err != nil {
		return err
	}
	sbx := &v1alpha1.Sandbox{ObjectMeta: metav1.ObjectMeta{Namespace: ns, Name: agent},
		Spec: v1alpha1.SandboxSpec{AgentID: agent, TemplateRef: v1alpha1.LocalObjectReference{Name: "python"}}}
	if err := c.Create(ctx, sbx); err != nil {
		return err
	}
	var ready *metav1.Condition
	err := wait.PollUntilContextTimeout(ctx, time.Second, 2*time.Minute, true, func(ctx context.Context) (bool, error) {
		if err := c.Get(ctx, client.ObjectKeyFromObject(sbx), sbx); err != nil {
			return false, err
		}
		ready = meta.FindStatusCondition(sbx.Status.Conditions, v1alpha1.ConditionReady)
		return ready != nil && ready.Reason == v1alpha1.ReasonNamespaceNotServed, nil
	})
	if err != nil {
		return fmt.Errorf("sandbox %s/%s: Ready %+v, want reason %s: %w", ns, agent, ready, v1alpha1.ReasonNamespaceNotServed, err)
	}
	if ready.Status != metav1.ConditionFalse || sbx.Status.Phase != v1alpha1.SandboxPhasePending ||
		!strings.Contains(ready.Message, ns) || !strings.Contains(ready.Message, "sandbox_namespaces") {
		return fmt.Errorf("sandbox %s/%s: phase %s, Ready %+v", ns, agent, sbx.Status.Phase, ready)
	}
	if len(sbx.Finalizers) > 0 {
		return fmt.Errorf("sandbox %s/%s got finalizers %v in a namespace not served", ns, agent, sbx.Finalizers)
	}
	var event *corev1.Event
	err = wait.PollUntilContextTimeout(ctx, time.Second, time.Minute, true, func(ctx context.Context) (bool, error) {
		list, err := cs.CoreV1().Events(ns).List(ctx, metav1.ListOptions{FieldSelector: "involvedObject.name=" + agent})
		if err != nil {
			return false, err
		}
		for i := range list.Items {
			if list.Items[i].Reason == v1alpha1.ReasonNamespaceNotServed {
				event = &list.Items[i]
				return true, nil
			}
		}
		return false, nil
	})
	if err != nil {
		return fmt.Errorf("no %s event for sandbox %s/%s: %w", v1alpha1.ReasonNamespaceNotServed, ns, agent, err)
	}
	if event.Type != corev1.EventTypeWarning || !strings.Contains(event.Message, "sandbox_namespaces") {
		return fmt.Errorf("event %s %q", event.Type, event.Message)
	}
	pods, err := cs.CoreV1().Pods(ns).List(ctx, metav1.ListOptions{})
	if err != nil {
		return err
	}
	secrets, err := cs.CoreV1().Secrets(ns).List(ctx, metav1.ListOptions{})
	if err != nil {
		return err
	}
	for _, s := range secrets.Items {
		if strings.HasPrefix(s.Name, agent) {
			return fmt.Errorf("Secret %s made in a namespace not served", s.Name)
		}
	}
	if len(pods.Items) > 0 {
		return fmt.Errorf("%d pods made in a namespace not served (first %s)", len(pods.Items), pods.Items[0].Name)
	}
	return nil
}

// expectAPINotServed wants the Compute API to answer a call for agent,
// whose sandbox is in a namespace not served, at once with the reason.
func expectAPINotServed(ctx context.Context, s *terraform.State, agent string) error {
	api, err := platformAPI(s, "agentbox_platform.this")
	if err != nil {
		return err
	}
	defer api.CloseIdleConnections()
	// Well under the API's 3 minutes of waiting for a sandbox that starts:
	// this one is not starting, and must not be waited for.
	callCtx, cancel := context.WithTimeout(ctx, time.Minute)
	defer cancel()
	_, err = api.RunCommand(callCtx, agent, apiclient.RunCommandRequest{Command: []string{"true"}})
	var apiErr *apiclient.Error
	if !errors.As(err, &apiErr) || apiErr.Code != "sandbox_not_ready" || apiErr.Details["reason"] != v1alpha1.ReasonNamespaceNotServed {
		return fmt.Errorf("run_command for %s in a namespace not served: %v, want sandbox_not_ready with reason %s", agent, err, v1alpha1.ReasonNamespaceNotServed)
	}
	return nil
}

func waitServedSandboxRunning(ctx context.Context, c client.Client, ns, name string) error {
	var sbx v1alpha1.Sandbox
	err := wait.PollUntilContextTimeout(ctx, 2*time.Second, 5*time.Minute, true, func(ctx context.Context) (bool, error) {
		if err := c.Get(ctx, k8stypes.NamespacedName{Namespace: ns, Name: name}, &sbx); err != nil {
			return false, err
		}
		return sbx.Status.Phase == v1alpha1.SandboxPhaseRunning, nil
	})
	if err != nil {
		return fmt.Errorf("sandbox %s/%s once its namespace is served: phase %s, conditions %+v: %w", ns, name, sbx.Status.Phase, sbx.Status.Conditions, err)
	}
	return nil
}

func deleteSandboxAndWait(ctx context.Context, c client.Client, ns, name string) error {
	sbx := &v1alpha1.Sandbox{ObjectMeta: metav1.ObjectMeta{Namespace: ns, Name: name}}
	if err := c.Delete(ctx, sbx); err != nil {
		return err
	}
	return wait.PollUntilContextTimeout(ctx, time.Second, 2*time.Minute, true, func(ctx context.Context) (bool, error) {
		err := c.Get(ctx, client.ObjectKeyFromObject(sbx), sbx)
		return apierrors.IsNotFound(err), client.IgnoreNotFound(err)
	})
}
