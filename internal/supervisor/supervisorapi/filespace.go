package supervisorapi

import (
	"context"
	"time"
)

// PathManifest (GET, followed by a workspace path) lists every regular
// file under that directory, recursively, with its size, modification
// time and SHA-256: what a filespace sync compares against the control
// plane's copy.
const PathManifest = "/v1/manifest/"

// ManifestEntry is one regular file of a manifest.
type ManifestEntry struct {
	// Path is workspace-relative, with slashes.
	Path    string    `json:"path"`
	Size    int64     `json:"size"`
	ModTime time.Time `json:"mod_time"`
	// SHA256 is the lower-case hex digest of the content.
	SHA256 string `json:"sha256"`
	// Mode is the permission bits in octal, e.g. "0644".
	Mode string `json:"mode"`
}

// Manifest is the body of GET /v1/manifest/{path}. Symbolic links,
// directories and special files are not listed (Skipped counts them), nor
// are the supervisor's temporary files of writes in flight.
type Manifest struct {
	Path  string          `json:"path"`
	Files []ManifestEntry `json:"files"`
	// TotalBytes is the sum of the files' sizes.
	TotalBytes int64 `json:"total_bytes"`
	// Skipped counts entries that are not regular files (directories
	// excluded).
	Skipped int `json:"skipped"`
	// CapBytes is the workspace cap the supervisor enforces.
	CapBytes int64 `json:"cap_bytes"`
}

// Manifest lists the regular files under the workspace directory dir ("."
// or "" for the whole workspace) with their digests. It reads every file,
// so it takes as long as reading the workspace does.
func (c *Client) Manifest(ctx context.Context, dir string) (*Manifest, error) {
	if dir == "" {
		dir = "."
	}
	var m Manifest
	if err := c.getJSON(ctx, FilePath(PathManifest, dir), &m); err != nil {
		return nil, err
	}
	return &m, nil
}
