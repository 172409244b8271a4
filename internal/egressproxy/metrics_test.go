package egressproxy

import (
	"bufio"
	"io"
	"net"
	"net/http"
	"net/http/httptest"
	"strconv"
	"strings"
	"testing"
	"time"
)

// scrape returns the value of each sample line, keyed by name and labels
// as printed, e.g. `agentbox_egress_bytes_total{direction="out"}`.
func scrape(t *testing.T, p *Proxy) map[string]float64 {
	t.Helper()
	w := httptest.NewRecorder()
	p.MetricsHandler().ServeHTTP(w, httptest.NewRequest(http.MethodGet, "/metrics", nil))
	if w.Code != http.StatusOK {
		t.Fatalf("/metrics: %d", w.Code)
	}
	out := map[string]float64{}
	for _, line := range strings.Split(w.Body.String(), "\n") {
		if line == "" || strings.HasPrefix(line, "#") {
			continue
		}
		i := strings.LastIndexByte(line, ' ')
		v, err := strconv.ParseFloat(line[i+1:], 64)
		if err != nil {
			t.Fatalf("bad sample %q", line)
		}
		out[line[:i]] = v
	}
	return out
}

func TestMetricsMove(t *testing.T) {
	res := &fakeResolver{names: map[string][]string{"ok.example": {"203.0.113.7"}}}
	p, _, _ := newTestProxy(t, Config{Allow: []string{"ok.example"}, Resolver: res})
	release := make(chan struct{})
	dial := &fakeDialer{serve: func(c net.Conn) {
		defer c.Close()
		br := bufio.NewReader(c)
		line, err := br.ReadString('\n')
		if err != nil {
			return
		}
		if strings.HasPrefix(line, "GET ") {
			http.ReadRequest(bufio.NewReader(io.MultiReader(strings.NewReader(line), br)))
			io.WriteString(c, "HTTP/1.1 200 OK\r\nContent-Length: 5\r\nConnection: close\r\n\r\nhello")
			return
		}
		// A tunnel: echo one line, then stay open until released.
		io.WriteString(c, line)
		<-release
	}}
	p.dial = dial.Dial

	before := scrape(t, p)
	do(p, http.MethodGet, "http://ok.example/")
	do(p, http.MethodGet, "http://no.example/")
	do(p, http.MethodConnect, "no.example:443")

	srv := httptest.NewServer(p) // loopback; the target is the in-memory fake
	defer srv.Close()
	c, err := net.Dial("tcp", srv.Listener.Addr().String())
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	c.SetDeadline(time.Now().Add(10 * time.Second))
	io.WriteString(c, "CONNECT ok.example:443 HTTP/1.1\r\nHost: ok.example:443\r\n\r\n")
	br := bufio.NewReader(c)
	if resp, err := http.ReadResponse(br, &http.Request{Method: http.MethodConnect}); err != nil || resp.StatusCode != 200 {
		t.Fatalf("CONNECT: %v %v", resp, err)
	}
	io.WriteString(c, "ping\n")
	br.ReadString('\n')
	if got := scrape(t, p)["agentbox_egress_active_tunnels"]; got != 1 {
		t.Errorf("active tunnels while open: %v, want 1", got)
	}
	close(release)
	c.Close()
	waitFor(t, func() bool { return scrape(t, p)["agentbox_egress_active_tunnels"] == 0 })

	after := scrape(t, p)
	delta := func(k string) float64 { return after[k] - before[k] }
	for k, want := range map[string]float64{
		`agentbox_egress_requests_total{decision="allow",reason=""}`:           2,
		`agentbox_egress_requests_total{decision="deny",reason="not_allowed"}`: 2,
		`agentbox_egress_request_duration_seconds_count{kind="http"}`:          2,
		`agentbox_egress_request_duration_seconds_count{kind="connect"}`:       2,
	} {
		if got := delta(k); got != want {
			t.Errorf("%s moved by %v, want %v", k, got, want)
		}
	}
	// "hello" out on GET, "ping\n" both ways through the tunnel.
	if got := delta(`agentbox_egress_bytes_total{direction="out"}`); got < 10 {
		t.Errorf("bytes out moved by %v, want at least 10", got)
	}
	if got := delta(`agentbox_egress_bytes_total{direction="in"}`); got < 5 {
		t.Errorf("bytes in moved by %v, want at least 5", got)
	}
}
