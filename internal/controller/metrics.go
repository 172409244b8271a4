package controller

import (
	"github.com/prometheus/client_golang/prometheus"
	"sigs.k8s.io/controller-runtime/pkg/metrics"
)

// Metrics of the sandbox lifecycle, served on the control plane's metrics
// endpoint with controller-runtime's own. Durations are histograms so that
// an operator can read percentiles of what agents wait for.
var (
	metricPodStartSeconds = prometheus.NewHistogram(prometheus.HistogramOpts{
		Name:    "agentbox_sandbox_pod_start_seconds",
		Help:    "Time from creating a sandbox's pod to the sandbox taking calls, restore included.",
		Buckets: prometheus.ExponentialBuckets(0.25, 2, 12),
	})
	metricSnapshotSeconds = prometheus.NewHistogramVec(prometheus.HistogramOpts{
		Name:    "agentbox_sandbox_snapshot_seconds",
		Help:    "Time from the start of an idle stop to its snapshot being ready, by snapshot driver.",
		Buckets: prometheus.ExponentialBuckets(0.25, 2, 14),
	}, []string{"driver"})
	metricRestoreSeconds = prometheus.NewHistogramVec(prometheus.HistogramOpts{
		Name:    "agentbox_sandbox_restore_seconds",
		Help:    "Time the snapshot driver took to fill a resumed sandbox's workspace through its supervisor, by driver.",
		Buckets: prometheus.ExponentialBuckets(0.05, 2, 14),
	}, []string{"driver"})
	metricSnapshots = prometheus.NewCounterVec(prometheus.CounterOpts{
		Name: "agentbox_sandbox_snapshots_total",
		Help: "Idle-stop snapshots by driver and result (ready, failed).",
	}, []string{"driver", "result"})
	metricIdleStops = prometheus.NewCounter(prometheus.CounterOpts{
		Name: "agentbox_sandbox_idle_stops_total",
		Help: "Sandboxes stopped after their idle timeout.",
	})
	metricResumes = prometheus.NewCounter(prometheus.CounterOpts{
		Name: "agentbox_sandbox_resumes_total",
		Help: "Stopped sandboxes resumed by activity.",
	})
	// Adoptions and cold starts together count new sandboxes, so their
	// ratio says how well the warm pools are sized.
	metricWarmAdoptions = prometheus.NewCounter(prometheus.CounterOpts{
		Name: "agentbox_warm_pool_adoptions_total",
		Help: "New sandboxes that adopted a ready sandbox from a warm pool.",
	})
	// metricWarmAdoptionEnvRouting is agentbox_pool_lease_env_routing_total
	// for adoptions by Sandboxes that name their python environment.
	metricWarmAdoptionEnvRouting = prometheus.NewCounterVec(prometheus.CounterOpts{
		Name: "agentbox_warm_pool_adoption_env_routing_total",
		Help: "Adoptions of a warm sandbox by a Sandbox that named its python environment, by result: hit (the warm sandbox held it), building (it was building it), miss.",
	}, []string{"result"})
	metricColdStarts = prometheus.NewCounter(prometheus.CounterOpts{
		Name: "agentbox_sandbox_cold_starts_total",
		Help: "New sandboxes that started a pod of their own because no warm sandbox of their template was ready.",
	})
	metricEphemeralRecycled = prometheus.NewCounter(prometheus.CounterOpts{
		Name: "agentbox_warm_pool_ephemeral_recycled_total",
		Help: "Sandboxes leased from a warm pool for one run and deleted when their lease ended.",
	})
)

func init() {
	metrics.Registry.MustRegister(metricPodStartSeconds, metricSnapshotSeconds, metricRestoreSeconds,
		metricSnapshots, metricIdleStops, metricResumes, metricWarmAdoptions, metricWarmAdoptionEnvRouting, metricColdStarts, metricEphemeralRecycled)
}
