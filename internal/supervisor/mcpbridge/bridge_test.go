package mcpbridge

import (
	"context"
	"encoding/json"
	"fmt"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"sort"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	api "github.com/agentbox/terraform-provider-agentbox/internal/supervisor/supervisorapi"
)

// everythingDirEnv names an existing npm prefix holding the package, to
// skip the install on repeated runs.
const everythingDirEnv = "MCPBRIDGE_EVERYTHING_PREFIX"

// installEverything installs the reference "everything" MCP server from
// the npm registry and returns node and the server's entry point.
func installEverything(t *testing.T) (node, entry string) {
	t.Helper()
	if testing.Short() {
		t.Skip("skipping the npm install in -short mode")
	}
	node, err := exec.LookPath("node")
	if err != nil {
		t.Skip("node is not installed; skipping the third-party MCP server test")
	}
	prefix := os.Getenv(everythingDirEnv)
	if prefix == "" {
		npm, err := exec.LookPath("npm")
		if err != nil {
			t.Skip("npm is not installed; skipping the third-party MCP server test")
		}
		prefix = t.TempDir()
		ctx, cancel := context.WithTimeout(context.Background(), 5*time.Minute)
		defer cancel()
		start := time.Now()
		cmd := exec.CommandContext(ctx, npm, "install", "--prefix", prefix, "--no-audit", "--no-fund", "--loglevel=error",
			"@modelcontextprotocol/server-everything")
		cmd.Dir = prefix
		if out, err := cmd.CombinedOutput(); err != nil {
			t.Skipf("npm install @modelcontextprotocol/server-everything failed (no registry access?); skipping: %v\n%s", err, out)
		}
		t.Logf("npm install took %s", time.Since(start).Round(time.Millisecond))
	}
	pkgDir := filepath.Join(prefix, "node_modules", "@modelcontextprotocol", "server-everything")
	b, err := os.ReadFile(filepath.Join(pkgDir, "package.json"))
	if err != nil {
		t.Skipf("server-everything is not installed under %s: %v", prefix, err)
	}
	var pkg struct {
		Version string            `json:"version"`
		Bin     map[string]string `json:"bin"`
	}
	if err := json.Unmarshal(b, &pkg); err != nil {
		t.Fatal(err)
	}
	bin := pkg.Bin["mcp-server-everything"]
	if bin == "" {
		bin = "dist/index.js"
	}
	t.Logf("server-everything %s, entry %s, node %s", pkg.Version, bin, nodeVersion(node))
	return node, filepath.Join(pkgDir, bin)
}

func nodeVersion(node string) string {
	out, err := exec.Command(node, "--version").Output()
	if err != nil {
		return "unknown"
	}
	return strings.TrimSpace(string(out))
}

