package provider

import (
	"context"
	"fmt"
	"time"

	"github.com/hashicorp/terraform-plugin-framework/diag"
	"github.com/hashicorp/terraform-plugin-log/tflog"
	"k8s.io/client-go/kubernetes"

	"github.com/agentbox/terraform-provider-agentbox/internal/api/v1alpha1"
	"github.com/agentbox/terraform-provider-agentbox/internal/chart"
)

// snapshotCheckWait bounds how long an apply waits for the new control
// plane's first snapshot check; it runs right after the control plane
// becomes ready, and an S3 store that does not answer takes 30 s to fail.
const snapshotCheckWait = time.Minute

// waitSnapshotCheck waits for the control plane of rel to report its
// snapshot check. Finding none is not an error: refreshes report it later.
func waitSnapshotCheck(ctx context.Context, data *providerData, rel *chart.Release) {
	clients, err := data.Clients()
	if err != nil {
		return
	}
	if _, err := chart.WaitSnapshotCheck(ctx, clients.Kubernetes, rel, snapshotCheckWait); err != nil {
		tflog.Warn(ctx, "waiting for the control plane's snapshot check", map[string]any{"error": err.Error()})
	}
}

// warnSnapshotCheck adds a warning when the running control plane of rel
// reports that its snapshot driver cannot work: the platform serves, but
// sandboxes are not idle-stopped until it is fixed. A report that is not
// the running control plane's about the configured driver (not written
// yet, or left by a replaced pod) says nothing either way.
func warnSnapshotCheck(ctx context.Context, cs kubernetes.Interface, rel *chart.Release, diags *diag.Diagnostics) {
	c, err := chart.ReadSnapshotCheck(ctx, cs, rel.Namespace)
	if err != nil {
		tflog.Warn(ctx, "reading the control plane's snapshot check", map[string]any{"error": err.Error()})
		return
	}
	if !c.Current(rel) || c.Ready {
		return
	}
	diags.AddWarning("Idle stop cannot work on this agentbox platform",
		fmt.Sprintf("%s (%s, checked %s).\n\nUntil this is fixed, sandboxes are not stopped when idle: they keep running and serving "+
			"calls, and each says why in its IdleStopBlocked condition. The control plane checks again every minute; the ConfigMap "+
			"%s in namespace %s shows its latest result.",
			c.Message, c.Reason, c.CheckedAt.UTC().Format(time.RFC3339), v1alpha1.ControlPlaneStatusConfigMap, rel.Namespace))
}
