package failover

import (
	"fmt"
	"sort"
	"strings"
	"time"

	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
)

// What a failure after a fault is read from.

// logRestarts logs, for each control plane container that restarted, how
// its last run ended and the end of its log: what a failure after a fault
// is read from.
func (e *env) logRestarts() {
	ctx := e.t.Context()
	for _, p := range e.diagnosedPods() {
		for _, c := range p.Status.ContainerStatuses {
			if c.RestartCount == 0 {
				continue
			}
			how := ""
			if term := c.LastTerminationState.Terminated; term != nil {
				how = fmt.Sprintf("%s, exit code %d, at %s", term.Reason, term.ExitCode, term.FinishedAt.UTC().Format(time.RFC3339))
			}
			lines := int64(12)
			raw, err := e.cs.CoreV1().Pods(e.releaseN).GetLogs(p.Name, &corev1.PodLogOptions{Container: c.Name, Previous: true, TailLines: &lines}).DoRaw(ctx)
			if err != nil {
				raw = []byte(err.Error())
			}
			e.t.Logf("control plane pod %s restarted %d times; last run ended %s; its log ends:\n%s", p.Name, c.RestartCount, how, raw)
		}
	}
}

// logIdlerStory logs what explains a lost write: the idler's events in
// order and every control plane log line about it, from each pod's
// current run and, for a restarted container, its previous one.
func (e *env) logIdlerStory() {
	ctx := e.t.Context()
	evs, err := e.cs.CoreV1().Events(e.workN).List(ctx, metav1.ListOptions{FieldSelector: "involvedObject.name=idler"})
	if err != nil {
		e.t.Logf("list the idler's events: %v", err)
	} else {
		sort.Slice(evs.Items, func(i, j int) bool { return eventTime(evs.Items[i]).Before(eventTime(evs.Items[j])) })
		for _, ev := range evs.Items {
			e.t.Logf("idler event %s %s (x%d): %s", eventTime(ev).UTC().Format("15:04:05.000"), ev.Reason, ev.Count, ev.Message)
		}
	}
	for _, p := range e.diagnosedPods() {
		for _, c := range p.Status.ContainerStatuses {
			for _, previous := range []bool{true, false} {
				if previous && c.RestartCount == 0 {
					continue
				}
				raw, err := e.cs.CoreV1().Pods(e.releaseN).GetLogs(p.Name, &corev1.PodLogOptions{Container: c.Name, Previous: previous}).DoRaw(ctx)
				if err != nil {
					e.t.Logf("log of %s (previous %t): %v", p.Name, previous, err)
					continue
				}
				for _, line := range strings.Split(string(raw), "\n") {
					if strings.Contains(line, `"idler"`) || strings.Contains(line, "-idler") {
						e.t.Logf("%s (previous %t): %s", p.Name, previous, line)
					}
				}
			}
		}
	}
}

func eventTime(ev corev1.Event) time.Time {
	switch {
	case !ev.EventTime.IsZero():
		return ev.EventTime.Time
	case !ev.LastTimestamp.IsZero():
		return ev.LastTimestamp.Time
	}
	return ev.FirstTimestamp.Time
}

// diagnosedPods lists the control plane pods, terminating ones included;
// a failure to list is logged, as diagnostics must not end the test.
func (e *env) diagnosedPods() []corev1.Pod {
	pods, err := e.cs.CoreV1().Pods(e.releaseN).List(e.t.Context(), metav1.ListOptions{LabelSelector: "app.kubernetes.io/component=controlplane"})
	if err != nil {
		e.t.Logf("list control plane pods: %v", err)
		return nil
	}
	return pods.Items
}
