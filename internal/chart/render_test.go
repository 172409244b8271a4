package chart

import (
	"crypto/x509"
	"encoding/pem"
	"io/fs"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"slices"
	"strings"
	"testing"

	"helm.sh/helm/v3/pkg/chartutil"
	"helm.sh/helm/v3/pkg/lint"
	"helm.sh/helm/v3/pkg/lint/support"
	appsv1 "k8s.io/api/apps/v1"
	corev1 "k8s.io/api/core/v1"
	rbacv1 "k8s.io/api/rbac/v1"
	"k8s.io/apimachinery/pkg/runtime"
	"k8s.io/client-go/kubernetes/scheme"

	"github.com/agentbox/terraform-provider-agentbox/charts"
	"github.com/agentbox/terraform-provider-agentbox/internal/api/v1alpha1"
	"github.com/agentbox/terraform-provider-agentbox/internal/imagebuild"
)

const testNamespace = "agentbox-system"

// rendered holds the typed objects of a rendered release.
type rendered struct {
	t       *testing.T
	objects []runtime.Object
}

func render(t *testing.T, v Values) *rendered {
	t.Helper()
	rel, err := Template(testNamespace, DefaultReleaseName, v)
	if err != nil {
		t.Fatalf("render: %v", err)
	}
	objs, err := manifestObjects(rel.Manifest)
	if err != nil {
		t.Fatal(err)
	}
	r := &rendered{t: t}
	for _, o := range objs {
		b, err := o.MarshalJSON()
		if err != nil {
			t.Fatal(err)
		}
		typed, _, err := scheme.Codecs.UniversalDeserializer().Decode(b, nil, nil)
		if err != nil {
			t.Fatalf("decoding %s %s: %v", o.GetKind(), o.GetName(), err)
		}
		r.objects = append(r.objects, typed)
	}
	return r
}

func renderRaw(t *testing.T, raw string) *rendered {
	t.Helper()
	return render(t, Values{Raw: raw})
}

func find[T runtime.Object](r *rendered, name string) (T, bool) {
	for _, o := range r.objects {
		if typed, ok := o.(T); ok {
			if acc, ok := any(typed).(interface{ GetName() string }); ok && acc.GetName() == name {
				return typed, true
			}
		}
	}
	var zero T
	return zero, false
}

func must[T runtime.Object](r *rendered, name string) T {
	r.t.Helper()
	o, ok := find[T](r, name)
	if !ok {
		r.t.Fatalf("no %T named %q rendered", o, name)
	}
	return o
}

func (r *rendered) deployment() *appsv1.Deployment {
	r.t.Helper()
	return must[*appsv1.Deployment](r, ControlPlaneDeployment)
}

func container(t *testing.T, d *appsv1.Deployment) corev1.Container {
	t.Helper()
	if n := len(d.Spec.Template.Spec.Containers); n != 1 {
		t.Fatalf("%d containers", n)
	}
	return d.Spec.Template.Spec.Containers[0]
}

func envValue(c corev1.Container, name string) (corev1.EnvVar, bool) {
	for _, e := range c.Env {
		if e.Name == name {
			return e, true
		}
	}
	return corev1.EnvVar{}, false
}

func volume(d *appsv1.Deployment, name string) (corev1.Volume, bool) {
	for _, v := range d.Spec.Template.Spec.Volumes {
		if v.Name == name {
			return v, true
		}
	}
	return corev1.Volume{}, false
}

func mountPath(c corev1.Container, name string) string {
	for _, m := range c.VolumeMounts {
		if m.Name == name {
			return m.MountPath
		}
	}
	return ""
}

func TestEmbeddedChartMetadata(t *testing.T) {
	ch, err := Load()
	if err != nil {
		t.Fatal(err)
	}
	md := ch.Metadata
	if md.APIVersion != "v2" || md.Name != "agentbox" || md.Version != "0.1.0" || md.AppVersion != "dev" || md.KubeVersion != ">=1.31.0-0" {
		t.Errorf("metadata %+v", md)
	}
	if Version() != "0.1.0" || AppVersion() != "dev" {
		t.Errorf("Version() %q, AppVersion() %q", Version(), AppVersion())
	}
	var names []string
	for _, f := range ch.Templates {
		names = append(names, f.Name)
	}
	// The all: embed prefix is what keeps the underscore file.
	for _, want := range []string{"templates/_helpers.tpl", "templates/deployment.yaml", "templates/NOTES.txt"} {
		if !slices.Contains(names, want) {
			t.Errorf("templates %v lack %s", names, want)
		}
	}
	if ch.Schema == nil {
		t.Error("values.schema.json was not loaded")
	}
	if n := len(ch.CRDObjects()); n != 5 {
		t.Errorf("%d CRDs, want 5", n)
	}
	// No Go source may end up in the chart.
	for _, f := range append(ch.Raw, ch.Files...) {
		if strings.HasSuffix(f.Name, ".go") {
			t.Errorf("chart holds Go file %s", f.Name)
		}
	}
}

func TestLint(t *testing.T) {
	dir := filepath.Join(t.TempDir(), ChartName)
	sub, err := fs.Sub(charts.FS, ChartName)
	if err != nil {
		t.Fatal(err)
	}
	if err := os.CopyFS(dir, sub); err != nil {
		t.Fatal(err)
	}
	l := lint.AllWithKubeVersion(dir, nil, testNamespace, &chartutil.KubeVersion{Version: "v1.31.0", Major: "1", Minor: "31"})
	for _, m := range l.Messages {
		// Info messages (a missing icon) are advice, not defects.
		if m.Severity > support.InfoSev {
			t.Errorf("lint: %s", m)
		}
	}
}

