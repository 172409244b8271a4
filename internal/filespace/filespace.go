// Package filespace syncs a sandbox's workspace with the agent's filespace
// in the control plane's store: file metadata in store.FileNode, contents
// as content-addressed blobs.
//
// A sync is one direction at a time. A push writes the workspace's changes
// into the filespace, stamped with the sync time; a pull writes the
// filespace's changes into the workspace. Whether a side changed is judged
// against a baseline: what both sides agreed on at the workspace's last
// sync, kept in the workspace itself (StatePath), so that a workspace
// restored from a snapshot carries the baseline that matches it. When
// both sides changed a file, the newer change wins: the workspace file's
// modification time against the node's updated_at, the authoritative
// clock, which also wins ties. A workspace deletion has no time, so it
// propagates only when the filespace has not changed the file since the
// baseline, which is when it is provably the newer change.
//
// Regular files are synced, with their permission bits: a pull restores
// the mode a file had when it was pushed. A change of mode alone moves no
// modification time and is not a change; it travels with the next change
// of content. Symbolic links and empty directories are not synced, nor is
// the workspace's platform directory (supervisorapi.PlatformDir, the
// cached Python environments), which travels only with the idle stop's
// snapshot.
package filespace

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"io/fs"
	"path"
	"sort"
	"strings"
	"sync"
	"time"

	"github.com/dustin/go-humanize"

	"github.com/agentbox/terraform-provider-agentbox/internal/store"
	"github.com/agentbox/terraform-provider-agentbox/internal/supervisor/supervisorapi"
)

// Timeout is what callers bound one sync with: hashing and copying a full
// workspace of a few GiB at a slow 10 MB/s takes a few minutes, so it is a
// hang guard.
const Timeout = 30 * time.Minute

// Workspace is the sandbox side of a sync; *supervisorapi.Client is one.
type Workspace interface {
	Manifest(ctx context.Context, dir string) (*supervisorapi.Manifest, error)
	GetFile(ctx context.Context, path string) (io.ReadCloser, error)
	PutFile(ctx context.Context, path string, body io.Reader, mode fs.FileMode) (*supervisorapi.FileInfo, error)
	Delete(ctx context.Context, path string, recursive bool) error
}

var _ Workspace = (*supervisorapi.Client)(nil)

// Direction of a sync.
type Direction string

const (
	// Push writes workspace changes into the filespace.
	Push Direction = "push"
	// Pull writes filespace changes into the workspace.
	Pull Direction = "pull"
)

// StatePath is the workspace file that holds the sync baseline. It is
// never synced itself.
const StatePath = ".agentbox-filespace.json"

// ErrWorkspaceOverCap means the workspace (or, for a pull, the workspace
// as the pull would leave it) exceeds its cap; nothing was synced.
var ErrWorkspaceOverCap = errors.New("filespace: workspace exceeds its cap")

// Options of one sync.
type Options struct {
	AgentID   string
	Direction Direction
	// CapBytes overrides the workspace's cap; 0 takes the cap the
	// supervisor reports and enforces (the template's workspace size, which
	// the controller gives it), or supervisorapi.DefaultWorkspaceCapBytes
	// from a supervisor that reports none.
	CapBytes int64
	// Now is the sync clock; nil means time.Now.
	Now func() time.Time
}

// Summary reports what a sync did.
type Summary struct {
	Direction Direction `json:"direction"`
	// SyncedAt is the sync time, the updated_at of the nodes a push wrote.
	SyncedAt time.Time `json:"synced_at"`
	// Pushed and Pulled count files written into the filespace or the
	// workspace; Deleted counts deletions applied to the side written.
	Pushed  int `json:"pushed"`
	Pulled  int `json:"pulled"`
	Deleted int `json:"deleted"`
	// Skipped counts differences this direction did not apply: the other
	// side's change was newer (the opposite direction applies it), or the
	// file changed while it was read.
	Skipped   int `json:"skipped"`
	Unchanged int `json:"unchanged"`
	// Bytes is the content written to the side synced into.
	Bytes int64 `json:"bytes"`
	// WorkspaceBytes is the workspace's size before the sync; 0 for a pull
	// from an empty filespace, which does not look at the workspace.
	WorkspaceBytes int64 `json:"workspace_bytes"`
	// Conflicts lists the paths that changed on both sides and which side
	// won, at most maxConflicts of them.
	Conflicts []Conflict `json:"conflicts,omitempty"`
}

// Conflict is a path both sides changed since the baseline.
type Conflict struct {
	Path   string `json:"path"`
	Winner string `json:"winner"` // "workspace" or "filespace"
}

