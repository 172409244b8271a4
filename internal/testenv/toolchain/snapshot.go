package toolchain

import (
	"context"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
)

// ExternalSnapshotterVersion is the release of the snapshot-controller, of
// csi-snapshotter and of the snapshot CRDs; the snapshot-controller wrapper
// pins the same one.
const ExternalSnapshotterVersion = "v8.3.0"

// File names under BinDir.
const (
	SnapshotController = "snapshot-controller"
	// CSISnapshotter is the sidecar that calls a CSI driver's
	// CreateSnapshot and DeleteSnapshot for VolumeSnapshotContents.
	CSISnapshotter = "csi-snapshotter"
)

const snapshotClientModule = "github.com/kubernetes-csi/external-snapshotter/client/v8"

// SnapshotCRDs are the snapshot.storage.k8s.io CRD files under
// SnapshotCRDDir. The group snapshot CRDs are left out: the controller runs
// without that feature.
var SnapshotCRDs = []string{
	"snapshot.storage.k8s.io_volumesnapshotclasses.yaml",
	"snapshot.storage.k8s.io_volumesnapshotcontents.yaml",
	"snapshot.storage.k8s.io_volumesnapshots.yaml",
}

// SnapshotCRDDir holds the snapshot CRDs, copied from the module at build
// time rather than committed, so that they cannot drift from the
// snapshot-controller that was built with them.
func SnapshotCRDDir(dir string) string { return filepath.Join(dir, snapshotCRDSubdir) }

const snapshotCRDSubdir = "crds/snapshot"

// snapshotController is the real VolumeSnapshot controller the
// volumesnapshot driver is tested against, with csi-snapshotter, the
// sidecar that hands its requests to the test node's CSI driver.
func snapshotController() component {
	produces := make([]string, len(SnapshotCRDs))
	for i, f := range SnapshotCRDs {
		produces[i] = filepath.Join(snapshotCRDSubdir, f)
	}
	return component{name: "snapshot-controller", testOnly: true, binary: []binary{
		{SnapshotController, "github.com/kubernetes-csi/external-snapshotter/v8/cmd/snapshot-controller"},
		{CSISnapshotter, "github.com/kubernetes-csi/external-snapshotter/v8/cmd/csi-snapshotter"},
	}, ldflags: "-s -w -X main.version=" + ExternalSnapshotterVersion, files: copySnapshotCRDs, produces: produces}
}

func copySnapshotCRDs(ctx context.Context, b *Builder, src string) error {
	cmd := exec.CommandContext(ctx, "go", "list", "-m", "-f", "{{.Dir}}", snapshotClientModule)
	cmd.Dir = src
	cmd.Env = append(os.Environ(), "GOWORK=off")
	out, err := cmd.Output()
	if err != nil {
		return fmt.Errorf("locate %s: %w", snapshotClientModule, err)
	}
	from := filepath.Join(strings.TrimSpace(string(out)), "config", "crd")
	to := SnapshotCRDDir(b.Dir)
	if err := os.MkdirAll(to, 0o755); err != nil {
		return err
	}
	for _, f := range SnapshotCRDs {
		if err := copyFile(filepath.Join(from, f), filepath.Join(to, f), 0o644); err != nil {
			return fmt.Errorf("copy snapshot CRD %s: %w", f, err)
		}
	}
	b.logf("snapshot-controller: %d CRDs into %s", len(SnapshotCRDs), to)
	return nil
}
