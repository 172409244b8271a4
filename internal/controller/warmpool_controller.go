package controller

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"errors"
	"fmt"
	"sort"
	"sync"
	"time"

	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/labels"
	"k8s.io/apimachinery/pkg/runtime"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/client-go/tools/events"
	"k8s.io/utils/clock"
	ctrl "sigs.k8s.io/controller-runtime"
	"sigs.k8s.io/controller-runtime/pkg/client"
	"sigs.k8s.io/controller-runtime/pkg/controller/controllerutil"
	"sigs.k8s.io/controller-runtime/pkg/handler"
	"sigs.k8s.io/controller-runtime/pkg/reconcile"

	"github.com/agentbox/terraform-provider-agentbox/internal/api/v1alpha1"
	"github.com/agentbox/terraform-provider-agentbox/internal/store"
)

// WarmPoolControllerName names the warm pool controller, and its events'
// reporter.
const WarmPoolControllerName = "agentbox-warmpool"

// Event reasons of the warm pool controller.
const (
	EventWarmSandboxCreated = "WarmSandboxCreated"
	EventWarmSandboxDeleted = "WarmSandboxDeleted"
	EventPoolFull           = "PoolFull"
)

// createExpiry bounds how long a created warm sandbox that the cache has
// not shown yet is counted as present. Without it, a pass that runs before
// the cache catches up would create the same replicas again.
const createExpiry = 30 * time.Second

// claimRecheck is how often a pool with claimed sandboxes is looked at
// again: a claim whose adopter was deleted before finishing is cleaned up
// by the pool, and nothing about the claimed sandbox changes to wake it.
const claimRecheck = time.Minute

// SandboxWarmPoolReconciler keeps spec.replicas unassigned, ready Sandboxes
// of a pool's template. They are ordinary Sandboxes owned by the pool; the
// Sandbox controller runs them, and a new Sandbox of the same template
// adopts one (see adopt), after which the pool makes a replacement.
type SandboxWarmPoolReconciler struct {
	client.Client
	Scheme *runtime.Scheme
	// Recorder receives events about pools; SetupWithManager fills it from
	// the manager when nil.
	Recorder events.EventRecorder
	// Clock is the controller's notion of now; nil means the real clock.
	Clock clock.PassiveClock
	// WarmTakes decides who gets each ready warm sandbox; see WarmTakes.
	WarmTakes WarmTakes
	// Namespaces are the namespaces the platform serves; a pool elsewhere
	// makes no sandboxes and only gets the NamespaceNotServed condition.
	// Empty serves every namespace.
	Namespaces ServedNamespaces

	mu sync.Mutex
	// created maps a pool's UID to the sandboxes it created that the cache
	// may not show yet, with when they were created.
	created map[types.UID]map[string]time.Time
}

// SetupWithManager registers the reconciler and its watches with mgr.
func (r *SandboxWarmPoolReconciler) SetupWithManager(mgr ctrl.Manager) error {
	fillFromManager(mgr, WarmPoolControllerName, &r.Client, &r.Scheme, &r.Recorder)
	if err := indexField(mgr, &v1alpha1.SandboxWarmPool{}, templateRefIndex, func(o client.Object) []string {
		return []string{o.(*v1alpha1.SandboxWarmPool).Spec.TemplateRef.Name}
	}, "warm pools by template"); err != nil {
		return err
	}
	return ctrl.NewControllerManagedBy(mgr).
		Named(WarmPoolControllerName).
		For(&v1alpha1.SandboxWarmPool{}).
		Owns(&v1alpha1.Sandbox{}).
		// A template change rolls the pool; a template that appears lets a
		// waiting pool fill.
		Watches(&v1alpha1.SandboxTemplate{}, handler.EnqueueRequestsFromMapFunc(r.poolsForTemplate)).
		Complete(r)
}

func (r *SandboxWarmPoolReconciler) poolsForTemplate(ctx context.Context, o client.Object) []reconcile.Request {
	var list v1alpha1.SandboxWarmPoolList
	if !listOfTemplate(ctx, r, &list, o, "warm pools") {
		return nil
	}
	return requestsFor(list.Items)
}

func (r *SandboxWarmPoolReconciler) now() time.Time { return nowOf(r.Clock) }