const maxConflicts = 100

// baseline is the content of StatePath: for every path both sides last
// agreed on, the digest and the node's updated_at at that time.
type baseline struct {
	Version int                  `json:"version"`
	Files   map[string]agreement `json:"files"`
}

type agreement struct {
	SHA256    string    `json:"sha256"`
	UpdatedAt time.Time `json:"updated_at"`
}

// One sync per agent at a time in this process: two would race on the
// baseline. (Replicas do not coordinate; the last baseline written wins,
// which at worst makes the next sync treat a change as a conflict.)
var locks = struct {
	sync.Mutex
	m map[string]*agentLock
}{m: map[string]*agentLock{}}

type agentLock struct {
	mu   sync.Mutex
	refs int
}

func lockAgent(agentID string) func() {
	locks.Lock()
	l := locks.m[agentID]
	if l == nil {
		l = &agentLock{}
		locks.m[agentID] = l
	}
	l.refs++
	locks.Unlock()
	l.mu.Lock()
	return func() {
		l.mu.Unlock()
		locks.Lock()
		if l.refs--; l.refs == 0 {
			delete(locks.m, agentID)
		}
		locks.Unlock()
	}
}

// Sync runs one sync between ws and agentID's filespace in st.
func Sync(ctx context.Context, ws Workspace, st *store.Store, opts Options) (*Summary, error) {
	if err := opts.check(); err != nil {
		return nil, err
	}
	now := opts.Now
	if now == nil {
		now = time.Now
	}
	defer lockAgent(opts.AgentID)()

	nodes, err := listNodes(ctx, st, opts.AgentID)
	if err != nil {
		return nil, err
	}
	if opts.Direction == Pull && len(nodes) == 0 {
		// Nothing to bring, and the workspace is not touched: this is every
		// new sandbox of an agent that never synced, so its start costs a
		// store query, not a walk of the workspace. It also keeps a store
		// that lost its data from deleting the workspace's files.
		return &Summary{Direction: Pull, SyncedAt: now().UTC().Truncate(time.Microsecond)}, nil
	}

	m, err := ws.Manifest(ctx, ".")
	if err != nil {
		return nil, fmt.Errorf("list the workspace: %w", err)
	}
	capBytes := workspaceCap(opts, m)
	sum := &Summary{Direction: opts.Direction, SyncedAt: now().UTC().Truncate(time.Microsecond), WorkspaceBytes: m.TotalBytes}
	if m.TotalBytes > capBytes {
		return nil, fmt.Errorf("%w: %d bytes in use, cap %d", ErrWorkspaceOverCap, m.TotalBytes, capBytes)
	}
	work := workspaceFiles(m)
	base, err := readBaseline(ctx, ws)
	if err != nil {
		return nil, err
	}

	plan := planSync(work, nodes, base, sum)
	if opts.Direction == Push {
		if err := checkRoom(ctx, st, plan, work); err != nil {
			return nil, err
		}
	}
	if opts.Direction == Pull {
		if err := checkPullFits(plan, work, nodes, m.TotalBytes, capBytes); err != nil {
			return nil, err
		}
	}

	changed, err := applyPlan(ctx, ws, st, opts, plan, work, nodes, base, sum)
	if err != nil {
		// The baseline keeps what was done so far.
		if changed {
			err = errors.Join(err, writeBaseline(ctx, ws, base))
		}
		return sum, err
	}
	if settleBaseline(work, nodes, base) {
		changed = true
	}
	if changed {
		if err := writeBaseline(ctx, ws, base); err != nil {
			return sum, err
		}
	}
	return sum, nil
}

func (opts Options) check() error {
	if opts.AgentID == "" {
		return errors.New("filespace: agent ID is empty")
	}
	if opts.Direction != Push && opts.Direction != Pull {
		return fmt.Errorf("filespace: direction must be %q or %q, not %q", Push, Pull, opts.Direction)
	}
	return nil
}

// workspaceCap is the cap a sync must keep the workspace under: the
// caller's, else the supervisor's, else the default.
func workspaceCap(opts Options, m *supervisorapi.Manifest) int64 {
	capBytes := opts.CapBytes
	if capBytes <= 0 {
		capBytes = m.CapBytes
	}
	if capBytes <= 0 {
		capBytes = supervisorapi.DefaultWorkspaceCapBytes
	}
	return capBytes
}

