package controller

import (
	"encoding/json"
	"fmt"
	"net/netip"
	"net/url"
	"sort"
	"strconv"
	"strings"

	appsv1 "k8s.io/api/apps/v1"
	corev1 "k8s.io/api/core/v1"
	networkingv1 "k8s.io/api/networking/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/apimachinery/pkg/util/intstr"
	"k8s.io/utils/ptr"

	"github.com/agentbox/terraform-provider-agentbox/internal/api/v1alpha1"
	"github.com/agentbox/terraform-provider-agentbox/internal/egressproxy"
)

// The egress proxy's objects. PerAgent mode gives each sandbox a proxy pod
// and Service named after the sandbox's workload and owned by the Sandbox,
// so they go with it; the policy ConfigMap and the proxies' NetworkPolicy
// belong to the EgressProxy. Shared mode runs one Deployment and Service
// owned by the EgressProxy.

const (
	// EgressProxyPort is the port proxy pods serve and their Services
	// expose; the sandboxes' HTTP_PROXY points at it.
	EgressProxyPort = 3128
	// egressMetricsPort serves the proxy's Prometheus metrics. It is a
	// separate listener so that NetworkPolicy can keep sandboxes off it.
	egressMetricsPort = 9090

	egressContainerName = "proxy"
	egressPortName      = "proxy"
	egressMetricsName   = "metrics"

	// egressPolicyKey is the ConfigMap key of the proxy's policy file, in
	// the format of egressproxy.FileConfig.
	egressPolicyKey = "policy.yaml"
	// egressUpstreamCredentialsKey is the file name the upstream
	// credentials are mounted under, whatever the Secret's key is called.
	egressUpstreamCredentialsKey = "credentials"
	// egressClientsKey is the key of the Shared proxy's client credentials
	// Secret: one "sandbox:password" line per sandbox.
	egressClientsKey = "clients"

	egressConfigDir      = "/etc/agentbox/egress"
	egressUpstreamDir    = "/etc/agentbox/egress-upstream"
	egressClientsDir     = "/etc/agentbox/egress-clients"
	egressVolumeConfig   = "policy"
	egressVolumeUpstream = "upstream"
	egressVolumeClients  = "clients"

	// egressUID is the proxy image's nonroot user.
	egressUID int64 = 65532

	// DefaultEgressProxyImage is the proxy image when the reconciler is
	// given none.
	DefaultEgressProxyImage = "agentbox/agentbox-egress-proxy:dev"

	// controlPlaneComponentLabel selects the control plane's pods (the
	// chart's selector labels) for the sandboxes' ingress rule.
	controlPlaneComponentLabel = "app.kubernetes.io/component"
	controlPlaneComponent      = "controlplane"

	// DefaultClusterDomain is the DNS domain of the cluster's Services when
	// the reconciler is given none.
	DefaultClusterDomain = "cluster.local"
)

// privateRanges are the destinations a proxy pod's NetworkPolicy never lets
// it reach: cluster-internal and node networks, loopback, link-local (with
// the cloud metadata address), CGNAT and the benchmarking range, the same
// list the proxy denies after DNS by default.
var privateRanges = []string{
	"10.0.0.0/8", "172.16.0.0/12", "192.168.0.0/16", "100.64.0.0/10",
	"127.0.0.0/8", "169.254.0.0/16", "198.18.0.0/15", "0.0.0.0/8",
}

var privateRangesV6 = []string{"fc00::/7", "fe80::/10", "::1/128"}

// EgressServiceName is the name of a PerAgent sandbox's proxy pod and
// Service, derived from the sandbox's workload name.
func EgressServiceName(workload string) string { return workload + "-egress" }

// egressConfigMapName names the policy ConfigMap of an EgressProxy.
func egressConfigMapName(proxy string) string { return proxy + "-egress-policy" }

// egressClientsSecretName names a Shared proxy's client credentials Secret.
func egressClientsSecretName(proxy string) string { return proxy + "-egress-clients" }

// egressProxyNetworkPolicyName names the NetworkPolicy of an EgressProxy's
// pods.
func egressProxyNetworkPolicyName(proxy string) string { return proxy + "-egress-proxy" }

// SandboxNetworkPolicyName names a sandbox's NetworkPolicy.
func SandboxNetworkPolicyName(sandbox string) string { return sandbox + "-sandbox" }

