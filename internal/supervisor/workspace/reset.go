package workspace

import (
	"errors"
	"fmt"
	"io/fs"
	"os"
	"path/filepath"
	"sort"
	"syscall"

	"github.com/agentbox/terraform-provider-agentbox/internal/supervisor/pyenv"
	api "github.com/agentbox/terraform-provider-agentbox/internal/supervisor/supervisorapi"
)

// ResetReport is what Reset did to a workspace.
type ResetReport struct {
	// Removed is how many top-level entries of the workspace went.
	Removed int
	// KeptEnvs are the cached Python environments kept, by directory.
	KeptEnvs []string
	// DroppedEnvs maps each entry of the environment directory that was
	// removed to why.
	DroppedEnvs map[string]string
}

// lostFound is the directory mkfs leaves at a volume's root. It belongs
// to root, so no holder can have written into it, and the sandbox's user
// cannot remove it.
const lostFound = "lost+found"

// Reset empties the workspace at root for a new holder of a reused warm
// sandbox, and verifies it: it runs before the sandbox's supervisor
// starts, while nothing of the previous holder runs. Every file goes but
// the platform's environment cache (api.EnvsDir), whose environments are
// kept only when their seal under key still matches (pyenv.Scrub). Any
// error means the workspace may still hold the previous holder's files,
// and the sandbox must not be handed out.
func Reset(root string, key []byte) (ResetReport, error) {
	rep := ResetReport{DroppedEnvs: map[string]string{}}
	entries, err := os.ReadDir(root)
	if err != nil {
		return rep, fmt.Errorf("read the workspace: %w", err)
	}
	for _, de := range entries {
		name := de.Name()
		if name == api.PlatformDir && de.IsDir() {
			continue
		}
		if name == lostFound && ownedByRoot(filepath.Join(root, name)) {
			continue
		}
		if err := pyenv.RemoveAll(filepath.Join(root, name)); err != nil {
			return rep, err
		}
		rep.Removed++
	}
	platform := filepath.Join(root, api.PlatformDir)
	// The previous holder may have locked the platform's directories
	// (their owner is its user too); opening them up again is the reset's
	// to do, and failing to is an error below.
	for _, d := range []string{platform, filepath.Join(root, api.EnvsDir)} {
		// Never through a symlink (the envs directory may be one; Scrub
		// removes it).
		if info, err := os.Lstat(d); err == nil && info.IsDir() {
			_ = os.Chmod(d, 0o700)
		}
	}
	if entries, err := os.ReadDir(platform); err == nil {
		for _, de := range entries {
			if filepath.Join(api.PlatformDir, de.Name()) == api.EnvsDir && de.IsDir() {
				continue
			}
			if err := pyenv.RemoveAll(filepath.Join(platform, de.Name())); err != nil {
				return rep, err
			}
		}
	} else if !errors.Is(err, fs.ErrNotExist) {
		return rep, fmt.Errorf("read the platform directory: %w", err)
	}
	scrub, err := pyenv.Scrub(filepath.Join(root, api.EnvsDir), key)
	if err != nil {
		return rep, fmt.Errorf("clean the environment cache: %w", err)
	}
	rep.DroppedEnvs = scrub.Dropped
	for _, name := range scrub.Kept {
		rep.KeptEnvs = append(rep.KeptEnvs, filepath.Join(api.EnvsDir, name))
	}
	sort.Strings(rep.KeptEnvs)
	return rep, verifyReset(root, rep.KeptEnvs)
}

// verifyReset checks, by reading the workspace again, that it holds
// nothing but the platform's directories and the kept environments.
func verifyReset(root string, kept []string) error {
	allowed := map[string]bool{api.PlatformDir: true, api.EnvsDir: true}
	for _, k := range kept {
		allowed[k] = true
	}
	var left []string
	err := filepath.WalkDir(root, func(p string, d fs.DirEntry, err error) error {
		if err != nil {
			return err
		}
		rel, err := filepath.Rel(root, p)
		if err != nil || rel == "." {
			return err
		}
		switch {
		case allowed[rel] && d.IsDir():
			if rel == api.PlatformDir || rel == api.EnvsDir {
				return nil
			}
			// A kept environment was verified whole by its seal.
			return filepath.SkipDir
		case rel == lostFound && ownedByRoot(p):
			return filepath.SkipDir
		}
		left = append(left, rel)
		if d.IsDir() {
			return filepath.SkipDir
		}
		return nil
	})
	if err != nil {
		return fmt.Errorf("verify the workspace: %w", err)
	}
	if len(left) > 0 {
		return fmt.Errorf("the workspace still holds %d entries after the reset, e.g. %q", len(left), left[0])
	}
	return nil
}

func ownedByRoot(p string) bool {
	info, err := os.Lstat(p)
	if err != nil || !info.IsDir() {
		return false
	}
	st, ok := info.Sys().(*syscall.Stat_t)
	return ok && st.Uid == 0
}
