package main

import (
	"bytes"
	"context"
	"crypto/sha256"
	"errors"
	"fmt"
	"io"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
)

// Install copies Binaries from the folder from into the folder to, then
// runs the installed runsc --version. A file whose content is already the
// same is left alone, so a restarted pod changes nothing on the node.
func Install(ctx context.Context, from, to string, out io.Writer) error {
	fi, err := os.Stat(to)
	if err != nil {
		return fmt.Errorf("host folder: %w", err)
	}
	if !fi.IsDir() {
		return fmt.Errorf("host folder %s is not a folder", to)
	}
	for _, name := range Binaries {
		changed, err := installFile(filepath.Join(from, name), filepath.Join(to, name))
		if err != nil {
			return err
		}
		if changed {
			fmt.Fprintf(out, "installed %s\n", filepath.Join(to, name))
		} else {
			fmt.Fprintf(out, "%s is up to date\n", filepath.Join(to, name))
		}
	}
	v, err := check(ctx, filepath.Join(to, "runsc"))
	if err != nil {
		return err
	}
	fmt.Fprintln(out, v)
	return nil
}

// installFile puts src at dst unless dst already has its content. The copy
// goes to a temporary file in dst's folder, is synced, and is renamed over
// dst: a runsc or shim that is running keeps its old file, and nothing
// ever sees a half-written one, even after a crash of the node.
func installFile(src, dst string) (changed bool, err error) {
	in, err := os.Open(src)
	if err != nil {
		return false, fmt.Errorf("the installer image lacks %s: %w", src, err)
	}
	defer in.Close()
	fi, err := in.Stat()
	if err != nil {
		return false, err
	}
	if !fi.Mode().IsRegular() || fi.Mode().Perm()&0o111 == 0 {
		return false, fmt.Errorf("%s in the installer image is not an executable file (%s)", src, fi.Mode())
	}
	if same, err := sameContent(in, dst, fi.Size()); err != nil {
		return false, err
	} else if same {
		return false, nil
	}
	if _, err := in.Seek(0, io.SeekStart); err != nil {
		return false, err
	}

	dir := filepath.Dir(dst)
	tmp, err := os.CreateTemp(dir, "."+filepath.Base(dst)+".agentbox-")
	if err != nil {
		return false, fmt.Errorf("creating a file in %s: %w", dir, err)
	}
	defer func() {
		if err != nil {
			tmp.Close()
			os.Remove(tmp.Name())
		}
	}()
	if _, err = io.Copy(tmp, in); err != nil {
		return false, fmt.Errorf("copying %s to %s: %w", src, tmp.Name(), err)
	}
	// CreateTemp makes the file 0600 whatever the umask; Chmod sets the
	// exact mode kubelet's containerd will need to execute it.
	if err = tmp.Chmod(0o755); err != nil {
		return false, fmt.Errorf("chmod %s: %w", tmp.Name(), err)
	}
	if err = tmp.Sync(); err != nil {
		return false, fmt.Errorf("fsync %s: %w", tmp.Name(), err)
	}
	if err = tmp.Close(); err != nil {
		return false, fmt.Errorf("closing %s: %w", tmp.Name(), err)
	}
	if err = os.Rename(tmp.Name(), dst); err != nil {
		return false, fmt.Errorf("replacing %s: %w", dst, err)
	}
	// The rename is durable only once the folder is synced too.
	if d, err := os.Open(dir); err == nil {
		_ = d.Sync()
		d.Close()
	}
	return true, nil
}

// sameContent reports whether the file at p has the content of src
// (size first, then SHA-256), leaving src's offset anywhere.
func sameContent(src *os.File, p string, size int64) (bool, error) {
	fi, err := os.Stat(p)
	if errors.Is(err, os.ErrNotExist) {
		return false, nil
	}
	if err != nil {
		return false, fmt.Errorf("checking %s: %w", p, err)
	}
	if !fi.Mode().IsRegular() || fi.Size() != size || fi.Mode().Perm() != 0o755 {
		return false, nil
	}
	a, err := hashReader(src)
	if err != nil {
		return false, err
	}
	f, err := os.Open(p)
	if err != nil {
		return false, fmt.Errorf("reading %s: %w", p, err)
	}
	defer f.Close()
	b, err := hashReader(f)
	if err != nil {
		return false, err
	}
	return bytes.Equal(a, b), nil
}

func hashReader(r io.Reader) ([]byte, error) {
	h := sha256.New()
	if _, err := io.Copy(h, r); err != nil {
		return nil, err
	}
	return h.Sum(nil), nil
}

// check runs the installed runsc --version: it proves that the copy is a
// runsc that runs on this node (architecture, kernel), not just a file.
func check(ctx context.Context, runsc string) (string, error) {
	out, err := exec.CommandContext(ctx, runsc, "--version").CombinedOutput()
	v := strings.TrimSpace(string(out))
	if err != nil {
		return "", fmt.Errorf("the installed %s does not run: %w: %s", runsc, err, v)
	}
	if !strings.Contains(v, "runsc version") {
		return "", fmt.Errorf("the installed %s --version printed %q, not a runsc version", runsc, v)
	}
	return v, nil
}