func proxyMode(ep *v1alpha1.EgressProxy) v1alpha1.EgressProxyMode {
	if ep.Spec.Mode == "" {
		return v1alpha1.EgressProxyModePerAgent
	}
	return ep.Spec.Mode
}

// egressPolicyData is the proxy's policy file: the EgressProxy's lists in
// the proxy's -config format. Lists are sorted so that an unchanged spec
// gives byte-identical data and the proxy does not reload for nothing.
func egressPolicyData(ep *v1alpha1.EgressProxy) (string, error) {
	sorted := func(in []string) []string {
		out := append([]string(nil), in...)
		sort.Strings(out)
		return out
	}
	var cfg struct {
		AllowedDomains []string `json:"allowedDomains,omitempty"`
		DeniedDomains  []string `json:"deniedDomains,omitempty"`
		DeniedCIDRs    []string `json:"deniedCIDRs,omitempty"`
		AllowedCIDRs   []string `json:"allowedCIDRs,omitempty"`
		// Credentials name their values' files, never the values.
		Credentials []egressproxy.FileCredential `json:"credentials,omitempty"`
	}
	for _, d := range ep.Spec.AllowedDomains {
		cfg.AllowedDomains = append(cfg.AllowedDomains, string(d))
	}
	for _, d := range ep.Spec.DeniedDomains {
		cfg.DeniedDomains = append(cfg.DeniedDomains, string(d))
	}
	for _, c := range ep.Spec.DeniedCIDRs {
		cfg.DeniedCIDRs = append(cfg.DeniedCIDRs, string(c))
	}
	for _, c := range ep.Spec.AllowedCIDRs {
		cfg.AllowedCIDRs = append(cfg.AllowedCIDRs, string(c))
	}
	cfg.AllowedDomains, cfg.DeniedDomains, cfg.DeniedCIDRs = sorted(cfg.AllowedDomains), sorted(cfg.DeniedDomains), sorted(cfg.DeniedCIDRs)
	cfg.AllowedCIDRs = sorted(cfg.AllowedCIDRs)
	cfg.Credentials = egressFileCredentials(ep)
	// JSON is YAML, and the proxy reads either.
	b, err := json.Marshal(cfg)
	if err != nil {
		return "", fmt.Errorf("encode the policy of EgressProxy %s: %w", ep.Name, err)
	}
	return string(b) + "\n", nil
}

// egressConfigData is the policy ConfigMap's data: the policy file and,
// when the spec has one, the destinations' CA bundle.
func egressConfigData(ep *v1alpha1.EgressProxy, policy string) map[string]string {
	data := map[string]string{egressPolicyKey: policy}
	if ep.Spec.DestinationCABundle != "" {
		data[egressDestinationsKey] = ep.Spec.DestinationCABundle
	}
	return data
}

func desiredEgressConfigMap(ep *v1alpha1.EgressProxy) (*corev1.ConfigMap, error) {
	data, err := egressPolicyData(ep)
	if err != nil {
		return nil, err
	}
	return &corev1.ConfigMap{
		ObjectMeta: metav1.ObjectMeta{
			Name:      egressConfigMapName(ep.Name),
			Namespace: ep.Namespace,
			Labels:    map[string]string{v1alpha1.LabelEgressProxy: ep.Name},
		},
		Data: egressConfigData(ep, data),
	}, nil
}

// egressPodOptions are the settings of the proxy pods that come from the
// control plane rather than from the EgressProxy.
type egressPodOptions struct {
	image string
	// baseDeniedCIDRs replace the proxy's default denied ranges when
	// non-nil (its -deny-cidrs flag); the EgressProxy's deniedCIDRs are
	// denied on top.
	baseDeniedCIDRs []string
	// agent is the agent served (PerAgent), for the access log.
	agent string
	// clientAuth turns on per-sandbox client credentials (Shared).
	clientAuth bool
	// runtimeClass of the proxy pods; empty leaves the cluster's default.
	runtimeClass string
}

