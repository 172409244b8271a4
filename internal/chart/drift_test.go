package chart

import (
	"context"
	"errors"
	"reflect"
	"sort"
	"strings"
	"testing"

	apierrors "k8s.io/apimachinery/pkg/api/errors"
	"k8s.io/apimachinery/pkg/apis/meta/v1/unstructured"
	"k8s.io/apimachinery/pkg/runtime"
	"k8s.io/apimachinery/pkg/runtime/schema"
	dynamicfake "k8s.io/client-go/dynamic/fake"
	k8stesting "k8s.io/client-go/testing"
	"sigs.k8s.io/yaml"
)

func obj(t *testing.T, doc string) map[string]any {
	t.Helper()
	var m map[string]any
	if err := yaml.Unmarshal([]byte(doc), &m); err != nil {
		t.Fatal(err)
	}
	return m
}

const liveDeployment = `
apiVersion: apps/v1
kind: Deployment
metadata:
  name: agentbox-controlplane
  namespace: agentbox-system
  uid: 1234
  resourceVersion: "100"
  generation: 3
  creationTimestamp: "2026-01-01T00:00:00Z"
  managedFields: [{manager: helm, operation: Update}]
  labels: {app.kubernetes.io/component: controlplane, example.com/added: by-someone}
  annotations: {deployment.kubernetes.io/revision: "3"}
spec:
  replicas: 1
  template:
    spec:
      containers:
        - name: controlplane
          image: agentbox/agentbox-controlplane:dev
          env: [{name: A, value: "1"}, {name: B, value: "2"}]
          resources: {requests: {cpu: 50m}}
status:
  replicas: 1
`

// TestDiffObjects covers what counts as a change between the live object
// and the result of the dry run.
func TestDiffObjects(t *testing.T) {
	cases := []struct {
		name    string
		edit    func(m map[string]any)
		ignored [][]string
		want    []string
	}{
		{name: "identical"},
		{
			name: "server-owned metadata and status",
			edit: func(m map[string]any) {
				md := m["metadata"].(map[string]any)
				md["resourceVersion"] = "101"
				md["generation"] = int64(4)
				md["managedFields"] = []any{map[string]any{"manager": "agentbox-platform", "operation": "Apply"}}
				m["status"] = map[string]any{"replicas": int64(2)}
			},
		},
		{
			name: "an image",
			edit: func(m map[string]any) { firstContainer(m)["image"] = "agentbox/agentbox-controlplane:other" },
			want: []string{"spec.template.spec.containers[0].image"},
		},
		{
			name: "an env value",
			edit: func(m map[string]any) { firstContainer(m)["env"].([]any)[1].(map[string]any)["value"] = "3" },
			want: []string{"spec.template.spec.containers[0].env[1].value"},
		},
		{
			name: "an env var more or less is the list",
			edit: func(m map[string]any) { firstContainer(m)["env"] = firstContainer(m)["env"].([]any)[:1] },
			want: []string{"spec.template.spec.containers[0].env"},
		},
		{
			name: "a label, written in brackets",
			edit: func(m map[string]any) {
				delete(m["metadata"].(map[string]any)["labels"].(map[string]any), "app.kubernetes.io/component")
			},
			want: []string{"metadata.labels[app.kubernetes.io/component]"},
		},
		{
			name: "a map that appears",
			edit: func(m map[string]any) {
				firstContainer(m)["resources"].(map[string]any)["limits"] = map[string]any{"cpu": "1"}
			},
			want: []string{"spec.template.spec.containers[0].resources.limits"},
		},
		{
			name: "a number decoded as float",
			edit: func(m map[string]any) { m["spec"].(map[string]any)["replicas"] = float64(1) },
		},
		{
			name: "a number",
			edit: func(m map[string]any) { m["spec"].(map[string]any)["replicas"] = int64(2) },
			want: []string{"spec.replicas"},
		},
		{
			name:    "an ignored field",
			edit:    func(m map[string]any) { m["spec"].(map[string]any)["replicas"] = int64(2) },
			ignored: [][]string{{"spec", "replicas"}},
		},
		{
			name: "several, sorted",
			edit: func(m map[string]any) {
				firstContainer(m)["image"] = "x"
				m["spec"].(map[string]any)["replicas"] = int64(0)
			},
			want: []string{"spec.replicas", "spec.template.spec.containers[0].image"},
		},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			live := obj(t, liveDeployment)
			applied := runtime.DeepCopyJSON(live)
			if c.edit != nil {
				c.edit(applied)
			}
			got := diffObjects(live, applied, c.ignored)
			if !reflect.DeepEqual(got, c.want) {
				t.Errorf("got %q, want %q", got, c.want)
			}
			if _, ok := live["status"]; !ok {
				t.Error("diffObjects modified its input")
			}
		})
	}
}

