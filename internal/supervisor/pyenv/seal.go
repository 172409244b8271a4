package pyenv

import (
	"crypto/hmac"
	"crypto/sha256"
	"encoding/binary"
	"encoding/hex"
	"errors"
	"fmt"
	"hash"
	"io"
	"io/fs"
	"os"
	"path/filepath"
	"strings"
)

// sealFile holds an environment's seal: an HMAC, under a key the
// sandbox's commands cannot read, of the digest of its files as its build
// left them. A warm pool that reuses sandboxes keeps an environment for
// the next holder only when its seal still matches: an environment is code
// every run imports, and the previous holder could have changed it
// (pip-installing into it, editing site-packages, or rewriting its
// metadata, which is why a plain digest beside it would not do).
const sealFile = "agentbox-env.seal"

// pycacheDir is the bytecode cache Python writes beside the sources it
// imports. It is left out of the digest, since every use would change it,
// and removed whenever an environment is kept for a new holder, since a
// planted .pyc would otherwise run in place of its source.
const pycacheDir = "__pycache__"

// Digest is the digest of the environment in dir: every file's path,
// type, permission bits and content (a symlink's target), in walk order,
// without following symlinks. The files the manager itself rewrites (its
// metadata, the last-used time, the seal) and bytecode caches are left
// out.
func Digest(dir string) ([]byte, error) {
	h := sha256.New()
	err := filepath.WalkDir(dir, func(p string, d fs.DirEntry, err error) error {
		if err != nil {
			return err
		}
		rel, err := filepath.Rel(dir, p)
		if err != nil {
			return err
		}
		if d.IsDir() && d.Name() == pycacheDir {
			return filepath.SkipDir
		}
		if filepath.Dir(rel) == "." && (rel == metaFile || rel == usedFile || rel == sealFile) {
			return nil
		}
		info, err := d.Info()
		if err != nil {
			return err
		}
		writeField(h, []byte(rel))
		writeField(h, []byte(fmt.Sprintf("%v", info.Mode())))
		switch {
		case info.Mode().IsRegular():
			f, err := os.Open(p)
			if err != nil {
				return err
			}
			defer f.Close()
			sum := sha256.New()
			if _, err := io.Copy(sum, f); err != nil {
				return err
			}
			writeField(h, sum.Sum(nil))
		case info.Mode()&fs.ModeSymlink != 0:
			target, err := os.Readlink(p)
			if err != nil {
				return err
			}
			writeField(h, []byte(target))
		case info.IsDir():
		default:
			// A device, socket or pipe is no part of what a build makes.
			return fmt.Errorf("%s is a %v, not a file, directory or symlink", rel, info.Mode().Type())
		}
		return nil
	})
	if err != nil {
		return nil, err
	}
	return h.Sum(nil), nil
}

// writeField writes b length-prefixed, so that no two file lists hash
// alike.
func writeField(h hash.Hash, b []byte) {
	var n [8]byte
	binary.BigEndian.PutUint64(n[:], uint64(len(b)))
	h.Write(n[:])
	h.Write(b)
}

func seal(key, digest []byte) string {
	mac := hmac.New(sha256.New, key)
	mac.Write(digest)
	return hex.EncodeToString(mac.Sum(nil))
}

// Seal seals the environment in dir under key.
func Seal(dir string, key []byte) error {
	d, err := Digest(dir)
	if err != nil {
		return err
	}
	return os.WriteFile(filepath.Join(dir, sealFile), []byte(seal(key, d)+"\n"), 0o600)
}

// ErrNotSealed is VerifySeal's error for an environment that has no seal:
// it was built without a key, or its seal was removed.
var ErrNotSealed = errors.New("the environment has no seal")

// VerifySeal checks that the environment in dir is as its build left it:
// its seal is the HMAC under key of its digest now.
func VerifySeal(dir string, key []byte) error {
	got, err := os.ReadFile(filepath.Join(dir, sealFile))
	if errors.Is(err, fs.ErrNotExist) {
		return ErrNotSealed
	}
	if err != nil {
		return err
	}
	d, err := Digest(dir)
	if err != nil {
		return fmt.Errorf("digest: %w", err)
	}
	if !hmac.Equal([]byte(strings.TrimSpace(string(got))), []byte(seal(key, d))) {
		return errors.New("its files changed since it was built")
	}
	return nil
}

