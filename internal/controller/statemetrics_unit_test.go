package controller

import (
	"strings"
	"testing"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/testutil"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	k8sruntime "k8s.io/apimachinery/pkg/runtime"
	clientgoscheme "k8s.io/client-go/kubernetes/scheme"
	"sigs.k8s.io/controller-runtime/pkg/client"
	"sigs.k8s.io/controller-runtime/pkg/client/fake"

	"github.com/agentbox/terraform-provider-agentbox/internal/api/v1alpha1"
)

// The state metrics report the served pools' sandboxes by state and the
// held sandboxes per namespace, and nothing until the replica leads.
func TestUnitStateMetrics(t *testing.T) {
	scheme := k8sruntime.NewScheme()
	must(t, clientgoscheme.AddToScheme(scheme))
	must(t, v1alpha1.AddToScheme(scheme))
	pool := func(ns, name string, total, ready, leased int32) client.Object {
		return &v1alpha1.SandboxWarmPool{ObjectMeta: metav1.ObjectMeta{Namespace: ns, Name: name},
			Status: v1alpha1.SandboxWarmPoolStatus{Replicas: total, ReadyReplicas: ready, LeasedReplicas: leased}}
	}
	sandbox := func(ns, name string, held bool) client.Object {
		status := metav1.ConditionFalse
		if held {
			status = metav1.ConditionTrue
		}
		return &v1alpha1.Sandbox{ObjectMeta: metav1.ObjectMeta{Namespace: ns, Name: name},
			Status: v1alpha1.SandboxStatus{Conditions: []metav1.Condition{{Type: v1alpha1.ConditionLeased, Status: status,
				Reason: "r", LastTransitionTime: metav1.Now()}}}}
	}
	c := fake.NewClientBuilder().WithScheme(scheme).WithObjects(
		pool("team-a", "py", 3, 2, 1), pool("elsewhere", "other", 9, 9, 0),
		sandbox("team-a", "s1", true), sandbox("team-a", "s2", true), sandbox("team-a", "s3", false),
		sandbox("team-b", "s4", false), sandbox("elsewhere", "s5", true),
	).Build()
	elected := make(chan struct{})
	m := &StateMetrics{Reader: c, Elected: elected, Namespaces: ServedNamespaces{"team-a", "team-b"}}
	reg := prometheus.NewPedanticRegistry()
	must(t, reg.Register(m))

	if n, err := testutil.GatherAndCount(reg); err != nil || n != 0 {
		t.Fatalf("before leading: %d series (%v), want none", n, err)
	}
	close(elected)
	want := `
# HELP agentbox_sandbox_holds_active Sandboxes someone holds (a lease or a pool lease: the Leased condition is True), by namespace.
# TYPE agentbox_sandbox_holds_active gauge
agentbox_sandbox_holds_active{namespace="team-a"} 2
agentbox_sandbox_holds_active{namespace="team-b"} 0
`
	if err := testutil.GatherAndCompare(reg, strings.NewReader(want), "agentbox_sandbox_holds_active"); err != nil {
		t.Error(err)
	}
	for state, v := range map[string]float64{"total": 3, "ready": 2, "leased": 1} {
		if got := gaugeValue(t, reg, "agentbox_warm_pool_sandboxes", map[string]string{"namespace": "team-a", "pool": "py", "state": state}); got != v {
			t.Errorf("agentbox_warm_pool_sandboxes{state=%q} = %v, want %v", state, got, v)
		}
	}
	if n, err := testutil.GatherAndCount(reg, "agentbox_warm_pool_sandboxes"); err != nil || n != 3 {
		t.Errorf("%d pool series (%v), want the served pool's 3", n, err)
	}
}

// gaugeValue gathers reg and returns the value of the gauge name with
// exactly labels, failing the test when there is none.
func gaugeValue(t *testing.T, reg prometheus.Gatherer, name string, labels map[string]string) float64 {
	t.Helper()
	families, err := reg.Gather()
	must(t, err)
	for _, f := range families {
		if f.GetName() != name {
			continue
		}
	metrics:
		for _, m := range f.GetMetric() {
			if len(m.GetLabel()) != len(labels) {
				continue
			}
			for _, l := range m.GetLabel() {
				if labels[l.GetName()] != l.GetValue() {
					continue metrics
				}
			}
			return m.GetGauge().GetValue()
		}
	}
	t.Fatalf("no %s%v gathered", name, labels)
	return 0
}
