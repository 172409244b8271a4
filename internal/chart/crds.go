package chart

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"io"
	"time"

	"helm.sh/helm/v3/pkg/chart"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/apis/meta/v1/unstructured"
	"k8s.io/apimachinery/pkg/runtime/schema"
	"k8s.io/apimachinery/pkg/util/wait"
	utilyaml "k8s.io/apimachinery/pkg/util/yaml"
	"k8s.io/client-go/dynamic"
)

// fieldManager owns the CRDs' fields in server-side apply.
const fieldManager = "agentbox-platform"

var crdGVR = schema.GroupVersionResource{Group: "apiextensions.k8s.io", Version: "v1", Resource: "customresourcedefinitions"}

// applyCRDs creates or updates the chart's CRDs with server-side apply.
// Helm installs crds/ only when they are missing and never upgrades them,
// which would leave a newer control plane with the old schemas. Forced
// apply takes over fields another manager (Helm, kubectl) set before.
func (c *Client) applyCRDs(ctx context.Context, ch *chart.Chart) error {
	objs, err := crdObjects(ch)
	if err != nil {
		return err
	}
	if len(objs) == 0 {
		return nil
	}
	dyn, err := dynamic.NewForConfig(c.cfg)
	if err != nil {
		return fmt.Errorf("creating Kubernetes client: %w", err)
	}
	crds := dyn.Resource(crdGVR)
	for _, obj := range objs {
		if _, err := crds.Apply(ctx, obj.GetName(), obj, metav1.ApplyOptions{FieldManager: fieldManager, Force: true}); err != nil {
			return fmt.Errorf("applying CRD %s: %w", obj.GetName(), err)
		}
	}
	// Templates and later Terraform resources use the new kinds at once; the
	// API server serves a CRD only once it is Established.
	for _, obj := range objs {
		name := obj.GetName()
		err := wait.PollUntilContextTimeout(ctx, 250*time.Millisecond, time.Minute, true, func(ctx context.Context) (bool, error) {
			live, err := crds.Get(ctx, name, metav1.GetOptions{})
			if apierrors.IsNotFound(err) {
				return false, nil
			}
			if err != nil {
				return false, err
			}
			return conditionTrue(live, "Established"), nil
		})
		if err != nil {
			return fmt.Errorf("waiting for CRD %s to be established: %w", name, err)
		}
	}
	return nil
}

func crdObjects(ch *chart.Chart) ([]*unstructured.Unstructured, error) {
	var out []*unstructured.Unstructured
	for _, crd := range ch.CRDObjects() {
		dec := utilyaml.NewYAMLOrJSONDecoder(bytes.NewReader(crd.File.Data), 4096)
		for {
			obj := &unstructured.Unstructured{}
			err := dec.Decode(&obj.Object)
			if errors.Is(err, io.EOF) {
				break
			}
			if err != nil {
				return nil, fmt.Errorf("parsing %s: %w", crd.Filename, err)
			}
			if len(obj.Object) == 0 {
				continue
			}
			out = append(out, obj)
		}
	}
	return out, nil
}

// conditionTrue reports whether status.conditions holds type t with status
// "True".
func conditionTrue(obj *unstructured.Unstructured, t string) bool {
	conds, _, _ := unstructured.NestedSlice(obj.Object, "status", "conditions")
	for _, c := range conds {
		m, ok := c.(map[string]any)
		if ok && m["type"] == t && m["status"] == "True" {
			return true
		}
	}
	return false
}