// ScrubResult is what Scrub kept and removed.
type ScrubResult struct {
	// Kept are the names of the environments kept.
	Kept []string
	// Dropped maps each removed entry of the directory to why.
	Dropped map[string]string
}

// Scrub readies an environment directory for a new holder of a reused
// sandbox, while no process of the previous one runs: it keeps only the
// finished environments whose seal under key still matches, with their
// bytecode caches removed, and removes everything else (the installer
// environment, unfinished builds, any file the previous holder
// left). Without a key nothing can be verified, and everything goes. A
// directory that is not there is fine; one that cannot be cleaned is an
// error, and the caller must not hand the sandbox out.
func Scrub(dir string, key []byte) (ScrubResult, error) {
	res := ScrubResult{Dropped: map[string]string{}}
	info, err := os.Lstat(dir)
	if errors.Is(err, fs.ErrNotExist) {
		return res, nil
	}
	if err != nil {
		return res, err
	}
	if !info.IsDir() {
		res.Dropped[filepath.Base(dir)] = "not a directory"
		return res, RemoveAll(dir)
	}
	entries, err := os.ReadDir(dir)
	if err != nil {
		return res, err
	}
	for _, de := range entries {
		p := filepath.Join(dir, de.Name())
		why := ""
		switch {
		case len(key) == 0:
			why = "no key to verify it with"
		case !de.IsDir() || de.Type()&fs.ModeSymlink != 0:
			why = "not an environment"
		case de.Name() == installerDir:
			// Its pip builds every later environment; it is remade
			// when needed.
			why = "the installer environment is remade for each holder"
		default:
			if _, err := readMeta(p); err != nil {
				why = "unfinished: " + err.Error()
			} else if err := VerifySeal(p, key); err != nil {
				why = err.Error()
			}
		}
		if why == "" {
			if err := removePycache(p); err != nil {
				return res, fmt.Errorf("remove the bytecode caches of %s: %w", de.Name(), err)
			}
			res.Kept = append(res.Kept, de.Name())
			continue
		}
		res.Dropped[de.Name()] = why
		if err := RemoveAll(p); err != nil {
			return res, err
		}
	}
	return res, nil
}

// removePycache removes every bytecode cache under dir.
func removePycache(dir string) error {
	var caches []string
	err := filepath.WalkDir(dir, func(p string, d fs.DirEntry, err error) error {
		if err != nil {
			return err
		}
		if d.IsDir() && d.Name() == pycacheDir {
			caches = append(caches, p)
			return filepath.SkipDir
		}
		return nil
	})
	if err != nil {
		return err
	}
	for _, c := range caches {
		if err := RemoveAll(c); err != nil {
			return err
		}
	}
	return nil
}

// RemoveAll removes p and everything under it, making directories
// writable first: a previous holder may have taken the write bit off its
// own directories, which os.RemoveAll alone cannot get past. It never
// follows a symlink.
func RemoveAll(p string) error {
	err := os.RemoveAll(p)
	if err == nil {
		return nil
	}
	_ = filepath.WalkDir(p, func(q string, d fs.DirEntry, err error) error {
		if err == nil && d.IsDir() {
			_ = os.Chmod(q, 0o700)
		} else if err != nil {
			// An unreadable directory: open it up and walk it again below.
			_ = os.Chmod(q, 0o700)
		}
		return nil
	})
	// Directories made readable on the way down may hold more of them.
	for range 8 {
		if err = os.RemoveAll(p); err == nil {
			return nil
		}
		_ = filepath.WalkDir(p, func(q string, d fs.DirEntry, err error) error {
			if d != nil && d.IsDir() {
				_ = os.Chmod(q, 0o700)
			}
			return nil
		})
	}
	return fmt.Errorf("remove %s: %w", p, err)
}
