// Command csihostpath is the test node's CSI driver: volumes are folders on
// the node and snapshots are tar archives of them, as in the Kubernetes CSI
// project's csi-driver-host-path, except that each volume's folder is the
// mount point of an ext4 filesystem of the volume's size, in a sparse image
// file (package loopvol), so that the size is a real limit: a write past it
// fails with ENOSPC, as on a cloud disk. It runs as a host process beside kubelet
// with the real csi-provisioner, csi-snapshotter and snapshot-controller, so
// that the test cluster runs the whole CSI snapshot path with real data:
// VolumeSnapshot, VolumeSnapshotContent, CreateSnapshot, and a claim
// provisioned from a snapshot through its dataSource.
//
// It exists because the Go module proxy serves neither csi-driver-host-path
// nor node-driver-registrar (it answers 403 for both), so it also registers
// itself with kubelet, which is node-driver-registrar's job. It is for tests
// only: no capacity tracking, no topology, one node.
//
// Volumes are made root-owned 0755, like a fresh filesystem; kubelet applies
// the pod's fsGroup to them because the CSIDriver object says fsGroupPolicy
// File.
package main

import (
	"context"
	"encoding/json"
	"errors"
	"flag"
	"fmt"
	"log/slog"
	"net"
	"os"
	"os/exec"
	"os/signal"
	"path/filepath"
	"strings"
	"sync"
	"syscall"
	"time"

	"github.com/container-storage-interface/spec/lib/go/csi"
	"golang.org/x/sys/unix"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/types/known/timestamppb"
	registerapi "k8s.io/kubelet/pkg/apis/pluginregistration/v1"

	"github.com/agentbox/terraform-provider-agentbox/internal/testenv/loopvol"
)

const version = "0.1.0"

func main() {
	endpoint := flag.String("endpoint", "", "unix socket the CSI services listen on")
	registry := flag.String("registration-dir", "", "kubelet's plugins_registry folder (empty: do not register with kubelet)")
	dir := flag.String("dir", "", "folder that holds volumes and snapshots")
	name := flag.String("name", "", "CSI driver name")
	node := flag.String("node", "", "node ID reported to kubelet")
	flag.Parse()
	log := slog.New(slog.NewTextHandler(os.Stderr, nil))
	if *endpoint == "" || *dir == "" || *name == "" || *node == "" {
		log.Error("-endpoint, -dir, -name and -node are required")
		os.Exit(2)
	}
	ctx, stop := signal.NotifyContext(context.Background(), syscall.SIGTERM, os.Interrupt)
	defer stop()
	if err := run(ctx, *endpoint, *registry, *dir, *name, *node, log); err != nil {
		log.Error("csihostpath", "err", err)
		os.Exit(1)
	}
}

func run(ctx context.Context, endpoint, registry, dir, name, node string, log *slog.Logger) error {
	d := &driver{name: name, node: node, dir: dir, vols: filepath.Join(dir, "volumes"), images: filepath.Join(dir, "images"),
		snaps: filepath.Join(dir, "snapshots"), log: log}
	for _, p := range []string{d.vols, d.images, d.snaps, d.metaDir(), d.tmpDir(), filepath.Dir(endpoint)} {
		if err := os.MkdirAll(p, 0o755); err != nil {
			return err
		}
	}
	srv := grpc.NewServer(grpc.UnaryInterceptor(d.logCall))
	csi.RegisterIdentityServer(srv, d)
	csi.RegisterControllerServer(srv, d)
	csi.RegisterNodeServer(srv, d)
	l, err := listenUnix(endpoint)
	if err != nil {
		return err
	}
	go func() { _ = srv.Serve(l) }()
	defer srv.Stop()

	if registry != "" {
		// kubelet's plugin watcher finds this socket, asks GetInfo, and then
		// talks CSI to the endpoint it names. Removing the socket on the way
		// out makes kubelet deregister the driver.
		reg := grpc.NewServer()
		registerapi.RegisterRegistrationServer(reg, &registration{name: name, endpoint: endpoint, log: log})
		regSock := filepath.Join(registry, name+"-reg.sock")
		rl, err := listenUnix(regSock)
		if err != nil {
			return err
		}
		go func() { _ = reg.Serve(rl) }()
		defer func() {
			reg.Stop()
			_ = os.Remove(regSock)
		}()
	}
	log.Info("serving", "endpoint", endpoint, "driver", name, "node", node, "version", version)
	<-ctx.Done()
	return nil
}

