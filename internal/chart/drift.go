package chart

import (
	"context"
	"fmt"
	"sort"
	"strings"

	"helm.sh/helm/v3/pkg/releaseutil"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	"k8s.io/apimachinery/pkg/api/meta"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/apis/meta/v1/unstructured"
	"k8s.io/client-go/dynamic"
	"k8s.io/client-go/rest"
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
}

func (d DriftItem) String() string {
	name := d.Name
	if d.Namespace != "" {
		name = d.Namespace + "/" + name
	}
	return fmt.Sprintf("%s %s %s", d.Kind, name, d.Reason)
}

// Reasons of DriftItem.
const (
	ReasonMissing  = "is missing"
	ReasonDeleting = "is being deleted"
)

// LiveDrift compares the objects of rel (its manifest and its chart's CRDs)
// with the cluster and reports those that are missing or being deleted. An
// upgrade to the same values creates them again.
//
// Only presence is compared for now. Reporting changed fields as well needs
// to ignore what controllers and admission legitimately set (defaults,
// status, the ClusterIP, replicas under an autoscaler); that comes with
// issue 8, which will extend this function rather than add another.
func LiveDrift(ctx context.Context, cfg *rest.Config, rel *Release) ([]DriftItem, error) {
	objs, err := manifestObjects(rel.Manifest)
	if err != nil {
		return nil, err
	}
	for _, name := range rel.CRDs {
		crd := &unstructured.Unstructured{}
		crd.SetAPIVersion("apiextensions.k8s.io/v1")
		crd.SetKind("CustomResourceDefinition")
		crd.SetName(name)
		objs = append(objs, crd)
	}

	getter := newRESTClientGetter(cfg, rel.Namespace)
	mapper, err := getter.ToRESTMapper()
	if err != nil {
		return nil, fmt.Errorf("discovering the cluster's kinds: %w", err)
	}
	dyn, err := dynamic.NewForConfig(getter.cfg)
	if err != nil {
		return nil, fmt.Errorf("creating Kubernetes client: %w", err)
	}

	var drift []DriftItem
	for _, obj := range objs {
		gvk := obj.GroupVersionKind()
		item := DriftItem{APIVersion: obj.GetAPIVersion(), Kind: gvk.Kind, Name: obj.GetName()}
		mapping, err := mapper.RESTMapping(gvk.GroupKind(), gvk.Version)
		if meta.IsNoMatchError(err) {
			// The kind itself is gone (its CRD or API group was removed).
			item.Namespace = obj.GetNamespace()
			item.Reason = ReasonMissing
			drift = append(drift, item)
			continue
		}
		if err != nil {
			return nil, fmt.Errorf("mapping %s: %w", gvk, err)
		}
		var ri dynamic.ResourceInterface = dyn.Resource(mapping.Resource)
		if mapping.Scope.Name() == meta.RESTScopeNameNamespace {
			item.Namespace = obj.GetNamespace()
			if item.Namespace == "" {
				item.Namespace = rel.Namespace
			}
			ri = dyn.Resource(mapping.Resource).Namespace(item.Namespace)
		}
		live, err := ri.Get(ctx, obj.GetName(), metav1.GetOptions{})
		switch {
		case apierrors.IsNotFound(err):
			item.Reason = ReasonMissing
		case err != nil:
			return nil, fmt.Errorf("reading %s: %w", item, err)
		case live.GetDeletionTimestamp() != nil:
			item.Reason = ReasonDeleting
		default:
			continue
		}
		drift = append(drift, item)
	}
	sort.Slice(drift, func(i, j int) bool { return drift[i].String() < drift[j].String() })
	return drift, nil
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
