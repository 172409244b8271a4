package main

import (
	"errors"
	"flag"
	"fmt"
	"os"
	"path/filepath"
	"strconv"
	"strings"

	"sigs.k8s.io/controller-runtime/pkg/client"

	"github.com/agentbox/terraform-provider-agentbox/internal/api/v1alpha1"
	"github.com/agentbox/terraform-provider-agentbox/internal/snapshot"
	"github.com/agentbox/terraform-provider-agentbox/internal/snapshot/archive"
	"github.com/agentbox/terraform-provider-agentbox/internal/snapshot/volumesnapshot"
)

// Files of the archive store's credentials directory (the mounted Secret
// snapshot.archive.credentialsSecret, whose keys AWS_ACCESS_KEY_ID and
// AWS_SECRET_ACCESS_KEY the chart maps to these names).
const (
	archiveAccessKeyFile = "access-key-id"
	archiveSecretKeyFile = "secret-access-key"
)

// defaultArchiveDir is where the chart mounts the embedded store's volume
// (the claim agentbox-snapshots).
const defaultArchiveDir = "/var/lib/agentbox-snapshots"

// snapshotFlags select and configure the snapshot driver. Each flag
// defaults to an environment variable, which is how the chart passes them:
// a variable the binary does not know is ignored, where an unknown flag
// would stop it, so a chart newer than the image still starts.
type snapshotFlags struct {
	driver string

	volumeSnapshotClass string

	archiveDir            string
	archiveEndpoint       string
	archiveBucket         string
	archivePrefix         string
	archiveRegion         string
	archiveCredentialsDir string
	archiveCAFile         string
	archiveAllowHTTP      bool
	archiveCompression    string
}

func registerSnapshotFlags(fs *flag.FlagSet, getenv func(string) string) *snapshotFlags {
	env := func(key, def string) string {
		if v := getenv(key); v != "" {
			return v
		}
		return def
	}
	f := &snapshotFlags{}
	allowHTTP, _ := strconv.ParseBool(getenv("AGENTBOX_ARCHIVE_ALLOW_HTTP"))
	fs.StringVar(&f.driver, "snapshot-driver", env("AGENTBOX_SNAPSHOT_DRIVER", archive.Name),
		`how stopped sandboxes' workspaces are kept: "archive" (tar archives in the embedded store, a directory on a volume, or with --archive-endpoint in an S3-compatible store) or "volumesnapshot" (CSI VolumeSnapshots) [AGENTBOX_SNAPSHOT_DRIVER]`)
	fs.StringVar(&f.volumeSnapshotClass, "volume-snapshot-class", getenv("AGENTBOX_VOLUME_SNAPSHOT_CLASS"),
		"VolumeSnapshotClass of templates that name none; empty means the cluster's default class [AGENTBOX_VOLUME_SNAPSHOT_CLASS]")
	fs.StringVar(&f.archiveDir, "archive-dir", env("AGENTBOX_ARCHIVE_DIR", defaultArchiveDir),
		"directory of the embedded store (a volume of the control plane's own), used when no --archive-endpoint is set [AGENTBOX_ARCHIVE_DIR]")
	fs.StringVar(&f.archiveEndpoint, "archive-endpoint", getenv("AGENTBOX_ARCHIVE_ENDPOINT"),
		"URL of the S3-compatible store, https://host[:port]; set, the archives go there instead of the embedded store [AGENTBOX_ARCHIVE_ENDPOINT]")
	fs.StringVar(&f.archiveBucket, "archive-bucket", getenv("AGENTBOX_ARCHIVE_BUCKET"), "bucket of the archives [AGENTBOX_ARCHIVE_BUCKET]")
	fs.StringVar(&f.archivePrefix, "archive-prefix", getenv("AGENTBOX_ARCHIVE_PREFIX"), "key prefix of the archives [AGENTBOX_ARCHIVE_PREFIX]")
	fs.StringVar(&f.archiveRegion, "archive-region", getenv("AGENTBOX_ARCHIVE_REGION"), "region of the bucket (default us-east-1) [AGENTBOX_ARCHIVE_REGION]")
	fs.StringVar(&f.archiveCredentialsDir, "archive-credentials-dir", getenv("AGENTBOX_ARCHIVE_CREDENTIALS_DIR"),
		"directory holding the files "+archiveAccessKeyFile+" and "+archiveSecretKeyFile+" (a mounted Secret) [AGENTBOX_ARCHIVE_CREDENTIALS_DIR]")
	fs.StringVar(&f.archiveCAFile, "archive-ca-file", getenv("AGENTBOX_ARCHIVE_CA_FILE"),
		"PEM file of extra certificate authorities trusted for the store's https endpoint [AGENTBOX_ARCHIVE_CA_FILE]")
	fs.BoolVar(&f.archiveAllowHTTP, "archive-allow-http", allowHTTP,
		"accept a plain-http endpoint that is not loopback; workspaces then cross the network in clear [AGENTBOX_ARCHIVE_ALLOW_HTTP]")
	fs.StringVar(&f.archiveCompression, "archive-compression", env("AGENTBOX_ARCHIVE_COMPRESSION", string(archive.CompressionGzip)),
		`compression of the archives: "gzip" or "none" [AGENTBOX_ARCHIVE_COMPRESSION]`)
	return f
}

