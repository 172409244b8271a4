package client

import (
	"context"
	"errors"
	"fmt"
	"io"
	"net/http"
	"net/url"
	"strconv"
	"strings"
	"time"
)

// A run's artifacts: the files its command left under its artifact paths
// (StartRunRequest.Artifacts, DefaultRunArtifactPath when none), uploaded
// to the platform's object store once the command ended and before the
// run's end was recorded, so that a client that sees the end can read
// them.
//
//	GET /v1/runs/{id}/artifacts          -> RunArtifactList
//	GET /v1/runs/{id}/artifacts/{path}   -> the file (Content-Length, HeaderArtifactSHA256)

// DefaultRunArtifactPath is where a run's artifacts are looked for when
// its start names no paths.
const DefaultRunArtifactPath = "/workspace/artifacts"

// RunEventArtifact is the event of one artifact, uploaded (Path, Size,
// SHA256) or not (Path, Size, Error), or of a run whose artifacts were not
// kept at all (Message). Artifact events come before the end event.
const RunEventArtifact = "artifact"

// HeaderArtifactSHA256 carries the lower-case hex SHA-256 of an artifact
// the API streams back.
const HeaderArtifactSHA256 = "X-Agentbox-Artifact-Sha256"

// Collection states of a run's artifacts (RunArtifactList.State).
const (
	// RunArtifactsPending: the run is live; its artifacts are collected
	// once its command ends.
	RunArtifactsPending = "pending"
	// RunArtifactsCollecting: the upload is in progress.
	RunArtifactsCollecting = "collecting"
	// RunArtifactsCollected: every file found is listed, uploaded or
	// with the Error that kept it out. A run that ended with none (its
	// command never ran, or left nothing under its paths) lists none.
	RunArtifactsCollected = "collected"
	// RunArtifactsNotKept: none were kept; Message says why.
	RunArtifactsNotKept = "not_kept"
)

// PathRunArtifacts lists a run's artifacts.
func PathRunArtifacts(id string) string { return PathRun(id) + "/artifacts" }

// PathRunArtifact streams one artifact of a run; path is
// workspace-relative, as listed.
func PathRunArtifact(id, path string) string {
	segs := strings.Split(strings.TrimPrefix(path, "/"), "/")
	for i, s := range segs {
		segs[i] = url.PathEscape(s)
	}
	return PathRunArtifacts(id) + "/" + strings.Join(segs, "/")
}

// RunArtifact is one file of a run's artifacts.
type RunArtifact struct {
	// Path is the file's path in the workspace, relative to it
	// ("artifacts/report.json" for /workspace/artifacts/report.json).
	Path string `json:"path"`
	Size int64  `json:"size"`
	// SHA256 is the lower-case hex digest of the uploaded content.
	SHA256 string `json:"sha256,omitempty"`
	// UploadedAt is when the upload completed; absent when the file was
	// not uploaded.
	UploadedAt *time.Time `json:"uploaded_at,omitempty"`
	// Error says why the file was not uploaded (over a size limit,
	// unreadable); such a file cannot be read back.
	Error string `json:"error,omitempty"`
}

// RunArtifactList is a run's artifacts, by path.
type RunArtifactList struct {
	Artifacts []RunArtifact `json:"artifacts"`
	// State is RunArtifactsPending, RunArtifactsCollecting,
	// RunArtifactsCollected or RunArtifactsNotKept.
	State string `json:"state"`
	// Message says why the artifacts were not kept.
	Message string `json:"message,omitempty"`
}

// ListRunArtifacts lists a run's artifacts.
func (c *Client) ListRunArtifacts(ctx context.Context, id string) (*RunArtifactList, error) {
	if id == "" {
		return nil, errors.New("empty run ID")
	}
	var l RunArtifactList
	if err := c.do(ctx, http.MethodGet, PathRunArtifacts(id), nil, &l); err != nil {
		return nil, err
	}
	return &l, nil
}

// GetRunArtifact streams one artifact of a run, and returns its size and
// SHA-256 as the API announced them (the caller may check the digest of
// what it reads against the latter). The caller closes the reader.
func (c *Client) GetRunArtifact(ctx context.Context, id, path string) (io.ReadCloser, RunArtifact, error) {
	if id == "" || path == "" {
		return nil, RunArtifact{}, errors.New("empty run ID or artifact path")
	}
	resp, err := c.stream(ctx, http.MethodGet, PathRunArtifact(id, path), nil)
	if err != nil {
		return nil, RunArtifact{}, err
	}
	a := RunArtifact{Path: path, Size: resp.ContentLength, SHA256: resp.Header.Get(HeaderArtifactSHA256)}
	if a.Size < 0 {
		if n, err := strconv.ParseInt(resp.Header.Get("Content-Length"), 10, 64); err == nil {
			a.Size = n
		} else {
			_ = resp.Body.Close()
			return nil, RunArtifact{}, fmt.Errorf("artifact %s of run %s came without its length", path, id)
		}
	}
	return resp.Body, a, nil
}
