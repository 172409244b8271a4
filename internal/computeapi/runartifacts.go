package computeapi

import (
	"context"
	"crypto/sha256"
	"encoding/hex"
	"errors"
	"fmt"
	"hash"
	"io"
	"net/http"
	"path"
	"strconv"
	"strings"
	"time"

	"github.com/go-logr/logr"
	"github.com/prometheus/client_golang/prometheus"
	"sigs.k8s.io/controller-runtime/pkg/metrics"

	api "github.com/agentbox/terraform-provider-agentbox/internal/computeapi/client"
	"github.com/agentbox/terraform-provider-agentbox/internal/objectstore"
	"github.com/agentbox/terraform-provider-agentbox/internal/store"
	"github.com/agentbox/terraform-provider-agentbox/internal/supervisor/supervisorapi"
	"github.com/agentbox/terraform-provider-agentbox/internal/supervisor/workspace"
)

// A run's artifacts: once its command has ended, the executor reads the
// files under the run's artifact paths through the sandbox's supervisor
// (the same mTLS channel as every file call) and streams each into the
// platform's object store, the one the archive snapshot driver keeps the
// workspaces in, under <prefix>/_runs/<run-id>/<path>. Each file is
// recorded, with an artifact event, before the run's end is, so that a
// client that sees the end can list and read them. The sandbox never
// holds the store's credentials (see the archive package for why the
// control plane carries the bytes).

const (
	// DefaultRunArtifactMaxFileBytes and DefaultRunArtifactMaxRunBytes
	// bound one artifact and a run's artifacts together; a file past
	// either is recorded with an error, not uploaded, and the others are.
	DefaultRunArtifactMaxFileBytes = 1 << 30
	DefaultRunArtifactMaxRunBytes  = 4 << 30
	// maxArtifactFiles bounds the files one run keeps: past it, the rest
	// are not looked at, and the collection says so.
	maxArtifactFiles = 1000
	// maxArtifactPatterns bounds the paths a run's start may name.
	maxArtifactPatterns = 32
	// artifactCollectTimeout bounds a run's whole collection; the run
	// heartbeats meanwhile.
	artifactCollectTimeout = 30 * time.Minute
	// artifactListTimeout bounds one listing call to the supervisor.
	artifactListTimeout = 30 * time.Second
	// artifactKeyDir is the folder of the runs' objects under the store's
	// prefix. A Kubernetes namespace (the archives' first folder) cannot
	// be named with an underscore, so the two never meet.
	artifactKeyDir = "_runs"
	// metaArtifactRun and metaArtifactPath are the objects' metadata.
	metaArtifactRun  = "Agentbox-Run"
	metaArtifactPath = "Agentbox-Artifact-Path"
)

var (
	metricArtifactBytes = prometheus.NewCounter(prometheus.CounterOpts{
		Name: "agentbox_run_artifact_bytes_total",
		Help: "Bytes of run artifacts this replica's executors uploaded to the object store.",
	})
	metricArtifactsDeleted = prometheus.NewCounter(prometheus.CounterOpts{
		Name: "agentbox_run_artifacts_deleted_total",
		Help: "Objects of run artifacts this replica's sweeper deleted from the object store once their runs were past the run retention.",
	})
	metricArtifactDeletedBytes = prometheus.NewCounter(prometheus.CounterOpts{
		Name: "agentbox_run_artifacts_deleted_bytes_total",
		Help: "Bytes of the run artifact objects this replica's sweeper deleted.",
	})
)

func init() {
	metrics.Registry.MustRegister(metricArtifactBytes, metricArtifactsDeleted, metricArtifactDeletedBytes)
}

// RunArtifactsOptions say where runs' artifacts go and how much of them.
type RunArtifactsOptions struct {
	// Store is the platform's object store; nil keeps no artifacts, and
	// each run that had some records Unavailable as the reason.
	Store objectstore.Store
	// Prefix is put in front of the keys (the archive driver's prefix).
	Prefix string
	// Unavailable says why there is no Store, for the runs' records.
	Unavailable string
	// MaxFileBytes and MaxRunBytes bound one artifact and a run's
	// artifacts together; they default to DefaultRunArtifactMaxFileBytes
	// and DefaultRunArtifactMaxRunBytes.
	MaxFileBytes, MaxRunBytes int64
}

