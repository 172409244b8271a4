package controller

import (
	"context"
	"strings"
	"testing"

	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"

	"github.com/agentbox/terraform-provider-agentbox/internal/api/v1alpha1"
)

// TestUnitNodeLoss plays node loss as the API server shows it: the
// workspace's volume is pinned to a node, and that Node object goes away.
// The sandbox gives the claim up and comes back from its last snapshot;
// while the node exists, a pod that is not ready is left to kubelet.
func TestUnitNodeLoss(t *testing.T) {
	ctx := context.Background()
	f, d := newLifecycleEnv(t, idleSandbox("s", 0))
	f.reconcile("s")
	node := &corev1.Node{ObjectMeta: metav1.ObjectMeta{Name: "node-a", Labels: map[string]string{corev1.LabelHostname: "node-a"}}}
	must(t, f.c.Create(ctx, node))
	must(t, f.c.Create(ctx, &corev1.PersistentVolume{
		ObjectMeta: metav1.ObjectMeta{Name: "pv-s"},
		Spec: corev1.PersistentVolumeSpec{NodeAffinity: &corev1.VolumeNodeAffinity{Required: &corev1.NodeSelector{
			NodeSelectorTerms: []corev1.NodeSelectorTerm{{MatchExpressions: []corev1.NodeSelectorRequirement{{
				Key: corev1.LabelHostname, Operator: corev1.NodeSelectorOpIn, Values: []string{"node-a"},
			}}}},
		}}},
	}))
	var claim corev1.PersistentVolumeClaim
	if !f.exists(&claim, WorkspaceClaimName("s")) {
		t.Fatal("no workspace claim")
	}
	claim.Spec.VolumeName = "pv-s"
	must(t, f.c.Update(ctx, &claim))
	sbx := f.sandbox("s")
	sbx.Status.Snapshot = &v1alpha1.SandboxSnapshot{Name: "s-snap-1"}
	must(t, f.c.Status().Update(ctx, sbx))

	f.reconcile("s")
	if !f.exists(&corev1.Pod{}, "s") || !f.exists(&corev1.PersistentVolumeClaim{}, WorkspaceClaimName("s")) {
		t.Fatal("a starting pod on an existing node was given up")
	}

	must(t, f.c.Delete(ctx, node))
	f.reconcile("s")
	f.wantPhase("s", v1alpha1.SandboxPhasePending, v1alpha1.ReasonNodeLost)
	if f.exists(&corev1.Pod{}, "s") || f.exists(&corev1.PersistentVolumeClaim{}, WorkspaceClaimName("s")) {
		t.Fatal("pod or claim of the lost node kept")
	}
	if evs := strings.Join(f.drainEvents(), "\n"); !strings.Contains(evs, EventNodeLost) || !strings.Contains(evs, "s-snap-1") {
		t.Errorf("events %q lack a NodeLost naming the snapshot", evs)
	}

	f.reconcile("s")
	if !f.exists(&claim, WorkspaceClaimName("s")) || claim.Annotations[AnnotationRestoreFrom] != "s-snap-1" || claim.Spec.VolumeName != "" {
		t.Fatalf("new claim: annotations %v, volume %q", claim.Annotations, claim.Spec.VolumeName)
	}
	if len(d.prepared) != 1 || d.prepared[0] != "s-snap-1" {
		t.Errorf("driver prepared %v, want the last snapshot", d.prepared)
	}
	f.wantPhase("s", v1alpha1.SandboxPhaseResuming, v1alpha1.ReasonResuming)
}