func firstContainer(m map[string]any) map[string]any {
	return m["spec"].(map[string]any)["template"].(map[string]any)["spec"].(map[string]any)["containers"].([]any)[0].(map[string]any)
}

func TestFieldList(t *testing.T) {
	if got := fieldList([]string{"a", "b"}); got != "a, b" {
		t.Errorf("got %q", got)
	}
	if got := fieldList([]string{"a", "b", "c", "d", "e"}); got != "a, b, c and 2 more" {
		t.Errorf("got %q", got)
	}
	d := DriftItem{Kind: "Deployment", Namespace: "ns", Name: "x", Reason: ReasonChanged + ": " + fieldList([]string{"spec.replicas"})}
	if got := d.String(); got != "Deployment ns/x changed out of band: spec.replicas" {
		t.Errorf("got %q", got)
	}
}

// TestDryRunRefused separates a dry run that did not happen (the object is
// then checked for presence only) from a failure that must fail the refresh.
func TestDryRunRefused(t *testing.T) {
	gr := schema.GroupResource{Group: "apps", Resource: "deployments"}
	for _, c := range []struct {
		err     error
		refused bool
	}{
		{apierrors.NewForbidden(gr, "x", errors.New("cannot patch")), true},
		{apierrors.NewInternalError(errors.New("duplicate entries for key")), true},
		{apierrors.NewBadRequest("webhook does not support dry run"), true},
		{apierrors.NewMethodNotSupported(gr, "patch"), true},
		{apierrors.NewServiceUnavailable("down"), false},
		{apierrors.NewTimeoutError("slow", 1), false},
		{errors.New("connection refused"), false},
		{nil, false},
	} {
		if got := dryRunRefused(c.err); got != c.refused {
			t.Errorf("%v: refused %v, want %v", c.err, got, c.refused)
		}
	}
}

func TestRemoveField(t *testing.T) {
	m := obj(t, "spec: {resources: {requests: {storage: 1Gi}}, accessModes: [ReadWriteOnce]}")
	removeField(m, []string{"spec", "resources", "requests", "storage"})
	// An empty map left in an apply would claim it, so it goes too.
	if !reflect.DeepEqual(m, obj(t, "spec: {accessModes: [ReadWriteOnce]}")) {
		t.Errorf("got %v", m)
	}
	removeField(m, []string{"spec", "accessModes", "x"})
	removeField(m, []string{"nothing", "here"})
	if !reflect.DeepEqual(m, obj(t, "spec: {accessModes: [ReadWriteOnce]}")) {
		t.Errorf("removing what is not there changed %v", m)
	}
}

func hpa(name, kind, target string) *unstructured.Unstructured {
	u := &unstructured.Unstructured{Object: map[string]any{
		"apiVersion": "autoscaling/v2", "kind": "HorizontalPodAutoscaler",
		"metadata": map[string]any{"name": name, "namespace": testNamespace},
		"spec": map[string]any{
			"scaleTargetRef": map[string]any{"apiVersion": "apps/v1", "kind": kind, "name": target},
			"maxReplicas":    int64(3),
		},
	}}
	return u
}

func fakeCluster(objs ...runtime.Object) (*cluster, *dynamicfake.FakeDynamicClient) {
	dyn := dynamicfake.NewSimpleDynamicClientWithCustomListKinds(runtime.NewScheme(),
		map[schema.GroupVersionResource]string{hpaGVR: "HorizontalPodAutoscalerList"}, objs...)
	return &cluster{dyn: dyn}, dyn
}

func ignoredOf(t *testing.T, cl *cluster, kind, name string) [][]string {
	t.Helper()
	o := &unstructured.Unstructured{}
	o.SetKind(kind)
	o.SetName(name)
	o.SetNamespace(testNamespace)
	paths, err := ignoredPaths(context.Background(), cl, o)
	if err != nil {
		t.Fatal(err)
	}
	return paths
}

