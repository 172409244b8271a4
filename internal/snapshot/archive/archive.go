// Package archive is the snapshot driver that needs no CSI snapshots: a
// stopped sandbox's workspace is a tar archive in an object store, and a
// resumed sandbox's fresh, empty workspace is filled from it. The store is
// an S3-compatible bucket (Config.Endpoint), or a directory on a volume of
// the control plane (Config.Dir, the chart's embedded store), which works
// on any cluster with a default StorageClass and needs nothing outside it.
//
// # Why the control plane carries the bytes
//
// The archive could be uploaded by the supervisor inside the sandbox pod,
// but it is not, for two reasons:
//
//   - a sandbox has no network egress except through its egress proxy (a
//     NetworkPolicy enforces it), so the pod cannot reach the store without
//     opening a hole an agent could use too;
//   - the store's credentials would have to enter the pod, where the agent's
//     code runs; an agent could then read, overwrite or delete every other
//     sandbox's archive.
//
// So the control plane pipes the bytes: Take streams the workspace as a tar
// from the supervisor (GET /v1/files/?format=tar, over the same mTLS
// channel as every other call) straight into a multipart upload, and
// Restore streams the object back into the supervisor's tar extraction
// (PUT /v1/files/?format=tar). Neither buffers the workspace: memory is one
// multipart part (Config.PartSize) per upload in flight, and with S3
// nothing touches the control plane's disk.
//
// # Objects
//
// Snapshot name of sandbox namespace/sandbox is the object
//
//	<prefix>/<namespace>/<sandbox>/<name>.tar.gz   (Compression "gzip")
//	<prefix>/<namespace>/<sandbox>/<name>.tar      (Compression "none")
//
// in the bucket, or the file of that path under the directory.
//
// Its metadata records the sandbox's UID. A sandbox deleted and created
// again under the same name is another sandbox: Restore refuses an archive
// whose UID is not the sandbox's (snapshot.ErrNotFound), and Take replaces
// one instead of reporting it ready.
//
// # Completeness
//
// An archive becomes visible only when its write completes (an S3
// multipart upload completes; a directory's temporary file is renamed into
// place, see dirStore), and the write completes only after the whole tar
// has passed through: every entry read to its end and the end-of-archive
// marker seen, and the supervisor's response ended cleanly (the supervisor
// cuts the connection when it cannot finish a tar, so a cut stream is an
// error, not an early end). A failed write is discarded; one left behind by
// a control plane that died half-way is invisible to readers, removed
// before the next attempt at the same key, and in a bucket should also be
// reaped by a lifecycle rule (AbortIncompleteMultipartUpload). So an object
// that exists is a whole archive, and Take's "ready" is simply "the object
// exists and is this sandbox's".
//
// # Compression
//
// Archives are gzip-compressed by default (klauspost/compress, level
// BestSpeed). Workspaces are mostly source code, dependencies and build
// output, which shrink several times; BenchmarkArchiveRoundTrip measures
// what the compression costs on incompressible data (see the README of
// the benchmark's results in the package test). Compression "none" stores
// the plain tar, for stores that compress or deduplicate by themselves.
package archive

import (
	"context"
	"errors"
	"fmt"
	"io"
	"path"
	"strings"
	"sync"
	"time"

	"github.com/klauspost/compress/gzip"
	corev1 "k8s.io/api/core/v1"

	"github.com/agentbox/terraform-provider-agentbox/internal/api/v1alpha1"
	"github.com/agentbox/terraform-provider-agentbox/internal/objectstore"
	"github.com/agentbox/terraform-provider-agentbox/internal/snapshot"
	"github.com/agentbox/terraform-provider-agentbox/internal/supervisor/supervisorapi"
)

// Name is the driver's name as the chart selects it.
const Name = "archive"

// Compression of the archives.
type Compression string

const (
	CompressionGzip Compression = "gzip"
	CompressionNone Compression = "none"
)

func (c Compression) ext() string {
	if c == CompressionGzip {
		return ".tar.gz"
	}
	return ".tar"
}

func (c Compression) format() string {
	if c == CompressionGzip {
		return "tar+gzip"
	}
	return "tar"
}

func (c Compression) contentType() string {
	if c == CompressionGzip {
		// Not Content-Encoding: gzip, which HTTP clients may undo on the
		// way down without saying so.
		return "application/gzip"
	}
	return supervisorapi.ContentTypeTar
}

