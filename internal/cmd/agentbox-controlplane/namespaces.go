package main

import (
	"flag"
	"fmt"
	"slices"
	"strconv"
	"strings"

	corev1 "k8s.io/api/core/v1"
	"k8s.io/apimachinery/pkg/util/validation"
	"sigs.k8s.io/controller-runtime/pkg/cache"
	"sigs.k8s.io/controller-runtime/pkg/client"

	"github.com/agentbox/terraform-provider-agentbox/internal/api/v1alpha1"
	"github.com/agentbox/terraform-provider-agentbox/internal/controller"
)

// What the control plane serves: the namespaces whose sandboxes it runs,
// which bound its cache as the chart's Roles bound its rights, and whether
// Managed node pools run.

// registerScopeFlags registers the flags that say what the control plane
// serves: the namespaces of its sandboxes, and whether Managed node pools
// run. It returns --sandbox-namespaces as given, which
// parseSandboxNamespaces reads once --namespace is known.
func registerScopeFlags(fs *flag.FlagSet, getenv func(string) string, o *options) (*string, error) {
	sandboxNamespaces := fs.String("sandbox-namespaces", getenv("AGENTBOX_SANDBOX_NAMESPACES"),
		"comma-separated namespaces whose sandboxes, warm pools and egress proxies the control plane runs, besides --namespace, which is always served; "+
			"it watches pods, Secrets and their other children only there (its RBAC Roles grant no more), and objects elsewhere that no other platform takes up get the NamespaceNotServed condition. "+
			"Empty serves every namespace, which needs cluster-wide rights [AGENTBOX_SANDBOX_NAMESPACES]")
	managedDefault := true
	if v := getenv("AGENTBOX_MANAGED_NODE_POOLS"); v != "" {
		b, err := strconv.ParseBool(v)
		if err != nil {
			return nil, fmt.Errorf("AGENTBOX_MANAGED_NODE_POOLS %q: want true or false", v)
		}
		managedDefault = b
	}
	fs.BoolVar(&o.managedNodePools, "managed-node-pools", managedDefault,
		"run Managed GVisorNodePools: label and taint their nodes and write their RuntimeClasses, which needs the right to patch nodes; "+
			"false leaves such pools with the ManagedModeDisabled condition [AGENTBOX_MANAGED_NODE_POOLS]")
	return sandboxNamespaces, nil
}

// parseSandboxNamespaces reads --sandbox-namespaces: nil when empty (every
// namespace), else the namespaces named with the platform namespace added,
// sorted and without duplicates.
func parseSandboxNamespaces(v, platformNamespace string) (controller.ServedNamespaces, error) {
	if strings.TrimSpace(v) == "" {
		return nil, nil
	}
	served := controller.ServedNamespaces{platformNamespace}
	for _, ns := range strings.Split(v, ",") {
		ns = strings.TrimSpace(ns)
		if ns == "" {
			continue
		}
		if errs := validation.IsDNS1123Label(ns); len(errs) > 0 {
			return nil, fmt.Errorf("--sandbox-namespaces: %q is not a namespace name: %s", ns, strings.Join(errs, "; "))
		}
		served = append(served, ns)
	}
	slices.Sort(served)
	return slices.Compact(served), nil
}

// cacheOptions confines the manager's cache to the served namespaces, so
// that it never lists or watches pods, Secrets and the other children
// cluster-wide, which the chart's Roles do not allow. The agentbox kinds
// stay watched everywhere (the ClusterRole allows it), so that one made in
// a namespace that is not served is told so. Cluster-scoped kinds (nodes,
// namespaces, RuntimeClasses) are not namespaced and unaffected.
//
// Every cached object drops its managedFields: nothing here reads them,
// and on a pod or a Sandbox they are a good part of the object, so with
// thousands of sandboxes they were much of the control plane's memory.
// Cached pods keep only what the controllers read of them (trimPod).
func cacheOptions(served controller.ServedNamespaces) cache.Options {
	strip := cache.TransformStripManagedFields()
	pods := cache.ByObject{Transform: func(in any) (any, error) {
		out, err := strip(in)
		if pod, ok := out.(*corev1.Pod); ok && err == nil {
			trimPod(pod)
		}
		return out, err
	}}
	if len(served) == 0 {
		return cache.Options{DefaultTransform: strip, ByObject: map[client.Object]cache.ByObject{&corev1.Pod{}: pods}}
	}
	opts := cache.Options{DefaultNamespaces: map[string]cache.Config{}, ByObject: map[client.Object]cache.ByObject{&corev1.Pod{}: pods},
		DefaultTransform: strip}
	for _, ns := range served {
		opts.DefaultNamespaces[ns] = cache.Config{}
	}
	// An empty, non-nil map means every namespace.
	for _, obj := range []client.Object{&v1alpha1.Sandbox{}, &v1alpha1.SandboxTemplate{}, &v1alpha1.SandboxWarmPool{}, &v1alpha1.EgressProxy{},
		&v1alpha1.RunSchedule{}} {
		opts.ByObject[obj] = cache.ByObject{Namespaces: map[string]cache.Config{}}
	}
	return opts
}

// servedOrAll names the served namespaces in the start-up log line.
func servedOrAll(s controller.ServedNamespaces) string {
	if len(s) == 0 {
		return "all"
	}
	return strings.Join(s, ",")
}

// trimPod drops from a cached pod what no reader of the cache looks at:
// its containers' commands, environment, mounts, probes and security
// contexts, and its volumes. A sandbox pod carries its whole supervisor
// configuration there, most of a cached pod's size, and thousands are
// cached. The controllers read a pod's metadata (owners, labels, the
// annotations that say which template and reset made it), its node, its
// containers' names and images and its status; a pod that must change is
// replaced, never updated from the cache, and patches are computed
// between two copies of the cached object.
func trimPod(pod *corev1.Pod) {
	trim := func(cs []corev1.Container) {
		for i, c := range cs {
			cs[i] = corev1.Container{Name: c.Name, Image: c.Image, ImagePullPolicy: c.ImagePullPolicy, Resources: c.Resources}
		}
	}
	trim(pod.Spec.InitContainers)
	trim(pod.Spec.Containers)
	pod.Spec.Volumes = nil
}
