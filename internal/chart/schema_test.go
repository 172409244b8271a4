package chart

import (
	"io/fs"
	"path"
	"strings"
	"testing"

	"helm.sh/helm/v3/pkg/chartutil"
	corev1 "k8s.io/api/core/v1"

	"github.com/agentbox/terraform-provider-agentbox/charts"
)

// These tests drive values.schema.json through Helm itself (the same
// validation `helm install` and `helm template` run), so they hold for the
// schema as users meet it, not for another validator's reading of it.

// TestSchemaAcceptsDefaults checks that values.yaml satisfies the schema
// both as Helm loads it and when every key is given explicitly with its
// default, which is what a user who copies values.yaml and edits it does.
func TestSchemaAcceptsDefaults(t *testing.T) {
	ch, err := Load()
	if err != nil {
		t.Fatal(err)
	}
	if err := chartutil.ValidateAgainstSchema(ch, ch.Values); err != nil {
		t.Fatalf("values.yaml does not meet values.schema.json: %v", err)
	}
	raw, err := fs.ReadFile(charts.FS, path.Join(ChartName, chartutil.ValuesfileName))
	if err != nil {
		t.Fatal(err)
	}
	if _, err := RenderInstall(testNamespace, DefaultReleaseName, Values{Raw: string(raw)}); err != nil {
		t.Fatalf("values.yaml given as user values does not render: %v", err)
	}
	if _, err := RenderInstall(testNamespace, DefaultReleaseName, Values{}); err != nil {
		t.Fatalf("the defaults do not render: %v", err)
	}
}

// TestSchemaAcceptsGoodValues renders values that differ from the defaults
// but are valid, so that the hardening does not turn away real
// configurations: the typed values the Terraform resource builds, and the
// spellings Kubernetes accepts for quantities, names and images.
func TestSchemaAcceptsGoodValues(t *testing.T) {
	zero, three := 0, 3
	cases := map[string]Values{
		"typed fields":           {ImageRegistry: "registry.example.com:5000/mirror/", ImageTag: "v1.2.3-rc.1", Replicas: &zero},
		"replicas with postgres": {Replicas: &three, Raw: "store: {existingSecret: pg}\nsnapshot: {driver: volumesnapshot}"},
		"resources as strings":   {Raw: "resources: {requests: {cpu: 50m, memory: 128Mi}, limits: {memory: 1Gi, ephemeral-storage: 2G}}"},
		"resources as numbers": {Raw: "resources: {requests: {cpu: 0.5, memory: 134217728}, limits: {cpu: 2}}\n" +
			"runscInstaller: {resources: {requests: {cpu: 10m, memory: 1e6}}}"},
		"drop a default map":   {Raw: "nodeSelector: null\nrunscInstaller: {tolerations: null}"},
		"size as an integer":   {Raw: "store: {persistence: {size: 1073741824}}"},
		"size with a fraction": {Raw: "store: {persistence: {size: 1.5Gi, storageClassName: fast-ssd.example.com}}"},
		"repository with host": {Raw: "image: {controlPlane: {repository: 'localhost:5000/agentbox/agentbox_controlplane'}}"},
		"labels and annotations": {Raw: "global: {commonLabels: {example.com/team: infra, tier: ''}, imagePullSecrets: [{name: pull}]}\n" +
			"podAnnotations: {prometheus.io/scrape: 'true'}\nserviceAccount: {annotations: {iam.gke.io/gcp-service-account: a@b.iam.gserviceaccount.com}}"},
		"extra env":        {Raw: "extraEnv: [{name: GODEBUG, value: 'x=1'}, {name: FROM_FIELD, valueFrom: {fieldRef: {fieldPath: metadata.uid}}}]"},
		"archive":          {Raw: "snapshot: {driver: archive, archive: {endpoint: 'http://minio.storage:9000', bucket: b, credentialsSecret: s3, allowHTTP: true, compression: none}}"},
		"embedded":         {Raw: "snapshot: {archive: {compression: none, embedded: {size: 50Gi, storageClassName: fast, existingClaim: mine}}}"},
		"installer":        {Raw: "runscInstaller: {enabled: true, hostBinDir: /opt/bin, priorityClassName: system-node-critical, seLinuxOptions: {type: spc_t}}"},
		"node port":        {Raw: "service: {type: NodePort, port: 8443}"},
		"default template": {Raw: "computeApi: {defaultTemplate: agents/python.v3}"},
		"BestEffort":       {Raw: "resources: null\nrunscInstaller: {resources: null}"},
		"empty resources":  {Raw: "resources: {}\nrunscInstaller: {resources: {}}"},
		"budget and spread": {Raw: "replicaCount: 3\nstore: {existingSecret: pg}\nsnapshot: {driver: volumesnapshot}\n" +
			"podDisruptionBudget: {minAvailable: '50%'}\npodAntiAffinityPreset: hard\n" +
			"topologySpreadConstraints: [{maxSkew: 1, topologyKey: topology.kubernetes.io/zone, whenUnsatisfiable: ScheduleAnyway}]"},
		"network policy peers": {Raw: "networkPolicy: {api: {from: [{ipBlock: {cidr: 10.0.0.0/8}}]}, " +
			"metrics: {from: [{namespaceSelector: {matchLabels: {kubernetes.io/metadata.name: monitoring}}, podSelector: {}}]}}"},
	}
	for _, policy := range []corev1.PullPolicy{corev1.PullAlways, corev1.PullIfNotPresent, corev1.PullNever} {
		cases["pull policy "+string(policy)] = Values{ImagePullPolicy: string(policy)}
	}
	for name, v := range cases {
		t.Run(name, func(t *testing.T) {
			if _, err := RenderInstall(testNamespace, DefaultReleaseName, v); err != nil {
				t.Errorf("rejected: %v", err)
			}
		})
	}
}

