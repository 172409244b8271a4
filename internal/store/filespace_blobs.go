package store

import (
	"context"
	"crypto/sha256"
	"database/sql"
	"encoding/hex"
	"errors"
	"fmt"
	"hash"
	"io"
	"time"
)

// The contents of filespace files, content-addressed by SHA-256. They live
// in the database rather than on a replica's disk so that every replica of
// the control plane serves the same filespace; a FileNode's SHA256 names
// its blob. A blob is stored in chunks so that neither side ever holds a
// whole file (as large as a workspace) in memory, and each chunk is
// its own short write, so that a large upload does not hold SQLite's
// single write lock (and with it every audited call) for its duration.

// BlobChunkSize is the size of a stored chunk; the last one may be shorter.
const BlobChunkSize = 1 << 20

// ErrDigestMismatch means a blob's bytes did not hash to the digest the
// caller named: the file changed while it was read, or the data is corrupt.
var ErrDigestMismatch = errors.New("store: content does not match its sha256")

// BlobInfo describes a stored blob.
type BlobInfo struct {
	SHA256    string
	SizeBytes int64
	// Existed is set by PutBlob when the blob was already stored and the
	// reader was not consumed.
	Existed bool
}

// checkDigest accepts a lower-case hex SHA-256, the form FileNode uses.
func checkDigest(sum string) error {
	if len(sum) != sha256.Size*2 {
		return fmt.Errorf("%w: sha256 %q is not 64 hex digits", ErrInvalid, sum)
	}
	for _, c := range []byte(sum) {
		if !('0' <= c && c <= '9' || 'a' <= c && c <= 'f') {
			return fmt.Errorf("%w: sha256 %q is not lower-case hex", ErrInvalid, sum)
		}
	}
	return nil
}

// BlobExists reports whether the blob with digest sum is stored whole.
func (s *Store) BlobExists(ctx context.Context, sum string) (BlobInfo, bool, error) {
	if err := checkDigest(sum); err != nil {
		return BlobInfo{}, false, err
	}
	info := BlobInfo{SHA256: sum}
	err := s.db.QueryRowContext(ctx, `SELECT size_bytes FROM filespace_blobs WHERE sha256 = $1`, sum).Scan(&info.SizeBytes)
	if errors.Is(err, sql.ErrNoRows) {
		return BlobInfo{}, false, nil
	}
	if err != nil {
		return BlobInfo{}, false, fmt.Errorf("look up blob: %w", err)
	}
	return info, true, nil
}

// PutBlob stores the content r yields under its digest sum. If the blob is
// already stored, r is not read and Existed is set. If the bytes do not
// hash to sum, nothing is stored and the error is ErrDigestMismatch; if the
// store has no room for them (see BlobRoom), nothing is stored and the
// error is ErrStoreFull.
// Concurrent puts of the same content are safe: one wins, the others'
// chunks are removed.
func (s *Store) PutBlob(ctx context.Context, sum string, r io.Reader) (BlobInfo, error) {
	info, ok, err := s.BlobExists(ctx, sum)
	if err != nil {
		return BlobInfo{}, err
	}
	if ok {
		info.Existed = true
		return info, nil
	}
	upload := newID()
	created := s.now()
	h := sha256.New()
	buf := make([]byte, BlobChunkSize)
	var size int64
	var chunks int
	fail := func(err error) (BlobInfo, error) {
		// Best effort: chunks left behind are removed by PurgeBlobs.
		cctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), 30*time.Second)
		defer cancel()
		_, _ = s.wdb.ExecContext(cctx, `DELETE FROM filespace_blob_chunks WHERE upload_id = $1`, upload)
		return BlobInfo{}, err
	}
	for {
		n, rerr := io.ReadFull(r, buf)
		if n > 0 {
			h.Write(buf[:n])
			// Measured before every chunk: other uploads and the audit log
			// take room meanwhile, and the caller's estimate may be stale.
			if err := s.ensureRoom(ctx, int64(n)); err != nil {
				return fail(fmt.Errorf("store blob chunk %d after %d bytes: %w", chunks, size, err))
			}
			if _, err := s.wdb.ExecContext(ctx, `INSERT INTO filespace_blob_chunks (upload_id, seq, data, created_at)
				VALUES ($1, $2, $3, $4)`, upload, chunks, buf[:n], created); err != nil {
				if sqliteFull(err) {
					err = fmt.Errorf("%w: %w", ErrStoreFull, err)
				}
				return fail(fmt.Errorf("store blob chunk %d: %w", chunks, err))
			}
			chunks++
			size += int64(n)
		}
		if errors.Is(rerr, io.EOF) || errors.Is(rerr, io.ErrUnexpectedEOF) {
			break
		}
		if rerr != nil {
			return fail(fmt.Errorf("read blob content: %w", rerr))
		}
	}
	if got := hex.EncodeToString(h.Sum(nil)); got != sum {
		return fail(fmt.Errorf("%w: expected %s, got %s (%d bytes)", ErrDigestMismatch, sum, got, size))
	}
	res, err := s.wdb.ExecContext(ctx, `INSERT INTO filespace_blobs (sha256, upload_id, size_bytes, chunks, created_at)
		VALUES ($1, $2, $3, $4, $5) ON CONFLICT (sha256) DO NOTHING`, sum, upload, size, chunks, created)
	if err != nil {
		return fail(fmt.Errorf("store blob: %w", err))
	}
	if n, err := res.RowsAffected(); err != nil {
		return fail(fmt.Errorf("store blob: %w", err))
	} else if n == 0 {
		// Another put of the same content finished first; its chunks are
		// the ones the blob names.
		_, _ = fail(nil)
		return BlobInfo{SHA256: sum, SizeBytes: size, Existed: true}, nil
	}
	return BlobInfo{SHA256: sum, SizeBytes: size}, nil
}