func TestDeploymentArgs(t *testing.T) {
	d := render(t, Values{}).deployment()
	c := container(t, d)
	want := []string{
		"--namespace=agentbox-system",
		"--ca-dir=/etc/agentbox/ca",
		"--admin-token-file=/etc/agentbox/admin/token",
		"--api-listen=:8443",
		"--metrics-listen=:8080",
		"--health-listen=:8081",
		"--api-service=agentbox-api",
		"--sandbox-image=agentbox/agentbox-sandbox:dev",
		"--egress-proxy-image=agentbox/agentbox-egress-proxy:dev",
		"--trust-domain=agentbox.local",
		"--leader-elect=false",
	}
	if !slices.Equal(c.Args, want) {
		t.Errorf("args\n got %q\nwant %q", c.Args, want)
	}
	if c.Image != "agentbox/agentbox-controlplane:dev" || c.ImagePullPolicy != corev1.PullIfNotPresent {
		t.Errorf("image %q %q", c.Image, c.ImagePullPolicy)
	}
	if d.Spec.Template.Spec.ServiceAccountName != "agentbox-controlplane" {
		t.Errorf("service account %q", d.Spec.Template.Spec.ServiceAccountName)
	}
	if *d.Spec.Replicas != 1 {
		t.Errorf("replicas %d", *d.Spec.Replicas)
	}

	withArgs := renderRaw(t, "trustDomain: example.org\nextraArgs: [\"--verbose\"]\n").deployment()
	args := container(t, withArgs).Args
	if !slices.Contains(args, "--trust-domain=example.org") || args[len(args)-1] != "--verbose" {
		t.Errorf("args %q", args)
	}
}

func TestProbesPortsAndMounts(t *testing.T) {
	d := render(t, Values{}).deployment()
	c := container(t, d)
	ports := map[string]int32{}
	for _, p := range c.Ports {
		ports[p.Name] = p.ContainerPort
	}
	if ports["https"] != 8443 || ports["metrics"] != 8080 || ports["health"] != 8081 {
		t.Errorf("ports %v", ports)
	}
	if p := c.ReadinessProbe; p == nil || p.HTTPGet == nil || p.HTTPGet.Path != "/readyz" || p.HTTPGet.Port.String() != "health" {
		t.Errorf("readiness probe %+v", p)
	}
	if p := c.LivenessProbe; p == nil || p.HTTPGet == nil || p.HTTPGet.Path != "/healthz" || p.HTTPGet.Port.String() != "health" {
		t.Errorf("liveness probe %+v", p)
	}
	for name, want := range map[string]string{"ca": "/etc/agentbox/ca", "admin-token": "/etc/agentbox/admin", "tmp": "/tmp", "store": "/var/lib/agentbox"} {
		if got := mountPath(c, name); got != want {
			t.Errorf("volume %s mounted at %q, want %q", name, got, want)
		}
	}
	if v, _ := volume(d, "ca"); v.Secret == nil || v.Secret.SecretName != "agentbox-ca" {
		t.Errorf("ca volume %+v", v)
	}
	if v, _ := volume(d, "admin-token"); v.Secret == nil || v.Secret.SecretName != "agentbox-admin-token" ||
		len(v.Secret.Items) != 1 || v.Secret.Items[0].Key != "token" || v.Secret.Items[0].Path != "token" {
		t.Errorf("admin-token volume %+v", v)
	}
}

func TestSecurityContext(t *testing.T) {
	d := render(t, Values{}).deployment()
	ps := d.Spec.Template.Spec.SecurityContext
	if ps == nil || ps.RunAsNonRoot == nil || !*ps.RunAsNonRoot || ps.RunAsUser == nil || *ps.RunAsUser != 65532 ||
		ps.SeccompProfile == nil || ps.SeccompProfile.Type != corev1.SeccompProfileTypeRuntimeDefault {
		t.Errorf("pod security context %+v", ps)
	}
	sc := container(t, d).SecurityContext
	switch {
	case sc == nil:
		t.Fatal("no container security context")
	case sc.RunAsNonRoot == nil || !*sc.RunAsNonRoot || sc.RunAsUser == nil || *sc.RunAsUser != 65532:
		t.Errorf("runAsNonRoot/runAsUser %v %v", sc.RunAsNonRoot, sc.RunAsUser)
	case sc.ReadOnlyRootFilesystem == nil || !*sc.ReadOnlyRootFilesystem:
		t.Error("root filesystem is writable")
	case sc.AllowPrivilegeEscalation == nil || *sc.AllowPrivilegeEscalation:
		t.Error("privilege escalation allowed")
	case sc.Capabilities == nil || !slices.Equal(sc.Capabilities.Drop, []corev1.Capability{"ALL"}) || len(sc.Capabilities.Add) != 0:
		t.Errorf("capabilities %+v", sc.Capabilities)
	case sc.SeccompProfile == nil || sc.SeccompProfile.Type != corev1.SeccompProfileTypeRuntimeDefault:
		t.Errorf("seccomp %+v", sc.SeccompProfile)
	}
}

