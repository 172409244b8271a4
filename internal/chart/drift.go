package chart

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"reflect"
	"regexp"
	"sort"
	"strings"

	"helm.sh/helm/v3/pkg/releaseutil"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	"k8s.io/apimachinery/pkg/api/meta"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/apis/meta/v1/unstructured"
	"k8s.io/apimachinery/pkg/runtime"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/client-go/dynamic"
	"k8s.io/client-go/rest"
	"k8s.io/utils/ptr"
	"sigs.k8s.io/yaml"
)

// DriftItem is an object of a release whose live state differs from what the
// release installed.
type DriftItem struct {
	APIVersion string
	Kind       string
	Namespace  string // empty for cluster-scoped objects
	Name       string
	// Reason says what differs, for example "is missing".
	Reason string
	// Fields are the paths of the fields that differ, for an object that
	// was changed out of band (see ReasonChanged); Reason names the first
	// few.
	Fields []string
}

func (d DriftItem) String() string { return d.object() + " " + d.Reason }

// object names the object as "<kind> <namespace>/<name>".
func (d DriftItem) object() string {
	name := d.Name
	if d.Namespace != "" {
		name = d.Namespace + "/" + name
	}
	return d.Kind + " " + name
}

// Reasons of DriftItem. ReasonChanged and ReasonRejected are followed by a
// colon and the fields that differ, or the API server's message.
const (
	ReasonMissing  = "is missing"
	ReasonDeleting = "is being deleted"
	ReasonChanged  = "changed out of band"
	// ReasonRejected is an object the API server will not update to the
	// release's version, typically because an immutable field differs.
	// The upgrade fails the same way, which is the point of reporting it:
	// the object must be deleted, or the release changed.
	ReasonRejected = "rejects the release's version"
)

// driftFieldManager names the dry runs of LiveDrift; they persist nothing.
const driftFieldManager = "agentbox-drift"

// maxReasonFields is how many field paths a Reason names: enough to say
// what happened without turning a plan into a diff.
const maxReasonFields = 3

// LiveDrift compares the objects of rel (its manifest and its chart's CRDs)
// with the cluster and reports those that are missing, being deleted, or
// (manifest objects only) changed out of band in fields the release sets.
// An upgrade to the same values restores them: Helm's three-way merge
// patches every field where the live object differs from the manifest.
//
// How "changed" is decided: each object is applied to the cluster with a
// server-side apply dry run, and the result is compared with the live
// object. A comparison of the manifest's fields with the live ones would
// have to redo what the API server does on every write: defaulting,
// normalization (quantities, int or float, empty or omitted), and mutating
// admission webhooks, which rewrite fields the manifest sets (an image
// mirror policy, for one) and would show as perpetual drift. The dry run is
// the API server's own answer to "would applying the release change this
// object?", and it leaves alone whatever the release does not set (labels
// and annotations others add, the ClusterIP, status), so only fields the
// manifest sets can differ. Fields that legitimately change after install
// are taken out of both sides first; see ignoredFields.
//
// A dry run needs the rights of a real write, and not every object can be
// applied. Where the API server refuses or fails the dry run (credentials
// that may only read, a webhook that does not support dry runs or is down,
// an object server-side apply cannot express, such as extraEnv repeating a
// variable of the chart), that object is checked for presence only: a
// refresh must not fail over what the upgrade, with Helm's patches, may
// well do.
func LiveDrift(ctx context.Context, cfg *rest.Config, rel *Release) ([]DriftItem, error) {
	objs, err := manifestObjects(rel.Manifest)
	if err != nil {
		return nil, err
	}
	objs, presenceOnly := withCRDs(objs, rel.CRDs)
	d, err := newDriftChecker(cfg, rel.Namespace, presenceOnly)
	if err != nil {
		return nil, err
	}
	var drift []DriftItem
	for _, obj := range objs {
		item, err := d.check(ctx, obj)
		if err != nil {
			return nil, err
		}
		if item != nil {
			drift = append(drift, *item)
		}
	}
	sort.Slice(drift, func(i, j int) bool { return drift[i].String() < drift[j].String() })
	return drift, nil
}

