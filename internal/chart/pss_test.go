package chart

import (
	"io/fs"
	"path"
	"slices"
	"strings"
	"testing"

	appsv1 "k8s.io/api/apps/v1"
	batchv1 "k8s.io/api/batch/v1"
	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/runtime"
	psapi "k8s.io/pod-security-admission/api"
	"k8s.io/pod-security-admission/policy"

	"github.com/agentbox/terraform-provider-agentbox/charts"
)

// The chart's workloads are checked against the restricted Pod Security
// Standard with the library the API server's PodSecurity admission itself
// uses, so a namespace labelled pod-security.kubernetes.io/enforce=restricted
// admits what the chart renders.

var restrictedLatest = psapi.LevelVersion{Level: psapi.LevelRestricted, Version: psapi.LatestVersion()}

// podWorkload is one pod template of a rendered object.
type podWorkload struct {
	kind, namespace, name string
	meta                  *metav1.ObjectMeta
	spec                  *corev1.PodSpec
}

func (w podWorkload) String() string { return w.kind + " " + w.namespace + "/" + w.name }

// podWorkloads returns the pod templates of every pod-bearing object, and
// fails on an object that carries a pod template of a kind it does not
// know, so that a new kind of workload cannot slip past the check.
func podWorkloads(t *testing.T, r *rendered) []podWorkload {
	t.Helper()
	var out []podWorkload
	for _, o := range r.objects {
		var w podWorkload
		switch o := o.(type) {
		case *appsv1.Deployment:
			w = podWorkload{"Deployment", o.Namespace, o.Name, &o.Spec.Template.ObjectMeta, &o.Spec.Template.Spec}
		case *appsv1.DaemonSet:
			w = podWorkload{"DaemonSet", o.Namespace, o.Name, &o.Spec.Template.ObjectMeta, &o.Spec.Template.Spec}
		case *appsv1.StatefulSet:
			w = podWorkload{"StatefulSet", o.Namespace, o.Name, &o.Spec.Template.ObjectMeta, &o.Spec.Template.Spec}
		case *appsv1.ReplicaSet:
			w = podWorkload{"ReplicaSet", o.Namespace, o.Name, &o.Spec.Template.ObjectMeta, &o.Spec.Template.Spec}
		case *batchv1.Job:
			w = podWorkload{"Job", o.Namespace, o.Name, &o.Spec.Template.ObjectMeta, &o.Spec.Template.Spec}
		case *batchv1.CronJob:
			w = podWorkload{"CronJob", o.Namespace, o.Name, &o.Spec.JobTemplate.Spec.Template.ObjectMeta, &o.Spec.JobTemplate.Spec.Template.Spec}
		case *corev1.Pod:
			w = podWorkload{"Pod", o.Namespace, o.Name, &o.ObjectMeta, &o.Spec}
		case *corev1.ReplicationController:
			if o.Spec.Template != nil {
				w = podWorkload{"ReplicationController", o.Namespace, o.Name, &o.Spec.Template.ObjectMeta, &o.Spec.Template.Spec}
			}
		default:
			u, err := runtime.DefaultUnstructuredConverter.ToUnstructured(o)
			if err != nil {
				t.Fatal(err)
			}
			spec, _ := u["spec"].(map[string]any)
			if _, ok := spec["template"]; ok {
				t.Fatalf("%T carries a pod template this test does not evaluate", o)
			}
			if _, ok := spec["jobTemplate"]; ok {
				t.Fatalf("%T carries a job template this test does not evaluate", o)
			}
			continue
		}
		if w.spec != nil {
			out = append(out, w)
		}
	}
	return out
}

func newEvaluator(t *testing.T) policy.Evaluator {
	t.Helper()
	ev, err := policy.NewEvaluator(policy.DefaultChecks(), nil)
	if err != nil {
		t.Fatal(err)
	}
	return ev
}

// violations evaluates a pod against restricted/latest and returns the
// failed checks as "reason (detail)".
func violations(ev policy.Evaluator, meta *metav1.ObjectMeta, spec *corev1.PodSpec) []string {
	var out []string
	for _, res := range ev.EvaluatePod(restrictedLatest, meta, spec) {
		if !res.Allowed {
			out = append(out, res.ForbiddenReason+" ("+res.ForbiddenDetail+")")
		}
	}
	return out
}

const installerDaemonSet = "agentbox-runsc-installer"

