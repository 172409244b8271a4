package chart

import (
	"crypto/x509"
	"encoding/pem"
	"io/fs"
	"maps"
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
	"helm.sh/helm/v3/pkg/releaseutil"
	appsv1 "k8s.io/api/apps/v1"
	corev1 "k8s.io/api/core/v1"
	rbacv1 "k8s.io/api/rbac/v1"
	storagev1 "k8s.io/api/storage/v1"
	"k8s.io/apimachinery/pkg/api/resource"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/runtime"
	"k8s.io/client-go/kubernetes/scheme"
	"sigs.k8s.io/yaml"

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

// render renders v as a first install would (see RenderInstall).
func render(t *testing.T, v Values) *rendered {
	t.Helper()
	rel, err := RenderInstall(testNamespace, DefaultReleaseName, v)
	if err != nil {
		t.Fatalf("render: %v", err)
	}
	return parse(t, rel)
}

func parse(t *testing.T, rel *Release) *rendered {
	t.Helper()
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
	if n := len(ch.CRDObjects()); n != 6 {
		t.Errorf("%d CRDs, want 6", n)
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
		"--supervisor-image=agentbox/agentbox-supervisor:dev",
		"--supervisor-image-pull-policy=IfNotPresent",
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

// TestDefaultTemplate checks that computeApi.defaultTemplate reaches the
// control plane as AGENTBOX_DEFAULT_TEMPLATE (a variable, not a flag, so
// that an older control plane image still starts), and only when set.
func TestDefaultTemplate(t *testing.T) {
	if e, ok := envValue(container(t, render(t, Values{}).deployment()), "AGENTBOX_DEFAULT_TEMPLATE"); ok {
		t.Errorf("the default values set %s=%q", e.Name, e.Value)
	}
	c := container(t, renderRaw(t, "computeApi: {defaultTemplate: agents/python}\n").deployment())
	if e, ok := envValue(c, "AGENTBOX_DEFAULT_TEMPLATE"); !ok || e.Value != "agents/python" {
		t.Errorf("AGENTBOX_DEFAULT_TEMPLATE = %+v, %v; want agents/python", e, ok)
	}
}

// TestRunRetention checks that computeApi.runRetention reaches the control
// plane as AGENTBOX_RUN_RETENTION (a variable, like the default template,
// which its --run-retention flag defaults to), a week unless set.
func TestRunRetention(t *testing.T) {
	for raw, want := range map[string]string{
		"":                                    "168h",
		"computeApi: {runRetention: 720h}\n":  "720h",
		"computeApi: {runRetention: \"0\"}\n": "0",
	} {
		c := container(t, renderRaw(t, raw).deployment())
		if e, ok := envValue(c, "AGENTBOX_RUN_RETENTION"); !ok || e.Value != want {
			t.Errorf("values %q: AGENTBOX_RUN_RETENTION = %+v, %v; want %s", raw, e, ok, want)
		}
	}
}

// TestSandboxWorkers checks that sandboxWorkers reaches the control plane as
// AGENTBOX_SANDBOX_WORKERS, which its --sandbox-workers flag defaults to.
func TestSandboxWorkers(t *testing.T) {
	for raw, want := range map[string]string{
		"":                    "16",
		"sandboxWorkers: 4\n": "4",
	} {
		c := container(t, renderRaw(t, raw).deployment())
		if e, ok := envValue(c, "AGENTBOX_SANDBOX_WORKERS"); !ok || e.Value != want {
			t.Errorf("values %q: AGENTBOX_SANDBOX_WORKERS = %+v, %v; want %s", raw, e, ok, want)
		}
	}
}

// TestUserTokenIssuerValues checks that computeApi.userTokens reaches the
// control plane as the variables its --user-token-* flags default to, the
// issuer only when set.
func TestUserTokenIssuerValues(t *testing.T) {
	c := container(t, renderRaw(t, "").deployment())
	for name, want := range map[string]string{"AGENTBOX_USER_TOKEN_KEY_ROTATION": "24h", "AGENTBOX_USER_TOKEN_MAX_LIFETIME": "1h"} {
		if e, ok := envValue(c, name); !ok || e.Value != want {
			t.Errorf("defaults: %s = %+v, %v; want %s", name, e, ok, want)
		}
	}
	if e, ok := envValue(c, "AGENTBOX_USER_TOKEN_ISSUER"); ok {
		t.Errorf("defaults set the issuer: %+v", e)
	}
	c = container(t, renderRaw(t, "computeApi: {userTokens: {issuer: 'https://agentbox.example', keyRotation: 6h, maxLifetime: 15m}}\n").deployment())
	for name, want := range map[string]string{"AGENTBOX_USER_TOKEN_KEY_ROTATION": "6h", "AGENTBOX_USER_TOKEN_MAX_LIFETIME": "15m",
		"AGENTBOX_USER_TOKEN_ISSUER": "https://agentbox.example"} {
		if e, ok := envValue(c, name); !ok || e.Value != want {
			t.Errorf("set: %s = %+v, %v; want %s", name, e, ok, want)
		}
	}
}

// TestRunArtifactLimits checks that computeApi.runArtifacts reaches the
// control plane as the variables its flags default to.
func TestRunArtifactLimits(t *testing.T) {
	for raw, want := range map[string][2]string{
		"": {"1Gi", "4Gi"},
		"computeApi: {runArtifacts: {maxFileSize: 10Mi, maxRunSize: 1G}}\n": {"10Mi", "1G"},
	} {
		c := container(t, renderRaw(t, raw).deployment())
		for i, name := range []string{"AGENTBOX_RUN_ARTIFACT_MAX_FILE_SIZE", "AGENTBOX_RUN_ARTIFACT_MAX_RUN_SIZE"} {
			if e, ok := envValue(c, name); !ok || e.Value != want[i] {
				t.Errorf("values %q: %s = %+v, %v; want %s", raw, name, e, ok, want[i])
			}
		}
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

// With no snapshot configuration the archive driver keeps its archives in
// the embedded store: a claim of its own, mounted into the control plane,
// which then cannot roll two pods over one volume.
func TestSnapshotDefaults(t *testing.T) {
	r := render(t, Values{})
	pvc := must[*corev1.PersistentVolumeClaim](r, "agentbox-snapshots")
	if q := pvc.Spec.Resources.Requests[corev1.ResourceStorage]; q.String() != "10Gi" || pvc.Spec.StorageClassName != nil ||
		!slices.Equal(pvc.Spec.AccessModes, []corev1.PersistentVolumeAccessMode{corev1.ReadWriteOnce}) {
		t.Errorf("embedded store claim: size %s, class %v, modes %v", q.String(), pvc.Spec.StorageClassName, pvc.Spec.AccessModes)
	}
	d := r.deployment()
	c := container(t, d)
	env := map[string]string{}
	for _, e := range c.Env {
		env[e.Name] = e.Value
	}
	if env["AGENTBOX_SNAPSHOT_DRIVER"] != "archive" || env["AGENTBOX_ARCHIVE_DIR"] != "/var/lib/agentbox-snapshots" || env["AGENTBOX_ARCHIVE_COMPRESSION"] != "gzip" {
		t.Errorf("snapshot environment %v", env)
	}
	for _, name := range []string{"AGENTBOX_ARCHIVE_ENDPOINT", "AGENTBOX_ARCHIVE_CREDENTIALS_DIR", "AGENTBOX_ARCHIVE_BUCKET"} {
		if _, ok := env[name]; ok {
			t.Errorf("the embedded store gets the S3 setting %s", name)
		}
	}
	if v, _ := volume(d, "snapshots"); v.PersistentVolumeClaim == nil || v.PersistentVolumeClaim.ClaimName != "agentbox-snapshots" {
		t.Errorf("snapshots volume %+v", v)
	}
	if mountPath(c, "snapshots") != env["AGENTBOX_ARCHIVE_DIR"] {
		t.Errorf("snapshots mounted at %q, the control plane looks in %q", mountPath(c, "snapshots"), env["AGENTBOX_ARCHIVE_DIR"])
	}
	if _, ok := volume(d, "archive-credentials"); ok {
		t.Error("the embedded store mounts S3 credentials")
	}
	if d.Spec.Strategy.Type != appsv1.RecreateDeploymentStrategyType {
		t.Errorf("strategy %q with the embedded store's ReadWriteOnce volume", d.Spec.Strategy.Type)
	}

	t.Run("sized, classed", func(t *testing.T) {
		r := renderRaw(t, "snapshot: {archive: {embedded: {size: 50Gi, storageClassName: fast}}}")
		pvc := must[*corev1.PersistentVolumeClaim](r, "agentbox-snapshots")
		if q := pvc.Spec.Resources.Requests[corev1.ResourceStorage]; q.String() != "50Gi" || pvc.Spec.StorageClassName == nil || *pvc.Spec.StorageClassName != "fast" {
			t.Errorf("claim: size %s, class %v", q.String(), pvc.Spec.StorageClassName)
		}
	})
	t.Run("existing claim", func(t *testing.T) {
		r := renderRaw(t, "snapshot: {archive: {embedded: {existingClaim: kept-snapshots}}}")
		if _, ok := find[*corev1.PersistentVolumeClaim](r, "agentbox-snapshots"); ok {
			t.Error("claim rendered with an existing one")
		}
		if v, _ := volume(r.deployment(), "snapshots"); v.PersistentVolumeClaim == nil || v.PersistentVolumeClaim.ClaimName != "kept-snapshots" {
			t.Errorf("snapshots volume %+v", v)
		}
	})
	t.Run("an endpoint means S3", func(t *testing.T) {
		r := renderRaw(t, "snapshot: {archive: {endpoint: 'https://s3.example.com', bucket: b, credentialsSecret: s3}}")
		if _, ok := find[*corev1.PersistentVolumeClaim](r, "agentbox-snapshots"); ok {
			t.Error("embedded store claim rendered with an S3 endpoint")
		}
		d := r.deployment()
		if _, ok := volume(d, "snapshots"); ok {
			t.Error("embedded store mounted with an S3 endpoint")
		}
		if e, _ := envValue(container(t, d), "AGENTBOX_ARCHIVE_DIR"); e.Value != "" {
			t.Errorf("AGENTBOX_ARCHIVE_DIR %q with an S3 endpoint", e.Value)
		}
	})
	t.Run("volumesnapshot", func(t *testing.T) {
		r := renderRaw(t, "snapshot: {driver: volumesnapshot, volumeSnapshotClassName: csi-snap}")
		if _, ok := find[*corev1.PersistentVolumeClaim](r, "agentbox-snapshots"); ok {
			t.Error("embedded store claim rendered for the volumesnapshot driver")
		}
		c := container(t, r.deployment())
		if e, _ := envValue(c, "AGENTBOX_VOLUME_SNAPSHOT_CLASS"); e.Value != "csi-snap" {
			t.Errorf("class %q", e.Value)
		}
	})
	t.Run("replicas with S3", func(t *testing.T) {
		r := renderRaw(t, "replicaCount: 3\nstore: {existingSecret: pg}\nsnapshot: {archive: {endpoint: 'https://s3.example.com', bucket: b, credentialsSecret: s3}}")
		if d := r.deployment(); *d.Spec.Replicas != 3 || d.Spec.Strategy.Type == appsv1.RecreateDeploymentStrategyType {
			t.Errorf("replicas %d, strategy %q", *d.Spec.Replicas, d.Spec.Strategy.Type)
		}
	})
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
		if q := pvc.Spec.Resources.Requests[corev1.ResourceStorage]; q.String() != "10Gi" {
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
		r := renderRaw(t, "replicaCount: 2\nstore: {dsn: 'postgres://u:p@db/agentbox'}\nsnapshot: {driver: volumesnapshot}")
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

// TestClaimSizeOnUpgrade: a claim the chart made and that exists already
// keeps its size where its StorageClass cannot expand it, so that an
// upgrade (to a chart whose default is larger, or with a larger value)
// does not fail on it; where the class can expand it, it gets the value.
func TestClaimSizeOnUpgrade(t *testing.T) {
	claim := func(name, class, size string) *corev1.PersistentVolumeClaim {
		c := &corev1.PersistentVolumeClaim{
			ObjectMeta: metav1.ObjectMeta{Name: name, Namespace: testNamespace},
			Spec: corev1.PersistentVolumeClaimSpec{
				AccessModes: []corev1.PersistentVolumeAccessMode{corev1.ReadWriteOnce},
				Resources:   corev1.VolumeResourceRequirements{Requests: corev1.ResourceList{corev1.ResourceStorage: resource.MustParse(size)}},
			},
		}
		if class != "" {
			c.Spec.StorageClassName = &class
		}
		return c
	}
	class := func(name string, expand bool) *storagev1.StorageClass {
		return &storagev1.StorageClass{ObjectMeta: metav1.ObjectMeta{Name: name}, Provisioner: "example.com/csi", AllowVolumeExpansion: &expand}
	}
	sizes := func(objects ...runtime.Object) (string, string) {
		t.Helper()
		rel, err := RenderInstall(testNamespace, DefaultReleaseName, Values{}, objects...)
		if err != nil {
			t.Fatal(err)
		}
		r := parse(t, rel)
		st := must[*corev1.PersistentVolumeClaim](r, "agentbox-store").Spec.Resources.Requests[corev1.ResourceStorage]
		sn := must[*corev1.PersistentVolumeClaim](r, "agentbox-snapshots").Spec.Resources.Requests[corev1.ResourceStorage]
		return st.String(), sn.String()
	}
	for name, tc := range map[string]struct {
		objects    []runtime.Object
		store, snp string
	}{
		"first install": {nil, "10Gi", "10Gi"},
		"class that cannot expand": {[]runtime.Object{claim("agentbox-store", "fixed", "1Gi"), claim("agentbox-snapshots", "fixed", "5Gi"), class("fixed", false)},
			"1Gi", "5Gi"},
		"class that can expand": {[]runtime.Object{claim("agentbox-store", "grows", "1Gi"), claim("agentbox-snapshots", "grows", "5Gi"), class("grows", true)},
			"10Gi", "10Gi"},
		"class gone, or none named": {[]runtime.Object{claim("agentbox-store", "gone", "1Gi"), claim("agentbox-snapshots", "", "5Gi")},
			"1Gi", "5Gi"},
	} {
		t.Run(name, func(t *testing.T) {
			if st, sn := sizes(tc.objects...); st != tc.store || sn != tc.snp {
				t.Errorf("agentbox-store %s, agentbox-snapshots %s; want %s and %s", st, sn, tc.store, tc.snp)
			}
		})
	}
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

// TestTemplateWithoutCluster renders as `helm template` does, and as GitOps
// tools such as Argo CD do: lookup sees no cluster, so the chart cannot
// reuse the CA and admin token it generated before. New ones on every
// render would replace the CA on every sync and break every sandbox's mTLS,
// so it refuses, and says what to do instead.
func TestTemplateWithoutCluster(t *testing.T) {
	cases := map[string]struct{ raw, set, notSet string }{
		"both generated":  {"", "set ca.existingSecret and adminToken.existingSecret (", ""},
		"token generated": {"ca: {existingSecret: my-ca}", "set adminToken.existingSecret (", "ca.existingSecret"},
		"CA generated":    {"adminToken: {existingSecret: my-token}", "set ca.existingSecret (", "adminToken.existingSecret"},
	}
	for name, tc := range cases {
		t.Run(name, func(t *testing.T) {
			_, err := Template(testNamespace, DefaultReleaseName, Values{Raw: tc.raw})
			if err == nil {
				t.Fatal("rendered without the cluster, with generated secrets")
			}
			msg := err.Error()
			for _, want := range []string{"cannot reach the cluster", "helm template", "Argo CD", "breaks the mTLS", tc.set, "--dry-run=server"} {
				if !strings.Contains(msg, want) {
					t.Errorf("error lacks %q:\n%s", want, msg)
				}
			}
			if tc.notSet != "" && strings.Contains(msg, tc.notSet) {
				t.Errorf("error asks for %s, which is set:\n%s", tc.notSet, msg)
			}
		})
	}

	// With both Secrets named, the render needs no lookup and gives the
	// same manifest every time, which is what a GitOps tool must see.
	own := Values{Raw: "ca: {existingSecret: my-ca}\nadminToken: {existingSecret: my-token}"}
	first, err := Template(testNamespace, DefaultReleaseName, own)
	if err != nil {
		t.Fatal(err)
	}
	second, err := Template(testNamespace, DefaultReleaseName, own)
	if err != nil {
		t.Fatal(err)
	}
	if first.Manifest != second.Manifest {
		t.Error("two renders of the same values differ")
	}
	r := parse(t, first)
	for _, o := range r.objects {
		if s, ok := o.(*corev1.Secret); ok {
			t.Errorf("Secret %s rendered although both are the user's", s.Name)
		}
	}
	d := r.deployment()
	if v, _ := volume(d, "ca"); v.Secret == nil || v.Secret.SecretName != "my-ca" {
		t.Errorf("ca volume %+v", v)
	}
	if v, _ := volume(d, "admin-token"); v.Secret == nil || v.Secret.SecretName != "my-token" {
		t.Errorf("admin-token volume %+v", v)
	}
	if !strings.Contains(first.Notes, "secret my-token") || !strings.Contains(first.Notes, "secret my-ca") {
		t.Errorf("NOTES do not point at the user's Secrets:\n%s", first.Notes)
	}
}

// TestInstallReusesGeneratedSecrets renders as an upgrade would, with the
// Secrets an earlier install generated in the namespace: the chart keeps
// them rather than generating new ones.
func TestInstallReusesGeneratedSecrets(t *testing.T) {
	first := render(t, Values{})
	ca := must[*corev1.Secret](first, DefaultCASecret)
	token := must[*corev1.Secret](first, DefaultAdminTokenSecret)
	ca.Namespace, token.Namespace = testNamespace, testNamespace

	rel, err := RenderInstall(testNamespace, DefaultReleaseName, Values{}, ca, token)
	if err != nil {
		t.Fatal(err)
	}
	again := parse(t, rel)
	if got := must[*corev1.Secret](again, DefaultCASecret); string(got.Data["tls.crt"]) != string(ca.Data["tls.crt"]) ||
		string(got.Data["tls.key"]) != string(ca.Data["tls.key"]) {
		t.Error("the CA was generated again although the namespace holds one")
	}
	if got := must[*corev1.Secret](again, DefaultAdminTokenSecret); string(got.Data["token"]) != string(token.Data["token"]) {
		t.Error("the admin token was generated again although the namespace holds one")
	}
	// A Secret of the same name in another namespace is not the release's.
	ca.Namespace = "elsewhere"
	rel, err = RenderInstall(testNamespace, DefaultReleaseName, Values{}, ca)
	if err != nil {
		t.Fatal(err)
	}
	if got := must[*corev1.Secret](parse(t, rel), DefaultCASecret); string(got.Data["tls.crt"]) == string(ca.Data["tls.crt"]) {
		t.Error("the CA of another namespace was reused")
	}
}

func TestImageReferences(t *testing.T) {
	cases := []struct {
		name                                  string
		values                                Values
		controlPlane, sandbox, supervisor, ep string
	}{
		{"defaults", Values{}, "agentbox/agentbox-controlplane:dev", "agentbox/agentbox-sandbox:dev",
			"agentbox/agentbox-supervisor:dev", "agentbox/agentbox-egress-proxy:dev"},
		{"registry and tag", Values{ImageRegistry: "registry.example.com/mirror", ImageTag: "v1.2.3"},
			"registry.example.com/mirror/agentbox/agentbox-controlplane:v1.2.3",
			"registry.example.com/mirror/agentbox/agentbox-sandbox:v1.2.3",
			"registry.example.com/mirror/agentbox/agentbox-supervisor:v1.2.3",
			"registry.example.com/mirror/agentbox/agentbox-egress-proxy:v1.2.3"},
		{"trailing slash", Values{ImageRegistry: "localhost:5000/"}, "localhost:5000/agentbox/agentbox-controlplane:dev",
			"localhost:5000/agentbox/agentbox-sandbox:dev", "localhost:5000/agentbox/agentbox-supervisor:dev",
			"localhost:5000/agentbox/agentbox-egress-proxy:dev"},
		{"raw wins", Values{ImageTag: "v1", Raw: "image: {controlPlane: {repository: me/cp, tag: v2}, supervisor: {repository: me/sup}}"},
			"me/cp:v2", "agentbox/agentbox-sandbox:v1", "me/sup:v1", "agentbox/agentbox-egress-proxy:v1"},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			c := container(t, render(t, tc.values).deployment())
			if c.Image != tc.controlPlane {
				t.Errorf("control plane image %q, want %q", c.Image, tc.controlPlane)
			}
			for flag, want := range map[string]string{"sandbox-image": tc.sandbox, "supervisor-image": tc.supervisor, "egress-proxy-image": tc.ep} {
				if !slices.Contains(c.Args, "--"+flag+"="+want) {
					t.Errorf("args %q lack --%s=%s", c.Args, flag, want)
				}
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
	if !slices.Contains(c.Args, "--supervisor-image-pull-policy=Never") {
		t.Errorf("args %q lack --supervisor-image-pull-policy=Never", c.Args)
	}
	c = container(t, render(t, Values{Raw: "image: {supervisor: {pullPolicy: Always}}"}).deployment())
	if !slices.Contains(c.Args, "--supervisor-image-pull-policy=Always") {
		t.Errorf("args %q lack the supervisor's own --supervisor-image-pull-policy=Always", c.Args)
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
		"SQLite with replicas":  {"replicaCount: 2\nsnapshot: {driver: volumesnapshot}", "PostgreSQL"},
		"embedded store with replicas": {"replicaCount: 2\nstore: {existingSecret: pg}",
			"replicaCount > 1 cannot use the embedded snapshot store"},
		"embedded store, default driver, replicas": {"replicaCount: 3\nstore: {existingSecret: pg}\nsnapshot: {driver: archive, archive: {embedded: {existingClaim: rwx}}}",
			"snapshot.archive.endpoint"},
		"S3 without bucket":    {"snapshot: {driver: archive, archive: {endpoint: 'https://s3.example.com', credentialsSecret: s3}}", "snapshot.archive.bucket"},
		"archive without keys": {"snapshot: {driver: archive, archive: {endpoint: 'https://s3.example.com', bucket: b}}", "snapshot.archive.credentialsSecret"},
		"bad embedded size":    {"snapshot: {archive: {embedded: {size: lots}}}", "size"},
		"no sandbox workers":   {"sandboxWorkers: 0", "sandboxWorkers"},
		"too many workers":     {"sandboxWorkers: 1000", "sandboxWorkers"},
		"bad run retention":    {"computeApi: {runRetention: a week}", "runRetention"},
		"run retention number": {"computeApi: {runRetention: 7}", "runRetention"},
		"bad artifact size":    {"computeApi: {runArtifacts: {maxFileSize: huge}}", "maxFileSize"},
		"plain http issuer":    {"computeApi: {userTokens: {issuer: 'http://agentbox.example'}}", "issuer"},
		"bad key rotation":     {"computeApi: {userTokens: {keyRotation: daily}}", "keyRotation"},
	}
	for name, tc := range cases {
		t.Run(name, func(t *testing.T) {
			_, err := RenderInstall(testNamespace, DefaultReleaseName, Values{Raw: tc.raw})
			if err == nil {
				t.Fatalf("%q rendered", tc.raw)
			}
			if !strings.Contains(err.Error(), tc.want) {
				t.Errorf("error %q does not mention %q", err, tc.want)
			}
		})
	}
	if _, err := RenderInstall(testNamespace, DefaultReleaseName, Values{Raw: "global: {fromParent: x}"}); err != nil {
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

// reservedLabels are the label keys the chart sets itself, which
// global.commonLabels may not use.
var reservedLabels = []string{
	"helm.sh/chart", "app.kubernetes.io/name", "app.kubernetes.io/instance", "app.kubernetes.io/version",
	"app.kubernetes.io/managed-by", "app.kubernetes.io/part-of", "app.kubernetes.io/component",
}

// renderSkippingSchema renders as `helm install --skip-schema-validation`
// does, which leaves the template's own checks as the only guard.
func renderSkippingSchema(raw string) error {
	ch, err := Load()
	if err != nil {
		return err
	}
	ch.Schema = nil
	vals, err := Values{Raw: raw}.Map()
	if err != nil {
		return err
	}
	_, err = renderInstall(ch, testNamespace, DefaultReleaseName, vals)
	return err
}

// noDuplicateKeys parses every document of the manifest with a YAML parser
// that refuses duplicate keys; Kubernetes' own decoding would silently keep
// one of them.
func noDuplicateKeys(t *testing.T, manifest string) {
	t.Helper()
	if _, err := yaml.YAMLToJSONStrict([]byte("labels:\n  a: x\n  a: y\n")); err == nil {
		t.Fatal("the strict parser accepts duplicate keys; this check would prove nothing")
	}
	for name, doc := range releaseutil.SplitManifests(manifest) {
		if _, err := yaml.YAMLToJSONStrict([]byte(doc)); err != nil {
			t.Errorf("%s: %v\n%s", name, err, doc)
		}
	}
}

func TestCommonLabelsRefuseReservedKeys(t *testing.T) {
	// The keys are those the chart really sets: every one of them is on a
	// rendered object.
	set := map[string]bool{}
	for _, o := range render(t, Values{}).objects {
		for k := range o.(interface{ GetLabels() map[string]string }).GetLabels() {
			set[k] = true
		}
	}
	for _, key := range reservedLabels {
		if !set[key] {
			t.Errorf("%s is reserved but the chart sets it on no object", key)
		}
	}
	for k := range set {
		if !slices.Contains(reservedLabels, k) {
			t.Errorf("the chart sets %s, which global.commonLabels may still use", k)
		}
	}

	for _, key := range reservedLabels {
		t.Run(key, func(t *testing.T) {
			raw := "global: {commonLabels: {" + key + ": mine, team: infra}}"
			_, err := RenderInstall(testNamespace, DefaultReleaseName, Values{Raw: raw})
			if err == nil {
				t.Fatalf("%q rendered", raw)
			}
			// A JSON pointer: "/" in the key is "~1".
			at := "at '/global/commonLabels/" + strings.ReplaceAll(key, "/", "~1") + "'"
			for _, want := range []string{at, "reserved: the chart sets this label itself, choose another key"} {
				if !strings.Contains(err.Error(), want) {
					t.Errorf("schema error lacks %q:\n%v", want, err)
				}
			}
			// Without the schema, the template refuses it with its own message.
			err = renderSkippingSchema(raw)
			if err == nil || !strings.Contains(err.Error(), "global.commonLabels may not set \""+key+"\": the chart sets it itself") {
				t.Errorf("without the schema: %v", err)
			}
		})
	}

	// podLabels may not take over the selector's keys either.
	for _, key := range []string{"app.kubernetes.io/name", "app.kubernetes.io/instance", "app.kubernetes.io/component"} {
		raw := "podLabels: {" + key + ": other}"
		if _, err := RenderInstall(testNamespace, DefaultReleaseName, Values{Raw: raw}); err == nil ||
			!strings.Contains(err.Error(), "at '/podLabels/"+strings.ReplaceAll(key, "/", "~1")+"'") ||
			!strings.Contains(err.Error(), "reserved: the Deployment selector uses this label") {
			t.Errorf("%q: %v", raw, err)
		}
		if err := renderSkippingSchema(raw); err == nil || !strings.Contains(err.Error(), "podLabels may not set \""+key+"\"") {
			t.Errorf("%q without the schema: %v", raw, err)
		}
	}
	// Standard keys that are not in the selector stay allowed on the pods.
	if _, err := RenderInstall(testNamespace, DefaultReleaseName, Values{Raw: "podLabels: {app.kubernetes.io/version: v9}"}); err != nil {
		t.Errorf("podLabels with a non-selector standard key: %v", err)
	}
}

// TestCommonLabelsReachPods checks that global.commonLabels are on every
// object and on every pod template, but in no selector, and that no key is
// rendered twice, also where commonLabels and podLabels share one.
func TestCommonLabelsReachPods(t *testing.T) {
	plain := render(t, Values{Raw: "runscInstaller: {enabled: true}"})
	raw := "global: {commonLabels: {example.com/team: infra, tier: common, cost-center: '42'}}\n" +
		"podLabels: {tier: control}\nrunscInstaller: {enabled: true}"
	rel, err := RenderInstall(testNamespace, DefaultReleaseName, Values{Raw: raw})
	if err != nil {
		t.Fatal(err)
	}
	noDuplicateKeys(t, rel.Manifest)
	r := render(t, Values{Raw: raw})
	for _, o := range r.objects {
		acc := o.(interface {
			GetName() string
			GetLabels() map[string]string
		})
		l := acc.GetLabels()
		if l["example.com/team"] != "infra" || l["tier"] != "common" || l["cost-center"] != "42" {
			t.Errorf("%T %s labels %v", o, acc.GetName(), l)
		}
	}

	d := r.deployment()
	ds := must[*appsv1.DaemonSet](r, "agentbox-runsc-installer")
	pods := map[string]struct {
		labels, selector, plainSelector map[string]string
		tier                            string
	}{
		"control plane": {d.Spec.Template.Labels, d.Spec.Selector.MatchLabels, plain.deployment().Spec.Selector.MatchLabels, "control"},
		"runsc installer": {ds.Spec.Template.Labels, ds.Spec.Selector.MatchLabels,
			must[*appsv1.DaemonSet](plain, "agentbox-runsc-installer").Spec.Selector.MatchLabels, "common"},
	}
	for name, p := range pods {
		if p.labels["example.com/team"] != "infra" || p.labels["cost-center"] != "42" || p.labels["tier"] != p.tier {
			t.Errorf("%s pod labels %v", name, p.labels)
		}
		// Selectors cannot change after install: labels a user adds or
		// changes later must not be in them.
		if !maps.Equal(p.selector, p.plainSelector) {
			t.Errorf("%s selector %v, want %v whatever the common labels", name, p.selector, p.plainSelector)
		}
		for k, v := range p.selector {
			if p.labels[k] != v {
				t.Errorf("%s selector %s=%s does not match the pod labels %v", name, k, v, p.labels)
			}
		}
	}
	svc := must[*corev1.Service](r, APIService)
	if !maps.Equal(svc.Spec.Selector, plain.deployment().Spec.Selector.MatchLabels) {
		t.Errorf("service selector %v", svc.Spec.Selector)
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
		if _, err := RenderInstall(testNamespace, DefaultReleaseName, Values{Raw: raw}); err == nil || !strings.Contains(err.Error(), want) {
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
	rel, err := RenderInstall(long, DefaultReleaseName, Values{Raw: "runscInstaller: {enabled: true}"})
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
	_, err = RenderInstall(testNamespace, DefaultReleaseName, Values{Raw: "runscInstaller: {enabled: true, namespace: " + testNamespace + "}"})
	if err == nil || !strings.Contains(err.Error(), "must not be the release namespace") {
		t.Errorf("installer namespace = release namespace: %v", err)
	}
}
