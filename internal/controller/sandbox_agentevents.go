package controller

import (
	corev1 "k8s.io/api/core/v1"
	"k8s.io/apimachinery/pkg/runtime"

	"github.com/agentbox/terraform-provider-agentbox/internal/api/v1alpha1"
	api "github.com/agentbox/terraform-provider-agentbox/internal/computeapi/client"
)

// AgentEventSink takes the events of each agent's sandbox into the
// agent's event log (GET /v1/agents/{id}/events). Record must not block:
// it is called from reconciles. The control plane gives the sandbox
// controller the Compute API's sink, in process, rather than letting the
// API read the Kubernetes Events the controller records: the event
// recorder aggregates and may drop events, and the API server keeps them
// an hour, while the agent's log must be complete and numbered for
// followers to resume in; in process the event reaches the store at once.
type AgentEventSink interface {
	Record(api.AgentEvent)
}

// agentEventTypes are the agent event types of the controller's event
// reasons; a reason not here is an error when a Warning, else a notice.
// Checkpointed is left out: snapshotCut tells of it, with the snapshot.
var agentEventTypes = map[string]string{
	EventWorkspaceCreated:    api.AgentEventCreated,
	EventAdoptedFromWarmPool: api.AgentEventCreated,
	EventPodCreated:          api.AgentEventPodCreated,
	EventSandboxReady:        api.AgentEventReady,
	EventIdleStopping:        api.AgentEventIdleStopping,
	EventIdleStopped:         api.AgentEventStopped,
	EventIdleStopCancelled:   api.AgentEventIdleStopCancelled,
	EventResuming:            api.AgentEventResuming,
	EventResumed:             api.AgentEventResumed,
	EventPodRecreated:        api.AgentEventPodReplaced,
	EventPodFailed:           api.AgentEventPodFailed,
	EventNodeLost:            api.AgentEventNodeLost,
	EventCheckpointed:        "",
}

// agentEventType is the agent event type of an event the controller
// records, or "" for none.
func agentEventType(eventType, reason string) string {
	if t, ok := agentEventTypes[reason]; ok {
		return t
	}
	if eventType == corev1.EventTypeWarning {
		return api.AgentEventError
	}
	return api.AgentEventNotice
}

// recordAgentEvent hands ev, about sbx, to the agent's log. A sandbox of
// no agent (a warm one) has none.
func (r *SandboxReconciler) recordAgentEvent(sbx *v1alpha1.Sandbox, related runtime.Object, ev api.AgentEvent) {
	if r.AgentEvents == nil || sbx.Spec.AgentID == "" || ev.Type == "" {
		return
	}
	ev.Agent, ev.Namespace, ev.Sandbox, ev.Time = sbx.Spec.AgentID, sbx.Namespace, sbx.Name, r.now()
	if pod, ok := related.(*corev1.Pod); ok && pod != nil {
		ev.Pod = pod.Name
	}
	r.AgentEvents.Record(ev)
}

// snapshotCut tells the agent's log of a snapshot of its workspace that
// is ready: an idle stop's, or a checkpoint's (reason).
func (r *SandboxReconciler) snapshotCut(sbx *v1alpha1.Sandbox, reason, name string, size int64, msg string) {
	r.recordAgentEvent(sbx, nil, api.AgentEvent{Type: api.AgentEventSnapshot, Reason: reason, Snapshot: name,
		SizeBytes: size, Message: truncateMessage(msg)})
}