func (o RunArtifactsOptions) withDefaults() RunArtifactsOptions {
	o.Prefix = strings.Trim(o.Prefix, "/")
	o.MaxFileBytes = positiveOr(o.MaxFileBytes, DefaultRunArtifactMaxFileBytes)
	o.MaxRunBytes = positiveOr(o.MaxRunBytes, DefaultRunArtifactMaxRunBytes)
	if o.Unavailable == "" {
		o.Unavailable = "the control plane has no object store to keep run artifacts in"
	}
	return o
}

// runPrefix is the key prefix of a run's objects, ending in a slash.
func (o RunArtifactsOptions) runPrefix(runID string) string {
	return path.Join(o.Prefix, artifactKeyDir, runID) + "/"
}

// artifactPatterns checks and cleans the artifact paths of a run's start:
// workspace paths, absolute under the workspace or relative to it, whose
// segments may be globs. They are recorded relative to the workspace.
func artifactPatterns(in []string) ([]string, *api.Error) {
	if len(in) > maxArtifactPatterns {
		return nil, api.Errorf(api.CodeInvalidArgument, "a run names at most %d artifact paths, got %d", maxArtifactPatterns, len(in))
	}
	out := make([]string, 0, len(in))
	for _, p := range in {
		rel, err := artifactRel(p)
		if err != nil {
			return nil, api.Errorf(api.CodeInvalidArgument, "artifact path %q: %v", p, err)
		}
		out = append(out, rel)
	}
	return out, nil
}

// artifactRel is p relative to the workspace, cleaned; its globs are
// checked.
func artifactRel(p string) (string, error) {
	if p == "" || strings.ContainsAny(p, "\x00\\") {
		return "", errors.New("empty, or with a NUL byte or a backslash")
	}
	if path.IsAbs(p) {
		root := workspace.Default + "/"
		if p != workspace.Default && !strings.HasPrefix(p, root) {
			return "", fmt.Errorf("an absolute path must be under %s", workspace.Default)
		}
		p = strings.TrimPrefix(strings.TrimPrefix(p, workspace.Default), "/")
	}
	p = path.Clean("./" + p)
	if p == ".." || strings.HasPrefix(p, "../") {
		return "", errors.New("leads out of the workspace")
	}
	if _, err := path.Match(p, ""); err != nil {
		return "", fmt.Errorf("malformed glob: %w", err)
	}
	return p, nil
}

// artifactFile is a file found under a run's artifact paths.
type artifactFile struct {
	path string
	size int64
}

// artifactFinder expands a run's artifact paths into files through the
// supervisor's listing, without following symbolic links.
type artifactFinder struct {
	sup   *supervisorapi.Client
	seen  map[string]bool
	files []artifactFile
	// more is set when files past maxArtifactFiles were left out.
	more bool
}

func (f *artifactFinder) add(p string, size int64) {
	if f.seen[p] {
		return
	}
	if len(f.files) >= maxArtifactFiles {
		f.more = true
		return
	}
	f.seen[p] = true
	f.files = append(f.files, artifactFile{path: p, size: size})
}

// find expands one pattern. A path that does not exist is no artifact,
// not an error: the default path is looked at in every run.
func (f *artifactFinder) find(ctx context.Context, pattern string) error {
	if pattern == "." {
		return f.walk(ctx, ".")
	}
	return f.match(ctx, ".", strings.Split(pattern, "/"))
}

// match finds what the pattern's segments rest name under dir.
func (f *artifactFinder) match(ctx context.Context, dir string, rest []string) error {
	seg := rest[0]
	if !hasMeta(seg) {
		p := path.Join(dir, seg)
		if len(rest) > 1 {
			return f.match(ctx, p, rest[1:])
		}
		lctx, cancel := context.WithTimeout(ctx, artifactListTimeout)
		fi, err := f.sup.Stat(lctx, p)
		cancel()
		switch {
		case missing(err):
			return nil
		case err != nil:
			return fmt.Errorf("stat %s: %w", p, err)
		case fi.IsDir:
			return f.walk(ctx, p)
		case !fi.IsSymlink:
			f.add(p, fi.Size)
		}
		return nil
	}
	entries, err := f.list(ctx, dir)
	if err != nil || entries == nil {
		return err
	}
	for _, e := range entries {
		if ok, _ := path.Match(seg, e.Name); !ok || e.IsSymlink {
			continue
		}
		p := path.Join(dir, e.Name)
		switch {
		case len(rest) > 1 && e.IsDir:
			err = f.match(ctx, p, rest[1:])
		case len(rest) > 1:
		case e.IsDir:
			err = f.walk(ctx, p)
		default:
			f.add(p, e.Size)
		}
		if err != nil {
			return err
		}
	}
	return nil
}

