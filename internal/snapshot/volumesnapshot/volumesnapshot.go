// Package volumesnapshot is the snapshot driver for clusters with CSI
// snapshots: a stopped sandbox's workspace is a snapshot.storage.k8s.io/v1
// VolumeSnapshot of its claim, and a resumed sandbox's new claim is
// provisioned from it through the claim's dataSourceRef. The CSI driver and
// external-snapshotter do the copying; this package only creates, watches
// and deletes the API objects.
//
// The client must know the snapshot types: register them with AddToScheme
// (which also registers the agentbox types, needed for owner references).
package volumesnapshot

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"time"

	snapshotv1 "github.com/kubernetes-csi/external-snapshotter/client/v6/apis/volumesnapshot/v1"
	corev1 "k8s.io/api/core/v1"
	storagev1 "k8s.io/api/storage/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	"k8s.io/apimachinery/pkg/api/meta"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/runtime"
	"k8s.io/apimachinery/pkg/runtime/schema"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/utils/ptr"
	"sigs.k8s.io/controller-runtime/pkg/client"
	"sigs.k8s.io/controller-runtime/pkg/controller/controllerutil"

	"github.com/agentbox/terraform-provider-agentbox/internal/api/v1alpha1"
	"github.com/agentbox/terraform-provider-agentbox/internal/snapshot"
)

// Name is the driver's name as the chart selects it.
const Name = "volumesnapshot"

// APIGroup is the group of VolumeSnapshots, as a claim's dataSourceRef
// names it.
const APIGroup = snapshotv1.GroupName

// Defaults for Options.
const (
	DefaultErrorGrace = 2 * time.Minute
	DefaultCutTimeout = 10 * time.Minute
)

// AddToScheme registers the VolumeSnapshot types and the agentbox types the
// driver needs (owner references name the Sandbox's kind).
func AddToScheme(s *runtime.Scheme) error {
	return errors.Join(snapshotv1.AddToScheme(s), v1alpha1.AddToScheme(s))
}

// Options tune when a snapshot that is not ready is given up on.
//
// external-snapshotter retries everything: the snapshot-controller requeues
// a VolumeSnapshot whose class or claim is missing, and the CSI sidecar
// retries CreateSnapshot, with backoff, on every error. So an error on a
// VolumeSnapshot is never final by itself, and a snapshot whose driver has
// no sidecar in the cluster reports no error at all: it stays unready
// forever. The driver therefore judges by time, measured from the
// VolumeSnapshot's creation so that the verdict survives a restart of the
// control plane:
//
//   - an error still reported ErrorGrace after creation, on a snapshot that
//     is not ready, is final (a missing or mistyped class, a claim that is
//     gone or unbound, a CSI driver refusing the request);
//   - a snapshot not yet cut (no status.creationTime: no CSI driver has
//     taken it) CutTimeout after creation is final (a class naming a driver
//     that is not installed, a sidecar that is down).
//
// A snapshot that has been cut but is not ready yet is still being
// processed (uploaded, for cloud disks); it is waited for without a limit
// as long as it reports no lasting error. The controller's own stop
// deadline, if any, bounds that.
type Options struct {
	// Class is the VolumeSnapshotClass of templates that name none; ""
	// leaves the choice to the cluster's default class.
	Class string
	// ErrorGrace defaults to DefaultErrorGrace.
	ErrorGrace time.Duration
	// CutTimeout defaults to DefaultCutTimeout.
	CutTimeout time.Duration
	// Now is the clock (tests); nil means time.Now.
	Now func() time.Time
	// APIReader, when set, reads VolumeSnapshotClasses and StorageClasses
	// straight from the API server, for Check and for a look before each
	// VolumeSnapshot is created: a class that does not exist, or cannot
	// snapshot the claim's volume, then fails the snapshot at once instead
	// of after ErrorGrace or CutTimeout. It needs get and list on both.
	APIReader client.Reader
}

