package controller

import (
	"context"
	"errors"
	"strings"
	"testing"
	"time"

	"github.com/go-logr/logr"
	appsv1 "k8s.io/api/apps/v1"
	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	k8sruntime "k8s.io/apimachinery/pkg/runtime"
	"k8s.io/apimachinery/pkg/types"
	clientgoscheme "k8s.io/client-go/kubernetes/scheme"
	"k8s.io/client-go/tools/events"
	clocktesting "k8s.io/utils/clock/testing"
	"sigs.k8s.io/controller-runtime/pkg/client/fake"

	"github.com/agentbox/terraform-provider-agentbox/internal/api/v1alpha1"
	"github.com/agentbox/terraform-provider-agentbox/internal/snapshot"
)

// checkedDriver is a recordingDriver whose Check answers what the test
// sets: the real drivers' checks have their own tests.
type checkedDriver struct {
	recordingDriver
	err error
}

func (d *checkedDriver) Check(context.Context) error { return d.err }

func TestUnitSnapshotCheckPublishes(t *testing.T) {
	scheme := k8sruntime.NewScheme()
	must(t, clientgoscheme.AddToScheme(scheme))
	deploy := &appsv1.Deployment{ObjectMeta: metav1.ObjectMeta{Name: "agentbox-controlplane", Namespace: "agentbox-system", UID: "uid-deploy"}}
	c := fake.NewClientBuilder().WithScheme(scheme).WithObjects(deploy).Build()
	rec := events.NewFakeRecorder(10)
	clk := clocktesting.NewFakeClock(time.Now())
	drv := &checkedDriver{err: &snapshot.Problem{Reason: v1alpha1.ReasonSnapshotAPIMissing, Message: "the cluster does not serve VolumeSnapshots"}}
	check := &SnapshotCheck{
		Driver: drv, Client: c, Reader: c, Recorder: rec, Namespace: "agentbox-system", Deployment: "agentbox-controlplane",
		PodName: "agentbox-controlplane-abc", Hint: func(p *snapshot.Problem) string { return "install the snapshot CRDs" },
		Log: logr.Discard(), Clock: clk,
	}
	ctx := context.Background()
	cm := func() *corev1.ConfigMap {
		t.Helper()
		var cm corev1.ConfigMap
		must(t, c.Get(ctx, types.NamespacedName{Namespace: "agentbox-system", Name: v1alpha1.ControlPlaneStatusConfigMap}, &cm))
		return &cm
	}
	drain := func() []string {
		var out []string
		for {
			select {
			case e := <-rec.Events:
				out = append(out, e)
			default:
				return out
			}
		}
	}

	if check.Problem() != nil {
		t.Fatal("a problem before the first check")
	}
	check.RunOnce(ctx)
	p := check.Problem()
	if p == nil || p.Reason != v1alpha1.ReasonSnapshotAPIMissing || !strings.Contains(p.Message, "install the snapshot CRDs") {
		t.Fatalf("Problem() = %+v; want the driver's, with the fix", p)
	}
	got := cm()
	if d := got.Data; d[v1alpha1.StatusKeySnapshotDriver] != "recording" || d[v1alpha1.StatusKeySnapshotReady] != "false" ||
		d[v1alpha1.StatusKeySnapshotReason] != v1alpha1.ReasonSnapshotAPIMissing || !strings.Contains(d[v1alpha1.StatusKeySnapshotMessage], "install the snapshot CRDs") ||
		d[v1alpha1.StatusKeyReportedBy] != "agentbox-controlplane-abc" || d[v1alpha1.StatusKeySnapshotCheckedAt] == "" {
		t.Fatalf("ConfigMap data %v", d)
	}
	if refs := got.OwnerReferences; len(refs) != 1 || refs[0].UID != "uid-deploy" {
		t.Errorf("owners %+v; want the Deployment", refs)
	}
	if evs := drain(); len(evs) != 1 || !strings.HasPrefix(evs[0], "Warning "+EventSnapshotCheckFailed) {
		t.Errorf("events %q", evs)
	}

	// The same result again: no event, no write.
	rv := got.ResourceVersion
	clk.Step(time.Minute)
	check.RunOnce(ctx)
	if cm().ResourceVersion != rv || len(drain()) != 0 {
		t.Error("an unchanged result was published again")
	}
	// Until it is old: then checkedAt moves, still without an event.
	clk.Step(snapshotCheckRepublish)
	check.RunOnce(ctx)
	if cm().ResourceVersion == rv || len(drain()) != 0 {
		t.Error("an old result was not refreshed, or was announced again")
	}

	// Fixed: stops may go, and the ConfigMap and an event say so.
	drv.err = nil
	check.RunOnce(ctx)
	if check.Problem() != nil || cm().Data[v1alpha1.StatusKeySnapshotReady] != "true" || cm().Data[v1alpha1.StatusKeySnapshotReason] != v1alpha1.ReasonSnapshotDriverReady {
		t.Fatalf("after the fix: problem %+v, data %v", check.Problem(), cm().Data)
	}
	if evs := drain(); len(evs) != 1 || !strings.HasPrefix(evs[0], "Normal "+EventSnapshotCheckPassed) {
		t.Errorf("events %q", evs)
	}

	// A check that cannot run is reported but holds nothing back.
	drv.err = errors.New("the server is currently unable to handle the request")
	check.RunOnce(ctx)
	if check.Problem() != nil || cm().Data[v1alpha1.StatusKeySnapshotReason] != v1alpha1.ReasonSnapshotCheckFailed {
		t.Fatalf("check that could not run: problem %+v, data %v", check.Problem(), cm().Data)
	}
}