// TestEverythingServer bridges the reference MCP server from the npm
// registry, run with the machine's Node.
func TestEverythingServer(t *testing.T) {
	node, entry := installEverything(t)
	start := time.Now()
	m, ts := startManager(t, Config{
		Servers: []ServerConfig{{
			Name:    "everything",
			Command: node,
			Args:    []string{entry, "stdio"},
			Env:     map[string]string{"PATH": filepath.Dir(node) + ":" + DefaultPath},
		}},
	})
	waitRunning(t, m, "everything", 60*time.Second)
	t.Logf("time to running with the first tools/list cached: %s", time.Since(start).Round(time.Millisecond))

	var tools ToolsResponse
	if code := getJSON(t, ts.URL+"/mcp/everything/tools", &tools); code != http.StatusOK {
		t.Fatalf("GET tools: %d", code)
	}
	names := toolNames(tools.Tools)
	if !slices.Contains(names, "echo") {
		t.Fatalf("cached tools/list lacks echo: %v", names)
	}
	t.Logf("cached tools (%d): %v", len(names), names)

	st, _ := m.Status("everything")
	if st.ServerInfo == nil || st.ProtocolVersion == "" || st.PID == 0 || st.Tools != len(names) {
		t.Fatalf("status: %+v", st)
	}
	t.Logf("server %s %s, protocol %s", st.ServerInfo.Name, st.ServerInfo.Version, st.ProtocolVersion)

	// tools/list through the bridge agrees with the cache.
	r := call(t, ts, "everything", "tools/list", map[string]any{})
	var listed struct {
		Tools []struct {
			Name string `json:"name"`
		} `json:"tools"`
	}
	if err := json.Unmarshal(r.Result, &listed); err != nil || len(listed.Tools) == 0 {
		t.Fatalf("tools/list: %v %s", err, r.Result)
	}

	if got := toolText(t, ts, "everything", "echo", map[string]any{"message": "hello bridge"}); !strings.Contains(got, "hello bridge") {
		t.Fatalf("echo returned %q", got)
	}

	var rtts []time.Duration
	for i := range 20 {
		msg := "round trip " + strconv.Itoa(i)
		t0 := time.Now()
		got := toolText(t, ts, "everything", "echo", map[string]any{"message": msg})
		rtts = append(rtts, time.Since(t0))
		if !strings.Contains(got, msg) {
			t.Fatalf("echo returned %q", got)
		}
	}
	sort.Slice(rtts, func(i, j int) bool { return rtts[i] < rtts[j] })
	t.Logf("tools/call echo over HTTP: median %s, min %s, max %s (20 calls)", rtts[10], rtts[0], rtts[19])

	// Concurrent calls share the one session.
	t0 := time.Now()
	var wg sync.WaitGroup
	errs := make(chan string, 32)
	for i := range 32 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			msg := "parallel " + strconv.Itoa(i)
			body := `{"jsonrpc":"2.0","id":` + strconv.Itoa(i) + `,"method":"tools/call","params":{"name":"echo","arguments":{"message":"` + msg + `"}}}`
			resp, err := http.Post(ts.URL+"/mcp/everything", "application/json", strings.NewReader(body))
			if err != nil {
				errs <- err.Error()
				return
			}
			defer resp.Body.Close()
			var r struct {
				ID     int `json:"id"`
				Result struct {
					Content []struct {
						Text string `json:"text"`
					} `json:"content"`
				} `json:"result"`
			}
			if err := json.NewDecoder(resp.Body).Decode(&r); err != nil || r.ID != i || len(r.Result.Content) == 0 ||
				!strings.Contains(r.Result.Content[0].Text, msg) {
				errs <- fmt.Sprintf("call %d: HTTP %d, %+v, %v", i, resp.StatusCode, r, err)
			}
		}()
	}
	wg.Wait()
	close(errs)
	for e := range errs {
		t.Error(e)
	}
	t.Logf("32 concurrent tools/call echo: %s wall time", time.Since(t0).Round(time.Millisecond))

	for _, method := range []string{"ping", "resources/list", "prompts/list", "resources/templates/list"} {
		if r := call(t, ts, "everything", method, nil); r.Error != nil {
			t.Errorf("%s: %d %s", method, r.Error.Code, r.Error.Message)
		}
	}
	// A tool error from the server is a JSON-RPC answer, not an HTTP one.
	r = call(t, ts, "everything", "tools/call", map[string]any{"name": "no-such-tool"})
	if r.Error == nil && !strings.Contains(string(r.Result), `"isError":true`) {
		t.Errorf("unknown tool: %s", r.Result)
	}
	if r := call(t, ts, "everything", "logging/setLevel", map[string]any{"level": "debug"}); r.Error == nil || r.Error.Code != -32601 {
		t.Errorf("unbridged method: %+v", r.Error)
	}
}

