package objectstore

import (
	"errors"
	"fmt"
	"net"
	"net/url"

	"github.com/minio/minio-go/v7/pkg/s3utils"
)

// Defaults for Config.
const (
	DefaultPartSize = 16 << 20
	MinPartSize     = 5 << 20 // S3's smallest part but the last
	DefaultRegion   = "us-east-1"
)

// Config says where the objects go: an S3-compatible bucket (Endpoint,
// Bucket and the keys) or a directory (Dir), not both.
type Config struct {
	// Dir is an existing directory, normally a volume of the control
	// plane's own, that holds the objects as files: the embedded store.
	// It excludes every S3 setting.
	Dir string
	// Endpoint is the store's URL: https://host[:port], or http:// for a
	// loopback address or with AllowHTTP. No path, query or user info.
	Endpoint string
	// Bucket holds the objects; it must exist.
	Bucket string
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
	// wire, but the objects do, in clear: use it only on a network you
	// trust (an in-cluster store behind a NetworkPolicy).
	AllowHTTP bool
	// PartSize is the default multipart part size in bytes,
	// DefaultPartSize when 0, at least MinPartSize. An object can have at
	// most 10,000 parts (160 GB with the default). S3 only.
	PartSize int64
	// MaxRetries of one S3 request; 0 means the client library's default
	// (10).
	MaxRetries int
}

// New checks cfg and returns its store. It does not contact the store or
// touch the directory; Check does. Its errors say what is wrong with cfg
// without repeating credentials.
func New(cfg Config) (Store, error) {
	if cfg.Dir != "" {
		if cfg.Endpoint != "" || cfg.Bucket != "" || cfg.AccessKeyID != "" || cfg.SecretAccessKey != "" || len(cfg.CAPEM) > 0 {
			return nil, errors.New("a store directory and an S3 endpoint, bucket, keys or CA are configured together; configure one store")
		}
		return newDirStore(cfg.Dir)
	}
	return newS3FromConfig(cfg)
}

// newS3FromConfig checks and completes the S3 settings of cfg and returns
// the store they describe.
func newS3FromConfig(cfg Config) (*s3Store, error) {
	if cfg.Endpoint == "" {
		return nil, errors.New("the endpoint URL is required (or a store directory)")
	}
	u, err := url.Parse(cfg.Endpoint)
	if err != nil {
		return nil, fmt.Errorf("endpoint %q: %w", cfg.Endpoint, err)
	}
	switch {
	case u.Scheme != "http" && u.Scheme != "https":
		return nil, fmt.Errorf("endpoint %q must be an http:// or https:// URL", cfg.Endpoint)
	case u.Host == "":
		return nil, fmt.Errorf("endpoint %q has no host", cfg.Endpoint)
	case u.User != nil:
		return nil, fmt.Errorf("endpoint %q must not carry credentials; set the access key and secret key instead", redact(u))
	case (u.Path != "" && u.Path != "/") || u.RawQuery != "" || u.Fragment != "":
		return nil, fmt.Errorf("endpoint %q must be a bare scheme://host[:port], without a path or query (the bucket is configured separately)", cfg.Endpoint)
	}
	secure := u.Scheme == "https"
	if !secure && !cfg.AllowHTTP && !isLoopback(u.Hostname()) {
		return nil, fmt.Errorf("endpoint %q is plain http to a host that is not loopback: the data would cross the network in clear; use https, or allow http explicitly", cfg.Endpoint)
	}
	if !secure && len(cfg.CAPEM) > 0 {
		return nil, fmt.Errorf("a CA is configured but endpoint %q is not https", cfg.Endpoint)
	}
	if cfg.Bucket == "" {
		return nil, errors.New("the bucket is required")
	}
	if err := s3utils.CheckValidBucketNameStrict(cfg.Bucket); err != nil {
		return nil, fmt.Errorf("bucket %q: %w", cfg.Bucket, err)
	}
	if cfg.AccessKeyID == "" || cfg.SecretAccessKey == "" {
		return nil, errors.New("the access key ID and the secret access key are both required")
	}
	switch {
	case cfg.PartSize == 0:
		cfg.PartSize = DefaultPartSize
	case cfg.PartSize < MinPartSize:
		return nil, fmt.Errorf("part size %d is below S3's minimum of %d bytes", cfg.PartSize, MinPartSize)
	}
	if cfg.Region == "" {
		cfg.Region = DefaultRegion
	}
	return newS3Store(cfg, u)
}

func redact(u *url.URL) string {
	c := *u
	c.User = nil
	return c.String()
}

func isLoopback(host string) bool {
	if host == "localhost" {
		return true
	}
	ip := net.ParseIP(host)
	return ip != nil && ip.IsLoopback()
}
