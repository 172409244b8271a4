package egressproxy

// TestBenchEgressInjectedHTTPS measures what credential injection adds to
// an HTTPS request: the same 1 KiB GET through the same proxy process,
// once to a destination with a credential (the proxy terminates the TLS,
// adds the header and opens its own TLS connection to the destination)
// and once to one without (a plain CONNECT tunnel), with direct requests as
// the baseline. It prints a table and asserts no time. Run it with
//
//	AGENTBOX_BENCH=1 go test -count=1 -v -run TestBenchEgressInjectedHTTPS ./internal/egressproxy/
//
// AGENTBOX_BENCH_ROUNDS (default 5) sets how many rounds alternate the
// sides. Each side is measured two ways: sequential GETs on one
// keep-alive connection (what an API client does), and sequential GETs
// each on a new connection (a new CONNECT and TLS handshake with the proxy
// or, tunnelled, with the destination). The proxy keeps its own
// connections to the destination alive in both, so a new connection can
// cost less injected than tunnelled: the proxy answers the CONNECT itself
// and sends the request on a connection it already has, where a tunnel
// dials the destination and relays the client's whole handshake to it.
//
// The proxy is this test binary in proxy mode, as in the squid comparison
// (squid_bench_test.go), given an interception CA, the destination's CA
// as its bundle and a credential for benchCredHost. Both names resolve to
// 127.0.0.1 there; the destination speaks HTTP/1.1 only, so that the two
// paths differ by the interception alone. The destination refuses a
// request to benchCredHost without the credential and one to benchHost
// with any Authorization, so the sides are what they claim to be. Nothing
// leaves 127.0.0.1.

import (
	"crypto/tls"
	"crypto/x509"
	"fmt"
	"net"
	"net/http"
	"net/netip"
	"os"
	"path/filepath"
	"runtime"
	"strconv"
	"strings"
	"testing"
	"text/tabwriter"
	"time"

	"github.com/agentbox/terraform-provider-agentbox/internal/benchreport"
	"github.com/agentbox/terraform-provider-agentbox/internal/pki"
)

const (
	// benchCredHost is the destination with a credential.
	benchCredHost = "api.bench.test"
	// benchInterceptEnv names the folder with the interception CA and the
	// destination's CA bundle for the proxy process (addBenchInterception).
	benchInterceptEnv = "AGENTBOX_EGRESS_BENCH_INTERCEPT_DIR"
	benchSecret       = "bench-api-key-5c1e"

	// Sequential GETs per side per round. Enough that the proxy's CPU
	// time, which /proc counts in 10 ms ticks, is a few dozen ticks.
	injectKeepAliveReqs = 2000 // on one connection
	injectNewConnReqs   = 500  // each on a new connection
)

// addBenchInterception gives the bench proxy process what credential
// injection needs, read from the files in dir.
func addBenchInterception(cfg *Config, dir string) error {
	files := map[string][]byte{"intercept-ca.crt": nil, "intercept-ca.key": nil, "destination-ca.crt": nil}
	for name := range files {
		b, err := os.ReadFile(filepath.Join(dir, name))
		if err != nil {
			return err
		}
		files[name] = b
	}
	var err error
	if cfg.InterceptCA, err = pki.LoadCA(files["intercept-ca.crt"], files["intercept-ca.key"]); err != nil {
		return fmt.Errorf("interception CA: %w", err)
	}
	if cfg.DestinationRoots, err = pki.CertPoolFromPEM(files["destination-ca.crt"]); err != nil {
		return fmt.Errorf("destination CA: %w", err)
	}
	res, ok := cfg.Resolver.(staticResolver)
	if !ok {
		return fmt.Errorf("bench proxy: want a staticResolver, got %T", cfg.Resolver)
	}
	res[benchCredHost] = []netip.Addr{netip.MustParseAddr("127.0.0.1")}
	cfg.Allow = append(cfg.Allow, benchCredHost)
	cfg.Credentials = []Credential{{
		Name: "bench-token", Hosts: []string{benchCredHost},
		Header: "Authorization", Template: "Bearer {{secret}}", Secret: benchSecret,
	}}
	return nil
}

// injectSeries is one side measured one way, over all rounds.
type injectSeries struct {
	all       []time.Duration // every timed sample
	roundP50  []time.Duration
	roundP90  []time.Duration
	cpuPerReq []time.Duration // proxy process CPU per timed request, per round
}

// measure times n sequential GETs of u after n/10 untimed ones.
func (m *injectSeries) measure(s *side, u string, n int) error {
	for range n / 10 {
		if _, err := s.get(u); err != nil {
			return err
		}
	}
	round := make([]time.Duration, 0, n)
	cpu0 := procCPU(s.pid)
	for range n {
		t0 := time.Now()
		if _, err := s.get(u); err != nil {
			return err
		}
		round = append(round, time.Since(t0))
	}
	if s.pid != 0 {
		m.cpuPerReq = append(m.cpuPerReq, (procCPU(s.pid)-cpu0)/time.Duration(n))
	}
	m.all = append(m.all, round...)
	m.roundP50 = append(m.roundP50, percentile(round, 50))
	m.roundP90 = append(m.roundP90, percentile(round, 90))
	return nil
}

