package chart

import (
	"strings"
	"testing"

	appsv1 "k8s.io/api/apps/v1"
	corev1 "k8s.io/api/core/v1"
	networkingv1 "k8s.io/api/networking/v1"
	policyv1 "k8s.io/api/policy/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/labels"
)

// haValues are the least a highly available control plane needs: more than
// one replica, PostgreSQL, and a snapshot store every replica reaches.
const haValues = "replicaCount: 2\nstore: {dsn: 'postgres://agentbox@db.invalid/agentbox'}\n" +
	"snapshot: {archive: {endpoint: 'https://s3.invalid', bucket: agentbox, credentialsSecret: agentbox-s3}}\n"

func quantity(rl corev1.ResourceList, name corev1.ResourceName) string {
	q, ok := rl[name]
	if !ok {
		return ""
	}
	return q.String()
}

// selects reports whether sel selects pods labelled podLabels.
func selects(t *testing.T, sel *metav1.LabelSelector, podLabels map[string]string) bool {
	t.Helper()
	s, err := metav1.LabelSelectorAsSelector(sel)
	if err != nil {
		t.Fatal(err)
	}
	return !s.Empty() && s.Matches(labels.Set(podLabels))
}

// TestResourceDefaults checks the measured defaults: both workloads are
// Burstable with a memory limit and no CPU limit, a user's key changes that
// key only (Helm merges maps), and null drops a default.
func TestResourceDefaults(t *testing.T) {
	res := func(c corev1.Container) [4]string {
		r := c.Resources
		return [4]string{quantity(r.Requests, corev1.ResourceCPU), quantity(r.Requests, corev1.ResourceMemory),
			quantity(r.Limits, corev1.ResourceCPU), quantity(r.Limits, corev1.ResourceMemory)}
	}
	cases := []struct {
		name, raw           string
		controlPlane, runsc [4]string // cpu and memory requests, cpu and memory limits
	}{
		{"defaults", "runscInstaller: {enabled: true}", [4]string{"100m", "128Mi", "", "512Mi"}, [4]string{"10m", "32Mi", "", "256Mi"}},
		{"empty maps keep the defaults", "resources: {}\nrunscInstaller: {enabled: true, resources: {}}",
			[4]string{"100m", "128Mi", "", "512Mi"}, [4]string{"10m", "32Mi", "", "256Mi"}},
		{"one key", "resources: {limits: {memory: 2Gi}}\nrunscInstaller: {enabled: true, resources: {requests: {cpu: 50m}}}",
			[4]string{"100m", "128Mi", "", "2Gi"}, [4]string{"50m", "32Mi", "", "256Mi"}},
		{"a CPU limit", "resources: {limits: {cpu: '2'}}\nrunscInstaller: {enabled: true}", [4]string{"100m", "128Mi", "2", "512Mi"}, [4]string{"10m", "32Mi", "", "256Mi"}},
		{"null drops a key", "resources: {limits: {memory: null}}\nrunscInstaller: {enabled: true}", [4]string{"100m", "128Mi", "", ""}, [4]string{"10m", "32Mi", "", "256Mi"}},
		{"null drops all", "resources: null\nrunscInstaller: {enabled: true, resources: null}", [4]string{}, [4]string{}},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			r := renderRaw(t, tc.raw)
			if got := res(container(t, r.deployment())); got != tc.controlPlane {
				t.Errorf("control plane resources %q, want %q", got, tc.controlPlane)
			}
			pod := must[*appsv1.DaemonSet](r, "agentbox-runsc-installer").Spec.Template.Spec
			for _, c := range append(pod.InitContainers, pod.Containers...) {
				if got := res(c); got != tc.runsc {
					t.Errorf("installer container %s resources %q, want %q", c.Name, got, tc.runsc)
				}
			}
		})
	}
}