// egressPodSpec is the proxy's pod: restricted Pod Security, no API
// token, the policy ConfigMap and the upstream credentials mounted as
// files. The credentials never go into the environment, where they would
// show in the pod spec and in /proc of every process.
func egressPodSpec(ep *v1alpha1.EgressProxy, o egressPodOptions) corev1.PodSpec {
	args, volumes, mounts := egressProxyInputs(ep, o)
	var runtimeClass *string
	if o.runtimeClass != "" {
		runtimeClass = ptr.To(o.runtimeClass)
	}
	if ep.Spec.RuntimeClassName != "" {
		runtimeClass = ptr.To(ep.Spec.RuntimeClassName)
	}
	return corev1.PodSpec{
		RuntimeClassName:             runtimeClass,
		AutomountServiceAccountToken: ptr.To(false),
		EnableServiceLinks:           ptr.To(false),
		SecurityContext: &corev1.PodSecurityContext{
			RunAsNonRoot:   ptr.To(true),
			RunAsUser:      ptr.To(egressUID),
			RunAsGroup:     ptr.To(egressUID),
			FSGroup:        ptr.To(egressUID),
			SeccompProfile: &corev1.SeccompProfile{Type: corev1.SeccompProfileTypeRuntimeDefault},
		},
		Volumes: volumes,
		Containers: []corev1.Container{{
			Name:            egressContainerName,
			Image:           o.image,
			ImagePullPolicy: corev1.PullIfNotPresent,
			Args:            args,
			Ports: []corev1.ContainerPort{
				{Name: egressPortName, ContainerPort: EgressProxyPort, Protocol: corev1.ProtocolTCP},
				{Name: egressMetricsName, ContainerPort: egressMetricsPort, Protocol: corev1.ProtocolTCP},
			},
			// The proxy listens only after its policy and credentials files
			// loaded (a broken one is fatal at startup), so an open port
			// means it enforces the policy.
			ReadinessProbe: &corev1.Probe{
				ProbeHandler:     corev1.ProbeHandler{TCPSocket: &corev1.TCPSocketAction{Port: intstr.FromString(egressPortName)}},
				PeriodSeconds:    2,
				TimeoutSeconds:   1,
				FailureThreshold: 3,
			},
			SecurityContext: &corev1.SecurityContext{
				RunAsNonRoot:             ptr.To(true),
				RunAsUser:                ptr.To(egressUID),
				RunAsGroup:               ptr.To(egressUID),
				AllowPrivilegeEscalation: ptr.To(false),
				ReadOnlyRootFilesystem:   ptr.To(true),
				Capabilities:             &corev1.Capabilities{Drop: []corev1.Capability{"ALL"}},
				SeccompProfile:           &corev1.SeccompProfile{Type: corev1.SeccompProfileTypeRuntimeDefault},
			},
			VolumeMounts:             mounts,
			TerminationMessagePolicy: corev1.TerminationMessageFallbackToLogsOnError,
		}},
	}
}

// egressProxyInputs are the proxy's arguments, and the volumes and mounts
// of the files they name: its policy, the upstream credentials and, for a
// Shared proxy, its clients' credentials.
func egressProxyInputs(ep *v1alpha1.EgressProxy, o egressPodOptions) ([]string, []corev1.Volume, []corev1.VolumeMount) {
	args := []string{
		"-listen=:" + strconv.Itoa(EgressProxyPort),
		"-metrics-listen=:" + strconv.Itoa(egressMetricsPort),
		"-config=" + egressConfigDir + "/" + egressPolicyKey,
	}
	if o.baseDeniedCIDRs != nil {
		args = append(args, "-deny-cidrs="+strings.Join(o.baseDeniedCIDRs, ","))
	}
	if o.agent != "" {
		args = append(args, "-agent="+o.agent)
	}
	volumes := []corev1.Volume{{Name: egressVolumeConfig, VolumeSource: corev1.VolumeSource{
		ConfigMap: &corev1.ConfigMapVolumeSource{LocalObjectReference: corev1.LocalObjectReference{Name: egressConfigMapName(ep.Name)}},
	}}}
	mounts := []corev1.VolumeMount{{Name: egressVolumeConfig, MountPath: egressConfigDir, ReadOnly: true}}
	if up := ep.Spec.Upstream; up != nil {
		args = append(args, "-upstream="+strings.TrimSuffix(up.URL, "/"))
		if ref := up.CredentialsSecretRef; ref != nil {
			args = append(args, "-upstream-credentials-file="+egressUpstreamDir+"/"+egressUpstreamCredentialsKey)
			volumes = append(volumes, corev1.Volume{Name: egressVolumeUpstream, VolumeSource: corev1.VolumeSource{Secret: &corev1.SecretVolumeSource{
				SecretName:  ref.Name,
				Items:       []corev1.KeyToPath{{Key: ref.Key, Path: egressUpstreamCredentialsKey}},
				DefaultMode: ptr.To[int32](0o440),
			}}})
			mounts = append(mounts, corev1.VolumeMount{Name: egressVolumeUpstream, MountPath: egressUpstreamDir, ReadOnly: true})
		}
	}
	credArgs, credVolumes, credMounts := egressCredentialInputs(ep)
	args, volumes, mounts = append(args, credArgs...), append(volumes, credVolumes...), append(mounts, credMounts...)
	if o.clientAuth {
		args = append(args, "-client-credentials-file="+egressClientsDir+"/"+egressClientsKey)
		volumes = append(volumes, corev1.Volume{Name: egressVolumeClients, VolumeSource: corev1.VolumeSource{Secret: &corev1.SecretVolumeSource{
			SecretName:  egressClientsSecretName(ep.Name),
			DefaultMode: ptr.To[int32](0o440),
		}}})
		mounts = append(mounts, corev1.VolumeMount{Name: egressVolumeClients, MountPath: egressClientsDir, ReadOnly: true})
	}
	return args, volumes, mounts
}

