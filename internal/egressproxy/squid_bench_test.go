package egressproxy

// TestEgressProxyVsSquid measures this proxy and Debian's squid side by
// side, both on loopback with the same one-name allowlist, and prints a
// table; it asserts no time. Run it with
//
//	AGENTBOX_BENCH=1 go test -count=1 -v -run TestEgressProxyVsSquid ./internal/egressproxy/
//
// AGENTBOX_BENCH_ROUNDS (default 5) sets how many rounds alternate the
// sides; AGENTBOX_BENCH_CPUPROFILE=file writes a CPU profile of the egress
// proxy process (not of the load generator) for "go tool pprof".
//
// squid comes from internal/testenv/squid: the host's, or Debian's
// packages fetched and unpacked into the user cache folder on first use.
// The benchmark skips when it cannot be had.
//
// Each proxy runs in a process of its own, as deployed: squid with -N (one
// process), the egress proxy as this test binary started again in proxy
// mode (see init below), with a resolver that maps the test name to
// 127.0.0.1 and the default denied ranges less loopback, so that the
// address check runs as in production. squid resolves the same name from a
// hosts file. Both write one access-log line per request to a file. The
// origin and the load generator share this process, the same for every
// side. Nothing leaves 127.0.0.1: the client's dialer refuses any other
// address.

import (
	"bufio"
	"context"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net"
	"net/http"
	"net/netip"
	"net/url"
	"os"
	"os/exec"
	"path/filepath"
	"runtime"
	"runtime/pprof"
	"slices"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"text/tabwriter"
	"time"

	"github.com/agentbox/terraform-provider-agentbox/internal/benchreport"
	"github.com/agentbox/terraform-provider-agentbox/internal/testenv/squid"
)

const (
	benchHost = "origin.bench.test"
	// benchProxyEnv makes this test binary serve as the egress proxy
	// instead of running tests.
	benchProxyEnv   = "AGENTBOX_EGRESS_BENCH_PROXY"
	benchProfileEnv = "AGENTBOX_BENCH_CPUPROFILE"

	smallBody   = 1 << 10
	largeBody   = 64 << 20
	latencyReqs = 1000 // sequential GETs per side per round
	concurrency = 16   // keep-alive clients for requests/s
	throughputD = 2 * time.Second
	largeGets   = 2 // downloads of largeBody per side per round
)

func init() {
	if os.Getenv(benchProxyEnv) == "1" {
		os.Exit(runBenchProxy())
	}
}

type staticResolver map[string][]netip.Addr

func (r staticResolver) LookupNetIP(_ context.Context, _, host string) ([]netip.Addr, error) {
	if a, ok := r[host]; ok {
		return a, nil
	}
	return nil, &net.DNSError{Err: "no such host", Name: host, IsNotFound: true}
}

// runBenchProxy serves the egress proxy on a free loopback port, prints the
// address on stdout and runs until stdin closes. The server is set up as
// cmd/agentbox-egress-proxy sets up its own.
func runBenchProxy() int {
	fail := func(err error) int {
		fmt.Fprintln(os.Stderr, "bench proxy:", err)
		return 1
	}
	var denied []netip.Prefix
	for _, p := range DefaultDeniedCIDRs {
		if p != netip.MustParsePrefix("127.0.0.0/8") {
			denied = append(denied, p)
		}
	}
	log := slog.New(slog.NewJSONHandler(os.Stderr, nil))
	cfg := Config{
		Allow:       []string{benchHost},
		DeniedCIDRs: denied,
		Resolver:    staticResolver{benchHost: {netip.MustParseAddr("127.0.0.1")}},
		Logger:      log,
		Agent:       "bench",
	}
	if dir := os.Getenv(benchInterceptEnv); dir != "" {
		// The injection benchmark (inject_bench_test.go) adds a
		// credential; the squid comparison leaves this unset.
		if err := addBenchInterception(&cfg, dir); err != nil {
			return fail(err)
		}
	}
	p, err := New(cfg)
	if err != nil {
		return fail(err)
	}
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		return fail(err)
	}
	if f := os.Getenv(benchProfileEnv); f != "" {
		out, err := os.Create(f)
		if err != nil {
			return fail(err)
		}
		if err := pprof.StartCPUProfile(out); err != nil {
			return fail(err)
		}
		defer func() {
			pprof.StopCPUProfile()
			out.Close()
		}()
	}
	srv := &http.Server{
		Handler:           p,
		ReadHeaderTimeout: 10 * time.Second,
		IdleTimeout:       2 * time.Minute,
		ErrorLog:          slog.NewLogLogger(log.Handler(), slog.LevelWarn),
	}
	go srv.Serve(ln)
	fmt.Println(ln.Addr().String())
	io.Copy(io.Discard, os.Stdin)
	srv.Close()
	return 0
}

