package workspace

import (
	"errors"
	"io/fs"
	"os"
	"path"
	"slices"
	"sync"
	"time"
)

// errWorkspaceFull is what a write that would pass the cap fails with.
var errWorkspaceFull = errors.New("workspace cap exceeded")

// workspaceUsage enforces the workspace cap.
//
// Usage is the sum of the apparent sizes of the regular files in the
// workspace (sparse files and hard links count in full, which errs on the
// side of refusing). It is known by walking the tree, because commands
// write to the workspace behind the supervisor's back; a walk's result is
// trusted for ttl. In between, the supervisor's own writes and deletes
// update it incrementally, so a file API write is seen at once.
//
// Writes in flight are charged as they go: a write may add a byte only if
// the committed usage plus every in-flight write's growth stays within the
// cap. A write's growth is what it has written beyond the size of the file
// it replaces, so replacing a file with a smaller or equal one always
// succeeds. (Two concurrent writes replacing the same file both get that
// credit; the excess lasts until the second rename.)
//
// A walk that overlaps any write's start, commit or abort is discarded
// (the generation counter tells), because it may have seen the tree before
// or after a change whose delta is also applied incrementally; the
// incremental figure stays, and the next write walks again.
type workspaceUsage struct {
	root *os.Root
	cap  int64
	ttl  time.Duration

	walkMu sync.Mutex // one walk at a time

	mu      sync.Mutex
	used    int64     // committed usage
	walked  time.Time // when used was last set by a walk; zero forces one
	gen     uint64    // bumped by every change the walk could race with
	charged int64     // sum of the in-flight writes' growth
	temps   map[string]struct{}
}

func newWorkspaceUsage(root *os.Root, capBytes int64, ttl time.Duration) (*workspaceUsage, error) {
	u := &workspaceUsage{root: root, cap: capBytes, ttl: ttl, temps: map[string]struct{}{}}
	n, err := walkUsage(root, nil)
	if err != nil {
		return nil, err
	}
	u.used, u.walked = n, time.Now()
	return u, nil
}

// refresh walks the tree if the last walk is older than the TTL.
func (u *workspaceUsage) refresh() {
	u.walkMu.Lock()
	defer u.walkMu.Unlock()
	u.mu.Lock()
	if !u.walked.IsZero() && time.Since(u.walked) < u.ttl {
		u.mu.Unlock()
		return
	}
	gen := u.gen
	skip := make(map[string]struct{}, len(u.temps))
	for t := range u.temps {
		skip[t] = struct{}{}
	}
	u.mu.Unlock()

	n, err := walkUsage(u.root, skip)
	u.mu.Lock()
	defer u.mu.Unlock()
	if err == nil && u.gen == gen {
		u.used, u.walked = n, time.Now()
	}
}

// snapshot returns the usage that counts against the cap now: committed
// files plus what writes in flight have added.
func (u *workspaceUsage) snapshot() int64 {
	u.refresh()
	u.mu.Lock()
	defer u.mu.Unlock()
	return u.used + u.charged
}

// invalidate forces the next refresh to walk, after a change whose size
// the supervisor did not count (a recursive delete).
func (u *workspaceUsage) invalidate() {
	u.mu.Lock()
	defer u.mu.Unlock()
	u.walked = time.Time{}
	u.gen++
}

// removed records that a regular file of size bytes was deleted.
func (u *workspaceUsage) removed(size int64) {
	u.mu.Lock()
	defer u.mu.Unlock()
	u.used = max(0, u.used-size)
	u.gen++
}

// reservation is one write in flight, into the temporary file temp, that
// will replace a file of credit bytes.
type reservation struct {
	u       *workspaceUsage
	temp    string
	credit  int64
	written int64
	charge  int64
	done    bool
}

func (u *workspaceUsage) begin(temp string, credit int64) *reservation {
	u.refresh()
	u.mu.Lock()
	defer u.mu.Unlock()
	u.temps[temp] = struct{}{}
	u.gen++
	return &reservation{u: u, temp: temp, credit: credit}
}

// fits reports whether n more bytes would fit now; used to refuse a body
// whose Content-Length is already too large before reading it.
func (r *reservation) fits(n int64) bool {
	r.u.mu.Lock()
	defer r.u.mu.Unlock()
	delta := max(0, r.written+n-r.credit) - r.charge
	return delta <= 0 || r.u.used+r.u.charged+delta <= r.u.cap
}

// grow charges n more bytes, or fails with errWorkspaceFull and charges
// nothing.
func (r *reservation) grow(n int64) error {
	u := r.u
	u.mu.Lock()
	defer u.mu.Unlock()
	charge := max(0, r.written+n-r.credit)
	if delta := charge - r.charge; delta > 0 && u.used+u.charged+delta > u.cap {
		return errWorkspaceFull
	}
	u.charged += charge - r.charge
	r.written += n
	r.charge = charge
	return nil
}

// commit records that the temporary file replaced the old one.
func (r *reservation) commit() { r.finish(true) }

// abort records that the temporary file was removed. It is a no-op after
// commit, so it can be deferred.
func (r *reservation) abort() { r.finish(false) }

func (r *reservation) finish(committed bool) {
	u := r.u
	u.mu.Lock()
	defer u.mu.Unlock()
	if r.done {
		return
	}
	r.done = true
	u.charged -= r.charge
	if committed {
		u.used = max(0, u.used+r.written-r.credit)
	}
	delete(u.temps, r.temp)
	u.gen++
}

// walkUsage sums the sizes of the regular files under root, skipping the
// temporary files in skip (they are charged as in-flight writes). Files
// that vanish during the walk are ignored.
func walkUsage(root *os.Root, skip map[string]struct{}) (int64, error) {
	var total int64
	err := walkRoot(root, ".", func(rel string, fi fs.FileInfo) error {
		if _, ok := skip[rel]; !ok && fi.Mode().IsRegular() {
			total += fi.Size()
		}
		return nil
	})
	return total, err
}

// walkRoot calls fn for every entry under dir (not dir itself), in lexical
// order, with the entry's Lstat. Symbolic links are reported, never
// followed. Everything goes through root, so a directory swapped for a
// symbolic link during the walk cannot lead it outside the workspace.
// Entries that vanish during the walk are skipped. (os.File.ReadDir's
// DirEntry.Info would lstat by a path string instead, so it is not used.)
func walkRoot(root *os.Root, dir string, fn func(rel string, fi fs.FileInfo) error) error {
	f, err := root.Open(dir)
	if err != nil {
		if errors.Is(err, fs.ErrNotExist) {
			return nil
		}
		return err
	}
	names, err := f.Readdirnames(-1)
	f.Close()
	if err != nil {
		return err
	}
	slices.Sort(names)
	for _, name := range names {
		rel := path.Join(dir, name)
		fi, err := root.Lstat(rel)
		if errors.Is(err, fs.ErrNotExist) {
			continue
		}
		if err != nil {
			return err
		}
		if err := fn(rel, fi); err != nil {
			if errors.Is(err, fs.SkipDir) {
				continue
			}
			return err
		}
		if fi.IsDir() {
			if err := walkRoot(root, rel, fn); err != nil {
				return err
			}
		}
	}
	return nil
}