// TestPodDisruptionBudget checks that the budget exists exactly when there
// is more than one replica to keep, selects the control plane pods, and
// takes one of maxUnavailable and minAvailable.
func TestPodDisruptionBudget(t *testing.T) {
	if _, ok := find[*policyv1.PodDisruptionBudget](render(t, Values{}), "agentbox-controlplane"); ok {
		t.Error("a PodDisruptionBudget at one replica, where it would block drains or do nothing")
	}
	r := renderRaw(t, haValues)
	pdb := must[*policyv1.PodDisruptionBudget](r, "agentbox-controlplane")
	if pdb.Namespace != testNamespace {
		t.Errorf("namespace %q", pdb.Namespace)
	}
	if !selects(t, pdb.Spec.Selector, r.deployment().Spec.Template.Labels) {
		t.Errorf("selector %v does not select the control plane pods %v", pdb.Spec.Selector, r.deployment().Spec.Template.Labels)
	}
	if pdb.Spec.MaxUnavailable == nil || pdb.Spec.MaxUnavailable.String() != "1" || pdb.Spec.MinAvailable != nil {
		t.Errorf("maxUnavailable %v minAvailable %v, want maxUnavailable 1 alone", pdb.Spec.MaxUnavailable, pdb.Spec.MinAvailable)
	}

	for raw, want := range map[string]string{
		"podDisruptionBudget: {minAvailable: 1}":       "1",
		"podDisruptionBudget: {minAvailable: '50%'}":   "50%",
		"podDisruptionBudget: {maxUnavailable: '50%'}": "",
	} {
		pdb := must[*policyv1.PodDisruptionBudget](renderRaw(t, haValues+raw), "agentbox-controlplane")
		switch {
		case want != "" && (pdb.Spec.MinAvailable == nil || pdb.Spec.MinAvailable.String() != want || pdb.Spec.MaxUnavailable != nil):
			t.Errorf("%s: minAvailable %v maxUnavailable %v, want minAvailable %s alone", raw, pdb.Spec.MinAvailable, pdb.Spec.MaxUnavailable, want)
		case want == "" && (pdb.Spec.MaxUnavailable == nil || pdb.Spec.MaxUnavailable.String() != "50%" || pdb.Spec.MinAvailable != nil):
			t.Errorf("%s: maxUnavailable %v minAvailable %v, want maxUnavailable 50%% alone", raw, pdb.Spec.MaxUnavailable, pdb.Spec.MinAvailable)
		}
	}
	if _, err := RenderInstall(testNamespace, DefaultReleaseName, Values{Raw: haValues + "podDisruptionBudget: {maxUnavailable: null}"}); err == nil ||
		!strings.Contains(err.Error(), "podDisruptionBudget needs maxUnavailable or minAvailable") {
		t.Errorf("a budget with neither maxUnavailable nor minAvailable: %v", err)
	}
	if _, ok := find[*policyv1.PodDisruptionBudget](renderRaw(t, haValues+"podDisruptionBudget: {enabled: false}"), "agentbox-controlplane"); ok {
		t.Error("a PodDisruptionBudget with podDisruptionBudget.enabled false")
	}
}

