package main

import (
	"context"
	"errors"
	"os/exec"
	"strings"
	"testing"
	"time"

	coordinationv1 "k8s.io/api/coordination/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/client-go/util/retry"

	"github.com/agentbox/terraform-provider-agentbox/internal/api/v1alpha1"
	apiclient "github.com/agentbox/terraform-provider-agentbox/internal/computeapi/client"
	"github.com/agentbox/terraform-provider-agentbox/internal/store"
)

// TestLeaderLossDrainsCalls takes the leader election Lease away from the
// real binary while a Compute API call is in flight. controller-runtime's
// manager returns at once when the Lease is lost; the binary must still
// answer the call, record it, and only then exit (non-zero, so that the
// restart rejoins the election).
func TestLeaderLossDrainsCalls(t *testing.T) {
	if testing.Short() {
		t.Skip("starts a kube-apiserver")
	}
	ctx, cancel := context.WithTimeout(context.Background(), 4*time.Minute)
	defer cancel()
	cp := startControlPlane(ctx, t, "--leader-elect")
	leaseKey := types.NamespacedName{Namespace: platformNamespace, Name: leaderElectionID}
	var lease coordinationv1.Lease
	waitFor(t, cp.exited, "the binary to hold the leader election Lease", func() bool {
		err := cp.kube.Get(ctx, leaseKey, &lease)
		return err == nil && lease.Spec.HolderIdentity != nil && *lease.Spec.HolderIdentity != ""
	})
	t.Logf("the binary leads as %s", *lease.Spec.HolderIdentity)

	// A pool with no sandboxes (and no template: nothing is ever started
	// for it) gives a pool lease that waits its whole wait_seconds and
	// then answers pool_exhausted, with no node needed.
	wp := &v1alpha1.SandboxWarmPool{ObjectMeta: metav1.ObjectMeta{Namespace: "team-a", Name: "empty"},
		Spec: v1alpha1.SandboxWarmPoolSpec{TemplateRef: v1alpha1.LocalObjectReference{Name: "none"}, Replicas: 0}}
	if err := cp.kube.Create(ctx, wp); err != nil {
		t.Fatal(err)
	}
	c := cp.client(t, "admin-token")
	waitFor(t, cp.exited, "the API to see the warm pool", func() bool {
		_, err := c.AcquirePoolLease(ctx, "team-a", "empty", apiclient.AcquireLeaseRequest{Holder: "probe", RequestID: "probe"})
		return apiclient.CodeOf(err) == apiclient.CodePoolExhausted
	})

	// The Lease is lost at the first renewal that finds another holder
	// and then fails until the renew deadline (controller-runtime's
	// defaults: retry every 2 s, deadline 10 s), so 10 to 12 s after it
	// is taken: well inside the call's wait, which the API drains.
	const waitSeconds = 20
	type answer struct {
		err      error
		took     time.Duration
		logsThen string
	}
	answered := make(chan answer, 1)
	began := time.Now()
	go func() {
		_, err := c.AcquirePoolLease(ctx, "team-a", "empty", apiclient.AcquireLeaseRequest{Holder: "run-1", RequestID: "drained", WaitSeconds: waitSeconds})
		answered <- answer{err: err, took: time.Since(began), logsThen: cp.logs.String()}
	}()
	if err := retry.RetryOnConflict(retry.DefaultRetry, func() error {
		if err := cp.kube.Get(ctx, leaseKey, &lease); err != nil {
			return err
		}
		now := metav1.NewMicroTime(time.Now())
		other, hour := "another-replica", int32(3600)
		lease.Spec.HolderIdentity, lease.Spec.LeaseDurationSeconds = &other, &hour
		lease.Spec.AcquireTime, lease.Spec.RenewTime = &now, &now
		return cp.kube.Update(ctx, &lease)
	}); err != nil {
		t.Fatalf("take the leader election Lease: %v", err)
	}
	t.Logf("took the Lease %s after the call began", time.Since(began).Round(time.Millisecond))

	var got answer
	select {
	case got = <-answered:
	case <-time.After(2 * time.Minute):
		t.Fatal("the call in flight got no answer within 2 minutes")
	}
	t.Logf("the call in flight answered after %s: %v", got.took.Round(time.Millisecond), got.err)
	if code := apiclient.CodeOf(got.err); code != apiclient.CodePoolExhausted {
		t.Errorf("the call in flight during the leader loss: %v (code %q), want pool_exhausted after its wait", got.err, code)
	}
	// The loss must have come while the call was in flight, or this test
	// shows nothing.
	if !strings.Contains(got.logsThen, "draining the calls in flight") {
		t.Errorf("the call was answered before the binary began to drain; the leader loss came too late to test anything")
	}

	select {
	case <-cp.exited:
	case <-time.After(time.Minute):
		t.Fatal("the binary did not exit within a minute of answering the drained call")
	}
	t.Logf("the binary exited %s after the call began: %v", time.Since(began).Round(time.Millisecond), cp.waitErr)
	var exitErr *exec.ExitError
	if !errors.As(cp.waitErr, &exitErr) || exitErr.ExitCode() == 0 {
		t.Errorf("exit after the leader loss: %v, want a non-zero exit status", cp.waitErr)
	}
	out := cp.logs.String()
	for _, want := range []string{"lost the leader election Lease", leaderElectionLost, "drained the Compute API"} {
		if !strings.Contains(out, want) {
			t.Errorf("the binary's output does not say %q", want)
		}
	}

	// The drained call was recorded before the audit log was closed.
	st := cp.openStore(ctx, t)
	rep, err := st.VerifyAudit(ctx)
	if err != nil || !rep.OK() {
		t.Fatalf("audit chain after exit: %+v, %v", rep, err)
	}
	page, err := st.QueryAudit(ctx, store.AuditQuery{Operation: "acquire_pool_lease", Newest: true, Limit: 1})
	if err != nil || len(page.Records) != 1 {
		t.Fatalf("newest acquire_pool_lease record after exit: %+v, %v", page.Records, err)
	}
	// Every earlier pool lease here asked for no wait; this one waited.
	if r := page.Records[0]; r.Result != string(apiclient.CodePoolExhausted) || r.Duration < (waitSeconds-1)*time.Second {
		t.Errorf("newest acquire_pool_lease record: result %q after %s, want pool_exhausted after its %d s wait", r.Result, r.Duration, waitSeconds)
	}
	t.Logf("audit chain after exit: %d records, head %s", rep.Records, rep.Head)
}
