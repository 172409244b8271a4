package holds

import (
	"context"
	"encoding/json"
	"fmt"
	"sync"
	"time"

	"github.com/go-logr/logr"
	coordinationv1 "k8s.io/api/coordination/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/utils/clock"
	"sigs.k8s.io/controller-runtime/pkg/client"

	"github.com/agentbox/terraform-provider-agentbox/internal/api/v1alpha1"
)

// DefaultActivityRenewInterval throttles activity renewals. The idle timeout
// is measured in tens of minutes, so a renewal every 30 s loses nothing,
// while renewing on every call would put one API write behind each command.
// The controller relies on it being at most v1alpha1.ActivityRenewInterval.
const DefaultActivityRenewInterval = v1alpha1.ActivityRenewInterval

// ActivityLeaseKey names the Kubernetes Lease that is a sandbox's
// activity clock, and that carries its hold.
func ActivityLeaseKey(sb *v1alpha1.Sandbox) types.NamespacedName {
	return types.NamespacedName{Namespace: sb.Namespace, Name: v1alpha1.LeaseName(sb.Name)}
}

// ActivityClock records activity on sandboxes by moving their activity
// clock (the renewTime of their Kubernetes Lease), at most once per
// interval per sandbox. The throttle is in
// memory: after a restart, or on another replica, the first call renews
// again, which is harmless.
type ActivityClock struct {
	client   client.Client
	clock    clock.PassiveClock
	interval time.Duration
	log      logr.Logger

	mu        sync.Mutex
	last      map[types.NamespacedName]time.Time
	lastSweep time.Time
}

// NewActivityClock returns the activity clock that writes through c and
// renews a sandbox's at most once per interval.
func NewActivityClock(c client.Client, clk clock.PassiveClock, interval time.Duration, log logr.Logger) *ActivityClock {
	return &ActivityClock{client: c, clock: clk, interval: interval, log: log, last: map[types.NamespacedName]time.Time{}}
}

// Renew moves the sandbox's activity clock to now unless that was done
// less than the interval ago. Failures are logged, not returned: losing
// one activity mark is far less harmful than failing the agent's call, and
// the next call after the interval tries again.
func (r *ActivityClock) Renew(ctx context.Context, sb *v1alpha1.Sandbox) {
	key := ActivityLeaseKey(sb)
	now := r.clock.Now()
	r.mu.Lock()
	if t, ok := r.last[key]; ok && now.Sub(t) < r.interval {
		r.mu.Unlock()
		return
	}
	// Claimed before the write so concurrent calls do not all renew.
	r.last[key] = now
	r.sweepLocked(now)
	r.mu.Unlock()

	err := r.patch(ctx, key, now, nil)
	if err == nil {
		return
	}
	r.mu.Lock()
	if r.last[key].Equal(now) {
		delete(r.last, key)
	}
	r.mu.Unlock()
	if apierrors.IsNotFound(err) {
		// The controller has not created it yet (or the sandbox is being
		// deleted); it starts the clock itself when it does.
		r.log.V(1).Info("sandbox lease not found; activity not recorded", "lease", key.String())
		return
	}
	r.log.Error(err, "renew sandbox lease", "lease", key.String())
}

// Wake renews the activity clock of a sandbox that is not running, whatever the
// throttle says: on a stopped sandbox the renewal is the signal that
// resumes it, and must not be skipped because a call half a minute ago
// already renewed (that renewal may have landed before the stop began).
//
// The renewal is marked as a wake (v1alpha1.AnnotationWokenAt): the call
// that woke the sandbox is served only once it serves again, so until the
// next renewal the controller counts the sandbox idle from then.
func (r *ActivityClock) Wake(ctx context.Context, sb *v1alpha1.Sandbox) {
	key := ActivityLeaseKey(sb)
	now := r.clock.Now().Truncate(time.Microsecond)
	if err := r.patch(ctx, key, now, map[string]any{v1alpha1.AnnotationWokenAt: now.UTC().Format(metav1.RFC3339Micro)}); err != nil {
		r.log.Error(err, "renew the lease of a sandbox to wake it", "lease", key.String())
		return
	}
	r.NoteRenewed(key, now)
}

func (r *ActivityClock) patch(ctx context.Context, key types.NamespacedName, now time.Time, annotations map[string]any) error {
	// A merge patch of renewTime (and a wake's mark): no read first, no
	// conflict with the controller, and the holder and annotations of a
	// hold, written by hold calls with resourceVersion checks, stay as
	// they are.
	patch := map[string]any{"spec": map[string]any{"renewTime": metav1.NewMicroTime(now)}}
	if annotations != nil {
		patch["metadata"] = map[string]any{"annotations": annotations}
	}
	body, err := json.Marshal(patch)
	if err != nil {
		return fmt.Errorf("encode lease patch: %w", err)
	}
	lease := &coordinationv1.Lease{ObjectMeta: metav1.ObjectMeta{Namespace: key.Namespace, Name: key.Name}}
	if err := r.client.Patch(ctx, lease, client.RawPatch(types.MergePatchType, body)); err != nil {
		return fmt.Errorf("patch lease %s: %w", key, err)
	}
	return nil
}

// NoteRenewed records that renewTime was moved to now by another write (a
// hold's acquire or heartbeat, a pool lease's settle), so that the next
// call does not renew again within the interval.
func (r *ActivityClock) NoteRenewed(key types.NamespacedName, now time.Time) {
	r.mu.Lock()
	defer r.mu.Unlock()
	if t, ok := r.last[key]; !ok || now.After(t) {
		r.last[key] = now
	}
}

// sweepLocked forgets entries older than the interval, which would renew
// anyway, so sandboxes that are gone do not accumulate.
func (r *ActivityClock) sweepLocked(now time.Time) {
	if now.Sub(r.lastSweep) < r.interval {
		return
	}
	r.lastSweep = now
	for k, t := range r.last {
		if now.Sub(t) >= r.interval {
			delete(r.last, k)
		}
	}
}

// Interval is the least time between two renewals of one sandbox's
// activity clock.
func (r *ActivityClock) Interval() time.Duration { return r.interval }
