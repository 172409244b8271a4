package v1alpha1_test

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"fmt"
	"os"
	"path/filepath"
	"reflect"
	"slices"
	"strings"
	"testing"
	"time"

	autoscalingv1 "k8s.io/api/autoscaling/v1"
	corev1 "k8s.io/api/core/v1"
	apiextensionsv1 "k8s.io/apiextensions-apiserver/pkg/apis/apiextensions/v1"
	apiextensionsclient "k8s.io/apiextensions-apiserver/pkg/client/clientset/clientset"
	"k8s.io/apimachinery/pkg/api/equality"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	"k8s.io/apimachinery/pkg/api/meta"
	"k8s.io/apimachinery/pkg/api/resource"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/runtime"
	"k8s.io/apimachinery/pkg/runtime/schema"
	"k8s.io/apimachinery/pkg/runtime/serializer"
	"k8s.io/apimachinery/pkg/util/wait"
	"k8s.io/client-go/kubernetes/scheme"
	"k8s.io/client-go/util/retry"
	"k8s.io/utils/ptr"
	"sigs.k8s.io/controller-runtime/pkg/client"
	"sigs.k8s.io/yaml"

	v1alpha1 "github.com/agentbox/terraform-provider-agentbox/internal/api/v1alpha1"
	"github.com/agentbox/terraform-provider-agentbox/internal/testenv"
)

// crdDir is where controller-gen writes the CRDs, relative to this package.
const crdDir = "../../../charts/agentbox/crds"

func newScheme(t testing.TB) *runtime.Scheme {
	t.Helper()
	s := runtime.NewScheme()
	if err := scheme.AddToScheme(s); err != nil {
		t.Fatal(err)
	}
	if err := v1alpha1.AddToScheme(s); err != nil {
		t.Fatal(err)
	}
	return s
}

var testTime = metav1.Date(2026, 11, 22, 10, 30, 0, 0, time.UTC)

// Fully populated objects: every pointer, slice and map set, so that deep
// copies and round trips are exercised on all of them.

func fullTemplate() *v1alpha1.SandboxTemplate {
	return &v1alpha1.SandboxTemplate{
		ObjectMeta: metav1.ObjectMeta{Name: "python", Namespace: "team-a", Labels: map[string]string{"team": "a"}},
		Spec: v1alpha1.SandboxTemplateSpec{
			Image:            "registry.example.com/agentbox-sandbox:v1",
			ImagePullPolicy:  corev1.PullIfNotPresent,
			RuntimeClassName: "gvisor",
			Resources: corev1.ResourceRequirements{
				Limits:   corev1.ResourceList{corev1.ResourceCPU: resource.MustParse("2"), corev1.ResourceMemory: resource.MustParse("4Gi")},
				Requests: corev1.ResourceList{corev1.ResourceCPU: resource.MustParse("500m")},
			},
			Env: []corev1.EnvVar{
				{Name: "LANG", Value: "C.UTF-8"},
				{Name: "TOKEN", ValueFrom: &corev1.EnvVarSource{SecretKeyRef: &corev1.SecretKeySelector{
					LocalObjectReference: corev1.LocalObjectReference{Name: "tok"}, Key: "token", Optional: ptr.To(true),
				}}},
			},
			SecretFiles: []v1alpha1.SecretFile{{SecretName: "gcp", MountPath: "/etc/gcp"}},
			Workspace: v1alpha1.WorkspaceSpec{
				Size:                    resource.MustParse("2Gi"),
				StorageClassName:        ptr.To("fast"),
				VolumeSnapshotClassName: ptr.To("csi-snap"),
				MountPath:               "/workspace",
			},
			IdleTimeout: metav1.Duration{Duration: 30 * time.Minute},
			Python: v1alpha1.PythonPolicy{
				DefaultTimeout:  metav1.Duration{Duration: 30 * time.Second},
				MaxTimeout:      metav1.Duration{Duration: 2 * time.Minute},
				IndexURL:        "https://pypi.example.com/simple",
				ExtraIndexURLs:  []string{"https://extra.example.com/simple"},
				AllowedPackages: []string{"numpy", "pandas"},
			},
			MCPServers: []v1alpha1.MCPServer{{
				Name: "files", Command: "npx", Args: []string{"-y", "@modelcontextprotocol/server-filesystem", "/workspace"},
				Env: map[string]string{"DEBUG": "1"},
			}, {Name: "remote", URL: "https://mcp.example.com/mcp"}},
			EgressProxyRef: &v1alpha1.LocalObjectReference{Name: "egress"},
			NodePoolRef:    ptr.To("gvisor-pool"),
			NodeSelector:   map[string]string{"pool": "sandbox"},
			Tolerations:    []corev1.Toleration{{Key: "sandbox", Operator: corev1.TolerationOpExists, TolerationSeconds: ptr.To[int64](30)}},
		},
		Status: v1alpha1.SandboxTemplateStatus{
			Conditions:         []metav1.Condition{{Type: v1alpha1.ConditionReady, Status: metav1.ConditionTrue, Reason: v1alpha1.ReasonTemplateResolved, LastTransitionTime: testTime}},
			ObservedGeneration: 3,
		},
	}
}

func fullSandbox() *v1alpha1.Sandbox {
	return &v1alpha1.Sandbox{
		ObjectMeta: metav1.ObjectMeta{Name: "agent-1", Namespace: "team-a", Finalizers: []string{v1alpha1.Finalizer}},
		Spec: v1alpha1.SandboxSpec{
			AgentID:     "6f1c2b7e-agent",
			TemplateRef: v1alpha1.LocalObjectReference{Name: "python"},
			IdleTimeout: &metav1.Duration{Duration: 10 * time.Minute},
			Ephemeral:   true,
		},
		Status: v1alpha1.SandboxStatus{
			Phase:            v1alpha1.SandboxPhaseStopped,
			PodName:          "agent-1",
			PodIP:            "10.0.0.7",
			ServiceEndpoint:  v1alpha1.SupervisorEndpoint("10.0.0.7"),
			LastActivityTime: ptr.To(testTime),
			Snapshot:         &v1alpha1.SandboxSnapshot{Name: "agent-1-1", SizeBytes: 4096, ReadyTime: ptr.To(testTime)},
			Conditions: []metav1.Condition{{
				Type: v1alpha1.ConditionReady, Status: metav1.ConditionFalse, Reason: v1alpha1.ReasonStopped, Message: "idle", LastTransitionTime: testTime,
			}},
			ObservedGeneration: 1,
		},
	}
}