// Reconcile brings a pool's unassigned sandboxes to spec.replicas, all made
// from the template as it is now, and reports them in the status.
func (r *SandboxWarmPoolReconciler) Reconcile(ctx context.Context, req ctrl.Request) (ctrl.Result, error) {
	var pool v1alpha1.SandboxWarmPool
	// Once it is deleted, owner references take the warm sandboxes along.
	if live, err := fetchLive(ctx, r, req, &pool); !live {
		return ctrl.Result{}, err
	}
	if !r.Namespaces.Serves(pool.Namespace) {
		return r.refuseNamespace(ctx, &pool)
	}
	base := pool.DeepCopy()
	result, err := r.reconcilePool(ctx, readyReasonOf(base.Status.Conditions), &pool)
	if cacheBehind(ctx, err) {
		// Unlike the other reconcilers, the status found so far is still
		// written.
		result, err = ctrl.Result{RequeueAfter: cacheRetry}, nil
	} else if err != nil {
		r.setReady(&pool, metav1.ConditionFalse, v1alpha1.ReasonReconcileError, err.Error())
	}
	if serr := patchStatusIfChanged(ctx, r.Client, base, &pool, base.Status, pool.Status, "warm pool"); serr != nil {
		return ctrl.Result{}, errors.Join(err, serr)
	}
	return result, err
}

// refuseNamespace reports a pool in a namespace the platform does not
// serve, once no other platform has taken it up (notServedNow). Its
// sandboxes could never run: none is made.
func (r *SandboxWarmPoolReconciler) refuseNamespace(ctx context.Context, pool *v1alpha1.SandboxWarmPool) (ctrl.Result, error) {
	if tell, wait := notServedNow(pool.CreationTimestamp, pool.Status.Conditions, r.now()); !tell {
		return ctrl.Result{RequeueAfter: wait}, nil
	}
	base := pool.DeepCopy()
	pool.Status.ObservedGeneration = pool.Generation
	msg := r.Namespaces.notServedMessage("SandboxWarmPool", pool.Namespace)
	r.setReady(pool, metav1.ConditionFalse, v1alpha1.ReasonNamespaceNotServed, msg)
	r.event(pool, nil, corev1.EventTypeWarning, EventNamespaceNotServed, "Wait", msg)
	return ctrl.Result{}, patchStatusIfChanged(ctx, r.Client, base, pool, base.Status, pool.Status, "warm pool")
}

// reconcilePool runs a pass over the pool: its template, its sandboxes as
// they are, the retiring of outdated ones, scaling to spec.replicas, and
// the status.
func (r *SandboxWarmPoolReconciler) reconcilePool(ctx context.Context, prevReason string, pool *v1alpha1.SandboxWarmPool) (ctrl.Result, error) {
	pool.Status.ObservedGeneration = pool.Generation
	pool.Status.Selector = labels.SelectorFromSet(labels.Set{v1alpha1.LabelWarmPool: pool.Name}).String()

	tpl, err := r.getTemplate(ctx, pool)
	if err != nil {
		return ctrl.Result{}, err
	}
	hash := ""
	if tpl != nil {
		hash = v1alpha1.TemplateHash(&tpl.Spec)
	}
	var result ctrl.Result
	m, err := r.members(ctx, pool, tpl != nil, hash, &result)
	if err != nil {
		return ctrl.Result{}, err
	}
	pending := r.pending(pool.UID, m.seen)
	if pending > 0 {
		result.RequeueAfter = minPositive(result.RequeueAfter, createExpiry)
	}

	// A rolled template replaces every warm sandbox at once: an outdated
	// one is never adopted, so keeping it serves nobody.
	for _, s := range m.outdated {
		if err := r.retireWarm(ctx, pool, s, fmt.Sprintf("template %s changed", tpl.Name)); err != nil {
			return ctrl.Result{}, err
		}
	}
	current, created, err := r.scale(ctx, pool, tpl, hash, m.current, pending)
	if err != nil {
		return ctrl.Result{}, err
	}
	if err := r.passPrewarm(ctx, pool, current); err != nil {
		return ctrl.Result{}, err
	}
	r.report(prevReason, pool, tpl, current, pending+created, m.leased)
	r.reportPrewarm(pool, tpl, current)
	return result, nil
}

// getTemplate reads the pool's template; nil when it does not exist.
func (r *SandboxWarmPoolReconciler) getTemplate(ctx context.Context, pool *v1alpha1.SandboxWarmPool) (*v1alpha1.SandboxTemplate, error) {
	var tpl v1alpha1.SandboxTemplate
	if err := r.Get(ctx, types.NamespacedName{Namespace: pool.Namespace, Name: pool.Spec.TemplateRef.Name}, &tpl); err != nil {
		if !apierrors.IsNotFound(err) {
			return nil, fmt.Errorf("get SandboxTemplate %s: %w", pool.Spec.TemplateRef.Name, err)
		}
		return nil, nil
	}
	return &tpl, nil
}