// withCRDs adds the release's CRDs to objs, marked as compared for
// presence only. They are cluster-wide and shared by every platform in the
// cluster, whose providers may embed other chart versions and each apply
// their own; comparing fields would have two such platforms upgrade each
// other on every run.
func withCRDs(objs []*unstructured.Unstructured, crds []string) ([]*unstructured.Unstructured, map[*unstructured.Unstructured]bool) {
	presenceOnly := map[*unstructured.Unstructured]bool{}
	for _, name := range crds {
		crd := &unstructured.Unstructured{}
		crd.SetAPIVersion("apiextensions.k8s.io/v1")
		crd.SetKind("CustomResourceDefinition")
		crd.SetName(name)
		objs = append(objs, crd)
		presenceOnly[crd] = true
	}
	return objs, presenceOnly
}

// driftChecker compares the release's objects with the cluster's, one at
// a time.
type driftChecker struct {
	mapper       meta.RESTMapper
	dyn          dynamic.Interface
	cl           *cluster
	namespace    string
	presenceOnly map[*unstructured.Unstructured]bool
}

func newDriftChecker(cfg *rest.Config, namespace string, presenceOnly map[*unstructured.Unstructured]bool) (*driftChecker, error) {
	getter := newRESTClientGetter(cfg, namespace)
	mapper, err := getter.ToRESTMapper()
	if err != nil {
		return nil, fmt.Errorf("discovering the cluster's kinds: %w", err)
	}
	dyn, err := dynamic.NewForConfig(getter.cfg)
	if err != nil {
		return nil, fmt.Errorf("creating Kubernetes client: %w", err)
	}
	return &driftChecker{mapper: mapper, dyn: dyn, cl: &cluster{dyn: dyn}, namespace: namespace, presenceOnly: presenceOnly}, nil
}

// check returns how obj drifted, or nil if it did not.
func (d *driftChecker) check(ctx context.Context, obj *unstructured.Unstructured) (*DriftItem, error) {
	gvk := obj.GroupVersionKind()
	item := &DriftItem{APIVersion: obj.GetAPIVersion(), Kind: gvk.Kind, Name: obj.GetName()}
	mapping, err := d.mapper.RESTMapping(gvk.GroupKind(), gvk.Version)
	if meta.IsNoMatchError(err) {
		// The kind itself is gone (its CRD or API group was removed).
		item.Namespace = obj.GetNamespace()
		item.Reason = ReasonMissing
		return item, nil
	}
	if err != nil {
		return nil, fmt.Errorf("mapping %s: %w", gvk, err)
	}
	var ri dynamic.ResourceInterface = d.dyn.Resource(mapping.Resource)
	if mapping.Scope.Name() == meta.RESTScopeNameNamespace {
		item.Namespace = obj.GetNamespace()
		if item.Namespace == "" {
			item.Namespace = d.namespace
		}
		ri = d.dyn.Resource(mapping.Resource).Namespace(item.Namespace)
	}
	live, err := ri.Get(ctx, obj.GetName(), metav1.GetOptions{})
	switch {
	case apierrors.IsNotFound(err):
		item.Reason = ReasonMissing
	case err != nil:
		return nil, fmt.Errorf("reading %s: %w", item.object(), err)
	case live.GetDeletionTimestamp() != nil:
		item.Reason = ReasonDeleting
	case d.presenceOnly[obj]:
		return nil, nil
	default:
		return d.compare(ctx, ri, obj, live, item)
	}
	return item, nil
}