// Driver takes workspace snapshots as VolumeSnapshots.
type Driver struct {
	c    client.Client
	opts Options
}

var (
	_ snapshot.Driver  = (*Driver)(nil)
	_ snapshot.Checker = (*Driver)(nil)
)

// New returns a driver that uses c, whose scheme must include AddToScheme's
// types. It needs get, create and delete on volumesnapshots, and get on
// persistentvolumeclaims.
func New(c client.Client, opts Options) *Driver {
	if opts.ErrorGrace <= 0 {
		opts.ErrorGrace = DefaultErrorGrace
	}
	if opts.CutTimeout <= 0 {
		opts.CutTimeout = DefaultCutTimeout
	}
	if opts.Now == nil {
		opts.Now = time.Now
	}
	return &Driver{c: c, opts: opts}
}

// Name implements snapshot.Driver.
func (d *Driver) Name() string { return Name }

// Take implements snapshot.Driver: it creates VolumeSnapshot req.Name of
// the claim on the first call and reports its state on every call.
func (d *Driver) Take(ctx context.Context, req snapshot.Request) (snapshot.State, error) {
	if req.Sandbox == nil || req.Name == "" || req.ClaimName == "" {
		return snapshot.State{}, fmt.Errorf("volumesnapshot: a request needs a sandbox, a claim and a snapshot name")
	}
	ns := req.Sandbox.Namespace
	vs := &snapshotv1.VolumeSnapshot{}
	err := d.c.Get(ctx, types.NamespacedName{Namespace: ns, Name: req.Name}, vs)
	if apierrors.IsNotFound(err) {
		return d.create(ctx, req)
	}
	if err != nil {
		return snapshot.State{}, fmt.Errorf("get VolumeSnapshot %s/%s: %w", ns, req.Name, err)
	}
	return d.state(vs, req)
}

func (d *Driver) create(ctx context.Context, req snapshot.Request) (snapshot.State, error) {
	ns := req.Sandbox.Namespace
	// A missing claim would only surface later as an error on the
	// VolumeSnapshot; say it now. The claim is looked at only before the
	// snapshot exists: once it does, the controller may already have
	// deleted the claim and be calling again after a restart.
	claim := &corev1.PersistentVolumeClaim{}
	if err := d.c.Get(ctx, types.NamespacedName{Namespace: ns, Name: req.ClaimName}, claim); err != nil {
		if apierrors.IsNotFound(err) {
			return snapshot.State{Failed: fmt.Sprintf("workspace claim %s/%s does not exist", ns, req.ClaimName)}, nil
		}
		return snapshot.State{}, fmt.Errorf("get workspace claim %s/%s: %w", ns, req.ClaimName, err)
	}
	if d.opts.APIReader != nil {
		// Before anything is created, so that the stop is abandoned with
		// the reason rather than left to a snapshot that never cuts.
		if err := d.checkClass(ctx, d.className(req.Template), ptr.Deref(claim.Spec.StorageClassName, "")); err != nil {
			return snapshot.State{}, err
		}
	}
	vs := &snapshotv1.VolumeSnapshot{
		ObjectMeta: metav1.ObjectMeta{
			Name:      req.Name,
			Namespace: ns,
			Labels:    map[string]string{v1alpha1.LabelSandbox: req.Sandbox.Name},
		},
		Spec: snapshotv1.VolumeSnapshotSpec{
			Source: snapshotv1.VolumeSnapshotSource{PersistentVolumeClaimName: ptr.To(req.ClaimName)},
		},
	}
	if class := d.className(req.Template); class != "" {
		vs.Spec.VolumeSnapshotClassName = ptr.To(class)
	}
	// Owned by the Sandbox, so that deleting the Sandbox collects its
	// snapshots (and, with a Delete class, their storage).
	if err := controllerutil.SetControllerReference(req.Sandbox, vs, d.c.Scheme()); err != nil {
		return snapshot.State{}, fmt.Errorf("own VolumeSnapshot %s/%s: %w", ns, req.Name, err)
	}
	if err := d.c.Create(ctx, vs); err != nil {
		if apierrors.IsAlreadyExists(err) {
			// Another call (or a previous life of the controller) won the
			// race; report on the one that exists.
			return d.Take(ctx, req)
		}
		return snapshot.State{}, fmt.Errorf("create VolumeSnapshot %s/%s: %w", ns, req.Name, err)
	}
	return snapshot.State{}, nil
}

