package main

import (
	"bytes"
	"context"
	"encoding/json"
	"io"
	"net/http"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	api "github.com/agentbox/terraform-provider-agentbox/internal/supervisor/supervisorapi"
)

// The per-command path of the real binary: every call has its log line and
// audit record, and a command without stdin reads /dev/null, the one the
// supervisor keeps open for all of them.
func TestSupervisorProcessCommandPath(t *testing.T) {
	bin := buildSupervisor(t)
	workdir := t.TempDir()
	auditPath := filepath.Join(t.TempDir(), "audit.jsonl")
	p := startSupervisor(t, bin, []string{"-insecure-listen", "127.0.0.1:0", "-workdir", workdir, "-audit-log", auditPath},
		[]string{"PATH=" + os.Getenv("PATH")})
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()

	post := func(body string) (*http.Response, []byte) {
		t.Helper()
		req, err := http.NewRequestWithContext(ctx, http.MethodPost, "http://"+p.addr+api.PathCommands, strings.NewReader(body))
		if err != nil {
			t.Fatal(err)
		}
		req.Header.Set("Content-Type", "application/json")
		return roundTrip(t, req)
	}
	run := func(req api.CommandRequest) api.CommandResult {
		t.Helper()
		body, _ := json.Marshal(req)
		resp, data := post(string(body))
		var res api.CommandResult
		if resp.StatusCode != http.StatusOK || json.Unmarshal(data, &res) != nil {
			t.Fatalf("%v: %d %s", req.Command, resp.StatusCode, data)
		}
		return res
	}

	// Twice: the first command's exit must leave the shared /dev/null
	// open for the next.
	for range 2 {
		res := run(api.CommandRequest{Command: []string{"sh", "-c", "readlink /proc/self/fd/0; cat; echo done"}})
		if res.Stdout != "/dev/null\ndone\n" || res.ExitCode != 0 {
			t.Errorf("without stdin: %+v", res)
		}
	}
	if res := run(api.CommandRequest{Command: []string{"cat"}, Stdin: "given"}); res.Stdout != "given" {
		t.Errorf("with stdin: %+v", res)
	}
	if resp, data := post(`{"command":`); resp.StatusCode != http.StatusBadRequest {
		t.Errorf("a truncated request: %d %s", resp.StatusCode, data)
	}

	// The audit record follows the answer, so it may land a moment later.
	want := map[float64]int{200: 3, 400: 1}
	deadline := time.Now().Add(10 * time.Second)
	for {
		got := map[float64]int{}
		for _, e := range readAudit(t, auditPath) {
			if e["tool"] == "run_command" {
				got[e["http_status"].(float64)]++
			}
		}
		if got[200] == want[200] && got[400] == want[400] && len(got) == 2 {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("audit: run_command lines by status %v, want %v", got, want)
		}
		time.Sleep(20 * time.Millisecond)
	}
}

// Files are served in large blocks (progressWriter.ReadFrom); whole files
// and ranges come back exact through the real binary.
func TestSupervisorProcessFileBlocks(t *testing.T) {
	bin := buildSupervisor(t)
	workdir := t.TempDir()
	p := startSupervisor(t, bin, []string{"-insecure-listen", "127.0.0.1:0", "-workdir", workdir},
		[]string{"PATH=" + os.Getenv("PATH")})
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	data := make([]byte, 3<<20+7)
	for i := range data {
		data[i] = byte(i*7 + i>>11)
	}
	client := api.NewClient("http://"+p.addr, nil)
	if _, err := client.PutFile(ctx, "big.bin", bytes.NewReader(data), 0); err != nil {
		t.Fatal(err)
	}
	get := func(rng string) (*http.Response, []byte) {
		t.Helper()
		req, _ := http.NewRequestWithContext(ctx, http.MethodGet, "http://"+p.addr+api.PathFiles+"big.bin", nil)
		if rng != "" {
			req.Header.Set("Range", rng)
		}
		return roundTrip(t, req)
	}
	if resp, got := get(""); resp.StatusCode != http.StatusOK || !bytes.Equal(got, data) {
		t.Errorf("whole file: %d, %d bytes, equal %v", resp.StatusCode, len(got), bytes.Equal(got, data))
	}
	if resp, got := get("bytes=300001-1048999"); resp.StatusCode != http.StatusPartialContent || !bytes.Equal(got, data[300001:1049000]) {
		t.Errorf("range: %d, %d bytes", resp.StatusCode, len(got))
	}
}

// roundTrip sends req and returns the response with its whole body read.
func roundTrip(t *testing.T, req *http.Request) (*http.Response, []byte) {
	t.Helper()
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	data, err := io.ReadAll(resp.Body)
	if err != nil {
		t.Fatal(err)
	}
	return resp, data
}