// TestCrashLoop: a server that exits at once is restarted with growing
// delays and reported, while the supervisor and the other servers keep
// serving.
func TestCrashLoop(t *testing.T) {
	m, ts := startManager(t, Config{
		Servers: []ServerConfig{
			{Name: "crashy", Command: "sh", Args: []string{"-c", "echo boom: config missing >&2; exit 3"}},
			helperServer(t, "good", "plain"),
			{Name: "missing", Command: "no-such-mcp-server"},
		},
		InitialBackoff: 40 * time.Millisecond,
		MaxBackoff:     320 * time.Millisecond,
	})
	var backoffs []int64
	start := time.Now()
	waitFor(t, 10*time.Second, "five restarts", func() bool {
		st, _ := m.Status("crashy")
		if st.State == StateBackoff && (len(backoffs) == 0 || backoffs[len(backoffs)-1] != st.BackoffMS) {
			backoffs = append(backoffs, st.BackoffMS)
		}
		return st.Restarts >= 5
	})
	t.Logf("5 restarts in %s; backoffs seen (ms): %v", time.Since(start).Round(time.Millisecond), backoffs)
	if len(backoffs) < 3 || !slices.IsSorted(backoffs) || backoffs[0] != 40 || backoffs[len(backoffs)-1] != 320 {
		t.Errorf("backoff did not grow from 40 ms to the 320 ms cap: %v", backoffs)
	}

	st, _ := m.Status("crashy")
	if !strings.Contains(st.LastError, "exit status 3") || !strings.Contains(st.LastError, "boom: config missing") {
		t.Errorf("last error: %q", st.LastError)
	}

	status, body := post(t, ts, "crashy", `{"jsonrpc":"2.0","id":1,"method":"tools/list"}`)
	var unavailable UnavailableBody
	if err := json.Unmarshal(body, &unavailable); err != nil {
		t.Fatal(err)
	}
	if status != http.StatusServiceUnavailable || unavailable.Error == nil || unavailable.Error.Code != api.CodeUnavailable ||
		!strings.Contains(unavailable.Error.Message, "exit status 3") || unavailable.Server.Restarts < 5 {
		t.Errorf("POST to a crashing server: %d %s", status, body)
	}
	if code := getJSON(t, ts.URL+"/mcp/crashy/tools", nil); code != http.StatusServiceUnavailable {
		t.Errorf("GET tools of a crashing server: %d", code)
	}

	waitRunning(t, m, "good", 10*time.Second)
	if got := toolText(t, ts, "good", "echo", map[string]string{"message": "still here"}); got != "Echo: still here" {
		t.Errorf("good server: %q", got)
	}
	var list ListResponse
	if code := getJSON(t, ts.URL+"/mcp", &list); code != http.StatusOK || len(list.Servers) != 3 ||
		list.Servers[0].Name != "crashy" || list.Servers[1].State != StateRunning {
		t.Errorf("GET /mcp: %d %+v", code, list)
	}
	st, _ = m.Status("missing")
	if st.State == StateRunning || !strings.Contains(st.LastError, "no-such-mcp-server") {
		t.Errorf("missing executable: %+v", st)
	}
}

// TestHungHandshake: a server that never answers the handshake is killed,
// with its group, when the start-up times out, and retried.
func TestHungHandshake(t *testing.T) {
	dir := t.TempDir()
	pidFile := filepath.Join(dir, "pids")
	m, _ := startManager(t, Config{
		Servers:        []ServerConfig{{Name: "mute", Command: "sh", Args: []string{"-c", "sleep 300 & echo $$ $! >> " + pidFile + "; wait"}}},
		StartTimeout:   200 * time.Millisecond,
		InitialBackoff: 50 * time.Millisecond,
	})
	waitFor(t, 10*time.Second, "a retry after the start-up timeout", func() bool {
		st, _ := m.Status("mute")
		return st.Restarts >= 1 && st.State == StateStarting
	})
	st, _ := m.Status("mute")
	if !strings.Contains(st.LastError, "start-up timed out") && !strings.Contains(st.LastError, "signal: killed") {
		t.Errorf("last error: %q", st.LastError)
	}
	b, err := os.ReadFile(pidFile)
	if err != nil {
		t.Fatal(err)
	}
	first := strings.Fields(strings.SplitN(string(b), "\n", 2)[0])
	for _, f := range first {
		pid, _ := strconv.Atoi(f)
		if alive(pid) {
			t.Errorf("process %d of the timed-out start is still alive", pid)
		}
	}
}

// TestRestartAfterExit: a server that dies while running comes back,
// with its tool cache refreshed, and calls in flight fail with 503.
func TestRestartAfterExit(t *testing.T) {
	tracker := &countingTracker{live: map[int]bool{}}
	m, ts := startManager(t, Config{
		Servers:        []ServerConfig{helperServer(t, "h", "plain")},
		InitialBackoff: 20 * time.Millisecond,
		Tracker:        tracker,
	})
	waitRunning(t, m, "h", 10*time.Second)
	first, _ := m.Status("h")
	status, body := post(t, ts, "h", `{"jsonrpc":"2.0","id":"x","method":"tools/call","params":{"name":"exit"}}`)
	if status != http.StatusServiceUnavailable {
		t.Errorf("call that kills the server: %d %s", status, body)
	}
	waitFor(t, 10*time.Second, "restart", func() bool {
		st, _ := m.Status("h")
		return st.State == StateRunning && st.Restarts == 1
	})
	st, _ := m.Status("h")
	if st.PID == first.PID || !strings.Contains(st.LastError, "exit status 7") || !strings.Contains(st.LastError, "exiting on request") {
		t.Errorf("after restart: %+v", st)
	}
	if got := toolText(t, ts, "h", "echo", map[string]string{"message": "again"}); got != "Echo: again" {
		t.Errorf("echo after restart: %q", got)
	}
	if err := m.Stop(context.Background()); err != nil {
		t.Fatal(err)
	}
	tracker.mu.Lock()
	defer tracker.mu.Unlock()
	if tracker.starts != 2 || len(tracker.live) != 0 {
		t.Errorf("tracker saw %d starts and has %v left, want 2 and none", tracker.starts, tracker.live)
	}
}