// TestIgnoredPaths covers which fields of which objects are left out.
func TestIgnoredPaths(t *testing.T) {
	none := [][]string(nil)
	replicas := [][]string{{"spec", "replicas"}}
	data := [][]string{{"data"}}

	cl, _ := fakeCluster()
	for _, c := range []struct {
		kind, name string
		want       [][]string
	}{
		{"Deployment", ControlPlaneDeployment, none},
		{"Secret", DefaultCASecret, data},
		{"Secret", DefaultAdminTokenSecret, data},
		// The DSN comes from values, not from a lookup: changing it is drift.
		{"Secret", "agentbox-store", none},
		{"PersistentVolumeClaim", "agentbox-store", [][]string{{"spec", "resources", "requests", "storage"}}},
		{"Service", APIService, none},
		{"DaemonSet", "agentbox-runsc-installer", none},
	} {
		if got := ignoredOf(t, cl, c.kind, c.name); !reflect.DeepEqual(got, c.want) {
			t.Errorf("%s %s: got %v, want %v", c.kind, c.name, got, c.want)
		}
	}

	cl, _ = fakeCluster(hpa("cp", "Deployment", ControlPlaneDeployment), hpa("other", "StatefulSet", "db"))
	if got := ignoredOf(t, cl, "Deployment", ControlPlaneDeployment); !reflect.DeepEqual(got, replicas) {
		t.Errorf("under an autoscaler: got %v", got)
	}
	if got := ignoredOf(t, cl, "Deployment", "not-scaled"); got != nil {
		t.Errorf("a Deployment no autoscaler targets: got %v", got)
	}

	// Who cannot see the autoscalers must not fight them.
	cl, dyn := fakeCluster()
	dyn.PrependReactor("list", "horizontalpodautoscalers", func(k8stesting.Action) (bool, runtime.Object, error) {
		return true, nil, apierrors.NewForbidden(hpaGVR.GroupResource(), "", errors.New("no"))
	})
	if got := ignoredOf(t, cl, "Deployment", ControlPlaneDeployment); !reflect.DeepEqual(got, replicas) {
		t.Errorf("autoscalers not listable: got %v", got)
	}
	cl, dyn = fakeCluster()
	dyn.PrependReactor("list", "horizontalpodautoscalers", func(k8stesting.Action) (bool, runtime.Object, error) {
		return true, nil, apierrors.NewServiceUnavailable("down")
	})
	o := &unstructured.Unstructured{}
	o.SetKind("Deployment")
	o.SetName(ControlPlaneDeployment)
	if _, err := ignoredPaths(context.Background(), cl, o); err == nil || !strings.Contains(err.Error(), "HorizontalPodAutoscalers") {
		t.Errorf("error %v", err)
	}
}

// TestDriftReviewedKinds renders every template and fails when the chart
// produces a kind whose legitimately changing fields ignoredFields was not
// reviewed for (see its comment), or when a rule names what the chart no
// longer renders.
func TestDriftReviewedKinds(t *testing.T) {
	reviewed := []string{
		"ClusterRole", "ClusterRoleBinding", "DaemonSet", "Deployment", "Namespace", "NetworkPolicy",
		"PersistentVolumeClaim", "PodDisruptionBudget", "Role", "RoleBinding", "Secret", "Service", "ServiceAccount",
	}
	kinds := map[string]bool{}
	objects := map[string]*unstructured.Unstructured{}
	for _, raw := range []string{
		"",
		"runscInstaller: {enabled: true}\nstore: {dsn: 'postgres://db.invalid/agentbox'}\nreplicaCount: 2\nsnapshot: {driver: volumesnapshot}",
	} {
		rel, err := RenderInstall(testNamespace, DefaultReleaseName, Values{Raw: raw})
		if err != nil {
			t.Fatal(err)
		}
		objs, err := manifestObjects(rel.Manifest)
		if err != nil {
			t.Fatal(err)
		}
		for _, o := range objs {
			kinds[o.GetKind()] = true
			objects[o.GetKind()+"/"+o.GetName()] = o
		}
	}
	var got []string
	for k := range kinds {
		got = append(got, k)
	}
	sort.Strings(got)
	if !reflect.DeepEqual(got, reviewed) {
		t.Errorf("the chart renders %v; review ignoredFields for the kinds not in %v, then add them", got, reviewed)
	}

	for _, f := range ignoredFields {
		matched := false
		for _, o := range objects {
			if o.GetKind() != f.Kind || (f.Name != "" && o.GetName() != f.Name) {
				continue
			}
			matched = true
			if _, found, _ := unstructured.NestedFieldNoCopy(o.Object, f.Path...); !found {
				t.Errorf("%s %s does not set %s: the rule ignoring it is dead", f.Kind, o.GetName(), strings.Join(f.Path, "."))
			}
		}
		if !matched {
			t.Errorf("no rendered object matches the rule for %s %s", f.Kind, f.Name)
		}
		if f.Why == "" {
			t.Errorf("the rule for %s %s does not say why", f.Kind, f.Path)
		}
	}
}
