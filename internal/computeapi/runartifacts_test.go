package computeapi

import (
	"bytes"
	"context"
	"crypto/rand"
	"crypto/sha256"
	"encoding/hex"
	"errors"
	"io"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus/testutil"

	api "github.com/agentbox/terraform-provider-agentbox/internal/computeapi/client"
	"github.com/agentbox/terraform-provider-agentbox/internal/objectstore"
	"github.com/agentbox/terraform-provider-agentbox/internal/store"
	"github.com/agentbox/terraform-provider-agentbox/internal/supervisor"
	"github.com/agentbox/terraform-provider-agentbox/internal/testenv/s3server"
)

func writeRandom(t *testing.T, path string, n int) []byte {
	t.Helper()
	b := make([]byte, n)
	if _, err := rand.Read(b); err != nil {
		t.Fatal(err)
	}
	if err := os.MkdirAll(filepath.Dir(path), 0o755); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(path, b, 0o644); err != nil {
		t.Fatal(err)
	}
	return b
}

func sha(b []byte) string {
	h := sha256.Sum256(b)
	return hex.EncodeToString(h[:])
}

// TestRunArtifacts runs commands in a real supervisor's workspace and
// keeps their artifacts in a real object store (a directory, and the test
// S3 server): the default path and globs, files over the per-file limit
// listed with an error and the others kept, byte-for-byte reads with
// their digest, the artifact events before the end, and retention
// deleting the objects before the records.
func TestRunArtifacts(t *testing.T) {
	t.Run(objectstore.KindEmbedded, func(t *testing.T) {
		s, err := objectstore.New(objectstore.Config{Dir: t.TempDir()})
		if err != nil {
			t.Fatal(err)
		}
		testRunArtifacts(t, s)
	})
	t.Run(objectstore.KindS3, func(t *testing.T) {
		srv := s3server.Start(t)
		s, err := objectstore.New(objectstore.Config{Endpoint: srv.Endpoint, Bucket: srv.Bucket, Region: srv.Region,
			AccessKeyID: srv.AccessKeyID, SecretAccessKey: srv.SecretAccessKey})
		if err != nil {
			t.Fatal(err)
		}
		testRunArtifacts(t, s)
	})
}