// countingTracker records the children it is told about, as the
// supervisor's reaper bookkeeping would.
type countingTracker struct {
	mu     sync.Mutex
	starts int
	live   map[int]bool
}

func (c *countingTracker) Start(start func() (int, error)) error {
	c.mu.Lock()
	defer c.mu.Unlock()
	pid, err := start()
	if err == nil {
		c.starts++
		c.live[pid] = true
	}
	return err
}

func (c *countingTracker) Done(pid int) {
	c.mu.Lock()
	defer c.mu.Unlock()
	delete(c.live, pid)
}

// TestToolListChanged: the cache follows the server's list_changed
// notification.
func TestToolListChanged(t *testing.T) {
	m, ts := startManager(t, Config{Servers: []ServerConfig{helperServer(t, "h", "plain")}})
	waitRunning(t, m, "h", 10*time.Second)
	toolText(t, ts, "h", "add_tool", map[string]string{"name": "brand_new"})
	waitFor(t, 10*time.Second, "the cache to show the new tool", func() bool {
		var tools ToolsResponse
		getJSON(t, ts.URL+"/mcp/h/tools", &tools)
		return slices.Contains(toolNames(tools.Tools), "brand_new")
	})
}

// TestStopKillsProcessGroups: Stop leaves no process of any server,
// grandchildren and servers that ignore SIGTERM included.
func TestStopKillsProcessGroups(t *testing.T) {
	m, ts := startManager(t, Config{
		Servers: []ServerConfig{
			helperServer(t, "polite", "plain"),
			helperServer(t, "stubborn", "ignore-term"),
		},
		StopGrace: 300 * time.Millisecond,
	})
	var pids, groups []int
	for _, name := range []string{"polite", "stubborn"} {
		waitRunning(t, m, name, 10*time.Second)
		st, _ := m.Status(name)
		child, err := strconv.Atoi(toolText(t, ts, name, "spawn", map[string]any{}))
		if err != nil {
			t.Fatal(err)
		}
		pids = append(pids, st.PID, child)
		groups = append(groups, st.PID)
	}
	for _, g := range groups {
		if n := len(groupMembers(g)); n != 2 {
			t.Fatalf("group %d has %d live members before Stop, want 2", g, n)
		}
	}
	// A call in flight when Stop comes must not hold it up.
	inflight := make(chan int, 1)
	go func() {
		status, _ := postNoFatal(ts.URL+"/mcp/polite", `{"jsonrpc":"2.0","id":1,"method":"tools/call","params":{"name":"sleep"}}`)
		inflight <- status
	}()
	time.Sleep(100 * time.Millisecond)

	t0 := time.Now()
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()
	if err := m.Stop(ctx); err != nil {
		t.Fatal(err)
	}
	t.Logf("Stop took %s (stop grace 300ms, one server ignores SIGTERM)", time.Since(t0).Round(time.Millisecond))
	for _, p := range pids {
		if alive(p) {
			t.Errorf("process %d is still alive after Stop", p)
		}
	}
	for _, g := range groups {
		if left := groupMembers(g); len(left) > 0 {
			t.Errorf("group %d still has %v", g, left)
		}
	}
	for _, st := range m.Statuses() {
		if st.State != StateStopped || st.PID != 0 {
			t.Errorf("after Stop: %+v", st)
		}
	}
	select {
	case status := <-inflight:
		if status != http.StatusServiceUnavailable {
			t.Errorf("call in flight at Stop: %d, want 503", status)
		}
	case <-time.After(10 * time.Second):
		t.Error("call in flight at Stop did not return")
	}
}