// compare dry-runs obj over live and fills item in with the fields that
// would change; nil when none would, or the dry run could not say.
func (d *driftChecker) compare(ctx context.Context, ri dynamic.ResourceInterface, obj, live *unstructured.Unstructured, item *DriftItem) (*DriftItem, error) {
	want := obj.DeepCopy()
	want.SetNamespace(item.Namespace)
	fields, err := changedFields(ctx, ri, d.cl, want, live)
	var status apierrors.APIStatus
	switch {
	case apierrors.IsInvalid(err) && errors.As(err, &status):
		item.Reason = ReasonRejected + ": " + shorten(status.Status().Message, 200)
	case dryRunRefused(err):
		return nil, nil
	case err != nil:
		return nil, fmt.Errorf("comparing %s with the release: %w", item.object(), err)
	case len(fields) == 0:
		return nil, nil
	default:
		item.Fields = fields
		item.Reason = ReasonChanged + ": " + fieldList(fields)
	}
	return item, nil
}

// changedFields returns the paths of the fields of live that applying want
// would change, leaving out ignored fields.
func changedFields(ctx context.Context, ri dynamic.ResourceInterface, cl *cluster, want, live *unstructured.Unstructured) ([]string, error) {
	ignored, err := ignoredPaths(ctx, cl, want)
	if err != nil {
		return nil, err
	}
	for _, p := range ignored {
		removeField(want.Object, p)
	}
	for attempt := 1; ; attempt++ {
		// The dry run must start from the very object it is compared with:
		// a controller writing in between (the volume binder filling a new
		// claim in) would otherwise show its own fields as the release's.
		// The resourceVersion makes the apply a precondition on live.
		want.SetResourceVersion(live.GetResourceVersion())
		body, err := want.MarshalJSON()
		if err != nil {
			return nil, fmt.Errorf("encoding %s %s: %w", want.GetKind(), want.GetName(), err)
		}
		// Helm writes these objects with patches, not with server-side
		// apply, so the manager's name does not matter: it owns nothing, and
		// forcing makes the dry run take every field the manifest sets and
		// leave every other field alone.
		applied, err := ri.Patch(ctx, want.GetName(), types.ApplyPatchType, body, metav1.PatchOptions{
			DryRun:       []string{metav1.DryRunAll},
			FieldManager: driftFieldManager,
			Force:        ptr.To(true),
		})
		if apierrors.IsConflict(err) && attempt < maxDryRunAttempts {
			if live, err = ri.Get(ctx, want.GetName(), metav1.GetOptions{}); err != nil {
				return nil, fmt.Errorf("reading %s %s again: %w", want.GetKind(), want.GetName(), err)
			}
			continue
		}
		if err != nil {
			return nil, err
		}
		return diffObjects(live.Object, applied.Object, ignored), nil
	}
}

// maxDryRunAttempts bounds how often changedFields reads an object that
// keeps changing under it before it gives up with the conflict.
const maxDryRunAttempts = 5

// dryRunRefused reports whether err means the API server did not do the
// dry run, as opposed to finding the object invalid. Server-side apply
// reports objects it cannot merge (duplicate list keys) as internal errors,
// and so are failing webhooks.
func dryRunRefused(err error) bool {
	return apierrors.IsForbidden(err) || apierrors.IsMethodNotSupported(err) || apierrors.IsBadRequest(err) ||
		apierrors.IsUnsupportedMediaType(err) || apierrors.IsInternalError(err)
}

// diffObjects returns the paths where after differs from before, leaving out
// what the server owns (see serverFields), status, and the ignored paths.
func diffObjects(before, after map[string]any, ignored [][]string) []string {
	b, a := comparable(before, ignored), comparable(after, ignored)
	var out []string
	diffValues(b, a, "", &out)
	return out
}

// serverFields are metadata the API server maintains on every write. The
// dry run bumps some of them (resourceVersion, generation, managedFields),
// so they differ although nothing the release sets does.
var serverFields = []string{"resourceVersion", "generation", "managedFields", "uid", "creationTimestamp", "selfLink"}

// comparable is obj without server-owned metadata, status and ignored paths.
func comparable(obj map[string]any, ignored [][]string) map[string]any {
	c := runtime.DeepCopyJSON(obj)
	delete(c, "status")
	if md, ok := c["metadata"].(map[string]any); ok {
		for _, f := range serverFields {
			delete(md, f)
		}
	}
	for _, p := range ignored {
		removeField(c, p)
	}
	return c
}

