package controller

import (
	"bufio"
	"context"
	"encoding/json"
	"fmt"
	"strconv"
	"sync"
	"time"

	"github.com/go-logr/logr"
	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/client-go/kubernetes"
	"sigs.k8s.io/controller-runtime/pkg/client"

	"github.com/agentbox/terraform-provider-agentbox/internal/api/v1alpha1"
	api "github.com/agentbox/terraform-provider-agentbox/internal/computeapi/client"
)

// Egress denials reach the agents' event logs from the access logs the
// egress proxies already write (one JSON line a request, decision "deny"
// for a refusal, with the agent, host, port and reason): the control
// plane's leader follows the log of each proxy pod through the API server.
// This needs nothing of the proxy (no credentials, no API access from the
// pod that guards the sandbox's egress) and loses nothing that the proxy
// logged while the pod lives: a follow that breaks resumes from the last
// line's time, and the store takes each line once (its pod, time, host and
// port are the event's source key). A denial logged while no leader
// follows (a failover) is found when the next one resumes, within
// egressDenialLookback.

const (
	// egressDenialWindow is how often one agent's denials of one host
	// become an event: the first at once, then one event counting the
	// rest of each window, so that a retry loop does not flood the log.
	egressDenialWindow = 10 * time.Second
	// egressDenialLookback is how far back a follow starts when the
	// leader first sees a proxy pod that has run for a while.
	egressDenialLookback = time.Minute
	// egressDenialScan is how often the proxy pods are listed.
	egressDenialScan = 3 * time.Second
)

// AgentEventOnceSink is an AgentEventSink that records an event once per
// source key.
type AgentEventOnceSink interface {
	RecordOnce(key string, ev api.AgentEvent)
}

// EgressDenials follows the access logs of the egress proxy pods in the
// served namespaces and records their denials as egress_denied agent
// events. It runs on the leader only.
type EgressDenials struct {
	// Pods lists the proxy pods; Logs follows their logs.
	Pods       client.Reader
	Logs       kubernetes.Interface
	Namespaces ServedNamespaces
	Events     AgentEventOnceSink
	Log        logr.Logger

	mu        sync.Mutex
	following map[types.UID]context.CancelFunc
	windows   map[denialKey]*denialWindow
}

type denialKey struct{ agent, host, port string }

// denialWindow counts the denials of one host after the first, within a
// window.
type denialWindow struct {
	until time.Time
	count int
	last  api.AgentEvent
	key   string
}

// NeedLeaderElection: one replica follows the proxies, so that each
// denial is read once.
func (d *EgressDenials) NeedLeaderElection() bool { return true }

// Start follows the proxies until ctx ends.
func (d *EgressDenials) Start(ctx context.Context) error {
	d.following, d.windows = map[types.UID]context.CancelFunc{}, map[denialKey]*denialWindow{}
	started := time.Now()
	scan := time.NewTicker(egressDenialScan)
	defer scan.Stop()
	flush := time.NewTicker(time.Second)
	defer flush.Stop()
	// After the follows have stopped: the counts of open windows.
	defer d.flushWindows(time.Time{}, true)
	var wg sync.WaitGroup
	defer wg.Wait()
	for {
		d.scan(ctx, started, &wg)
		select {
		case <-ctx.Done():
			return nil
		case <-scan.C:
		case now := <-flush.C:
			d.flushWindows(now, false)
		}
	}
}

// scan starts following the proxy pods not followed yet, and stops
// following those that are gone.
func (d *EgressDenials) scan(ctx context.Context, started time.Time, wg *sync.WaitGroup) {
	// In each served namespace: the control plane may read pods only
	// there (its Roles), unless it serves every namespace.
	namespaces := []string(d.Namespaces)
	if len(namespaces) == 0 {
		namespaces = []string{""}
	}
	var pods []corev1.Pod
	for _, ns := range namespaces {
		var list corev1.PodList
		if err := d.Pods.List(ctx, &list, client.InNamespace(ns), client.HasLabels{v1alpha1.LabelEgressProxy}); err != nil {
			if ctx.Err() == nil {
				d.Log.Error(err, "list egress proxy pods", "namespace", ns)
			}
			// A pod not listed is not let go: a failed list says
			// nothing of it.
			return
		}
		pods = append(pods, list.Items...)
	}
	seen := map[types.UID]bool{}
	for i := range pods {
		pod := &pods[i]
		if !d.Namespaces.Serves(pod.Namespace) || pod.Status.StartTime == nil {
			continue
		}
		seen[pod.UID] = true
		d.mu.Lock()
		_, ok := d.following[pod.UID]
		if !ok {
			fctx, cancel := context.WithCancel(ctx)
			d.following[pod.UID] = cancel
			since := pod.Status.StartTime.Time
			if lb := started.Add(-egressDenialLookback); since.Before(lb) {
				since = lb
			}
			p := pod.DeepCopy()
			wg.Go(func() { d.follow(fctx, p, since) })
		}
		d.mu.Unlock()
	}
	d.mu.Lock()
	for uid, cancel := range d.following {
		if !seen[uid] {
			cancel()
			delete(d.following, uid)
		}
	}
	d.mu.Unlock()
}

