package testenv

import (
	"encoding/json"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"strings"
)

// state is what a running cluster leaves on disk so that another process
// (`agentbox-testenv down`, or the next run after a crash) can stop it and
// undo every change it made to the host.
type state struct {
	Dir    string `json:"dir"`
	BinDir string `json:"binDir"`
	Procs  []proc `json:"procs"`
	// Host changes to undo. Each is recorded before it is made.
	NodeIP    string `json:"nodeIP,omitempty"`
	LoAddr    bool   `json:"loAddr,omitempty"`
	Fence     bool   `json:"fence,omitempty"`
	IPForward string `json:"ipForward,omitempty"`
	Node      bool   `json:"node,omitempty"`
	Cgroups   bool   `json:"cgroups,omitempty"`
	// NetworkPolicy: kube-router enforces NetworkPolicies on the node.
	NetworkPolicy bool   `json:"networkPolicy,omitempty"`
	Kubeconfig    string `json:"kubeconfig"`
}

type proc struct {
	Name string `json:"name"`
	PID  int    `json:"pid"`
}

func statePath(dir string) string { return filepath.Join(dir, "state.json") }

func (s *state) save() error {
	b, err := json.MarshalIndent(s, "", "  ")
	if err != nil {
		return err
	}
	tmp := statePath(s.Dir) + ".tmp"
	if err := os.WriteFile(tmp, b, 0o600); err != nil {
		return err
	}
	return os.Rename(tmp, statePath(s.Dir))
}

func loadState(dir string) (*state, error) {
	b, err := os.ReadFile(statePath(dir))
	if err != nil {
		return nil, err
	}
	var s state
	if err := json.Unmarshal(b, &s); err != nil {
		return nil, fmt.Errorf("corrupt %s: %w", statePath(dir), err)
	}
	return &s, nil
}

func (s *state) proc(name string) *proc {
	for i := range s.Procs {
		if s.Procs[i].Name == name {
			return &s.Procs[i]
		}
	}
	return nil
}

func (s *state) running() []proc {
	var r []proc
	for _, p := range s.Procs {
		if alive(p.PID) {
			r = append(r, p)
		}
	}
	return r
}

func (s *state) logPath(name string) string { return filepath.Join(s.Dir, name+".log") }

func (s *state) logTail(name string, n int) string {
	b, err := os.ReadFile(s.logPath(name))
	if errors.Is(err, os.ErrNotExist) {
		return "(no log)"
	}
	lines := strings.Split(strings.TrimRight(string(b), "\n"), "\n")
	if len(lines) > n {
		lines = lines[len(lines)-n:]
	}
	return strings.Join(lines, "\n")
}
