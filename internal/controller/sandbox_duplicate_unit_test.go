package controller

import (
	"context"
	"strings"
	"testing"
	"time"

	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"
	"sigs.k8s.io/controller-runtime/pkg/client"
	"sigs.k8s.io/controller-runtime/pkg/event"

	"github.com/agentbox/terraform-provider-agentbox/internal/api/v1alpha1"
)

// TestUnitDuplicateAgent: of two Sandboxes of one agent, the newer gets
// DuplicateAgent and no pod (one it had is deleted), and starts once the
// older is deleted. The cluster test covers the watch that brings it back.
func TestUnitDuplicateAgent(t *testing.T) {
	now := time.Now()
	first, second := unitSandbox("first", "t"), unitSandbox("second", "t")
	second.Spec.AgentID = first.Spec.AgentID
	first.CreationTimestamp = metav1.NewTime(now.Add(-time.Minute))
	second.CreationTimestamp = metav1.NewTime(now)
	// A pod the newer one started before the older was seen.
	stray := &corev1.Pod{ObjectMeta: metav1.ObjectMeta{Name: PodName("second"), Namespace: unitNS, UID: "uid-pod",
		OwnerReferences: []metav1.OwnerReference{*metav1.NewControllerRef(second, v1alpha1.GroupVersion.WithKind("Sandbox"))}}}
	f := newFakeEnv(t, first, second, unitTemplate("t"), stray)

	f.reconcile("second")
	sbx, c := f.sandbox("second"), f.ready("second")
	if sbx.Status.Phase != v1alpha1.SandboxPhaseError || c.Reason != v1alpha1.ReasonDuplicateAgent ||
		!strings.Contains(c.Message, unitNS+"/first") || sbx.Status.PodName != "" {
		t.Fatalf("the newer sandbox: phase %s, pod %q, Ready %s: %s", sbx.Status.Phase, sbx.Status.PodName, c.Reason, c.Message)
	}
	if err := f.c.Get(context.Background(), client.ObjectKeyFromObject(stray), &corev1.Pod{}); err == nil {
		t.Error("the duplicate's pod was kept")
	}
	evs := strings.Join(f.drainEvents(), "\n")
	if !strings.Contains(evs, EventDuplicateAgent) {
		t.Errorf("no DuplicateAgent event: %s", evs)
	}
	// Said once, not on every pass.
	rv := f.sandbox("second").ResourceVersion
	f.reconcile("second")
	if evs := f.drainEvents(); len(evs) != 0 || f.sandbox("second").ResourceVersion != rv {
		t.Errorf("a second pass repeated events %v or rewrote the sandbox", evs)
	}

	f.reconcile("first")
	if c := f.ready("first"); c.Reason == v1alpha1.ReasonDuplicateAgent {
		t.Fatalf("the older sandbox was refused: %s", c.Message)
	}
	if err := f.c.Get(context.Background(), types.NamespacedName{Namespace: unitNS, Name: PodName("first")}, &corev1.Pod{}); err != nil {
		t.Errorf("the older sandbox has no pod: %v", err)
	}

	// The older one goes: the newer one starts.
	must(t, f.c.Delete(context.Background(), f.sandbox("first")))
	f.reconcile("first")
	f.reconcile("second")
	if c := f.ready("second"); c.Reason == v1alpha1.ReasonDuplicateAgent {
		t.Fatalf("still refused after the older one was deleted: %s", c.Message)
	}
	if err := f.c.Get(context.Background(), types.NamespacedName{Namespace: unitNS, Name: PodName("second")}, &corev1.Pod{}); err != nil {
		t.Errorf("no pod after the older one was deleted: %v", err)
	}
}

func TestUnitAgentMembershipPredicate(t *testing.T) {
	old := unitSandbox("s", "t")
	statusOnly := old.DeepCopy()
	statusOnly.Status.Phase = v1alpha1.SandboxPhaseRunning
	deleting := old.DeepCopy()
	deleting.DeletionTimestamp = &metav1.Time{Time: time.Now()}
	if agentMembershipChanged.Update(updateEvent(old, statusOnly)) {
		t.Error("a status write passes")
	}
	if !agentMembershipChanged.Update(updateEvent(old, deleting)) {
		t.Error("the start of a deletion does not pass")
	}
}

func updateEvent(old, new client.Object) event.UpdateEvent {
	return event.UpdateEvent{ObjectOld: old, ObjectNew: new}
}
