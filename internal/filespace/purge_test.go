package filespace_test

import (
	"context"
	"testing"
	"time"

	"github.com/go-logr/logr/testr"

	"github.com/agentbox/terraform-provider-agentbox/internal/filespace"
)

// TestBlobPurger: after a file is rewritten and another deleted, their old
// contents go once they are older than a sync can be, and what the
// filespace names still pulls whole.
func TestBlobPurger(t *testing.T) {
	st := openStore(t)
	a, b := newSandbox(t, 0), newSandbox(t, 0)
	t0 := time.Now().Add(-time.Hour)
	a.write(t, "kept.txt", "version 1", t0)
	a.write(t, "gone.txt", "deleted later", t0)
	syncAt(t, a, st, filespace.Push, t0)
	a.write(t, "kept.txt", "version 2", t0.Add(time.Minute))
	a.remove(t, "gone.txt")
	if sum := syncAt(t, a, st, filespace.Push, t0.Add(2*time.Minute)); sum.Pushed != 1 || sum.Deleted != 1 {
		t.Fatalf("second push: %+v", sum)
	}

	ctx := context.Background()
	p := filespace.BlobPurger{Store: st, Log: testr.New(t)}
	if n, err := p.PurgeOnce(ctx); err != nil || n != 0 {
		t.Fatalf("a purge right after the pushes removed %d blobs (%v); a push in flight may still name them", n, err)
	}
	p.Now = func() time.Time { return time.Now().Add(filespace.Timeout + time.Minute) }
	if n, err := p.PurgeOnce(ctx); err != nil || n != 2 {
		t.Fatalf("purge removed %d blobs (%v), want the 2 old contents", n, err)
	}
	syncAt(t, b, st, filespace.Pull, t0.Add(3*time.Minute))
	if got := b.read(t, "kept.txt"); got != "version 2" {
		t.Errorf("kept.txt pulled after the purge as %q", got)
	}
	if got := b.read(t, "gone.txt"); got != "<absent>" {
		t.Errorf("gone.txt pulled after the purge as %q", got)
	}
}