// benchProxy is the egress proxy process started by the benchmark.
type benchProxy struct {
	addr  string
	cmd   *exec.Cmd
	stdin io.WriteCloser
}

// startBenchProxy starts the proxy process; env is added to its
// environment.
func startBenchProxy(t *testing.T, dir string, env ...string) *benchProxy {
	t.Helper()
	exe, err := os.Executable()
	if err != nil {
		t.Fatal(err)
	}
	logFile, err := os.Create(filepath.Join(dir, "egress-proxy.log"))
	if err != nil {
		t.Fatal(err)
	}
	defer logFile.Close()
	cmd := exec.Command(exe)
	cmd.Env = append([]string{benchProxyEnv + "=1", "PATH=" + os.Getenv("PATH")}, env...)
	if f := os.Getenv(benchProfileEnv); f != "" {
		cmd.Env = append(cmd.Env, benchProfileEnv+"="+f)
	}
	cmd.Stderr = logFile
	stdin, err := cmd.StdinPipe()
	if err != nil {
		t.Fatal(err)
	}
	stdout, err := cmd.StdoutPipe()
	if err != nil {
		t.Fatal(err)
	}
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	line, err := bufio.NewReader(stdout).ReadString('\n')
	if err != nil {
		cmd.Process.Kill()
		cmd.Wait()
		log, _ := os.ReadFile(logFile.Name())
		t.Fatalf("egress proxy process: %v\n%s", err, log)
	}
	return &benchProxy{addr: strings.TrimSpace(line), cmd: cmd, stdin: stdin}
}

// stop closes stdin, which ends the process cleanly so that a CPU profile
// is written.
func (p *benchProxy) stop() {
	p.stdin.Close()
	done := make(chan struct{})
	go func() { p.cmd.Wait(); close(done) }()
	select {
	case <-done:
	case <-time.After(10 * time.Second):
		p.cmd.Process.Kill()
		<-done
	}
}

// side is one way to reach the origin: directly or through a proxy.
type side struct {
	name   string
	pid    int // proxy process, 0 for direct
	client *http.Client
	tr     *http.Transport

	latency   []time.Duration // every sample of every round
	roundP50  []time.Duration
	roundP90  []time.Duration
	reqPerSec []float64
	cpuPerReq []time.Duration // proxy CPU per request in the requests/s runs
	mbPerSec  []float64
}

// loopbackOnly dials only 127.0.0.0/8; direct requests for the test name
// go to the origin.
func loopbackOnly(origin string) func(ctx context.Context, network, addr string) (net.Conn, error) {
	d := &net.Dialer{}
	return func(ctx context.Context, network, addr string) (net.Conn, error) {
		host, port, err := net.SplitHostPort(addr)
		if err != nil {
			return nil, err
		}
		if host == benchHost {
			return d.DialContext(ctx, network, origin)
		}
		ip, err := netip.ParseAddr(host)
		if err != nil || !ip.IsLoopback() {
			return nil, fmt.Errorf("benchmark dials loopback only, not %s", addr)
		}
		return d.DialContext(ctx, network, net.JoinHostPort(host, port))
	}
}

func newSide(name, proxyAddr, origin string, pid int) *side {
	tr := &http.Transport{
		DialContext:         loopbackOnly(origin),
		DisableCompression:  true,
		MaxIdleConns:        2 * concurrency,
		MaxIdleConnsPerHost: 2 * concurrency,
		ForceAttemptHTTP2:   false,
	}
	if proxyAddr != "" {
		tr.Proxy = http.ProxyURL(&url.URL{Scheme: "http", Host: proxyAddr})
	}
	return &side{name: name, pid: pid, tr: tr, client: &http.Client{Transport: tr}}
}

func (s *side) get(u string) (int64, error) {
	resp, err := s.client.Get(u)
	if err != nil {
		return 0, err
	}
	defer resp.Body.Close()
	n, err := io.Copy(io.Discard, resp.Body)
	if err != nil {
		return n, err
	}
	if resp.StatusCode != http.StatusOK {
		return n, fmt.Errorf("%s: %s", u, resp.Status)
	}
	return n, nil
}

