package computeapi

import (
	"context"
	"errors"
	"fmt"
	"net/http"
	"strings"
	"testing"
	"time"

	coordinationv1 "k8s.io/api/coordination/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/utils/ptr"
	"sigs.k8s.io/controller-runtime/pkg/client"

	"github.com/agentbox/terraform-provider-agentbox/internal/api/v1alpha1"
	api "github.com/agentbox/terraform-provider-agentbox/internal/computeapi/client"
)

// The Compute API's side of node loss: a sandbox in Error/NodeLost is woken
// by the call, which waits for the resume; every other Error fails at once.
// The controller's side has its own tests; here a stand-in plays it.

var sb1 = client.ObjectKey{Namespace: "team-a", Name: "sb-1"}

// setStatus replaces sb-1's status with what mutate makes of a copy of it.
func (f *fixture) setStatus(t *testing.T, mutate func(*v1alpha1.SandboxStatus)) {
	t.Helper()
	var sb v1alpha1.Sandbox
	if err := f.kube.Get(context.Background(), sb1, &sb); err != nil {
		t.Fatal(err)
	}
	mutate(&sb.Status)
	if err := f.kube.Status().Update(context.Background(), &sb); err != nil {
		t.Fatal(err)
	}
}

func (f *fixture) renewTime(t *testing.T) metav1.MicroTime {
	t.Helper()
	var l coordinationv1.Lease
	if err := f.kube.Get(context.Background(), sb1, &l); err != nil {
		t.Fatal(err)
	}
	return *l.Spec.RenewTime
}

// lostNode puts the sandbox into Error/NodeLost, as the controller does,
// with the Lease's current renewTime as the activity before the loss.
func lostNode(st *v1alpha1.SandboxStatus, renew metav1.MicroTime) {
	st.Phase = v1alpha1.SandboxPhaseError
	st.ServiceEndpoint = ""
	st.Conditions[0].Status = metav1.ConditionFalse
	st.Conditions[0].Reason = v1alpha1.ReasonNodeLost
	st.Conditions[0].Message = "node kwok-1, where the sandbox ran, no longer exists"
	st.NodeLoss = &v1alpha1.SandboxNodeLoss{NodeName: "kwok-1", Time: metav1.Now(), ActivityTime: ptr.To(renew), WorkspaceLost: true}
}

// renewedPast waits, for at most two seconds, until the Lease's renewTime
// differs from than, and returns it.
func (f *fixture) renewedPast(than metav1.MicroTime) (metav1.MicroTime, error) {
	deadline := time.Now().Add(2 * time.Second)
	for time.Now().Before(deadline) {
		var l coordinationv1.Lease
		if err := f.kube.Get(context.Background(), sb1, &l); err != nil {
			return metav1.MicroTime{}, err
		}
		if !l.Spec.RenewTime.Equal(&than) {
			return *l.Spec.RenewTime, nil
		}
		time.Sleep(10 * time.Millisecond)
	}
	return metav1.MicroTime{}, errors.New("the call did not renew the Lease")
}

// resume is the stand-in controller's last step: the sandbox runs again.
func (f *fixture) resume(running v1alpha1.SandboxStatus) error {
	var cur v1alpha1.Sandbox
	if err := f.kube.Get(context.Background(), sb1, &cur); err != nil {
		return err
	}
	cur.Status = running
	return f.kube.Status().Update(context.Background(), &cur)
}

// A call to a sandbox that lost its node renews its Lease, which is what
// resumes it, waits, and is served once it runs on another node.
func TestNodeLostSandboxIsWokenAndServed(t *testing.T) {
	f := newFixture(t, "")
	ctx := context.Background()
	c := f.client(t, adminToken)
	var sb v1alpha1.Sandbox
	if err := f.kube.Get(ctx, sb1, &sb); err != nil {
		t.Fatal(err)
	}
	running := *sb.Status.DeepCopy()
	before := f.renewTime(t)
	f.setStatus(t, func(st *v1alpha1.SandboxStatus) { lostNode(st, before) })
	f.clock.Step(time.Second)

	resumed := make(chan error, 1)
	go func() {
		if _, err := f.renewedPast(before); err != nil {
			resumed <- err
			return
		}
		resumed <- f.resume(running)
	}()
	res, err := c.RunCommand(ctx, "agent-1", api.RunCommandRequest{Command: []string{"true"}})
	if rerr := <-resumed; rerr != nil {
		t.Fatal(rerr)
	}
	if err != nil || res.ExitCode != 0 {
		t.Fatalf("call on a sandbox whose node was lost: %+v, %v; want it served after the resume", res, err)
	}
}