// workspaceFiles indexes the manifest by path, without the sync's own
// state file.
func workspaceFiles(m *supervisorapi.Manifest) map[string]supervisorapi.ManifestEntry {
	work := map[string]supervisorapi.ManifestEntry{}
	for _, e := range m.Files {
		if e.Path != StatePath && !platformPath(e.Path) {
			work[e.Path] = e
		}
	}
	return work
}

// checkPullFits refuses a pull the cap could not take before writing
// anything: the supervisor would stop it half-way otherwise.
func checkPullFits(plan []action, work map[string]supervisorapi.ManifestEntry, nodes map[string]store.FileNode, total, capBytes int64) error {
	after := total
	for _, a := range plan {
		if a.winner != fromFilespace {
			continue
		}
		if w, ok := work[a.path]; ok {
			after -= w.Size
		}
		if n, ok := nodes[a.path]; ok && !n.Deleted {
			after += n.SizeBytes
		}
	}
	if after > capBytes {
		return fmt.Errorf("%w: the pull would leave %d bytes in the workspace, cap %d", ErrWorkspaceOverCap, after, capBytes)
	}
	return nil
}

// applyPlan carries out the actions won by the sync's direction, and says
// whether the baseline changed, also when it fails part-way.
func applyPlan(ctx context.Context, ws Workspace, st *store.Store, opts Options, plan []action,
	work map[string]supervisorapi.ManifestEntry, nodes map[string]store.FileNode, base *baseline, sum *Summary) (bool, error) {
	changed := false
	for _, a := range plan {
		var did bool
		var err error
		switch {
		case opts.Direction == Push && a.winner == fromWorkspace:
			did, err = push(ctx, ws, st, opts.AgentID, a, work, nodes, base, sum)
		case opts.Direction == Pull && a.winner == fromFilespace:
			did, err = pull(ctx, ws, st, a, work, nodes, base, sum)
		default:
			sum.Skipped++
			continue
		}
		changed = changed || did
		if err != nil {
			return changed, err
		}
	}
	return changed, nil
}

// settleBaseline records agreements found without any transfer and drops
// paths gone from both sides; it says whether the baseline changed.
func settleBaseline(work map[string]supervisorapi.ManifestEntry, nodes map[string]store.FileNode, base *baseline) bool {
	changed := false
	for p, w := range work {
		if n, ok := nodes[p]; ok && !n.Deleted && n.SHA256 == w.SHA256 {
			if b, ok := base.Files[p]; !ok || b.SHA256 != n.SHA256 || !b.UpdatedAt.Equal(n.UpdatedAt) {
				base.Files[p] = agreement{SHA256: n.SHA256, UpdatedAt: n.UpdatedAt}
				changed = true
			}
		}
	}
	for p := range base.Files {
		_, inWork := work[p]
		n, inStore := nodes[p]
		if !inWork && (!inStore || n.Deleted) {
			delete(base.Files, p)
			changed = true
		}
	}
	return changed
}

// checkRoom refuses, before anything is written, a push whose new
// contents the store has no room for: failing half-way would take as long
// and say less.
func checkRoom(ctx context.Context, st *store.Store, plan []action, work map[string]supervisorapi.ManifestEntry) error {
	var files int
	var need int64
	seen := map[string]bool{}
	for _, a := range plan {
		w, ok := work[a.path]
		if a.winner != fromWorkspace || !ok || seen[w.SHA256] {
			continue
		}
		seen[w.SHA256] = true
		if _, exists, err := st.BlobExists(ctx, w.SHA256); err != nil {
			return fmt.Errorf("look up the content of %s: %w", a.path, err)
		} else if exists {
			continue
		}
		files++
		need += w.Size
	}
	if need == 0 {
		return nil
	}
	room, err := st.BlobRoom(ctx)
	if err != nil {
		return err
	}
	if room.Known && need > room.Bytes {
		return fmt.Errorf("%w: pushing the workspace into the agent's filespace needs room for %s of new content (in %d file(s)), but the store has room for %s (%s); "+
			"grow the control plane's store: its volume (the claim agentbox-store, the chart's store.persistence.size, where the claim's StorageClass allows expansion), or a PostgreSQL store",
			store.ErrStoreFull, humanize.IBytes(uint64(need)), files, humanize.IBytes(uint64(room.Bytes)), room)
	}
	return nil
}

type side int

const (
	fromWorkspace side = iota + 1
	fromFilespace
)

type action struct {
	path   string
	winner side
}