// workspaceRoot is the workspace itself in the supervisor's file API
// (relative paths; an absolute "/" would be outside the workspace).
const workspaceRoot = ""

// Object metadata keys (sent as x-amz-meta-<key>).
const (
	metaSandboxUID = "Agentbox-Sandbox-Uid"
	metaSandbox    = "Agentbox-Sandbox"
	metaSnapshot   = "Agentbox-Snapshot"
	metaFormat     = "Agentbox-Format"
)

// Driver stores workspace snapshots as archives in an object store.
// It is safe for concurrent use.
type Driver struct {
	cfg    Config
	store  objectstore.Store
	prefix string

	// base is the context of the background uploads; Close cancels it.
	base   context.Context
	cancel context.CancelFunc

	mu      sync.Mutex
	uploads map[string]*upload // by object key
}

var (
	_ snapshot.Driver     = (*Driver)(nil)
	_ snapshot.Checker    = (*Driver)(nil)
	_ snapshot.StoreNamer = (*Driver)(nil)
)

// upload is one archive being written in the background.
type upload struct {
	uid    string
	cancel context.CancelFunc
	done   chan struct{}
	// Set before done is closed.
	state snapshot.State
	err   error
}

// Name implements snapshot.Driver.
func (d *Driver) Name() string { return Name }

// Store is the kind of store the archives are in: StoreS3 or
// StoreEmbedded. A snapshot records it with the driver's name, since an
// archive in one store cannot be restored from the other.
func (d *Driver) Store() string { return d.store.Kind() }

// ObjectStore is the store the archives are in, for the platform's other
// objects (run artifacts), which go under keys of their own below
// Prefix.
func (d *Driver) ObjectStore() objectstore.Store { return d.store }

// Prefix is the configured key prefix without its surrounding slashes;
// "" means none.
func (d *Driver) Prefix() string { return d.prefix }

// Check verifies that the store can take archives: the bucket answers and
// exists, or the directory is writable. The control plane runs it at start
// and then periodically, so that a misconfiguration shows before the first
// idle stop needs the store.
func (d *Driver) Check(ctx context.Context) error {
	if err := d.store.Check(ctx); err != nil {
		return &snapshot.Problem{Reason: v1alpha1.ReasonSnapshotStoreUnavailable, Message: "archive: " + err.Error()}
	}
	return nil
}

// Close cancels the uploads in flight. Like a crash, it leaves them
// incomplete and invisible; the next Take of the same snapshot starts
// again.
func (d *Driver) Close() {
	d.cancel()
}

// Key returns the object key of snapshot name of sandbox with the driver's
// compression.
func (d *Driver) Key(sandbox *v1alpha1.Sandbox, name string) string {
	return d.key(sandbox, name, d.cfg.Compression)
}

func (d *Driver) key(sandbox *v1alpha1.Sandbox, name string, c Compression) string {
	return path.Join(d.prefix, sandbox.Namespace, sandbox.Name, name+c.ext())
}

// Bucket returns the configured bucket; "" for a directory.
func (d *Driver) Bucket() string { return d.cfg.Bucket }

// Location names where snapshot name of sandbox is, or would be, kept:
// s3://bucket/key, or the file's path.
func (d *Driver) Location(sandbox *v1alpha1.Sandbox, name string) string {
	return d.store.Location(d.Key(sandbox, name))
}

func checkName(sandbox *v1alpha1.Sandbox, name string) error {
	if sandbox == nil || sandbox.Namespace == "" || sandbox.Name == "" {
		return errors.New("archive: the sandbox (with its namespace and name) is required")
	}
	if sandbox.UID == "" {
		return fmt.Errorf("archive: sandbox %s/%s has no UID", sandbox.Namespace, sandbox.Name)
	}
	if name == "" || name == "." || name == ".." || strings.ContainsAny(name, "/\x00") || len(name) > 253 {
		return fmt.Errorf("archive: snapshot name %q must be a non-empty path segment of at most 253 bytes", name)
	}
	return nil
}

