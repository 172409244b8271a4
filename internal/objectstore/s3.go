package objectstore

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

// s3Store keeps the objects in an S3-compatible bucket. An object appears
// only when its upload completes, and PutObject completes the upload only
// after its reader has ended without error.
type s3Store struct {
	client   *minio.Client
	bucket   string
	endpoint string
	partSize int64
}

func newS3Store(cfg Config, u *url.URL) (*s3Store, error) {
	secure := u.Scheme == "https"
	transport, err := minio.DefaultTransport(secure)
	if err != nil {
		return nil, fmt.Errorf("transport: %w", err)
	}
	if secure {
		pool, err := x509.SystemCertPool()
		if err != nil {
			pool = x509.NewCertPool()
		}
		if len(cfg.CAPEM) > 0 && !pool.AppendCertsFromPEM(cfg.CAPEM) {
			return nil, errors.New("the CA holds no PEM certificate")
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
		return nil, fmt.Errorf("S3 client: %w", err)
	}
	return &s3Store{client: client, bucket: cfg.Bucket, endpoint: cfg.Endpoint, partSize: cfg.PartSize}, nil
}

func (s *s3Store) Kind() string { return KindS3 }

func (s *s3Store) Location(key string) string { return "s3://" + s.bucket + "/" + key }

func (s *s3Store) Put(ctx context.Context, key string, r io.Reader, size int64, o PutOptions) error {
	part := o.PartSize
	if part <= 0 {
		part = s.partSize
	}
	_, err := s.client.PutObject(ctx, s.bucket, key, r, size, minio.PutObjectOptions{
		ContentType:  o.ContentType,
		PartSize:     uint64(part),
		UserMetadata: o.Meta,
	})
	return err
}

func (s *s3Store) Stat(ctx context.Context, key string) (Info, error) {
	info, err := s.client.StatObject(ctx, s.bucket, key, minio.StatObjectOptions{})
	if s3NotFound(err) {
		return Info{}, ErrNotFound
	}
	if err != nil {
		return Info{}, err
	}
	return Info{Key: key, Size: info.Size, ModTime: info.LastModified, Meta: info.UserMetadata, Version: info.ETag}, nil
}

func (s *s3Store) Get(ctx context.Context, key string, info Info) (io.ReadCloser, error) {
	opts := minio.GetObjectOptions{}
	// The object read is the one just checked, not one replaced since.
	if err := opts.SetMatchETag(info.Version); err != nil {
		return nil, err
	}
	return s.client.GetObject(ctx, s.bucket, key, opts)
}

func (s *s3Store) Remove(ctx context.Context, key string) error {
	// Removing a missing key succeeds in S3.
	if err := s.client.RemoveObject(ctx, s.bucket, key, minio.RemoveObjectOptions{}); err != nil && !s3NotFound(err) {
		return err
	}
	return nil
}

func (s *s3Store) RemoveIncomplete(ctx context.Context, key string) error {
	if err := s.client.RemoveIncompleteUpload(ctx, s.bucket, key); err != nil && !s3NotFound(err) {
		return err
	}
	return nil
}

func (s *s3Store) List(ctx context.Context, prefix string, fn func(Info) error) error {
	ctx, cancel := context.WithCancel(ctx)
	// Ending the listing's context stops its goroutine when fn stops
	// early.
	defer cancel()
	for obj := range s.client.ListObjects(ctx, s.bucket, minio.ListObjectsOptions{Prefix: prefix, Recursive: true}) {
		if obj.Err != nil {
			return obj.Err
		}
		if err := fn(Info{Key: obj.Key, Size: obj.Size, ModTime: obj.LastModified, Version: obj.ETag}); err != nil {
			return err
		}
	}
	return ctx.Err()
}

// Check verifies that the store answers and the bucket exists.
func (s *s3Store) Check(ctx context.Context) error {
	ok, err := s.client.BucketExists(ctx, s.bucket)
	if err != nil {
		return fmt.Errorf("bucket %s at %s: %w", s.bucket, s.endpoint, err)
	}
	if !ok {
		return fmt.Errorf("bucket %s does not exist at %s", s.bucket, s.endpoint)
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