// pssValueSets are the defaults and value sets that add containers,
// volumes, environment and scheduling to the chart's pods.
var pssValueSets = map[string]string{
	"defaults":         "",
	"volume snapshots": "snapshot: {driver: volumesnapshot}",
	"archive snapshots and PostgreSQL": "snapshot: {driver: archive, archive: {endpoint: 'https://s3.example.com', bucket: b, credentialsSecret: s3}}\n" +
		"store: {existingSecret: pg}\nreplicaCount: 2",
	"SQLite on an emptyDir": "store: {persistence: {enabled: false}}",
	"existing claim and extras": "store: {persistence: {existingClaim: mine}}\n" +
		"extraEnv: [{name: GODEBUG, value: 'x=1'}, {name: UID, valueFrom: {fieldRef: {fieldPath: metadata.uid}}}]\n" +
		"extraArgs: ['--verbose']\nresources: {requests: {cpu: 50m, memory: 128Mi}, limits: {memory: 512Mi}}\n" +
		"global: {imagePullSecrets: [{name: pull}]}\npriorityClassName: high\ntolerations: [{key: k, operator: Exists}]\n" +
		"podAnnotations: {a: b}\npodLabels: {tier: control}",
	"runsc installer": "runscInstaller: {enabled: true, priorityClassName: system-node-critical, " +
		"resources: {requests: {cpu: 10m, memory: 16Mi}}, nodeSelector: {pool-kind: gvisor}}",
}

// TestPodSecurityRestricted renders the chart with each value set and
// checks every pod it would run against restricted/latest. The one
// exception is the runsc installer DaemonSet; see
// TestPodSecurityInstallerException for what it may and may not break.
func TestPodSecurityRestricted(t *testing.T) {
	ev := newEvaluator(t)
	sawInstaller := false
	for name, raw := range pssValueSets {
		t.Run(name, func(t *testing.T) {
			workloads := podWorkloads(t, renderRaw(t, raw))
			if !slices.ContainsFunc(workloads, func(w podWorkload) bool { return w.name == ControlPlaneDeployment }) {
				t.Fatalf("no control plane Deployment among %v", workloads)
			}
			for _, w := range workloads {
				v := violations(ev, w.meta, w.spec)
				if w.kind == "DaemonSet" && w.name == installerDaemonSet {
					sawInstaller = true
					if len(v) == 0 {
						t.Errorf("%s meets restricted now: drop it from the documented exceptions", w)
					}
					continue
				}
				if w.namespace != testNamespace {
					t.Errorf("%s is outside the release namespace", w)
				}
				for _, s := range v {
					t.Errorf("%s violates restricted/latest: %s", w, s)
				}
				t.Logf("%s: restricted/latest, %d containers, %d init containers, %d volumes",
					w, len(w.spec.Containers), len(w.spec.InitContainers), len(w.spec.Volumes))
			}
		})
	}
	if !sawInstaller {
		t.Error("no value set rendered the runsc installer, so its exception went unchecked")
	}
}

