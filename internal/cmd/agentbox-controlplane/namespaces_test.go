package main

import (
	"io"
	"reflect"
	"strings"
	"testing"

	coordinationv1 "k8s.io/api/coordination/v1"
	corev1 "k8s.io/api/core/v1"
	"k8s.io/apimachinery/pkg/api/equality"
	"k8s.io/apimachinery/pkg/api/resource"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/utils/ptr"
	"sigs.k8s.io/controller-runtime/pkg/cache"

	"github.com/agentbox/terraform-provider-agentbox/internal/controller"
)

func TestSandboxNamespacesFlag(t *testing.T) {
	env := func(m map[string]string) func(string) string { return func(k string) string { return m[k] } }

	// Unset: every namespace, the in-process test setup.
	o, err := parseOptions(nil, env(nil), io.Discard)
	if err != nil || o.sandboxNamespaces != nil {
		t.Fatalf("unset: %v, %v; want every namespace (nil)", o.sandboxNamespaces, err)
	}
	// The chart's env: the platform namespace is always added, duplicates go.
	o, err = parseOptions(nil, env(map[string]string{"POD_NAMESPACE": "agentbox-system", "AGENTBOX_SANDBOX_NAMESPACES": "team-b, agents,agentbox-system,agents"}), io.Discard)
	if err != nil {
		t.Fatal(err)
	}
	if want := (controller.ServedNamespaces{"agentbox-system", "agents", "team-b"}); !reflect.DeepEqual(o.sandboxNamespaces, want) {
		t.Fatalf("served %v, want %v", o.sandboxNamespaces, want)
	}
	if !o.sandboxNamespaces.Serves("agents") || o.sandboxNamespaces.Serves("default") {
		t.Fatalf("Serves is wrong for %v", o.sandboxNamespaces)
	}
	// The flag wins over the env.
	o, err = parseOptions([]string{"--sandbox-namespaces=x"}, env(map[string]string{"AGENTBOX_SANDBOX_NAMESPACES": "agents"}), io.Discard)
	if err != nil || !reflect.DeepEqual(o.sandboxNamespaces, controller.ServedNamespaces{"agentbox-system", "x"}) {
		t.Fatalf("flag: %v, %v", o.sandboxNamespaces, err)
	}
	if _, err := parseOptions([]string{"--sandbox-namespaces=agents,Not_A_Namespace"}, env(nil), io.Discard); err == nil || !strings.Contains(err.Error(), "Not_A_Namespace") {
		t.Fatalf("invalid name: %v", err)
	}
}

func TestCacheOptions(t *testing.T) {
	if o := cacheOptions(nil); o.DefaultNamespaces != nil || len(o.ByObject) != 1 {
		t.Fatalf("every namespace must leave the cache's namespaces alone: %+v", o)
	}
	// Cached objects keep no managedFields, served namespaces or not, and
	// cached pods only what the controllers read.
	for _, o := range []cache.Options{cacheOptions(nil), cacheOptions(controller.ServedNamespaces{"agents"})} {
		lease := &coordinationv1.Lease{ObjectMeta: metav1.ObjectMeta{Name: "l", ManagedFields: []metav1.ManagedFieldsEntry{{Manager: "kubectl"}}}}
		if o.DefaultTransform == nil {
			t.Fatal("no transform of cached objects")
		}
		out, err := o.DefaultTransform(lease)
		if err != nil || out.(*coordinationv1.Lease).ManagedFields != nil || out.(*coordinationv1.Lease).Name != "l" {
			t.Errorf("transformed: %+v, %v; want the lease without managedFields", out, err)
		}
		var pods *cache.ByObject
		for obj, by := range o.ByObject {
			if _, ok := obj.(*corev1.Pod); ok {
				pods = &by
			}
		}
		if pods == nil || pods.Transform == nil || pods.Namespaces != nil {
			t.Fatalf("pods: %+v; want a transform, in the default namespaces", pods)
		}
		out, err = pods.Transform(unitPod())
		if err != nil {
			t.Fatal(err)
		}
		pod := out.(*corev1.Pod)
		want := unitPod()
		want.ManagedFields, want.Spec.Volumes = nil, nil
		want.Spec.InitContainers = []corev1.Container{{Name: "install", Image: "sup:1"}}
		want.Spec.Containers = []corev1.Container{{Name: "sandbox", Image: "sandbox:1", ImagePullPolicy: corev1.PullNever,
			Resources: corev1.ResourceRequirements{Limits: corev1.ResourceList{corev1.ResourceMemory: resource.MustParse("1Gi")}}}}
		if !equality.Semantic.DeepEqual(pod, want) {
			t.Errorf("cached pod\n%+v\nwant\n%+v", pod, want)
		}
	}
	o := cacheOptions(controller.ServedNamespaces{"agentbox-system", "agents"})
	if len(o.DefaultNamespaces) != 2 {
		t.Fatalf("default namespaces %v", o.DefaultNamespaces)
	}
	// The agentbox kinds are watched everywhere, so that one in a namespace
	// not served is told so; everything else only in the served ones.
	kinds := map[string]bool{}
	for obj, by := range o.ByObject {
		if _, pod := obj.(*corev1.Pod); pod {
			continue
		}
		if by.Namespaces == nil || len(by.Namespaces) != 0 {
			t.Errorf("%T: namespaces %v, want every namespace (empty map)", obj, by.Namespaces)
		}
		kinds[reflect.TypeOf(obj).Elem().Name()] = true
	}
	for _, k := range []string{"Sandbox", "SandboxTemplate", "SandboxWarmPool", "EgressProxy", "RunSchedule"} {
		if !kinds[k] {
			t.Errorf("%s is not watched in every namespace", k)
		}
	}
	for obj, by := range o.ByObject {
		switch obj.(type) {
		case *corev1.Secret, *corev1.Pod:
			if by.Namespaces != nil {
				t.Errorf("%T must not be watched cluster-wide", obj)
			}
		}
	}
}

