package computeapi

import (
	"unicode/utf8"

	"github.com/prometheus/client_golang/prometheus"
	"sigs.k8s.io/controller-runtime/pkg/metrics"

	"github.com/agentbox/terraform-provider-agentbox/internal/store"
)

// Metrics of the Compute API, on the control plane's metrics endpoint with
// the controllers' own. Labels are bounded sets: the operation is the
// route's name and the result an error code, never anything a caller
// chooses.
var (
	metricRequestSeconds = prometheus.NewHistogramVec(prometheus.HistogramOpts{
		Name:    "agentbox_api_request_duration_seconds",
		Help:    "Compute API calls by operation and result (ok or the error code), from authentication to the last byte written.",
		Buckets: prometheus.ExponentialBuckets(0.001, 2, 18),
	}, []string{"operation", "result"})
	metricAuditQueue = prometheus.NewGauge(prometheus.GaugeOpts{
		Name: "agentbox_api_audit_queue_length",
		Help: "Audit records waiting to be written to the store; calls wait once it is full.",
	})
	metricKubeWriteSeconds = prometheus.NewHistogramVec(prometheus.HistogramOpts{
		Name:    "agentbox_api_kube_write_duration_seconds",
		Help:    "The Compute API's writes to the Kubernetes API server, by verb and kind (Sandbox, Lease or other), conflicts and errors included.",
		Buckets: prometheus.ExponentialBuckets(0.001, 2, 14),
	}, []string{"verb", "kind"})
	metricAuditFailures = prometheus.NewCounter(prometheus.CounterOpts{
		Name: "agentbox_api_audit_append_failures_total",
		Help: "Failed writes of audit batches to the store (each is retried until it succeeds).",
	})
	metricColdStarts = prometheus.NewCounter(prometheus.CounterOpts{
		Name: "agentbox_api_pool_cold_starts_total",
		Help: "Sandboxes created for pool leases that found their pool (one with coldStartWhenExhausted) exhausted.",
	})
	metricRunsStarted = prometheus.NewCounterVec(prometheus.CounterOpts{
		Name: "agentbox_runs_started_total",
		Help: "Runs recorded by POST /v1/runs (repeats of a request id not counted), by mode.",
	}, []string{"mode"})
	metricRunAttempts = prometheus.NewCounterVec(prometheus.CounterOpts{
		Name: "agentbox_run_attempts_total",
		Help: "Run attempts started in a sandbox by this replica's executors, by mode.",
	}, []string{"mode"})
	metricRunsFinished = prometheus.NewCounterVec(prometheus.CounterOpts{
		Name: "agentbox_runs_finished_total",
		Help: "Runs whose end this replica recorded (its executors', runs cancelled while queued, and lost runs its sweeper failed), by status and mode.",
	}, []string{"status", "mode"})
	metricRunSeconds = prometheus.NewHistogramVec(prometheus.HistogramOpts{
		Name:    "agentbox_run_duration_seconds",
		Help:    "Runs executed by this replica, from the start of the attempt to the record of its end, by mode.",
		Buckets: prometheus.ExponentialBuckets(0.05, 2, 18),
	}, []string{"mode"})
	metricRunEventStreams = prometheus.NewGauge(prometheus.GaugeOpts{
		Name: "agentbox_run_event_streams",
		Help: "Run event streams (GET /v1/runs/{id}/events) open on this replica.",
	})
	metricAgentEventStreams = prometheus.NewGauge(prometheus.GaugeOpts{
		Name: "agentbox_agent_event_streams",
		Help: "Agent event streams (GET /v1/agents/{id}/events) open on this replica.",
	})
	metricAgentEventsDropped = prometheus.NewCounter(prometheus.CounterOpts{
		Name: "agentbox_agent_events_dropped_total",
		Help: "Agent events this replica could not record: its queue was full, or the store kept failing.",
	})
	metricPoolLeaseEnvRouting = prometheus.NewCounterVec(prometheus.CounterOpts{
		Name: "agentbox_pool_lease_env_routing_total",
		Help: "Pool leases (and pool-mode runs) that named a Python environment, by how their sandbox was chosen: hit (it held the environment), building (it was building it) or miss.",
	}, []string{"result"})
	metricRunsDeleted = prometheus.NewCounter(prometheus.CounterOpts{
		Name: "agentbox_runs_deleted_total",
		Help: "Finished runs whose records this replica's sweeper deleted once past the run retention or their own TTL.",
	})
)

func init() {
	metrics.Registry.MustRegister(metricRequestSeconds, metricAuditQueue, metricAuditFailures, metricKubeWriteSeconds, metricColdStarts,
		metricRunsStarted, metricRunAttempts, metricRunsFinished, metricRunSeconds, metricRunEventStreams, metricRunsDeleted,
		metricAgentEventStreams, metricAgentEventsDropped, metricPoolLeaseEnvRouting)
}

// maxExemplarRunes is the most an exemplar's label names and values may
// hold together (OpenMetrics); the client panics past it.
const maxExemplarRunes = 128

// runExemplar ties a run's samples to its record, its events and its log
// lines: the run id always, then the agent and the request id while they
// fit in an exemplar. Exemplars are served to a scraper that asks for
// OpenMetrics, which the control plane's metrics endpoint offers.
func runExemplar(r store.Run) prometheus.Labels {
	l := prometheus.Labels{"run_id": r.ID}
	used := len("run_id") + utf8.RuneCountInString(r.ID)
	for _, kv := range [][2]string{{"agent", r.AgentID}, {"request_id", r.RequestID}} {
		n := len(kv[0]) + utf8.RuneCountInString(kv[1])
		if kv[1] == "" || used+n > maxExemplarRunes {
			continue
		}
		l[kv[0]] = kv[1]
		used += n
	}
	return l
}

// countRun adds one to c's series of labels, with r's exemplar.
func countRun(c *prometheus.CounterVec, r store.Run, labels ...string) {
	c.WithLabelValues(labels...).(prometheus.ExemplarAdder).AddWithExemplar(1, runExemplar(r))
}

// observeRun observes v in h's series of labels, with r's exemplar.
func observeRun(h *prometheus.HistogramVec, r store.Run, v float64, labels ...string) {
	h.WithLabelValues(labels...).(prometheus.ExemplarObserver).ObserveWithExemplar(v, runExemplar(r))
}