func fullWarmPool() *v1alpha1.SandboxWarmPool {
	return &v1alpha1.SandboxWarmPool{
		ObjectMeta: metav1.ObjectMeta{Name: "python", Namespace: "team-a"},
		Spec:       v1alpha1.SandboxWarmPoolSpec{TemplateRef: v1alpha1.LocalObjectReference{Name: "python"}, Replicas: 3},
		Status: v1alpha1.SandboxWarmPoolStatus{
			Replicas: 3, ReadyReplicas: 2, Selector: v1alpha1.LabelWarmPool + "=python",
			Conditions:         []metav1.Condition{{Type: v1alpha1.ConditionReady, Status: metav1.ConditionFalse, Reason: v1alpha1.ReasonScaling, LastTransitionTime: testTime}},
			ObservedGeneration: 2,
		},
	}
}

func fullRunSchedule() *v1alpha1.RunSchedule {
	deadline, ok, failed := int64(30), int32(3), int32(1)
	return &v1alpha1.RunSchedule{
		ObjectMeta: metav1.ObjectMeta{Name: "nightly", Namespace: "team-a"},
		Spec: v1alpha1.RunScheduleSpec{
			Schedule: "0 3 * * *", TimeZone: "Europe/Berlin",
			Target:            v1alpha1.RunScheduleTarget{AgentID: "agent-1"},
			Command:           v1alpha1.RunScheduleCommand{Argv: []string{"make", "report"}, Env: map[string]string{"MODE": "full"}, Cwd: "/workspace", TimeoutSeconds: 600},
			ConcurrencyPolicy: v1alpha1.ConcurrencyReplace, StartingDeadlineSeconds: &deadline,
			SuccessfulRunsHistoryLimit: &ok, FailedRunsHistoryLimit: &failed, Suspend: true,
		},
		Status: v1alpha1.RunScheduleStatus{
			LastScheduleTime: &testTime, NextScheduleTime: &testTime, LastRunID: "run-0123456789abcdef0123",
			LastRunStatus: "running", Active: []string{"run-0123456789abcdef0123"},
			LastSkipped:        &v1alpha1.RunScheduleSkip{Time: testTime, Reason: v1alpha1.SkipForbid, Message: "a run was live"},
			Conditions:         []metav1.Condition{{Type: v1alpha1.ConditionReady, Status: metav1.ConditionTrue, Reason: v1alpha1.ReasonScheduled, LastTransitionTime: testTime}},
			ObservedGeneration: 1,
		},
	}
}

func fullEgressProxy() *v1alpha1.EgressProxy {
	return &v1alpha1.EgressProxy{
		ObjectMeta: metav1.ObjectMeta{Name: "egress", Namespace: "team-a"},
		Spec: v1alpha1.EgressProxySpec{
			Mode:             v1alpha1.EgressProxyModeShared,
			AllowedDomains:   []v1alpha1.Domain{"pypi.org", "*.pythonhosted.org"},
			DeniedDomains:    []v1alpha1.Domain{"evil.pypi.org"},
			DeniedCIDRs:      []v1alpha1.CIDR{"100.64.0.0/10", "fd00::/8"},
			AllowedCIDRs:     []v1alpha1.AllowedCIDR{"10.20.0.0/16"},
			RuntimeClassName: "gvisor",
			Upstream: &v1alpha1.EgressUpstream{
				URL:                  "http://proxy.example.com:7000",
				CredentialsSecretRef: &v1alpha1.SecretKeySelector{Name: "upstream", Key: "credentials"},
			},
			Replicas: ptr.To[int32](2),
		},
		Status: v1alpha1.EgressProxyStatus{
			ReadyEndpoints:     []string{"http://egress.team-a.svc:3128"},
			Conditions:         []metav1.Condition{{Type: v1alpha1.ConditionReady, Status: metav1.ConditionTrue, Reason: v1alpha1.ReasonProxyAvailable, LastTransitionTime: testTime}},
			ObservedGeneration: 1,
		},
	}
}

func fullNodePool() *v1alpha1.GVisorNodePool {
	return &v1alpha1.GVisorNodePool{
		ObjectMeta: metav1.ObjectMeta{Name: "gvisor-pool"},
		Spec: v1alpha1.GVisorNodePoolSpec{
			Mode:             v1alpha1.GVisorNodePoolModeManaged,
			RuntimeClassName: "gvisor",
			NodeSelector:     map[string]string{"pool": "sandbox"},
			Tolerations:      []corev1.Toleration{{Key: "sandbox", Operator: corev1.TolerationOpExists}},
			Taint:            &corev1.Taint{Key: "sandbox", Value: "gvisor", Effect: corev1.TaintEffectNoSchedule, TimeAdded: ptr.To(testTime)},
			Overhead:         corev1.ResourceList{corev1.ResourceMemory: resource.MustParse("64Mi")},
		},
		Status: v1alpha1.GVisorNodePoolStatus{
			Nodes:              []string{"node-a", "node-b"},
			ReadyNodes:         2,
			Conditions:         []metav1.Condition{{Type: v1alpha1.ConditionReady, Status: metav1.ConditionTrue, Reason: v1alpha1.ReasonNodesReady, LastTransitionTime: testTime}},
			ObservedGeneration: 1,
		},
	}
}

// kinds pairs every kind with a full object and its list; tests iterate it so
// that a new kind is caught by all of them.
var kinds = []struct {
	kind string
	full func() runtime.Object
	list runtime.Object
}{
	{"Sandbox", func() runtime.Object { return fullSandbox() }, &v1alpha1.SandboxList{}},
	{"SandboxTemplate", func() runtime.Object { return fullTemplate() }, &v1alpha1.SandboxTemplateList{}},
	{"SandboxWarmPool", func() runtime.Object { return fullWarmPool() }, &v1alpha1.SandboxWarmPoolList{}},
	{"EgressProxy", func() runtime.Object { return fullEgressProxy() }, &v1alpha1.EgressProxyList{}},
	{"GVisorNodePool", func() runtime.Object { return fullNodePool() }, &v1alpha1.GVisorNodePoolList{}},
	{"RunSchedule", func() runtime.Object { return fullRunSchedule() }, &v1alpha1.RunScheduleList{}},
}

