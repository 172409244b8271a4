// Package snapshot defines how a stopped sandbox's workspace is kept: the
// Driver interface the sandbox controller drives at idle stop and resume.
// Implementations live in the sub-packages, one per storage backend
// (volumesnapshot for CSI clusters, archive for clusters without CSI
// snapshots), so the controller depends on none of their clients.
package snapshot

import (
	"context"
	"errors"
	"time"

	corev1 "k8s.io/api/core/v1"

	"github.com/agentbox/terraform-provider-agentbox/internal/api/v1alpha1"
	"github.com/agentbox/terraform-provider-agentbox/internal/supervisor/supervisorapi"
)

// Driver takes workspace snapshots and brings them back.
//
// Every method may be called again after a crash of the control plane at any
// point, so each must be idempotent on the snapshot name it is given.
type Driver interface {
	// Name is the driver's name as the chart selects it: "volumesnapshot"
	// or "archive".
	Name() string

	// Take starts, or checks on, snapshot req.Name of the workspace claim
	// req.ClaimName. The controller calls it repeatedly until the result
	// is Ready or Failed; the pod is still running, and its supervisor has
	// flushed the workspace. A transient problem is returned as an error
	// (the controller retries); a snapshot that can never become ready is
	// reported as Failed.
	Take(ctx context.Context, req Request) (State, error)

	// PrepareClaim changes a new workspace claim, before it is created, so
	// that it starts with the snapshot's contents when the driver restores
	// through the volume (a dataSource). Drivers that restore through the
	// supervisor leave it alone.
	PrepareClaim(snap *v1alpha1.SandboxSnapshot, claim *corev1.PersistentVolumeClaim)

	// Restore fills the workspace of a resumed sandbox whose pod is ready,
	// before the sandbox takes calls. Drivers that restore through the
	// volume do nothing.
	Restore(ctx context.Context, req RestoreRequest) error

	// Delete removes snapshot name of the sandbox, once a newer one is ready
	// or the sandbox is gone. A snapshot that does not exist is not an
	// error.
	Delete(ctx context.Context, sandbox *v1alpha1.Sandbox, name string) error
}

// Request asks for one snapshot.
type Request struct {
	// Sandbox being stopped; drivers own snapshots through it.
	Sandbox *v1alpha1.Sandbox
	// Template the sandbox runs; its workspace spec names the
	// VolumeSnapshotClass.
	Template *v1alpha1.SandboxTemplate
	// ClaimName is the workspace PersistentVolumeClaim.
	ClaimName string
	// Name the snapshot gets; the same on every call for one stop.
	Name string
	// Supervisor of the running pod, for drivers that read the workspace
	// through it.
	Supervisor *supervisorapi.Client
}

// State is where a snapshot stands.
type State struct {
	// Ready: the snapshot can be restored from; the claim may be deleted.
	Ready bool
	// Failed is set when the snapshot can never become ready; it says why.
	Failed string
	// SizeBytes is the snapshot's size when the storage reports one.
	SizeBytes int64
	// ReadyTime is when it became ready, when the storage reports it.
	ReadyTime time.Time
}

// RestoreRequest asks to fill a resumed sandbox's workspace.
type RestoreRequest struct {
	Sandbox    *v1alpha1.Sandbox
	Snapshot   *v1alpha1.SandboxSnapshot
	Supervisor *supervisorapi.Client
}

// ErrNotFound is returned, wrapped, by Restore when the snapshot is gone
// from the store: retrying cannot help.
var ErrNotFound = errors.New("snapshot not found")

// StoreNamer is implemented by drivers that keep snapshots in more than
// one kind of store (the archive driver: an S3 bucket or the embedded
// directory). A snapshot in one cannot be restored from another.
type StoreNamer interface {
	Store() string
}

// ID identifies what took a snapshot, so that a resume can tell that the
// driver has changed since: the driver's name, followed by "/" and its
// store for a driver with several ("volumesnapshot", "archive/s3",
// "archive/embedded").
func ID(d Driver) string {
	if d == nil {
		return ""
	}
	if s, ok := d.(StoreNamer); ok && s.Store() != "" {
		return d.Name() + "/" + s.Store()
	}
	return d.Name()
}

// Checker is implemented by drivers that can tell whether they can work in
// the cluster they run in. The control plane checks at start and then
// periodically, reports the result, and does not begin idle stops while
// the check fails.
type Checker interface {
	// Check returns nil when the driver can take and restore snapshots,
	// a *Problem when it cannot, and another error when it could not
	// find out (the API server did not answer, say).
	Check(ctx context.Context) error
}

// Problem says why a driver cannot work.
type Problem struct {
	// Reason is a CamelCase word, one of the snapshot check reasons
	// documented in the v1alpha1 package.
	Reason string
	// Message says what is wrong, in the driver's terms.
	Message string
}

func (p *Problem) Error() string { return p.Message }