func TestServices(t *testing.T) {
	r := render(t, Values{})
	svc := must[*corev1.Service](r, APIService)
	if svc.Spec.Type != corev1.ServiceTypeClusterIP || len(svc.Spec.Ports) != 1 {
		t.Fatalf("service %+v", svc.Spec)
	}
	p := svc.Spec.Ports[0]
	// The named target resolves to the container's https port, 8443.
	if p.Name != "https" || p.Port != 443 || p.TargetPort.String() != "https" {
		t.Errorf("port %+v", p)
	}
	d := r.deployment()
	for k, v := range svc.Spec.Selector {
		if d.Spec.Template.Labels[k] != v {
			t.Errorf("service selector %s=%s does not match the pods' labels %v", k, v, d.Spec.Template.Labels)
		}
	}
	if _, ok := find[*corev1.Service](r, "agentbox-controlplane-metrics"); !ok {
		t.Error("no metrics Service by default")
	}
	if _, ok := find[*corev1.Service](renderRaw(t, "metrics: {enabled: false}"), "agentbox-controlplane-metrics"); ok {
		t.Error("metrics Service rendered with metrics.enabled=false")
	}
}

func TestRBAC(t *testing.T) {
	r := render(t, Values{})
	cr := must[*rbacv1.ClusterRole](r, "agentbox-controlplane-"+testNamespace)
	can := func(group, resource, verb string) bool {
		for _, rule := range cr.Rules {
			if slices.Contains(rule.APIGroups, group) && slices.Contains(rule.Resources, resource) && slices.Contains(rule.Verbs, verb) {
				return true
			}
		}
		return false
	}
	for _, rule := range cr.Rules {
		if slices.Contains(rule.Verbs, "*") || slices.Contains(rule.Resources, "*") || slices.Contains(rule.APIGroups, "*") {
			t.Errorf("wildcard rule %+v", rule)
		}
	}
	for _, res := range []string{"sandboxes", "sandboxtemplates", "sandboxwarmpools", "egressproxies", "gvisornodepools"} {
		if !can("agentbox.dev", res, "watch") || !can("agentbox.dev", res+"/status", "update") {
			t.Errorf("cannot watch %s or update its status", res)
		}
	}
	if !can("agentbox.dev", "sandboxwarmpools/scale", "update") {
		t.Error("cannot scale warm pools")
	}
	if can("agentbox.dev", "sandboxtemplates", "create") || can("agentbox.dev", "sandboxtemplates", "delete") {
		t.Error("may create or delete templates, which Terraform owns")
	}
	for _, res := range []string{"pods", "persistentvolumeclaims", "secrets", "services", "configmaps"} {
		if !can("", res, "create") || !can("", res, "watch") {
			t.Errorf("cannot create or watch %s", res)
		}
	}
	if !can("", "persistentvolumes", "watch") || can("", "persistentvolumes", "delete") || can("", "persistentvolumes", "patch") {
		t.Error("persistentvolumes: want read-only (node loss is read from their node affinity)")
	}
	if can("", "pods/exec", "create") || can("", "pods/exec", "get") {
		t.Error("may exec into pods")
	}
	if !can("", "events", "create") || !can("networking.k8s.io", "networkpolicies", "create") || !can("coordination.k8s.io", "leases", "update") {
		t.Error("missing events, networkpolicies or leases")
	}
	// Managed node pools create their own RuntimeClass and label and taint
	// their nodes, through patches only.
	if !can("node.k8s.io", "runtimeclasses", "watch") || !can("node.k8s.io", "runtimeclasses", "create") ||
		can("node.k8s.io", "runtimeclasses", "update") {
		t.Error("runtimeclasses: want watch and create, and patch rather than update")
	}
	if !can("", "nodes", "patch") || can("", "nodes", "update") || can("", "nodes", "create") || can("", "nodes/status", "patch") {
		t.Error("nodes: want patch only, and nothing on their status")
	}
	if !can("snapshot.storage.k8s.io", "volumesnapshots", "create") {
		t.Error("volumesnapshot driver without VolumeSnapshot rights")
	}

	crb := must[*rbacv1.ClusterRoleBinding](r, cr.Name)
	if crb.RoleRef.Name != cr.Name || len(crb.Subjects) != 1 || crb.Subjects[0].Name != "agentbox-controlplane" || crb.Subjects[0].Namespace != testNamespace {
		t.Errorf("cluster role binding %+v", crb)
	}
	role := must[*rbacv1.Role](r, "agentbox-controlplane-leader-election")
	if role.Namespace != testNamespace || len(role.Rules) == 0 || !slices.Contains(role.Rules[0].Resources, "leases") {
		t.Errorf("leader election role %+v", role)
	}
	must[*rbacv1.RoleBinding](r, "agentbox-controlplane-leader-election")
	sa := must[*corev1.ServiceAccount](r, "agentbox-controlplane")
	if sa.Namespace != testNamespace {
		t.Errorf("service account namespace %q", sa.Namespace)
	}

	archive := renderRaw(t, "snapshot: {driver: archive, archive: {endpoint: 'https://s3.example.com', bucket: b, credentialsSecret: s3}}")
	for _, rule := range must[*rbacv1.ClusterRole](archive, cr.Name).Rules {
		if slices.Contains(rule.APIGroups, "snapshot.storage.k8s.io") {
			t.Error("archive driver still gets VolumeSnapshot rights")
		}
	}
}