func TestSchemeRoundTrip(t *testing.T) {
	s := newScheme(t)
	codecs := serializer.NewCodecFactory(s)
	codec := codecs.LegacyCodec(v1alpha1.GroupVersion)
	registered := s.KnownTypes(v1alpha1.GroupVersion)
	for _, k := range kinds {
		t.Run(k.kind, func(t *testing.T) {
			for _, obj := range []runtime.Object{k.full(), k.list} {
				gvks, _, err := s.ObjectKinds(obj)
				if err != nil {
					t.Fatalf("ObjectKinds(%T): %v", obj, err)
				}
				want := reflect.TypeOf(obj).Elem().Name()
				if len(gvks) != 1 || gvks[0] != v1alpha1.GroupVersion.WithKind(want) {
					t.Fatalf("%T registered as %v, want %s", obj, gvks, v1alpha1.GroupVersion.WithKind(want))
				}
				if _, ok := registered[want]; !ok {
					t.Fatalf("%s missing from KnownTypes", want)
				}
			}

			orig := k.full()
			data, err := runtime.Encode(codec, orig)
			if err != nil {
				t.Fatalf("encode: %v", err)
			}
			if !strings.Contains(string(data), `"apiVersion":"agentbox.dev/v1alpha1"`) {
				t.Errorf("encoded object lacks apiVersion: %s", data)
			}
			back, gvk, err := codecs.UniversalDeserializer().Decode(data, nil, nil)
			if err != nil {
				t.Fatalf("decode: %v", err)
			}
			if *gvk != v1alpha1.GroupVersion.WithKind(k.kind) {
				t.Errorf("decoded kind %v, want %s", gvk, k.kind)
			}
			back.GetObjectKind().SetGroupVersionKind(schema.GroupVersionKind{})
			if !equality.Semantic.DeepEqual(orig, back) {
				t.Errorf("round trip changed the object:\n got %#v\nwant %#v", back, orig)
			}
		})
	}
	if got, want := len(registered), 2*len(kinds)+len(metaTypes(s)); got != want {
		t.Errorf("%d types registered in %s, want %d (a kind is missing from the tests)", got, v1alpha1.GroupVersion, want)
	}
}

// metaTypes are the meta/v1 types metav1.AddToGroupVersion registers with
// every group version.
func metaTypes(s *runtime.Scheme) []string {
	var names []string
	for name, typ := range s.KnownTypes(v1alpha1.GroupVersion) {
		if typ.PkgPath() != reflect.TypeOf(v1alpha1.Sandbox{}).PkgPath() {
			names = append(names, name)
		}
	}
	return names
}

func TestDeepCopyIsIndependent(t *testing.T) {
	mutations := map[string]func(runtime.Object){
		"Sandbox": func(o runtime.Object) {
			sb := o.(*v1alpha1.Sandbox)
			sb.Finalizers[0] = "x"
			sb.Spec.IdleTimeout.Duration = time.Hour
			sb.Status.LastActivityTime.Time = time.Time{}
			sb.Status.Snapshot.Name = "x"
			sb.Status.Snapshot.ReadyTime.Time = time.Time{}
			sb.Status.Conditions[0].Reason = "x"
		},
		"SandboxTemplate": func(o runtime.Object) {
			tp := o.(*v1alpha1.SandboxTemplate)
			tp.Labels["team"] = "b"
			tp.Spec.Resources.Limits[corev1.ResourceCPU] = resource.MustParse("9")
			tp.Spec.Env[1].ValueFrom.SecretKeyRef.Name = "x"
			*tp.Spec.Env[1].ValueFrom.SecretKeyRef.Optional = false
			tp.Spec.SecretFiles[0].MountPath = "/x"
			*tp.Spec.Workspace.StorageClassName = "x"
			*tp.Spec.Workspace.VolumeSnapshotClassName = "x"
			tp.Spec.Python.ExtraIndexURLs[0] = "x"
			tp.Spec.Python.AllowedPackages[0] = "x"
			tp.Spec.MCPServers[0].Args[0] = "x"
			tp.Spec.MCPServers[0].Env["DEBUG"] = "0"
			tp.Spec.EgressProxyRef.Name = "x"
			*tp.Spec.NodePoolRef = "x"
			tp.Spec.NodeSelector["pool"] = "x"
			*tp.Spec.Tolerations[0].TolerationSeconds = 1
			tp.Status.Conditions[0].Reason = "x"
		},
		"SandboxWarmPool": func(o runtime.Object) {
			wp := o.(*v1alpha1.SandboxWarmPool)
			wp.Status.Conditions[0].Reason = "x"
		},
		"EgressProxy": func(o runtime.Object) {
			ep := o.(*v1alpha1.EgressProxy)
			ep.Spec.AllowedDomains[0] = "x"
			ep.Spec.DeniedDomains[0] = "x"
			ep.Spec.DeniedCIDRs[0] = "x"
			ep.Spec.Upstream.URL = "x"
			ep.Spec.Upstream.CredentialsSecretRef.Key = "x"
			*ep.Spec.Replicas = 9
			ep.Status.ReadyEndpoints[0] = "x"
			ep.Status.Conditions[0].Reason = "x"
		},
		"RunSchedule": func(o runtime.Object) {
			rs := o.(*v1alpha1.RunSchedule)
			rs.Spec.Command.Argv[0] = "x"
			rs.Spec.Command.Env["MODE"] = "x"
			*rs.Spec.StartingDeadlineSeconds = 1
			*rs.Spec.SuccessfulRunsHistoryLimit = 9
			*rs.Spec.FailedRunsHistoryLimit = 9
			rs.Status.LastScheduleTime.Time = time.Time{}
			rs.Status.NextScheduleTime.Time = time.Time{}
			rs.Status.LastSkipped.Reason = "x"
			rs.Status.Active[0] = "x"
			rs.Status.Conditions[0].Reason = "x"
		},
		"GVisorNodePool": func(o runtime.Object) {
			np := o.(*v1alpha1.GVisorNodePool)
			np.Spec.NodeSelector["pool"] = "x"
			np.Spec.Tolerations[0].Key = "x"
			np.Spec.Taint.Key = "x"
			np.Spec.Taint.TimeAdded.Time = time.Time{}
			np.Spec.Overhead[corev1.ResourceMemory] = resource.MustParse("1Gi")
			np.Status.Nodes[0] = "x"
			np.Status.Conditions[0].Reason = "x"
		},
	}
	for _, k := range kinds {
		t.Run(k.kind, func(t *testing.T) {
			mutate := mutations[k.kind]
			if mutate == nil {
				t.Fatalf("no mutation for %s", k.kind)
			}
			orig := k.full()
			cp := orig.DeepCopyObject()
			if !equality.Semantic.DeepEqual(orig, cp) {
				t.Fatalf("copy differs from the original")
			}
			mutate(cp)
			if !equality.Semantic.DeepEqual(orig, k.full()) {
				t.Errorf("changing the copy changed the original: %#v", orig)
			}
			if equality.Semantic.DeepEqual(orig, cp) {
				t.Errorf("the mutation changed nothing")
			}

			list := k.list.DeepCopyObject()
			items := reflect.ValueOf(list).Elem().FieldByName("Items")
			items.Set(reflect.Append(items, reflect.ValueOf(orig).Elem()))
			listCopy := list.DeepCopyObject()
			mutate(reflect.ValueOf(listCopy).Elem().FieldByName("Items").Index(0).Addr().Interface().(runtime.Object))
			if !equality.Semantic.DeepEqual(list, func() runtime.Object {
				l := k.list.DeepCopyObject()
				it := reflect.ValueOf(l).Elem().FieldByName("Items")
				it.Set(reflect.Append(it, reflect.ValueOf(k.full()).Elem()))
				return l
			}()) {
				t.Errorf("changing a copied list's item changed the original list")
			}
		})
	}
}

