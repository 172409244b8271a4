package workspace

import (
	"encoding/json"
	"os"
	"path/filepath"
	"testing"

	"github.com/agentbox/terraform-provider-agentbox/internal/supervisor/pyenv"
	api "github.com/agentbox/terraform-provider-agentbox/internal/supervisor/supervisorapi"
)

// fakeEnv makes a finished environment directory as the manager leaves
// one (its metadata file and a few files), sealed under key when key is
// set.
func fakeEnv(t *testing.T, envs, name string, key []byte) string {
	t.Helper()
	dir := filepath.Join(envs, name+".abcd1234")
	if err := os.MkdirAll(filepath.Join(dir, "lib", "site-packages", "pkg"), 0o700); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(filepath.Join(dir, "lib", "site-packages", "pkg", "__init__.py"), []byte("X = 1\n"), 0o600); err != nil {
		t.Fatal(err)
	}
	if err := os.Symlink("/usr/bin/python3", filepath.Join(dir, "python")); err != nil {
		t.Fatal(err)
	}
	md, _ := json.Marshal(map[string]any{"name": name, "spec": map[string]any{"requirements": []string{"pkg"}}})
	if err := os.WriteFile(filepath.Join(dir, "agentbox-env.json"), md, 0o600); err != nil {
		t.Fatal(err)
	}
	if key != nil {
		if err := pyenv.Seal(dir, key); err != nil {
			t.Fatal(err)
		}
	}
	return dir
}

// Reset leaves nothing of the previous holder's files, locked
// directories, symlinks and platform files included, but the sealed,
// unchanged environments.
func TestResetWipesAllButSealedEnvironments(t *testing.T) {
	root := t.TempDir()
	key := []byte("k")
	envs := filepath.Join(root, api.EnvsDir)
	kept := fakeEnv(t, envs, "kept", key)
	tampered := fakeEnv(t, envs, "tampered", key)
	if err := os.WriteFile(filepath.Join(tampered, "lib", "site-packages", "pkg", "__init__.py"), []byte("X = 2\n"), 0o600); err != nil {
		t.Fatal(err)
	}
	unsealed := fakeEnv(t, envs, "unsealed", nil)
	for p, content := range map[string]string{
		"notes.txt": "a", "src/main.py": "b", ".hidden/x": "c", ".agentbox/other/state": "d", ".bashrc": "export SECRET=1",
	} {
		if err := os.MkdirAll(filepath.Join(root, filepath.Dir(p)), 0o700); err != nil {
			t.Fatal(err)
		}
		if err := os.WriteFile(filepath.Join(root, p), []byte(content), 0o600); err != nil {
			t.Fatal(err)
		}
	}
	if err := os.Symlink("/etc", filepath.Join(root, "link")); err != nil {
		t.Fatal(err)
	}
	if err := os.Chmod(filepath.Join(root, "src"), 0o500); err != nil {
		t.Fatal(err)
	}

	rep, err := Reset(root, key)
	if err != nil {
		t.Fatal(err)
	}
	if len(rep.KeptEnvs) != 1 || rep.KeptEnvs[0] != filepath.Join(api.EnvsDir, filepath.Base(kept)) {
		t.Fatalf("kept %v (dropped %v)", rep.KeptEnvs, rep.DroppedEnvs)
	}
	if rep.DroppedEnvs[filepath.Base(tampered)] == "" || rep.DroppedEnvs[filepath.Base(unsealed)] == "" {
		t.Errorf("dropped %v", rep.DroppedEnvs)
	}
	if rep.Removed != 5 {
		t.Errorf("removed %d top-level entries, want 5", rep.Removed)
	}
	var left []string
	_ = filepath.WalkDir(root, func(p string, d os.DirEntry, err error) error {
		rel, _ := filepath.Rel(root, p)
		if rel == filepath.Base(kept) || (d != nil && d.IsDir() && p == kept) {
			return filepath.SkipDir
		}
		left = append(left, rel)
		return nil
	})
	want := []string{".", api.PlatformDir, api.EnvsDir}
	if len(left) != len(want) {
		t.Fatalf("left %v, want %v and the kept environment", left, want)
	}
	if _, err := os.Stat(filepath.Join(kept, "lib", "site-packages", "pkg", "__init__.py")); err != nil {
		t.Errorf("kept environment lost a file: %v", err)
	}
	// A second reset of a clean workspace changes nothing.
	if rep, err := Reset(root, key); err != nil || rep.Removed != 0 || len(rep.KeptEnvs) != 1 {
		t.Fatalf("second reset: %+v, %v", rep, err)
	}
}

// A platform directory replaced by a symlink or a file goes whole.
func TestResetPlatformDirNotADirectory(t *testing.T) {
	root := t.TempDir()
	target := t.TempDir()
	if err := os.WriteFile(filepath.Join(target, "keep"), []byte("x"), 0o600); err != nil {
		t.Fatal(err)
	}
	if err := os.Symlink(target, filepath.Join(root, api.PlatformDir)); err != nil {
		t.Fatal(err)
	}
	if _, err := Reset(root, []byte("k")); err != nil {
		t.Fatal(err)
	}
	if entries, _ := os.ReadDir(root); len(entries) != 0 {
		t.Errorf("%d entries left", len(entries))
	}
	if _, err := os.Stat(filepath.Join(target, "keep")); err != nil {
		t.Errorf("the reset followed the symlink: %v", err)
	}
}