// A node lost while a call waits for the sandbox to start (it was resuming
// on that node) parks the sandbox until activity after the loss. The
// waiting call's first renewal came before it, so the call renews again,
// once, and is served from the other node.
func TestNodeLostWhileWaitingIsWokenAgain(t *testing.T) {
	f := newFixture(t, "")
	ctx := context.Background()
	c := f.client(t, adminToken)
	var sb v1alpha1.Sandbox
	if err := f.kube.Get(ctx, sb1, &sb); err != nil {
		t.Fatal(err)
	}
	running := *sb.Status.DeepCopy()
	f.setStatus(t, func(st *v1alpha1.SandboxStatus) {
		st.Phase = v1alpha1.SandboxPhaseResuming
		st.ServiceEndpoint = ""
		st.Conditions[0].Status = metav1.ConditionFalse
		st.Conditions[0].Reason = v1alpha1.ReasonResuming
	})
	before := f.renewTime(t)
	f.clock.Step(time.Second)

	resumed := make(chan error, 1)
	go func() {
		// The call's first renewal: the resume goes on, onto a node that
		// is then lost, after that renewal.
		first, err := f.renewedPast(before)
		if err != nil {
			resumed <- err
			return
		}
		f.clock.Step(time.Second)
		var sb v1alpha1.Sandbox
		if err := f.kube.Get(ctx, sb1, &sb); err != nil {
			resumed <- err
			return
		}
		lostNode(&sb.Status, first)
		if err := f.kube.Status().Update(ctx, &sb); err != nil {
			resumed <- err
			return
		}
		// Parked until activity after the loss: only a second renewal
		// resumes it.
		if _, err := f.renewedPast(first); err != nil {
			resumed <- fmt.Errorf("after the loss: %w", err)
			return
		}
		resumed <- f.resume(running)
	}()
	res, err := c.RunCommand(ctx, "agent-1", api.RunCommandRequest{Command: []string{"true"}})
	if rerr := <-resumed; rerr != nil {
		t.Fatal(rerr)
	}
	if err != nil || res.ExitCode != 0 {
		t.Fatalf("call while the node was lost: %+v, %v; want it served after the resume elsewhere", res, err)
	}
}

// Every other Error needs a person: the call fails at once, saying why,
// and does not touch the Lease.
func TestOtherErrorsFailAtOnce(t *testing.T) {
	for _, reason := range []string{v1alpha1.ReasonRestoreFailed, v1alpha1.ReasonOwnershipConflict, v1alpha1.ReasonPodFailed} {
		t.Run(reason, func(t *testing.T) {
			f := newFixture(t, "")
			f.setStatus(t, func(st *v1alpha1.SandboxStatus) {
				st.Phase = v1alpha1.SandboxPhaseError
				st.ServiceEndpoint = ""
				st.Conditions[0].Status = metav1.ConditionFalse
				st.Conditions[0].Reason = reason
				st.Conditions[0].Message = "what went wrong"
			})
			before := f.renewTime(t)
			f.clock.Step(time.Minute)
			_, err := f.client(t, adminToken).RunCommand(context.Background(), "agent-1", api.RunCommandRequest{Command: []string{"true"}})
			e := wantAPIError(t, err, api.CodeSandboxNotReady, http.StatusConflict)
			if e.Details["phase"] != "Error" || e.Details["reason"] != reason || !strings.Contains(e.Message, "what went wrong") {
				t.Errorf("error = %+v", e)
			}
			if strings.Contains(e.Message, "waited") {
				t.Errorf("the call waited for a sandbox that needs a person: %s", e.Message)
			}
			if after := f.renewTime(t); !after.Equal(&before) {
				t.Errorf("the call renewed the Lease (%s -> %s) of a sandbox that no activity can start", before, after)
			}
		})
	}
}

// An idle stop that failed after its pod was gone (SyncFailed,
// SnapshotFailed) leaves the sandbox waiting for activity, like a lost
// node: the call renews the Lease, which starts it again on its kept
// workspace claim, and is served once it runs.
func TestFailedStopIsWokenAndServed(t *testing.T) {
	for _, reason := range []string{v1alpha1.ReasonSyncFailed, v1alpha1.ReasonSnapshotFailed} {
		t.Run(reason, func(t *testing.T) {
			f := newFixture(t, "")
			ctx := context.Background()
			c := f.client(t, adminToken)
			var sb v1alpha1.Sandbox
			if err := f.kube.Get(ctx, sb1, &sb); err != nil {
				t.Fatal(err)
			}
			running := *sb.Status.DeepCopy()
			before := f.renewTime(t)
			f.setStatus(t, func(st *v1alpha1.SandboxStatus) {
				st.Phase = v1alpha1.SandboxPhaseError
				st.ServiceEndpoint = ""
				st.Conditions[0].Status = metav1.ConditionFalse
				st.Conditions[0].Reason = reason
				st.Conditions[0].Message = "the pod is stopped, the workspace claim is kept, and the next activity starts the sandbox again"
			})
			f.clock.Step(time.Second)
			resumed := make(chan error, 1)
			go func() {
				if _, err := f.renewedPast(before); err != nil {
					resumed <- err
					return
				}
				resumed <- f.resume(running)
			}()
			res, err := c.RunCommand(ctx, "agent-1", api.RunCommandRequest{Command: []string{"true"}})
			if rerr := <-resumed; rerr != nil {
				t.Fatal(rerr)
			}
			if err != nil || res.ExitCode != 0 {
				t.Fatalf("call on a sandbox in Error/%s: %+v, %v; want it served after the restart", reason, res, err)
			}
		})
	}
}
