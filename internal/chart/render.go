package chart

import (
	"bytes"
	"fmt"
	"path"
	"strings"

	"helm.sh/helm/v3/pkg/chart"
	"helm.sh/helm/v3/pkg/chartutil"
	"helm.sh/helm/v3/pkg/engine"
	"helm.sh/helm/v3/pkg/release"
	"helm.sh/helm/v3/pkg/releaseutil"
	corev1 "k8s.io/api/core/v1"
	storagev1 "k8s.io/api/storage/v1"
	"k8s.io/apimachinery/pkg/api/meta"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/runtime"
	"k8s.io/apimachinery/pkg/runtime/schema"
	"k8s.io/client-go/dynamic"
	dynamicfake "k8s.io/client-go/dynamic/fake"
	"k8s.io/client-go/kubernetes/scheme"
)

// renderKubeVersion is the oldest Kubernetes the chart supports: what
// renders there renders on newer clusters too.
var renderKubeVersion = chartutil.KubeVersion{Version: "v1.31.0", Major: "1", Minor: "31"}

// RenderInstall renders the chart as an install into a cluster that holds
// objects would: the templates' lookups see those objects and the
// namespace kube-system, which every cluster has, and nothing else. So
// without objects the chart generates its CA and admin token, as on a first
// install, and with a CA Secret among objects it reuses that one, as on an
// upgrade.
//
// Unlike Template, which renders as `helm template` does and so refuses to
// generate secrets (see templates/secrets.yaml), this is what checking
// values before an install needs. Nothing is sent to any cluster.
func RenderInstall(namespace, releaseName string, v Values, objects ...runtime.Object) (*Release, error) {
	ch, vals, err := prepare(Options{Namespace: namespace, ReleaseName: releaseName, Values: v})
	if err != nil {
		return nil, err
	}
	return renderInstall(ch, namespace, releaseName, vals, objects...)
}

func renderInstall(ch *chart.Chart, namespace, releaseName string, vals map[string]any, objects ...runtime.Object) (*Release, error) {
	// The steps of Helm's install action up to the manifest, with a
	// lookup that answers from objects instead of a cluster; Helm's own
	// actions reach lookups only through a REST configuration.
	caps := chartutil.DefaultCapabilities.Copy()
	caps.KubeVersion = renderKubeVersion
	if ch.Metadata.KubeVersion != "" && !chartutil.IsCompatibleRange(ch.Metadata.KubeVersion, caps.KubeVersion.String()) {
		return nil, fmt.Errorf("rendering the chart: it requires Kubernetes %s", ch.Metadata.KubeVersion)
	}
	if err := chartutil.ProcessDependenciesWithMerge(ch, vals); err != nil {
		return nil, fmt.Errorf("rendering the chart: %w", err)
	}
	top, err := chartutil.ToRenderValues(ch, vals, chartutil.ReleaseOptions{
		Name: releaseName, Namespace: namespace, Revision: 1, IsInstall: true,
	}, caps)
	if err != nil {
		return nil, fmt.Errorf("rendering the chart: %w", err)
	}
	cluster := offlineCluster{dynamicfake.NewSimpleDynamicClient(scheme.Scheme,
		append([]runtime.Object{&corev1.Namespace{ObjectMeta: metav1.ObjectMeta{Name: metav1.NamespaceSystem}}}, objects...)...)}
	files, err := engine.RenderWithClientProvider(ch, top, cluster)
	if err != nil {
		return nil, fmt.Errorf("rendering the chart: %w", err)
	}

	var notes string
	for name, content := range files {
		if strings.HasSuffix(name, "NOTES.txt") {
			if name == path.Join(ch.Name(), "templates", "NOTES.txt") {
				notes = content
			}
			delete(files, name)
		}
	}
	_, manifests, err := releaseutil.SortManifests(files, nil, releaseutil.InstallOrder)
	if err != nil {
		return nil, fmt.Errorf("rendering the chart: %w", err)
	}
	var manifest bytes.Buffer
	for _, m := range manifests {
		fmt.Fprintf(&manifest, "---\n# Source: %s\n%s\n", m.Name, m.Content)
	}
	return fromHelm(&release.Release{
		Name: releaseName, Namespace: namespace, Version: 1, Chart: ch, Config: vals,
		Manifest: manifest.String(),
		Info:     &release.Info{Status: release.StatusPendingInstall, Notes: notes},
	}), nil
}

// offlineCluster answers the templates' lookups from a fake dynamic client.
type offlineCluster struct{ client dynamic.Interface }

// offlineKinds are the kinds the chart looks up, and whether they are
// namespaced. A template that looks up another kind fails the render
// rather than getting a guess.
var offlineKinds = map[schema.GroupVersionKind]bool{
	corev1.SchemeGroupVersion.WithKind("Namespace"):             false,
	corev1.SchemeGroupVersion.WithKind("Secret"):                true,
	corev1.SchemeGroupVersion.WithKind("PersistentVolumeClaim"): true,
	storagev1.SchemeGroupVersion.WithKind("StorageClass"):       false,
}

func (c offlineCluster) GetClientFor(apiVersion, kind string) (dynamic.NamespaceableResourceInterface, bool, error) {
	gvk := schema.FromAPIVersionAndKind(apiVersion, kind)
	namespaced, ok := offlineKinds[gvk]
	if !ok {
		return nil, false, fmt.Errorf("lookup of %s %s: RenderInstall knows only Namespaces, Secrets, PersistentVolumeClaims and StorageClasses", apiVersion, kind)
	}
	gvr, _ := meta.UnsafeGuessKindToResource(gvk)
	return c.client.Resource(gvr), namespaced, nil
}