// TestHandlerErrors covers the HTTP surface's refusals.
func TestHandlerErrors(t *testing.T) {
	m, ts := startManager(t, Config{
		Servers:         []ServerConfig{helperServer(t, "h", "plain")},
		MaxRequestBytes: 1024,
		CallTimeout:     time.Second,
	})
	waitRunning(t, m, "h", 10*time.Second)

	var eb api.ErrorBody
	if code := getJSON(t, ts.URL+"/mcp/nope", &eb); code != http.StatusNotFound || eb.Error == nil || eb.Error.Code != api.CodeNotFound {
		t.Errorf("unknown server: %d %+v", code, eb.Error)
	}
	if status, body := post(t, ts, "nope", `{}`); status != http.StatusNotFound {
		t.Errorf("POST unknown server: %d %s", status, body)
	}
	if status, body := post(t, ts, "h", `{"jsonrpc":"2.0","id":1,"method":"ping","params":{"pad":"`+strings.Repeat("x", 2000)+`"}}`); status != http.StatusRequestEntityTooLarge {
		t.Errorf("large body: %d %s", status, body)
	}
	for body, code := range map[string]int64{
		`not json`: -32700,
		`[{"jsonrpc":"2.0","id":1,"method":"ping"}]`:                      -32600,
		`{"jsonrpc":"2.0","method":"tools/list"}`:                         -32600,
		`{"jsonrpc":"2.0","id":{},"method":"ping"}`:                       -32600,
		`{"jsonrpc":"1.0","id":1,"method":"ping"}`:                        -32600,
		`{"jsonrpc":"2.0","id":1,"method":"sampling/createMessage"}`:      -32601,
		`{"jsonrpc":"2.0","id":1,"method":"tools/call","params":"oops"}`:  -32602,
		`{"jsonrpc":"2.0","id":1,"method":"tools/call","params":{"x":1}}`: 0, // the server's own answer
	} {
		status, b := post(t, ts, "h", body)
		var r rpcReply
		if status != http.StatusOK || json.Unmarshal(b, &r) != nil {
			t.Errorf("%s: %d %s", body, status, b)
			continue
		}
		if code != 0 && (r.Error == nil || r.Error.Code != code) {
			t.Errorf("%s: want JSON-RPC error %d, got %s", body, code, b)
		}
	}
	if status, _ := post(t, ts, "h", `{"jsonrpc":"2.0","method":"notifications/initialized"}`); status != http.StatusAccepted {
		t.Errorf("notification: %d", status)
	}
	t0 := time.Now()
	if status, body := post(t, ts, "h", `{"jsonrpc":"2.0","id":1,"method":"tools/call","params":{"name":"sleep"}}`); status != http.StatusGatewayTimeout {
		t.Errorf("slow call: %d %s", status, body)
	}
	if d := time.Since(t0); d > 5*time.Second {
		t.Errorf("timeout took %s", d)
	}
	req, _ := http.NewRequest(http.MethodDelete, ts.URL+"/mcp/h", nil)
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	resp.Body.Close()
	if resp.StatusCode != http.StatusMethodNotAllowed || resp.Header.Get("Allow") == "" {
		t.Errorf("DELETE: %d", resp.StatusCode)
	}
	// The server is still usable after the timed-out call.
	if got := toolText(t, ts, "h", "echo", map[string]string{"message": "ok"}); got != "Echo: ok" {
		t.Errorf("echo: %q", got)
	}
}

// TestConcurrencyLimit: calls past MaxConcurrentCalls are refused, not
// queued.
func TestConcurrencyLimit(t *testing.T) {
	m, ts := startManager(t, Config{
		Servers:            []ServerConfig{helperServer(t, "h", "plain")},
		MaxConcurrentCalls: 1,
		CallTimeout:        2 * time.Second,
	})
	waitRunning(t, m, "h", 10*time.Second)
	go postNoFatal(ts.URL+"/mcp/h", `{"jsonrpc":"2.0","id":1,"method":"tools/call","params":{"name":"sleep"}}`)
	waitFor(t, 5*time.Second, "the slow call to take the slot", func() bool { return len(m.slots) == 1 })
	status, body := post(t, ts, "h", `{"jsonrpc":"2.0","id":2,"method":"ping"}`)
	if status != http.StatusTooManyRequests || !strings.Contains(string(body), string(api.CodeResourceExhausted)) {
		t.Errorf("second call: %d %s", status, body)
	}
}

func TestConfigValidation(t *testing.T) {
	for _, sc := range []ServerConfig{
		{Name: "", Command: "x"},
		{Name: "../x", Command: "x"},
		{Name: "a", Command: ""},
		{Name: "a", Command: "x", Args: []string{"a\x00b"}},
		{Name: "a", Command: "x", Env: map[string]string{"A=B": "c"}},
	} {
		if _, err := New(Config{Servers: []ServerConfig{sc}}); err == nil {
			t.Errorf("%+v: accepted", sc)
		}
	}
	if _, err := New(Config{Servers: []ServerConfig{{Name: "a", Command: "x"}, {Name: "a", Command: "y"}}}); err == nil {
		t.Error("duplicate names accepted")
	}
}