// unitPod is a sandbox pod as the API server has it, in short.
func unitPod() *corev1.Pod {
	return &corev1.Pod{
		ObjectMeta: metav1.ObjectMeta{Name: "s", Namespace: "agents", Labels: map[string]string{"a": "b"},
			Annotations:   map[string]string{"agentbox.dev/template-hash": "h"},
			ManagedFields: []metav1.ManagedFieldsEntry{{Manager: "agentbox"}}},
		Spec: corev1.PodSpec{
			NodeName: "node-1", RuntimeClassName: ptr.To("gvisor"),
			InitContainers: []corev1.Container{{Name: "install", Image: "sup:1", Command: []string{"cp"},
				VolumeMounts: []corev1.VolumeMount{{Name: "bin", MountPath: "/b"}}}},
			Containers: []corev1.Container{{Name: "sandbox", Image: "sandbox:1", ImagePullPolicy: corev1.PullNever,
				Env:            []corev1.EnvVar{{Name: "AGENTBOX_X", Value: "1"}},
				Resources:      corev1.ResourceRequirements{Limits: corev1.ResourceList{corev1.ResourceMemory: resource.MustParse("1Gi")}},
				ReadinessProbe: &corev1.Probe{PeriodSeconds: 1}}},
			Volumes: []corev1.Volume{{Name: "bin"}},
		},
		Status: corev1.PodStatus{Phase: corev1.PodRunning, PodIP: "198.18.0.9",
			Conditions: []corev1.PodCondition{{Type: corev1.PodReady, Status: corev1.ConditionTrue}}},
	}
}

func TestManagedNodePoolsFlag(t *testing.T) {
	env := func(v string) func(string) string {
		return func(k string) string {
			if k == "AGENTBOX_MANAGED_NODE_POOLS" {
				return v
			}
			return ""
		}
	}
	for v, want := range map[string]bool{"": true, "true": true, "false": false} {
		o, err := parseOptions(nil, env(v), io.Discard)
		if err != nil || o.managedNodePools != want {
			t.Errorf("AGENTBOX_MANAGED_NODE_POOLS=%q: %v, %v; want %v", v, o, err, want)
		}
	}
	if o, err := parseOptions([]string{"--managed-node-pools=false"}, env("true"), io.Discard); err != nil || o.managedNodePools {
		t.Errorf("the flag must win over the environment: %v", err)
	}
	if _, err := parseOptions(nil, env("maybe"), io.Discard); err == nil || !strings.Contains(err.Error(), "AGENTBOX_MANAGED_NODE_POOLS") {
		t.Errorf("a bad value: %v", err)
	}
}