// poolMembers are the pool's sandboxes as one pass sees them.
type poolMembers struct {
	// current are the pool's own, made from the template as it is now;
	// outdated those made from an earlier version of it.
	current, outdated []*v1alpha1.Sandbox
	// leased counts those out on a pool lease, or taken for one.
	leased int
	// seen holds the name of every sandbox carrying the pool's label.
	seen map[string]bool
}

// members lists the pool's sandboxes and sorts them. A sandbox taken
// from the pool, leased or claimed by an adopter is the pool's no more;
// result is brought forward to when such a one needs looking at again.
func (r *SandboxWarmPoolReconciler) members(ctx context.Context, pool *v1alpha1.SandboxWarmPool, haveTemplate bool, hash string, result *ctrl.Result) (poolMembers, error) {
	m := poolMembers{seen: map[string]bool{}}
	var list v1alpha1.SandboxList
	if err := r.List(ctx, &list, client.InNamespace(pool.Namespace),
		client.MatchingLabels{v1alpha1.LabelWarmPool: pool.Name}); err != nil {
		return m, fmt.Errorf("list sandboxes of warm pool %s: %w", pool.Name, err)
	}
	live := make(map[types.UID]bool, len(list.Items))
	for i := range list.Items {
		live[list.Items[i].UID] = true
	}
	takes, err := r.poolTakes(ctx, pool, live)
	if err != nil {
		return m, err
	}
	for i := range list.Items {
		s := &list.Items[i]
		m.seen[s.Name] = true
		if !metav1.IsControlledBy(s, pool) || !s.DeletionTimestamp.IsZero() {
			continue
		}
		if t, taken := takes[s.UID]; taken && !v1alpha1.PoolLeased(s) && s.Annotations[v1alpha1.AnnotationAdoptedBy] == "" {
			// Taken, and its taker has not written so yet (or the cache
			// does not show it): it is not the pool's any more, and its
			// replacement starts now.
			wait, err := r.settleTake(ctx, pool, s, t)
			if err != nil {
				return m, err
			}
			result.RequeueAfter = minPositive(result.RequeueAfter, max(wait, time.Second))
			if t.Taker == store.WarmTakenByLease {
				m.leased++
			}
			continue
		}
		if v1alpha1.PoolLeased(s) {
			// Out on an ephemeral run, and never back: the Sandbox
			// controller deletes it when the lease ends, so it is replaced
			// now, and neither a template roll nor a scale-down touches it.
			m.leased++
			continue
		}
		if by := s.Annotations[v1alpha1.AnnotationAdoptedBy]; by != "" {
			// No longer the pool's to count: the adopter deletes it once
			// it has its children. Unless the adopter went away first.
			result.RequeueAfter = claimRecheck
			if err := r.dropAbandonedClaim(ctx, pool, s, by); err != nil {
				return m, err
			}
			continue
		}
		if haveTemplate && s.Annotations[v1alpha1.AnnotationTemplateHash] != hash {
			m.outdated = append(m.outdated, s)
			continue
		}
		m.current = append(m.current, s)
	}
	return m, nil
}

// scale brings the pool's current sandboxes and those created but not
// seen yet (pending) to spec.replicas: it retires the surplus, and, when
// the template exists, creates what is missing. It returns the current
// sandboxes kept and how many it created.
func (r *SandboxWarmPoolReconciler) scale(ctx context.Context, pool *v1alpha1.SandboxWarmPool, tpl *v1alpha1.SandboxTemplate, hash string, current []*v1alpha1.Sandbox, pending int) ([]*v1alpha1.Sandbox, int, error) {
	want := int(pool.Spec.Replicas)
	have := len(current) + pending
	if have > want {
		// Not-ready ones go first (they serve nobody yet), then the
		// newest, so the longest-warmed stay. One just back from a lease
		// counts as ready: its pod was ready when it came back, and its
		// kept environments are worth more than a fresh sandbox.
		sort.SliceStable(current, func(i, j int) bool {
			ri := sandboxReady(current[i]) || current[i].Annotations[v1alpha1.AnnotationPoolReusedAt] != ""
			rj := sandboxReady(current[j]) || current[j].Annotations[v1alpha1.AnnotationPoolReusedAt] != ""
			if ri != rj {
				return !ri
			}
			return current[j].CreationTimestamp.Before(&current[i].CreationTimestamp)
		})
		n := min(have-want, len(current))
		for _, s := range current[:n] {
			if err := r.retireWarm(ctx, pool, s, fmt.Sprintf("the pool is scaled to %d", want)); err != nil {
				return nil, 0, err
			}
		}
		current = current[n:]
		have -= n
	}
	created := 0
	if tpl != nil {
		for ; have+created < want; created++ {
			if err := r.createWarm(ctx, pool, tpl, hash); err != nil {
				return nil, 0, err
			}
		}
	}
	return current, created, nil
}