// className is the VolumeSnapshotClass of a template's snapshots: its own,
// else the driver's, else "" for the cluster's default.
func (d *Driver) className(tpl *v1alpha1.SandboxTemplate) string {
	if tpl != nil && tpl.Spec.Workspace.VolumeSnapshotClassName != nil {
		return *tpl.Spec.Workspace.VolumeSnapshotClassName
	}
	return d.opts.Class
}

// Annotations that mark default classes.
const (
	defaultSnapshotClassAnnotation = "snapshot.storage.kubernetes.io/is-default-class"
	defaultStorageClassAnnotation  = "storageclass.kubernetes.io/is-default-class"
	defaultStorageClassBeta        = "storageclass.beta.kubernetes.io/is-default-class"
)

// Check implements snapshot.Checker: the cluster serves VolumeSnapshots
// (the RESTMapper knows the kind) and the class the driver uses exists and
// can snapshot volumes of the default StorageClass, when there is one.
// Templates that name their own classes are checked when their snapshots
// are taken.
func (d *Driver) Check(ctx context.Context) error {
	for _, kind := range []string{"VolumeSnapshot", "VolumeSnapshotClass"} {
		if _, err := d.c.RESTMapper().RESTMapping(schema.GroupKind{Group: APIGroup, Kind: kind}, snapshotv1.SchemeGroupVersion.Version); err != nil {
			if meta.IsNoMatchError(err) {
				return &snapshot.Problem{Reason: v1alpha1.ReasonSnapshotAPIMissing, Message: fmt.Sprintf(
					"the cluster does not serve %s/%s %s: the CSI snapshot CRDs and the snapshot-controller are not installed", APIGroup, snapshotv1.SchemeGroupVersion.Version, kind)}
			}
			return fmt.Errorf("look up the %s kind: %w", kind, err)
		}
	}
	if d.opts.APIReader == nil {
		return nil
	}
	return d.checkClass(ctx, d.opts.Class, "")
}