func listenUnix(path string) (net.Listener, error) {
	if err := os.Remove(path); err != nil && !errors.Is(err, os.ErrNotExist) {
		return nil, err
	}
	l, err := net.Listen("unix", path)
	if err != nil {
		return nil, fmt.Errorf("listen on %s: %w", path, err)
	}
	return l, nil
}

type registration struct {
	registerapi.UnimplementedRegistrationServer
	name, endpoint string
	log            *slog.Logger
}

func (r *registration) GetInfo(context.Context, *registerapi.InfoRequest) (*registerapi.PluginInfo, error) {
	return &registerapi.PluginInfo{Type: registerapi.CSIPlugin, Name: r.name, Endpoint: r.endpoint, SupportedVersions: []string{"1.0.0"}}, nil
}

func (r *registration) NotifyRegistrationStatus(_ context.Context, st *registerapi.RegistrationStatus) (*registerapi.RegistrationStatusResponse, error) {
	if !st.PluginRegistered {
		r.log.Error("kubelet refused the registration", "err", st.Error)
	} else {
		r.log.Info("registered with kubelet")
	}
	return &registerapi.RegistrationStatusResponse{}, nil
}

type driver struct {
	csi.UnimplementedIdentityServer
	csi.UnimplementedControllerServer
	csi.UnimplementedNodeServer
	name, node               string
	dir, vols, images, snaps string
	log                      *slog.Logger
	// mu serialises changes: the sidecars retry, and a test cluster has a
	// handful of volumes, so there is nothing to gain from concurrency.
	mu sync.Mutex
}

func (d *driver) logCall(ctx context.Context, req any, info *grpc.UnaryServerInfo, h grpc.UnaryHandler) (any, error) {
	start := time.Now()
	resp, err := h(ctx, req)
	method := info.FullMethod[strings.LastIndexByte(info.FullMethod, '/')+1:]
	if err != nil {
		d.log.Warn("call failed", "method", method, "err", err)
	} else if !strings.HasPrefix(method, "Probe") && !strings.HasPrefix(method, "Get") && !strings.HasSuffix(method, "GetCapabilities") {
		d.log.Info("call", "method", method, "took", time.Since(start).Round(time.Millisecond))
	}
	return resp, err
}

// Identity.

func (d *driver) GetPluginInfo(context.Context, *csi.GetPluginInfoRequest) (*csi.GetPluginInfoResponse, error) {
	return &csi.GetPluginInfoResponse{Name: d.name, VendorVersion: version}, nil
}

func (d *driver) GetPluginCapabilities(context.Context, *csi.GetPluginCapabilitiesRequest) (*csi.GetPluginCapabilitiesResponse, error) {
	return &csi.GetPluginCapabilitiesResponse{Capabilities: []*csi.PluginCapability{{
		Type: &csi.PluginCapability_Service_{Service: &csi.PluginCapability_Service{Type: csi.PluginCapability_Service_CONTROLLER_SERVICE}},
	}}}, nil
}

func (d *driver) Probe(context.Context, *csi.ProbeRequest) (*csi.ProbeResponse, error) {
	return &csi.ProbeResponse{}, nil
}

// Controller.