// Take implements snapshot.Driver. The first call starts the upload in the
// background and waits up to Config.TakeWait for it; later calls wait for
// the same upload again, or find the finished object. An upload that
// failed is reported once, as an error, and the next call starts over.
func (d *Driver) Take(ctx context.Context, req snapshot.Request) (snapshot.State, error) {
	if err := checkName(req.Sandbox, req.Name); err != nil {
		return snapshot.State{}, err
	}
	key := d.Key(req.Sandbox, req.Name)
	uid := string(req.Sandbox.UID)

	u := d.running(key, uid)
	if u == nil {
		st, found, err := d.stat(ctx, key, uid)
		if err != nil {
			return snapshot.State{}, err
		}
		if found {
			// Checked before the supervisor: a pass that repeats a finished
			// stop (after a restart, or from a cache that has not seen the
			// stop's status yet) finds the pod gone, and must still see the
			// snapshot ready rather than fail for want of a pod.
			return st, nil
		}
		if req.Supervisor == nil {
			return snapshot.State{}, errors.New("archive: Take needs the sandbox's supervisor: the pod is not serving and the archive does not exist yet")
		}
		u = d.start(key, uid, req)
	}

	timer := time.NewTimer(d.cfg.TakeWait)
	defer timer.Stop()
	select {
	case <-u.done:
	case <-timer.C:
		return snapshot.State{}, nil
	case <-ctx.Done():
		return snapshot.State{}, fmt.Errorf("archive: waiting for the upload of %s: %w", key, ctx.Err())
	}
	d.mu.Lock()
	if d.uploads[key] == u {
		delete(d.uploads, key)
	}
	d.mu.Unlock()
	return u.state, u.err
}

// running returns the upload in flight (or finished, not yet reported) for
// key, after cancelling one that belongs to another sandbox of the same
// name.
func (d *Driver) running(key, uid string) *upload {
	d.mu.Lock()
	defer d.mu.Unlock()
	u := d.uploads[key]
	if u != nil && u.uid != uid {
		u.cancel()
		delete(d.uploads, key)
		return nil
	}
	return u
}

// start begins an upload unless another call just did.
func (d *Driver) start(key, uid string, req snapshot.Request) *upload {
	d.mu.Lock()
	defer d.mu.Unlock()
	if u := d.uploads[key]; u != nil && u.uid == uid {
		return u
	}
	ctx, cancel := context.WithTimeout(d.base, d.cfg.UploadTimeout)
	u := &upload{uid: uid, cancel: cancel, done: make(chan struct{})}
	d.uploads[key] = u
	go func() {
		defer cancel()
		u.state, u.err = d.upload(ctx, key, req)
		close(u.done)
	}()
	return u
}

// stat reports whether key holds sandbox uid's complete archive.
func (d *Driver) stat(ctx context.Context, key, uid string) (snapshot.State, bool, error) {
	info, err := d.store.Stat(ctx, key)
	if errors.Is(err, objectstore.ErrNotFound) {
		return snapshot.State{}, false, nil
	}
	if err != nil {
		return snapshot.State{}, false, fmt.Errorf("archive: stat %s: %w", d.store.Location(key), err)
	}
	if objectstore.MetaValue(info.Meta, metaSandboxUID) != uid {
		// A predecessor's archive under the same names; it is replaced.
		return snapshot.State{}, false, nil
	}
	return snapshot.State{Ready: true, SizeBytes: info.Size, ReadyTime: info.ModTime}, true, nil
}