// report sets the pool's replica counts and its Ready condition: current
// are its sandboxes, starting counts those created but not seen yet. A
// sandbox of a pool with pythonEnvironments counts as ready only once its
// pre-warm has settled (prewarmSettledFor): built, or failed, since a
// failed one is leased all the same and a broken requirement must not keep
// the pool (and an apply waiting for it) from ever being full.
func (r *SandboxWarmPoolReconciler) report(prevReason string, pool *v1alpha1.SandboxWarmPool, tpl *v1alpha1.SandboxTemplate, current []*v1alpha1.Sandbox, starting, leased int) {
	want := int(pool.Spec.Replicas)
	ready, prewarming, failed := 0, 0, 0
	for _, s := range current {
		if !sandboxReady(s) {
			continue
		}
		switch prewarmSettledFor(pool, tpl, s) {
		case prewarmBuilding:
			prewarming++
			continue
		case prewarmFailedState:
			failed++
		}
		ready++
	}
	pool.Status.Replicas = int32(len(current) + starting)
	pool.Status.ReadyReplicas = int32(ready)
	pool.Status.LeasedReplicas = int32(leased)
	note := ""
	if failed > 0 {
		note = fmt.Sprintf("; %d of them serve without the pool's python environments, whose build failed (see the PythonEnvironmentsReady condition)", failed)
	}

	switch {
	case tpl == nil:
		msg := fmt.Sprintf("SandboxTemplate %q does not exist in namespace %q; the pool fills when it is created",
			pool.Spec.TemplateRef.Name, pool.Namespace)
		r.setReady(pool, metav1.ConditionFalse, v1alpha1.ReasonTemplateNotFound, msg)
		if prevReason != v1alpha1.ReasonTemplateNotFound {
			r.event(pool, nil, corev1.EventTypeWarning, EventTemplateNotFound, "Wait", msg)
		}
	case ready >= want:
		msg := fmt.Sprintf("%d of %d warm sandboxes are ready%s", ready, want, note)
		r.setReady(pool, metav1.ConditionTrue, v1alpha1.ReasonPoolFull, msg)
		if prevReason != v1alpha1.ReasonPoolFull {
			r.event(pool, nil, corev1.EventTypeNormal, EventPoolFull, "Scale", msg)
		}
	default:
		msg := fmt.Sprintf("%d of %d warm sandboxes are ready%s; %d are starting", ready, want, note, int(pool.Status.Replicas)-ready-prewarming)
		if prewarming > 0 {
			msg += fmt.Sprintf(", %d are building the pool's python environments", prewarming)
		}
		r.setReady(pool, metav1.ConditionFalse, v1alpha1.ReasonScaling, msg)
	}
}

// createWarm creates one warm sandbox of the pool.
func (r *SandboxWarmPoolReconciler) createWarm(ctx context.Context, pool *v1alpha1.SandboxWarmPool, tpl *v1alpha1.SandboxTemplate, hash string) error {
	s := &v1alpha1.Sandbox{
		ObjectMeta: metav1.ObjectMeta{
			GenerateName: pool.Name + "-",
			Namespace:    pool.Namespace,
			Labels: map[string]string{
				v1alpha1.LabelWarmPool: pool.Name,
				v1alpha1.LabelTemplate: tpl.Name,
			},
			Annotations: map[string]string{v1alpha1.AnnotationTemplateHash: hash},
		},
		Spec: v1alpha1.SandboxSpec{
			AgentID:     warmAgentID(pool.Name),
			TemplateRef: pool.Spec.TemplateRef,
		},
	}
	if envs := v1alpha1.PrewarmEnvsAnnotation(pool.Spec.PythonEnvironments); envs != "" {
		s.Annotations[v1alpha1.AnnotationPrewarmEnvs] = envs
	}
	if err := controllerutil.SetControllerReference(pool, s, r.Scheme); err != nil {
		return fmt.Errorf("set owner of warm sandbox: %w", err)
	}
	if err := r.Create(ctx, s); err != nil {
		return fmt.Errorf("create warm sandbox of pool %s: %w", pool.Name, err)
	}
	r.expect(pool.UID, s.Name)
	r.event(pool, s, corev1.EventTypeNormal, EventWarmSandboxCreated, "Create",
		fmt.Sprintf("created warm sandbox %s of template %s", s.Name, tpl.Name))
	return nil
}