// perAgentProxyLabels select one sandbox's proxy pod. LabelSandbox is
// shared with the sandbox's own pod; LabelEgressProxy tells them apart.
func perAgentProxyLabels(ep *v1alpha1.EgressProxy, sbx *v1alpha1.Sandbox) map[string]string {
	return map[string]string{
		v1alpha1.LabelEgressProxy: ep.Name,
		v1alpha1.LabelSandbox:     sbx.Name,
		v1alpha1.LabelAgentIDHash: v1alpha1.AgentIDHash(sbx.Spec.AgentID),
	}
}

func desiredPerAgentProxyPod(ep *v1alpha1.EgressProxy, sbx *v1alpha1.Sandbox, o egressPodOptions) *corev1.Pod {
	o.agent, o.clientAuth = sbx.Spec.AgentID, false
	return &corev1.Pod{
		ObjectMeta: metav1.ObjectMeta{
			Name:        EgressServiceName(sbx.WorkloadName()),
			Namespace:   sbx.Namespace,
			Labels:      perAgentProxyLabels(ep, sbx),
			Annotations: egressPodAnnotations(ep),
		},
		Spec: egressPodSpec(ep, o),
	}
}

func desiredPerAgentProxyService(ep *v1alpha1.EgressProxy, sbx *v1alpha1.Sandbox) *corev1.Service {
	return proxyService(EgressServiceName(sbx.WorkloadName()), sbx.Namespace, perAgentProxyLabels(ep, sbx))
}

func proxyService(name, ns string, selector map[string]string) *corev1.Service {
	return &corev1.Service{
		ObjectMeta: metav1.ObjectMeta{Name: name, Namespace: ns, Labels: selector},
		Spec: corev1.ServiceSpec{
			Type:     corev1.ServiceTypeClusterIP,
			Selector: selector,
			Ports: []corev1.ServicePort{{
				Name: egressPortName, Port: EgressProxyPort, TargetPort: intstr.FromString(egressPortName), Protocol: corev1.ProtocolTCP,
			}},
		},
	}
}

// labelEgressShared marks the pods of a Shared proxy's Deployment (Shared
// mode is not implemented yet; sandboxes' policies already select them).
const labelEgressShared = v1alpha1.GroupName + "/egress-shared"

// egressProxyEndpoint is the URL a Service of the proxy is reached at by
// name, as status.readyEndpoints reports it.
func egressProxyEndpoint(svc, ns string) string {
	return fmt.Sprintf("http://%s.%s.svc:%d", svc, ns, EgressProxyPort)
}

// dnsPeer is the cluster DNS: kube-dns (CoreDNS keeps the label) in
// kube-system.
func dnsPeer() networkingv1.NetworkPolicyPeer {
	return networkingv1.NetworkPolicyPeer{
		NamespaceSelector: &metav1.LabelSelector{MatchLabels: map[string]string{"kubernetes.io/metadata.name": "kube-system"}},
		PodSelector:       &metav1.LabelSelector{MatchLabels: map[string]string{"k8s-app": "kube-dns"}},
	}
}