// The archive driver's keys reach the control plane as files under the
// directory its flag names, mapped from the Secret's AWS_* keys.
func TestArchiveCredentials(t *testing.T) {
	r := renderRaw(t, "snapshot: {driver: archive, archive: {endpoint: 'https://s3.example.com', bucket: b, credentialsSecret: s3, compression: none}}")
	d := r.deployment()
	c := d.Spec.Template.Spec.Containers[0]
	dir, _ := envValue(c, "AGENTBOX_ARCHIVE_CREDENTIALS_DIR")
	if e, _ := envValue(c, "AGENTBOX_ARCHIVE_COMPRESSION"); e.Value != "none" {
		t.Errorf("compression %q", e.Value)
	}
	var mounted bool
	for _, m := range c.VolumeMounts {
		if m.Name == "archive-credentials" && m.MountPath == dir.Value && m.ReadOnly {
			mounted = true
		}
	}
	if !mounted || dir.Value == "" {
		t.Errorf("credentials dir %q not mounted read-only: %+v", dir.Value, c.VolumeMounts)
	}
	var paths []string
	for _, v := range d.Spec.Template.Spec.Volumes {
		if v.Name == "archive-credentials" && v.Secret != nil && v.Secret.SecretName == "s3" {
			for _, it := range v.Secret.Items {
				paths = append(paths, it.Key+"="+it.Path)
			}
		}
	}
	if want := []string{"AWS_ACCESS_KEY_ID=access-key-id", "AWS_SECRET_ACCESS_KEY=secret-access-key"}; !slices.Equal(paths, want) {
		t.Errorf("secret items %v, want %v", paths, want)
	}
	for _, e := range c.Env {
		if strings.HasPrefix(e.Name, "AWS_") {
			t.Errorf("credentials in the environment: %s", e.Name)
		}
	}
}

func TestStoreVolume(t *testing.T) {
	t.Run("pvc by default", func(t *testing.T) {
		r := render(t, Values{})
		pvc := must[*corev1.PersistentVolumeClaim](r, "agentbox-store")
		if q := pvc.Spec.Resources.Requests[corev1.ResourceStorage]; q.String() != "1Gi" {
			t.Errorf("size %s", q.String())
		}
		if pvc.Spec.StorageClassName != nil {
			t.Errorf("storage class %q, want the cluster default", *pvc.Spec.StorageClassName)
		}
		d := r.deployment()
		if v, _ := volume(d, "store"); v.PersistentVolumeClaim == nil || v.PersistentVolumeClaim.ClaimName != "agentbox-store" {
			t.Errorf("store volume %+v", v)
		}
		if d.Spec.Strategy.Type != appsv1.RecreateDeploymentStrategyType {
			t.Errorf("strategy %q: two pods would open one SQLite file", d.Spec.Strategy.Type)
		}
		if e, _ := envValue(container(t, d), "AGENTBOX_DATA_DIR"); e.Value != "/var/lib/agentbox" {
			t.Errorf("AGENTBOX_DATA_DIR %+v", e)
		}
	})
	t.Run("emptyDir without persistence", func(t *testing.T) {
		r := renderRaw(t, "store: {persistence: {enabled: false}}")
		if _, ok := find[*corev1.PersistentVolumeClaim](r, "agentbox-store"); ok {
			t.Error("PVC rendered with persistence disabled")
		}
		if v, _ := volume(r.deployment(), "store"); v.EmptyDir == nil {
			t.Errorf("store volume %+v, want emptyDir", v)
		}
	})
	t.Run("existing claim", func(t *testing.T) {
		r := renderRaw(t, "store: {persistence: {existingClaim: mine, storageClassName: fast}}")
		if _, ok := find[*corev1.PersistentVolumeClaim](r, "agentbox-store"); ok {
			t.Error("PVC rendered with an existing claim")
		}
		if v, _ := volume(r.deployment(), "store"); v.PersistentVolumeClaim == nil || v.PersistentVolumeClaim.ClaimName != "mine" {
			t.Errorf("store volume %+v", v)
		}
	})
	t.Run("postgres", func(t *testing.T) {
		r := renderRaw(t, "replicaCount: 2\nstore: {dsn: 'postgres://u:p@db/agentbox'}")
		if _, ok := find[*corev1.PersistentVolumeClaim](r, "agentbox-store"); ok {
			t.Error("PVC rendered with a PostgreSQL store")
		}
		d := r.deployment()
		c := container(t, d)
		if _, ok := volume(d, "store"); ok || mountPath(c, "store") != "" {
			t.Error("store volume rendered with a PostgreSQL store")
		}
		e, _ := envValue(c, "AGENTBOX_STORE_DSN")
		if e.ValueFrom == nil || e.ValueFrom.SecretKeyRef == nil || e.ValueFrom.SecretKeyRef.Name != "agentbox-store" || e.ValueFrom.SecretKeyRef.Key != "dsn" {
			t.Errorf("AGENTBOX_STORE_DSN %+v", e)
		}
		if e.Value != "" {
			t.Error("the DSN is in the pod spec in clear")
		}
		s := must[*corev1.Secret](r, "agentbox-store")
		if string(s.Data["dsn"]) != "postgres://u:p@db/agentbox" {
			t.Errorf("store secret %q", s.Data["dsn"])
		}
		if d.Spec.Strategy.Type == appsv1.RecreateDeploymentStrategyType {
			t.Error("Recreate strategy without SQLite")
		}
		if !slices.Contains(c.Args, "--leader-elect=true") {
			t.Errorf("two replicas without leader election: %q", c.Args)
		}
	})
}

