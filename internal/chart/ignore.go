package chart

import (
	"context"
	"fmt"

	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/apis/meta/v1/unstructured"
	"k8s.io/apimachinery/pkg/runtime/schema"
	"k8s.io/client-go/dynamic"
)

// ignoredField is a field of release objects that LiveDrift does not
// compare, because something other than the release legitimately owns it
// after install. Reporting it would plan an upgrade on every run that
// either changes nothing or fights the rightful owner.
type ignoredField struct {
	Kind string
	// Name limits the rule to one object; empty means every object of Kind.
	Name string
	Path []string
	// When, if set, limits the rule to objects for which it returns true.
	When func(ctx context.Context, cl *cluster, obj *unstructured.Unstructured) (bool, error)
	Why  string
}

// ignoredFields is the one list of what LiveDrift ignores. It was drawn up
// from every kind the chart renders (TestDriftReviewedKinds fails when a
// template brings a new kind, so that it gets reviewed here too):
//
//   - Deployment, DaemonSet: the controllers write status, revision
//     annotations and the pod template hash only where the manifest sets
//     nothing; spec.replicas is the exception, below.
//   - Service: the ClusterIP, node ports and IP families are allocated
//     where the manifest sets nothing.
//   - ServiceAccount: token controllers (OpenShift's, for one) add secrets
//     and imagePullSecrets, which the manifest does not set.
//   - ClusterRole, ClusterRoleBinding, Role, RoleBinding: nothing writes
//     them; the chart's ClusterRole has no aggregationRule.
//   - Namespace (the runsc installer's): the API server adds the
//     kubernetes.io/metadata.name label and the kubernetes finalizer where
//     the manifest sets nothing. Its Pod Security labels are the chart's:
//     a change to them is drift.
//   - PodDisruptionBudget: the disruption controller writes status only.
//   - NetworkPolicy: nothing writes it.
//   - Secret, PersistentVolumeClaim: below.
//
// The chart's CRDs are left out altogether (presence is still checked):
// they are shared by every platform in the cluster, and another platform's
// provider legitimately applies its own chart's version of them.
//
// The chart has no webhook configurations or APIServices, so there is no
// injected caBundle, and the control plane writes none of these objects (it
// reads the agentbox-api Service and mounts the Secrets). Everything the
// server defaults is the same on both sides of the dry run and needs no rule.
var ignoredFields = []ignoredField{
	{
		Kind: "Deployment", Path: []string{"spec", "replicas"}, When: autoscaled,
		Why: "a HorizontalPodAutoscaler (KEDA's included) that targets the Deployment owns its scale; " +
			"without one, `kubectl scale` is drift like any other change",
	},
	{
		Kind: "Secret", Name: DefaultCASecret, Path: []string{"data"},
		Why: "the chart looks the generated CA up and renders what the cluster holds, so the live data is " +
			"what an upgrade applies: replacing it in the cluster is how it is rotated, not drift",
	},
	{
		Kind: "Secret", Name: DefaultAdminTokenSecret, Path: []string{"data"},
		Why: "looked up like the CA: replacing the token in the cluster is how it is rotated",
	},
	{
		Kind: "PersistentVolumeClaim", Path: []string{"spec", "resources", "requests", "storage"},
		Why: "a claim may be expanded in place but never shrunk, so an upgrade could not restore a smaller " +
			"size, only fail; expanding the store volume by hand is legitimate",
	},
}

// ignoredPaths returns the paths of ignoredFields that apply to obj.
func ignoredPaths(ctx context.Context, cl *cluster, obj *unstructured.Unstructured) ([][]string, error) {
	var out [][]string
	for _, f := range ignoredFields {
		if f.Kind != obj.GetKind() || (f.Name != "" && f.Name != obj.GetName()) {
			continue
		}
		if f.When != nil {
			ok, err := f.When(ctx, cl, obj)
			if err != nil {
				return nil, err
			}
			if !ok {
				continue
			}
		}
		out = append(out, f.Path)
	}
	return out, nil
}

// cluster answers the questions of ignoredFields' conditions, once per
// LiveDrift.
type cluster struct {
	dyn dynamic.Interface
	// scaled holds, per namespace, the Deployments an autoscaler targets.
	scaled map[string]map[string]bool
}

var hpaGVR = schema.GroupVersionResource{Group: "autoscaling", Version: "v2", Resource: "horizontalpodautoscalers"}

// autoscaled reports whether a HorizontalPodAutoscaler targets the
// Deployment obj. When the autoscalers cannot be listed it answers yes:
// missing `kubectl scale` is better than fighting an autoscaler forever.
func autoscaled(ctx context.Context, cl *cluster, obj *unstructured.Unstructured) (bool, error) {
	ns := obj.GetNamespace()
	if cl.scaled == nil {
		cl.scaled = map[string]map[string]bool{}
	}
	names, ok := cl.scaled[ns]
	if !ok {
		list, err := cl.dyn.Resource(hpaGVR).Namespace(ns).List(ctx, metav1.ListOptions{})
		switch {
		case apierrors.IsForbidden(err):
			names = nil
		case apierrors.IsNotFound(err):
			names = map[string]bool{}
		case err != nil:
			return false, fmt.Errorf("listing HorizontalPodAutoscalers in %s: %w", ns, err)
		default:
			names = map[string]bool{}
			for _, hpa := range list.Items {
				ref, _, _ := unstructured.NestedStringMap(hpa.Object, "spec", "scaleTargetRef")
				gv, err := schema.ParseGroupVersion(ref["apiVersion"])
				if err == nil && gv.Group == "apps" && ref["kind"] == "Deployment" {
					names[ref["name"]] = true
				}
			}
		}
		cl.scaled[ns] = names
	}
	if names == nil {
		return true, nil
	}
	return names[obj.GetName()], nil
}