// TestPodAntiAffinity checks the spread of the replicas over nodes: soft
// by default with more than one replica, hard or none on request, nothing
// at one replica, and the user's own podAntiAffinity and
// topologySpreadConstraints win.
func TestPodAntiAffinity(t *testing.T) {
	if a := render(t, Values{}).deployment().Spec.Template.Spec.Affinity; a != nil {
		t.Errorf("affinity %+v at one replica", a)
	}

	d := renderRaw(t, haValues).deployment()
	a := d.Spec.Template.Spec.Affinity
	if a == nil || a.PodAntiAffinity == nil || len(a.PodAntiAffinity.RequiredDuringSchedulingIgnoredDuringExecution) != 0 ||
		len(a.PodAntiAffinity.PreferredDuringSchedulingIgnoredDuringExecution) != 1 {
		t.Fatalf("affinity %+v, want one preferred pod anti-affinity term", a)
	}
	term := a.PodAntiAffinity.PreferredDuringSchedulingIgnoredDuringExecution[0]
	if term.Weight != 100 || term.PodAffinityTerm.TopologyKey != corev1.LabelHostname ||
		!selects(t, term.PodAffinityTerm.LabelSelector, d.Spec.Template.Labels) {
		t.Errorf("term %+v, want weight 100 on %s selecting the control plane pods", term, corev1.LabelHostname)
	}

	hard := renderRaw(t, haValues+"podAntiAffinityPreset: hard").deployment().Spec.Template.Spec.Affinity
	if hard == nil || hard.PodAntiAffinity == nil || len(hard.PodAntiAffinity.PreferredDuringSchedulingIgnoredDuringExecution) != 0 ||
		len(hard.PodAntiAffinity.RequiredDuringSchedulingIgnoredDuringExecution) != 1 ||
		hard.PodAntiAffinity.RequiredDuringSchedulingIgnoredDuringExecution[0].TopologyKey != corev1.LabelHostname {
		t.Errorf("hard affinity %+v, want one required term on %s", hard, corev1.LabelHostname)
	}
	if a := renderRaw(t, haValues+"podAntiAffinityPreset: none").deployment().Spec.Template.Spec.Affinity; a != nil {
		t.Errorf("affinity %+v with podAntiAffinityPreset none", a)
	}

	// The user's node affinity is kept beside the preset.
	node := renderRaw(t, haValues+"affinity: {nodeAffinity: {requiredDuringSchedulingIgnoredDuringExecution: "+
		"{nodeSelectorTerms: [{matchExpressions: [{key: pool, operator: In, values: [system]}]}]}}}").deployment().Spec.Template.Spec.Affinity
	if node == nil || node.NodeAffinity == nil || node.PodAntiAffinity == nil ||
		len(node.PodAntiAffinity.PreferredDuringSchedulingIgnoredDuringExecution) != 1 {
		t.Errorf("affinity %+v, want the user's node affinity and the preset", node)
	}
	// The user's pod anti-affinity replaces the preset.
	own := renderRaw(t, haValues+"affinity: {podAntiAffinity: {preferredDuringSchedulingIgnoredDuringExecution: "+
		"[{weight: 7, podAffinityTerm: {topologyKey: topology.kubernetes.io/zone, labelSelector: {matchLabels: {a: b}}}}]}}").
		deployment().Spec.Template.Spec.Affinity
	if own == nil || own.PodAntiAffinity == nil || len(own.PodAntiAffinity.PreferredDuringSchedulingIgnoredDuringExecution) != 1 ||
		own.PodAntiAffinity.PreferredDuringSchedulingIgnoredDuringExecution[0].Weight != 7 {
		t.Errorf("affinity %+v, want the user's pod anti-affinity alone", own)
	}

	if c := render(t, Values{}).deployment().Spec.Template.Spec.TopologySpreadConstraints; len(c) != 0 {
		t.Errorf("topology spread constraints %+v by default", c)
	}
	spread := renderRaw(t, haValues+"topologySpreadConstraints: [{maxSkew: 1, topologyKey: topology.kubernetes.io/zone, "+
		"whenUnsatisfiable: ScheduleAnyway, labelSelector: {matchLabels: {app.kubernetes.io/component: controlplane}}}]").
		deployment().Spec.Template.Spec.TopologySpreadConstraints
	if len(spread) != 1 || spread[0].TopologyKey != corev1.LabelTopologyZone || spread[0].WhenUnsatisfiable != corev1.ScheduleAnyway {
		t.Errorf("topology spread constraints %+v", spread)
	}
}

// ingressRule is one ingress rule reduced to the container port its port
// names and its peers.
type ingressRule struct {
	port  int32
	peers []networkingv1.NetworkPolicyPeer
}

// ingressRules resolves the policy's named ports against the container's,
// so that a port name that names nothing fails the test.
func ingressRules(t *testing.T, np *networkingv1.NetworkPolicy, c corev1.Container) []ingressRule {
	t.Helper()
	var out []ingressRule
	for _, rule := range np.Spec.Ingress {
		if len(rule.Ports) != 1 || rule.Ports[0].Port == nil || rule.Ports[0].Protocol == nil || *rule.Ports[0].Protocol != corev1.ProtocolTCP {
			t.Fatalf("rule %+v, want one TCP port", rule)
		}
		var port int32
		for _, p := range c.Ports {
			if p.Name == rule.Ports[0].Port.String() {
				port = p.ContainerPort
			}
		}
		if port == 0 {
			t.Fatalf("rule port %s names no port of the container", rule.Ports[0].Port)
		}
		out = append(out, ingressRule{port: port, peers: rule.From})
	}
	return out
}

