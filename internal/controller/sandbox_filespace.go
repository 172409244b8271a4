package controller

import (
	"context"
	"fmt"
	"io"
	"io/fs"
	"sync"
	"time"

	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"
	"sigs.k8s.io/controller-runtime/pkg/event"
	logf "sigs.k8s.io/controller-runtime/pkg/log"

	"github.com/agentbox/terraform-provider-agentbox/internal/api/v1alpha1"
	"github.com/agentbox/terraform-provider-agentbox/internal/filespace"
	"github.com/agentbox/terraform-provider-agentbox/internal/supervisor/supervisorapi"
)

// The sandbox's sync with its agent's filespace: a push before an idle
// stop's snapshot, and a pull before a new or resumed workspace serves.

// syncRetryDelay spaces the two sync attempts of an idle stop.
var syncRetryDelay = time.Second

// syncBeforeStop pushes the workspace into the agent's filespace and then
// makes the workspace's last writes durable before it is snapshotted,
// retrying once: a failure that persists stops the sandbox without a
// snapshot (SyncFailed). The push comes first because it writes
// the sync baseline into the workspace, which the snapshot must hold.
func (r *SandboxReconciler) syncBeforeStop(ctx context.Context, sbx *v1alpha1.Sandbox, sup *supervisorapi.Client) error {
	var err error
	for attempt := range 2 {
		if attempt > 0 {
			select {
			case <-ctx.Done():
				return ctx.Err()
			case <-time.After(syncRetryDelay):
			}
		}
		if err = r.pushFilespace(ctx, sbx, sup); err != nil {
			continue
		}
		fctx, cancel := context.WithTimeout(ctx, supervisorCallTimeout)
		err = sup.Flush(fctx)
		cancel()
		if err == nil {
			return nil
		}
	}
	return err
}

func (r *SandboxReconciler) pushFilespace(ctx context.Context, sbx *v1alpha1.Sandbox, sup *supervisorapi.Client) error {
	sum, err := r.syncFilespace(ctx, sbx, sup, filespace.Push)
	if err != nil || sum == nil {
		return err
	}
	logf.FromContext(ctx).Info("filespace pushed before the idle stop", "pushed", sum.Pushed, "deleted", sum.Deleted, "bytes", sum.Bytes)
	return nil
}

// pullFilespace brings the agent's filespace into a workspace that is about
// to serve: a new one (the agent's files outlive its sandboxes) or one just
// restored from a snapshot (the filespace may be newer). A sync is
// idempotent, so running it again after a crash or an error is safe.
//
// The pull runs in the background (filespacePulls): it reads the store and
// calls the sandbox's supervisor, and a supervisor that is slow, or a pod
// address that does not answer, must not hold one of the controller's
// workers, or every other sandbox's lifecycle queues behind it. The pass
// waits for it at most pullWait, which a pull with nothing to bring (a
// store query: every sandbox of an agent that never synced) stays well
// within; a longer one reports done false, and its end brings the sandbox
// back (SetupWithManager's channel source), with a pullRecheck requeue in
// case nothing else does.
func (r *SandboxReconciler) pullFilespace(ctx context.Context, sbx *v1alpha1.Sandbox, pod *corev1.Pod) (done bool, err error) {
	if r.Filespaces == nil || isWarm(sbx) {
		return true, nil
	}
	// The pull outlives the pass, which goes on changing sbx.
	own, podCopy := sbx.DeepCopy(), pod.DeepCopy()
	p := r.pulls.begin(sbx, pod, func(ctx context.Context) (*filespace.Summary, error) {
		// The supervisor is dialed only if the pull needs the workspace:
		// for an agent that never synced, which is most new sandboxes, it
		// does not, and the supervisor pool then keeps no client for a
		// sandbox nothing calls.
		ws := &lazyWorkspace{dial: func() (*supervisorapi.Client, error) { return r.supervisor(own, podCopy) }}
		return r.syncFilespace(ctx, own, ws, filespace.Pull)
	})
	wait := time.NewTimer(pullWait)
	defer wait.Stop()
	select {
	case <-p.done:
	case <-wait.C:
		return false, nil
	case <-ctx.Done():
		return false, ctx.Err()
	}
	r.pulls.forget(sbx.UID, p)
	if p.err != nil {
		return false, p.err
	}
	if sum := p.sum; sum != nil && sum.Pulled+sum.Deleted > 0 {
		r.event(sbx, pod, corev1.EventTypeNormal, EventFilespacePulled, "Sync",
			fmt.Sprintf("pulled %d files (%s) and %d deletions from the agent's filespace into the workspace", sum.Pulled, formatBytes(sum.Bytes), sum.Deleted))
	}
	return true, nil
}

// pullWait is how long a pass waits for its sandbox's filespace pull
// before it lets the worker go: enough for a pull with nothing to bring.
var pullWait = 500 * time.Millisecond

// pullRecheck is how soon a sandbox whose pull is under way is looked at
// again should the pull's end bring it back no other way.
const pullRecheck = 10 * time.Second

// maxPulls bounds the pulls running at once: each holds a connection to a
// supervisor and store reads, and a thousand sandboxes starting together
// must not open a thousand of each.
const maxPulls = 16