// planSync decides, for every path where the workspace and the filespace
// differ, which side's version wins.
func planSync(work map[string]supervisorapi.ManifestEntry, nodes map[string]store.FileNode, base *baseline, sum *Summary) []action {
	paths := map[string]struct{}{}
	for p := range work {
		paths[p] = struct{}{}
	}
	for p := range nodes {
		paths[p] = struct{}{}
	}
	var plan []action
	for p := range paths {
		if p == StatePath || platformPath(p) {
			continue
		}
		w, hasW := work[p]
		n, hasN := nodes[p]
		live := hasN && !n.Deleted
		if hasW && live && w.SHA256 == n.SHA256 {
			sum.Unchanged++
			continue
		}
		if !hasW && !live {
			continue
		}
		b, hasB := base.Files[p]
		wsChanged := hasW
		fsChanged := hasN
		if hasB {
			wsChanged = !hasW || w.SHA256 != b.SHA256
			fsChanged = !hasN || !n.UpdatedAt.Equal(b.UpdatedAt)
		}
		var winner side
		switch {
		case wsChanged && !fsChanged:
			winner = fromWorkspace
		case fsChanged && !wsChanged:
			winner = fromFilespace
		default:
			// Both changed. A workspace deletion has no time, so it never
			// beats a filespace change; a file beats the node only if it
			// was modified strictly after the node's updated_at.
			winner = fromFilespace
			if hasW && (!hasN || w.ModTime.After(n.UpdatedAt)) {
				winner = fromWorkspace
			}
			if len(sum.Conflicts) < maxConflicts {
				name := "filespace"
				if winner == fromWorkspace {
					name = "workspace"
				}
				sum.Conflicts = append(sum.Conflicts, Conflict{Path: p, Winner: name})
			}
		}
		plan = append(plan, action{path: p, winner: winner})
	}
	sort.Slice(plan, func(i, j int) bool { return plan[i].path < plan[j].path })
	sort.Slice(sum.Conflicts, func(i, j int) bool { return sum.Conflicts[i].Path < sum.Conflicts[j].Path })
	return plan
}

// push writes the workspace's version of a.path into the filespace.
func push(ctx context.Context, ws Workspace, st *store.Store, agentID string, a action, work map[string]supervisorapi.ManifestEntry,
	nodes map[string]store.FileNode, base *baseline, sum *Summary) (bool, error) {
	w, hasW := work[a.path]
	node := store.FileNode{AgentID: agentID, Path: a.path, UpdatedAt: sum.SyncedAt}
	if n, ok := nodes[a.path]; ok && !node.UpdatedAt.After(n.UpdatedAt) {
		// The plan already decided the workspace wins; the store takes
		// only strictly newer writes, so a clock behind the one that
		// wrote the node (another replica's, or the same microsecond)
		// must not turn the win into a silent skip.
		node.UpdatedAt = n.UpdatedAt.Add(time.Microsecond)
	}
	if hasW {
		body, err := ws.GetFile(ctx, a.path)
		if supervisorapi.CodeOf(err) == supervisorapi.CodeNotFound {
			// Deleted since the listing; the next sync sees the deletion.
			sum.Skipped++
			return false, nil
		}
		if err != nil {
			return false, fmt.Errorf("read %s from the workspace: %w", a.path, err)
		}
		_, err = st.PutBlob(ctx, w.SHA256, body)
		body.Close()
		if errors.Is(err, store.ErrDigestMismatch) {
			// Changed since the listing; the next sync pushes it.
			sum.Skipped++
			return false, nil
		}
		if err != nil {
			return false, fmt.Errorf("store the content of %s: %w", a.path, err)
		}
		node.SizeBytes, node.SHA256 = w.Size, w.SHA256
		if m, err := supervisorapi.ParseMode(w.Mode); err == nil {
			node.Mode = m
		}
	} else {
		node.Deleted = true
	}
	applied, err := st.PutFile(ctx, node)
	if err != nil {
		return false, fmt.Errorf("write %s to the filespace: %w", a.path, err)
	}
	if !applied {
		// A newer write landed in between.
		sum.Skipped++
		return false, nil
	}
	if hasW {
		base.Files[a.path] = agreement{SHA256: w.SHA256, UpdatedAt: node.UpdatedAt}
		sum.Pushed++
		sum.Bytes += w.Size
	} else {
		delete(base.Files, a.path)
		sum.Deleted++
	}
	return true, nil
}

