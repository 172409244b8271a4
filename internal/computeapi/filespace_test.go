package computeapi

import (
	"bytes"
	"context"
	"crypto/rand"
	"crypto/sha256"
	"encoding/hex"
	"io"
	"net/http"
	"testing"
	"time"

	api "github.com/agentbox/terraform-provider-agentbox/internal/computeapi/client"
	"github.com/agentbox/terraform-provider-agentbox/internal/filespace"
	"github.com/agentbox/terraform-provider-agentbox/internal/store"
)

// TestSyncFilespaceThroughTheAPI pushes a file written through the API
// into the filespace, and pulls it back byte for byte once the workspace
// has lost it, against the real supervisor and store.
func TestSyncFilespaceThroughTheAPI(t *testing.T) {
	st := tempStore(t)
	clients := realSupervisorAPI(t, st, nil)
	c := clients(adminToken)
	ctx := context.Background()
	blob := make([]byte, 2<<20+123)
	if _, err := rand.Read(blob); err != nil {
		t.Fatal(err)
	}
	if _, err := c.PutFile(ctx, "agent-1", "data/blob.bin", bytes.NewReader(blob), 0); err != nil {
		t.Fatal(err)
	}

	sum, err := c.SyncFilespace(ctx, "agent-1", api.SyncPush)
	if err != nil {
		t.Fatal(err)
	}
	t.Logf("push: %+v", *sum)
	if sum.Direction != api.SyncPush || sum.Pushed != 1 || sum.Bytes != int64(len(blob)) || sum.SyncedAt.IsZero() {
		t.Fatalf("push summary %+v", sum)
	}
	n, err := st.GetFile(ctx, "agent-1", "data/blob.bin")
	if err != nil || n.SizeBytes != int64(len(blob)) || n.Deleted {
		t.Fatalf("filespace node %+v, %v", n, err)
	}

	// The agent deletes the file: that deletion is newer than the
	// filespace's copy, so a pull leaves it deleted.
	if err := c.DeleteFile(ctx, "agent-1", "data/blob.bin", false); err != nil {
		t.Fatal(err)
	}
	sum, err = c.SyncFilespace(ctx, "agent-1", api.SyncPull)
	if err != nil {
		t.Fatal(err)
	}
	t.Logf("pull after a deletion: %+v", *sum)
	if sum.Pulled != 0 || sum.Skipped != 1 {
		t.Fatalf("a pull undid a newer deletion: %+v", sum)
	}
	_, err = c.GetFile(ctx, "agent-1", "data/blob.bin")
	wantAPIError(t, err, api.CodeFileNotFound, http.StatusNotFound)

	// A workspace that lost everything, its sync baseline included (a
	// fresh volume), gets the file back from the filespace.
	if err := c.DeleteFile(ctx, "agent-1", filespace.StatePath, false); err != nil {
		t.Fatal(err)
	}
	sum, err = c.SyncFilespace(ctx, "agent-1", api.SyncPull)
	if err != nil {
		t.Fatal(err)
	}
	t.Logf("pull into a fresh workspace: %+v", *sum)
	if sum.Pulled != 1 || sum.Bytes != int64(len(blob)) {
		t.Fatalf("pull summary %+v", sum)
	}
	body, err := c.GetFile(ctx, "agent-1", "data/blob.bin")
	if err != nil {
		t.Fatal(err)
	}
	got, err := io.ReadAll(body)
	body.Close()
	if err != nil || !bytes.Equal(got, blob) {
		t.Fatalf("pulled file: %d bytes (want %d), equal=%v, %v", len(got), len(blob), bytes.Equal(got, blob), err)
	}

	// Pushing the deletion now tombstones the node.
	if err := c.DeleteFile(ctx, "agent-1", "data/blob.bin", false); err != nil {
		t.Fatal(err)
	}
	if sum, err = c.SyncFilespace(ctx, "agent-1", api.SyncPush); err != nil || sum.Deleted != 1 {
		t.Fatalf("push of the deletion: %+v, %v", sum, err)
	}
	if n, err := st.GetFile(ctx, "agent-1", "data/blob.bin"); err != nil || !n.Deleted {
		t.Fatalf("node after the deletion: %+v, %v", n, err)
	}

	// Bad requests and scope.
	_, err = c.SyncFilespace(ctx, "agent-1", "sideways")
	wantAPIError(t, err, api.CodeInvalidArgument, http.StatusBadRequest)
	_, err = clients("agent-token:agent-2").SyncFilespace(ctx, "agent-1", api.SyncPush)
	wantAPIError(t, err, api.CodePermissionDenied, http.StatusForbidden)
	_, err = c.SyncFilespace(ctx, "agent-404", api.SyncPush)
	wantAPIError(t, err, api.CodeSandboxNotFound, http.StatusNotFound)

	// Every call is audited under its operation.
	deadline := time.Now().Add(10 * time.Second)
	for {
		page, err := st.QueryAudit(ctx, store.AuditQuery{Operation: "sync_filespace"})
		if err != nil {
			t.Fatal(err)
		}
		if len(page.Records) >= 7 {
			t.Logf("%d sync_filespace audit records", len(page.Records))
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("%d sync_filespace audit records, want 7", len(page.Records))
		}
		time.Sleep(20 * time.Millisecond)
	}
}

