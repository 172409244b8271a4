package controller

import (
	"context"
	"slices"
	"testing"

	k8sruntime "k8s.io/apimachinery/pkg/runtime"
	clientgoscheme "k8s.io/client-go/kubernetes/scheme"
	"sigs.k8s.io/controller-runtime/pkg/client"
	"sigs.k8s.io/controller-runtime/pkg/client/fake"

	"github.com/agentbox/terraform-provider-agentbox/internal/api/v1alpha1"
)

// TestUnitEgressProxyWakesItsSandboxes: a sandbox waiting for its
// template's EgressProxy is reconciled when the proxy appears, and only
// the sandboxes of templates that name that proxy are.
func TestUnitEgressProxyWakesItsSandboxes(t *testing.T) {
	scheme := k8sruntime.NewScheme()
	must(t, clientgoscheme.AddToScheme(scheme))
	must(t, v1alpha1.AddToScheme(scheme))
	other := unitTemplate("plain")
	c := fake.NewClientBuilder().WithScheme(scheme).
		WithIndex(&v1alpha1.Sandbox{}, templateRefIndex, func(o client.Object) []string {
			return []string{o.(*v1alpha1.Sandbox).Spec.TemplateRef.Name}
		}).
		WithObjects(proxiedTemplate("t", "egress"), other, unitSandbox("a", "t"), unitSandbox("b", "t"), unitSandbox("c", "plain")).
		Build()
	r := &SandboxReconciler{Client: c, Scheme: scheme}
	reqs := r.sandboxesForEgressProxy(context.Background(), unitEgressProxy("egress"))
	var names []string
	for _, q := range reqs {
		names = append(names, q.Name)
	}
	slices.Sort(names)
	if !slices.Equal(names, []string{"a", "b"}) {
		t.Errorf("EgressProxy egress wakes %v, want [a b]", names)
	}
	if got := r.sandboxesForEgressProxy(context.Background(), unitEgressProxy("unused")); len(got) != 0 {
		t.Errorf("an EgressProxy no template names wakes %v", got)
	}
}