// walk adds every regular file under dir.
func (f *artifactFinder) walk(ctx context.Context, dir string) error {
	entries, err := f.list(ctx, dir)
	if err != nil {
		return err
	}
	for _, e := range entries {
		if f.more {
			return nil
		}
		p := path.Join(dir, e.Name)
		switch {
		case e.IsSymlink:
		case e.IsDir:
			if err := f.walk(ctx, p); err != nil {
				return err
			}
		default:
			f.add(p, e.Size)
		}
	}
	return nil
}

// list returns dir's entries; nil for a directory that does not exist.
func (f *artifactFinder) list(ctx context.Context, dir string) ([]supervisorapi.FileInfo, error) {
	lctx, cancel := context.WithTimeout(ctx, artifactListTimeout)
	defer cancel()
	res, err := f.sup.List(lctx, dir)
	if missing(err) {
		return nil, nil
	}
	if err != nil {
		return nil, fmt.Errorf("list %s: %w", dir, err)
	}
	return res.Entries, nil
}

// missing reports whether err says the path is not there (or is not a
// directory where one was looked into).
func missing(err error) bool {
	switch supervisorapi.CodeOf(err) {
	case supervisorapi.CodeNotFound, supervisorapi.CodeNotADirectory:
		return true
	}
	return false
}

func hasMeta(seg string) bool { return strings.ContainsAny(seg, `*?[`) }