// TestPushAfterCalls checks the push after each tool call: a burst
// of writes through the API reaches the filespace once it is quiet,
// without any sync_filespace call, and a read does not schedule a push.
func TestPushAfterCalls(t *testing.T) {
	st := tempStore(t)
	c := realSupervisorAPIWith(t, apiSetup{store: st, pushDelay: 100 * time.Millisecond})(adminToken)
	ctx := context.Background()
	for i := range 5 {
		if _, err := c.PutFile(ctx, "agent-1", "notes/n.txt", bytes.NewReader([]byte{byte('0' + i)}), 0); err != nil {
			t.Fatal(err)
		}
	}
	if _, err := c.RunCommand(ctx, "agent-1", api.RunCommandRequest{Command: []string{"sh", "-c", "echo made > made.txt"}}); err != nil {
		t.Fatal(err)
	}
	deadline := time.Now().Add(10 * time.Second)
	for {
		n, err1 := st.GetFile(ctx, "agent-1", "notes/n.txt")
		m, err2 := st.GetFile(ctx, "agent-1", "made.txt")
		if err1 == nil && err2 == nil && n.SizeBytes == 1 && m.SizeBytes == int64(len("made\n")) {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("the writes did not reach the filespace: %+v (%v), %+v (%v)", n, err1, m, err2)
		}
		time.Sleep(20 * time.Millisecond)
	}
	n, err := st.GetFile(ctx, "agent-1", "notes/n.txt")
	if sum := sha256.Sum256([]byte("4")); err != nil || n.SHA256 != hex.EncodeToString(sum[:]) {
		t.Errorf("the filespace holds %+v (%v), want the last write", n, err)
	}
}

// A run changes the workspace as run_command does, and its end schedules
// the push into the agent's filespace.
func TestPushAfterRun(t *testing.T) {
	st := tempStore(t)
	c := realSupervisorAPIWith(t, apiSetup{store: st, pushDelay: 100 * time.Millisecond})(adminToken)
	ctx := context.Background()
	run, _, err := c.StartRun(ctx, api.StartRunRequest{AgentID: "agent-1", Command: []string{"sh", "-c", "echo by-run > by-run.txt"}})
	if err != nil {
		t.Fatal(err)
	}
	deadline := time.Now().Add(10 * time.Second)
	for {
		f, err := st.GetFile(ctx, "agent-1", "by-run.txt")
		if err == nil && f.SizeBytes == int64(len("by-run\n")) {
			break
		}
		if time.Now().After(deadline) {
			got, _ := c.GetRun(ctx, run.ID)
			t.Fatalf("the run's file did not reach the filespace: %+v (%v); run %+v", f, err, got)
		}
		time.Sleep(20 * time.Millisecond)
	}
}

// TestSyncFilespaceWithoutStore answers unavailable: the filespace lives
// in the store.
func TestSyncFilespaceWithoutStore(t *testing.T) {
	c := realSupervisorAPI(t, nil, nil)(adminToken)
	_, err := c.SyncFilespace(context.Background(), "agent-1", api.SyncPush)
	wantAPIError(t, err, api.CodeUnavailable, http.StatusServiceUnavailable)
}
