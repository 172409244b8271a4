package controller

import (
	"context"
	"fmt"
	"time"
	"unicode/utf8"

	"k8s.io/apimachinery/pkg/api/equality"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	"k8s.io/apimachinery/pkg/api/meta"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/runtime"
	"k8s.io/client-go/tools/events"
	ctrl "sigs.k8s.io/controller-runtime"
	"sigs.k8s.io/controller-runtime/pkg/client"
	logf "sigs.k8s.io/controller-runtime/pkg/log"

	"github.com/agentbox/terraform-provider-agentbox/internal/api/v1alpha1"
)

// The status helpers every reconciler shares: how a condition is stamped,
// how an event is recorded, and how a status is written. Each reconciler
// reports the same way, so they are written once here and each reconciler
// wraps them for its kind.

// setCondition sets the condition typ of an object at generation.
func setCondition(conds *[]metav1.Condition, typ string, generation int64, now time.Time, status metav1.ConditionStatus, reason, msg string) {
	meta.SetStatusCondition(conds, metav1.Condition{
		Type:               typ,
		Status:             status,
		Reason:             reason,
		Message:            truncateMessage(msg),
		ObservedGeneration: generation,
		// Whole seconds, as the API stores them, so that a re-read condition
		// compares equal to the one written.
		LastTransitionTime: metav1.NewTime(now.Truncate(time.Second)),
	})
}

// readyReasonOf is the reason of the Ready condition, or "" without one.
func readyReasonOf(conds []metav1.Condition) string {
	if c := meta.FindStatusCondition(conds, v1alpha1.ConditionReady); c != nil {
		return c.Reason
	}
	return ""
}

// readyReasonIsNew reports whether the Ready condition's reason differs
// from prevReason, the one the pass began with. Events that report a state
// record only then, so that a state lasting across many passes (a
// crash-looping pod, a missing template) is told once, not on every pass.
func readyReasonIsNew(conds []metav1.Condition, prevReason string) bool {
	c := meta.FindStatusCondition(conds, v1alpha1.ConditionReady)
	return c == nil || c.Reason != prevReason
}

// recordEvent records an event about obj, if the reconciler has a
// recorder. The note is cut to what the API server accepts: it refuses a
// longer one, and the event is then lost (a crashed container's last log
// lines, in its termination message, easily pass it).
func recordEvent(rec events.EventRecorder, obj, related runtime.Object, eventType, reason, action, note string) {
	if rec == nil {
		return
	}
	rec.Eventf(obj, related, eventType, reason, action, "%s", truncateEventNote(note))
}

// patchStatusIfChanged writes obj's status, is, when it differs from was,
// the status of base, the object as read. Writing only on change keeps a
// settled object from generating watch events (and resourceVersion bumps)
// on every resync. A merge patch rather than an update: each controller is
// its kind's only status writer, and a patch does not fail on the
// resourceVersion bump of a metadata patch or of a client's spec change in
// between. kind names the object in the error.
func patchStatusIfChanged(ctx context.Context, c client.Client, base, obj client.Object, was, is any, kind string) error {
	if equality.Semantic.DeepEqual(was, is) {
		return nil
	}
	if err := c.Status().Patch(ctx, obj, client.MergeFrom(base)); err != nil {
		return fmt.Errorf("write status of %s %s: %w", kind, obj.GetName(), err)
	}
	return nil
}

// fetch reads the object req names into obj. It reports false, with no
// error, when the object is gone: there is nothing left to reconcile.
func fetch(ctx context.Context, c client.Reader, req ctrl.Request, obj client.Object) (bool, error) {
	if err := c.Get(ctx, req.NamespacedName, obj); err != nil {
		return false, client.IgnoreNotFound(err)
	}
	return true, nil
}

// fetchLive is fetch that also reports false for an object being deleted,
// for kinds whose children owner references take along.
func fetchLive(ctx context.Context, c client.Reader, req ctrl.Request, obj client.Object) (bool, error) {
	found, err := fetch(ctx, c, req, obj)
	return found && obj.GetDeletionTimestamp().IsZero(), err
}

// cacheRetry is how soon a pass that found the cache behind runs again.
const cacheRetry = time.Second

// cacheBehind reports, and logs, whether err only says that the cache lags
// behind a write (ours or someone's): the next pass reads the current
// object. Reporting it as a ReconcileError would flap the Ready condition
// for nothing.
func cacheBehind(ctx context.Context, err error) bool {
	if !apierrors.IsAlreadyExists(err) && !apierrors.IsConflict(err) {
		return false
	}
	logf.FromContext(ctx).V(1).Info("cache is behind; retrying", "reason", err.Error())
	return true
}

// fillFromManager gives a reconciler what it was not given from mgr: the
// manager's client and scheme, and an event recorder reporting as name.
func fillFromManager(mgr ctrl.Manager, name string, c *client.Client, scheme **runtime.Scheme, rec *events.EventRecorder) {
	if *c == nil {
		*c = mgr.GetClient()
	}
	if *scheme == nil {
		*scheme = mgr.GetScheme()
	}
	if *rec == nil {
		*rec = mgr.GetEventRecorder(name)
	}
}

// indexField registers a field index with mgr's cache; what names it in
// the error.
func indexField(mgr ctrl.Manager, obj client.Object, field string, extract client.IndexerFunc, what string) error {
	if err := mgr.GetFieldIndexer().IndexField(context.Background(), obj, field, extract); err != nil {
		return fmt.Errorf("index %s: %w", what, err)
	}
	return nil
}

// maxMessage keeps condition messages under the API's 32768-byte limit
// with room to spare; kubelet messages (image pull errors) can be long.
const maxMessage = 4096

// maxEventNote is the API server's limit on an event's note.
const maxEventNote = 1024

func truncateMessage(s string) string { return truncateTo(s, maxMessage) }

func truncateEventNote(s string) string { return truncateTo(s, maxEventNote) }

// truncateTo cuts s to at most n bytes, marking the cut, and never inside
// a UTF-8 sequence (the API server refuses invalid UTF-8).
func truncateTo(s string, n int) string {
	if len(s) <= n {
		return s
	}
	cut := n - 3
	for cut > 0 && !utf8.RuneStart(s[cut]) {
		cut--
	}
	return s[:cut] + "..."
}
