package main

import (
	"context"
	"crypto/sha256"
	"encoding/hex"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/agentbox/terraform-provider-agentbox/internal/computeapi"
	"github.com/agentbox/terraform-provider-agentbox/internal/computeapi/apitest"
	"github.com/agentbox/terraform-provider-agentbox/internal/objectstore"
	"github.com/agentbox/terraform-provider-agentbox/internal/store"
)

// runs start --artifact names what a run keeps; runs artifacts lists it
// and --get downloads it, to stdout or a file, checked against its
// digest, against the real Compute API, store and supervisor, with a
// directory as the object store.
func TestRunsArtifactsCommand(t *testing.T) {
	st, err := store.OpenSQLite(context.Background(), filepath.Join(t.TempDir(), "agentbox.db"), store.Options{})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { st.Close() })
	obj, err := objectstore.New(objectstore.Config{Dir: t.TempDir()})
	if err != nil {
		t.Fatal(err)
	}
	s, env := realAgentAPI(t, apitest.Options{Store: st, RunArtifacts: computeapi.RunArtifactsOptions{Store: obj, MaxFileBytes: 1000}})
	a := s.AgentID
	r := runCLI(t, env, "", "runs", "start", "--wait", "--poll", "20ms", "--artifact", "out/*.txt", a, "--",
		"sh", "-c", "mkdir -p out && printf 'kept content' > out/a.txt && head -c 2000 /dev/zero > out/big.txt")
	id := strings.TrimSpace(r.stdout)
	if r.code != 0 || !strings.HasPrefix(id, "run-") {
		t.Fatalf("runs start: code %d, stdout %q, stderr %q", r.code, r.stdout, r.stderr)
	}
	sum := sha256.Sum256([]byte("kept content"))
	digest := hex.EncodeToString(sum[:])
	r = runCLI(t, env, "", "runs", "artifacts", id)
	if r.code != 0 || !strings.Contains(r.stdout, "out/a.txt") || !strings.Contains(r.stdout, digest) ||
		!strings.Contains(r.stdout, "out/big.txt") || !strings.Contains(r.stdout, "per-file limit") {
		t.Fatalf("runs artifacts: code %d, stdout %q, stderr %q", r.code, r.stdout, r.stderr)
	}
	if r = runCLI(t, env, "", "runs", "artifacts", id, "--get", "out/a.txt"); r.code != 0 || r.stdout != "kept content" {
		t.Errorf("runs artifacts --get: code %d, stdout %q, stderr %q", r.code, r.stdout, r.stderr)
	}
	dst := filepath.Join(t.TempDir(), "a.txt")
	if r = runCLI(t, env, "", "runs", "artifacts", "--get", "out/a.txt", "-o", dst, id); r.code != 0 {
		t.Errorf("runs artifacts --get -o: code %d, stderr %q", r.code, r.stderr)
	}
	if b, err := os.ReadFile(dst); err != nil || string(b) != "kept content" {
		t.Errorf("downloaded %q, %v", b, err)
	}
	if r = runCLI(t, env, "", "runs", "artifacts", id, "--get", "out/big.txt", "-o", filepath.Join(t.TempDir(), "big")); r.code != exitAPIError ||
		!strings.Contains(r.stderr, "per-file limit") {
		t.Errorf("runs artifacts --get of a file not kept: code %d, stderr %q", r.code, r.stderr)
	}
	for _, args := range [][]string{{"runs", "artifacts"}, {"runs", "artifacts", "-o", "x", id}, {"runs", "artifacts", "--json", "--get", "x", id}} {
		if r := runCLI(t, env, "", args...); r.code != exitUsage {
			t.Errorf("%v: code %d, want %d (stderr %q)", args, r.code, exitUsage, r.stderr)
		}
	}
}