// diffValues appends to out the paths below path where a and b differ. A
// subtree that differs as a whole (present on one side only, another type,
// a list of another length) is one path.
func diffValues(a, b any, path string, out *[]string) {
	switch av := a.(type) {
	case map[string]any:
		bv, ok := b.(map[string]any)
		if !ok {
			*out = append(*out, path)
			return
		}
		keys := make([]string, 0, len(av)+len(bv))
		for k := range av {
			keys = append(keys, k)
		}
		for k := range bv {
			if _, dup := av[k]; !dup {
				keys = append(keys, k)
			}
		}
		sort.Strings(keys)
		for _, k := range keys {
			diffValues(av[k], bv[k], joinPath(path, k), out)
		}
	case []any:
		bv, ok := b.([]any)
		if !ok || len(av) != len(bv) {
			*out = append(*out, path)
			return
		}
		for i := range av {
			diffValues(av[i], bv[i], fmt.Sprintf("%s[%d]", path, i), out)
		}
	default:
		if !sameScalar(a, b) {
			*out = append(*out, path)
		}
	}
}

// sameScalar compares JSON scalars; numbers by value, because a decoder may
// give 1 as an int64 on one side and a float64 on the other.
func sameScalar(a, b any) bool {
	if fa, ok := number(a); ok {
		fb, ok := number(b)
		return ok && fa == fb
	}
	return reflect.DeepEqual(a, b)
}

func number(v any) (float64, bool) {
	switch n := v.(type) {
	case int64:
		return float64(n), true
	case int:
		return float64(n), true
	case int32:
		return float64(n), true
	case float64:
		return n, true
	case json.Number:
		f, err := n.Float64()
		return f, err == nil
	}
	return 0, false
}

var plainKey = regexp.MustCompile(`^[A-Za-z0-9_-]+$`)

// joinPath writes keys with dots or slashes (labels, annotations, Secret
// keys) in brackets, so that the path stays readable.
func joinPath(path, key string) string {
	if !plainKey.MatchString(key) {
		return path + "[" + key + "]"
	}
	if path == "" {
		return key
	}
	return path + "." + key
}

func fieldList(fields []string) string {
	if len(fields) <= maxReasonFields {
		return strings.Join(fields, ", ")
	}
	return fmt.Sprintf("%s and %d more", strings.Join(fields[:maxReasonFields], ", "), len(fields)-maxReasonFields)
}

func shorten(s string, n int) string {
	if len(s) <= n {
		return s
	}
	return s[:n] + "..."
}

// removeField deletes the field at path from obj, and the maps that held
// only it: an empty map left behind in an apply would claim the map.
func removeField(obj map[string]any, path []string) {
	if len(path) == 0 {
		return
	}
	if len(path) == 1 {
		delete(obj, path[0])
		return
	}
	child, ok := obj[path[0]].(map[string]any)
	if !ok {
		return
	}
	removeField(child, path[1:])
	if len(child) == 0 {
		delete(obj, path[0])
	}
}

// manifestObjects parses a release manifest into its objects, in Helm's
// install order.
func manifestObjects(manifest string) ([]*unstructured.Unstructured, error) {
	docs := releaseutil.SplitManifests(manifest)
	keys := make([]string, 0, len(docs))
	for k := range docs {
		keys = append(keys, k)
	}
	sort.Sort(releaseutil.BySplitManifestsOrder(keys))
	var out []*unstructured.Unstructured
	for _, k := range keys {
		doc := strings.TrimSpace(docs[k])
		if doc == "" {
			continue
		}
		obj := &unstructured.Unstructured{}
		if err := yaml.Unmarshal([]byte(doc), &obj.Object); err != nil {
			return nil, fmt.Errorf("parsing the release manifest: %w", err)
		}
		if len(obj.Object) == 0 || obj.GetKind() == "" {
			continue
		}
		out = append(out, obj)
	}
	return out, nil
}