// warmAgentID is the placeholder agent of a warm sandbox. The agentID is
// required, and one no real agent has keeps the Compute API from routing
// anyone's calls to an unassigned sandbox; the adopter brings its own.
func warmAgentID(pool string) string {
	b := make([]byte, 4)
	_, _ = rand.Read(b)
	const maxAgentID = 253
	if room := maxAgentID - len("warm..") - 2*len(b); len(pool) > room {
		pool = pool[:room]
	}
	return "warm." + pool + "." + hex.EncodeToString(b)
}

// deleteWarm deletes an unassigned warm sandbox. The precondition carries
// the resourceVersion read, so a sandbox claimed in the meantime (the claim
// bumps it) is left to its adopter.
func (r *SandboxWarmPoolReconciler) deleteWarm(ctx context.Context, pool *v1alpha1.SandboxWarmPool, s *v1alpha1.Sandbox, why string) error {
	uid, rv := s.UID, s.ResourceVersion
	return r.deleteWarmWith(ctx, pool, s, why, client.Preconditions{UID: &uid, ResourceVersion: &rv})
}

func (r *SandboxWarmPoolReconciler) deleteWarmWith(ctx context.Context, pool *v1alpha1.SandboxWarmPool, s *v1alpha1.Sandbox, why string, pre client.Preconditions) error {
	err := r.Delete(ctx, s, pre)
	if apierrors.IsNotFound(err) {
		return nil
	}
	if err != nil {
		return fmt.Errorf("delete warm sandbox %s: %w", s.Name, err)
	}
	r.event(pool, s, corev1.EventTypeNormal, EventWarmSandboxDeleted, "Delete",
		fmt.Sprintf("deleted warm sandbox %s: %s", s.Name, why))
	return nil
}

// dropAbandonedClaim deletes a claimed warm sandbox whose adopter no longer
// exists: nobody else would ever finish or undo the claim.
func (r *SandboxWarmPoolReconciler) dropAbandonedClaim(ctx context.Context, pool *v1alpha1.SandboxWarmPool, s *v1alpha1.Sandbox, adopter string) error {
	var x v1alpha1.Sandbox
	err := r.Get(ctx, types.NamespacedName{Namespace: s.Namespace, Name: adopter}, &x)
	if err == nil && x.DeletionTimestamp.IsZero() {
		return nil
	}
	if err != nil && !apierrors.IsNotFound(err) {
		return fmt.Errorf("get adopter %s of warm sandbox %s: %w", adopter, s.Name, err)
	}
	return r.deleteWarm(ctx, pool, s, fmt.Sprintf("its adopter %s was deleted before taking it over", adopter))
}

func (r *SandboxWarmPoolReconciler) expect(pool types.UID, name string) {
	r.mu.Lock()
	defer r.mu.Unlock()
	if r.created == nil {
		r.created = map[types.UID]map[string]time.Time{}
	}
	if r.created[pool] == nil {
		r.created[pool] = map[string]time.Time{}
	}
	r.created[pool][name] = r.now()
}

// pending counts the pool's created sandboxes the cache has not shown yet,
// and forgets those it has shown or that have expired.
func (r *SandboxWarmPoolReconciler) pending(pool types.UID, seen map[string]bool) int {
	r.mu.Lock()
	defer r.mu.Unlock()
	n := 0
	for name, at := range r.created[pool] {
		if seen[name] || r.now().Sub(at) > createExpiry {
			delete(r.created[pool], name)
			continue
		}
		n++
	}
	if len(r.created[pool]) == 0 {
		delete(r.created, pool)
	}
	return n
}

func (r *SandboxWarmPoolReconciler) setReady(pool *v1alpha1.SandboxWarmPool, status metav1.ConditionStatus, reason, msg string) {
	setCondition(&pool.Status.Conditions, v1alpha1.ConditionReady, pool.Generation, r.now(), status, reason, msg)
}

func (r *SandboxWarmPoolReconciler) event(pool *v1alpha1.SandboxWarmPool, related runtime.Object, eventType, reason, action, note string) {
	recordEvent(r.Recorder, pool, related, eventType, reason, action, note)
}

func minPositive(a, b time.Duration) time.Duration {
	if a <= 0 {
		return b
	}
	return min(a, b)
}