func (d *driver) ControllerGetCapabilities(context.Context, *csi.ControllerGetCapabilitiesRequest) (*csi.ControllerGetCapabilitiesResponse, error) {
	var caps []*csi.ControllerServiceCapability
	for _, c := range []csi.ControllerServiceCapability_RPC_Type{
		csi.ControllerServiceCapability_RPC_CREATE_DELETE_VOLUME,
		csi.ControllerServiceCapability_RPC_CREATE_DELETE_SNAPSHOT,
	} {
		caps = append(caps, &csi.ControllerServiceCapability{Type: &csi.ControllerServiceCapability_Rpc{Rpc: &csi.ControllerServiceCapability_RPC{Type: c}}})
	}
	return &csi.ControllerGetCapabilitiesResponse{Capabilities: caps}, nil
}

// safeID checks that an ID or name from the CO is one path element, and
// not "." or "..", so that no request can reach outside, or remove, the
// driver's folders.
func safeID(id string) error {
	if id == "" || strings.ContainsRune(id, '/') || strings.HasPrefix(id, ".") || !filepath.IsLocal(id) {
		return status.Errorf(codes.InvalidArgument, "invalid ID %q", id)
	}
	return nil
}

// volMeta is kept beside each volume folder: the capacity the CO asked
// for, which a snapshot reports as its size (what a restored claim needs at
// least), as csi-driver-host-path does.
type volMeta struct {
	Capacity int64 `json:"capacity"`
}

// A volume is its image, which exists only when whole, mounted on its
// folder from CreateVolume to DeleteVolume: the folder is what snapshots
// archive and what NodePublishVolume binds into the pod.
func (d *driver) volPath(id string) string   { return filepath.Join(d.vols, id) }
func (d *driver) imagePath(id string) string { return filepath.Join(d.images, id+".img") }
func (d *driver) metaDir() string            { return filepath.Join(d.dir, "volume-meta") }
func (d *driver) metaPath(id string) string  { return filepath.Join(d.metaDir(), id+".json") }
func (d *driver) tmpDir() string             { return filepath.Join(d.dir, "tmp") }

// mountVolume mounts volume id on its folder if it exists and is not
// mounted yet (after a crash of the driver, say); NotFound if it does not
// exist.
func (d *driver) mountVolume(ctx context.Context, id string) error {
	if _, err := os.Stat(d.imagePath(id)); err != nil {
		return status.Errorf(codes.NotFound, "volume %s: %v", id, err)
	}
	if err := loopvol.Mount(ctx, d.imagePath(id), d.volPath(id)); err != nil {
		return status.Errorf(codes.Internal, "mount volume %s: %v", id, err)
	}
	return nil
}

// CreateVolume formats the volume's image, fills it from a snapshot when
// one is its content source, and mounts it.
func (d *driver) CreateVolume(ctx context.Context, req *csi.CreateVolumeRequest) (*csi.CreateVolumeResponse, error) {
	if err := safeID(req.GetName()); err != nil {
		return nil, err
	}
	for _, c := range req.GetVolumeCapabilities() {
		if c.GetBlock() != nil {
			return nil, status.Error(codes.InvalidArgument, "block volumes are not supported")
		}
	}
	d.mu.Lock()
	defer d.mu.Unlock()
	// The sidecar's deadline is short; work it gives up on would only be
	// redone by its retry, so each step is bounded by loopvol instead.
	ctx = context.WithoutCancel(ctx)
	id := req.GetName()
	size := req.GetCapacityRange().GetRequiredBytes()
	vol := &csi.Volume{VolumeId: id, CapacityBytes: loopvol.Size(size), ContentSource: req.GetVolumeContentSource()}
	if _, err := os.Stat(d.imagePath(id)); err == nil {
		// A retry of a call that succeeded, or got as far as the image:
		// the sidecar lost the answer, or the driver died before mounting.
		if err := d.mountVolume(ctx, id); err != nil {
			return nil, err
		}
		return &csi.CreateVolumeResponse{Volume: vol}, nil
	}
	archive, err := d.sourceArchive(req.GetVolumeContentSource())
	if err != nil {
		return nil, err
	}
	tmpImage, err := d.buildImage(ctx, id, size, archive)
	if err != nil {
		return nil, err
	}
	b, _ := json.Marshal(volMeta{Capacity: size})
	if err := os.WriteFile(d.metaPath(id), b, 0o644); err != nil {
		return nil, status.Error(codes.Internal, err.Error())
	}
	if err := os.Rename(tmpImage, d.imagePath(id)); err != nil {
		return nil, status.Error(codes.Internal, err.Error())
	}
	if err := d.mountVolume(ctx, id); err != nil {
		return nil, err
	}
	return &csi.CreateVolumeResponse{Volume: vol}, nil
}

