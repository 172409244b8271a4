package chart

import (
	"context"
	"testing"
	"time"

	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/apis/meta/v1/unstructured"
	"k8s.io/apimachinery/pkg/runtime/schema"
	"k8s.io/client-go/dynamic"
)

// TestDriftNotFromAWriteInBetween writes a field the release does not set
// between reading an object and comparing it, as the volume binder does to
// a claim the apply has just created. That write is not drift: it must not
// show as a field the release would change.
func TestDriftNotFromAWriteInBetween(t *testing.T) {
	cfg, cs := clusterClients(t)
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	ns := testNamespaceFor(t, cs, "chart-race")
	if _, err := cs.CoreV1().Namespaces().Create(ctx, &corev1.Namespace{ObjectMeta: metav1.ObjectMeta{Name: ns}}, metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	cm := &corev1.ConfigMap{ObjectMeta: metav1.ObjectMeta{Name: "released", Namespace: ns}, Data: map[string]string{"k": "v"}}
	if _, err := cs.CoreV1().ConfigMaps(ns).Create(ctx, cm, metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	dyn, err := dynamic.NewForConfig(cfg)
	if err != nil {
		t.Fatal(err)
	}
	ri := dyn.Resource(schema.GroupVersionResource{Version: "v1", Resource: "configmaps"}).Namespace(ns)
	stale, err := ri.Get(ctx, "released", metav1.GetOptions{})
	if err != nil {
		t.Fatal(err)
	}

	// Another controller annotates the object after it was read.
	cur, err := cs.CoreV1().ConfigMaps(ns).Get(ctx, "released", metav1.GetOptions{})
	if err != nil {
		t.Fatal(err)
	}
	cur.Annotations = map[string]string{"example.com/bound-by-controller": "yes"}
	if _, err := cs.CoreV1().ConfigMaps(ns).Update(ctx, cur, metav1.UpdateOptions{}); err != nil {
		t.Fatal(err)
	}

	want := &unstructured.Unstructured{Object: map[string]any{
		"apiVersion": "v1", "kind": "ConfigMap",
		"metadata": map[string]any{"name": "released", "namespace": ns},
		"data":     map[string]any{"k": "v"},
	}}
	fields, err := changedFields(ctx, ri, &cluster{dyn: dyn}, want.DeepCopy(), stale)
	if err != nil {
		t.Fatal(err)
	}
	if len(fields) != 0 {
		t.Errorf("a write between reading and comparing shows as drift: %v", fields)
	}

	// A field the release sets still shows, from the same stale read.
	want.Object["data"] = map[string]any{"k": "w"}
	fields, err = changedFields(ctx, ri, &cluster{dyn: dyn}, want, stale)
	if err != nil {
		t.Fatal(err)
	}
	if len(fields) != 1 || fields[0] != "data.k" {
		t.Errorf("changed fields %v, want [data.k]", fields)
	}
}