// collectRunArtifacts keeps a run's artifacts once its command has ended
// (cmdErr is how the supervisor's call ended): it is called at the end of
// the attempt, before the run's end is recorded. The output's last lines
// are written first, so that the log has them before the artifacts. A
// command that never ran (the supervisor failed the call, and no cancel
// stopped it) has none; a run lost to another replica, or a control plane
// shutting down, records nothing more. Failures go into the run's
// record, never into its status.
func (s *Server) collectRunArtifacts(ctx context.Context, run store.Run, sup *supervisorapi.Client, output *runOutput, cmdErr error, log logr.Logger) {
	output.close()
	var c cancelled
	cause := context.Cause(ctx)
	switch {
	case errors.Is(cause, errRunLost), errors.Is(cause, errServerClosing):
		return
	case cmdErr != nil && !errors.As(cause, &c):
		return
	}
	// A cancel that stopped the command does not stop the collection;
	// losing the run or a shutdown do.
	cctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), artifactCollectTimeout)
	defer cancel()
	stop := context.AfterFunc(ctx, func() {
		if cause := context.Cause(ctx); errors.Is(cause, errRunLost) || errors.Is(cause, errServerClosing) {
			cancel()
		}
	})
	defer stop()
	// The attempt's heartbeats end with a cancel; the run is kept alive
	// here while its artifacts upload.
	beat := make(chan struct{})
	defer func() { <-beat }()
	defer cancel()
	go func() {
		defer close(beat)
		s.keepRunAlive(cctx, cancel, run.ID)
	}()
	log = log.WithName("artifacts")
	o := s.artifacts
	end := func(state, message string) {
		ectx, done := context.WithTimeout(context.WithoutCancel(ctx), runStoreTimeout)
		defer done()
		if err := s.store.EndRunArtifacts(ectx, run.ID, state, message); err != nil {
			log.Error(err, "record the end of the artifacts' collection")
			return
		}
		if message != "" {
			s.runNotes.notify(run.ID)
		}
	}

	patterns := run.Command.Artifacts
	explicit := len(patterns) > 0
	if !explicit {
		patterns = []string{strings.TrimPrefix(strings.TrimPrefix(api.DefaultRunArtifactPath, workspace.Default), "/")}
	}
	finder := &artifactFinder{sup: sup, seen: map[string]bool{}}
	for _, p := range patterns {
		if err := finder.find(cctx, p); err != nil {
			log.Info("could not look for the run's artifacts", "err", err.Error())
			end(store.ArtifactsNotKept, fmt.Sprintf("the artifacts could not be looked for in the sandbox: %v", err))
			return
		}
	}
	if len(finder.files) == 0 {
		if explicit {
			end(store.ArtifactsCollected, "")
		}
		return
	}
	if o.Store == nil {
		end(store.ArtifactsNotKept, fmt.Sprintf("%d file(s) under the artifact paths were not kept: %s", len(finder.files), o.Unavailable))
		return
	}
	prefix := o.runPrefix(run.ID)
	bctx, done := context.WithTimeout(cctx, runStoreTimeout)
	err := s.store.BeginRunArtifacts(bctx, run.ID, o.Store.Kind(), prefix)
	done()
	if err != nil {
		log.Error(err, "record the start of the artifacts' collection")
		return
	}
	var total int64
	for _, f := range finder.files {
		a := store.RunArtifact{RunID: run.ID, Path: f.path, Size: f.size}
		switch {
		case f.size > o.MaxFileBytes:
			a.Error = fmt.Sprintf("not uploaded: %d bytes is over the per-file limit of %d bytes", f.size, o.MaxFileBytes)
		case total+f.size > o.MaxRunBytes:
			a.Error = fmt.Sprintf("not uploaded: %d bytes would take the run's artifacts past their limit of %d bytes (%d already uploaded)",
				f.size, o.MaxRunBytes, total)
		default:
			a = s.uploadArtifact(cctx, sup, run.ID, prefix+f.path, f, log)
			if a.Error == "" {
				total += a.Size
			}
		}
		if cctx.Err() != nil && a.Error != "" {
			// Lost, shut down or out of time: the rest is not tried.
			break
		}
		rctx, done := context.WithTimeout(cctx, runStoreTimeout)
		_, err := s.store.RecordRunArtifact(rctx, a)
		done()
		if err != nil {
			log.Error(err, "record a run artifact", "path", a.Path)
			if a.Error == "" {
				// Not recorded, it would be found by no one but
				// retention; it goes now.
				_ = o.Store.Remove(context.WithoutCancel(cctx), a.ObjectKey)
			}
			if errors.Is(err, store.ErrRunFinished) || errors.Is(err, store.ErrNotFound) {
				return
			}
			continue
		}
		s.runNotes.notify(run.ID)
	}
	switch {
	case cctx.Err() != nil:
		end(store.ArtifactsCollected, fmt.Sprintf("the collection stopped before every file was uploaded: %v", context.Cause(cctx)))
	case finder.more:
		end(store.ArtifactsCollected, fmt.Sprintf("only the first %d files under the artifact paths were looked at", maxArtifactFiles))
	default:
		end(store.ArtifactsCollected, "")
	}
	log.V(1).Info("run artifacts collected", "files", len(finder.files), "bytes", total)
}

// keepRunAlive heartbeats the run until ctx ends, whatever cancel was
// asked for, and ends ctx (stop) when the run is no longer this
// executor's.
func (s *Server) keepRunAlive(ctx context.Context, stop context.CancelFunc, id string) {
	t := time.NewTicker(s.runHeartbeat)
	defer t.Stop()
	for {
		select {
		case <-ctx.Done():
			return
		case <-t.C:
		}
		hctx, done := context.WithTimeout(context.WithoutCancel(ctx), runStoreTimeout)
		_, err := s.store.HeartbeatRun(hctx, id, s.replica)
		done()
		if errors.Is(err, store.ErrConflict) || errors.Is(err, store.ErrNotFound) {
			stop()
			return
		}
	}
}