func TestHelpers(t *testing.T) {
	if got := v1alpha1.SupervisorEndpoint("10.1.2.3"); got != "https://10.1.2.3:8443" {
		t.Errorf("SupervisorEndpoint(v4) = %q", got)
	}
	if got := v1alpha1.SupervisorEndpoint("fd00::1"); got != "https://[fd00::1]:8443" {
		t.Errorf("SupervisorEndpoint(v6) = %q", got)
	}
	h := v1alpha1.AgentIDHash("agent/with spaces and a very long name " + strings.Repeat("x", 300))
	if len(h) != 32 || strings.Trim(h, "0123456789abcdef") != "" {
		t.Errorf("AgentIDHash = %q, want 32 lower-case hex digits (a valid label value)", h)
	}
	if v1alpha1.AgentIDHash("a") == v1alpha1.AgentIDHash("b") {
		t.Error("AgentIDHash does not depend on its input")
	}
	// The reasons are condition reasons, so they must match metav1.Condition's pattern.
	for _, r := range []string{
		v1alpha1.ReasonReconcileError, v1alpha1.ReasonTemplateNotFound, v1alpha1.ReasonEgressProxyNotFound,
		v1alpha1.ReasonNodePoolNotFound, v1alpha1.ReasonTemplateResolved, v1alpha1.ReasonCreating,
		v1alpha1.ReasonAdoptedFromWarmPool, v1alpha1.ReasonRunning, v1alpha1.ReasonIdleTimeout,
		v1alpha1.ReasonStopped, v1alpha1.ReasonResuming, v1alpha1.ReasonSnapshotFailed,
		v1alpha1.ReasonRestoreFailed, v1alpha1.ReasonSyncFailed, v1alpha1.ReasonPodFailed, v1alpha1.ReasonImageRunsAsRoot,
		v1alpha1.ReasonPoolFull, v1alpha1.ReasonScaling, v1alpha1.ReasonProxyAvailable,
		v1alpha1.ReasonProxyProgressing, v1alpha1.ReasonUpstreamSecretNotFound, v1alpha1.ReasonNodesReady,
		v1alpha1.ReasonInstalling, v1alpha1.ReasonNoMatchingNodes, v1alpha1.ReasonRuntimeClassNotFound,
		v1alpha1.ReasonRuntimeClassConflict, v1alpha1.ReasonCredentialSecretNotFound,
		v1alpha1.ReasonPrewarmed, v1alpha1.ReasonPrewarming, v1alpha1.ReasonPrewarmFailed,
	} {
		if r == "" || !isCamel(r) {
			t.Errorf("reason %q is not CamelCase", r)
		}
	}
}

func isCamel(s string) bool {
	if s[0] < 'A' || s[0] > 'Z' {
		return false
	}
	for _, c := range s {
		if !(c >= 'a' && c <= 'z' || c >= 'A' && c <= 'Z' || c >= '0' && c <= '9') {
			return false
		}
	}
	return true
}

func loadCRDs(t testing.TB) map[string]*apiextensionsv1.CustomResourceDefinition {
	t.Helper()
	files, err := filepath.Glob(filepath.Join(crdDir, "*.yaml"))
	if err != nil {
		t.Fatal(err)
	}
	if len(files) == 0 {
		t.Fatalf("no CRDs in %s: run `make generate`", crdDir)
	}
	crds := map[string]*apiextensionsv1.CustomResourceDefinition{}
	for _, f := range files {
		data, err := os.ReadFile(f)
		if err != nil {
			t.Fatal(err)
		}
		var crd apiextensionsv1.CustomResourceDefinition
		if err := yaml.UnmarshalStrict(data, &crd); err != nil {
			t.Fatalf("%s: %v", f, err)
		}
		if want := crd.Spec.Group + "_" + crd.Spec.Names.Plural + ".yaml"; filepath.Base(f) != want {
			t.Errorf("%s holds %s; controller-gen would name it %s", f, crd.Name, want)
		}
		crds[crd.Spec.Names.Kind] = &crd
	}
	return crds
}

