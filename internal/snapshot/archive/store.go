package archive

import (
	"context"
	"errors"
	"io"
	"strings"
	"time"
)

// Kinds of object store, as Driver.Store reports them.
const (
	// StoreS3 is an S3-compatible bucket (Config.Endpoint).
	StoreS3 = "s3"
	// StoreEmbedded is a directory on a volume of the control plane
	// (Config.Dir): the chart's default, which needs nothing outside the
	// cluster.
	StoreEmbedded = "embedded"
)

// objectStore is where the archives live. The driver's guarantees rest on
// two properties every implementation has: an object is visible only once
// it is whole (put either completes or leaves nothing a reader can see),
// and it carries the metadata it was written with.
type objectStore interface {
	// kind is StoreS3 or StoreEmbedded.
	kind() string
	// location names key in messages: s3://bucket/key, or the file.
	location(key string) string
	// put writes everything r yields, to its end, as key with meta. The
	// object becomes visible, whole, only when put returns nil; a put that
	// fails or whose context ends leaves it as it was.
	put(ctx context.Context, key string, r io.Reader, meta map[string]string, contentType string, partSize int64) error
	// stat describes key, or returns errObjectNotFound.
	stat(ctx context.Context, key string) (objectInfo, error)
	// get opens the object info describes; it fails, rather than read
	// another, if key was replaced since the stat.
	get(ctx context.Context, key string, info objectInfo) (io.ReadCloser, error)
	// remove deletes key; a key that does not exist is not an error.
	remove(ctx context.Context, key string) error
	// removeIncomplete discards what interrupted puts of key left behind
	// (S3 multipart uploads, temporary files). They are invisible to
	// readers; this only frees their space.
	removeIncomplete(ctx context.Context, key string) error
	// check verifies that the store can be written to.
	check(ctx context.Context) error
}

// objectInfo describes a stored object.
type objectInfo struct {
	size    int64
	modTime time.Time
	meta    map[string]string
	// version identifies this write of the object (an ETag, a file's
	// identity), so that get reads what stat saw.
	version string
}

// errObjectNotFound is stat's answer for a key that holds no object.
var errObjectNotFound = errors.New("object not found")

func metaValue(m map[string]string, key string) string {
	for k, v := range m {
		if strings.EqualFold(k, key) || strings.EqualFold(k, "X-Amz-Meta-"+key) {
			return v
		}
	}
	return ""
}