func dnsPorts() []networkingv1.NetworkPolicyPort {
	port := intstr.FromInt32(53)
	return []networkingv1.NetworkPolicyPort{
		{Protocol: ptr.To(corev1.ProtocolUDP), Port: &port},
		{Protocol: ptr.To(corev1.ProtocolTCP), Port: &port},
	}
}

func tcpPort(p int32) networkingv1.NetworkPolicyPort {
	port := intstr.FromInt32(p)
	return networkingv1.NetworkPolicyPort{Protocol: ptr.To(corev1.ProtocolTCP), Port: &port}
}

// desiredSandboxNetworkPolicy confines a sandbox pod: ingress only from
// the control plane's pods on the supervisor port, egress only to DNS and,
// when the template names a proxy, to that proxy's pods on the proxy
// port. It selects the sandbox's pod by LabelSandbox and excludes its
// proxy pod, which carries the same label. Without a proxy the sandbox
// reaches DNS and nothing else, as the SandboxTemplate API promises.
func desiredSandboxNetworkPolicy(sbx *v1alpha1.Sandbox, ep *v1alpha1.EgressProxy, platformNamespace string) *networkingv1.NetworkPolicy {
	egress := []networkingv1.NetworkPolicyEgressRule{{To: []networkingv1.NetworkPolicyPeer{dnsPeer()}, Ports: dnsPorts()}}
	if ep != nil {
		sel := map[string]string{v1alpha1.LabelEgressProxy: ep.Name}
		if proxyMode(ep) == v1alpha1.EgressProxyModePerAgent {
			sel[v1alpha1.LabelSandbox] = sbx.Name
		} else {
			sel[labelEgressShared] = "true"
		}
		egress = append(egress, networkingv1.NetworkPolicyEgressRule{
			To:    []networkingv1.NetworkPolicyPeer{{PodSelector: &metav1.LabelSelector{MatchLabels: sel}}},
			Ports: []networkingv1.NetworkPolicyPort{tcpPort(EgressProxyPort)},
		})
	}
	return &networkingv1.NetworkPolicy{
		ObjectMeta: metav1.ObjectMeta{
			Name:      SandboxNetworkPolicyName(sbx.Name),
			Namespace: sbx.Namespace,
			Labels:    sandboxLabels(sbx),
		},
		Spec: networkingv1.NetworkPolicySpec{
			PodSelector: metav1.LabelSelector{
				MatchLabels: map[string]string{v1alpha1.LabelSandbox: sbx.Name},
				MatchExpressions: []metav1.LabelSelectorRequirement{
					{Key: v1alpha1.LabelEgressProxy, Operator: metav1.LabelSelectorOpDoesNotExist},
				},
			},
			PolicyTypes: []networkingv1.PolicyType{networkingv1.PolicyTypeIngress, networkingv1.PolicyTypeEgress},
			Ingress: []networkingv1.NetworkPolicyIngressRule{{
				From: []networkingv1.NetworkPolicyPeer{{
					NamespaceSelector: &metav1.LabelSelector{MatchLabels: map[string]string{"kubernetes.io/metadata.name": platformNamespace}},
					PodSelector:       &metav1.LabelSelector{MatchLabels: map[string]string{controlPlaneComponentLabel: controlPlaneComponent}},
				}},
				Ports: []networkingv1.NetworkPolicyPort{tcpPort(v1alpha1.SupervisorPort)},
			}},
			Egress: egress,
		},
	}
}

