package controller

import (
	"sync"
	"testing"
	"time"

	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"

	"github.com/agentbox/terraform-provider-agentbox/internal/api/v1alpha1"
	api "github.com/agentbox/terraform-provider-agentbox/internal/computeapi/client"
)

type onceSink struct {
	mu   sync.Mutex
	keys []string
	evs  []api.AgentEvent
}

func (s *onceSink) RecordOnce(key string, ev api.AgentEvent) {
	s.mu.Lock()
	defer s.mu.Unlock()
	s.keys, s.evs = append(s.keys, key), append(s.evs, ev)
}

// The first denial of a host is recorded at once; the rest of its window
// become one event with their count when the window ends; another host,
// or the same host after the window, starts its own.
func TestEgressDenialWindows(t *testing.T) {
	sink := &onceSink{}
	d := &EgressDenials{Events: sink, windows: map[denialKey]*denialWindow{}}
	pod := &corev1.Pod{ObjectMeta: metav1.ObjectMeta{Name: "egress-sb", Namespace: "team-a", UID: "uid-1",
		Labels: map[string]string{v1alpha1.LabelSandbox: "sb"}}}
	t0 := time.Date(2026, 11, 28, 12, 0, 0, 0, time.UTC)
	deny := func(at time.Duration, host string) {
		d.denied(pod, accessLine{Time: t0.Add(at), Msg: "egress", Agent: "agent-1", Host: host, Port: "443", Decision: "deny", Reason: "not_allowed"})
	}
	deny(0, "a.invalid")
	deny(time.Second, "a.invalid")
	deny(2*time.Second, "a.invalid")
	deny(3*time.Second, "b.invalid")
	if len(sink.evs) != 2 || sink.evs[0].Host != "a.invalid" || sink.evs[1].Host != "b.invalid" || sink.evs[0].Count != 1 {
		t.Fatalf("at once: %+v", sink.evs)
	}
	if e := sink.evs[0]; e.Type != api.AgentEventEgressDenied || e.Agent != "agent-1" || e.Sandbox != "sb" || e.Namespace != "team-a" ||
		e.Port != 443 || e.Reason != "not_allowed" || !e.Time.Equal(t0) {
		t.Errorf("first event: %+v", e)
	}
	d.flushWindows(t0.Add(5*time.Second), false)
	if len(sink.evs) != 2 {
		t.Fatalf("a window still open was flushed: %+v", sink.evs)
	}
	d.flushWindows(t0.Add(egressDenialWindow+2*time.Second), false)
	if len(sink.evs) != 3 || sink.evs[2].Host != "a.invalid" || sink.evs[2].Count != 2 || !sink.evs[2].Time.Equal(t0.Add(2*time.Second)) {
		t.Fatalf("the window's count: %+v", sink.evs)
	}
	// After its window, a host's next denial is recorded at once.
	deny(egressDenialWindow+3*time.Second, "a.invalid")
	deny(egressDenialWindow+4*time.Second, "a.invalid")
	if len(sink.evs) != 4 || sink.evs[3].Count != 1 {
		t.Fatalf("after the window: %+v", sink.evs)
	}
	// A denial in a later window records the previous window's count first.
	deny(2*egressDenialWindow+5*time.Second, "a.invalid")
	if len(sink.evs) != 6 || sink.evs[4].Count != 1 || sink.evs[5].Count != 1 {
		t.Fatalf("next window: %+v", sink.evs)
	}
	d.flushWindows(time.Time{}, true)
	seen := map[string]bool{}
	for _, k := range sink.keys {
		if seen[k] {
			t.Errorf("key %s used twice", k)
		}
		seen[k] = true
	}
}

type recordSink struct{ evs []api.AgentEvent }

func (s *recordSink) Record(ev api.AgentEvent) { s.evs = append(s.evs, ev) }

// The controller's events reach the agent's log with their type, the
// sandbox they are about and the pod; a warm sandbox's (no agent) do not.
func TestSandboxAgentEvents(t *testing.T) {
	sink := &recordSink{}
	r := &SandboxReconciler{AgentEvents: sink}
	sbx := &v1alpha1.Sandbox{ObjectMeta: metav1.ObjectMeta{Name: "sb", Namespace: "team-a"}, Spec: v1alpha1.SandboxSpec{AgentID: "agent-1"}}
	pod := &corev1.Pod{ObjectMeta: metav1.ObjectMeta{Name: "sb-pod"}}
	r.event(sbx, pod, corev1.EventTypeNormal, EventSandboxReady, "Start", "running")
	r.event(sbx, nil, corev1.EventTypeWarning, EventSnapshotFailed, "Snapshot", "no room")
	r.event(sbx, nil, corev1.EventTypeNormal, EventCertificateIssued, "Issue", "issued")
	r.event(sbx, pod, corev1.EventTypeNormal, EventCheckpointed, "Checkpoint", "ready")
	r.snapshotCut(sbx, EventCheckpointed, "snap-1", 42, "ready")
	warm := sbx.DeepCopy()
	warm.Spec.AgentID = ""
	r.event(warm, pod, corev1.EventTypeNormal, EventPodCreated, "Create", "created")
	want := []struct{ typ, reason string }{
		{api.AgentEventReady, EventSandboxReady}, {api.AgentEventError, EventSnapshotFailed},
		{api.AgentEventNotice, EventCertificateIssued}, {api.AgentEventSnapshot, EventCheckpointed},
	}
	if len(sink.evs) != len(want) {
		t.Fatalf("events %+v", sink.evs)
	}
	for i, w := range want {
		e := sink.evs[i]
		if e.Type != w.typ || e.Reason != w.reason || e.Agent != "agent-1" || e.Namespace != "team-a" || e.Sandbox != "sb" || e.Time.IsZero() {
			t.Errorf("event %d: %+v, want %s/%s", i, e, w.typ, w.reason)
		}
	}
	if sink.evs[0].Pod != "sb-pod" || sink.evs[3].Snapshot != "snap-1" || sink.evs[3].SizeBytes != 42 {
		t.Errorf("fields: %+v %+v", sink.evs[0], sink.evs[3])
	}
}
