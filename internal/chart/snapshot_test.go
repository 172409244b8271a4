package chart

import (
	"context"
	"testing"
	"time"

	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/client-go/kubernetes/fake"

	"github.com/agentbox/terraform-provider-agentbox/internal/api/v1alpha1"
	"github.com/agentbox/terraform-provider-agentbox/internal/snapshot"
	"github.com/agentbox/terraform-provider-agentbox/internal/snapshot/archive"
	"github.com/agentbox/terraform-provider-agentbox/internal/snapshot/volumesnapshot"
)

func TestSnapshotDriverOfRelease(t *testing.T) {
	for raw, want := range map[string]string{
		"": SnapshotDriverArchiveEmbedded,
		"snapshot: {archive: {embedded: {size: 1Gi}}}":                                                SnapshotDriverArchiveEmbedded,
		"snapshot: {archive: {endpoint: 'https://s3.example.com', bucket: b, credentialsSecret: s3}}": SnapshotDriverArchiveS3,
		"snapshot: {driver: volumesnapshot}":                                                          SnapshotDriverVolumeSnapshot,
	} {
		rel, err := RenderInstall(testNamespace, DefaultReleaseName, Values{Raw: raw})
		if err != nil {
			t.Fatal(err)
		}
		if got := rel.SnapshotDriver(); got != want {
			t.Errorf("values %q: driver %q, want %q", raw, got, want)
		}
	}
	// The names are those the control plane reports, from the drivers.
	emb, err := archive.New(archive.Config{Dir: "/var/lib/agentbox-snapshots"})
	if err != nil {
		t.Fatal(err)
	}
	s3, err := archive.New(archive.Config{Endpoint: "https://s3.example.com", Bucket: "snapshots", AccessKeyID: "a", SecretAccessKey: "s"})
	if err != nil {
		t.Fatal(err)
	}
	for got, want := range map[string]string{
		snapshot.ID(emb): SnapshotDriverArchiveEmbedded, snapshot.ID(s3): SnapshotDriverArchiveS3,
		snapshot.ID(volumesnapshot.New(nil, volumesnapshot.Options{})): SnapshotDriverVolumeSnapshot,
	} {
		if got != want {
			t.Errorf("a driver reports %q, the chart package says %q", got, want)
		}
	}
}

func TestReadSnapshotCheck(t *testing.T) {
	ctx := context.Background()
	cs := fake.NewClientset()
	rel, err := RenderInstall(testNamespace, DefaultReleaseName, Values{})
	if err != nil {
		t.Fatal(err)
	}
	if c, err := ReadSnapshotCheck(ctx, cs, testNamespace); c != nil || err != nil {
		t.Fatalf("without a report: %+v, %v", c, err)
	}
	if c, err := WaitSnapshotCheck(ctx, cs, rel, 1500*time.Millisecond); c != nil || err != nil {
		t.Fatalf("waiting without a report: %+v, %v", c, err)
	}
	cm := &corev1.ConfigMap{ObjectMeta: metav1.ObjectMeta{Namespace: testNamespace, Name: v1alpha1.ControlPlaneStatusConfigMap}, Data: map[string]string{
		v1alpha1.StatusKeySnapshotDriver: SnapshotDriverArchiveEmbedded, v1alpha1.StatusKeySnapshotReady: "false",
		v1alpha1.StatusKeySnapshotReason: v1alpha1.ReasonSnapshotStoreUnavailable, v1alpha1.StatusKeySnapshotMessage: "not writable",
		v1alpha1.StatusKeySnapshotCheckedAt: "2030-01-02T03:04:05Z", v1alpha1.StatusKeyReportedBy: "agentbox-controlplane-1",
	}}
	if _, err := cs.CoreV1().ConfigMaps(testNamespace).Create(ctx, cm, metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	c, err := ReadSnapshotCheck(ctx, cs, testNamespace)
	if err != nil || c == nil || c.Ready || c.Reason != v1alpha1.ReasonSnapshotStoreUnavailable || c.Message != "not writable" ||
		!c.CheckedAt.Equal(time.Date(2030, 1, 2, 3, 4, 5, 0, time.UTC)) || c.Live || c.Current(rel) {
		t.Fatalf("report of a pod that is gone: %+v, %v", c, err)
	}
	pod := &corev1.Pod{ObjectMeta: metav1.ObjectMeta{Namespace: testNamespace, Name: "agentbox-controlplane-1"}}
	if _, err := cs.CoreV1().Pods(testNamespace).Create(ctx, pod, metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	if c, err := WaitSnapshotCheck(ctx, cs, rel, time.Minute); err != nil || !c.Current(rel) {
		t.Fatalf("report of the running pod: %+v, %v", c, err)
	}
	other, err := RenderInstall(testNamespace, DefaultReleaseName, Values{Raw: "snapshot: {driver: volumesnapshot}"})
	if err != nil {
		t.Fatal(err)
	}
	if c.Current(other) {
		t.Error("a report about another driver counts as current")
	}
}
