package pyenv

import (
	"os"
	"path/filepath"
	"slices"
	"sync"
	"time"
)

// Pin is an environment's in-use mark, held for a run: a pinned
// environment is not evicted or removed until the pin is released.
type Pin struct {
	m    *Manager
	e    *env
	once sync.Once
}

// Dir is the environment's directory, for VIRTUAL_ENV.
func (p *Pin) Dir() string { return p.e.dir }

// Python is the environment's interpreter.
func (p *Pin) Python() string { return filepath.Join(p.e.dir, "bin", "python") }

// Name is the environment's name.
func (p *Pin) Name() string { return p.e.name }

// Info describes the environment.
func (p *Pin) Info() Info {
	p.m.mu.Lock()
	defer p.m.mu.Unlock()
	return p.e.info()
}

// Release gives the environment back; it may be evicted from then on.
func (p *Pin) Release() {
	p.once.Do(func() {
		m := p.m
		m.mu.Lock()
		e := p.e
		e.users--
		e.lastUsed = m.now()
		var used string
		if !e.retired && e.lastUsed.Sub(e.usedWritten) >= usedWriteEvery {
			e.usedWritten = e.lastUsed
			used = e.lastUsed.UTC().Format(time.RFC3339Nano)
		}
		var remove []string
		if e.retired {
			if e.users == 0 {
				remove = append(remove, e.dir)
			}
		} else {
			// Limits passed while this was in use are enforced now.
			remove = m.enforceLocked(nil)
		}
		m.mu.Unlock()
		if used != "" && !slices.Contains(remove, e.dir) {
			// Best effort: without it the environment counts as last
			// used when it was built, after a restart.
			if err := os.WriteFile(filepath.Join(e.dir, usedFile), []byte(used+"\n"), 0o600); err != nil {
				m.log.Debug("recording an environment's last use failed", "env", e.name, "error", err.Error())
			}
		}
		m.removeDirs(remove)
	})
}
