package controller

import (
	"context"
	"strings"
	"testing"

	corev1 "k8s.io/api/core/v1"
	"k8s.io/apimachinery/pkg/api/meta"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"

	"github.com/agentbox/terraform-provider-agentbox/internal/api/v1alpha1"
)

// TestUnitPodSecurityCondition: a sandbox says whether its namespace
// enforces restricted, warns once when it does not, follows the label as
// it changes, and never touches the namespace.
func TestUnitPodSecurityCondition(t *testing.T) {
	ctx := context.Background()
	ns := &corev1.Namespace{ObjectMeta: metav1.ObjectMeta{Name: unitNS}}
	f := newFakeEnv(t, ns, unitTemplate("t"), unitSandbox("s", "t"))
	cond := func() *metav1.Condition {
		t.Helper()
		c := meta.FindStatusCondition(f.sandbox("s").Status.Conditions, v1alpha1.ConditionPodSecurity)
		if c == nil {
			t.Fatal("no PodSecurity condition")
		}
		return c
	}
	setLevel := func(level string) {
		t.Helper()
		must(t, f.c.Get(ctx, types.NamespacedName{Name: unitNS}, ns))
		ns.Labels = map[string]string{}
		if level != "" {
			ns.Labels["pod-security.kubernetes.io/enforce"] = level
		}
		must(t, f.c.Update(ctx, ns))
	}

	f.reconcile("s")
	c := cond()
	if c.Status != metav1.ConditionFalse || c.Reason != v1alpha1.ReasonRestrictedNotEnforced ||
		!strings.Contains(c.Message, "no pod-security.kubernetes.io/enforce label") {
		t.Errorf("unlabelled namespace: %+v", c)
	}
	f.reconcile("s")
	evs := strings.Join(f.drainEvents(), "\n")
	if n := strings.Count(evs, EventPodSecurityNotEnforced); n != 1 {
		t.Errorf("%d %s events over two passes, want one: %s", n, EventPodSecurityNotEnforced, evs)
	}

	setLevel("baseline")
	f.reconcile("s")
	if c := cond(); c.Status != metav1.ConditionFalse || !strings.Contains(c.Message, "pod-security.kubernetes.io/enforce=baseline") {
		t.Errorf("baseline namespace: %+v", c)
	}
	if evs := strings.Join(f.drainEvents(), "\n"); strings.Contains(evs, EventPodSecurityNotEnforced) {
		t.Errorf("warned again while the condition stayed False: %s", evs)
	}

	setLevel("restricted")
	f.reconcile("s")
	if c := cond(); c.Status != metav1.ConditionTrue || c.Reason != v1alpha1.ReasonRestrictedEnforced {
		t.Errorf("restricted namespace: %+v", c)
	}
	must(t, f.c.Get(ctx, types.NamespacedName{Name: unitNS}, ns))
	if len(ns.Labels) != 1 {
		t.Errorf("the controller changed the namespace's labels: %v", ns.Labels)
	}
	// The Ready condition tells its own story beside it.
	if f.ready("s").Reason != v1alpha1.ReasonCreating {
		t.Errorf("Ready reason %s", f.ready("s").Reason)
	}

	setLevel("privileged")
	f.reconcile("s")
	if c := cond(); c.Status != metav1.ConditionFalse {
		t.Errorf("privileged namespace: %+v", c)
	}
	if evs := strings.Join(f.drainEvents(), "\n"); !strings.Contains(evs, EventPodSecurityNotEnforced) {
		t.Errorf("no warning when the namespace stopped enforcing restricted: %s", evs)
	}
}