func TestCRDManifests(t *testing.T) {
	crds := loadCRDs(t)
	want := map[string]struct {
		plural, shortName string
		scope             apiextensionsv1.ResourceScope
	}{
		"Sandbox":         {"sandboxes", "sbx", apiextensionsv1.NamespaceScoped},
		"SandboxTemplate": {"sandboxtemplates", "sbxtpl", apiextensionsv1.NamespaceScoped},
		"SandboxWarmPool": {"sandboxwarmpools", "sbxpool", apiextensionsv1.NamespaceScoped},
		"EgressProxy":     {"egressproxies", "egp", apiextensionsv1.NamespaceScoped},
		"GVisorNodePool":  {"gvisornodepools", "gvnp", apiextensionsv1.ClusterScoped},
		"RunSchedule":     {"runschedules", "runsched", apiextensionsv1.NamespaceScoped},
	}
	if len(crds) != len(want) || len(crds) != len(kinds) {
		t.Errorf("%d CRDs in %s, want %d", len(crds), crdDir, len(want))
	}
	for kind, w := range want {
		crd := crds[kind]
		if crd == nil {
			t.Errorf("no CRD for %s", kind)
			continue
		}
		if crd.Name != w.plural+"."+v1alpha1.GroupName || crd.Spec.Group != v1alpha1.GroupName {
			t.Errorf("%s: name %s group %s", kind, crd.Name, crd.Spec.Group)
		}
		if crd.Spec.Names.Plural != w.plural || crd.Spec.Names.ListKind != kind+"List" || crd.Spec.Scope != w.scope {
			t.Errorf("%s: names %+v scope %s", kind, crd.Spec.Names, crd.Spec.Scope)
		}
		if !slices.Contains(crd.Spec.Names.ShortNames, w.shortName) || !slices.Contains(crd.Spec.Names.Categories, "agentbox") {
			t.Errorf("%s: shortNames %v categories %v", kind, crd.Spec.Names.ShortNames, crd.Spec.Names.Categories)
		}
		if len(crd.Spec.Versions) != 1 {
			t.Fatalf("%s: %d versions", kind, len(crd.Spec.Versions))
		}
		v := crd.Spec.Versions[0]
		if v.Name != v1alpha1.GroupVersion.Version || !v.Served || !v.Storage {
			t.Errorf("%s: version %s served=%t storage=%t", kind, v.Name, v.Served, v.Storage)
		}
		if v.Subresources == nil || v.Subresources.Status == nil {
			t.Errorf("%s: no status subresource", kind)
		}
		scale := v.Subresources != nil && v.Subresources.Scale != nil
		if scale != (kind == "SandboxWarmPool") {
			t.Errorf("%s: scale subresource %t", kind, scale)
		}
		if !hasColumn(v.AdditionalPrinterColumns, "Age") {
			t.Errorf("%s: no Age column", kind)
		}
		for _, path := range undocumented(v.Schema.OpenAPIV3Schema, "") {
			t.Errorf("%s: %s has no description (doc comment)", kind, path)
		}
	}

	if crd := crds["SandboxWarmPool"]; crd != nil {
		want := apiextensionsv1.CustomResourceSubresourceScale{
			SpecReplicasPath: ".spec.replicas", StatusReplicasPath: ".status.replicas", LabelSelectorPath: ptr.To(".status.selector"),
		}
		if got := crd.Spec.Versions[0].Subresources.Scale; got == nil || !reflect.DeepEqual(*got, want) {
			t.Errorf("SandboxWarmPool scale = %+v, want %+v", got, want)
		}
	}

	if crd := crds["Sandbox"]; crd != nil {
		v := crd.Spec.Versions[0]
		spec := v.Schema.OpenAPIV3Schema.Properties["spec"]
		for _, field := range []string{"agentID", "templateRef"} {
			if !hasRule(spec.Properties[field], "self == oldSelf") {
				t.Errorf("Sandbox spec.%s lacks the immutability rule", field)
			}
			if !slices.Contains(spec.Required, field) {
				t.Errorf("Sandbox spec.%s is not required", field)
			}
		}
		if a := spec.Properties["agentID"]; ptr.Deref(a.MinLength, 0) != 1 || ptr.Deref(a.MaxLength, 0) != 253 {
			t.Errorf("Sandbox spec.agentID length %v..%v, want 1..253", a.MinLength, a.MaxLength)
		}
		phase := v.Schema.OpenAPIV3Schema.Properties["status"].Properties["phase"]
		var phases []string
		for _, e := range phase.Enum {
			phases = append(phases, strings.Trim(string(e.Raw), `"`))
		}
		if want := []string{"Pending", "Running", "IdleStopping", "Stopped", "Resuming", "Error"}; !slices.Equal(phases, want) {
			t.Errorf("Sandbox status.phase enum %v, want %v", phases, want)
		}
		for _, col := range []string{"Agent", "Phase"} {
			if !hasColumn(v.AdditionalPrinterColumns, col) {
				t.Errorf("Sandbox: no %s column", col)
			}
		}
	}

	if crd := crds["SandboxTemplate"]; crd != nil {
		spec := crd.Spec.Versions[0].Schema.OpenAPIV3Schema.Properties["spec"]
		ws := spec.Properties["workspace"]
		checks := []struct {
			path string
			prop apiextensionsv1.JSONSchemaProps
			want string
		}{
			{"runtimeClassName", spec.Properties["runtimeClassName"], `"gvisor"`},
			{"idleTimeout", spec.Properties["idleTimeout"], `"1h"`},
			{"checkpointsKept", spec.Properties["checkpointsKept"], fmt.Sprint(v1alpha1.DefaultCheckpointsKept)},
			{"workspace", ws, `{}`},
			{"workspace.size", ws.Properties["size"], `"1Gi"`},
			{"workspace.mountPath", ws.Properties["mountPath"], `"/workspace"`},
			{"python", spec.Properties["python"], `{}`},
		}
		for _, c := range checks {
			if c.prop.Default == nil || string(c.prop.Default.Raw) != c.want {
				t.Errorf("SandboxTemplate spec.%s default %v, want %s", c.path, c.prop.Default, c.want)
			}
		}
	}
}

func hasColumn(cols []apiextensionsv1.CustomResourceColumnDefinition, name string) bool {
	return slices.ContainsFunc(cols, func(c apiextensionsv1.CustomResourceColumnDefinition) bool { return c.Name == name })
}

func hasRule(p apiextensionsv1.JSONSchemaProps, rule string) bool {
	return slices.ContainsFunc(p.XValidations, func(r apiextensionsv1.ValidationRule) bool { return r.Rule == rule })
}

// undocumented lists the schema properties without a description, below the
// root's spec and status: the doc comments are the API's documentation.
func undocumented(p *apiextensionsv1.JSONSchemaProps, path string) []string {
	var out []string
	for name, sub := range p.Properties {
		if path == "" && name != "spec" && name != "status" {
			continue
		}
		if sub.Description == "" {
			out = append(out, path+"."+name)
		}
		out = append(out, undocumented(&sub, path+"."+name)...)
	}
	if p.Items != nil && p.Items.Schema != nil {
		out = append(out, undocumented(p.Items.Schema, path+"[]")...)
	}
	slices.Sort(out)
	return out
}