// TestPodSecurityInstallerException pins the documented exception: the
// runsc installer DaemonSet's install init container runs as root and
// mounts a hostPath, because it writes runsc into a root-owned folder of
// the node. Nothing else in the pod may break restricted, and the
// exception must be the one values.yaml tells operators about.
func TestPodSecurityInstallerException(t *testing.T) {
	ev := newEvaluator(t)
	r := renderRaw(t, pssValueSets["runsc installer"])
	var installer []podWorkload
	for _, w := range podWorkloads(t, r) {
		if len(violations(ev, w.meta, w.spec)) > 0 {
			installer = append(installer, w)
		}
	}
	if len(installer) != 1 || installer[0].kind != "DaemonSet" || installer[0].name != installerDaemonSet {
		t.Fatalf("workloads that violate restricted: %v, want only DaemonSet %s", installer, installerDaemonSet)
	}
	w := installer[0]
	// The exception lives in a namespace of its own, which the chart
	// creates privileged, so that the release namespace can enforce
	// restricted.
	if w.namespace == testNamespace {
		t.Errorf("%s runs in the release namespace, which then could not enforce restricted", w)
	}
	ns, ok := find[*corev1.Namespace](r, w.namespace)
	if !ok || ns.Labels[psapi.EnforceLevelLabel] != string(psapi.LevelPrivileged) {
		t.Errorf("%s: its namespace is not rendered labelled %s=privileged (%v)", w, psapi.EnforceLevelLabel, ns)
	}

	// The failed checks are exactly those of root and a hostPath, and they
	// name the install container and the host folder's volume only.
	got := ev.EvaluatePod(restrictedLatest, w.meta, w.spec)
	allowedReasons := map[string]bool{
		"hostPath volumes":        true, // baseline
		"restricted volume types": true,
		"runAsNonRoot != true":    true,
		"runAsUser=0":             true,
	}
	var reasons []string
	for _, res := range got {
		if res.Allowed {
			continue
		}
		reasons = append(reasons, res.ForbiddenReason)
		if !allowedReasons[res.ForbiddenReason] {
			t.Errorf("%s violates a check outside the documented exception: %s (%s)", w, res.ForbiddenReason, res.ForbiddenDetail)
		}
		if strings.Contains(res.ForbiddenDetail, `"wait"`) ||
			!(strings.Contains(res.ForbiddenDetail, `"install"`) || strings.Contains(res.ForbiddenDetail, `"host-bin"`)) {
			t.Errorf("%s: %s names more than the install container and its host-bin volume: %s", w, res.ForbiddenReason, res.ForbiddenDetail)
		}
	}
	t.Logf("%s violates restricted/latest, as documented: %v", w, violations(ev, w.meta, w.spec))
	for _, want := range []string{"restricted volume types", "runAsUser=0"} {
		if !slices.Contains(reasons, want) {
			t.Errorf("%s: %q is not among the failed checks %v; is the exception still needed as documented?", w, want, reasons)
		}
	}
	// Baseline does not admit it either (hostPath), which is why the
	// namespace must be privileged rather than baseline.
	var baseline []string
	for _, res := range ev.EvaluatePod(psapi.LevelVersion{Level: psapi.LevelBaseline, Version: psapi.LatestVersion()}, w.meta, w.spec) {
		if !res.Allowed {
			baseline = append(baseline, res.ForbiddenReason)
		}
	}
	if !slices.Equal(baseline, []string{"hostPath volumes"}) {
		t.Errorf("%s fails baseline/latest with %v, want only hostPath volumes", w, baseline)
	}

	// Without the install container and its host folder, the pod meets
	// restricted: the pod-level settings and the wait container are clean.
	rest := w.spec.DeepCopy()
	rest.InitContainers = slices.DeleteFunc(rest.InitContainers, func(c corev1.Container) bool { return c.Name == "install" })
	rest.Volumes = slices.DeleteFunc(rest.Volumes, func(v corev1.Volume) bool { return v.HostPath != nil })
	if len(rest.InitContainers) != 0 || len(rest.Volumes) != 0 || len(rest.Containers) != 1 {
		t.Fatalf("the installer's pod changed shape: init %v, volumes %v", rest.InitContainers, rest.Volumes)
	}
	for _, s := range violations(ev, w.meta, rest) {
		t.Errorf("%s without its install container still violates restricted/latest: %s", w, s)
	}

	// The exception is documented where operators read about the value.
	values, err := fs.ReadFile(charts.FS, path.Join(ChartName, "values.yaml"))
	if err != nil {
		t.Fatal(err)
	}
	_, installerDoc, ok := strings.Cut(string(values), "\nrunscInstaller:")
	if !ok || !strings.Contains(installerDoc, "pod-security.kubernetes.io/enforce=privileged") || !strings.Contains(installerDoc, "namespace of its own") {
		t.Error("values.yaml's runscInstaller section does not tell operators that the installer runs in a namespace of its own, labelled privileged")
	}
}

// TestPodSecurityCatchesViolations makes sure the evaluation above can
// fail: values that weaken the control plane's security context must be
// reported, naming the check.
func TestPodSecurityCatchesViolations(t *testing.T) {
	ev := newEvaluator(t)
	cases := map[string]struct{ raw, reason string }{
		"privilege escalation": {"securityContext: {allowPrivilegeEscalation: true}", "allowPrivilegeEscalation != false"},
		"added capability":     {"securityContext: {capabilities: {add: [NET_ADMIN]}}", "unrestricted capabilities"},
		"no seccomp profile":   {"podSecurityContext: {seccompProfile: null}\nsecurityContext: {seccompProfile: null}", "seccompProfile"},
		"root":                 {"podSecurityContext: {runAsNonRoot: null, runAsUser: 0}\nsecurityContext: {runAsNonRoot: null, runAsUser: 0}", "runAsUser=0"},
	}
	for name, tc := range cases {
		t.Run(name, func(t *testing.T) {
			d := renderRaw(t, tc.raw).deployment()
			v := violations(ev, &d.Spec.Template.ObjectMeta, &d.Spec.Template.Spec)
			if !slices.ContainsFunc(v, func(s string) bool { return strings.Contains(s, tc.reason) }) {
				t.Errorf("violations %q lack %q", v, tc.reason)
			}
		})
	}
}
