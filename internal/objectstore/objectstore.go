// Package objectstore is the platform's small object store: put, get, stat,
// list and delete of whole objects, in an S3-compatible bucket (minio-go)
// or in a directory on a volume of the control plane (the chart's
// "embedded store", which needs nothing outside the cluster). The archive
// snapshot driver keeps workspace archives in it, and the Compute API a
// run's artifacts, under keys of their own in the same store.
//
// Every implementation guarantees two things the callers rest on: an
// object is visible only once it is whole (a put either completes or
// leaves nothing a reader can see), and it carries the metadata it was
// written with.
package objectstore

import (
	"context"
	"errors"
	"io"
	"strings"
	"time"
)

// Kinds of store, as Store.Kind reports them.
const (
	// KindS3 is an S3-compatible bucket (Config.Endpoint).
	KindS3 = "s3"
	// KindEmbedded is a directory on a volume of the control plane
	// (Config.Dir).
	KindEmbedded = "embedded"
)

// Store holds whole objects under slash-separated keys.
type Store interface {
	// Kind is KindS3 or KindEmbedded.
	Kind() string
	// Location names key in messages: s3://bucket/key, or the file.
	Location(key string) string
	// Put writes everything r yields, to its end, as key. size is how
	// many bytes r yields, or -1 when unknown; with a size, a reader that
	// ends early fails the put. The object becomes visible, whole, only
	// when Put returns nil; a put that fails or whose context ends leaves
	// it as it was.
	Put(ctx context.Context, key string, r io.Reader, size int64, o PutOptions) error
	// Stat describes key, or returns ErrNotFound.
	Stat(ctx context.Context, key string) (Info, error)
	// Get opens the object info describes; it fails, rather than read
	// another, if key was replaced since the Stat.
	Get(ctx context.Context, key string, info Info) (io.ReadCloser, error)
	// Remove deletes key; a key that does not exist is not an error.
	Remove(ctx context.Context, key string) error
	// RemoveIncomplete discards what interrupted puts of key left behind
	// (S3 multipart uploads, temporary files). They are invisible to
	// readers; this only frees their space.
	RemoveIncomplete(ctx context.Context, key string) error
	// List calls fn with each object whose key starts with prefix, in no
	// promised order, and stops at fn's first error, which it returns.
	// Only Key, Size and ModTime are filled in.
	List(ctx context.Context, prefix string, fn func(Info) error) error
	// Check verifies that the store can be written to.
	Check(ctx context.Context) error
}

// PutOptions are the object's attributes.
type PutOptions struct {
	// Meta is the object's metadata (x-amz-meta-<key> in S3).
	Meta map[string]string
	// ContentType of the object; S3 only.
	ContentType string
	// PartSize is the multipart part size of an upload whose size is
	// unknown or larger than it: each upload in flight holds one part in
	// memory. 0 means the store's (Config.PartSize). S3 only.
	PartSize int64
}

// Info describes a stored object.
type Info struct {
	Key     string
	Size    int64
	ModTime time.Time
	Meta    map[string]string
	// Version identifies this write of the object (an ETag, a file's
	// identity), so that Get reads what Stat saw.
	Version string
}

// ErrNotFound is Stat's answer for a key that holds no object.
var ErrNotFound = errors.New("object not found")

// MetaValue returns the value of metadata key in m, whatever the case of
// its name and whether S3 returned it with its x-amz-meta- prefix.
func MetaValue(m map[string]string, key string) string {
	for k, v := range m {
		if strings.EqualFold(k, key) || strings.EqualFold(k, "X-Amz-Meta-"+key) {
			return v
		}
	}
	return ""
}