// TestCRDsOnAPIServer applies the CRDs to the shared test cluster and checks
// what only a real kube-apiserver can: that the schemas and CEL rules are
// accepted, that defaults are applied and that immutability is enforced.
func TestCRDsOnAPIServer(t *testing.T) {
	cfg, _ := testenv.Shared(t)
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()

	ext, err := apiextensionsclient.NewForConfig(cfg)
	if err != nil {
		t.Fatal(err)
	}
	for _, crd := range loadCRDs(t) {
		if err := applyCRD(ctx, ext, crd); err != nil {
			t.Fatal(err)
		}
	}

	c, err := client.New(cfg, client.Options{Scheme: newScheme(t)})
	if err != nil {
		t.Fatal(err)
	}
	ns := &corev1.Namespace{ObjectMeta: metav1.ObjectMeta{Name: "api-v1alpha1-" + randSuffix(t)}}
	if err := c.Create(ctx, ns); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		// A fresh context: the test's may be done. Deleting the namespace
		// takes its objects with it.
		ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
		defer cancel()
		if err := c.Delete(ctx, ns); err != nil && !apierrors.IsNotFound(err) {
			t.Errorf("delete namespace: %v", err)
		}
	})

	t.Run("TemplateDefaults", func(t *testing.T) {
		tp := &v1alpha1.SandboxTemplate{ObjectMeta: metav1.ObjectMeta{Name: "minimal", Namespace: ns.Name}}
		create(ctx, t, c, tp)
		got := &v1alpha1.SandboxTemplate{}
		if err := c.Get(ctx, client.ObjectKeyFromObject(tp), got); err != nil {
			t.Fatal(err)
		}
		s := got.Spec
		if s.RuntimeClassName != v1alpha1.DefaultRuntimeClassName || s.IdleTimeout.Duration != time.Hour ||
			s.Workspace.Size.Cmp(resource.MustParse("1Gi")) != 0 || s.Workspace.MountPath != "/workspace" ||
			s.Python.DefaultTimeout.Duration != 30*time.Second || s.Python.MaxTimeout.Duration != 2*time.Minute {
			t.Errorf("defaults not applied: %+v", s)
		}

		// Go clients omit zero structs and durations, so a partly set
		// workspace or python policy still gets the other defaults.
		partial := &v1alpha1.SandboxTemplate{
			ObjectMeta: metav1.ObjectMeta{Name: "partial", Namespace: ns.Name},
			Spec: v1alpha1.SandboxTemplateSpec{
				Workspace: v1alpha1.WorkspaceSpec{StorageClassName: ptr.To("standard")},
				Python:    v1alpha1.PythonPolicy{MaxTimeout: metav1.Duration{Duration: 10 * time.Second}},
			},
		}
		create(ctx, t, c, partial)
		if w, p := partial.Spec.Workspace, partial.Spec.Python; w.Size.Cmp(resource.MustParse("1Gi")) != 0 || w.MountPath != "/workspace" ||
			p.DefaultTimeout.Duration != 30*time.Second || p.MaxTimeout.Duration != 10*time.Second {
			t.Errorf("defaults not applied around set fields: %+v %+v", w, p)
		}

		full := fullTemplate()
		full.Namespace, full.Status = ns.Name, v1alpha1.SandboxTemplateStatus{}
		create(ctx, t, c, full)
	})

	t.Run("SandboxImmutability", func(t *testing.T) {
		sb := &v1alpha1.Sandbox{
			ObjectMeta: metav1.ObjectMeta{Name: "agent", Namespace: ns.Name},
			Spec:       v1alpha1.SandboxSpec{AgentID: "agent-1", TemplateRef: v1alpha1.LocalObjectReference{Name: "minimal"}},
		}
		create(ctx, t, c, sb)

		changed := sb.DeepCopy()
		changed.Spec.AgentID = "agent-2"
		expectInvalid(t, c.Update(ctx, changed), "agentID is immutable")

		changed = sb.DeepCopy()
		changed.Spec.TemplateRef.Name = "other"
		expectInvalid(t, c.Update(ctx, changed), "templateRef is immutable")

		// The rest of the spec stays mutable.
		mutable := sb.DeepCopy()
		mutable.Spec.IdleTimeout = &metav1.Duration{Duration: 5 * time.Minute}
		if err := c.Update(ctx, mutable); err != nil {
			t.Errorf("update idleTimeout: %v", err)
		}

		// Status is a subresource: the controller's write goes through.
		mutable.Status.Phase = v1alpha1.SandboxPhaseRunning
		mutable.Status.ServiceEndpoint = v1alpha1.SupervisorEndpoint("10.0.0.1")
		if err := c.Status().Update(ctx, mutable); err != nil {
			t.Errorf("update status: %v", err)
		}

		bad := &v1alpha1.Sandbox{
			ObjectMeta: metav1.ObjectMeta{Name: "bad", Namespace: ns.Name},
			Spec:       v1alpha1.SandboxSpec{AgentID: "a", TemplateRef: v1alpha1.LocalObjectReference{Name: "minimal"}, IdleTimeout: &metav1.Duration{}},
		}
		expectInvalid(t, c.Create(ctx, bad), "idleTimeout must be positive")
	})

	t.Run("WarmPoolScale", func(t *testing.T) {
		wp := &v1alpha1.SandboxWarmPool{
			ObjectMeta: metav1.ObjectMeta{Name: "pool", Namespace: ns.Name},
			Spec:       v1alpha1.SandboxWarmPoolSpec{TemplateRef: v1alpha1.LocalObjectReference{Name: "minimal"}, Replicas: 0},
		}
		create(ctx, t, c, wp)
		scale := &autoscalingv1.Scale{}
		if err := c.SubResource("scale").Get(ctx, wp, scale); err != nil {
			t.Fatalf("get scale: %v", err)
		}
		if scale.Spec.Replicas != 0 {
			t.Errorf("scale spec.replicas = %d, want 0", scale.Spec.Replicas)
		}
		scale.Spec.Replicas = 4
		if err := c.SubResource("scale").Update(ctx, wp, client.WithSubResourceBody(scale)); err != nil {
			t.Fatalf("update scale: %v", err)
		}
		if err := c.Get(ctx, client.ObjectKeyFromObject(wp), wp); err != nil {
			t.Fatal(err)
		}
		if wp.Spec.Replicas != 4 {
			t.Errorf("spec.replicas after scaling = %d, want 4", wp.Spec.Replicas)
		}
	})

	t.Run("Validation", func(t *testing.T) {
		proxy := fullEgressProxy()
		proxy.Namespace, proxy.Status = ns.Name, v1alpha1.EgressProxyStatus{}
		create(ctx, t, c, proxy)

		perAgent := &v1alpha1.EgressProxy{
			ObjectMeta: metav1.ObjectMeta{Name: "per-agent", Namespace: ns.Name},
			Spec:       v1alpha1.EgressProxySpec{AllowedDomains: []v1alpha1.Domain{"pypi.org"}},
		}
		create(ctx, t, c, perAgent)
		if perAgent.Spec.Mode != v1alpha1.EgressProxyModePerAgent {
			t.Errorf("default mode %q, want PerAgent", perAgent.Spec.Mode)
		}

		cases := []struct {
			name string
			obj  client.Object
			want string
		}{
			{"replicas in PerAgent mode", &v1alpha1.EgressProxy{
				ObjectMeta: metav1.ObjectMeta{Name: "r", Namespace: ns.Name},
				Spec:       v1alpha1.EgressProxySpec{Replicas: ptr.To[int32](2)},
			}, "replicas applies only to mode Shared"},
			{"bad CIDR", &v1alpha1.EgressProxy{
				ObjectMeta: metav1.ObjectMeta{Name: "c", Namespace: ns.Name},
				Spec:       v1alpha1.EgressProxySpec{DeniedCIDRs: []v1alpha1.CIDR{"10.0.0.0/33"}},
			}, "must be a CIDR"},
			{"bad allowed CIDR", &v1alpha1.EgressProxy{
				ObjectMeta: metav1.ObjectMeta{Name: "ac", Namespace: ns.Name},
				Spec:       v1alpha1.EgressProxySpec{AllowedCIDRs: []v1alpha1.AllowedCIDR{"10.0.0.0/33"}},
			}, "must be a CIDR"},
			// An exception may never reach loopback or metadata, however it
			// is spelled: inside the range, around it, or IPv4-mapped.
			{"allowed CIDR inside loopback", &v1alpha1.EgressProxy{
				ObjectMeta: metav1.ObjectMeta{Name: "al", Namespace: ns.Name},
				Spec:       v1alpha1.EgressProxySpec{AllowedCIDRs: []v1alpha1.AllowedCIDR{"127.0.0.1/32"}},
			}, "must not overlap"},
			{"allowed CIDR around metadata", &v1alpha1.EgressProxy{
				ObjectMeta: metav1.ObjectMeta{Name: "am", Namespace: ns.Name},
				Spec:       v1alpha1.EgressProxySpec{AllowedCIDRs: []v1alpha1.AllowedCIDR{"128.0.0.0/1"}},
			}, "must not overlap"},
			{"allowed CIDR everything", &v1alpha1.EgressProxy{
				ObjectMeta: metav1.ObjectMeta{Name: "aa", Namespace: ns.Name},
				Spec:       v1alpha1.EgressProxySpec{AllowedCIDRs: []v1alpha1.AllowedCIDR{"::/0"}},
			}, "must not overlap"},
			{"allowed CIDR IPv4-mapped", &v1alpha1.EgressProxy{
				ObjectMeta: metav1.ObjectMeta{Name: "a6", Namespace: ns.Name},
				Spec:       v1alpha1.EgressProxySpec{AllowedCIDRs: []v1alpha1.AllowedCIDR{"::ffff:10.0.0.0/104"}},
			}, "must be a CIDR"},
			{"bad runtime class", &v1alpha1.EgressProxy{
				ObjectMeta: metav1.ObjectMeta{Name: "rc", Namespace: ns.Name},
				Spec:       v1alpha1.EgressProxySpec{RuntimeClassName: "gVisor"},
			}, "spec.runtimeClassName"},
			{"credentials in the upstream URL", &v1alpha1.EgressProxy{
				ObjectMeta: metav1.ObjectMeta{Name: "u", Namespace: ns.Name},
				Spec:       v1alpha1.EgressProxySpec{Upstream: &v1alpha1.EgressUpstream{URL: "http://user:pw@proxy:8080"}},
			}, "spec.upstream.url"},
			{"MCP server with command and url", &v1alpha1.SandboxTemplate{
				ObjectMeta: metav1.ObjectMeta{Name: "mcp", Namespace: ns.Name},
				Spec:       v1alpha1.SandboxTemplateSpec{MCPServers: []v1alpha1.MCPServer{{Name: "m", Command: "x", URL: "https://mcp.example.com/mcp"}}},
			}, "set exactly one of command (a stdio server) and url"},
			{"MCP server with neither command nor url", &v1alpha1.SandboxTemplate{
				ObjectMeta: metav1.ObjectMeta{Name: "mcp", Namespace: ns.Name},
				Spec:       v1alpha1.SandboxTemplateSpec{MCPServers: []v1alpha1.MCPServer{{Name: "m"}}},
			}, "set exactly one of command (a stdio server) and url"},
			{"remote MCP server with args", &v1alpha1.SandboxTemplate{
				ObjectMeta: metav1.ObjectMeta{Name: "mcp", Namespace: ns.Name},
				Spec:       v1alpha1.SandboxTemplateSpec{MCPServers: []v1alpha1.MCPServer{{Name: "m", URL: "https://mcp.example.com/mcp", Args: []string{"-v"}}}},
			}, "args and env apply only to a stdio server"},
			{"remote MCP server with env", &v1alpha1.SandboxTemplate{
				ObjectMeta: metav1.ObjectMeta{Name: "mcp", Namespace: ns.Name},
				Spec:       v1alpha1.SandboxTemplateSpec{MCPServers: []v1alpha1.MCPServer{{Name: "m", URL: "https://mcp.example.com/mcp", Env: map[string]string{"K": "v"}}}},
			}, "args and env apply only to a stdio server"},
			{"remote MCP server over ftp", &v1alpha1.SandboxTemplate{
				ObjectMeta: metav1.ObjectMeta{Name: "mcp", Namespace: ns.Name},
				Spec:       v1alpha1.SandboxTemplateSpec{MCPServers: []v1alpha1.MCPServer{{Name: "m", URL: "ftp://mcp.example.com/mcp"}}},
			}, "url must be an http or https URL with a host"},
			{"remote MCP server without a host", &v1alpha1.SandboxTemplate{
				ObjectMeta: metav1.ObjectMeta{Name: "mcp", Namespace: ns.Name},
				Spec:       v1alpha1.SandboxTemplateSpec{MCPServers: []v1alpha1.MCPServer{{Name: "m", URL: "http:///mcp"}}},
			}, "url must be an http or https URL with a host"},
			{"negative workspace", &v1alpha1.SandboxTemplate{
				ObjectMeta: metav1.ObjectMeta{Name: "w", Namespace: ns.Name},
				Spec:       v1alpha1.SandboxTemplateSpec{Workspace: v1alpha1.WorkspaceSpec{Size: resource.MustParse("-1Gi")}},
			}, "size must be positive"},
			{"workspace on /tmp", &v1alpha1.SandboxTemplate{
				ObjectMeta: metav1.ObjectMeta{Name: "wt", Namespace: ns.Name},
				Spec:       v1alpha1.SandboxTemplateSpec{Workspace: v1alpha1.WorkspaceSpec{MountPath: "/tmp"}},
			}, "the platform mounts its own volumes there"},
			{"secret files over the supervisor", &v1alpha1.SandboxTemplate{
				ObjectMeta: metav1.ObjectMeta{Name: "sb", Namespace: ns.Name},
				Spec:       v1alpha1.SandboxTemplateSpec{SecretFiles: []v1alpha1.SecretFile{{SecretName: "s", MountPath: "/agentbox/bin/x"}}},
			}, "the platform mounts its own volumes there"},
			{"secret files in the workspace", &v1alpha1.SandboxTemplate{
				ObjectMeta: metav1.ObjectMeta{Name: "sw", Namespace: ns.Name},
				Spec:       v1alpha1.SandboxTemplateSpec{SecretFiles: []v1alpha1.SecretFile{{SecretName: "s", MountPath: "/workspace/.keys"}}},
			}, "secretFiles may not be mounted in the workspace"},
			{"environments as large as the default workspace", &v1alpha1.SandboxTemplate{
				ObjectMeta: metav1.ObjectMeta{Name: "pe", Namespace: ns.Name},
				Spec: v1alpha1.SandboxTemplateSpec{Python: v1alpha1.PythonPolicy{Environments: &v1alpha1.PythonEnvironments{
					MaxSize: ptr.To(resource.MustParse("1Gi"))}}},
			}, "maxSize must be smaller than workspace.size"},
			{"environments larger than the workspace", &v1alpha1.SandboxTemplate{
				ObjectMeta: metav1.ObjectMeta{Name: "pw", Namespace: ns.Name},
				Spec: v1alpha1.SandboxTemplateSpec{Workspace: v1alpha1.WorkspaceSpec{Size: resource.MustParse("4Gi")},
					Python: v1alpha1.PythonPolicy{Environments: &v1alpha1.PythonEnvironments{MaxSize: ptr.To(resource.MustParse("5Gi"))}}},
			}, "maxSize must be smaller than workspace.size"},
			{"environments time-to-live too short", &v1alpha1.SandboxTemplate{
				ObjectMeta: metav1.ObjectMeta{Name: "pt", Namespace: ns.Name},
				Spec: v1alpha1.SandboxTemplateSpec{Python: v1alpha1.PythonPolicy{Environments: &v1alpha1.PythonEnvironments{
					TTL: &metav1.Duration{Duration: time.Second}}}},
			}, "ttl must be at least 1m"},
			{"too many environments", &v1alpha1.SandboxTemplate{
				ObjectMeta: metav1.ObjectMeta{Name: "pc", Namespace: ns.Name},
				Spec:       v1alpha1.SandboxTemplateSpec{Python: v1alpha1.PythonPolicy{Environments: &v1alpha1.PythonEnvironments{MaxCount: 65}}},
			}, "spec.python.environments.maxCount"},
			{"checkpoints too often", &v1alpha1.SandboxTemplate{
				ObjectMeta: metav1.ObjectMeta{Name: "ck", Namespace: ns.Name},
				Spec:       v1alpha1.SandboxTemplateSpec{CheckpointInterval: &metav1.Duration{Duration: 5 * time.Second}},
			}, "checkpointInterval must be at least 10s"},
			{"too many checkpoints kept", &v1alpha1.SandboxTemplate{
				ObjectMeta: metav1.ObjectMeta{Name: "ck", Namespace: ns.Name},
				Spec:       v1alpha1.SandboxTemplateSpec{CheckpointsKept: 11},
			}, "spec.checkpointsKept"},
			{"Managed pool without nodeSelector", &v1alpha1.GVisorNodePool{
				ObjectMeta: metav1.ObjectMeta{Name: "gvnp-" + randSuffix(t)},
				Spec:       v1alpha1.GVisorNodePoolSpec{Mode: v1alpha1.GVisorNodePoolModeManaged},
			}, "nodeSelector is required in Managed mode"},
		}
		for _, tc := range cases {
			expectInvalid(t, c.Create(ctx, tc.obj), tc.want)
		}

		pool := fullNodePool()
		pool.Name, pool.Status = "gvnp-"+randSuffix(t), v1alpha1.GVisorNodePoolStatus{}
		create(ctx, t, c, pool)
		t.Cleanup(func() {
			ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
			defer cancel()
			if err := c.Delete(ctx, pool); err != nil && !apierrors.IsNotFound(err) {
				t.Errorf("delete %s: %v", pool.Name, err)
			}
		})
	})
}

