package computeapi

import (
	"context"
	"time"

	coordinationv1 "k8s.io/api/coordination/v1"
	"sigs.k8s.io/controller-runtime/pkg/client"

	"github.com/agentbox/terraform-provider-agentbox/internal/api/v1alpha1"
)

// timedWriter times the API's writes to the Kubernetes API server (activity
// clock renewals and holds, pool takes, terminations): they are the part of a
// call the control plane waits on and does not control, so their latency
// is what explains a slow claim.
type timedWriter struct{ client.Client }

func (w timedWriter) observe(verb string, obj client.Object, start time.Time) {
	kind := "other"
	switch obj.(type) {
	case *v1alpha1.Sandbox:
		kind = "Sandbox"
	case *coordinationv1.Lease:
		kind = "Lease"
	}
	metricKubeWriteSeconds.WithLabelValues(verb, kind).Observe(time.Since(start).Seconds())
}

func (w timedWriter) Create(ctx context.Context, obj client.Object, opts ...client.CreateOption) error {
	defer w.observe("create", obj, time.Now())
	return w.Client.Create(ctx, obj, opts...)
}

func (w timedWriter) Update(ctx context.Context, obj client.Object, opts ...client.UpdateOption) error {
	defer w.observe("update", obj, time.Now())
	return w.Client.Update(ctx, obj, opts...)
}

func (w timedWriter) Patch(ctx context.Context, obj client.Object, patch client.Patch, opts ...client.PatchOption) error {
	defer w.observe("patch", obj, time.Now())
	return w.Client.Patch(ctx, obj, patch, opts...)
}

func (w timedWriter) Delete(ctx context.Context, obj client.Object, opts ...client.DeleteOption) error {
	defer w.observe("delete", obj, time.Now())
	return w.Client.Delete(ctx, obj, opts...)
}