// upload streams the workspace into key and returns the finished object's
// state.
func (d *Driver) upload(ctx context.Context, key string, req snapshot.Request) (snapshot.State, error) {
	// A control plane that died half-way left an incomplete upload behind;
	// it is invisible, but holds storage until removed.
	_ = d.store.RemoveIncomplete(ctx, key)

	body, err := req.Supervisor.GetTar(ctx, workspaceRoot)
	if err != nil {
		if supervisorapi.CodeOf(err) == supervisorapi.CodeNotFound {
			// The pod has no workspace: no retry will give it one.
			return snapshot.State{Failed: fmt.Sprintf("the supervisor has no workspace to archive: %v", err)}, nil
		}
		return snapshot.State{}, fmt.Errorf("archive: read the workspace of sandbox %s/%s: %w", req.Sandbox.Namespace, req.Sandbox.Name, err)
	}
	defer body.Close()

	pr, pw := io.Pipe()
	produced := make(chan error, 1)
	go func() {
		err := d.encode(pw, body)
		// nil closes the pipe with io.EOF: only a whole tar completes the
		// upload.
		pw.CloseWithError(err)
		produced <- err
	}()
	meta := map[string]string{
		metaSandboxUID: string(req.Sandbox.UID),
		metaSandbox:    req.Sandbox.Namespace + "/" + req.Sandbox.Name,
		metaSnapshot:   req.Name,
		metaFormat:     d.cfg.Compression.format(),
	}
	putErr := d.store.Put(ctx, key, pr, -1, objectstore.PutOptions{Meta: meta, ContentType: d.cfg.Compression.contentType(), PartSize: d.cfg.PartSize})
	// Unblock the producer if the upload stopped reading first.
	pr.CloseWithError(errConsumerDone)
	prodErr := <-produced
	switch {
	case prodErr != nil && !errors.Is(prodErr, errConsumerDone):
		// The root cause: the upload failed because its input did.
		return snapshot.State{}, fmt.Errorf("archive: stream the workspace of sandbox %s/%s: %w", req.Sandbox.Namespace, req.Sandbox.Name, prodErr)
	case putErr != nil:
		return snapshot.State{}, fmt.Errorf("archive: write %s: %w", d.store.Location(key), putErr)
	case prodErr != nil:
		return snapshot.State{}, fmt.Errorf("archive: the write of %s ended before the workspace's tar did", d.store.Location(key))
	}
	st, found, err := d.stat(ctx, key, string(req.Sandbox.UID))
	if err != nil {
		return snapshot.State{}, err
	}
	if !found {
		return snapshot.State{}, fmt.Errorf("archive: %s is missing right after its write completed", d.store.Location(key))
	}
	return st, nil
}

// encode copies the supervisor's tar to w, compressed as configured, and
// fails unless the tar is whole and its HTTP response ended cleanly.
func (d *Driver) encode(w io.Writer, body io.Reader) error {
	var zw *gzip.Writer
	if d.cfg.Compression == CompressionGzip {
		zw, _ = gzip.NewWriterLevel(w, gzip.BestSpeed) // the level is valid
		w = zw
	}
	if _, err := copyTar(w, body); err != nil {
		return err
	}
	// Nothing meaningful follows the end-of-archive marker, but the
	// response must still end: a cut connection is an error here, not EOF.
	if _, err := io.Copy(io.Discard, body); err != nil {
		return fmt.Errorf("after the end of the tar: %w", err)
	}
	if zw != nil {
		return zw.Close()
	}
	return nil
}

// PrepareClaim implements snapshot.Driver: the claim starts empty and
// Restore fills it.
func (d *Driver) PrepareClaim(*v1alpha1.SandboxSnapshot, *corev1.PersistentVolumeClaim) {}

// Restore implements snapshot.Driver: it streams the archive into the
// workspace through the supervisor. The archive may have been written with
// either compression (the configuration may have changed since). An archive
// that is missing, or belongs to another sandbox of the same name, is
// snapshot.ErrNotFound.
func (d *Driver) Restore(ctx context.Context, req snapshot.RestoreRequest) error {
	if req.Snapshot == nil {
		return errors.New("archive: Restore needs the snapshot")
	}
	if err := checkName(req.Sandbox, req.Snapshot.Name); err != nil {
		return err
	}
	if req.Supervisor == nil {
		return errors.New("archive: Restore needs the sandbox's supervisor")
	}
	key, comp, info, err := d.find(ctx, req.Sandbox, req.Snapshot.Name)
	if err != nil {
		return err
	}
	where := d.store.Location(key)
	if got := objectstore.MetaValue(info.Meta, metaSandboxUID); got != string(req.Sandbox.UID) {
		return fmt.Errorf("archive: %s belongs to sandbox UID %q, not %s/%s (UID %s), an earlier sandbox of the same name: %w",
			where, got, req.Sandbox.Namespace, req.Sandbox.Name, req.Sandbox.UID, snapshot.ErrNotFound)
	}
	obj, err := d.store.Get(ctx, key, info)
	if err != nil {
		return fmt.Errorf("archive: read %s: %w", where, err)
	}
	defer obj.Close()

	pr, pw := io.Pipe()
	produced := make(chan error, 1)
	go func() {
		err := decode(pw, obj, comp)
		pw.CloseWithError(err)
		produced <- err
	}()
	_, putErr := req.Supervisor.RestoreTar(ctx, workspaceRoot, pr)
	pr.CloseWithError(errConsumerDone)
	prodErr := <-produced
	switch {
	case prodErr != nil && !errors.Is(prodErr, errConsumerDone):
		// The root cause: the extraction failed because its input did,
		// or the archive's checksum is wrong.
		return fmt.Errorf("archive: read %s: %w", where, prodErr)
	case putErr != nil:
		return fmt.Errorf("archive: extract %s into sandbox %s/%s: %w", where, req.Sandbox.Namespace, req.Sandbox.Name, putErr)
	case prodErr != nil:
		return fmt.Errorf("archive: the supervisor finished extracting %s before the archive ended", where)
	}
	return nil
}

