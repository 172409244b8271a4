// Package workspace is the supervisor's view of the sandbox's workspace
// directory: every path a caller names is confined to it, files are read,
// written (atomically, within the workspace's size cap), tarred and
// deleted there, its manifest is what a filespace sync compares, and a
// flush sends its dirty data to the volume. It serves the file endpoints
// (/v1/files, /v1/stat, /v1/list, /v1/manifest) and the file operations
// the sandboxed tools call.
package workspace

import (
	"errors"
	"fmt"
	"io/fs"
	"log/slog"
	"os"
	"path/filepath"
	"time"

	api "github.com/agentbox/terraform-provider-agentbox/internal/supervisor/supervisorapi"
)

// Default is the workspace a supervisor serves when it is configured with
// none, if the directory exists.
const Default = "/workspace"

// Workspace is an open workspace directory.
type Workspace struct {
	// dir is the absolute path of the workspace and root the handle every
	// file operation goes through.
	dir string
	// aliases are other absolute spellings of the workspace (the
	// configured path, when it differs from the resolved one), accepted
	// in absolute request paths.
	aliases []string
	root    *os.Root
	usage   *workspaceUsage
	digests *digestCache
	log     *slog.Logger
}

// Open opens the workspace at dir, or returns nil when dir is empty and
// Default does not exist (there is no workspace then). A dir that is set
// must exist. capBytes bounds the size of its regular files; a walk of it
// is trusted for usageTTL.
func Open(dir string, capBytes int64, usageTTL time.Duration, log *slog.Logger) (*Workspace, error) {
	real, aliases, err := resolve(dir)
	if err != nil || real == "" {
		return nil, err
	}
	ws := &Workspace{dir: real, aliases: aliases, digests: newDigestCache(), log: log}
	if ws.root, err = os.OpenRoot(real); err != nil {
		return nil, fmt.Errorf("workspace: %w", err)
	}
	if ws.usage, err = newWorkspaceUsage(ws.root, capBytes, usageTTL); err != nil {
		ws.root.Close()
		return nil, fmt.Errorf("workspace usage: %w", err)
	}
	return ws, nil
}

// resolve returns the absolute, symlink-free path of the workspace, or ""
// for none, and the configured absolute path if it differs. Both are
// resolved once here so that absolute request paths can be matched
// against them.
func resolve(dir string) (string, []string, error) {
	explicit := dir != ""
	if !explicit {
		dir = Default
	}
	abs, err := filepath.Abs(dir)
	if err != nil {
		return "", nil, fmt.Errorf("workspace: %w", err)
	}
	real, err := filepath.EvalSymlinks(abs)
	if err != nil {
		if !explicit && errors.Is(err, fs.ErrNotExist) {
			return "", nil, nil
		}
		return "", nil, fmt.Errorf("workspace: %w", err)
	}
	st, err := os.Stat(real)
	if err != nil {
		return "", nil, fmt.Errorf("workspace: %w", err)
	}
	if !st.IsDir() {
		if !explicit {
			return "", nil, nil
		}
		return "", nil, fmt.Errorf("workspace %q is not a directory", abs)
	}
	var aliases []string
	if abs != real {
		aliases = []string{abs}
	}
	return real, aliases, nil
}

// Dir is the workspace's absolute, symlink-free path.
func (ws *Workspace) Dir() string { return ws.dir }

// Usage is the bytes the workspace's regular files hold now, and its cap.
func (ws *Workspace) Usage() (used, capBytes int64) { return ws.usage.snapshot(), ws.usage.cap }

// Close releases the workspace's handle.
func (ws *Workspace) Close() error { return ws.root.Close() }

// Unavailable is the error of a file call to a supervisor that serves no
// workspace.
func Unavailable() *api.Error {
	return api.Errorf(api.CodeUnavailable, "this supervisor serves no workspace (%s does not exist)", Default)
}
