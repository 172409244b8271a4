package filespace

import (
	"context"
	"fmt"
	"time"

	"github.com/go-logr/logr"

	"github.com/agentbox/terraform-provider-agentbox/internal/store"
)

// DefaultPurgeInterval is how often BlobPurger looks for blobs no file
// names any more: a changed or deleted file leaves its old content behind
// until then.
const DefaultPurgeInterval = time.Hour

// BlobPurger removes the contents that no filespace file names any more,
// so that a workspace that keeps rewriting files does not grow the store
// without bound. It is a controller-runtime Runnable that only the leader
// runs: the purge is one statement, and two replicas would only repeat
// it.
type BlobPurger struct {
	Store *store.Store
	// Interval defaults to DefaultPurgeInterval.
	Interval time.Duration
	// Now defaults to time.Now.
	Now func() time.Time
	Log logr.Logger
}

// Start purges every Interval until ctx ends.
func (p BlobPurger) Start(ctx context.Context) error {
	interval := p.Interval
	if interval <= 0 {
		interval = DefaultPurgeInterval
	}
	tick := time.NewTicker(interval)
	defer tick.Stop()
	for {
		select {
		case <-ctx.Done():
			return nil
		case <-tick.C:
		}
		n, err := p.PurgeOnce(ctx)
		if err != nil {
			// The next round tries again; nothing is lost by waiting.
			p.Log.Error(err, "purge filespace blobs")
			continue
		}
		if n > 0 {
			p.Log.Info("purged filespace blobs no file names", "blobs", n)
		}
	}
}

// NeedLeaderElection makes the purge the leader's alone.
func (p BlobPurger) NeedLeaderElection() bool { return true }

// PurgeOnce removes the unnamed blobs stored more than Timeout ago: a push
// stores a file's blob before the file that names it, and a push lasts at
// most Timeout, so a younger blob may be one a push in flight is about to
// name.
func (p BlobPurger) PurgeOnce(ctx context.Context) (int64, error) {
	now := time.Now
	if p.Now != nil {
		now = p.Now
	}
	n, err := p.Store.PurgeBlobs(ctx, now().Add(-Timeout))
	if err != nil {
		return 0, fmt.Errorf("filespace: %w", err)
	}
	return n, nil
}
