package controller

import (
	"bytes"
	"context"
	"crypto/rand"
	"crypto/sha256"
	"encoding/hex"
	"io"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
	"time"

	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"sigs.k8s.io/controller-runtime/pkg/metrics"

	"github.com/agentbox/terraform-provider-agentbox/internal/api/v1alpha1"
	"github.com/agentbox/terraform-provider-agentbox/internal/computeapi"
	apiclient "github.com/agentbox/terraform-provider-agentbox/internal/computeapi/client"
	"github.com/agentbox/terraform-provider-agentbox/internal/objectstore"
	"github.com/agentbox/terraform-provider-agentbox/internal/testenv/s3server"
)

// TestRunArtifactsOnCluster keeps a run's artifacts in the real S3 server
// from a real gVisor sandbox, recorded in the real store: the run writes
// files of known random content (one of 6 MiB) under /workspace/artifacts
// and one past the per-file limit; they are listed with their sizes and
// SHA-256 (the one past the limit with an error), their events come
// before the run's end, and they read back byte for byte through the API
// and through the agentbox CLI. A second run keeps what its globs name.
// Retention, by another replica's sweeper, deletes the objects from the
// bucket and then the records.
func TestRunArtifactsOnCluster(t *testing.T) {
	t.Parallel()
	image := os.Getenv(EnvSandboxImage)
	if image == "" {
		t.Skipf("%s is not set: runs need the real sandbox image's supervisor", EnvSandboxImage)
	}
	s3 := s3server.Start(t)
	obj, err := objectstore.New(objectstore.Config{Endpoint: s3.Endpoint, Bucket: s3.Bucket, Region: s3.Region,
		AccessKeyID: s3.AccessKeyID, SecretAccessKey: s3.SecretAccessKey})
	must(t, err)
	const maxFile = 8 << 20
	artifacts := computeapi.RunArtifactsOptions{Store: obj, Prefix: "agentbox", MaxFileBytes: maxFile}
	e, st, pool := platformEnv(t)
	api := e.computeAPIWithStore(pool, st, func(o *computeapi.Options) { o.RunArtifacts = artifacts })
	e.template("tpl", func(tpl *v1alpha1.SandboxTemplate) {
		tpl.Spec.Image = image
		tpl.Spec.IdleTimeout = metav1.Duration{Duration: time.Hour}
	})
	e.sandbox("artifacts", "tpl")
	sbx, _ := e.waitPhase("artifacts", v1alpha1.SandboxPhaseRunning, v1alpha1.ReasonRunning)
	agent := sbx.Spec.AgentID
	ctx := e.ctx

	random := func(n int) []byte {
		b := make([]byte, n)
		_, err := rand.Read(b)
		must(t, err)
		return b
	}
	digest := func(b []byte) string {
		h := sha256.Sum256(b)
		return hex.EncodeToString(h[:])
	}
	// The files go into the workspace through the API; the run copies
	// them where its artifacts are looked for.
	want := map[string][]byte{
		"artifacts/report.txt":     random(3000),
		"artifacts/data/large.bin": random(6 << 20),
	}
	over := random(maxFile + 1)
	for name, data := range map[string][]byte{"staging/report.txt": want["artifacts/report.txt"],
		"staging/large.bin": want["artifacts/data/large.bin"], "staging/over.bin": over} {
		_, err := api.PutFile(ctx, agent, name, bytes.NewReader(data), 0)
		must(t, err)
	}
	wctx, cancel := context.WithTimeout(ctx, waitTimeout)
	defer cancel()
	run, _, err := api.StartRun(ctx, apiclient.StartRunRequest{AgentID: agent, TimeoutSeconds: 120, Command: []string{"sh", "-c",
		"mkdir -p artifacts/data && cp staging/report.txt staging/over.bin artifacts/ && cp staging/large.bin artifacts/data/ && echo copied"}})
	must(t, err)
	var events []apiclient.RunEvent
	must(t, api.FollowRun(wctx, run.ID, 0, func(ev apiclient.RunEvent) error {
		events = append(events, ev)
		return nil
	}))
	end := events[len(events)-1]
	if end.Type != apiclient.RunEventEnd || end.Status != apiclient.RunSucceeded {
		t.Fatalf("the run ended %+v", end)
	}
	// Once the end is seen, the artifacts are there: their events came
	// before it.
	byPath := map[string]apiclient.RunEvent{}
	for _, ev := range events {
		if ev.Type == apiclient.RunEventArtifact {
			byPath[ev.Path] = ev
		}
	}
	l, err := api.ListRunArtifacts(ctx, run.ID)
	must(t, err)
	if l.State != apiclient.RunArtifactsCollected || len(l.Artifacts) != 3 || len(byPath) != 3 {
		t.Fatalf("artifacts %+v; events %+v", l, byPath)
	}
	for _, a := range l.Artifacts {
		ev := byPath[a.Path]
		if a.Path == "artifacts/over.bin" {
			if a.Error == "" || !strings.Contains(a.Error, "per-file limit") || a.Size != int64(len(over)) || ev.Error != a.Error {
				t.Errorf("the file past the limit: %+v, event %+v", a, ev)
			}
			continue
		}
		data := want[a.Path]
		if data == nil || a.Error != "" || a.Size != int64(len(data)) || a.SHA256 != digest(data) || ev.SHA256 != a.SHA256 || ev.Size != a.Size {
			t.Fatalf("artifact %+v (event %+v); want %d bytes, %s", a, ev, len(data), digest(data))
		}
		body, got, err := api.GetRunArtifact(ctx, run.ID, a.Path)
		must(t, err)
		b, err := io.ReadAll(body)
		_ = body.Close()
		must(t, err)
		if !bytes.Equal(b, data) || got.SHA256 != digest(data) || got.Size != int64(len(data)) {
			t.Fatalf("%s read back: %d bytes (%s), announced %+v; want %d bytes", a.Path, len(b), digest(b), got, len(data))
		}
	}

	// The CLI lists them and downloads one, checked against its digest.
	cli := goBuild(t, "../cmd/agentbox", "agentbox")
	env := e.cliEnv(api.Endpoint(), api.Token())
	var out, errOut bytes.Buffer
	cmd := exec.CommandContext(ctx, cli, "runs", "artifacts", run.ID)
	cmd.Env, cmd.Stdout, cmd.Stderr = env, &out, &errOut
	if err := cmd.Run(); err != nil {
		t.Fatalf("agentbox runs artifacts: %v\n%s", err, errOut.String())
	}
	for path, data := range want {
		if !strings.Contains(out.String(), path) || !strings.Contains(out.String(), digest(data)) {
			t.Errorf("agentbox runs artifacts does not list %s with its digest:\n%s", path, out.String())
		}
	}
	if !strings.Contains(out.String(), "per-file limit") {
		t.Errorf("agentbox runs artifacts does not say why over.bin was not kept:\n%s", out.String())
	}
	dst := filepath.Join(t.TempDir(), "large.bin")
	errOut.Reset()
	cmd = exec.CommandContext(ctx, cli, "runs", "artifacts", run.ID, "--get", "artifacts/data/large.bin", "-o", dst)
	cmd.Env, cmd.Stderr = env, &errOut
	if err := cmd.Run(); err != nil {
		t.Fatalf("agentbox runs artifacts --get: %v\n%s", err, errOut.String())
	}
	if b, err := os.ReadFile(dst); err != nil || !bytes.Equal(b, want["artifacts/data/large.bin"]) {
		t.Fatalf("the CLI downloaded %d bytes (%v), want the %d written", len(b), err, len(want["artifacts/data/large.bin"]))
	}

	// Globs: what they name, and nothing under the default path.
	res, err := api.RunCommand(ctx, agent, apiclient.RunCommandRequest{Command: []string{"sh", "-c",
		"mkdir -p out/deep && echo '{\"a\":1}' > out/one.json && echo skip > out/two.txt && echo '{}' > out/deep/three.json"}})
	if err != nil || res.ExitCode != 0 {
		t.Fatalf("prepare the globbed files: %+v, %v", res, err)
	}
	globbed, _, err := api.StartRun(ctx, apiclient.StartRunRequest{AgentID: agent, Command: []string{"true"},
		Artifacts: []string{"/workspace/out/*.json", "out/*/*.json"}})
	must(t, err)
	if r, err := api.WaitRun(wctx, globbed.ID, 200*time.Millisecond); err != nil || r.Status != apiclient.RunSucceeded {
		t.Fatalf("globbed run: %+v, %v", r, err)
	}
	gl, err := api.ListRunArtifacts(ctx, globbed.ID)
	must(t, err)
	var paths []string
	for _, a := range gl.Artifacts {
		paths = append(paths, a.Path)
	}
	if strings.Join(paths, ",") != "out/deep/three.json,out/one.json" {
		t.Fatalf("globbed artifacts %v", paths)
	}

	objects := func() (int, int64) {
		n, size := 0, int64(0)
		must(t, obj.List(ctx, "agentbox/_runs/", func(i objectstore.Info) error {
			n++
			size += i.Size
			return nil
		}))
		return n, size
	}
	n, size := objects()
	if n != 4 || size != int64(len(want["artifacts/report.txt"])+len(want["artifacts/data/large.bin"])+len(`{"a":1}`)+1+len(`{}`)+1) {
		t.Fatalf("the bucket holds %d objects of %d bytes under the runs' prefix", n, size)
	}

	// Retention: another replica sweeping with a short retention deletes
	// the objects and then the records.
	deleted, deletedBytes := counter(t, "agentbox_run_artifacts_deleted_total"), counter(t, "agentbox_run_artifacts_deleted_bytes_total")
	time.Sleep(10 * time.Millisecond)
	e.computeAPIWithStore(pool, st, func(o *computeapi.Options) {
		o.RunArtifacts = artifacts
		o.RunRetention = time.Millisecond
		o.RunSweepInterval = 50 * time.Millisecond
	})
	for deadline := time.Now().Add(waitTimeout); ; time.Sleep(100 * time.Millisecond) {
		_, err1 := st.GetRun(ctx, run.ID)
		_, err2 := st.GetRun(ctx, globbed.ID)
		if err1 != nil && err2 != nil {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("the runs outlived their retention: %v, %v", err1, err2)
		}
	}
	if n, _ := objects(); n != 0 {
		t.Fatalf("%d objects left in the bucket after retention", n)
	}
	if got := counter(t, "agentbox_run_artifacts_deleted_total") - deleted; got != 4 {
		t.Errorf("agentbox_run_artifacts_deleted_total grew by %v, want 4", got)
	}
	if got := counter(t, "agentbox_run_artifacts_deleted_bytes_total") - deletedBytes; got != float64(size) {
		t.Errorf("agentbox_run_artifacts_deleted_bytes_total grew by %v, want %d", got, size)
	}
	t.Logf("run %s kept %d bytes in %d objects; retention deleted them", run.ID, size, n)
}

// counter is the value of a counter in the controller-runtime registry,
// where the control plane's metrics are served from.
func counter(t *testing.T, name string) float64 {
	t.Helper()
	families, err := metrics.Registry.Gather()
	must(t, err)
	for _, f := range families {
		if f.GetName() == name {
			total := 0.0
			for _, m := range f.GetMetric() {
				total += m.GetCounter().GetValue()
			}
			return total
		}
	}
	t.Fatalf("no metric %s", name)
	return 0
}