// sourceArchive is the tar archive of the snapshot a volume is made from,
// "" for a volume made empty.
func (d *driver) sourceArchive(src *csi.VolumeContentSource) (string, error) {
	if src == nil {
		return "", nil
	}
	snap := src.GetSnapshot()
	if snap == nil {
		return "", status.Error(codes.InvalidArgument, "only snapshots can be a volume's content source")
	}
	if err := safeID(snap.GetSnapshotId()); err != nil {
		return "", err
	}
	archive := filepath.Join(d.snaps, snap.GetSnapshotId(), "data.tar")
	if _, err := os.Stat(archive); err != nil {
		return "", status.Errorf(codes.NotFound, "snapshot %s: %v", snap.GetSnapshotId(), err)
	}
	return archive, nil
}

// buildImage formats the volume's image in the temporary folder, restores
// archive into it if given, and returns the image's path. The image
// appears under its name only when it is whole, so a crash halfway leaves
// nothing a retry could mistake for a volume. Volumes are root-owned
// 0755, like a fresh filesystem.
func (d *driver) buildImage(ctx context.Context, id string, size int64, archive string) (string, error) {
	tmpImage, tmpMount := filepath.Join(d.tmpDir(), id+".img"), filepath.Join(d.tmpDir(), id)
	if err := loopvol.Unmount(ctx, tmpMount); err != nil {
		return "", status.Error(codes.Internal, err.Error())
	}
	if err := os.RemoveAll(tmpMount); err != nil {
		return "", status.Error(codes.Internal, err.Error())
	}
	if err := loopvol.Format(ctx, tmpImage, size, 0o755); err != nil {
		return "", status.Errorf(codes.Internal, "format volume %s: %v", id, err)
	}
	if archive == "" {
		return tmpImage, nil
	}
	if err := loopvol.Mount(ctx, tmpImage, tmpMount); err != nil {
		return "", status.Errorf(codes.Internal, "mount volume %s: %v", id, err)
	}
	// tar as root keeps owners and modes, so a restored workspace belongs
	// to the sandbox user as the original did.
	out, err := exec.Command("tar", "--numeric-owner", "-xpf", archive, "-C", tmpMount).CombinedOutput()
	if uerr := loopvol.Unmount(ctx, tmpMount); err == nil && uerr != nil {
		return "", status.Errorf(codes.Internal, "unmount volume %s: %v", id, uerr)
	}
	if err != nil {
		return "", status.Errorf(codes.Internal, "restore snapshot into %s: %v: %s", id, err, out)
	}
	if err := os.Remove(tmpMount); err != nil {
		return "", status.Error(codes.Internal, err.Error())
	}
	return tmpImage, nil
}

// DeleteVolume unmounts the volume, detaches its loop device and removes
// its image. A loop device that stays attached (a publication kubelet has
// not undone yet) makes it FailedPrecondition, which the sidecar retries.
func (d *driver) DeleteVolume(ctx context.Context, req *csi.DeleteVolumeRequest) (*csi.DeleteVolumeResponse, error) {
	if err := safeID(req.GetVolumeId()); err != nil {
		return nil, err
	}
	d.mu.Lock()
	defer d.mu.Unlock()
	ctx = context.WithoutCancel(ctx)
	id := req.GetVolumeId()
	if err := loopvol.Unmount(ctx, d.volPath(id)); err != nil {
		return nil, status.Errorf(codes.Internal, "unmount volume %s: %v", id, err)
	}
	if err := loopvol.Detach(d.imagePath(id)); errors.Is(err, loopvol.ErrBusy) {
		return nil, status.Errorf(codes.FailedPrecondition, "volume %s: %v", id, err)
	} else if err != nil {
		return nil, status.Errorf(codes.Internal, "volume %s: %v", id, err)
	}
	for _, p := range []string{d.imagePath(id), d.volPath(id), d.metaPath(id)} {
		if err := os.Remove(p); err != nil && !errors.Is(err, os.ErrNotExist) {
			return nil, status.Error(codes.Internal, err.Error())
		}
	}
	return &csi.DeleteVolumeResponse{}, nil
}