// uploadArtifact streams one file from the sandbox into key and returns
// its record: uploaded with its digest, or with the error that kept it
// out. Nothing of the file is held in memory but the store's part.
func (s *Server) uploadArtifact(ctx context.Context, sup *supervisorapi.Client, runID, key string, f artifactFile, log logr.Logger) store.RunArtifact {
	a := store.RunArtifact{RunID: runID, Path: f.path, Size: f.size}
	st := s.artifacts.Store
	if st.Kind() == objectstore.KindEmbedded {
		if err := objectstore.CheckKey(key); err != nil {
			a.Error = "not uploaded: the embedded store cannot hold this name (a segment starts with a dot)"
			return a
		}
	}
	body, err := sup.GetFile(ctx, f.path)
	if err != nil {
		a.Error = fmt.Sprintf("not uploaded: could not read it in the sandbox: %v", err)
		return a
	}
	defer body.Close()
	h := sha256.New()
	src := &hashingReader{r: io.LimitReader(body, f.size), h: h}
	err = st.Put(ctx, key, src, f.size, objectstore.PutOptions{
		Meta:        map[string]string{metaArtifactRun: runID, metaArtifactPath: f.path},
		ContentType: "application/octet-stream",
	})
	if err == nil && src.n != f.size {
		err = fmt.Errorf("the file shrank from %d to %d bytes while it was read", f.size, src.n)
		_ = st.Remove(context.WithoutCancel(ctx), key)
	}
	if err != nil {
		_ = st.RemoveIncomplete(context.WithoutCancel(ctx), key)
		log.Info("run artifact not uploaded", "path", f.path, "err", err.Error())
		a.Error = fmt.Sprintf("not uploaded: %v", err)
		return a
	}
	now := time.Now().UTC()
	a.SHA256, a.ObjectKey, a.UploadedAt = hex.EncodeToString(h.Sum(nil)), key, &now
	metricArtifactBytes.Add(float64(f.size))
	return a
}

// hashingReader hashes and counts what passes through it.
type hashingReader struct {
	r io.Reader
	h hash.Hash
	n int64
}

func (r *hashingReader) Read(p []byte) (int, error) {
	n, err := r.r.Read(p)
	r.h.Write(p[:n])
	r.n += int64(n)
	return n, err
}

// deleteExpiredArtifacts deletes, before pruneRuns deletes their runs, the
// objects of the artifacts of runs that finished before bound, and
// records each run whose objects are all gone, so that the store lets its
// record go. A run whose objects could not all be deleted keeps its record
// (which is what finds them) until a later prune.
func (s *Server) deleteExpiredArtifacts(bound, now time.Time, log logr.Logger) {
	st := s.artifacts.Store
	for {
		ctx, done := context.WithTimeout(context.Background(), runStoreTimeout)
		todo, err := s.store.RunArtifactsToDelete(ctx, bound, now, 100)
		done()
		if err != nil {
			log.Error(err, "list the expired runs' artifacts")
			return
		}
		if len(todo) == 0 {
			return
		}
		if st == nil {
			log.Info("runs past their retention have artifacts, but the control plane has no object store to delete them from; their records are kept",
				"runs", len(todo))
			return
		}
		forgotten := 0
		for _, c := range todo {
			if c.Store != st.Kind() {
				log.Info("a run's artifacts are in another kind of object store than the control plane's; their records are kept",
					"run", c.RunID, "store", c.Store)
				continue
			}
			n, bytes, err := removePrefix(st, c.Prefix)
			metricArtifactsDeleted.Add(float64(n))
			metricArtifactDeletedBytes.Add(float64(bytes))
			if err != nil {
				log.Error(err, "delete the objects of an expired run's artifacts; its record is kept", "run", c.RunID)
				continue
			}
			ctx, done := context.WithTimeout(context.Background(), runStoreTimeout)
			err = s.store.ForgetRunArtifactObjects(ctx, c.RunID)
			done()
			if err != nil {
				log.Error(err, "record that a run's artifacts were deleted", "run", c.RunID)
				continue
			}
			forgotten++
			log.V(1).Info("deleted the artifacts of a run past its retention", "run", c.RunID, "objects", n, "bytes", bytes)
		}
		if forgotten == 0 {
			// Every one failed: the next prune tries again.
			return
		}
	}
}

// removePrefix deletes every object under prefix, and says how many and
// how many bytes.
func removePrefix(st objectstore.Store, prefix string) (int, int64, error) {
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Minute)
	defer cancel()
	var infos []objectstore.Info
	if err := st.List(ctx, prefix, func(i objectstore.Info) error {
		infos = append(infos, i)
		return nil
	}); err != nil {
		return 0, 0, fmt.Errorf("list %s: %w", st.Location(prefix), err)
	}
	n, bytes := 0, int64(0)
	for _, i := range infos {
		if err := st.Remove(ctx, i.Key); err != nil {
			return n, bytes, fmt.Errorf("delete %s: %w", st.Location(i.Key), err)
		}
		n++
		bytes += i.Size
	}
	return n, bytes, nil
}

