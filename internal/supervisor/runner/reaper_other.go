//go:build !linux

package runner

import (
	"context"
	"errors"
	"log/slog"
)

// StartReaper is only implemented on Linux, the only system sandboxes run on.
func StartReaper(ctx context.Context, log *slog.Logger) error {
	return errors.New("reaping orphans is only supported on Linux")
}