// desiredProxyNetworkPolicy confines an EgressProxy's pods: ingress on the
// proxy port only from the namespace's sandbox pods (and on the metrics
// port from the platform namespace, for scraping), egress to DNS and to
// any address outside the private ranges. The proxy also refuses private
// addresses after DNS; the policy holds even if that check had a bug.
//
// Two things inside the private ranges are let through, each exactly: the
// spec's allowedCIDRs (less the deniedCIDRs inside them), which the proxy
// also lets through, and the upstream proxy when it is in the cluster (see
// upstreamEgressRule), without which an in-cluster upstream would be
// unreachable.
func desiredProxyNetworkPolicy(ep *v1alpha1.EgressProxy, platformNamespace string, upstream *networkingv1.NetworkPolicyEgressRule) *networkingv1.NetworkPolicy {
	egress := []networkingv1.NetworkPolicyEgressRule{
		{To: []networkingv1.NetworkPolicyPeer{dnsPeer()}, Ports: dnsPorts()},
		{To: []networkingv1.NetworkPolicyPeer{
			{IPBlock: &networkingv1.IPBlock{CIDR: "0.0.0.0/0", Except: append([]string(nil), privateRanges...)}},
			{IPBlock: &networkingv1.IPBlock{CIDR: "::/0", Except: append([]string(nil), privateRangesV6...)}},
		}},
	}
	if peers := allowedCIDRPeers(ep); len(peers) > 0 {
		egress = append(egress, networkingv1.NetworkPolicyEgressRule{To: peers})
	}
	if upstream != nil {
		egress = append(egress, *upstream)
	}
	return &networkingv1.NetworkPolicy{
		ObjectMeta: metav1.ObjectMeta{
			Name:      egressProxyNetworkPolicyName(ep.Name),
			Namespace: ep.Namespace,
			Labels:    map[string]string{v1alpha1.LabelEgressProxy: ep.Name},
		},
		Spec: networkingv1.NetworkPolicySpec{
			PodSelector: metav1.LabelSelector{MatchLabels: map[string]string{v1alpha1.LabelEgressProxy: ep.Name}},
			PolicyTypes: []networkingv1.PolicyType{networkingv1.PolicyTypeIngress, networkingv1.PolicyTypeEgress},
			Ingress: []networkingv1.NetworkPolicyIngressRule{
				{
					From: []networkingv1.NetworkPolicyPeer{{PodSelector: &metav1.LabelSelector{
						MatchExpressions: []metav1.LabelSelectorRequirement{
							{Key: v1alpha1.LabelSandbox, Operator: metav1.LabelSelectorOpExists},
							{Key: v1alpha1.LabelEgressProxy, Operator: metav1.LabelSelectorOpDoesNotExist},
						},
					}}},
					Ports: []networkingv1.NetworkPolicyPort{tcpPort(EgressProxyPort)},
				},
				{
					From: []networkingv1.NetworkPolicyPeer{{
						NamespaceSelector: &metav1.LabelSelector{MatchLabels: map[string]string{"kubernetes.io/metadata.name": platformNamespace}},
					}},
					Ports: []networkingv1.NetworkPolicyPort{tcpPort(egressMetricsPort)},
				},
			},
			Egress: egress,
		},
	}
}

// allowedCIDRPeers are the spec's allowedCIDRs as ipBlocks, each excepting
// the deniedCIDRs that lie strictly inside it, so that the policy lets out
// what the proxy lets out. A deniedCIDR covering a whole allowedCIDR drops
// that block. Sorted, so that the policy is stable.
func allowedCIDRPeers(ep *v1alpha1.EgressProxy) []networkingv1.NetworkPolicyPeer {
	var denied []netip.Prefix
	for _, c := range ep.Spec.DeniedCIDRs {
		if p, err := netip.ParsePrefix(string(c)); err == nil {
			denied = append(denied, p.Masked())
		}
	}
	allowed := make([]netip.Prefix, 0, len(ep.Spec.AllowedCIDRs))
	for _, c := range ep.Spec.AllowedCIDRs {
		// The CRD validated them; one that does not parse is no hole.
		if p, err := netip.ParsePrefix(string(c)); err == nil {
			allowed = append(allowed, p.Masked())
		}
	}
	sort.Slice(allowed, func(i, j int) bool { return allowed[i].String() < allowed[j].String() })
	var peers []networkingv1.NetworkPolicyPeer
	for _, a := range allowed {
		var except []string
		covered := false
		for _, d := range denied {
			switch {
			case d.Bits() <= a.Bits() && d.Contains(a.Addr()):
				covered = true
			case d.Bits() > a.Bits() && a.Contains(d.Addr()):
				except = append(except, d.String())
			}
		}
		if covered {
			continue
		}
		sort.Strings(except)
		peers = append(peers, networkingv1.NetworkPolicyPeer{IPBlock: &networkingv1.IPBlock{CIDR: a.String(), Except: except}})
	}
	return peers
}