// applyCRD creates or updates a CRD and waits until it is established.
// Other packages' tests apply the same CRDs concurrently, so AlreadyExists
// and conflicts are expected.
func applyCRD(ctx context.Context, ext apiextensionsclient.Interface, crd *apiextensionsv1.CustomResourceDefinition) error {
	crds := ext.ApiextensionsV1().CustomResourceDefinitions()
	err := retry.RetryOnConflict(retry.DefaultRetry, func() error {
		cur, err := crds.Get(ctx, crd.Name, metav1.GetOptions{})
		if apierrors.IsNotFound(err) {
			_, err = crds.Create(ctx, crd, metav1.CreateOptions{})
			if apierrors.IsAlreadyExists(err) {
				return apierrors.NewConflict(apiextensionsv1.Resource("customresourcedefinitions"), crd.Name, err)
			}
			return err
		}
		if err != nil {
			return err
		}
		if equality.Semantic.DeepEqual(cur.Spec, crd.Spec) {
			return nil
		}
		upd := crd.DeepCopy()
		upd.ResourceVersion = cur.ResourceVersion
		_, err = crds.Update(ctx, upd, metav1.UpdateOptions{})
		return err
	})
	if err != nil {
		return fmt.Errorf("apply CRD %s: %w", crd.Name, err)
	}
	err = wait.PollUntilContextCancel(ctx, 200*time.Millisecond, true, func(ctx context.Context) (bool, error) {
		cur, err := crds.Get(ctx, crd.Name, metav1.GetOptions{})
		if err != nil {
			return false, err
		}
		for _, c := range cur.Status.Conditions {
			if c.Type == apiextensionsv1.Established && c.Status == apiextensionsv1.ConditionTrue {
				return true, nil
			}
		}
		return false, nil
	})
	if err != nil {
		return fmt.Errorf("wait for CRD %s to be established: %w", crd.Name, err)
	}
	return nil
}