func (s *side) measureLatency(u string) error {
	for range 100 { // warm the connections and both sides' caches
		if _, err := s.get(u); err != nil {
			return err
		}
	}
	round := make([]time.Duration, 0, latencyReqs)
	for range latencyReqs {
		t0 := time.Now()
		if _, err := s.get(u); err != nil {
			return err
		}
		round = append(round, time.Since(t0))
	}
	s.latency = append(s.latency, round...)
	s.roundP50 = append(s.roundP50, percentile(round, 50))
	s.roundP90 = append(s.roundP90, percentile(round, 90))
	return nil
}

func (s *side) measureThroughput(u string) error {
	ctx, cancel := context.WithTimeout(context.Background(), throughputD)
	defer cancel()
	var n atomic.Int64
	var firstErr error
	var once sync.Once
	var wg sync.WaitGroup
	cpu0 := procCPU(s.pid)
	start := time.Now()
	for range concurrency {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for ctx.Err() == nil {
				if _, err := s.get(u); err != nil {
					once.Do(func() { firstErr = err })
					cancel()
					return
				}
				n.Add(1)
			}
		}()
	}
	wg.Wait()
	elapsed := time.Since(start)
	if firstErr != nil {
		return firstErr
	}
	s.reqPerSec = append(s.reqPerSec, float64(n.Load())/elapsed.Seconds())
	if s.pid != 0 && n.Load() > 0 {
		s.cpuPerReq = append(s.cpuPerReq, (procCPU(s.pid)-cpu0)/time.Duration(n.Load()))
	}
	return nil
}

func (s *side) measureLarge(u string) error {
	var total int64
	start := time.Now()
	for range largeGets {
		n, err := s.get(u)
		if err != nil {
			return err
		}
		if n != largeBody {
			return fmt.Errorf("%s: got %d bytes, want %d", u, n, largeBody)
		}
		total += n
	}
	s.mbPerSec = append(s.mbPerSec, float64(total)/(1<<20)/time.Since(start).Seconds())
	return nil
}

// procCPU is the user plus system CPU time of a process so far.
func procCPU(pid int) time.Duration {
	if pid == 0 {
		return 0
	}
	b, err := os.ReadFile(fmt.Sprintf("/proc/%d/stat", pid))
	if err != nil {
		return 0
	}
	// Fields after the command name, which is in parentheses and may hold
	// spaces; utime and stime are the 14th and 15th fields, in clock ticks
	// (USER_HZ, 100 on Linux).
	s := string(b)
	f := strings.Fields(s[strings.LastIndexByte(s, ')')+2:])
	if len(f) < 13 {
		return 0
	}
	u, _ := strconv.ParseInt(f[11], 10, 64)
	st, _ := strconv.ParseInt(f[12], 10, 64)
	return time.Duration(u+st) * 10 * time.Millisecond
}

func percentile(d []time.Duration, p int) time.Duration {
	if len(d) == 0 {
		return 0
	}
	s := slices.Clone(d)
	slices.Sort(s)
	return s[(len(s)-1)*p/100]
}

func median[T int64 | float64 | time.Duration](v []T) T {
	if len(v) == 0 {
		return 0
	}
	s := slices.Clone(v)
	slices.Sort(s)
	if len(s)%2 == 1 {
		return s[len(s)/2]
	}
	return (s[len(s)/2-1] + s[len(s)/2]) / 2
}

func ms(d time.Duration) string { return fmt.Sprintf("%.3f ms", float64(d)/float64(time.Millisecond)) }