// follow reads a proxy pod's log from since, again from its last line
// when the stream breaks, until ctx ends.
func (d *EgressDenials) follow(ctx context.Context, pod *corev1.Pod, since time.Time) {
	for ctx.Err() == nil {
		last, err := d.followOnce(ctx, pod, since)
		if last.After(since) {
			since = last
		}
		if ctx.Err() != nil {
			return
		}
		if err != nil {
			d.Log.V(1).Info("follow egress proxy log; again shortly", "pod", pod.Namespace+"/"+pod.Name, "error", err.Error())
		}
		select {
		case <-ctx.Done():
		case <-time.After(2 * time.Second):
		}
	}
}

// accessLine is the part of an access log line that tells of a denial.
type accessLine struct {
	Time     time.Time `json:"time"`
	Msg      string    `json:"msg"`
	Agent    string    `json:"agent"`
	Host     string    `json:"host"`
	Port     string    `json:"port"`
	Decision string    `json:"decision"`
	Reason   string    `json:"reason"`
}

func (d *EgressDenials) followOnce(ctx context.Context, pod *corev1.Pod, since time.Time) (time.Time, error) {
	st := metav1.NewTime(since)
	rc, err := d.Logs.CoreV1().Pods(pod.Namespace).GetLogs(pod.Name, &corev1.PodLogOptions{
		Container: egressContainerName, Follow: true, SinceTime: &st,
	}).Stream(ctx)
	if err != nil {
		return since, err
	}
	defer rc.Close()
	last := since
	sc := bufio.NewScanner(rc)
	sc.Buffer(make([]byte, 64<<10), 1<<20)
	for sc.Scan() {
		var l accessLine
		if json.Unmarshal(sc.Bytes(), &l) != nil || l.Msg != "egress" {
			continue
		}
		if l.Time.After(last) {
			last = l.Time
		}
		if l.Decision != "deny" || l.Agent == "" {
			continue
		}
		d.denied(pod, l)
	}
	return last, sc.Err()
}

// denied records a denial: at once when it is the first of its host in
// a window, else counted into the window's event.
func (d *EgressDenials) denied(pod *corev1.Pod, l accessLine) {
	port, _ := strconv.Atoi(l.Port)
	ev := api.AgentEvent{Type: api.AgentEventEgressDenied, Time: l.Time, Agent: l.Agent, Namespace: pod.Namespace,
		Sandbox: pod.Labels[v1alpha1.LabelSandbox], Host: l.Host, Port: port, Reason: l.Reason, Count: 1,
		Message: fmt.Sprintf("the egress proxy refused %s:%s (%s)", l.Host, l.Port, l.Reason)}
	key := fmt.Sprintf("egress/%s/%s/%s/%s", pod.UID, l.Time.UTC().Format(time.RFC3339Nano), l.Host, l.Port)
	k := denialKey{l.Agent, l.Host, l.Port}
	d.mu.Lock()
	w := d.windows[k]
	if w == nil || !l.Time.Before(w.until) {
		if w != nil && w.count > 0 {
			d.recordWindow(w)
		}
		d.windows[k] = &denialWindow{until: l.Time.Add(egressDenialWindow)}
		d.mu.Unlock()
		d.Events.RecordOnce(key, ev)
		return
	}
	w.count++
	w.last, w.key = ev, key
	d.mu.Unlock()
}

// flushWindows records the counts of the windows that ended (all when
// final), and forgets them.
func (d *EgressDenials) flushWindows(now time.Time, final bool) {
	d.mu.Lock()
	defer d.mu.Unlock()
	for k, w := range d.windows {
		// Windows are in the proxy's log time; a second of slack for
		// the log's delay.
		if final || now.After(w.until.Add(time.Second)) {
			if w.count > 0 {
				d.recordWindow(w)
			}
			delete(d.windows, k)
		}
	}
}

// recordWindow records the window's count as one event, at its last
// denial's time. d.mu is held.
func (d *EgressDenials) recordWindow(w *denialWindow) {
	ev := w.last
	ev.Count = w.count
	ev.Message = fmt.Sprintf("the egress proxy refused %s:%d %d more times (%s)", ev.Host, ev.Port, w.count, ev.Reason)
	d.Events.RecordOnce(w.key, ev)
	w.count = 0
}