func (d *driver) ValidateVolumeCapabilities(_ context.Context, req *csi.ValidateVolumeCapabilitiesRequest) (*csi.ValidateVolumeCapabilitiesResponse, error) {
	if err := safeID(req.GetVolumeId()); err != nil {
		return nil, err
	}
	if _, err := os.Stat(d.imagePath(req.GetVolumeId())); err != nil {
		return nil, status.Errorf(codes.NotFound, "volume %s", req.GetVolumeId())
	}
	for _, c := range req.GetVolumeCapabilities() {
		if c.GetBlock() != nil {
			return &csi.ValidateVolumeCapabilitiesResponse{Message: "block volumes are not supported"}, nil
		}
	}
	return &csi.ValidateVolumeCapabilitiesResponse{Confirmed: &csi.ValidateVolumeCapabilitiesResponse_Confirmed{VolumeCapabilities: req.GetVolumeCapabilities()}}, nil
}

type snapMeta struct {
	Source  string    `json:"source"`
	Created time.Time `json:"created"`
	Size    int64     `json:"size"`
}

func (d *driver) CreateSnapshot(ctx context.Context, req *csi.CreateSnapshotRequest) (*csi.CreateSnapshotResponse, error) {
	if err := safeID(req.GetName()); err != nil {
		return nil, err
	}
	if err := safeID(req.GetSourceVolumeId()); err != nil {
		return nil, err
	}
	d.mu.Lock()
	defer d.mu.Unlock()
	dir := filepath.Join(d.snaps, req.GetName())
	if b, err := os.ReadFile(filepath.Join(dir, "meta.json")); err == nil {
		var m snapMeta
		if err := json.Unmarshal(b, &m); err != nil {
			return nil, status.Error(codes.Internal, err.Error())
		}
		if m.Source != req.GetSourceVolumeId() {
			return nil, status.Errorf(codes.AlreadyExists, "snapshot %s is of volume %s", req.GetName(), m.Source)
		}
		return &csi.CreateSnapshotResponse{Snapshot: m.csi(req.GetName())}, nil
	}
	if err := d.mountVolume(context.WithoutCancel(ctx), req.GetSourceVolumeId()); err != nil {
		return nil, err
	}
	src := d.volPath(req.GetSourceVolumeId())
	var vm volMeta
	if b, err := os.ReadFile(d.metaPath(req.GetSourceVolumeId())); err == nil {
		_ = json.Unmarshal(b, &vm)
	}
	if err := os.MkdirAll(dir, 0o755); err != nil {
		return nil, status.Error(codes.Internal, err.Error())
	}
	archive := filepath.Join(dir, "data.tar")
	if out, err := exec.Command("tar", "--numeric-owner", "-cf", archive, "-C", src, ".").CombinedOutput(); err != nil {
		return nil, status.Errorf(codes.Internal, "archive volume %s: %v: %s", req.GetSourceVolumeId(), err, out)
	}
	m := snapMeta{Source: req.GetSourceVolumeId(), Created: time.Now(), Size: vm.Capacity}
	b, _ := json.Marshal(m)
	// meta.json is written last: its presence means the snapshot is whole.
	if err := os.WriteFile(filepath.Join(dir, "meta.json"), b, 0o644); err != nil {
		return nil, status.Error(codes.Internal, err.Error())
	}
	return &csi.CreateSnapshotResponse{Snapshot: m.csi(req.GetName())}, nil
}

