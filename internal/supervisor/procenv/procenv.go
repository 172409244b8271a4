// Package procenv holds the rules the supervisor applies to the
// environment and executable of every process it starts, so that commands
// and MCP servers resolve and validate them the same way.
package procenv

import (
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"sort"
	"strings"
	"syscall"
)

// ErrNotFound is wrapped by LookPath when no executable matches.
var ErrNotFound = errors.New("executable not found")

// Validate rejects variables the kernel cannot pass: an empty name, a name
// with '=' or NUL, or a value with NUL. Checking first gives the caller a
// clear error instead of exec's.
func Validate(env map[string]string) error {
	for k, v := range env {
		switch {
		case k == "":
			return errors.New("variable name must not be empty")
		case strings.ContainsAny(k, "=\x00"):
			return fmt.Errorf("variable name %q must not contain '=' or NUL", k)
		case strings.IndexByte(v, 0) >= 0:
			return fmt.Errorf("value of %s contains a NUL byte", k)
		}
	}
	return nil
}

// List turns env into the KEY=value list exec wants, sorted so that a
// process sees the same environment order every time.
func List(env map[string]string) []string {
	list := make([]string, 0, len(env))
	for k, v := range env {
		list = append(list, k+"="+v)
	}
	sort.Strings(list)
	return list
}

// LookPath finds name in the process's own PATH, relative to its working
// directory dir, as a shell started there would; os/exec would search the
// supervisor's PATH instead.
func LookPath(name, pathEnv, dir string) (string, error) {
	if strings.Contains(name, "/") {
		if !filepath.IsAbs(name) {
			name = filepath.Join(dir, name)
		}
		return name, nil
	}
	for _, d := range filepath.SplitList(pathEnv) {
		if d == "" {
			d = "."
		}
		if !filepath.IsAbs(d) {
			d = filepath.Join(dir, d)
		}
		p := filepath.Join(d, name)
		if st, err := os.Stat(p); err == nil && st.Mode().IsRegular() && syscall.Access(p, 0x1 /* X_OK */) == nil {
			return p, nil
		}
	}
	return "", fmt.Errorf("%w: %q not in PATH %q", ErrNotFound, name, pathEnv)
}