// listRunArtifacts serves GET /v1/runs/{id}/artifacts.
func (s *Server) listRunArtifacts(w http.ResponseWriter, r *http.Request) {
	run, apiErr := s.visibleRun(r, r.PathValue("run_id"))
	if apiErr != nil {
		writeError(w, apiErr)
		return
	}
	arts, coll, err := s.store.ListRunArtifacts(r.Context(), run.ID)
	if apiErr := s.runStoreError(r, "list run artifacts", err); apiErr != nil {
		writeError(w, apiErr)
		return
	}
	out := api.RunArtifactList{Artifacts: make([]api.RunArtifact, 0, len(arts)), State: api.RunArtifactsPending}
	switch {
	case coll != nil && coll.State == store.ArtifactsCollecting && run.Status.Terminal():
		// The executor stopped half-way (its replica was lost); what
		// it recorded is all there is.
		out.State = api.RunArtifactsCollected
		out.Message = "the collection stopped before it finished: the control plane replica running it was lost"
	case coll != nil:
		out.State, out.Message = coll.State, coll.Message
	case run.Status.Terminal():
		// Ended without a collection: the command never ran, or found
		// nothing under the default path.
		out.State = api.RunArtifactsCollected
	}
	for _, a := range arts {
		out.Artifacts = append(out.Artifacts, api.RunArtifact{Path: a.Path, Size: a.Size, SHA256: a.SHA256,
			UploadedAt: a.UploadedAt, Error: a.Error})
	}
	writeJSON(w, http.StatusOK, out)
}

// getRunArtifact serves GET /v1/runs/{id}/artifacts/{path...}: the
// object, streamed, with its length and digest in the headers.
func (s *Server) getRunArtifact(w http.ResponseWriter, r *http.Request) {
	run, apiErr := s.visibleRun(r, r.PathValue("run_id"))
	if apiErr != nil {
		writeError(w, apiErr)
		return
	}
	p := r.PathValue("path")
	a, err := s.store.GetRunArtifact(r.Context(), run.ID, p)
	if errors.Is(err, store.ErrNotFound) {
		writeError(w, api.Errorf(api.CodeNotFound, "run %s has no artifact %q", run.ID, p))
		return
	}
	if apiErr := s.runStoreError(r, "read run artifact", err); apiErr != nil {
		writeError(w, apiErr)
		return
	}
	if !a.Uploaded() {
		writeError(w, api.Errorf(api.CodeNotFound, "artifact %q of run %s was %s", p, run.ID, a.Error))
		return
	}
	st := s.artifacts.Store
	if st == nil {
		writeError(w, api.Errorf(api.CodeUnavailable, "%s", s.artifacts.Unavailable))
		return
	}
	ctx, cancel := context.WithTimeout(r.Context(), artifactCollectTimeout)
	defer cancel()
	info, err := st.Stat(ctx, a.ObjectKey)
	if errors.Is(err, objectstore.ErrNotFound) {
		writeError(w, api.Errorf(api.CodeNotFound, "artifact %q of run %s is no longer in the object store", p, run.ID))
		return
	}
	var body io.ReadCloser
	if err == nil {
		body, err = st.Get(ctx, a.ObjectKey, info)
	}
	if err != nil {
		s.callLog(r, "read run artifact").Error(err, "read a run artifact from the object store", "key", a.ObjectKey)
		writeError(w, api.Errorf(api.CodeInternal, "could not read artifact %q of run %s from the object store", p, run.ID))
		return
	}
	defer body.Close()
	w.Header().Set("Content-Type", "application/octet-stream")
	w.Header().Set("Content-Length", strconv.FormatInt(info.Size, 10))
	w.Header().Set(api.HeaderArtifactSHA256, a.SHA256)
	w.Header().Set("Cache-Control", "no-store")
	w.WriteHeader(http.StatusOK)
	if _, err := io.Copy(w, body); err != nil {
		// The status is sent; the client sees a short body.
		s.callLog(r, "read run artifact").V(1).Info("artifact transfer cut short", "err", err.Error())
	}
}