func TestSecrets(t *testing.T) {
	r := render(t, Values{})
	ca := must[*corev1.Secret](r, "agentbox-ca")
	if ca.Type != corev1.SecretTypeTLS || ca.Annotations["helm.sh/resource-policy"] != "keep" {
		t.Errorf("CA secret type %q annotations %v", ca.Type, ca.Annotations)
	}
	block, _ := pem.Decode(ca.Data["tls.crt"])
	if block == nil {
		t.Fatal("tls.crt is not PEM")
	}
	cert, err := x509.ParseCertificate(block.Bytes)
	if err != nil {
		t.Fatal(err)
	}
	if !cert.IsCA || cert.KeyUsage&x509.KeyUsageCertSign == 0 {
		t.Errorf("CA certificate IsCA=%v usage=%v", cert.IsCA, cert.KeyUsage)
	}
	if k, _ := pem.Decode(ca.Data["tls.key"]); k == nil {
		t.Error("tls.key is not PEM")
	}
	tok := must[*corev1.Secret](r, "agentbox-admin-token")
	if !regexp.MustCompile(`^[A-Za-z0-9]{48}$`).Match(tok.Data["token"]) {
		t.Errorf("admin token %q", tok.Data["token"])
	}

	own := renderRaw(t, "adminToken: {existingSecret: my-token}\nca: {existingSecret: my-ca}")
	for _, name := range []string{"agentbox-admin-token", "agentbox-ca"} {
		if _, ok := find[*corev1.Secret](own, name); ok {
			t.Errorf("%s rendered although an existing Secret is named", name)
		}
	}
	d := own.deployment()
	if v, _ := volume(d, "admin-token"); v.Secret == nil || v.Secret.SecretName != "my-token" {
		t.Errorf("admin-token volume %+v", v)
	}
	if v, _ := volume(d, "ca"); v.Secret == nil || v.Secret.SecretName != "my-ca" {
		t.Errorf("ca volume %+v", v)
	}
}

func TestImageReferences(t *testing.T) {
	cases := []struct {
		name                      string
		values                    Values
		controlPlane, sandbox, ep string
	}{
		{"defaults", Values{}, "agentbox/agentbox-controlplane:dev", "agentbox/agentbox-sandbox:dev", "agentbox/agentbox-egress-proxy:dev"},
		{"registry and tag", Values{ImageRegistry: "registry.example.com/mirror", ImageTag: "v1.2.3"},
			"registry.example.com/mirror/agentbox/agentbox-controlplane:v1.2.3",
			"registry.example.com/mirror/agentbox/agentbox-sandbox:v1.2.3",
			"registry.example.com/mirror/agentbox/agentbox-egress-proxy:v1.2.3"},
		{"trailing slash", Values{ImageRegistry: "localhost:5000/"}, "localhost:5000/agentbox/agentbox-controlplane:dev",
			"localhost:5000/agentbox/agentbox-sandbox:dev", "localhost:5000/agentbox/agentbox-egress-proxy:dev"},
		{"raw wins", Values{ImageTag: "v1", Raw: "image: {controlPlane: {repository: me/cp, tag: v2}}"},
			"me/cp:v2", "agentbox/agentbox-sandbox:v1", "agentbox/agentbox-egress-proxy:v1"},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			c := container(t, render(t, tc.values).deployment())
			if c.Image != tc.controlPlane {
				t.Errorf("control plane image %q, want %q", c.Image, tc.controlPlane)
			}
			if !slices.Contains(c.Args, "--sandbox-image="+tc.sandbox) {
				t.Errorf("args %q lack --sandbox-image=%s", c.Args, tc.sandbox)
			}
			if !slices.Contains(c.Args, "--egress-proxy-image="+tc.ep) {
				t.Errorf("args %q lack --egress-proxy-image=%s", c.Args, tc.ep)
			}
		})
	}
	c := container(t, render(t, Values{ImagePullPolicy: "Never"}).deployment())
	if c.ImagePullPolicy != corev1.PullNever {
		t.Errorf("pull policy %q", c.ImagePullPolicy)
	}
	if e, _ := envValue(c, "AGENTBOX_SANDBOX_IMAGE_PULL_POLICY"); e.Value != "Never" {
		t.Errorf("sandbox pull policy %q", e.Value)
	}
}

func TestSchemaRejects(t *testing.T) {
	cases := map[string]struct{ raw, want string }{
		"unknown top-level key": {"colour: blue", "colour"},
		"unknown nested key":    {"service: {typo: 1}", "typo"},
		"bad snapshot driver":   {"snapshot: {driver: zfs}", "driver"},
		"bad pull policy":       {"image: {controlPlane: {pullPolicy: Sometimes}}", "pullPolicy"},
		"negative replicas":     {"replicaCount: -1", "replicaCount"},
		"string replicas":       {"replicaCount: two", "replicaCount"},
		"SQLite with replicas":  {"replicaCount: 2", "PostgreSQL"},
		"archive without store": {"snapshot: {driver: archive}", "snapshot.archive.endpoint"},
		"archive without keys":  {"snapshot: {driver: archive, archive: {endpoint: 'https://s3.example.com', bucket: b}}", "snapshot.archive.credentialsSecret"},
	}
	for name, tc := range cases {
		t.Run(name, func(t *testing.T) {
			_, err := Template(testNamespace, DefaultReleaseName, Values{Raw: tc.raw})
			if err == nil {
				t.Fatalf("%q rendered", tc.raw)
			}
			if !strings.Contains(err.Error(), tc.want) {
				t.Errorf("error %q does not mention %q", err, tc.want)
			}
		})
	}
	if _, err := Template(testNamespace, DefaultReleaseName, Values{Raw: "global: {fromParent: x}"}); err != nil {
		t.Errorf("a parent chart's global key is rejected: %v", err)
	}
}