// OpenBlob returns a reader of the blob with digest sum, which fetches one
// chunk at a time, and the blob's size. The reader checks the digest at
// the end and fails with ErrDigestMismatch instead of io.EOF if the stored
// bytes were altered. A missing blob is ErrNotFound.
func (s *Store) OpenBlob(ctx context.Context, sum string) (io.ReadCloser, int64, error) {
	if err := checkDigest(sum); err != nil {
		return nil, 0, err
	}
	br := &blobReader{ctx: ctx, s: s, sum: sum, h: sha256.New()}
	err := s.db.QueryRowContext(ctx, `SELECT upload_id, size_bytes, chunks FROM filespace_blobs WHERE sha256 = $1`, sum).
		Scan(&br.upload, &br.size, &br.chunks)
	if errors.Is(err, sql.ErrNoRows) {
		return nil, 0, ErrNotFound
	}
	if err != nil {
		return nil, 0, fmt.Errorf("open blob: %w", err)
	}
	return br, br.size, nil
}

type blobReader struct {
	ctx    context.Context
	s      *Store
	sum    string
	upload string
	size   int64
	chunks int
	next   int
	buf    []byte
	h      hash.Hash
	err    error
}

func (b *blobReader) Read(p []byte) (int, error) {
	for len(b.buf) == 0 {
		if b.err != nil {
			return 0, b.err
		}
		if b.next == b.chunks {
			if got := hex.EncodeToString(b.h.Sum(nil)); got != b.sum {
				b.err = fmt.Errorf("%w: blob %s reads back as %s", ErrDigestMismatch, b.sum, got)
			} else {
				b.err = io.EOF
			}
			continue
		}
		var data []byte
		err := b.s.db.QueryRowContext(b.ctx, `SELECT data FROM filespace_blob_chunks WHERE upload_id = $1 AND seq = $2`,
			b.upload, b.next).Scan(&data)
		if errors.Is(err, sql.ErrNoRows) {
			b.err = fmt.Errorf("read blob %s: chunk %d of %d is missing", b.sum, b.next, b.chunks)
			continue
		}
		if err != nil {
			b.err = fmt.Errorf("read blob %s chunk %d: %w", b.sum, b.next, err)
			continue
		}
		b.h.Write(data)
		b.buf = data
		b.next++
	}
	n := copy(p, b.buf)
	b.buf = b.buf[n:]
	return n, nil
}

func (b *blobReader) Close() error {
	b.buf, b.err = nil, errors.New("read blob: reader closed")
	return nil
}

// PurgeBlobs removes the blobs no live filespace file names, and chunks of
// uploads that never completed, created before before; it returns how many
// blobs it removed. before must leave time for a sync in flight, which
// stores a blob before the file that names it.
func (s *Store) PurgeBlobs(ctx context.Context, before time.Time) (int64, error) {
	cutoff := dbTime(before)
	var removed int64
	err := s.writeTx(ctx, func(tx *sql.Tx) error {
		res, err := tx.ExecContext(ctx, `DELETE FROM filespace_blobs WHERE created_at < $1
			AND sha256 NOT IN (SELECT sha256 FROM filespace_nodes WHERE NOT deleted)`, cutoff)
		if err != nil {
			return fmt.Errorf("purge blobs: %w", err)
		}
		if removed, err = res.RowsAffected(); err != nil {
			return fmt.Errorf("purge blobs: %w", err)
		}
		if _, err := tx.ExecContext(ctx, `DELETE FROM filespace_blob_chunks WHERE created_at < $1
			AND upload_id NOT IN (SELECT upload_id FROM filespace_blobs)`, cutoff); err != nil {
			return fmt.Errorf("purge blob chunks: %w", err)
		}
		return nil
	})
	if err != nil {
		return 0, err
	}
	return removed, nil
}
