package store

import (
	"context"
	"errors"
	"fmt"

	"github.com/dustin/go-humanize"
)

// Room for filespace contents. A SQLite store shares one volume between
// the filespace contents, which come in gigabytes (a copy of every agent's
// workspace), and the audit log, sessions and tokens that every call
// writes. Contents that filled the volume would fail those writes too, and
// SQLite never gives the space of deleted rows back to the file system, so
// the store would stay full. So contents are refused while storing them
// would leave less than a reserve free. PostgreSQL's room is its
// operator's to watch: there the store does not measure it.

// Reserve kept free on a SQLite store's volume for everything but
// filespace contents: a twentieth of the volume, and at least
// minBlobReserve.
const (
	minBlobReserve      = 64 << 20
	blobReserveFraction = 20
)

// errUnmeasured is VolumeSpace's answer on a system where it cannot
// measure: the room is then unknown, not zero.
var errUnmeasured = errors.New("the volume's free space is not measured on this system")

// Room says how much more filespace content the store takes now.
type Room struct {
	// Known is false where the store does not measure its room
	// (PostgreSQL); the other fields are zero then.
	Known bool
	// Bytes of content the store takes before it reaches its reserve; 0
	// or more.
	Bytes int64
	// Free is what the volume has free, with the database's own free
	// pages, which SQLite reuses before it grows the file.
	Free int64
	// Reserve is what is kept free for the rest of the store.
	Reserve int64
	// VolumeBytes is the size of the volume.
	VolumeBytes int64
}

// String describes the room for error messages.
func (r Room) String() string {
	return fmt.Sprintf("%s free on the store's %s volume, %s of which it keeps for its audit log and the rest",
		humanize.IBytes(uint64(r.Free)), humanize.IBytes(uint64(r.VolumeBytes)), humanize.IBytes(uint64(r.Reserve)))
}

// BlobRoom measures the room for filespace contents.
func (s *Store) BlobRoom(ctx context.Context) (Room, error) {
	if s.dir == "" {
		return Room{}, nil
	}
	free, size, err := s.opts.VolumeSpace(s.dir)
	if errors.Is(err, errUnmeasured) {
		return Room{}, nil
	}
	if err != nil {
		return Room{}, fmt.Errorf("measure the store's volume: %w", err)
	}
	var pages, pageSize int64
	if err := s.db.QueryRowContext(ctx, `PRAGMA freelist_count`).Scan(&pages); err != nil {
		return Room{}, fmt.Errorf("count the store's free pages: %w", err)
	}
	if err := s.db.QueryRowContext(ctx, `PRAGMA page_size`).Scan(&pageSize); err != nil {
		return Room{}, fmt.Errorf("read the store's page size: %w", err)
	}
	r := Room{Known: true, Free: free + pages*pageSize, VolumeBytes: size, Reserve: max(minBlobReserve, size/blobReserveFraction)}
	r.Bytes = max(r.Free-r.Reserve, 0)
	return r, nil
}

// ensureRoom fails with ErrStoreFull unless n more bytes of content fit.
func (s *Store) ensureRoom(ctx context.Context, n int64) error {
	r, err := s.BlobRoom(ctx)
	if err != nil {
		return err
	}
	if r.Known && r.Bytes < n {
		return fmt.Errorf("%w: %s", ErrStoreFull, r)
	}
	return nil
}

// sqliteFull reports SQLITE_FULL: the database or its disk is full.
func sqliteFull(err error) bool {
	var coded interface{ Code() int }
	return errors.As(err, &coded) && coded.Code()&0xff == 13
}