// pull writes the filespace's version of a.path into the workspace.
func pull(ctx context.Context, ws Workspace, st *store.Store, a action, work map[string]supervisorapi.ManifestEntry,
	nodes map[string]store.FileNode, base *baseline, sum *Summary) (bool, error) {
	n, hasN := nodes[a.path]
	if !hasN || n.Deleted {
		err := ws.Delete(ctx, a.path, false)
		if err != nil && supervisorapi.CodeOf(err) != supervisorapi.CodeNotFound {
			return false, fmt.Errorf("delete %s from the workspace: %w", a.path, err)
		}
		delete(base.Files, a.path)
		sum.Deleted++
		return true, nil
	}
	body, size, err := st.OpenBlob(ctx, n.SHA256)
	if errors.Is(err, store.ErrNotFound) {
		return false, fmt.Errorf("the filespace has no content for %s (sha256 %s)", a.path, n.SHA256)
	}
	if err != nil {
		return false, fmt.Errorf("read the content of %s: %w", a.path, err)
	}
	defer body.Close()
	// The mode the file had where it was written; for nodes that recorded
	// none, the workspace's own.
	mode := n.Mode
	if w, ok := work[a.path]; ok && mode == 0 {
		if m, err := supervisorapi.ParseMode(w.Mode); err == nil {
			mode = m
		}
	}
	if _, err := ws.PutFile(ctx, a.path, body, mode); err != nil {
		if supervisorapi.CodeOf(err) == supervisorapi.CodeWorkspaceFull {
			return false, fmt.Errorf("%w: writing %s: %w", ErrWorkspaceOverCap, a.path, err)
		}
		return false, fmt.Errorf("write %s into the workspace: %w", a.path, err)
	}
	base.Files[a.path] = agreement{SHA256: n.SHA256, UpdatedAt: n.UpdatedAt}
	sum.Pulled++
	sum.Bytes += size
	return true, nil
}

// Syncer binds Sync to a store, for callers that hold none themselves: the
// sandbox controller pushes before an idle stop and pulls before a sandbox
// serves.
type Syncer struct{ Store *store.Store }

// Sync runs Sync against s.Store.
func (s Syncer) Sync(ctx context.Context, ws Workspace, opts Options) (*Summary, error) {
	return Sync(ctx, ws, s.Store, opts)
}

func listNodes(ctx context.Context, st *store.Store, agentID string) (map[string]store.FileNode, error) {
	const page = 1000
	out := map[string]store.FileNode{}
	after := ""
	for {
		files, err := st.ListFiles(ctx, agentID, store.FileQuery{IncludeDeleted: true, AfterPath: after, Limit: page})
		if err != nil {
			return nil, fmt.Errorf("list the filespace: %w", err)
		}
		for _, f := range files {
			if validPath(f.Path) {
				out[f.Path] = f
			}
		}
		if len(files) < page {
			return out, nil
		}
		after = files[len(files)-1].Path
	}
}

// validPath keeps filespace paths a workspace could hold: relative,
// clean, and not the baseline or the platform's directory.
func validPath(p string) bool {
	return p != "" && p != StatePath && !platformPath(p) && !strings.HasPrefix(p, "/") && path.Clean(p) == p && p != ".." && !strings.HasPrefix(p, "../")
}

// platformPath reports whether p is in the workspace's platform directory
// (the cached Python environments): the sandbox's own, never synced
// either way, so that a pull cannot plant code in an environment.
func platformPath(p string) bool {
	return p == supervisorapi.PlatformDir || strings.HasPrefix(p, supervisorapi.PlatformDir+"/")
}

// readBaseline reads StatePath. A missing or unreadable one is an empty
// baseline, which only makes every difference a conflict settled by time.
func readBaseline(ctx context.Context, ws Workspace) (*baseline, error) {
	empty := &baseline{Version: 1, Files: map[string]agreement{}}
	body, err := ws.GetFile(ctx, StatePath)
	if supervisorapi.CodeOf(err) == supervisorapi.CodeNotFound {
		return empty, nil
	}
	if err != nil {
		return nil, fmt.Errorf("read the sync baseline: %w", err)
	}
	defer body.Close()
	var b baseline
	if err := json.NewDecoder(io.LimitReader(body, 256<<20)).Decode(&b); err != nil || b.Version != 1 || b.Files == nil {
		return empty, nil
	}
	return &b, nil
}

func writeBaseline(ctx context.Context, ws Workspace, b *baseline) error {
	data, err := json.Marshal(b)
	if err != nil {
		return fmt.Errorf("encode the sync baseline: %w", err)
	}
	if _, err := ws.PutFile(ctx, StatePath, strings.NewReader(string(data)), 0o600); err != nil {
		return fmt.Errorf("write the sync baseline: %w", err)
	}
	return nil
}
