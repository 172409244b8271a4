package main

import (
	"context"
	"io"
	"os"
	"path/filepath"
	"strings"
	"testing"

	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"

	"github.com/agentbox/terraform-provider-agentbox/internal/api/v1alpha1"
	"github.com/agentbox/terraform-provider-agentbox/internal/snapshot"
	"github.com/agentbox/terraform-provider-agentbox/internal/snapshot/archive"
)

func TestSnapshotFlags(t *testing.T) {
	creds := t.TempDir()
	for name, v := range map[string]string{archiveAccessKeyFile: "AKIDEXAMPLE\n", archiveSecretKeyFile: "wJalrXUtnFEMI/K7MDENG\n"} {
		if err := os.WriteFile(filepath.Join(creds, name), []byte(v), 0o600); err != nil {
			t.Fatal(err)
		}
	}
	noEnv := func(string) string { return "" }

	o, err := parseOptions(nil, noEnv, io.Discard)
	if err != nil {
		t.Fatal(err)
	}
	// The default needs nothing outside the cluster: the archive driver
	// with the embedded store, where the chart mounts its volume.
	d, err := o.snapshot.newSnapshotDriver(nil, nil)
	if err != nil || snapshot.ID(d) != "archive/embedded" || d.(*archive.Driver).Location(&v1alpha1.Sandbox{ObjectMeta: metav1.ObjectMeta{Namespace: "ns", Name: "sb"}}, "s1") != "/var/lib/agentbox-snapshots/ns/sb/s1.tar.gz" {
		t.Fatalf("default driver: %v, %v", d, err)
	}
	d.(*archive.Driver).Close()
	embedded := t.TempDir()
	o, err = parseOptions(nil, func(k string) string {
		return map[string]string{"AGENTBOX_ARCHIVE_DIR": embedded, "AGENTBOX_ARCHIVE_PREFIX": "agentbox/"}[k]
	}, io.Discard)
	if err != nil {
		t.Fatal(err)
	}
	if d, err = o.snapshot.newSnapshotDriver(nil, nil); err != nil || snapshot.ID(d) != "archive/embedded" {
		t.Fatalf("embedded store from the environment: %v, %v", d, err)
	}
	if err := d.(snapshot.Checker).Check(context.Background()); err != nil {
		t.Errorf("Check of a writable directory: %v", err)
	}
	d.(*archive.Driver).Close()
	o, err = parseOptions([]string{"-snapshot-driver=volumesnapshot"}, noEnv, io.Discard)
	if err != nil {
		t.Fatal(err)
	}
	if d, err = o.snapshot.newSnapshotDriver(nil, nil); err != nil || snapshot.ID(d) != "volumesnapshot" {
		t.Fatalf("volumesnapshot driver: %v, %v", d, err)
	}

	o, err = parseOptions([]string{"-snapshot-driver=archive", "-archive-endpoint=https://s3.example.com", "-archive-bucket=snapshots",
		"-archive-prefix=agentbox", "-archive-region=eu-west-1", "-archive-credentials-dir=" + creds}, noEnv, io.Discard)
	if err != nil {
		t.Fatal(err)
	}
	d, err = o.snapshot.newSnapshotDriver(nil, nil)
	if err != nil {
		t.Fatal(err)
	}
	ad, ok := d.(*archive.Driver)
	if !ok || ad.Bucket() != "snapshots" || snapshot.ID(ad) != "archive/s3" {
		t.Fatalf("archive driver: %T %v", d, d)
	}
	ad.Close()

	// The chart passes the settings as variables.
	env := map[string]string{
		"AGENTBOX_SNAPSHOT_DRIVER":         "archive",
		"AGENTBOX_ARCHIVE_ENDPOINT":        "http://minio.storage.svc:9000",
		"AGENTBOX_ARCHIVE_BUCKET":          "snapshots",
		"AGENTBOX_ARCHIVE_CREDENTIALS_DIR": creds,
		"AGENTBOX_ARCHIVE_ALLOW_HTTP":      "true",
		"AGENTBOX_ARCHIVE_COMPRESSION":     "none",
	}
	o, err = parseOptions(nil, func(k string) string { return env[k] }, io.Discard)
	if err != nil {
		t.Fatal(err)
	}
	if f := o.snapshot; f.driver != "archive" || !f.archiveAllowHTTP || f.archiveCompression != "none" || f.archiveCredentialsDir != creds {
		t.Fatalf("from the environment: %+v", f)
	}
	if d, err = o.snapshot.newSnapshotDriver(nil, nil); err != nil {
		t.Fatal(err)
	}
	d.(*archive.Driver).Close()

	empty := t.TempDir()
	if err := os.WriteFile(filepath.Join(empty, archiveAccessKeyFile), []byte("AKID"), 0o600); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(filepath.Join(empty, archiveSecretKeyFile), []byte(" \n"), 0o600); err != nil {
		t.Fatal(err)
	}
	for name, tc := range map[string]struct {
		args []string
		want string
	}{
		"unknown driver":     {[]string{"-snapshot-driver=zfs"}, `"zfs" is not`},
		"no credentials":     {[]string{"-snapshot-driver=archive", "-archive-endpoint=https://s3.example.com", "-archive-bucket=snapshots"}, "--archive-credentials-dir"},
		"missing files":      {[]string{"-snapshot-driver=archive", "-archive-endpoint=https://s3.example.com", "-archive-credentials-dir=" + t.TempDir()}, archiveAccessKeyFile},
		"empty secret":       {[]string{"-snapshot-driver=archive", "-archive-endpoint=https://s3.example.com", "-archive-credentials-dir=" + empty}, archiveSecretKeyFile + " is empty"},
		"relative dir":       {[]string{"-snapshot-driver=archive", "-archive-dir=snapshots"}, "absolute path"},
		"missing CA file":    {[]string{"-snapshot-driver=archive", "-archive-endpoint=https://s3.example.com", "-archive-credentials-dir=" + creds, "-archive-ca-file=/nonexistent/ca.crt"}, "CA"},
		"remote plain http":  {[]string{"-snapshot-driver=archive", "-archive-credentials-dir=" + creds, "-archive-endpoint=http://s3.example.com", "-archive-bucket=snapshots"}, "plain http"},
		"unknown compressor": {[]string{"-snapshot-driver=archive", "-archive-credentials-dir=" + creds, "-archive-endpoint=https://s3.example.com", "-archive-bucket=snapshots", "-archive-compression=xz"}, "xz"},
	} {
		t.Run(name, func(t *testing.T) {
			o, err := parseOptions(tc.args, noEnv, io.Discard)
			if err != nil {
				t.Fatal(err)
			}
			_, err = o.snapshot.newSnapshotDriver(nil, nil)
			if err == nil || !strings.Contains(err.Error(), tc.want) {
				t.Fatalf("error %v, want one mentioning %q", err, tc.want)
			}
			if strings.Contains(err.Error(), "wJalrXUtnFEMI") {
				t.Errorf("the error shows the secret key: %v", err)
			}
		})
	}
}
