package controller

import (
	"context"
	"strings"
	"testing"
	"time"

	coordinationv1 "k8s.io/api/coordination/v1"
	corev1 "k8s.io/api/core/v1"
	"k8s.io/apimachinery/pkg/types"

	"github.com/agentbox/terraform-provider-agentbox/internal/api/v1alpha1"
)

// reusePool makes a ready Reuse pool of n and leases, holds and releases
// the first sandbox.
func reusePool(t *testing.T) (*warmEnv, string) {
	t.Helper()
	w, names := readyPool(t, 1)
	p := w.getPool("p")
	p.Spec.ReleasePolicy = v1alpha1.ReleasePolicyReuse
	must(t, w.c.Update(context.Background(), p))
	name := names[0]
	w.lease(name, "run-a", "req-a")
	w.hold(name, "run-a", "req-a", time.Minute)
	w.reconcile(name)
	w.changeLease(name, func(l *coordinationv1.Lease) {
		l.Spec.HolderIdentity, l.Spec.LeaseDurationSeconds, l.Spec.AcquireTime = nil, nil, nil
		delete(l.Annotations, v1alpha1.AnnotationLeaseRequestID)
		delete(l.Annotations, v1alpha1.AnnotationLeaseID)
		l.Annotations[v1alpha1.AnnotationLeaseReleasedRequestID] = "req-a"
	})
	return w, name
}

func (w *warmEnv) pod(name string) *corev1.Pod {
	w.t.Helper()
	var pod corev1.Pod
	if !w.exists(&pod, name) {
		return nil
	}
	return &pod
}

// A released sandbox of a Reuse pool keeps its UID: its pod is replaced by
// one that resets the workspace first, and once that pod is ready the
// sandbox is back in its pool, takeable, its take forgotten.
func TestUnitPoolReuse(t *testing.T) {
	w, name := reusePool(t)
	uid := w.sandbox(name).UID
	oldPod := w.pod(name).UID
	w.reconcile(name)
	s := w.sandbox(name)
	if w.recycled(name) || s.Annotations[v1alpha1.AnnotationPoolReset] != "req-a" || !v1alpha1.PoolLeased(s) {
		t.Fatalf("after the release: recycled %v, annotations %v", w.recycled(name), s.Annotations)
	}
	// The holder's pod went; the next pass makes the reset pod.
	if p := w.pod(name); p != nil && p.UID == oldPod && p.DeletionTimestamp.IsZero() {
		t.Fatal("the holder's pod was kept")
	}
	w.reconcile(name)
	p := w.pod(name)
	if p == nil || p.UID == oldPod || p.Annotations[v1alpha1.AnnotationPoolReset] != "req-a" {
		t.Fatalf("reset pod %+v", p)
	}
	if cmd := p.Spec.InitContainers[0].Command; !strings.Contains(strings.Join(cmd, " "), "-reset-workspace /workspace") {
		t.Fatalf("init container %q does not reset the workspace", cmd)
	}
	w.podReady(name)
	w.reconcile(name)
	s = w.sandbox(name)
	if s.UID != uid || v1alpha1.PoolLeased(s) || s.Annotations[v1alpha1.AnnotationPoolReset] != "" || s.Annotations[v1alpha1.AnnotationPoolReusedAt] == "" {
		t.Fatalf("after the reset: uid %s (was %s), annotations %v", s.UID, uid, s.Annotations)
	}
	if evs := strings.Join(w.drainEvents(), "\n"); !strings.Contains(evs, EventPoolResetStarted) || !strings.Contains(evs, EventPoolReused) {
		t.Errorf("events %q", evs)
	}
}

// A reset whose init container fails, or that takes too long, deletes
// the sandbox with an event saying why.
func TestUnitPoolResetFails(t *testing.T) {
	w, name := reusePool(t)
	w.reconcile(name)
	w.reconcile(name)
	var pod corev1.Pod
	must(t, w.c.Get(context.Background(), types.NamespacedName{Namespace: unitNS, Name: name}, &pod))
	pod.Status.InitContainerStatuses = []corev1.ContainerStatus{{Name: InstallContainerName,
		State: corev1.ContainerState{Terminated: &corev1.ContainerStateTerminated{ExitCode: 1,
			Message: "agentbox-supervisor -reset-workspace: the workspace still holds 1 entries after the reset"}}}}
	must(t, w.c.Status().Update(context.Background(), &pod))
	w.reconcile(name)
	if !w.recycled(name) {
		t.Fatal("a sandbox whose reset failed was kept")
	}
	if evs := strings.Join(w.drainEvents(), "\n"); !strings.Contains(evs, EventPoolResetFailed) || !strings.Contains(evs, "still holds 1 entries") {
		t.Errorf("events %q", evs)
	}

	w2, name2 := reusePool(t)
	w2.reconcile(name2)
	w2.clock.Step(v1alpha1.PoolResetTimeout + time.Second)
	w2.reconcile(name2)
	if !w2.recycled(name2) {
		t.Fatal("a reset past its timeout was kept")
	}
}
