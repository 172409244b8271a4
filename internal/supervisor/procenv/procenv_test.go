package procenv

import (
	"errors"
	"os"
	"path/filepath"
	"slices"
	"testing"
)

func TestLookPathUsesTheProcessPathAndDir(t *testing.T) {
	dir := t.TempDir()
	bin := filepath.Join(dir, "bin")
	if err := os.Mkdir(bin, 0o755); err != nil {
		t.Fatal(err)
	}
	tool := filepath.Join(bin, "tool")
	if err := os.WriteFile(tool, []byte("#!/bin/sh\n"), 0o755); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(filepath.Join(bin, "data"), nil, 0o644); err != nil {
		t.Fatal(err)
	}
	for _, tc := range []struct{ name, path, want string }{
		{"tool", "/nonexistent:bin", tool}, // a relative PATH entry is taken from dir
		{"./bin/tool", "", tool},
		{"/abs/tool", "", "/abs/tool"},
	} {
		got, err := LookPath(tc.name, tc.path, dir)
		if err != nil || got != tc.want {
			t.Errorf("LookPath(%q, %q) = %q, %v; want %q", tc.name, tc.path, got, err, tc.want)
		}
	}
	// Not executable, or not there: ErrNotFound.
	for _, name := range []string{"data", "missing"} {
		if _, err := LookPath(name, bin, dir); !errors.Is(err, ErrNotFound) {
			t.Errorf("LookPath(%q) error %v, want ErrNotFound", name, err)
		}
	}
}

func TestValidateAndList(t *testing.T) {
	for _, env := range []map[string]string{{"": "x"}, {"A=B": "x"}, {"A\x00": "x"}, {"A": "x\x00y"}} {
		if Validate(env) == nil {
			t.Errorf("Validate(%q) accepted it", env)
		}
	}
	env := map[string]string{"PATH": "/bin", "A": "1"}
	if err := Validate(env); err != nil {
		t.Fatal(err)
	}
	if got := List(env); !slices.Equal(got, []string{"A=1", "PATH=/bin"}) {
		t.Errorf("List = %q", got)
	}
}
