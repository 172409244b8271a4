package archive

import (
	"context"
	"crypto/tls"
	"crypto/x509"
	"errors"
	"fmt"
	"io"
	"net/url"

	"github.com/minio/minio-go/v7"
	"github.com/minio/minio-go/v7/pkg/credentials"
)

// s3Store keeps the archives in an S3-compatible bucket. An object appears
// only when its multipart upload completes, and PutObject completes the
// upload only after its reader has ended without error.
type s3Store struct {
	client   *minio.Client
	bucket   string
	endpoint string
}

func newS3Store(cfg Config, u *url.URL) (*s3Store, error) {
	secure := u.Scheme == "https"
	transport, err := minio.DefaultTransport(secure)
	if err != nil {
		return nil, fmt.Errorf("archive: transport: %w", err)
	}
	if secure {
		pool, err := x509.SystemCertPool()
		if err != nil {
			pool = x509.NewCertPool()
		}
		if len(cfg.CAPEM) > 0 && !pool.AppendCertsFromPEM(cfg.CAPEM) {
			return nil, errors.New("archive: the CA holds no PEM certificate")
		}
		transport.TLSClientConfig = &tls.Config{RootCAs: pool, MinVersion: tls.VersionTLS12}
	}
	client, err := minio.New(u.Host, &minio.Options{
		Creds:      credentials.NewStaticV4(cfg.AccessKeyID, cfg.SecretAccessKey, ""),
		Secure:     secure,
		Region:     cfg.Region,
		Transport:  transport,
		MaxRetries: cfg.MaxRetries,
	})
	if err != nil {
		return nil, fmt.Errorf("archive: S3 client: %w", err)
	}
	return &s3Store{client: client, bucket: cfg.Bucket, endpoint: cfg.Endpoint}, nil
}

func (s *s3Store) kind() string { return StoreS3 }

func (s *s3Store) location(key string) string { return "s3://" + s.bucket + "/" + key }

func (s *s3Store) put(ctx context.Context, key string, r io.Reader, meta map[string]string, contentType string, partSize int64) error {
	_, err := s.client.PutObject(ctx, s.bucket, key, r, -1, minio.PutObjectOptions{
		ContentType:  contentType,
		PartSize:     uint64(partSize),
		UserMetadata: meta,
	})
	return err
}

func (s *s3Store) stat(ctx context.Context, key string) (objectInfo, error) {
	info, err := s.client.StatObject(ctx, s.bucket, key, minio.StatObjectOptions{})
	if s3NotFound(err) {
		return objectInfo{}, errObjectNotFound
	}
	if err != nil {
		return objectInfo{}, err
	}
	return objectInfo{size: info.Size, modTime: info.LastModified, meta: info.UserMetadata, version: info.ETag}, nil
}

func (s *s3Store) get(ctx context.Context, key string, info objectInfo) (io.ReadCloser, error) {
	opts := minio.GetObjectOptions{}
	// The object read is the one just checked, not one replaced since.
	if err := opts.SetMatchETag(info.version); err != nil {
		return nil, err
	}
	return s.client.GetObject(ctx, s.bucket, key, opts)
}

func (s *s3Store) remove(ctx context.Context, key string) error {
	// Removing a missing key succeeds in S3.
	if err := s.client.RemoveObject(ctx, s.bucket, key, minio.RemoveObjectOptions{}); err != nil && !s3NotFound(err) {
		return err
	}
	return nil
}

func (s *s3Store) removeIncomplete(ctx context.Context, key string) error {
	if err := s.client.RemoveIncompleteUpload(ctx, s.bucket, key); err != nil && !s3NotFound(err) {
		return err
	}
	return nil
}

// check verifies that the store answers and the bucket exists.
func (s *s3Store) check(ctx context.Context) error {
	ok, err := s.client.BucketExists(ctx, s.bucket)
	if err != nil {
		return fmt.Errorf("archive: bucket %s at %s: %w", s.bucket, s.endpoint, err)
	}
	if !ok {
		return fmt.Errorf("archive: bucket %s does not exist at %s", s.bucket, s.endpoint)
	}
	return nil
}

func s3NotFound(err error) bool {
	if err == nil {
		return false
	}
	switch minio.ToErrorResponse(err).Code {
	case minio.NoSuchKey, "NotFound", "NoSuchUpload":
		return true
	}
	return false
}