// TestNetworkPolicy checks the control plane's policy: ingress only, the
// Compute API and health ports from anywhere by default, the metrics port
// from the configured peers only, and a deny-all policy for the runsc
// installer.
func TestNetworkPolicy(t *testing.T) {
	r := render(t, Values{})
	np := must[*networkingv1.NetworkPolicy](r, "agentbox-controlplane")
	d := r.deployment()
	if np.Namespace != testNamespace || !selects(t, &np.Spec.PodSelector, d.Spec.Template.Labels) {
		t.Errorf("policy %s/%s selects %v, want the control plane pods %v", np.Namespace, np.Name, np.Spec.PodSelector, d.Spec.Template.Labels)
	}
	// Ingress only: egress to the API server, sandboxes, stores and DNS stays open.
	if len(np.Spec.PolicyTypes) != 1 || np.Spec.PolicyTypes[0] != networkingv1.PolicyTypeIngress || len(np.Spec.Egress) != 0 {
		t.Errorf("policy types %v, egress %v; want Ingress only", np.Spec.PolicyTypes, np.Spec.Egress)
	}
	rules := ingressRules(t, np, container(t, d))
	if len(rules) != 2 || rules[0].port != 8443 || len(rules[0].peers) != 0 || rules[1].port != 8081 || len(rules[1].peers) != 0 {
		t.Errorf("rules %+v, want the API (8443) and health (8081) ports from any source, and no metrics rule", rules)
	}

	r = renderRaw(t, "networkPolicy:\n  api: {from: [{namespaceSelector: {matchLabels: {kubernetes.io/metadata.name: agents}}}, {ipBlock: {cidr: 10.0.0.0/8}}]}\n"+
		"  metrics: {from: [{namespaceSelector: {matchLabels: {kubernetes.io/metadata.name: monitoring}}, podSelector: {matchLabels: {app: prometheus}}}]}\n")
	np = must[*networkingv1.NetworkPolicy](r, "agentbox-controlplane")
	rules = ingressRules(t, np, container(t, r.deployment()))
	if len(rules) != 3 {
		t.Fatalf("rules %+v, want API, health and metrics", rules)
	}
	if api := rules[0]; api.port != 8443 || len(api.peers) != 2 || api.peers[0].NamespaceSelector == nil ||
		api.peers[0].NamespaceSelector.MatchLabels["kubernetes.io/metadata.name"] != "agents" ||
		api.peers[1].IPBlock == nil || api.peers[1].IPBlock.CIDR != "10.0.0.0/8" {
		t.Errorf("API rule %+v", api)
	}
	if health := rules[1]; health.port != 8081 || len(health.peers) != 0 {
		t.Errorf("health rule %+v, want from any source", health)
	}
	if m := rules[2]; m.port != 8080 || len(m.peers) != 1 || m.peers[0].NamespaceSelector == nil || m.peers[0].PodSelector == nil ||
		m.peers[0].PodSelector.MatchLabels["app"] != "prometheus" {
		t.Errorf("metrics rule %+v", m)
	}

	// The notes say how to open the metrics port, and only while it is closed.
	notes := func(raw string) string {
		rel, err := RenderInstall(testNamespace, DefaultReleaseName, Values{Raw: raw})
		if err != nil {
			t.Fatal(err)
		}
		return rel.Notes
	}
	if n := notes(""); !strings.Contains(n, "networkPolicy.metrics.from") || !strings.Contains(n, "\n\nCRDs:") {
		t.Errorf("NOTES do not say how to open the metrics port:\n%s", n)
	}
	if n := notes("networkPolicy: {metrics: {from: [{podSelector: {}}]}}"); strings.Contains(n, "networkPolicy.metrics.from") || !strings.Contains(n, "\n\nCRDs:") {
		t.Errorf("NOTES with metrics.from set:\n%s", n)
	}

	if _, ok := find[*networkingv1.NetworkPolicy](renderRaw(t, "networkPolicy: {enabled: false}\nrunscInstaller: {enabled: true}"), "agentbox-controlplane"); ok {
		t.Error("a NetworkPolicy with networkPolicy.enabled false")
	}
	if _, ok := find[*networkingv1.NetworkPolicy](render(t, Values{}), "agentbox-runsc-installer"); ok {
		t.Error("the installer's NetworkPolicy without the installer")
	}

	r = renderRaw(t, "runscInstaller: {enabled: true}")
	deny := must[*networkingv1.NetworkPolicy](r, "agentbox-runsc-installer")
	ds := must[*appsv1.DaemonSet](r, "agentbox-runsc-installer")
	if deny.Namespace != ds.Namespace || !selects(t, &deny.Spec.PodSelector, ds.Spec.Template.Labels) ||
		selects(t, &deny.Spec.PodSelector, r.deployment().Spec.Template.Labels) {
		t.Errorf("installer policy %s/%s selects %v; want the installer pods in %s only", deny.Namespace, deny.Name, deny.Spec.PodSelector, ds.Namespace)
	}
	if len(deny.Spec.PolicyTypes) != 2 || len(deny.Spec.Ingress) != 0 || len(deny.Spec.Egress) != 0 {
		t.Errorf("installer policy %+v, want Ingress and Egress with no rule", deny.Spec)
	}
}