// checkClass checks that class (or, for "", a default class) exists and
// that its CSI driver provisions storageClass ("" for the default
// StorageClass), when the StorageClass and its provisioner can be known.
func (d *Driver) checkClass(ctx context.Context, class, storageClass string) error {
	r := d.opts.APIReader
	provisioner, scName, err := d.provisioner(ctx, storageClass)
	if err != nil {
		return err
	}
	var chosen *snapshotv1.VolumeSnapshotClass
	if class != "" {
		var vsc snapshotv1.VolumeSnapshotClass
		err := r.Get(ctx, types.NamespacedName{Name: class}, &vsc)
		switch {
		case apierrors.IsNotFound(err):
			return &snapshot.Problem{Reason: v1alpha1.ReasonVolumeSnapshotClassNotFound, Message: fmt.Sprintf("VolumeSnapshotClass %s does not exist", class)}
		case meta.IsNoMatchError(err):
			return &snapshot.Problem{Reason: v1alpha1.ReasonSnapshotAPIMissing, Message: "the cluster does not serve VolumeSnapshotClasses: the CSI snapshot CRDs are not installed"}
		case err != nil:
			return fmt.Errorf("get VolumeSnapshotClass %s: %w", class, err)
		}
		chosen = &vsc
	} else {
		var list snapshotv1.VolumeSnapshotClassList
		if err := r.List(ctx, &list); err != nil {
			if meta.IsNoMatchError(err) {
				return &snapshot.Problem{Reason: v1alpha1.ReasonSnapshotAPIMissing, Message: "the cluster does not serve VolumeSnapshotClasses: the CSI snapshot CRDs are not installed"}
			}
			return fmt.Errorf("list VolumeSnapshotClasses: %w", err)
		}
		// The snapshot-controller picks the default class of the
		// volume's CSI driver, and refuses when there are several.
		var defaults []string
		for i := range list.Items {
			c := &list.Items[i]
			if c.Annotations[defaultSnapshotClassAnnotation] != "true" || (provisioner != "" && c.Driver != provisioner) {
				continue
			}
			defaults = append(defaults, c.Name)
			chosen = c
		}
		switch {
		case len(defaults) == 0 && provisioner != "":
			return &snapshot.Problem{Reason: v1alpha1.ReasonVolumeSnapshotClassNotFound, Message: fmt.Sprintf(
				"no VolumeSnapshotClass is configured and none is the default (annotation %s=true) for CSI driver %s, the provisioner of StorageClass %s",
				defaultSnapshotClassAnnotation, provisioner, scName)}
		case len(defaults) == 0:
			return &snapshot.Problem{Reason: v1alpha1.ReasonVolumeSnapshotClassNotFound, Message: fmt.Sprintf(
				"no VolumeSnapshotClass is configured and none is the default (annotation %s=true)", defaultSnapshotClassAnnotation)}
		case len(defaults) > 1 && provisioner != "":
			return &snapshot.Problem{Reason: v1alpha1.ReasonVolumeSnapshotClassNotFound, Message: fmt.Sprintf(
				"VolumeSnapshotClasses %s are all the default for CSI driver %s; the snapshot-controller refuses to choose, so configure one",
				strings.Join(defaults, ", "), provisioner)}
		}
	}
	if provisioner != "" && chosen.Driver != provisioner {
		return &snapshot.Problem{Reason: v1alpha1.ReasonVolumeSnapshotClassMismatch, Message: fmt.Sprintf(
			"VolumeSnapshotClass %s is for CSI driver %s, but the workspaces' StorageClass %s is provisioned by %s",
			chosen.Name, chosen.Driver, scName, provisioner)}
	}
	return nil
}

// provisioner returns the provisioner of StorageClass name, or of the
// default StorageClass for "", with the class's name; "" when it cannot
// be known (no default, or a claim bound without a class).
func (d *Driver) provisioner(ctx context.Context, name string) (string, string, error) {
	r := d.opts.APIReader
	if name != "" {
		var sc storagev1.StorageClass
		if err := r.Get(ctx, types.NamespacedName{Name: name}, &sc); err != nil {
			if apierrors.IsNotFound(err) {
				return "", name, nil
			}
			return "", name, fmt.Errorf("get StorageClass %s: %w", name, err)
		}
		return sc.Provisioner, name, nil
	}
	var list storagev1.StorageClassList
	if err := r.List(ctx, &list); err != nil {
		return "", "", fmt.Errorf("list StorageClasses: %w", err)
	}
	var found *storagev1.StorageClass
	for i := range list.Items {
		sc := &list.Items[i]
		if sc.Annotations[defaultStorageClassAnnotation] == "true" || sc.Annotations[defaultStorageClassBeta] == "true" {
			if found != nil {
				// Several defaults: the API server picks the newest; the
				// check does not guess.
				return "", "", nil
			}
			found = sc
		}
	}
	if found == nil {
		return "", "", nil
	}
	return found.Provisioner, found.Name, nil
}

