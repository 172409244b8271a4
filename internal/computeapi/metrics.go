package computeapi

import (
	"github.com/prometheus/client_golang/prometheus"
	"sigs.k8s.io/controller-runtime/pkg/metrics"
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
)

func init() {
	metrics.Registry.MustRegister(metricRequestSeconds, metricAuditQueue, metricAuditFailures, metricKubeWriteSeconds, metricColdStarts)
}