func TestEgressProxyVsSquid(t *testing.T) {
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
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Minute)
	defer cancel()
	cacheDir, err := squid.DefaultCacheDir()
	if err != nil {
		t.Skip(err)
	}
	sq, err := squid.Ensure(ctx, cacheDir, t.Logf)
	if errors.Is(err, squid.ErrUnavailable) {
		t.Skipf("no squid to compare with: %v", err)
	}
	if err != nil {
		t.Fatal(err)
	}
	sqVersion, _ := sq.Version(ctx)

	small := make([]byte, smallBody)
	chunk := make([]byte, 1<<20)
	for i := range small {
		small[i] = 'a' + byte(i%26)
	}
	copy(chunk, small)
	mux := http.NewServeMux()
	mux.HandleFunc("GET /small", func(w http.ResponseWriter, r *http.Request) {
		w.Header().Set("Content-Type", "text/plain")
		w.Header().Set("Content-Length", strconv.Itoa(len(small)))
		w.Write(small)
	})
	mux.HandleFunc("GET /large", func(w http.ResponseWriter, r *http.Request) {
		w.Header().Set("Content-Type", "application/octet-stream")
		w.Header().Set("Content-Length", strconv.Itoa(largeBody))
		for range largeBody / len(chunk) {
			if _, err := w.Write(chunk); err != nil {
				return
			}
		}
	})
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	origin := &http.Server{Handler: mux, ReadHeaderTimeout: 10 * time.Second}
	go origin.Serve(ln)
	defer origin.Close()
	originAddr := ln.Addr().String()
	_, port, _ := net.SplitHostPort(originAddr)
	smallURL := "http://" + benchHost + ":" + port + "/small"
	largeURL := "http://" + benchHost + ":" + port + "/large"

	sqSrv, err := sq.Start(ctx, squid.Config{
		Allow:     []string{benchHost},
		Hosts:     map[string]string{benchHost: "127.0.0.1"},
		AccessLog: true,
	})
	if err != nil {
		t.Fatal(err)
	}
	defer sqSrv.Stop()
	ours := startBenchProxy(t, t.TempDir())
	defer ours.stop()

	sides := []*side{
		newSide("direct", "", originAddr, 0),
		newSide("egress-proxy", ours.addr, originAddr, ours.cmd.Process.Pid),
		newSide("squid", sqSrv.Addr, originAddr, sqSrv.Pid()),
	}
	for _, s := range sides {
		defer s.tr.CloseIdleConnections()
		// Both proxies must refuse what is not on the allowlist, or the
		// comparison is not between like configurations.
		if s.name != "direct" {
			resp, err := s.client.Get("http://other.bench.test:" + port + "/small")
			if err != nil {
				t.Fatalf("%s: %v", s.name, err)
			}
			resp.Body.Close()
			if resp.StatusCode != http.StatusForbidden {
				t.Fatalf("%s let a name off the allowlist through: %s", s.name, resp.Status)
			}
		}
	}

	load, _ := os.ReadFile("/proc/loadavg")
	t.Logf("%s; %s; GOMAXPROCS %d, %d CPUs; load average before: %s", runtime.Version(), sqVersion,
		runtime.GOMAXPROCS(0), runtime.NumCPU(), strings.Join(strings.Fields(string(load))[:3], " "))
	start := time.Now()
	// Rounds rotate the order of the sides, so that drift in the machine's
	// load (it is shared) falls on all of them alike.
	for r := range rounds {
		for i := range sides {
			s := sides[(r+i)%len(sides)]
			for _, m := range []struct {
				what string
				f    func(string) error
				u    string
			}{
				{"latency", s.measureLatency, smallURL},
				{"requests/s", s.measureThroughput, smallURL},
				{"MB/s", s.measureLarge, largeURL},
			} {
				if err := m.f(m.u); err != nil {
					t.Fatalf("round %d, %s, %s: %v", r+1, s.name, m.what, err)
				}
			}
		}
	}
	load, _ = os.ReadFile("/proc/loadavg")
	t.Logf("%d rounds in %s; load average after: %s", rounds, time.Since(start).Round(time.Second),
		strings.Join(strings.Fields(string(load))[:3], " "))

	direct, egress, sqd := sides[0], sides[1], sides[2]
	var b strings.Builder
	w := tabwriter.NewWriter(&b, 0, 0, 2, ' ', tabwriter.AlignRight)
	fmt.Fprintf(w, "\t%s\t%s\t%s\tegress/squid\t\n", direct.name, egress.name, sqd.name)
	row := func(name string, f func(*side) string, ratio string) {
		fmt.Fprintf(w, "%s\t%s\t%s\t%s\t%s\t\n", name, f(direct), f(egress), f(sqd), ratio)
	}
	ratio := func(a, b float64) string {
		if b == 0 {
			return "-"
		}
		return fmt.Sprintf("%.2f", a/b)
	}
	p := func(pc int) func(*side) string {
		return func(s *side) string { return ms(percentile(s.latency, pc)) }
	}
	added := func(pc int) func(*side) time.Duration {
		return func(s *side) time.Duration {
			// Per round, against the direct figure of the same round.
			var d []time.Duration
			for r := range s.roundP50 {
				if pc == 50 {
					d = append(d, s.roundP50[r]-direct.roundP50[r])
				} else {
					d = append(d, s.roundP90[r]-direct.roundP90[r])
				}
			}
			return median(d)
		}
	}
	row(fmt.Sprintf("GET %d B, p50", smallBody), p(50), ratio(float64(percentile(egress.latency, 50)), float64(percentile(sqd.latency, 50))))
	row(fmt.Sprintf("GET %d B, p90", smallBody), p(90), ratio(float64(percentile(egress.latency, 90)), float64(percentile(sqd.latency, 90))))
	for _, pc := range []int{50, 90} {
		a := added(pc)
		row(fmt.Sprintf("added at p%d (median of rounds)", pc), func(s *side) string {
			if s == direct {
				return "-"
			}
			return ms(a(s))
		}, ratio(float64(a(egress)), float64(a(sqd))))
	}
	row(fmt.Sprintf("requests/s, %d clients", concurrency), func(s *side) string {
		return fmt.Sprintf("%.0f", median(s.reqPerSec))
	}, ratio(median(egress.reqPerSec), median(sqd.reqPerSec)))
	row("proxy CPU per request", func(s *side) string {
		if s == direct {
			return "-"
		}
		return fmt.Sprintf("%.1f µs", float64(median(s.cpuPerReq))/float64(time.Microsecond))
	}, ratio(float64(median(egress.cpuPerReq)), float64(median(sqd.cpuPerReq))))
	row(fmt.Sprintf("MB/s, %d MiB body", largeBody>>20), func(s *side) string {
		return fmt.Sprintf("%.0f", median(s.mbPerSec))
	}, ratio(median(egress.mbPerSec), median(sqd.mbPerSec)))
	w.Flush()
	t.Logf("medians over %d rounds (latency percentiles over all %d samples per side; goal: requests/s and MB/s ratios >= 1, added p50 < 0.3 ms):\n%s",
		rounds, rounds*latencyReqs, b.String())
	for _, s := range sides[1:] {
		t.Logf("%s per round: requests/s %.0f, MB/s %.0f, p50 %v", s.name, s.reqPerSec, s.mbPerSec, s.roundP50)
	}
	recordVsSquid(t, direct, egress, sqd)
}