func TestLabelsAndNamespace(t *testing.T) {
	r := renderRaw(t, "global: {commonLabels: {team: infra}}\npodLabels: {tier: control}")
	for _, o := range r.objects {
		acc := o.(interface {
			GetName() string
			GetNamespace() string
			GetLabels() map[string]string
		})
		if acc.GetLabels()["team"] != "infra" || acc.GetLabels()["app.kubernetes.io/managed-by"] != "Helm" {
			t.Errorf("%T %s labels %v", o, acc.GetName(), acc.GetLabels())
		}
		_, clusterScoped := o.(*rbacv1.ClusterRole)
		if _, ok := o.(*rbacv1.ClusterRoleBinding); ok {
			clusterScoped = true
		}
		if !clusterScoped && acc.GetNamespace() != testNamespace {
			t.Errorf("%T %s in namespace %q", o, acc.GetName(), acc.GetNamespace())
		}
	}
	if r.deployment().Spec.Template.Labels["tier"] != "control" {
		t.Error("podLabels not on the pods")
	}
}

// TestRBACCoversControllerMarkers keeps the chart's ClusterRole in line with
// the controllers' kubebuilder RBAC markers, the one list of what they use:
// a marker the chart does not grant would fail only on a real cluster, at
// the first API call that needs it.
func TestRBACCoversControllerMarkers(t *testing.T) {
	src, err := os.ReadFile(filepath.Join("..", "controller", "rbac.go"))
	if err != nil {
		t.Fatal(err)
	}
	cr := must[*rbacv1.ClusterRole](render(t, Values{}), "agentbox-controlplane-"+testNamespace)
	markers := 0
	for _, line := range strings.Split(string(src), "\n") {
		spec, ok := strings.CutPrefix(strings.TrimSpace(line), "// +kubebuilder:rbac:")
		if !ok {
			continue
		}
		markers++
		fields := map[string][]string{}
		for _, kv := range strings.Split(spec, ",") {
			k, v, _ := strings.Cut(kv, "=")
			fields[k] = strings.Split(strings.Trim(v, `"`), ";")
		}
		for _, group := range fields["groups"] {
			for _, res := range fields["resources"] {
				for _, verb := range fields["verbs"] {
					granted := slices.ContainsFunc(cr.Rules, func(r rbacv1.PolicyRule) bool {
						return slices.Contains(r.APIGroups, group) && slices.Contains(r.Resources, res) && slices.Contains(r.Verbs, verb)
					})
					if !granted {
						t.Errorf("rbac.go asks for %s on %q/%s; the chart's ClusterRole does not grant it", verb, group, res)
					}
				}
			}
		}
	}
	if markers < 10 {
		t.Fatalf("found only %d RBAC markers in rbac.go; has the marker format changed?", markers)
	}
}

