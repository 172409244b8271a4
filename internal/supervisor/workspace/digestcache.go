package workspace

import (
	"io/fs"
	"sync"
	"syscall"
	"time"
)

// digestCache remembers the SHA-256 of workspace files between manifests,
// so that a filespace sync after every tool call hashes what changed, not
// the whole workspace. An entry is valid while the file's inode, size,
// modification time and change time are the same; the change time catches
// a write followed by a reset of the modification time, as utimes also
// moves it.
//
// As in git's index, a file is not cached while its modification time is
// within racyWindow of the hash: a write in the same timestamp tick as the
// read would otherwise go unseen. Such files are hashed again next time.
type digestCache struct {
	racy time.Duration // racyWindow but in tests
	mu   sync.Mutex
	m    map[string]cachedDigest
}

type cachedDigest struct {
	key    fileKey
	sha256 string
}

type fileKey struct {
	ino, size      uint64
	mtimeNs, ctime int64
}

const (
	racyWindow = 2 * time.Second
	// maxCachedDigests bounds the cache's memory (about 150 bytes an
	// entry); a workspace with more files hashes the rest every time.
	maxCachedDigests = 200_000
)

func newDigestCache() *digestCache {
	return &digestCache{racy: racyWindow, m: map[string]cachedDigest{}}
}

func keyOf(fi fs.FileInfo) (fileKey, bool) {
	st, ok := fi.Sys().(*syscall.Stat_t)
	if !ok {
		return fileKey{}, false
	}
	return fileKey{
		ino: st.Ino, size: uint64(st.Size),
		mtimeNs: fi.ModTime().UnixNano(), ctime: st.Ctim.Nano(),
	}, true
}

// get returns the cached digest of p if fi still describes the file it was
// taken from.
func (c *digestCache) get(p string, fi fs.FileInfo) (string, bool) {
	k, ok := keyOf(fi)
	if !ok {
		return "", false
	}
	c.mu.Lock()
	defer c.mu.Unlock()
	d, ok := c.m[p]
	if !ok || d.key != k {
		return "", false
	}
	return d.sha256, true
}

// put caches sum for p as described by fi, unless the file may still be
// changing within its timestamp tick.
func (c *digestCache) put(p string, fi fs.FileInfo, sum string, hashedAt time.Time) {
	k, ok := keyOf(fi)
	if !ok || hashedAt.Sub(fi.ModTime()) < c.racy || hashedAt.Sub(time.Unix(0, k.ctime)) < c.racy {
		return
	}
	c.mu.Lock()
	defer c.mu.Unlock()
	if _, ok := c.m[p]; !ok && len(c.m) >= maxCachedDigests {
		return
	}
	c.m[p] = cachedDigest{key: k, sha256: sum}
}

// keep drops the entries under dir ("." for the whole workspace) that a
// complete walk of it did not see, so deleted files do not pin memory.
func (c *digestCache) keep(dir string, seen map[string]struct{}) {
	c.mu.Lock()
	defer c.mu.Unlock()
	for p := range c.m {
		if _, ok := seen[p]; !ok && under(p, dir) {
			delete(c.m, p)
		}
	}
}

func under(p, dir string) bool {
	return dir == "." || p == dir || len(p) > len(dir) && p[:len(dir)] == dir && p[len(dir)] == '/'
}
