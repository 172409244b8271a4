package chart

import (
	"context"
	"fmt"
	"time"

	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/client-go/kubernetes"

	"github.com/agentbox/terraform-provider-agentbox/internal/api/v1alpha1"
)

// Snapshot drivers as the control plane reports them and snapshots record
// them (the snapshot package's ID of each driver).
const (
	SnapshotDriverVolumeSnapshot  = "volumesnapshot"
	SnapshotDriverArchiveS3       = "archive/s3"
	SnapshotDriverArchiveEmbedded = "archive/embedded"
)

// SnapshotDriver is the snapshot driver the release's values select: the
// archive driver's embedded store unless snapshot.archive.endpoint names
// an S3 store, or the volumesnapshot driver.
func (r *Release) SnapshotDriver() string {
	switch d := r.stringValue("archive", "snapshot", "driver"); {
	case d != "archive":
		return d
	case r.stringValue("", "snapshot", "archive", "endpoint") != "":
		return SnapshotDriverArchiveS3
	default:
		return SnapshotDriverArchiveEmbedded
	}
}

// SnapshotCheck is the control plane's report of its snapshot check, from
// the ConfigMap v1alpha1.ControlPlaneStatusConfigMap.
type SnapshotCheck struct {
	// Driver is the driver the control plane runs.
	Driver string
	// Ready: the driver can take and restore snapshots. When it cannot,
	// sandboxes are not idle-stopped.
	Ready bool
	// Reason is one of the v1alpha1 snapshot check reasons; Message says
	// what is wrong and how to fix it.
	Reason, Message string
	CheckedAt       time.Time
	// ReportedBy is the control plane pod that wrote the report; Live says
	// whether it still runs (exists and is not being deleted), so that the
	// report is not that of a replaced control plane.
	ReportedBy string
	Live       bool
}

// Current reports whether the check is the running control plane's
// report about the release's driver.
func (c *SnapshotCheck) Current(rel *Release) bool {
	return c != nil && c.Live && c.Driver == rel.SnapshotDriver()
}

// ReadSnapshotCheck reads the control plane's report of its snapshot
// check; nil when there is none (yet).
func ReadSnapshotCheck(ctx context.Context, cs kubernetes.Interface, namespace string) (*SnapshotCheck, error) {
	cm, err := cs.CoreV1().ConfigMaps(namespace).Get(ctx, v1alpha1.ControlPlaneStatusConfigMap, metav1.GetOptions{})
	if apierrors.IsNotFound(err) {
		return nil, nil
	}
	if err != nil {
		return nil, fmt.Errorf("reading ConfigMap %s/%s: %w", namespace, v1alpha1.ControlPlaneStatusConfigMap, err)
	}
	d := cm.Data
	c := &SnapshotCheck{
		Driver: d[v1alpha1.StatusKeySnapshotDriver], Ready: d[v1alpha1.StatusKeySnapshotReady] == "true",
		Reason: d[v1alpha1.StatusKeySnapshotReason], Message: d[v1alpha1.StatusKeySnapshotMessage],
		ReportedBy: d[v1alpha1.StatusKeyReportedBy],
	}
	c.CheckedAt, _ = time.Parse(time.RFC3339, d[v1alpha1.StatusKeySnapshotCheckedAt])
	if c.ReportedBy != "" {
		pod, err := cs.CoreV1().Pods(namespace).Get(ctx, c.ReportedBy, metav1.GetOptions{})
		switch {
		case apierrors.IsNotFound(err):
		case err != nil:
			return nil, fmt.Errorf("reading the control plane pod %s/%s: %w", namespace, c.ReportedBy, err)
		default:
			c.Live = pod.DeletionTimestamp == nil
		}
	}
	return c, nil
}

// WaitSnapshotCheck waits, up to timeout, for the running control plane of
// rel to report its snapshot check, and returns the last report it read
// (nil when there was none). The control plane checks at start, so after
// an install or upgrade that waited for it this takes seconds.
func WaitSnapshotCheck(ctx context.Context, cs kubernetes.Interface, rel *Release, timeout time.Duration) (*SnapshotCheck, error) {
	ctx, cancel := context.WithTimeout(ctx, timeout)
	defer cancel()
	tick := time.NewTicker(time.Second)
	defer tick.Stop()
	var last *SnapshotCheck
	for {
		c, err := ReadSnapshotCheck(ctx, cs, rel.Namespace)
		if err != nil && ctx.Err() == nil {
			return nil, err
		}
		if c != nil {
			last = c
		}
		if last.Current(rel) {
			return last, nil
		}
		select {
		case <-ctx.Done():
			return last, nil
		case <-tick.C:
		}
	}
}
