package egressproxy

import (
	"net/http"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/collectors"
	"github.com/prometheus/client_golang/prometheus/promhttp"
)

// metrics live in a registry of their own rather than the global default,
// so that two proxies in one test process do not collide and nothing a
// library registers globally leaks onto the proxy's endpoint.
//
// Labels are kept to small fixed sets. The agent and the host are not
// labels: in Shared mode both are unbounded, and the access log has them.
type metrics struct {
	reg      *prometheus.Registry
	requests *prometheus.CounterVec
	bytes    *prometheus.CounterVec
	duration *prometheus.HistogramVec
	tunnels  prometheus.Gauge
	reloads  *prometheus.CounterVec
	// injections counts requests a credential was added to, by the
	// credential's name (a bounded, operator-given set) and scheme.
	injections *prometheus.CounterVec
}

func newMetrics() *metrics {
	m := &metrics{
		reg: prometheus.NewRegistry(),
		requests: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "agentbox_egress_requests_total",
			Help: "Proxy requests by decision (allow, deny, error) and reason (empty when allowed).",
		}, []string{"decision", "reason"}),
		bytes: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "agentbox_egress_bytes_total",
			Help: "Bytes relayed: direction \"in\" is client to destination, \"out\" destination to client. Tunnels count when they close.",
		}, []string{"direction"}),
		duration: prometheus.NewHistogramVec(prometheus.HistogramOpts{
			Name: "agentbox_egress_request_duration_seconds",
			Help: "Time from request to the end of the response, or to the tunnel's close for CONNECT.",
			// 1 ms to about 4.4 min: requests are short, tunnels are long.
			Buckets: prometheus.ExponentialBuckets(0.001, 4, 10),
		}, []string{"kind"}),
		tunnels: prometheus.NewGauge(prometheus.GaugeOpts{
			Name: "agentbox_egress_active_tunnels",
			Help: "CONNECT tunnels open now.",
		}),
		reloads: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "agentbox_egress_config_reloads_total",
			Help: "Configuration reloads by result (success, failure); a failed reload keeps the previous policy.",
		}, []string{"result"}),
		injections: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "agentbox_egress_credential_injections_total",
			Help: "Requests a credential was added to, by credential name and scheme (http, https).",
		}, []string{"credential", "scheme"}),
	}
	m.reg.MustRegister(m.requests, m.bytes, m.duration, m.tunnels, m.reloads, m.injections,
		collectors.NewGoCollector(),
		collectors.NewProcessCollector(collectors.ProcessCollectorOpts{}))
	return m
}

func (m *metrics) observe(method, decision, reason string, in, out int64, d time.Duration) {
	m.requests.WithLabelValues(decision, reason).Inc()
	m.bytes.WithLabelValues("in").Add(float64(in))
	m.bytes.WithLabelValues("out").Add(float64(out))
	kind := "http"
	if method == http.MethodConnect {
		kind = "connect"
	}
	m.duration.WithLabelValues(kind).Observe(d.Seconds())
}

// MetricsHandler serves the proxy's metrics in the Prometheus format. It is
// meant for a listener of its own, away from the port sandboxes reach.
func (p *Proxy) MetricsHandler() http.Handler {
	return promhttp.HandlerFor(p.metrics.reg, promhttp.HandlerOpts{})
}