// TestSchemaRejectsBadValues gives one bad value at a time and checks that
// rendering fails with an error that points at the offending key, as a
// JSON pointer (Helm's schema errors say "at '/service/port'").
func TestSchemaRejectsBadValues(t *testing.T) {
	cases := []struct {
		name, raw string
		// at is the key the error must name; for an unknown key the
		// pointer is its parent and the key itself is quoted after it.
		at, also string
	}{
		{"wrong type: string replicas", "replicaCount: '2'", "/replicaCount", ""},
		{"wrong type: fractional replicas", "replicaCount: 1.5", "/replicaCount", ""},
		{"wrong type: boolean as string", "metrics: {enabled: 'yes'}", "/metrics/enabled", ""},
		{"wrong type: map for a list", "tolerations: {operator: Exists}", "/tolerations", ""},
		{"wrong type: list for a map", "affinity: [a]", "/affinity", ""},
		{"wrong type: numeric label value", "podLabels: {tier: 1}", "/podLabels/tier", ""},
		{"wrong type: port as string", "service: {port: '443'}", "/service/port", ""},
		{"unknown top-level key", "replicas: 2", "", "replicas"},
		{"unknown nested key", "store: {persistence: {sizee: 2Gi}}", "/store/persistence", "sizee"},
		{"unknown image key", "image: {sandbox: {digest: 'sha256:00'}}", "/image/sandbox", "digest"},
		{"unknown installer key", "runscInstaller: {privileged: true}", "/runscInstaller", "privileged"},
		{"unknown archive key", "snapshot: {archive: {secretKey: x}}", "/snapshot/archive", "secretKey"},
		{"bad enum: pull policy", "image: {egressProxy: {pullPolicy: always}}", "/image/egressProxy/pullPolicy", ""},
		{"bad enum: installer pull policy", "runscInstaller: {image: {pullPolicy: Sometimes}}", "/runscInstaller/image/pullPolicy", ""},
		{"bad enum: service type", "service: {type: ExternalName}", "/service/type", ""},
		{"bad enum: compression", "snapshot: {archive: {compression: zstd}}", "/snapshot/archive/compression", ""},
		{"negative replicas", "replicaCount: -1", "/replicaCount", ""},
		{"port zero", "service: {port: 0}", "/service/port", ""},
		{"port too high", "service: {port: 70000}", "/service/port", ""},
		{"CA validity zero", "ca: {validityDays: 0}", "/ca/validityDays", ""},
		{"bad quantity: size", "store: {persistence: {size: 1GB}}", "/store/persistence/size", ""},
		{"bad quantity: negative size", "store: {persistence: {size: -1Gi}}", "/store/persistence/size", ""},
		{"bad quantity: zero integer size", "store: {persistence: {size: 0}}", "/store/persistence/size", ""},
		{"bad quantity: request", "resources: {requests: {memory: 128 MB}}", "/resources/requests/memory", ""},
		{"bad quantity: negative limit", "runscInstaller: {resources: {limits: {cpu: -1}}}", "/runscInstaller/resources/limits/cpu", ""},
		{"bad name: secret", "ca: {existingSecret: My_CA}", "/ca/existingSecret", ""},
		{"bad name: priority class", "priorityClassName: High Priority", "/priorityClassName", ""},
		{"bad name: pull secret", "global: {imagePullSecrets: [{name: ''}]}", "/global/imagePullSecrets/0/name", ""},
		{"bad label key", "global: {commonLabels: {'team name': infra}}", "/global/commonLabels", "team name"},
		{"bad label value", "nodeSelector: {pool: 'not valid!'}", "/nodeSelector/pool", ""},
		{"bad image tag", "image: {controlPlane: {tag: 'v1:2'}}", "/image/controlPlane/tag", ""},
		{"tag in repository", "image: {sandbox: {repository: 'agentbox/agentbox-sandbox:dev'}}", "/image/sandbox/repository", ""},
		{"default template without namespace", "computeApi: {defaultTemplate: python}", "/computeApi/defaultTemplate", ""},
		{"default template not a name", "computeApi: {defaultTemplate: Agents/Python_3}", "/computeApi/defaultTemplate", ""},
		{"relative host folder", "runscInstaller: {hostBinDir: usr/local/bin}", "/runscInstaller/hostBinDir", ""},
		{"archive endpoint without scheme", "snapshot: {archive: {endpoint: s3.example.com}}", "/snapshot/archive/endpoint", ""},
		{"extra env without name", "extraEnv: [{value: x}]", "/extraEnv/0", "name"},
		{"bad budget", "podDisruptionBudget: {maxUnavailable: one}", "/podDisruptionBudget/maxUnavailable", ""},
		{"bad anti-affinity preset", "podAntiAffinityPreset: preferred", "/podAntiAffinityPreset", ""},
		{"spread without topology key", "topologySpreadConstraints: [{maxSkew: 1, whenUnsatisfiable: ScheduleAnyway}]", "/topologySpreadConstraints/0", "topologyKey"},
		{"empty network policy peer", "networkPolicy: {api: {from: [{}]}}", "/networkPolicy/api/from/0", ""},
		{"unknown network policy peer key", "networkPolicy: {metrics: {from: [{namespace: monitoring}]}}", "/networkPolicy/metrics/from/0", "namespace"},
		{"unknown network policy key", "networkPolicy: {egress: {to: []}}", "/networkPolicy", "egress"},
		{"required map dropped", "service: null", "", "service"},
		{"required value dropped", "image: {controlPlane: {pullPolicy: null}}", "/image/controlPlane", "pullPolicy"},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			_, err := RenderInstall(testNamespace, DefaultReleaseName, Values{Raw: tc.raw})
			if err == nil {
				t.Fatalf("%q rendered", tc.raw)
			}
			msg := err.Error()
			t.Logf("%s", msg)
			// The pointer of the key itself, or of its parent for unknown
			// and missing keys: "at ''" is the top level.
			if !strings.Contains(msg, "at '"+tc.at+"'") {
				t.Errorf("error does not point at %q:\n%s", tc.at, msg)
			}
			if tc.also != "" && !strings.Contains(msg, "'"+tc.also+"'") {
				t.Errorf("error does not name %q:\n%s", tc.also, msg)
			}
		})
	}
}
