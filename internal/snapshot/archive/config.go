package archive

import (
	"context"
	"fmt"
	"strings"
	"time"

	"github.com/agentbox/terraform-provider-agentbox/internal/objectstore"
)

// Defaults for Config.
const (
	DefaultPartSize      = objectstore.DefaultPartSize
	MinPartSize          = objectstore.MinPartSize // S3's smallest part but the last
	DefaultTakeWait      = 5 * time.Second
	DefaultUploadTimeout = time.Hour
	DefaultRegion        = objectstore.DefaultRegion
)

// Config says where the archives go: an S3-compatible bucket (Endpoint,
// Bucket and the keys) or a directory (Dir), not both.
type Config struct {
	// Dir is an existing directory, normally a volume of the control
	// plane's own, that holds the archives as files: the embedded store.
	// It excludes every S3 setting.
	Dir string
	// Endpoint is the store's URL: https://host[:port], or http:// for a
	// loopback address or with AllowHTTP. No path, query or user info.
	Endpoint string
	// Bucket holds the archives; it must exist.
	Bucket string
	// Prefix is put in front of every key; "" means none. Leading and
	// trailing slashes are ignored.
	Prefix string
	// Region of the bucket; DefaultRegion when empty.
	Region string
	// AccessKeyID and SecretAccessKey sign the requests (AWS signature v4).
	AccessKeyID     string
	SecretAccessKey string
	// CAPEM holds extra certificate authorities (PEM) trusted for an https
	// endpoint, on top of the system's; for a store with a private CA.
	CAPEM []byte
	// AllowHTTP accepts a plain-http endpoint that is not a loopback
	// address. Requests are signed, so the secret key never crosses the
	// wire, but the workspaces do, in clear: use it only on a network you
	// trust (an in-cluster store behind a NetworkPolicy).
	AllowHTTP bool
	// Compression is CompressionGzip (the default) or CompressionNone.
	Compression Compression
	// PartSize is the multipart part size in bytes, DefaultPartSize when
	// 0, at least MinPartSize. Each upload in flight holds one part in
	// memory, and an archive can have at most 10,000 parts (160 GB with
	// the default). S3 only.
	PartSize int64
	// MaxRetries of one S3 request; 0 means the client library's default
	// (10). The controller retries Take and Restore as a whole anyway.
	MaxRetries int
	// TakeWait is how long Take waits for an upload it started or found
	// running before it reports "not ready yet"; DefaultTakeWait when 0.
	// Small workspaces are then ready on the first call, and large ones do
	// not hold a reconcile for minutes.
	TakeWait time.Duration
	// UploadTimeout bounds one upload; DefaultUploadTimeout when 0.
	UploadTimeout time.Duration
}

// New checks cfg and returns a driver. It does not contact the store or
// touch the directory; Check does.
func New(cfg Config) (*Driver, error) {
	store, err := objectstore.New(objectstore.Config{
		Dir:             cfg.Dir,
		Endpoint:        cfg.Endpoint,
		Bucket:          cfg.Bucket,
		Region:          cfg.Region,
		AccessKeyID:     cfg.AccessKeyID,
		SecretAccessKey: cfg.SecretAccessKey,
		CAPEM:           cfg.CAPEM,
		AllowHTTP:       cfg.AllowHTTP,
		PartSize:        cfg.PartSize,
		MaxRetries:      cfg.MaxRetries,
	})
	if err != nil {
		return nil, fmt.Errorf("archive: %w", err)
	}
	switch cfg.Compression {
	case "":
		cfg.Compression = CompressionGzip
	case CompressionGzip, CompressionNone:
	default:
		return nil, fmt.Errorf("archive: compression %q is not %q or %q", cfg.Compression, CompressionGzip, CompressionNone)
	}
	if cfg.PartSize == 0 {
		cfg.PartSize = DefaultPartSize
	}
	if cfg.TakeWait <= 0 {
		cfg.TakeWait = DefaultTakeWait
	}
	if cfg.UploadTimeout <= 0 {
		cfg.UploadTimeout = DefaultUploadTimeout
	}
	prefix := strings.Trim(cfg.Prefix, "/")
	if strings.Contains(prefix, "//") || strings.ContainsRune(prefix, 0) {
		return nil, fmt.Errorf("archive: prefix %q has an empty segment or a NUL byte", cfg.Prefix)
	}
	if prefix != "" && cfg.Dir != "" {
		if err := objectstore.CheckKey(prefix); err != nil {
			return nil, fmt.Errorf("archive: prefix %q is not a plain relative path: %w", cfg.Prefix, err)
		}
	}
	base, cancel := context.WithCancel(context.Background())
	return &Driver{cfg: cfg, store: store, prefix: prefix, base: base, cancel: cancel, uploads: map[string]*upload{}}, nil
}