func testRunArtifacts(t *testing.T, obj objectstore.Store) {
	st := tempStore(t)
	ws := t.TempDir()
	const limit = 1 << 20
	var srv *Server
	c := realSupervisorAPIWith(t, apiSetup{
		store:     st,
		configure: func(cfg *supervisor.Config) { cfg.Workspace = ws },
		pushDelay: -1,
		server:    func(s *Server) { srv = s },
		options: func(o *Options) {
			o.Replica = "replica-a"
			o.RunRetention = 24 * time.Hour
			o.RunArtifacts = RunArtifactsOptions{Store: obj, Prefix: "agentbox", MaxFileBytes: limit}
		},
	})("agent-token:agent-1")
	ctx := context.Background()
	want := map[string][]byte{
		"artifacts/a.txt":     []byte("hello artifacts\n"),
		"artifacts/sub/b.bin": writeRandom(t, filepath.Join(ws, "artifacts/sub/b.bin"), 300<<10),
	}
	if err := os.WriteFile(filepath.Join(ws, "artifacts/a.txt"), want["artifacts/a.txt"], 0o644); err != nil {
		t.Fatal(err)
	}
	big := writeRandom(t, filepath.Join(ws, "artifacts/big.bin"), limit+1)
	if err := os.Symlink("/etc/passwd", filepath.Join(ws, "artifacts/link")); err != nil {
		t.Fatal(err)
	}
	uploaded := testutil.ToFloat64(metricArtifactBytes)

	// The default path, with a file the command itself writes.
	run, _, err := c.StartRun(ctx, api.StartRunRequest{AgentID: "agent-1", Cwd: ws, TimeoutSeconds: 30,
		Command: []string{"sh", "-c", "echo made by the run > artifacts/made.txt; echo done"}})
	if err != nil {
		t.Fatal(err)
	}
	want["artifacts/made.txt"] = []byte("made by the run\n")
	if r := waitRun(t, c, run.ID); r.Status != api.RunSucceeded {
		t.Fatalf("run ended %+v", r)
	}
	l, err := c.ListRunArtifacts(ctx, run.ID)
	if err != nil {
		t.Fatal(err)
	}
	if l.State != api.RunArtifactsCollected || l.Message != "" || len(l.Artifacts) != 4 {
		t.Fatalf("artifacts %+v", l)
	}
	for _, a := range l.Artifacts {
		if a.Path == "artifacts/big.bin" {
			if a.Error == "" || !strings.Contains(a.Error, "per-file limit") || a.Size != int64(len(big)) || a.SHA256 != "" {
				t.Errorf("the file over the limit is listed %+v", a)
			}
			if _, _, err := c.GetRunArtifact(ctx, run.ID, a.Path); api.CodeOf(err) != api.CodeNotFound || !strings.Contains(err.Error(), "per-file limit") {
				t.Errorf("get the file over the limit: %v", err)
			}
			continue
		}
		data, ok := want[a.Path]
		if !ok || a.Error != "" || a.Size != int64(len(data)) || a.SHA256 != sha(data) || a.UploadedAt == nil {
			t.Errorf("artifact %+v (want %d bytes, %s)", a, len(data), sha(data))
			continue
		}
		body, got, err := c.GetRunArtifact(ctx, run.ID, a.Path)
		if err != nil {
			t.Fatal(err)
		}
		b, err := io.ReadAll(body)
		_ = body.Close()
		if err != nil || !bytes.Equal(b, data) || got.Size != int64(len(data)) || got.SHA256 != sha(data) {
			t.Errorf("read back %s: %d bytes, %v, announced %+v", a.Path, len(b), err, got)
		}
	}
	if got := testutil.ToFloat64(metricArtifactBytes) - uploaded; got != float64(len(want["artifacts/a.txt"])+len(want["artifacts/sub/b.bin"])+len(want["artifacts/made.txt"])) {
		t.Errorf("agentbox_run_artifact_bytes_total grew by %v", got)
	}
	// The artifact events come after the output and before the end.
	var types []string
	if err := c.FollowRun(ctx, run.ID, 0, func(e api.RunEvent) error {
		types = append(types, e.Type)
		if e.Type == api.RunEventArtifact && e.Path == "" {
			t.Errorf("artifact event without a path: %+v", e)
		}
		return nil
	}); err != nil {
		t.Fatal(err)
	}
	if got := strings.Join(types, ","); got != "state,stdout,artifact,artifact,artifact,artifact,state,end" {
		t.Errorf("events %s", got)
	}

	// Globs, absolute under the workspace and relative.
	writeRandom(t, filepath.Join(ws, "out/x.json"), 10)
	writeRandom(t, filepath.Join(ws, "out/y.txt"), 10)
	writeRandom(t, filepath.Join(ws, "out/deep/z.json"), 10)
	globbed, _, err := c.StartRun(ctx, api.StartRunRequest{AgentID: "agent-1", Cwd: ws, Command: []string{"true"},
		Artifacts: []string{"/workspace/out/*.json", "out/*/z.json", "missing/*"}})
	if err != nil {
		t.Fatal(err)
	}
	waitRun(t, c, globbed.ID)
	if l, err := c.ListRunArtifacts(ctx, globbed.ID); err != nil || len(l.Artifacts) != 2 ||
		l.Artifacts[0].Path != "out/deep/z.json" || l.Artifacts[1].Path != "out/x.json" {
		t.Errorf("globbed artifacts %+v, %v", l, err)
	}
	for _, bad := range [][]string{{"/etc/passwd"}, {"../x"}, {"out/[x"}} {
		if _, _, err := c.StartRun(ctx, api.StartRunRequest{AgentID: "agent-1", Command: []string{"true"}, Artifacts: bad}); api.CodeOf(err) != api.CodeInvalidArgument {
			t.Errorf("artifacts %q: %v, want invalid_argument", bad, err)
		}
	}
	if _, err := c.ListRunArtifacts(ctx, "run-00000000000000000000"); api.CodeOf(err) != api.CodeNotFound {
		t.Errorf("artifacts of no run: %v", err)
	}

	// A cancelled run keeps what its command left, too.
	long, _, err := c.StartRun(ctx, api.StartRunRequest{AgentID: "agent-1", Cwd: ws, TimeoutSeconds: 600,
		Command: []string{"sh", "-c", "echo partial > out/partial.json; touch started; sleep 600"}, Artifacts: []string{"out/partial.json"}})
	if err != nil {
		t.Fatal(err)
	}
	for deadline := time.Now().Add(30 * time.Second); ; time.Sleep(20 * time.Millisecond) {
		if _, err := os.Stat(filepath.Join(ws, "started")); err == nil {
			break
		}
		if time.Now().After(deadline) {
			t.Fatal("the long command never started")
		}
	}
	if _, err := c.CancelRun(ctx, long.ID); err != nil {
		t.Fatal(err)
	}
	if r := waitRun(t, c, long.ID); r.Status != api.RunCancelled {
		t.Fatalf("cancelled run ended %+v", r)
	}
	if l, err := c.ListRunArtifacts(ctx, long.ID); err != nil || len(l.Artifacts) != 1 || l.Artifacts[0].SHA256 != sha([]byte("partial\n")) {
		t.Errorf("artifacts of the cancelled run %+v, %v", l, err)
	}

	// Retention deletes the objects, then the records.
	var objects int
	count := func() int {
		n := 0
		if err := obj.List(ctx, "agentbox/_runs/", func(objectstore.Info) error { n++; return nil }); err != nil {
			t.Fatal(err)
		}
		return n
	}
	if objects = count(); objects != 6 {
		t.Fatalf("%d objects in the store, want 6", objects)
	}
	deleted, deletedBytes := testutil.ToFloat64(metricArtifactsDeleted), testutil.ToFloat64(metricArtifactDeletedBytes)
	srv.pruneRuns(time.Now().Add(48*time.Hour), srv.log)
	if n := count(); n != 0 {
		t.Errorf("%d objects left after retention", n)
	}
	if got := testutil.ToFloat64(metricArtifactsDeleted) - deleted; got != float64(objects) {
		t.Errorf("agentbox_run_artifacts_deleted_total grew by %v, want %d", got, objects)
	}
	if got := testutil.ToFloat64(metricArtifactDeletedBytes) - deletedBytes; got < float64(300<<10) {
		t.Errorf("agentbox_run_artifacts_deleted_bytes_total grew by %v", got)
	}
	for _, id := range []string{run.ID, globbed.ID, long.ID} {
		if _, err := st.GetRun(ctx, id); !errors.Is(err, store.ErrNotFound) {
			t.Errorf("run %s after retention: %v", id, err)
		}
	}
}