// upstreamHostPort splits the upstream URL into its host and port, the
// port defaulting by scheme.
func upstreamHostPort(up *v1alpha1.EgressUpstream) (string, int32, error) {
	u, err := url.Parse(strings.TrimSuffix(up.URL, "/"))
	if err != nil {
		return "", 0, fmt.Errorf("upstream URL %q: %w", up.URL, err)
	}
	host := u.Hostname()
	if host == "" {
		return "", 0, fmt.Errorf("upstream URL %q has no host", up.URL)
	}
	port := int32(80)
	if u.Scheme == "https" {
		port = 443
	}
	if p := u.Port(); p != "" {
		n, err := strconv.ParseUint(p, 10, 16)
		if err != nil || n == 0 {
			return "", 0, fmt.Errorf("upstream URL %q: bad port %q", up.URL, p)
		}
		port = int32(n)
	}
	return strings.ToLower(strings.TrimSuffix(host, ".")), port, nil
}

// upstreamServiceKey names the Service an upstream host would be if it is
// one in the cluster: "name" (the proxy's namespace, as the pod's DNS
// search path has it), "name.namespace", "name.namespace.svc" or that
// followed by the cluster domain. Whether it is one is for the caller to
// find out: "proxy.corp" may as well be a name outside the cluster.
func upstreamServiceKey(host, proxyNamespace, clusterDomain string) (types.NamespacedName, bool) {
	if _, err := netip.ParseAddr(host); err == nil {
		return types.NamespacedName{}, false
	}
	if clusterDomain == "" {
		clusterDomain = DefaultClusterDomain
	}
	host = strings.TrimSuffix(host, "."+strings.Trim(clusterDomain, "."))
	labels := strings.Split(host, ".")
	switch {
	case len(labels) == 1:
		return types.NamespacedName{Namespace: proxyNamespace, Name: labels[0]}, true
	case len(labels) == 2, len(labels) == 3 && labels[2] == "svc":
		return types.NamespacedName{Namespace: labels[1], Name: labels[0]}, true
	}
	return types.NamespacedName{}, false
}

// upstreamEgressRule is the rule letting the proxy pods reach their
// upstream when the default rule's excepted private ranges would stop
// them, or nil when the default rule already does (a name outside the
// cluster) or no rule can name it.
//
//   - An IP literal gets an ipBlock of that one address, on the URL's port,
//     unless it is one of egressproxy.NeverAllowedCIDRs.
//   - A Service of the cluster (svc, found by upstreamServiceKey) gets its
//     pods, by the Service's selector in its namespace, on the target port
//     behind the URL's port: NetworkPolicy sees the connection after the
//     Service's address was translated to a pod's. A Service without a
//     selector (hand-made endpoints, ExternalName) has no pods to select
//     and gets no rule.
func upstreamEgressRule(ep *v1alpha1.EgressProxy, svc *corev1.Service) (*networkingv1.NetworkPolicyEgressRule, error) {
	if ep.Spec.Upstream == nil {
		return nil, nil
	}
	host, port, err := upstreamHostPort(ep.Spec.Upstream)
	if err != nil {
		return nil, err
	}
	if a, err := netip.ParseAddr(host); err == nil {
		a = a.Unmap()
		for _, never := range egressproxy.NeverAllowedCIDRs {
			// Loopback is the pod itself, which NetworkPolicy does not
			// govern; link-local holds the metadata service, which no
			// upstream setting opens to the proxies.
			if never.Contains(a) {
				return nil, nil
			}
		}
		return &networkingv1.NetworkPolicyEgressRule{
			To:    []networkingv1.NetworkPolicyPeer{{IPBlock: &networkingv1.IPBlock{CIDR: netip.PrefixFrom(a, a.BitLen()).String()}}},
			Ports: []networkingv1.NetworkPolicyPort{tcpPort(port)},
		}, nil
	}
	if svc == nil || len(svc.Spec.Selector) == 0 || svc.Spec.Type == corev1.ServiceTypeExternalName {
		return nil, nil
	}
	target := intstr.FromInt32(port)
	for _, sp := range svc.Spec.Ports {
		if sp.Port != port || (sp.Protocol != "" && sp.Protocol != corev1.ProtocolTCP) {
			continue
		}
		// An unset target port is the port itself; a named one is
		// resolved by the network plugin against the selected pods.
		if sp.TargetPort.Type == intstr.String || sp.TargetPort.IntVal != 0 {
			target = sp.TargetPort
		}
		break
	}
	sel := make(map[string]string, len(svc.Spec.Selector))
	for k, v := range svc.Spec.Selector {
		sel[k] = v
	}
	return &networkingv1.NetworkPolicyEgressRule{
		To: []networkingv1.NetworkPolicyPeer{{
			NamespaceSelector: &metav1.LabelSelector{MatchLabels: map[string]string{"kubernetes.io/metadata.name": svc.Namespace}},
			PodSelector:       &metav1.LabelSelector{MatchLabels: sel},
		}},
		Ports: []networkingv1.NetworkPolicyPort{{Protocol: ptr.To(corev1.ProtocolTCP), Port: &target}},
	}, nil
}