// TestRunscInstaller renders the runsc installer DaemonSet and runs its
// install command, as rendered, with the real agentbox-runsc-installer
// against folders standing in for the image's and the host's: the command
// line is the part that can go wrong without a cluster noticing.
func TestRunscInstaller(t *testing.T) {
	if _, ok := find[*appsv1.DaemonSet](render(t, Values{}), "agentbox-runsc-installer"); ok {
		t.Fatal("runsc installer rendered by default")
	}

	r := renderRaw(t, "runscInstaller:\n  enabled: true\n  hostBinDir: /opt/bin\n  priorityClassName: system-node-critical\n"+
		"  nodeSelector: {pool-kind: gvisor}\n  resources: {requests: {cpu: 10m}}\n")
	ds := must[*appsv1.DaemonSet](r, "agentbox-runsc-installer")
	pod := ds.Spec.Template.Spec
	// Apart from the release namespace, which enforces restricted.
	if want := testNamespace + "-runsc-installer"; ds.Namespace != want {
		t.Errorf("namespace %q, want %q", ds.Namespace, want)
	}
	for k, v := range ds.Spec.Selector.MatchLabels {
		if ds.Spec.Template.Labels[k] != v {
			t.Errorf("selector %s=%s does not match the pod labels %v", k, v, ds.Spec.Template.Labels)
		}
	}
	if ds.Spec.Selector.MatchLabels["app.kubernetes.io/component"] != "runsc-installer" {
		t.Errorf("selector %v would also select the control plane", ds.Spec.Selector.MatchLabels)
	}

	// It must run exactly where the node pool controller puts its label.
	aff := pod.Affinity
	if aff == nil || aff.NodeAffinity == nil || aff.NodeAffinity.RequiredDuringSchedulingIgnoredDuringExecution == nil {
		t.Fatalf("affinity %+v", aff)
	}
	terms := aff.NodeAffinity.RequiredDuringSchedulingIgnoredDuringExecution.NodeSelectorTerms
	if len(terms) != 1 || len(terms[0].MatchExpressions) != 1 ||
		terms[0].MatchExpressions[0].Key != v1alpha1.LabelNodePool || terms[0].MatchExpressions[0].Operator != corev1.NodeSelectorOpExists {
		t.Errorf("node selector terms %+v, want %s Exists", terms, v1alpha1.LabelNodePool)
	}
	if pod.NodeSelector["pool-kind"] != "gvisor" || pod.PriorityClassName != "system-node-critical" {
		t.Errorf("nodeSelector %v priorityClassName %q", pod.NodeSelector, pod.PriorityClassName)
	}
	if len(pod.Tolerations) != 1 || pod.Tolerations[0].Operator != corev1.TolerationOpExists || pod.Tolerations[0].Key != "" {
		t.Errorf("tolerations %+v, want to tolerate every taint (pools taint their nodes)", pod.Tolerations)
	}
	if pod.AutomountServiceAccountToken == nil || *pod.AutomountServiceAccountToken {
		t.Error("the installer gets an API token it does not need")
	}
	if len(pod.Volumes) != 1 || pod.Volumes[0].HostPath == nil || pod.Volumes[0].HostPath.Path != "/opt/bin" {
		t.Fatalf("volumes %+v, want the hostPath /opt/bin", pod.Volumes)
	}

	if len(pod.InitContainers) != 1 || len(pod.Containers) != 1 {
		t.Fatalf("%d init containers, %d containers", len(pod.InitContainers), len(pod.Containers))
	}
	install, done := pod.InitContainers[0], pod.Containers[0]
	if install.Image != "agentbox/agentbox-runsc-installer:dev" || done.Image != install.Image {
		t.Errorf("images %q %q", install.Image, done.Image)
	}
	// Root for the root-owned host folder, and nothing more: not
	// privileged, no capabilities.
	if sc := install.SecurityContext; sc == nil || sc.RunAsUser == nil || *sc.RunAsUser != 0 ||
		(sc.Privileged != nil && *sc.Privileged) || sc.AllowPrivilegeEscalation == nil || *sc.AllowPrivilegeEscalation ||
		sc.Capabilities == nil || !slices.Equal(sc.Capabilities.Drop, []corev1.Capability{"ALL"}) || len(sc.Capabilities.Add) != 0 ||
		sc.ReadOnlyRootFilesystem == nil || !*sc.ReadOnlyRootFilesystem ||
		sc.SeccompProfile == nil || sc.SeccompProfile.Type != corev1.SeccompProfileTypeRuntimeDefault || sc.SELinuxOptions != nil {
		t.Errorf("install container security context %+v, want root with nothing else", sc)
	}
	if done.Name != "wait" || !slices.Equal(done.Command, []string{"/usr/local/bin/agentbox-runsc-installer", "wait"}) {
		t.Errorf("long-running container %s: %q", done.Name, done.Command)
	}
	if got := mountPath(install, "host-bin"); got != "/host/bin" {
		t.Errorf("host folder mounted at %q", got)
	}
	if q := install.Resources.Requests[corev1.ResourceCPU]; q.String() != "10m" {
		t.Errorf("install resources %+v", install.Resources)
	}
	sc := done.SecurityContext
	if sc == nil || (sc.Privileged != nil && *sc.Privileged) || sc.RunAsNonRoot == nil || !*sc.RunAsNonRoot ||
		sc.AllowPrivilegeEscalation == nil || *sc.AllowPrivilegeEscalation || len(done.VolumeMounts) != 0 {
		t.Errorf("the long-running container is not locked down: %+v, mounts %v", sc, done.VolumeMounts)
	}

	// The tag follows the control plane's, so a release's images match.
	tagged := must[*appsv1.DaemonSet](render(t, Values{ImageRegistry: "registry.example.com", ImageTag: "v1.2.3", Raw: "runscInstaller: {enabled: true}"}),
		"agentbox-runsc-installer")
	if got := tagged.Spec.Template.Spec.InitContainers[0].Image; got != "registry.example.com/agentbox/agentbox-runsc-installer:v1.2.3" {
		t.Errorf("image %q", got)
	}
	if got := tagged.Spec.Template.Spec.Volumes[0].HostPath.Path; got != "/usr/local/bin" {
		t.Errorf("default host folder %q", got)
	}

	for raw, want := range map[string]string{
		"runscInstaller: {enabled: true, typo: 1}":                      "typo",
		"runscInstaller: {enabled: true, hostBinDir: bin}":              "hostBinDir",
		"runscInstaller: {enabled: true, seLinuxOptions: {typ: spc_t}}": "typ",
	} {
		if _, err := Template(testNamespace, DefaultReleaseName, Values{Raw: raw}); err == nil || !strings.Contains(err.Error(), want) {
			t.Errorf("%q: error %v, want one about %s", raw, err, want)
		}
	}

	selinux := must[*appsv1.DaemonSet](renderRaw(t, "runscInstaller: {enabled: true, seLinuxOptions: {type: spc_t}}"), "agentbox-runsc-installer")
	if o := selinux.Spec.Template.Spec.InitContainers[0].SecurityContext.SELinuxOptions; o == nil || o.Type != "spc_t" {
		t.Errorf("seLinuxOptions %+v, want type spc_t", o)
	}

	t.Run("command", func(t *testing.T) { runInstallCommand(t, install) })
}