// recordVsSquid adds the comparison to `make bench`'s table, one figure
// per goal of the egress issue, each a per-round ratio or difference.
func recordVsSquid(t *testing.T, direct, egress, sqd *side) {
	addedP50 := make([]float64, len(egress.roundP50))
	squidAdded := make([]float64, len(sqd.roundP50))
	for r := range egress.roundP50 {
		addedP50[r] = float64(egress.roundP50[r]-direct.roundP50[r]) / float64(time.Millisecond)
		squidAdded[r] = float64(sqd.roundP50[r]-direct.roundP50[r]) / float64(time.Millisecond)
	}
	a := benchreport.Percentile(addedP50, 50)
	benchreport.Record(t, benchreport.Figure{
		Name: "egress proxy: latency added at p50, 1 KiB GET", Unit: "ms", Values: addedP50,
		Target: "< 0.3 ms and below squid", Met: benchreport.Bool(a < 0.3 && a < benchreport.Percentile(squidAdded, 50)),
		Note: fmt.Sprintf("squid adds %.3f ms; per round, against direct requests of the same round", benchreport.Percentile(squidAdded, 50)),
	})
	perRound := func(ours, theirs []float64) []float64 {
		out := make([]float64, min(len(ours), len(theirs)))
		for i := range out {
			out[i] = ours[i] / theirs[i]
		}
		return out
	}
	rps := perRound(egress.reqPerSec, sqd.reqPerSec)
	benchreport.Record(t, benchreport.Figure{
		Name: "egress proxy: requests/s against squid", Unit: "x", Values: rps,
		Target: ">= 1x", Met: benchreport.Bool(benchreport.Percentile(rps, 50) >= 1),
		Note: fmt.Sprintf("%d keep-alive clients; ours %.0f/s, squid %.0f/s", concurrency, median(egress.reqPerSec), median(sqd.reqPerSec)),
	})
	mbs := perRound(egress.mbPerSec, sqd.mbPerSec)
	benchreport.Record(t, benchreport.Figure{
		Name: "egress proxy: MB/s against squid", Unit: "x", Values: mbs,
		Target: ">= 1x", Met: benchreport.Bool(benchreport.Percentile(mbs, 50) >= 1),
		Note: fmt.Sprintf("%d MiB body; ours %.0f MB/s, squid %.0f MB/s", largeBody>>20, median(egress.mbPerSec), median(sqd.mbPerSec)),
	})
}
