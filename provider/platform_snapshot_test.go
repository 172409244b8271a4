package provider

import (
	"context"
	"strings"
	"testing"

	"github.com/hashicorp/terraform-plugin-framework/diag"
	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/client-go/kubernetes/fake"

	"github.com/agentbox/terraform-provider-agentbox/internal/api/v1alpha1"
	"github.com/agentbox/terraform-provider-agentbox/internal/chart"
)

// The control plane's failed snapshot check is an apply and refresh
// warning that names the fix; a passed one, a report of a replaced pod and
// a report about another driver say nothing.
func TestWarnSnapshotCheck(t *testing.T) {
	ctx := context.Background()
	const ns = "agentbox-system"
	rel, err := chart.RenderInstall(ns, chart.DefaultReleaseName, chart.Values{Raw: "snapshot: {driver: volumesnapshot}"})
	if err != nil {
		t.Fatal(err)
	}
	report := func(driver, ready, pod string) *corev1.ConfigMap {
		return &corev1.ConfigMap{ObjectMeta: metav1.ObjectMeta{Namespace: ns, Name: v1alpha1.ControlPlaneStatusConfigMap}, Data: map[string]string{
			v1alpha1.StatusKeySnapshotDriver: driver, v1alpha1.StatusKeySnapshotReady: ready,
			v1alpha1.StatusKeySnapshotReason:  v1alpha1.ReasonSnapshotAPIMissing,
			v1alpha1.StatusKeySnapshotMessage: "the volumesnapshot snapshot driver cannot work: the cluster does not serve VolumeSnapshots; to fix it, install the CRDs",
			v1alpha1.StatusKeyReportedBy:      pod, v1alpha1.StatusKeySnapshotCheckedAt: "2030-01-02T03:04:05Z",
		}}
	}
	live := &corev1.Pod{ObjectMeta: metav1.ObjectMeta{Namespace: ns, Name: "cp-live"}}
	for name, tc := range map[string]struct {
		cm   *corev1.ConfigMap
		warn bool
	}{
		"failed":          {report("volumesnapshot", "false", "cp-live"), true},
		"passed":          {report("volumesnapshot", "true", "cp-live"), false},
		"replaced pod":    {report("volumesnapshot", "false", "cp-gone"), false},
		"another driver":  {report("archive/embedded", "false", "cp-live"), false},
		"no report (yet)": {nil, false},
	} {
		t.Run(name, func(t *testing.T) {
			cs := fake.NewClientset(live)
			if tc.cm != nil {
				if _, err := cs.CoreV1().ConfigMaps(ns).Create(ctx, tc.cm, metav1.CreateOptions{}); err != nil {
					t.Fatal(err)
				}
			}
			var diags diag.Diagnostics
			warnSnapshotCheck(ctx, cs, rel, &diags)
			if diags.HasError() || (diags.WarningsCount() == 1) != tc.warn || diags.WarningsCount() > 1 {
				t.Fatalf("diagnostics %v, want a warning: %v", diags, tc.warn)
			}
			if tc.warn {
				d := diags.Warnings()[0].Detail()
				for _, want := range []string{"install the CRDs", "SnapshotAPIMissing", "IdleStopBlocked", v1alpha1.ControlPlaneStatusConfigMap} {
					if !strings.Contains(d, want) {
						t.Errorf("warning %q does not mention %q", d, want)
					}
				}
			}
		})
	}
}