// runInstallCommand builds agentbox-runsc-installer and runs the install
// container's command with the image's and the host's folders replaced by
// temporary ones.
func runInstallCommand(t *testing.T, c corev1.Container) {
	if _, err := exec.LookPath("sh"); err != nil {
		t.Skip("no sh to run the stand-in runsc with")
	}
	const bin = "/usr/local/bin/agentbox-runsc-installer"
	want := []string{bin, "install", "-from", imagebuild.RunscImageDir, "-to", mountPath(c, "host-bin")}
	if !slices.Equal(c.Command, want) {
		t.Fatalf("command %q, want %q (the image's layout)", c.Command, want)
	}
	installer := filepath.Join(t.TempDir(), "agentbox-runsc-installer")
	build := exec.Command("go", "build", "-o", installer, "../cmd/agentbox-runsc-installer")
	if out, err := build.CombinedOutput(); err != nil {
		t.Fatalf("go build: %v\n%s", err, out)
	}
	src, dest := t.TempDir(), t.TempDir()
	args := slices.Clone(c.Command[1:])
	args[2], args[4] = src, dest
	run := func() (string, error) {
		out, err := exec.Command(installer, args...).CombinedOutput()
		return string(out), err
	}

	if out, err := run(); err == nil || !strings.Contains(out, "installer image lacks") {
		t.Errorf("an image without the binaries installed: %v\n%s", err, out)
	}
	must0(t, os.WriteFile(filepath.Join(src, "runsc"), []byte("#!/bin/sh\necho runsc version fake-1\n"), 0o755))
	must0(t, os.WriteFile(filepath.Join(src, "containerd-shim-runsc-v1"), []byte("#!/bin/sh\n"), 0o755))
	// An older runsc on the host is replaced.
	must0(t, os.WriteFile(filepath.Join(dest, "runsc"), []byte("#!/bin/sh\necho old\n"), 0o755))

	out, err := run()
	if err != nil {
		t.Fatalf("install: %v\n%s", err, out)
	}
	for _, want := range []string{"installed " + dest + "/runsc", "installed " + dest + "/containerd-shim-runsc-v1", "runsc version fake-1"} {
		if !strings.Contains(out, want) {
			t.Errorf("output lacks %q:\n%s", want, out)
		}
	}
	for _, f := range imagebuild.RunscBinaries {
		want, _ := os.ReadFile(filepath.Join(src, f))
		got, err := os.ReadFile(filepath.Join(dest, f))
		if err != nil || string(got) != string(want) {
			t.Errorf("%s on the host: %q %v, want the image's", f, got, err)
		}
	}
	out, err = run()
	if err != nil || strings.Contains(out, "installed") || !strings.Contains(out, "is up to date") {
		t.Errorf("second run: %v\n%s", err, out)
	}
}

func must0(t *testing.T, err error) {
	t.Helper()
	if err != nil {
		t.Fatal(err)
	}
}

// TestRunscInstallerNamespace: the installer gets a namespace of its own,
// created with the release and labelled privileged, unless the operator
// names one that exists; it is never the release namespace the chart
// would then have to relax.
func TestRunscInstallerNamespace(t *testing.T) {
	r := renderRaw(t, "runscInstaller: {enabled: true}")
	ds := must[*appsv1.DaemonSet](r, "agentbox-runsc-installer")
	ns := must[*corev1.Namespace](r, ds.Namespace)
	want := map[string]string{
		"pod-security.kubernetes.io/enforce":         "privileged",
		"pod-security.kubernetes.io/enforce-version": "latest",
		"pod-security.kubernetes.io/audit":           "restricted",
		"pod-security.kubernetes.io/audit-version":   "latest",
		"app.kubernetes.io/component":                "runsc-installer",
		"app.kubernetes.io/managed-by":               "Helm",
	}
	for k, v := range want {
		if ns.Labels[k] != v {
			t.Errorf("namespace %s: label %s=%q, want %q", ns.Name, k, ns.Labels[k], v)
		}
	}
	if _, ok := ns.Labels["pod-security.kubernetes.io/warn"]; ok {
		t.Errorf("namespace %s warns on every installer rollout: %v", ns.Name, ns.Labels)
	}
	for _, o := range r.objects {
		if n, ok := o.(*corev1.Namespace); ok && n.Name != ds.Namespace {
			t.Errorf("the chart renders namespace %s besides the installer's", n.Name)
		}
	}

	// Cut to a valid name under a long release namespace.
	long := strings.Repeat("n", 60)
	rel, err := Template(long, DefaultReleaseName, Values{Raw: "runscInstaller: {enabled: true}"})
	if err != nil {
		t.Fatal(err)
	}
	objs, err := manifestObjects(rel.Manifest)
	if err != nil {
		t.Fatal(err)
	}
	for _, o := range objs {
		if o.GetKind() == "DaemonSet" && o.GetNamespace() != long+"-ru" {
			t.Errorf("installer namespace %q under release namespace %s", o.GetNamespace(), long)
		}
	}

	// A namespace the operator made: no Namespace object.
	r = renderRaw(t, "runscInstaller: {enabled: true, namespace: gvisor-system, createNamespace: false}")
	if ds := must[*appsv1.DaemonSet](r, "agentbox-runsc-installer"); ds.Namespace != "gvisor-system" {
		t.Errorf("namespace %q, want gvisor-system", ds.Namespace)
	}
	for _, o := range r.objects {
		if n, ok := o.(*corev1.Namespace); ok {
			t.Errorf("namespace %s rendered with createNamespace false", n.Name)
		}
	}

	// The release namespace cannot be turned into the installer's.
	_, err = Template(testNamespace, DefaultReleaseName, Values{Raw: "runscInstaller: {enabled: true, namespace: " + testNamespace + "}"})
	if err == nil || !strings.Contains(err.Error(), "must not be the release namespace") {
		t.Errorf("installer namespace = release namespace: %v", err)
	}
}
