package controller

import (
	"context"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"k8s.io/apimachinery/pkg/api/meta"
	"sigs.k8s.io/controller-runtime/pkg/client"
	logf "sigs.k8s.io/controller-runtime/pkg/log"

	"github.com/agentbox/terraform-provider-agentbox/internal/api/v1alpha1"
)

// State metrics: gauges of what the platform holds right now, read from the
// manager's cache at each scrape rather than set by the reconcilers, so
// that a pool or sandbox deleted while no controller ran never leaves a
// stale series behind, and the figures are the objects' own.
var (
	descPoolSandboxes = prometheus.NewDesc("agentbox_warm_pool_sandboxes",
		"Sandboxes of each warm pool by state: total (the pool's sandboxes, leased ones included), ready (ready and free to "+
			"lease or adopt) and leased (taken for one run by a pool lease), as the pool's status has them.",
		[]string{"namespace", "pool", "state"}, nil)
	descHolds = prometheus.NewDesc("agentbox_sandbox_holds_active",
		"Sandboxes someone holds (a lease or a pool lease: the Leased condition is True), by namespace.",
		[]string{"namespace"}, nil)
)

// stateScrapeTimeout bounds one scrape's reads; the cache answers from
// memory, so only a cache that has not synced yet takes long.
const stateScrapeTimeout = 5 * time.Second

// StateMetrics is the collector of the state metrics. Register it once
// with the control plane's registry; it reports only while Elected is
// closed, so that of several replicas, all reading the same objects, only
// the leader's series exist and a sum over pods stays right.
type StateMetrics struct {
	// Reader lists the pools and sandboxes: the manager's cache.
	Reader client.Reader
	// Elected is closed once this replica leads (ctrl.Manager's Elected).
	Elected <-chan struct{}
	// Namespaces are the namespaces the platform serves; objects
	// elsewhere are another platform's and not reported.
	Namespaces ServedNamespaces
}

var _ prometheus.Collector = (*StateMetrics)(nil)

// Describe implements prometheus.Collector.
func (m *StateMetrics) Describe(ch chan<- *prometheus.Desc) {
	ch <- descPoolSandboxes
	ch <- descHolds
}

// Collect implements prometheus.Collector.
func (m *StateMetrics) Collect(ch chan<- prometheus.Metric) {
	select {
	case <-m.Elected:
	default:
		return
	}
	ctx, cancel := context.WithTimeout(context.Background(), stateScrapeTimeout)
	defer cancel()
	log := logf.Log.WithName("state-metrics")
	var pools v1alpha1.SandboxWarmPoolList
	if err := m.Reader.List(ctx, &pools); err != nil {
		log.Error(err, "list warm pools for the metrics")
	}
	for _, p := range pools.Items {
		if !m.Namespaces.Serves(p.Namespace) {
			continue
		}
		for state, n := range map[string]int32{"total": p.Status.Replicas, "ready": p.Status.ReadyReplicas, "leased": p.Status.LeasedReplicas} {
			ch <- prometheus.MustNewConstMetric(descPoolSandboxes, prometheus.GaugeValue, float64(n), p.Namespace, p.Name, state)
		}
	}
	var sandboxes v1alpha1.SandboxList
	if err := m.Reader.List(ctx, &sandboxes); err != nil {
		log.Error(err, "list sandboxes for the metrics")
		return
	}
	held := map[string]int{}
	for _, sb := range sandboxes.Items {
		if !m.Namespaces.Serves(sb.Namespace) {
			continue
		}
		if _, ok := held[sb.Namespace]; !ok {
			// A served namespace with sandboxes and no hold reports 0, so
			// that the series does not vanish when the last hold ends.
			held[sb.Namespace] = 0
		}
		if meta.IsStatusConditionTrue(sb.Status.Conditions, v1alpha1.ConditionLeased) {
			held[sb.Namespace]++
		}
	}
	for ns, n := range held {
		ch <- prometheus.MustNewConstMetric(descHolds, prometheus.GaugeValue, float64(n), ns)
	}
}