// Without an object store a run that had artifacts says, once, that
// they were not kept and why; the run itself succeeds.
func TestRunArtifactsWithoutStore(t *testing.T) {
	st := tempStore(t)
	ws := t.TempDir()
	c := runsAPI(t, st, ws, func(o *Options) {
		o.RunArtifacts = RunArtifactsOptions{Unavailable: "no object store in this test"}
	})("agent-token:agent-1")
	ctx := context.Background()
	writeRandom(t, filepath.Join(ws, "artifacts/a.bin"), 100)
	run, _, err := c.StartRun(ctx, api.StartRunRequest{AgentID: "agent-1", Command: []string{"true"}})
	if err != nil {
		t.Fatal(err)
	}
	if r := waitRun(t, c, run.ID); r.Status != api.RunSucceeded {
		t.Fatalf("run ended %+v", r)
	}
	l, err := c.ListRunArtifacts(ctx, run.ID)
	if err != nil || l.State != api.RunArtifactsNotKept || len(l.Artifacts) != 0 ||
		!strings.Contains(l.Message, "1 file(s)") || !strings.Contains(l.Message, "no object store in this test") {
		t.Fatalf("artifacts %+v, %v", l, err)
	}
	var msgs []string
	must := func(err error) {
		if err != nil {
			t.Fatal(err)
		}
	}
	must(c.FollowRun(ctx, run.ID, 0, func(e api.RunEvent) error {
		if e.Type == api.RunEventArtifact {
			msgs = append(msgs, e.Message)
		}
		return nil
	}))
	if len(msgs) != 1 || msgs[0] != l.Message {
		t.Errorf("artifact events %q", msgs)
	}
	// A run with nothing under the default path records nothing.
	must(os.RemoveAll(filepath.Join(ws, "artifacts")))
	quiet, _, err := c.StartRun(ctx, api.StartRunRequest{AgentID: "agent-1", Command: []string{"true"}})
	must(err)
	waitRun(t, c, quiet.ID)
	if l, err := c.ListRunArtifacts(ctx, quiet.ID); err != nil || l.State != api.RunArtifactsCollected || l.Message != "" || len(l.Artifacts) != 0 {
		t.Errorf("artifacts of a run without any: %+v, %v", l, err)
	}
	// A run whose executor was lost half-way through its upload says so.
	lost, _, err := st.CreateRun(ctx, store.Run{Caller: "agent agent-1", Mode: store.RunModeAgent, AgentID: "agent-1",
		Command: store.RunCommand{Argv: []string{"true"}}})
	must(err)
	_, err = st.StartRunAttempt(ctx, lost.ID, "replica-x", "team-a/sb-1")
	must(err)
	must(st.BeginRunArtifacts(ctx, lost.ID, "s3", "agentbox/_runs/"+lost.ID+"/"))
	_, err = st.FinishRun(ctx, lost.ID, store.RunResult{Status: store.RunFailed, Reason: "ExecutorLost"})
	must(err)
	if l, err := c.ListRunArtifacts(ctx, lost.ID); err != nil || l.State != api.RunArtifactsCollected || !strings.Contains(l.Message, "was lost") {
		t.Errorf("artifacts of a run lost while collecting: %+v, %v", l, err)
	}
}
