package computeapi

import (
	"context"
	"net/http"
	"testing"
	"time"

	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"

	"github.com/agentbox/terraform-provider-agentbox/internal/api/v1alpha1"
	api "github.com/agentbox/terraform-provider-agentbox/internal/computeapi/client"
	"github.com/agentbox/terraform-provider-agentbox/internal/computeapi/holds"
)

func pythonTemplate(idle time.Duration) *v1alpha1.SandboxTemplate {
	return &v1alpha1.SandboxTemplate{ObjectMeta: metav1.ObjectMeta{Namespace: "team-a", Name: "python"},
		Spec: v1alpha1.SandboxTemplateSpec{IdleTimeout: metav1.Duration{Duration: idle}}}
}

// TestTerminateWithoutSnapshotDeletesTheSandbox: the sandbox is gone, and
// the agent has none afterwards.
func TestTerminateWithoutSnapshotDeletesTheSandbox(t *testing.T) {
	f := newFixture(t, "")
	c := f.client(t, adminToken)
	ctx := context.Background()

	_, err := c.Terminate(ctx, "agent-1", api.TerminateRequest{Reason: "   "})
	wantAPIError(t, err, api.CodeInvalidArgument, http.StatusBadRequest)
	_, err = c.Terminate(ctx, "agent-404", api.TerminateRequest{Reason: "x"})
	wantAPIError(t, err, api.CodeSandboxNotFound, http.StatusNotFound)

	res, err := c.Terminate(ctx, "agent-1", api.TerminateRequest{Reason: "agent retired"})
	if err != nil {
		t.Fatal(err)
	}
	t.Logf("terminate: %+v", *res)
	if res.Action != api.TerminateDeleted || res.Reason != "agent retired" || res.Status.Name != "sb-1" || res.Status.AgentID != "agent-1" {
		t.Fatalf("result %+v", res)
	}
	var list v1alpha1.SandboxList
	if err := f.kube.List(ctx, &list); err != nil {
		t.Fatal(err)
	}
	if len(list.Items) != 0 {
		t.Fatalf("%d sandboxes left after terminate", len(list.Items))
	}
	_, err = c.Status(ctx, "agent-1")
	wantAPIError(t, err, api.CodeSandboxNotFound, http.StatusNotFound)
	// A retry finds nothing to terminate.
	_, err = c.Terminate(ctx, "agent-1", api.TerminateRequest{Reason: "agent retired"})
	wantAPIError(t, err, api.CodeSandboxNotFound, http.StatusNotFound)
}

// TestTerminateWithSnapshotMakesTheSandboxIdle: the activity clock is set
// back by the idle timeout, so the controller runs its idle stop now, and
// an exclusive hold is released; the Sandbox itself is not written.
func TestTerminateWithSnapshotMakesTheSandboxIdle(t *testing.T) {
	f := newFixture(t, "", pythonTemplate(30*time.Minute))
	c := f.client(t, adminToken)
	ctx := context.Background()
	acquire(t, c, "worker-1", "req-1", 600)
	var before v1alpha1.Sandbox
	if err := f.kube.Get(ctx, holds.ActivityLeaseKey(readySandbox("team-a", "sb-1", "agent-1", "")), &before); err != nil {
		t.Fatal(err)
	}

	res, err := c.Terminate(ctx, "agent-1", api.TerminateRequest{Reason: "quota exceeded", Snapshot: true})
	if err != nil {
		t.Fatal(err)
	}
	t.Logf("terminate: %+v", *res)
	if res.Action != api.TerminateStopping || res.Status.Phase != string(v1alpha1.SandboxPhaseRunning) {
		t.Fatalf("result %+v", res)
	}
	l := f.lease(t)
	renew := l.Spec.RenewTime.Time
	idleFor := f.clock.Now().Sub(renew)
	t.Logf("lease renewTime %s, idle for %s", renew.Format(time.RFC3339Nano), idleFor)
	if idleFor < 30*time.Minute {
		t.Fatalf("the sandbox is idle for %s only, below its 30m timeout", idleFor)
	}
	if holder, _ := v1alpha1.LeaseHoldExpiry(&l.Spec); holder != "" || l.Annotations[v1alpha1.AnnotationLeaseID] != "" ||
		l.Annotations[v1alpha1.AnnotationLeaseReleasedRequestID] != "req-1" {
		t.Fatalf("hold not released: holder %q, annotations %v", holder, l.Annotations)
	}
	var after v1alpha1.Sandbox
	if err := f.kube.Get(ctx, holds.ActivityLeaseKey(readySandbox("team-a", "sb-1", "agent-1", "")), &after); err != nil {
		t.Fatal(err)
	}
	if after.ResourceVersion != before.ResourceVersion {
		t.Fatal("terminate wrote the Sandbox")
	}
}

// TestTerminateWithSnapshotNeedsTheTemplate: without it the controller
// would not stop the sandbox, so the call says so instead of pretending.
func TestTerminateWithSnapshotNeedsTheTemplate(t *testing.T) {
	f := newFixture(t, "")
	c := f.client(t, adminToken)
	before := f.leaseRenewTime(t)
	_, err := c.Terminate(context.Background(), "agent-1", api.TerminateRequest{Reason: "x", Snapshot: true})
	wantAPIError(t, err, api.CodeSandboxNotReady, http.StatusConflict)
	if got := f.leaseRenewTime(t); !got.Equal(before) {
		t.Fatalf("a refused terminate moved renewTime from %s to %s", before, got)
	}
}