// filespacePulls are the first-serve pulls under way, or finished and not
// yet seen by a pass, by sandbox UID. The zero value is ready to use.
type filespacePulls struct {
	mu      sync.Mutex
	running map[types.UID]*filespacePull
	slots   chan struct{}
	// notify, when set, is told the sandbox whose pull ended, so that the
	// controller takes it up again at once.
	notify chan<- event.GenericEvent
}

// filespacePull is one pull, for one pod of the sandbox.
type filespacePull struct {
	pod    types.UID
	cancel context.CancelFunc
	done   chan struct{} // closed when sum and err are set
	sum    *filespace.Summary
	err    error
}

// begin returns the pull of sbx into pod, starting it unless one is under
// way or finished. A pull for an earlier pod is called off: the workspace
// it wrote into is not the one about to serve.
func (f *filespacePulls) begin(sbx *v1alpha1.Sandbox, pod *corev1.Pod, run func(context.Context) (*filespace.Summary, error)) *filespacePull {
	f.mu.Lock()
	defer f.mu.Unlock()
	if p := f.running[sbx.UID]; p != nil {
		if p.pod == pod.UID {
			return p
		}
		p.cancel()
		delete(f.running, sbx.UID)
	}
	if f.running == nil {
		f.running = map[types.UID]*filespacePull{}
		f.slots = make(chan struct{}, maxPulls)
	}
	ctx, cancel := context.WithCancel(context.Background())
	p := &filespacePull{pod: pod.UID, cancel: cancel, done: make(chan struct{})}
	f.running[sbx.UID] = p
	// Only what the notification needs: the pass reads the sandbox anew.
	key := &v1alpha1.Sandbox{ObjectMeta: metav1.ObjectMeta{Namespace: sbx.Namespace, Name: sbx.Name}}
	slots, notify := f.slots, f.notify
	go func() {
		defer cancel()
		select {
		case slots <- struct{}{}:
			p.sum, p.err = run(ctx)
			<-slots
		case <-ctx.Done():
			p.err = ctx.Err()
		}
		close(p.done)
		if notify != nil {
			select {
			case notify <- event.GenericEvent{Object: key}:
			case <-ctx.Done():
			}
		}
	}()
	return p
}

// lazyWorkspace is a sandbox's workspace whose supervisor is dialed on
// the first call.
type lazyWorkspace struct {
	dial func() (*supervisorapi.Client, error)
	once sync.Once
	sup  *supervisorapi.Client
	err  error
}

var _ filespace.Workspace = (*lazyWorkspace)(nil)

func (w *lazyWorkspace) client() (*supervisorapi.Client, error) {
	w.once.Do(func() { w.sup, w.err = w.dial() })
	return w.sup, w.err
}

func (w *lazyWorkspace) Manifest(ctx context.Context, dir string) (*supervisorapi.Manifest, error) {
	sup, err := w.client()
	if err != nil {
		return nil, err
	}
	return sup.Manifest(ctx, dir)
}

func (w *lazyWorkspace) GetFile(ctx context.Context, path string) (io.ReadCloser, error) {
	sup, err := w.client()
	if err != nil {
		return nil, err
	}
	return sup.GetFile(ctx, path)
}

func (w *lazyWorkspace) PutFile(ctx context.Context, path string, body io.Reader, mode fs.FileMode) (*supervisorapi.FileInfo, error) {
	sup, err := w.client()
	if err != nil {
		return nil, err
	}
	return sup.PutFile(ctx, path, body, mode)
}

func (w *lazyWorkspace) Delete(ctx context.Context, path string, recursive bool) error {
	sup, err := w.client()
	if err != nil {
		return err
	}
	return sup.Delete(ctx, path, recursive)
}

// pending reports whether sbx has a pull under way or unseen; the pass
// then comes back within pullRecheck.
func (f *filespacePulls) pending(uid types.UID) bool {
	f.mu.Lock()
	defer f.mu.Unlock()
	return f.running[uid] != nil
}

// drop calls off and forgets sbx's pull: the sandbox is going away.
func (f *filespacePulls) drop(uid types.UID) {
	f.mu.Lock()
	defer f.mu.Unlock()
	if p := f.running[uid]; p != nil {
		p.cancel()
		delete(f.running, uid)
	}
}

// forget drops p, once a pass has seen its end; a later pull for the same
// sandbox (a resume) starts anew.
func (f *filespacePulls) forget(uid types.UID, p *filespacePull) {
	f.mu.Lock()
	defer f.mu.Unlock()
	if f.running[uid] == p {
		delete(f.running, uid)
	}
}

// syncFilespace runs one sync of sbx's workspace with its agent's
// filespace, or nothing (nil, nil) without a syncer or for a warm sandbox,
// which has no agent yet and pulls once it is adopted.
func (r *SandboxReconciler) syncFilespace(ctx context.Context, sbx *v1alpha1.Sandbox, sup filespace.Workspace, dir filespace.Direction) (*filespace.Summary, error) {
	if r.Filespaces == nil || isWarm(sbx) {
		return nil, nil
	}
	sctx, cancel := context.WithTimeout(ctx, filespace.Timeout)
	defer cancel()
	sum, err := r.Filespaces.Sync(sctx, sup, filespace.Options{AgentID: sbx.Spec.AgentID, Direction: dir, Now: r.now})
	if err != nil {
		return nil, fmt.Errorf("%s between the workspace and the agent's filespace: %w", dir, err)
	}
	return sum, nil
}