// state reads a VolumeSnapshot's status as the controller needs it.
func (d *Driver) state(vs *snapshotv1.VolumeSnapshot, req snapshot.Request) (snapshot.State, error) {
	src := vs.Spec.Source.PersistentVolumeClaimName
	if src == nil || *src != req.ClaimName || !metav1.IsControlledBy(vs, req.Sandbox) {
		// The name is taken by a snapshot of something else; waiting cannot
		// make it this sandbox's.
		return snapshot.State{Failed: fmt.Sprintf("VolumeSnapshot %s/%s exists but is not sandbox %s's snapshot of claim %s",
			vs.Namespace, vs.Name, req.Sandbox.Name, req.ClaimName)}, nil
	}
	if vs.DeletionTimestamp != nil {
		return snapshot.State{}, fmt.Errorf("VolumeSnapshot %s/%s is being deleted; it is made again once it is gone", vs.Namespace, vs.Name)
	}
	st := vs.Status
	if st != nil && ptr.Deref(st.ReadyToUse, false) {
		out := snapshot.State{Ready: true}
		if st.RestoreSize != nil {
			out.SizeBytes = st.RestoreSize.Value()
		}
		if st.CreationTime != nil {
			out.ReadyTime = st.CreationTime.Time
		}
		return out, nil
	}
	// The API server always sets the creation time; without one (a fake
	// client) there is nothing to judge by, so keep waiting.
	var age time.Duration
	if !vs.CreationTimestamp.IsZero() {
		age = d.opts.Now().Sub(vs.CreationTimestamp.Time)
	}
	if st != nil && st.Error != nil && age >= d.opts.ErrorGrace {
		msg := ptr.Deref(st.Error.Message, "no message")
		return snapshot.State{Failed: fmt.Sprintf("VolumeSnapshot %s/%s still reports an error %s after it was created: %s",
			vs.Namespace, vs.Name, age.Round(time.Second), msg)}, nil
	}
	if (st == nil || st.CreationTime == nil) && age >= d.opts.CutTimeout {
		return snapshot.State{Failed: fmt.Sprintf("no CSI driver took VolumeSnapshot %s/%s within %s (class %s): is the class's driver installed with its snapshotter sidecar?",
			vs.Namespace, vs.Name, d.opts.CutTimeout, className(vs))}, nil
	}
	return snapshot.State{}, nil
}

func className(vs *snapshotv1.VolumeSnapshot) string {
	if vs.Spec.VolumeSnapshotClassName == nil {
		return "default"
	}
	return *vs.Spec.VolumeSnapshotClassName
}

// PrepareClaim implements snapshot.Driver: the claim is provisioned from
// the VolumeSnapshot. Both dataSource and dataSourceRef are set, to the same
// object, as the API server itself mirrors them; clusters without the
// AnyVolumeDataSource behaviour still read dataSource.
func (d *Driver) PrepareClaim(snap *v1alpha1.SandboxSnapshot, claim *corev1.PersistentVolumeClaim) {
	if snap == nil || snap.Name == "" || claim == nil {
		return
	}
	group := APIGroup
	claim.Spec.DataSource = &corev1.TypedLocalObjectReference{APIGroup: &group, Kind: "VolumeSnapshot", Name: snap.Name}
	claim.Spec.DataSourceRef = &corev1.TypedObjectReference{APIGroup: ptr.To(group), Kind: "VolumeSnapshot", Name: snap.Name}
}

// Restore implements snapshot.Driver: the volume already holds the data.
func (d *Driver) Restore(context.Context, snapshot.RestoreRequest) error { return nil }

// Delete implements snapshot.Driver. With a Delete class the CSI driver
// then removes the stored snapshot too.
func (d *Driver) Delete(ctx context.Context, sandbox *v1alpha1.Sandbox, name string) error {
	vs := &snapshotv1.VolumeSnapshot{ObjectMeta: metav1.ObjectMeta{Namespace: sandbox.Namespace, Name: name}}
	if err := d.c.Delete(ctx, vs); err != nil && !apierrors.IsNotFound(err) {
		return fmt.Errorf("delete VolumeSnapshot %s/%s: %w", sandbox.Namespace, name, err)
	}
	return nil
}
