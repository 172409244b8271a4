package main

import (
	"errors"
	"fmt"
	"io"
	"io/fs"
	"log/slog"
	"os"
	"path/filepath"
	"strings"

	"github.com/agentbox/terraform-provider-agentbox/internal/supervisor/workspace"
)

// handOverSealKey copies the environment seal key from the init
// container's mount of it (from) to the file the supervisor reads and
// removes at its start (to), group-readable for an image user in the
// sandbox's group. A missing key is no error: the Secret may be from
// before there was one, and then nothing is sealed, so a reused sandbox
// keeps no environment.
func handOverSealKey(from, to string) error {
	if from == "" || to == "" {
		return nil
	}
	key, err := os.ReadFile(from)
	if errors.Is(err, fs.ErrNotExist) {
		return nil
	}
	if err != nil {
		return fmt.Errorf("read the seal key: %w", err)
	}
	tmp := to + ".tmp"
	if err := os.WriteFile(tmp, key, 0o640); err != nil {
		return fmt.Errorf("hand over the seal key: %w", err)
	}
	if err := os.Rename(tmp, to); err != nil {
		return fmt.Errorf("hand over the seal key: %w", err)
	}
	return nil
}

// resetWorkspace is the init container's reset of a reused warm sandbox's
// workspace (workspace.Reset), with the seal key at keyFile. It prints
// what it did; its error, the end of the container's output, becomes the
// pod's termination message, which the controller puts in the event of the
// sandbox's deletion.
func resetWorkspace(dir, keyFile string, out io.Writer) error {
	var key []byte
	if keyFile != "" {
		k, err := os.ReadFile(keyFile)
		if err != nil && !errors.Is(err, fs.ErrNotExist) {
			return fmt.Errorf("read the seal key: %w", err)
		}
		key = k
	}
	rep, err := workspace.Reset(dir, key)
	if err != nil {
		return err
	}
	fmt.Fprintf(out, "reset workspace %s: removed %d entries, kept %d environments\n", dir, rep.Removed, len(rep.KeptEnvs))
	for _, e := range rep.KeptEnvs {
		fmt.Fprintf(out, "kept environment %s\n", filepath.Base(e))
	}
	for name, why := range rep.DroppedEnvs {
		fmt.Fprintf(out, "dropped environment %s: %s\n", name, why)
	}
	return nil
}

// takeSealKey reads the seal key the init container handed over and
// removes its file before anything else runs in the sandbox. From then on
// only the supervisor's memory holds it: its commands run as the same
// user, but they are its descendants, and gVisor's ptrace scope lets a
// process trace or open /proc/PID/mem of its descendants only. (Making
// the supervisor non-dumpable would say so outright, but under gVisor a
// non-dumpable process can no longer start commands.) Without a file it
// returns nil: environments are then not sealed, and a reused sandbox
// keeps none.
func takeSealKey(path string, log *slog.Logger) []byte {
	if path == "" {
		return nil
	}
	key, err := os.ReadFile(path)
	if errors.Is(err, fs.ErrNotExist) {
		return nil
	}
	if rmErr := os.Remove(path); rmErr != nil && !errors.Is(rmErr, fs.ErrNotExist) {
		// A key commands could read seals nothing worth trusting.
		log.Warn("could not remove the environment seal key; environments are not sealed", "error", rmErr.Error())
		return nil
	}
	if err != nil {
		log.Warn("could not read the environment seal key; environments are not sealed", "error", err.Error())
		return nil
	}
	return []byte(strings.TrimSpace(string(key)))
}