// create creates obj, retrying while discovery has not caught up with a CRD
// that was just established.
func create(ctx context.Context, t *testing.T, c client.Client, obj client.Object) {
	t.Helper()
	err := wait.PollUntilContextCancel(ctx, 200*time.Millisecond, true, func(ctx context.Context) (bool, error) {
		err := c.Create(ctx, obj)
		if meta.IsNoMatchError(err) || apierrors.IsNotFound(err) {
			return false, nil
		}
		return err == nil, err
	})
	if err != nil {
		t.Fatalf("create %T %s: %v", obj, obj.GetName(), err)
	}
}

func expectInvalid(t *testing.T, err error, substr string) {
	t.Helper()
	if err == nil {
		t.Errorf("accepted; want it refused with %q", substr)
		return
	}
	if !apierrors.IsInvalid(err) || !strings.Contains(err.Error(), substr) {
		t.Errorf("err = %v; want Invalid mentioning %q", err, substr)
		return
	}
	t.Logf("refused as expected: %v", err)
}

func randSuffix(t testing.TB) string {
	b := make([]byte, 4)
	if _, err := rand.Read(b); err != nil {
		t.Fatal(err)
	}
	return hex.EncodeToString(b)
}

// TestReservedMountPathsInCRD checks that both mountPath rules of the
// SandboxTemplate CRD refuse exactly ReservedMountPaths, which the
// controller mounts and the provider checks before apply.
func TestReservedMountPathsInCRD(t *testing.T) {
	quoted := make([]string, len(v1alpha1.ReservedMountPaths))
	for i, p := range v1alpha1.ReservedMountPaths {
		quoted[i] = "'" + p + "'"
	}
	want := "![" + strings.Join(quoted, ", ") + "].exists(p, self == p || self.startsWith(p + '/'))"
	spec := loadCRDs(t)["SandboxTemplate"].Spec.Versions[0].Schema.OpenAPIV3Schema.Properties["spec"]
	for name, prop := range map[string]apiextensionsv1.JSONSchemaProps{
		"workspace.mountPath":   spec.Properties["workspace"].Properties["mountPath"],
		"secretFiles.mountPath": spec.Properties["secretFiles"].Items.Schema.Properties["mountPath"],
	} {
		if len(prop.XValidations) != 1 || prop.XValidations[0].Rule != want {
			t.Errorf("%s rules %+v, want the one rule %s", name, prop.XValidations, want)
		}
	}
}