func TestBenchEgressInjectedHTTPS(t *testing.T) {
	if os.Getenv("AGENTBOX_BENCH") != "1" {
		t.Skip("a benchmark: set AGENTBOX_BENCH=1 to run it")
	}
	rounds := 5
	if v := os.Getenv("AGENTBOX_BENCH_ROUNDS"); v != "" {
		n, err := strconv.Atoi(v)
		if err != nil || n < 1 {
			t.Fatalf("AGENTBOX_BENCH_ROUNDS=%q: want a positive number", v)
		}
		rounds = n
	}

	dir := t.TempDir()
	interceptCA, err := pki.NewCA("bench egress interception CA")
	if err != nil {
		t.Fatal(err)
	}
	destCA, err := pki.NewCA("bench destination CA")
	if err != nil {
		t.Fatal(err)
	}
	keyPEM, err := interceptCA.KeyPEM()
	if err != nil {
		t.Fatal(err)
	}
	for name, b := range map[string][]byte{
		"intercept-ca.crt": interceptCA.CertPEM, "intercept-ca.key": keyPEM, "destination-ca.crt": destCA.CertPEM,
	} {
		if err := os.WriteFile(filepath.Join(dir, name), b, 0o600); err != nil {
			t.Fatal(err)
		}
	}
	leaf, err := destCA.Issue(pki.LeafOptions{
		ID: pki.SandboxID("", "bench", "destination"), Usage: pki.UsageServer,
		DNSNames: []string{benchHost, benchCredHost},
	})
	if err != nil {
		t.Fatal(err)
	}
	cert, err := leaf.TLSCertificate()
	if err != nil {
		t.Fatal(err)
	}

	small := make([]byte, smallBody)
	for i := range small {
		small[i] = 'a' + byte(i%26)
	}
	mux := http.NewServeMux()
	mux.HandleFunc("GET /small", func(w http.ResponseWriter, r *http.Request) {
		host, _, _ := net.SplitHostPort(r.Host)
		auth := r.Header.Get("Authorization")
		switch {
		case host == benchCredHost && auth != "Bearer "+benchSecret:
			http.Error(w, "the credential was not injected", http.StatusUnauthorized)
			return
		case host != benchCredHost && auth != "":
			http.Error(w, "a tunnelled request carries Authorization", http.StatusBadRequest)
			return
		}
		w.Header().Set("Content-Type", "text/plain")
		w.Header().Set("Content-Length", strconv.Itoa(len(small)))
		w.Write(small)
	})
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	origin := &http.Server{
		Handler:           mux,
		ReadHeaderTimeout: 10 * time.Second,
		TLSConfig:         &tls.Config{Certificates: []tls.Certificate{cert}},
		// HTTP/1.1 only (a non-nil, empty map turns HTTP/2 off), as the
		// proxy speaks to the sandbox, so that the proxy's own
		// connection to the destination does not switch protocols.
		TLSNextProto: map[string]func(*http.Server, *tls.Conn, http.Handler){},
	}
	go origin.ServeTLS(ln, "", "")
	defer origin.Close()
	originAddr := ln.Addr().String()
	_, port, _ := net.SplitHostPort(originAddr)

	proxy := startBenchProxy(t, dir, benchInterceptEnv+"="+dir)
	defer proxy.stop()
	pid := proxy.cmd.Process.Pid

	// What a sandbox trusts: the destination's (public) CA and the proxy's.
	roots := x509.NewCertPool()
	roots.AddCert(destCA.Cert)
	roots.AddCert(interceptCA.Cert)
	type benchSide struct {
		name, url, issuer  string
		keepAlive, newConn *side
		ka, nc             injectSeries
	}
	mk := func(name, host, proxyAddr, issuer string, pid int) *benchSide {
		b := &benchSide{name: name, url: "https://" + host + ":" + port + "/small", issuer: issuer}
		b.keepAlive = newSide(name, proxyAddr, originAddr, pid)
		b.newConn = newSide(name, proxyAddr, originAddr, pid)
		b.newConn.tr.DisableKeepAlives = true
		for _, s := range []*side{b.keepAlive, b.newConn} {
			s.tr.TLSClientConfig = &tls.Config{RootCAs: roots}
		}
		return b
	}
	sides := []*benchSide{
		mk("direct", benchHost, "", destCA.Cert.Subject.CommonName, 0),
		mk("tunnel", benchHost, proxy.addr, destCA.Cert.Subject.CommonName, pid),
		mk("injected", benchCredHost, proxy.addr, interceptCA.Cert.Subject.CommonName, pid),
	}
	for _, b := range sides {
		defer b.keepAlive.tr.CloseIdleConnections()
		// Each side reaches the destination the way it claims: the
		// destination checked the header, and the certificate the client
		// saw tells interception from a tunnel.
		resp, err := b.keepAlive.client.Get(b.url)
		if err != nil {
			t.Fatalf("%s: %v", b.name, err)
		}
		resp.Body.Close()
		if resp.StatusCode != http.StatusOK {
			t.Fatalf("%s: %s", b.name, resp.Status)
		}
		if got := resp.TLS.PeerCertificates[0].Issuer.CommonName; got != b.issuer {
			t.Fatalf("%s: the client saw a certificate issued by %q, want %q", b.name, got, b.issuer)
		}
	}

	load, _ := os.ReadFile("/proc/loadavg")
	t.Logf("%s; GOMAXPROCS %d, %d CPUs; load average before: %s", runtime.Version(),
		runtime.GOMAXPROCS(0), runtime.NumCPU(), strings.Join(strings.Fields(string(load))[:3], " "))
	start := time.Now()
	// Rounds rotate the order of the sides, so that drift in the machine's
	// load falls on all of them alike.
	for r := range rounds {
		for i := range sides {
			b := sides[(r+i)%len(sides)]
			if err := b.ka.measure(b.keepAlive, b.url, injectKeepAliveReqs); err != nil {
				t.Fatalf("round %d, %s, keep-alive: %v", r+1, b.name, err)
			}
			if err := b.nc.measure(b.newConn, b.url, injectNewConnReqs); err != nil {
				t.Fatalf("round %d, %s, new connection: %v", r+1, b.name, err)
			}
		}
	}
	load, _ = os.ReadFile("/proc/loadavg")
	t.Logf("%d rounds in %s; load average after: %s", rounds, time.Since(start).Round(time.Second),
		strings.Join(strings.Fields(string(load))[:3], " "))

	direct, tunnel, injected := sides[0], sides[1], sides[2]
	// Per round, injected against the tunnel of the same round.
	perRound := func(a, b []time.Duration) (diff []time.Duration, ratio []float64) {
		for r := range min(len(a), len(b)) {
			diff = append(diff, a[r]-b[r])
			ratio = append(ratio, float64(a[r])/float64(b[r]))
		}
		return diff, ratio
	}
	var b strings.Builder
	w := tabwriter.NewWriter(&b, 0, 0, 2, ' ', tabwriter.AlignRight)
	fmt.Fprintf(w, "\tdirect\ttunnel\tinjected\tinjected-tunnel\tinjected/tunnel\t\n")
	for _, mode := range []struct {
		name string
		get  func(*benchSide) *injectSeries
	}{
		{fmt.Sprintf("keep-alive, %d GETs/round", injectKeepAliveReqs), func(s *benchSide) *injectSeries { return &s.ka }},
		{fmt.Sprintf("new connection, %d GETs/round", injectNewConnReqs), func(s *benchSide) *injectSeries { return &s.nc }},
	} {
		d, tn, in := mode.get(direct), mode.get(tunnel), mode.get(injected)
		for _, pc := range []int{50, 90} {
			rp := func(m *injectSeries) []time.Duration {
				if pc == 50 {
					return m.roundP50
				}
				return m.roundP90
			}
			diff, ratio := perRound(rp(in), rp(tn))
			fmt.Fprintf(w, "HTTPS GET %d B, %s, p%d\t%s\t%s\t%s\t%s\t%.2f\t\n", smallBody, mode.name, pc,
				ms(percentile(d.all, pc)), ms(percentile(tn.all, pc)), ms(percentile(in.all, pc)),
				ms(median(diff)), median(ratio))
		}
		diff, ratio := perRound(in.cpuPerReq, tn.cpuPerReq)
		us := func(d time.Duration) string { return fmt.Sprintf("%.1f µs", float64(d)/float64(time.Microsecond)) }
		fmt.Fprintf(w, "proxy CPU per request, %s\t-\t%s\t%s\t%s\t%.2f\t\n", mode.name,
			us(median(tn.cpuPerReq)), us(median(in.cpuPerReq)), us(median(diff)), median(ratio))
	}
	w.Flush()
	t.Logf("latency percentiles over all samples per side; differences and ratios are medians of per-round figures (p50 or p90 of the round, injected against the tunnel of the same round):\n%s", b.String())
	for _, s := range sides {
		t.Logf("%s per round: keep-alive p50 %v, new connection p50 %v", s.name, s.ka.roundP50, s.nc.roundP50)
	}

	for _, mode := range []struct {
		name   string
		tn, in *injectSeries
	}{
		{"keep-alive", &tunnel.ka, &injected.ka},
		{"new connection", &tunnel.nc, &injected.nc},
	} {
		diff, ratio := perRound(mode.in.roundP50, mode.tn.roundP50)
		benchreport.Record(t, benchreport.Figure{
			Name: "egress proxy: latency added by credential injection at p50, 1 KiB HTTPS GET, " + mode.name,
			Unit: "ms", Values: benchreport.Millis(diff),
			Note: fmt.Sprintf("injected %s against tunnel %s (%.2fx); per round, against the tunnel of the same round",
				ms(median(mode.in.roundP50)), ms(median(mode.tn.roundP50)), median(ratio)),
		})
	}
}
