package pyenv

import (
	"context"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strings"
	"testing"

	"github.com/agentbox/terraform-provider-agentbox/internal/supervisor/pyenv/pyenvtest"
)

// Environments built with a seal key are kept by Scrub while nobody
// changed them, and dropped when a file in them, or their metadata, was
// changed; bytecode caches are removed from kept ones, and the installer
// environment and anything else in the directory always go.
func TestScrubKeepsOnlyUnchangedSealedEnvironments(t *testing.T) {
	ix := pyenvtest.NewIndex(t, greet)
	key := []byte("0123456789abcdef0123456789abcdef")
	dir := t.TempDir()
	m := newTestManager(t, Config{Dir: dir, IndexURL: ix.URL, SealKey: key})
	ctx := context.Background()
	dirs := map[string]string{}
	for _, name := range []string{"kept", "edited", "installed-into", "meta-edited"} {
		l, _, err := m.Ensure(ctx, Request{Name: name, Requirements: []string{"agentbox-greet"}})
		if err != nil {
			t.Fatal(err)
		}
		dirs[name] = l.Dir()
		// A run imports from it: Python may write bytecode caches, which
		// must not count as a change.
		if out, err := exec.Command(l.Python(), "-c", "import agentbox_greet").CombinedOutput(); err != nil {
			t.Fatalf("import: %v\n%s", err, out)
		}
		l.Release()
	}
	if err := VerifySeal(dirs["kept"], key); err != nil {
		t.Fatalf("fresh environment: %v", err)
	}
	site, err := filepath.Glob(filepath.Join(dirs["edited"], "lib", "python3*", "site-packages", "agentbox_greet", "__init__.py"))
	if err != nil || len(site) != 1 {
		t.Fatalf("site-packages: %v %v", site, err)
	}
	if err := os.WriteFile(site[0], []byte("def hello(who):\n    return 'pwned'\n"), 0o644); err != nil {
		t.Fatal(err)
	}
	added := filepath.Join(filepath.Dir(filepath.Dir(site[0])), "sitecustomize.py")
	if err := os.WriteFile(strings.Replace(added, dirs["edited"], dirs["installed-into"], 1), []byte("print('pwned')\n"), 0o644); err != nil {
		t.Fatal(err)
	}
	// Whoever edits the metadata cannot make a matching seal without the
	// key; a seal computed with another key does not match either.
	if err := Seal(dirs["meta-edited"], []byte("another key")); err != nil {
		t.Fatal(err)
	}
	// A planted .pyc beside a source of the environment is no change of
	// its digest, but must not reach the next holder either.
	pyc := filepath.Join(strings.Replace(filepath.Dir(site[0]), dirs["edited"], dirs["kept"], 1), pycacheDir)
	if err := os.MkdirAll(pyc, 0o700); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(filepath.Join(pyc, "x.cpython-311.pyc"), []byte("planted"), 0o600); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(filepath.Join(dir, "stray"), []byte("x"), 0o600); err != nil {
		t.Fatal(err)
	}
	// The installer environment (made when the base interpreter has no
	// pip) holds the pip every later build runs.
	if err := os.MkdirAll(filepath.Join(dir, installerDir, "bin"), 0o700); err != nil {
		t.Fatal(err)
	}
	m.Close()

	res, err := Scrub(dir, key)
	if err != nil {
		t.Fatal(err)
	}
	if want := []string{filepath.Base(dirs["kept"])}; !slices.Equal(res.Kept, want) {
		t.Fatalf("kept %v, want %v (dropped %v)", res.Kept, want, res.Dropped)
	}
	for _, gone := range []string{filepath.Base(dirs["edited"]), filepath.Base(dirs["installed-into"]), filepath.Base(dirs["meta-edited"]), installerDir, "stray"} {
		if res.Dropped[gone] == "" {
			t.Errorf("%s not dropped: %v", gone, res.Dropped)
		}
		if _, err := os.Lstat(filepath.Join(dir, gone)); !os.IsNotExist(err) {
			t.Errorf("%s still there: %v", gone, err)
		}
	}
	if !strings.Contains(res.Dropped[filepath.Base(dirs["edited"])], "changed") {
		t.Errorf("why the edited environment went: %q", res.Dropped[filepath.Base(dirs["edited"])])
	}
	if err := filepath.WalkDir(dirs["kept"], func(p string, d os.DirEntry, err error) error {
		if err == nil && d.Name() == pycacheDir {
			t.Errorf("bytecode cache left in a kept environment: %s", p)
		}
		return err
	}); err != nil {
		t.Fatal(err)
	}
	// The kept environment still works, and a manager takes it in.
	m2 := newTestManager(t, Config{Dir: dir, IndexURL: ix.URL, SealKey: key})
	l, created, err := m2.Ensure(ctx, Request{Name: "kept"})
	if err != nil || created {
		t.Fatalf("kept environment: created %v, %v", created, err)
	}
	defer l.Release()
	if out, err := exec.Command(l.Python(), "-c", "import agentbox_greet; print(agentbox_greet.hello('b'))").Output(); err != nil || string(out) != "hello b\n" {
		t.Fatalf("kept environment runs: %q, %v", out, err)
	}
	if n := ix.Downloads("agentbox-greet"); n != 4 {
		t.Errorf("%d downloads, want 4 (one per build, none for the kept one)", n)
	}
}

// Without a key nothing can be verified, and nothing is kept; an
// environment built without a key has no seal.
func TestScrubWithoutKeyKeepsNothing(t *testing.T) {
	dir := t.TempDir()
	m := newTestManager(t, Config{Dir: dir})
	l, _, err := m.Ensure(context.Background(), Request{Name: "e", CreateEmpty: true})
	if err != nil {
		t.Fatal(err)
	}
	if err := VerifySeal(l.Dir(), []byte("k")); err != ErrNotSealed {
		t.Errorf("unsealed environment: %v", err)
	}
	l.Release()
	m.Close()
	res, err := Scrub(dir, nil)
	if err != nil || len(res.Kept) != 0 {
		t.Fatalf("kept %v, %v", res.Kept, err)
	}
	if entries, _ := os.ReadDir(dir); len(entries) != 0 {
		t.Errorf("%d entries left", len(entries))
	}
}

// RemoveAll gets past directories whose owner took the write and read
// bits off.
func TestRemoveAllLockedDirectories(t *testing.T) {
	root := filepath.Join(t.TempDir(), "x")
	deep := filepath.Join(root, "a", "b", "c")
	if err := os.MkdirAll(deep, 0o700); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(filepath.Join(deep, "f"), []byte("x"), 0o400); err != nil {
		t.Fatal(err)
	}
	for _, d := range []string{deep, filepath.Dir(deep), filepath.Join(root, "a")} {
		if err := os.Chmod(d, 0); err != nil {
			t.Fatal(err)
		}
	}
	if err := RemoveAll(root); err != nil {
		t.Fatal(err)
	}
	if _, err := os.Lstat(root); !os.IsNotExist(err) {
		t.Fatalf("still there: %v", err)
	}
}