// Shared mode: one Deployment and Service per EgressProxy, and per-sandbox
// proxy credentials. Each sandbox gets a Secret with its own user name (its
// workload name) and a random password; the controller gathers them into
// the proxy's client credentials Secret, which the proxy reloads. The
// proxy logs the user as the agent, so one agent's requests can be told
// from another's, and a sandbox cannot pass for another.

const (
	// egressUserKey and egressPasswordKey are the keys of a sandbox's
	// proxy credentials Secret.
	egressUserKey     = "username"
	egressPasswordKey = "password"
	// egressPasswordEnv is the sandbox variable holding its proxy password,
	// from its credentials Secret; HTTP_PROXY refers to it with $(...) so
	// that the password is in no pod spec.
	egressPasswordEnv = "AGENTBOX_EGRESS_PROXY_PASSWORD"

	// labelEgressCredentials, on a sandbox's proxy credentials Secret,
	// names the EgressProxy it authenticates to.
	labelEgressCredentials = v1alpha1.GroupName + "/egress-credentials"

	// annotationEgressTemplateHash, on a Shared proxy's Deployment, is the
	// hash of the pod template the controller last wrote. Comparing it
	// rather than the template itself ignores the API server's defaults.
	annotationEgressTemplateHash = v1alpha1.GroupName + "/egress-template-hash"
)

// egressSharedName names a Shared proxy's Deployment and Service.
func egressSharedName(proxy string) string { return proxy + "-egress" }

// EgressCredentialsSecretName names a sandbox's own proxy credentials
// (Shared mode).
func EgressCredentialsSecretName(workload string) string { return workload + "-egress-credentials" }

func sharedProxyLabels(ep *v1alpha1.EgressProxy) map[string]string {
	return map[string]string{v1alpha1.LabelEgressProxy: ep.Name, labelEgressShared: "true"}
}

func desiredSharedService(ep *v1alpha1.EgressProxy) *corev1.Service {
	return proxyService(egressSharedName(ep.Name), ep.Namespace, sharedProxyLabels(ep))
}

func desiredSharedDeployment(ep *v1alpha1.EgressProxy, o egressPodOptions) (*appsv1.Deployment, error) {
	o.agent, o.clientAuth = "", true
	tmpl := corev1.PodTemplateSpec{
		ObjectMeta: metav1.ObjectMeta{Labels: sharedProxyLabels(ep), Annotations: egressPodAnnotations(ep)},
		Spec:       egressPodSpec(ep, o),
	}
	hash, err := podHash(&tmpl.Spec, tmpl.Annotations)
	if err != nil {
		return nil, err
	}
	return &appsv1.Deployment{
		ObjectMeta: metav1.ObjectMeta{
			Name:        egressSharedName(ep.Name),
			Namespace:   ep.Namespace,
			Labels:      sharedProxyLabels(ep),
			Annotations: map[string]string{annotationEgressTemplateHash: hash},
		},
		Spec: appsv1.DeploymentSpec{
			Replicas: ptr.To(ptr.Deref(ep.Spec.Replicas, 1)),
			Selector: &metav1.LabelSelector{MatchLabels: sharedProxyLabels(ep)},
			Template: tmpl,
		},
	}, nil
}

// egressClientsData is the proxy's client credentials file: a line per
// sandbox credentials Secret, sorted so that an unchanged set gives
// unchanged data.
func egressClientsData(secrets []corev1.Secret) []byte {
	var lines []string
	for _, s := range secrets {
		user, pw := string(s.Data[egressUserKey]), string(s.Data[egressPasswordKey])
		if user == "" || pw == "" || strings.ContainsAny(user, ":\n") || strings.Contains(pw, "\n") {
			continue
		}
		lines = append(lines, user+":"+pw)
	}
	sort.Strings(lines)
	return []byte(strings.Join(lines, "\n") + "\n")
}