func (m snapMeta) csi(id string) *csi.Snapshot {
	return &csi.Snapshot{SnapshotId: id, SourceVolumeId: m.Source, CreationTime: timestamppb.New(m.Created), SizeBytes: m.Size, ReadyToUse: true}
}

func (d *driver) DeleteSnapshot(_ context.Context, req *csi.DeleteSnapshotRequest) (*csi.DeleteSnapshotResponse, error) {
	if err := safeID(req.GetSnapshotId()); err != nil {
		return nil, err
	}
	d.mu.Lock()
	defer d.mu.Unlock()
	if err := os.RemoveAll(filepath.Join(d.snaps, req.GetSnapshotId())); err != nil {
		return nil, status.Error(codes.Internal, err.Error())
	}
	return &csi.DeleteSnapshotResponse{}, nil
}

// Node.

func (d *driver) NodeGetInfo(context.Context, *csi.NodeGetInfoRequest) (*csi.NodeGetInfoResponse, error) {
	return &csi.NodeGetInfoResponse{NodeId: d.node}, nil
}

func (d *driver) NodeGetCapabilities(context.Context, *csi.NodeGetCapabilitiesRequest) (*csi.NodeGetCapabilitiesResponse, error) {
	return &csi.NodeGetCapabilitiesResponse{}, nil
}

func (d *driver) NodePublishVolume(ctx context.Context, req *csi.NodePublishVolumeRequest) (*csi.NodePublishVolumeResponse, error) {
	if err := safeID(req.GetVolumeId()); err != nil {
		return nil, err
	}
	target := req.GetTargetPath()
	if target == "" {
		return nil, status.Error(codes.InvalidArgument, "no target path")
	}
	if req.GetVolumeCapability().GetBlock() != nil {
		return nil, status.Error(codes.InvalidArgument, "block volumes are not supported")
	}
	// Held so that the volume cannot be deleted between its mount and the
	// bind mount of it.
	d.mu.Lock()
	defer d.mu.Unlock()
	if err := d.mountVolume(context.WithoutCancel(ctx), req.GetVolumeId()); err != nil {
		return nil, err
	}
	src := d.volPath(req.GetVolumeId())
	if mounted(target) {
		return &csi.NodePublishVolumeResponse{}, nil
	}
	// The CO makes the parent; the target itself is the driver's.
	if err := os.MkdirAll(target, 0o750); err != nil {
		return nil, status.Error(codes.Internal, err.Error())
	}
	if err := unix.Mount(src, target, "", unix.MS_BIND, ""); err != nil {
		return nil, status.Errorf(codes.Internal, "bind %s on %s: %v", src, target, err)
	}
	if req.GetReadonly() {
		if err := unix.Mount("", target, "", unix.MS_BIND|unix.MS_REMOUNT|unix.MS_RDONLY, ""); err != nil {
			_ = unix.Unmount(target, 0)
			return nil, status.Errorf(codes.Internal, "remount %s read-only: %v", target, err)
		}
	}
	return &csi.NodePublishVolumeResponse{}, nil
}

func (d *driver) NodeUnpublishVolume(_ context.Context, req *csi.NodeUnpublishVolumeRequest) (*csi.NodeUnpublishVolumeResponse, error) {
	target := req.GetTargetPath()
	if target == "" {
		return nil, status.Error(codes.InvalidArgument, "no target path")
	}
	if mounted(target) {
		if err := unix.Unmount(target, 0); err != nil {
			return nil, status.Errorf(codes.Internal, "unmount %s: %v", target, err)
		}
	}
	if err := os.Remove(target); err != nil && !errors.Is(err, os.ErrNotExist) {
		return nil, status.Error(codes.Internal, err.Error())
	}
	return &csi.NodeUnpublishVolumeResponse{}, nil
}

// mounted reports whether path is a mount point.
func mounted(path string) bool {
	m, _ := loopvol.Mounted(path)
	return m
}