// newSnapshotDriver builds the driver the flags select. c and reader are
// used by the volumesnapshot driver (reader, uncached, for its checks of
// the classes); c's scheme must hold volumesnapshot.AddToScheme's types.
// The archive driver's credentials are read here, once: rotating them
// means restarting the control plane.
func (f *snapshotFlags) newSnapshotDriver(c client.Client, reader client.Reader) (snapshot.Driver, error) {
	switch f.driver {
	case volumesnapshot.Name:
		return volumesnapshot.New(c, volumesnapshot.Options{Class: f.volumeSnapshotClass, APIReader: reader}), nil
	case archive.Name:
		return f.newArchiveDriver()
	default:
		return nil, fmt.Errorf("--snapshot-driver %q is not %q or %q", f.driver, volumesnapshot.Name, archive.Name)
	}
}

func (f *snapshotFlags) newArchiveDriver() (*archive.Driver, error) {
	if f.archiveEndpoint == "" {
		// The embedded store: no credentials, nothing outside the cluster.
		return archive.New(archive.Config{
			Dir:         f.archiveDir,
			Compression: archive.Compression(f.archiveCompression),
		})
	}
	if f.archiveCredentialsDir == "" {
		return nil, errors.New("--snapshot-driver=archive needs --archive-credentials-dir (the chart mounts snapshot.archive.credentialsSecret there)")
	}
	read := func(name string) (string, error) {
		p := filepath.Join(f.archiveCredentialsDir, name)
		b, err := os.ReadFile(p)
		if err != nil {
			return "", fmt.Errorf("archive store credentials: %w", err)
		}
		v := strings.TrimSpace(string(b))
		if v == "" {
			return "", fmt.Errorf("archive store credentials: %s is empty", p)
		}
		return v, nil
	}
	accessKey, err := read(archiveAccessKeyFile)
	if err != nil {
		return nil, err
	}
	secretKey, err := read(archiveSecretKeyFile)
	if err != nil {
		return nil, err
	}
	var caPEM []byte
	if f.archiveCAFile != "" {
		if caPEM, err = os.ReadFile(f.archiveCAFile); err != nil {
			return nil, fmt.Errorf("archive store CA: %w", err)
		}
	}
	return archive.New(archive.Config{
		Endpoint:        f.archiveEndpoint,
		Bucket:          f.archiveBucket,
		Prefix:          f.archivePrefix,
		Region:          f.archiveRegion,
		AccessKeyID:     accessKey,
		SecretAccessKey: secretKey,
		CAPEM:           caPEM,
		AllowHTTP:       f.archiveAllowHTTP,
		Compression:     archive.Compression(f.archiveCompression),
	})
}

// hint says how to fix a problem the snapshot check found, in the chart's
// values, for the control plane's status and events.
func (f *snapshotFlags) hint(p *snapshot.Problem) string {
	switch p.Reason {
	case v1alpha1.ReasonSnapshotAPIMissing:
		return "install the CSI external-snapshotter's CRDs and snapshot-controller (and a CSI driver with snapshot support), " +
			"or use the archive driver, which needs neither (snapshot.driver: archive, the chart's default)"
	case v1alpha1.ReasonVolumeSnapshotClassNotFound:
		return "create the VolumeSnapshotClass, or mark one of the workspaces' CSI driver as the default " +
			"(annotation snapshot.storage.kubernetes.io/is-default-class: \"true\"), or name one in snapshot.volumeSnapshotClassName; " +
			"or use the archive driver (snapshot.driver: archive)"
	case v1alpha1.ReasonVolumeSnapshotClassMismatch:
		return "set snapshot.volumeSnapshotClassName to a class of the CSI driver that provisions the workspaces, " +
			"or give the templates a workspace StorageClass that class can snapshot; or use the archive driver (snapshot.driver: archive)"
	case v1alpha1.ReasonSnapshotStoreUnavailable:
		if f.archiveEndpoint == "" {
			return fmt.Sprintf("check that the embedded store's claim (snapshot.archive.embedded; agentbox-snapshots unless existingClaim is set) is bound, "+
				"mounted at %s and writable, and has space left; or configure an S3 store (snapshot.archive.endpoint)", f.archiveDir)
		}
		return "check snapshot.archive.endpoint, bucket and region, that the bucket exists, and that the keys in " +
			"snapshot.archive.credentialsSecret may use it"
	}
	return ""
}
