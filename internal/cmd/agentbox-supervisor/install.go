package main

import (
	"errors"
	"fmt"
	"io"
	"os"
	"path/filepath"
)

// installName is the file -install writes in its directory; the
// controller runs the sandbox container's command from there.
const installName = "agentbox-supervisor"

// install copies the running executable into dir/agentbox-supervisor, mode
// 0755, and returns the path it wrote. It is how a sandbox pod gets its
// supervisor without the sandbox image having one: an init container from
// the small supervisor image runs "agentbox-supervisor -install DIR" into
// a volume the sandbox container then runs it from, so any Linux image can
// be a sandbox.
//
// The copy goes to a temporary name in dir and is renamed over the target
// only once it is complete and on disk, so a copy cut short (the init
// container killed, the volume full) never leaves a truncated binary where
// the sandbox container would run it: a restarted init container writes it
// again, and the sandbox container starts only after one has succeeded.
func install(dir string) (string, error) {
	self, err := os.Executable()
	if err != nil {
		return "", fmt.Errorf("find the running executable: %w", err)
	}
	st, err := os.Stat(dir)
	if err != nil {
		return "", fmt.Errorf("install directory: %w", err)
	}
	if !st.IsDir() {
		return "", fmt.Errorf("install directory %s is not a directory", dir)
	}
	src, err := os.Open(self)
	if err != nil {
		return "", fmt.Errorf("open the running executable: %w", err)
	}
	defer src.Close()
	tmp, err := os.CreateTemp(dir, "."+installName+"-*")
	if err != nil {
		return "", fmt.Errorf("create a file in %s: %w", dir, err)
	}
	done := false
	defer func() {
		if !done {
			tmp.Close()
			os.Remove(tmp.Name())
		}
	}()
	if _, err := io.Copy(tmp, src); err != nil {
		return "", fmt.Errorf("copy %s to %s: %w", self, tmp.Name(), err)
	}
	// CreateTemp makes the file 0600; the mode is set on the open file, so
	// the umask cannot narrow it.
	if err := tmp.Chmod(0o755); err != nil {
		return "", fmt.Errorf("make %s executable: %w", tmp.Name(), err)
	}
	if err := tmp.Sync(); err != nil {
		return "", fmt.Errorf("flush %s: %w", tmp.Name(), err)
	}
	if err := tmp.Close(); err != nil {
		return "", fmt.Errorf("close %s: %w", tmp.Name(), err)
	}
	target := filepath.Join(dir, installName)
	if err := os.Rename(tmp.Name(), target); err != nil {
		return "", fmt.Errorf("rename %s to %s: %w", tmp.Name(), target, err)
	}
	done = true
	// The rename itself is on disk once the directory is.
	if err := syncDir(dir); err != nil {
		return "", fmt.Errorf("flush %s: %w", dir, err)
	}
	return target, nil
}

func syncDir(dir string) error {
	d, err := os.Open(dir)
	if err != nil {
		return err
	}
	err = d.Sync()
	return errors.Join(err, d.Close())
}