// errConsumerDone closes a pipe whose reader (the upload, the extraction)
// has returned, so that its writer does not block.
var errConsumerDone = errors.New("the consumer of the stream has returned")

// decode copies the tar in src, decompressed, to w, and fails unless the
// tar is whole and, compressed, its checksum is right.
func decode(w io.Writer, src io.Reader, comp Compression) error {
	r := src
	var zr *gzip.Reader
	if comp == CompressionGzip {
		var err error
		if zr, err = gzip.NewReader(src); err != nil {
			return fmt.Errorf("gzip: %w", err)
		}
		r = zr
	}
	if _, err := copyTar(w, r); err != nil {
		return err
	}
	// Reading to the end checks the gzip trailer's CRC and length.
	if _, err := io.Copy(io.Discard, r); err != nil {
		return fmt.Errorf("after the end of the tar: %w", err)
	}
	if zr != nil {
		return zr.Close()
	}
	return nil
}

// find stats the snapshot's object with the configured compression first,
// then the other.
func (d *Driver) find(ctx context.Context, sandbox *v1alpha1.Sandbox, name string) (string, Compression, objectstore.Info, error) {
	comps := []Compression{d.cfg.Compression, CompressionNone}
	if d.cfg.Compression == CompressionNone {
		comps[1] = CompressionGzip
	}
	for _, c := range comps {
		key := d.key(sandbox, name, c)
		info, err := d.store.Stat(ctx, key)
		if errors.Is(err, objectstore.ErrNotFound) {
			continue
		}
		if err != nil {
			return "", "", objectstore.Info{}, fmt.Errorf("archive: stat %s: %w", d.store.Location(key), err)
		}
		return key, c, info, nil
	}
	// A HEAD on a missing bucket looks like a missing key, and so does a
	// directory whose volume is not mounted; either is a configuration
	// problem to fix and retry, not a lost snapshot.
	if err := d.Check(ctx); err != nil {
		return "", "", objectstore.Info{}, err
	}
	return "", "", objectstore.Info{}, fmt.Errorf("archive: no archive of snapshot %s of sandbox %s/%s at %s: %w",
		name, sandbox.Namespace, sandbox.Name, d.store.Location(d.key(sandbox, name, d.cfg.Compression)), snapshot.ErrNotFound)
}

// Delete implements snapshot.Driver: it cancels an upload in flight and
// removes the archive in either compression, and any incomplete upload.
func (d *Driver) Delete(ctx context.Context, sandbox *v1alpha1.Sandbox, name string) error {
	if sandbox == nil || sandbox.Namespace == "" || sandbox.Name == "" {
		return errors.New("archive: the sandbox (with its namespace and name) is required")
	}
	if name == "" || name == "." || name == ".." || strings.ContainsAny(name, "/\x00") {
		return fmt.Errorf("archive: snapshot name %q is not a path segment", name)
	}
	var errs []error
	for _, c := range []Compression{CompressionGzip, CompressionNone} {
		key := d.key(sandbox, name, c)
		d.mu.Lock()
		if u := d.uploads[key]; u != nil {
			u.cancel()
			delete(d.uploads, key)
			d.mu.Unlock()
			<-u.done // so that it cannot complete after the removal
		} else {
			d.mu.Unlock()
		}
		if err := d.store.Remove(ctx, key); err != nil {
			errs = append(errs, fmt.Errorf("archive: delete %s: %w", d.store.Location(key), err))
		}
		if err := d.store.RemoveIncomplete(ctx, key); err != nil {
			errs = append(errs, fmt.Errorf("archive: remove incomplete writes of %s: %w", d.store.Location(key), err))
		}
	}
	return errors.Join(errs...)
}
