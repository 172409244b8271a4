package controller

import (
	"context"
	"errors"
	"fmt"
	"time"

	coordinationv1 "k8s.io/api/coordination/v1"
	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	"k8s.io/apimachinery/pkg/api/meta"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/runtime"
	"k8s.io/client-go/tools/events"
	"k8s.io/utils/clock"
	ctrl "sigs.k8s.io/controller-runtime"
	"sigs.k8s.io/controller-runtime/pkg/builder"
	"sigs.k8s.io/controller-runtime/pkg/client"
	"sigs.k8s.io/controller-runtime/pkg/controller"
	"sigs.k8s.io/controller-runtime/pkg/controller/controllerutil"
	"sigs.k8s.io/controller-runtime/pkg/event"
	"sigs.k8s.io/controller-runtime/pkg/handler"
	logf "sigs.k8s.io/controller-runtime/pkg/log"
	"sigs.k8s.io/controller-runtime/pkg/predicate"
	"sigs.k8s.io/controller-runtime/pkg/reconcile"
	"sigs.k8s.io/controller-runtime/pkg/source"

	"github.com/agentbox/terraform-provider-agentbox/internal/api/v1alpha1"
	"github.com/agentbox/terraform-provider-agentbox/internal/pki"
	"github.com/agentbox/terraform-provider-agentbox/internal/snapshot"
)

// SandboxControllerName names the controller, and its events' reporter.
const SandboxControllerName = "agentbox-sandbox"

// templateRefIndex indexes Sandboxes by spec.templateRef.name, so that a
// template change finds its sandboxes without listing the namespace.
const templateRefIndex = "spec.templateRef.name"

// Event reasons. They are not condition reasons: events tell what the
// controller did, conditions what state the sandbox is in.
const (
	EventPodCreated          = "PodCreated"
	EventPodRecreated        = "PodRecreated"
	EventPodFailed           = "PodFailed"
	EventPodDeleted          = "PodDeleted"
	EventSandboxReady        = "SandboxReady"
	EventWorkspaceCreated    = "WorkspaceCreated"
	EventCertificateIssued   = "CertificateIssued"
	EventCertificateReissued = "CertificateReissued"
	EventTemplateNotFound    = "TemplateNotFound"
	EventOwnershipConflict   = "OwnershipConflict"
)

// conflictRetry is how often a sandbox blocked by a foreign object is looked
// at again: the object's removal triggers no watch event for the sandbox,
// because it is not the sandbox's child.
const conflictRetry = time.Minute

// nodePoolRetry is how often a sandbox whose template names a missing
// GVisorNodePool is looked at again; pools are not watched for sandboxes.
const nodePoolRetry = 30 * time.Second

// maxRequeue bounds the wait for a certificate renewal, so that a clock
// jump or a long-lived certificate never parks a sandbox for months.
const maxRequeue = 12 * time.Hour

// SandboxReconciler turns a Sandbox into its pod, workspace claim, serving
// certificate Secret and activity clock (a Lease), all owned by the Sandbox
// so that deleting it garbage-collects them, and reports their state in the
// Sandbox's status. It also reclaims an agent's hold on the sandbox, kept
// in the activity clock, when its holder stops heartbeating.
type SandboxReconciler struct {
	client.Client
	Scheme *runtime.Scheme
	// Recorder receives events about the sandbox; SetupWithManager fills it
	// from the manager when nil.
	Recorder events.EventRecorder
	// Namespace is the platform namespace, the control plane's own; the
	// supervisor accepts calls from the control-plane identity in it.
	Namespace string
	// TrustDomain of the SPIFFE identities; empty means
	// pki.DefaultTrustDomain.
	TrustDomain string
	// DefaultImage is the sandbox image of templates that name none.
	DefaultImage string
	// DefaultImagePullPolicy is DefaultImage's pull policy, unless the
	// template sets one; empty means IfNotPresent.
	DefaultImagePullPolicy corev1.PullPolicy
	// SupervisorImage holds the supervisor at
	// /usr/local/bin/agentbox-supervisor; every sandbox pod's init
	// container installs it from there, so that the sandbox image needs
	// none. Empty means DefaultSupervisorImage.
	SupervisorImage string
	// SupervisorImagePullPolicy is the init container's pull policy;
	// empty means IfNotPresent.
	SupervisorImagePullPolicy corev1.PullPolicy
	// CA issues the sandboxes' serving certificates.
	CA *pki.CA
	// Clock is the controller's notion of now (conditions, holds,
	// certificate checks); nil means the real clock.
	Clock clock.PassiveClock
	// Snapshots keeps the workspaces of idle sandboxes. Nil disables idle
	// stops of sandboxes that are not ephemeral: with nowhere to keep the
	// workspace, a sandbox keeps running.
	Snapshots snapshot.Driver
	// SnapshotHealth, when set, holds idle stops back while the snapshot
	// driver cannot work (the control plane's SnapshotCheck); the sandboxes
	// keep running and say why in their IdleStopBlocked condition.
	SnapshotHealth SnapshotHealth
	// Supervisors dials the sandboxes' supervisors, to flush the workspace
	// before a snapshot and to restore it on resume.
	Supervisors SupervisorDialer
	// WarmTakes decides who gets each ready warm sandbox; see WarmTakes.
	// The control plane gives the warm pool controller the same one.
	WarmTakes WarmTakes
	// APIReader reads straight from the API server: to confirm that a Node
	// the cache does not know is really gone before a sandbox is treated
	// as having lost it, and that an idle stop a stale cache shows under
	// way was not finished already. SetupWithManager fills it from the
	// manager when nil, and without one the cached Client is used.
	APIReader client.Reader
	// Filespaces syncs workspaces with the agents' filespaces: a push
	// before an idle stop's snapshot, a pull before a new or resumed
	// sandbox serves. Nil leaves workspaces alone, as a control plane
	// without a store must.
	Filespaces FilespaceSyncer
	// Namespaces are the namespaces the platform serves; a Sandbox
	// elsewhere only gets the NamespaceNotServed condition. Empty serves
	// every namespace.
	Namespaces ServedNamespaces
	// AgentEvents, when set, takes the events of the agents' sandboxes
	// into their event logs; see AgentEventSink.
	AgentEvents AgentEventSink

	// MaxConcurrentReconciles is how many Sandboxes are reconciled at once
	// (controller-runtime's workers); 0 means DefaultSandboxWorkers. A pass
	// spends most of its time waiting for the API server, so one worker
	// left a thousand new sandboxes queued behind each other's writes.
	MaxConcurrentReconciles int

	// prewarming are the warm pool environment builds under way.
	prewarming prewarms
	// pulls are the first-serve filespace pulls under way.
	pulls filespacePulls
}

// DefaultSandboxWorkers is the default of
// SandboxReconciler.MaxConcurrentReconciles. Passes of different sandboxes
// share nothing but the API server and the store, and the control plane's
// client-side rate limit (--kube-api-qps) bounds what they send together.
const DefaultSandboxWorkers = 16

// SetupWithManager registers the reconciler and its watches with mgr.
func (r *SandboxReconciler) SetupWithManager(mgr ctrl.Manager) error {
	if r.CA == nil {
		return errors.New("sandbox controller: no CA to issue serving certificates")
	}
	if r.Namespace == "" {
		return errors.New("sandbox controller: no platform namespace")
	}
	fillFromManager(mgr, SandboxControllerName, &r.Client, &r.Scheme, &r.Recorder)
	if r.APIReader == nil {
		r.APIReader = mgr.GetAPIReader()
	}
	if err := indexField(mgr, &v1alpha1.Sandbox{}, templateRefIndex, func(o client.Object) []string {
		return []string{o.(*v1alpha1.Sandbox).Spec.TemplateRef.Name}
	}, "sandboxes by template"); err != nil {
		return err
	}
	if err := indexField(mgr, &v1alpha1.Sandbox{}, agentIDIndex, indexAgentID, "sandboxes by agent"); err != nil {
		return err
	}
	if err := indexField(mgr, &v1alpha1.Sandbox{}, sandboxNodeIndex, func(o client.Object) []string {
		if n := o.(*v1alpha1.Sandbox).Status.NodeName; n != "" {
			return []string{n}
		}
		return nil
	}, "sandboxes by node"); err != nil {
		return err
	}
	workers := r.MaxConcurrentReconciles
	if workers <= 0 {
		workers = DefaultSandboxWorkers
	}
	pullEnded := make(chan event.GenericEvent, maxPulls)
	r.pulls.notify = pullEnded
	return ctrl.NewControllerManagedBy(mgr).
		Named(SandboxControllerName).
		WithOptions(controller.Options{MaxConcurrentReconciles: workers}).
		For(&v1alpha1.Sandbox{}).
		// A filespace pull that outlasted its pass brings the sandbox back
		// when it ends.
		WatchesRawSource(source.Channel(pullEnded, &handler.EnqueueRequestForObject{})).
		Owns(&corev1.Pod{}).
		Owns(&corev1.PersistentVolumeClaim{}).
		Owns(&corev1.Secret{}).
		Owns(&coordinationv1.Lease{}). // the activity clock
		// A template is read only when a pod is created, but a sandbox that
		// waits for its template must start as soon as it appears.
		Watches(&v1alpha1.SandboxTemplate{}, handler.EnqueueRequestsFromMapFunc(r.sandboxesForTemplate)).
		// Likewise a sandbox waiting for its template's EgressProxy.
		Watches(&v1alpha1.EgressProxy{}, handler.EnqueueRequestsFromMapFunc(r.sandboxesForEgressProxy)).
		// A duplicate of an agent's sandbox waits for the one that keeps
		// the agent to go (see agentKeeper).
		Watches(&v1alpha1.Sandbox{}, handler.EnqueueRequestsFromMapFunc(r.sandboxesOfAgent),
			builder.WithPredicates(agentMembershipChanged)).
		// Sandboxes report whether their namespace enforces restricted.
		Watches(&corev1.Namespace{}, handler.EnqueueRequestsFromMapFunc(r.sandboxesInNamespace),
			builder.WithPredicates(enforceLevelChanged)).
		// A deleted Node is a node loss for the sandboxes that ran there;
		// nothing else about nodes concerns them.
		Watches(&corev1.Node{}, handler.EnqueueRequestsFromMapFunc(r.sandboxesOnNode),
			builder.WithPredicates(predicate.Funcs{
				CreateFunc:  func(event.CreateEvent) bool { return false },
				UpdateFunc:  func(event.UpdateEvent) bool { return false },
				GenericFunc: func(event.GenericEvent) bool { return false },
			})).
		Complete(r)
}

// sandboxesForEgressProxy maps an EgressProxy to the sandboxes of the
// templates in its namespace that name it. Templates are few and come from
// the cache, so they are listed rather than indexed.
func (r *SandboxReconciler) sandboxesForEgressProxy(ctx context.Context, o client.Object) []reconcile.Request {
	var templates v1alpha1.SandboxTemplateList
	if err := r.List(ctx, &templates, client.InNamespace(o.GetNamespace())); err != nil {
		logf.FromContext(ctx).Error(err, "list templates of egress proxy", "egressProxy", client.ObjectKeyFromObject(o))
		return nil
	}
	var reqs []reconcile.Request
	for i := range templates.Items {
		if ref := templates.Items[i].Spec.EgressProxyRef; ref != nil && ref.Name == o.GetName() {
			reqs = append(reqs, r.sandboxesForTemplate(ctx, &templates.Items[i])...)
		}
	}
	return reqs
}

func (r *SandboxReconciler) sandboxesForTemplate(ctx context.Context, o client.Object) []reconcile.Request {
	var list v1alpha1.SandboxList
	if !listOfTemplate(ctx, r, &list, o, "sandboxes") {
		return nil
	}
	return requestsFor(list.Items)
}

func (r *SandboxReconciler) now() time.Time { return nowOf(r.Clock) }

func (r *SandboxReconciler) trustDomain() string {
	if r.TrustDomain == "" {
		return pki.DefaultTrustDomain
	}
	return r.TrustDomain
}

// Reconcile brings one Sandbox's children to what its spec and template ask
// and writes what it found into the status. It can run any number of times:
// it creates only what is missing and writes only what changed.
func (r *SandboxReconciler) Reconcile(ctx context.Context, req ctrl.Request) (ctrl.Result, error) {
	var sbx v1alpha1.Sandbox
	if found, err := fetch(ctx, r, req, &sbx); !found {
		return ctrl.Result{}, err
	}
	if !r.Namespaces.Serves(sbx.Namespace) {
		return r.refuseNamespace(ctx, &sbx)
	}
	if !sbx.DeletionTimestamp.IsZero() {
		// Owner references delete the children in the cluster; the
		// finalizer is there for the snapshots, which may live outside it.
		r.pulls.drop(sbx.UID)
		return ctrl.Result{}, r.finalize(ctx, &sbx)
	}
	if by := sbx.Annotations[v1alpha1.AnnotationAdoptedBy]; by != "" {
		// A warm sandbox claimed by a new Sandbox: its children are being
		// moved to the adopter, which then deletes it. Touching them here
		// (re-issuing the certificate, replacing the pod) would race the
		// move.
		return ctrl.Result{}, nil
	}
	if err := r.ensureSandboxMeta(ctx, &sbx); err != nil {
		return ctrl.Result{}, err
	}
	if keeper, err := r.agentKeeper(ctx, &sbx); err != nil {
		return ctrl.Result{}, err
	} else if keeper != nil {
		return ctrl.Result{}, r.refuseDuplicate(ctx, &sbx, keeper)
	}

	base := sbx.DeepCopy()
	sbx.Status.ObservedGeneration = sbx.Generation
	r.reportPodSecurity(ctx, meta.FindStatusCondition(base.Status.Conditions, v1alpha1.ConditionPodSecurity), &sbx)
	result, err := r.reconcileChildren(ctx, readyReason(base), &sbx)
	if cacheBehind(ctx, err) {
		return ctrl.Result{RequeueAfter: cacheRetry}, nil
	}
	if err != nil {
		result, err = r.reportError(readyReason(base), &sbx, result, err)
	}
	if serr := r.writeStatus(ctx, base, &sbx); serr != nil {
		return ctrl.Result{}, errors.Join(err, serr)
	}
	return result, err
}

// refuseNamespace reports a sandbox in a namespace the platform does not
// serve, once no other platform has taken it up (notServedNow). Nothing
// else is touched: the control plane has no rights over its pods and
// Secrets there, and its cache does not watch them. Nor is a deleted one
// finalized: its snapshots are in the store of the platform that served
// it. The agent-ID label is still set (a Sandbox write, allowed
// everywhere), so that the Compute API finds the sandbox and answers with
// this reason at once. A change of the served namespaces restarts the
// control plane, which then reconciles every sandbox again.
func (r *SandboxReconciler) refuseNamespace(ctx context.Context, sbx *v1alpha1.Sandbox) (ctrl.Result, error) {
	if !sbx.DeletionTimestamp.IsZero() {
		return ctrl.Result{}, nil
	}
	if tell, wait := notServedNow(sbx.CreationTimestamp, sbx.Status.Conditions, r.now()); !tell {
		return ctrl.Result{RequeueAfter: wait}, nil
	}
	if err := r.ensureSandboxLabels(ctx, sbx); err != nil {
		return ctrl.Result{}, err
	}
	base := sbx.DeepCopy()
	prevReason := readyReason(base)
	sbx.Status.ObservedGeneration = sbx.Generation
	msg := r.Namespaces.notServedMessage("Sandbox", sbx.Namespace)
	r.setNotServing(sbx, v1alpha1.SandboxPhasePending, v1alpha1.ReasonNamespaceNotServed, msg)
	r.eventOnNewReason(prevReason, sbx, nil, corev1.EventTypeWarning, EventNamespaceNotServed, "Wait", msg)
	return ctrl.Result{}, r.writeStatus(ctx, base, sbx)
}

// reportError sets the status from an error of the pass. The errors that
// wait for something, a person or the garbage collector, are states rather
// than failures: they are reported, and the pass retries at its own pace
// instead of with backoff. Any other error is a ReconcileError and is
// returned, with the pass's result.
func (r *SandboxReconciler) reportError(prevReason string, sbx *v1alpha1.Sandbox, result ctrl.Result, err error) (ctrl.Result, error) {
	var conflict *ownershipConflictError
	var leftover *leftoverChildError
	var driverChanged *snapshotDriverChangedError
	switch {
	case errors.As(err, &driverChanged):
		// Waits for a person: no claim or pod is made for a restore
		// that cannot work.
		r.setNotServing(sbx, v1alpha1.SandboxPhaseError, v1alpha1.ReasonSnapshotDriverChanged, driverChanged.Error())
		r.eventOnNewReason(prevReason, sbx, nil, corev1.EventTypeWarning, EventSnapshotDriverChanged, "Resume", driverChanged.Error())
		return ctrl.Result{}, nil
	case errors.As(err, &leftover):
		// A Sandbox deleted and re-created under the same name: its old
		// children are on their way out. Wait for them, not for a person.
		r.setNotServing(sbx, v1alpha1.SandboxPhasePending, v1alpha1.ReasonCreating, leftover.Error())
		return ctrl.Result{RequeueAfter: leftoverRetry}, nil
	case errors.As(err, &conflict):
		// Not an error to retry with backoff: it waits for a person.
		r.setNotServing(sbx, v1alpha1.SandboxPhaseError, v1alpha1.ReasonOwnershipConflict, conflict.Error())
		r.eventOnNewReason(prevReason, sbx, nil, corev1.EventTypeWarning, EventOwnershipConflict, "Wait", conflict.Error())
		return ctrl.Result{RequeueAfter: conflictRetry}, nil
	}
	phase := sbx.Status.Phase
	if phase == "" {
		phase = v1alpha1.SandboxPhasePending
	}
	r.setReady(sbx, metav1.ConditionFalse, v1alpha1.ReasonReconcileError, err.Error())
	sbx.Status.Phase = phase
	return result, err
}

// ensureSandboxMeta is ensureSandboxLabels and ensureFinalizer in one
// write: a new sandbox needs both, and its first pass's writes are what a
// thousand sandboxes created together wait for (the client's rate limit).
func (r *SandboxReconciler) ensureSandboxMeta(ctx context.Context, sbx *v1alpha1.Sandbox) error {
	want := v1alpha1.AgentIDHash(sbx.Spec.AgentID)
	needFinalizer := r.wantsFinalizer(sbx)
	if sbx.Labels[v1alpha1.LabelAgentIDHash] == want {
		return r.ensureFinalizer(ctx, sbx)
	}
	if !needFinalizer {
		return r.ensureSandboxLabels(ctx, sbx)
	}
	// The finalizers are a list, which a merge patch replaces whole:
	// the optimistic lock keeps another writer's from being lost.
	patch := client.MergeFromWithOptions(sbx.DeepCopy(), client.MergeFromWithOptimisticLock{})
	if sbx.Labels == nil {
		sbx.Labels = map[string]string{}
	}
	sbx.Labels[v1alpha1.LabelAgentIDHash] = want
	controllerutil.AddFinalizer(sbx, v1alpha1.Finalizer)
	if err := r.Patch(ctx, sbx, patch); err != nil {
		return fmt.Errorf("label sandbox %s with its agent ID hash and add its finalizer: %w", sbx.Name, err)
	}
	return nil
}

// ensureSandboxLabels puts the agent-ID hash on the Sandbox itself, so that
// the Compute API can find an agent's sandbox with a label selector. Agent
// IDs may not fit a label value, hence the hash.
func (r *SandboxReconciler) ensureSandboxLabels(ctx context.Context, sbx *v1alpha1.Sandbox) error {
	want := v1alpha1.AgentIDHash(sbx.Spec.AgentID)
	if sbx.Labels[v1alpha1.LabelAgentIDHash] == want {
		return nil
	}
	patch := client.MergeFrom(sbx.DeepCopy())
	if sbx.Labels == nil {
		sbx.Labels = map[string]string{}
	}
	sbx.Labels[v1alpha1.LabelAgentIDHash] = want
	if err := r.Patch(ctx, sbx, patch); err != nil {
		return fmt.Errorf("label sandbox %s with its agent ID hash: %w", sbx.Name, err)
	}
	return nil
}

// reconcileChildren ensures the children and sets the status from them, in
// the order a pass takes: the template (and an adoption, which decides the
// children's names), the pod as it is, the serving certificate and the
// activity clock, a lost node, the idle-stop cycle, and last the workload
// itself, its workspace claim and pod.
func (r *SandboxReconciler) reconcileChildren(ctx context.Context, prevReason string, sbx *v1alpha1.Sandbox) (ctrl.Result, error) {
	tpl, err := r.getTemplate(ctx, sbx)
	if err != nil {
		return ctrl.Result{}, err
	}
	// Before any child is looked up or created: adoption decides the name
	// they go by.
	if err := r.adopt(ctx, sbx, tpl); err != nil {
		return ctrl.Result{}, err
	}
	pod, err := r.getPod(ctx, sbx)
	if err != nil {
		return ctrl.Result{}, err
	}
	if tpl == nil && pod == nil && sbx.Status.Phase != v1alpha1.SandboxPhaseIdleStopping {
		// The template is needed only to make a pod; a running pod whose
		// template was deleted keeps serving. The template watch brings the
		// sandbox back here when the template appears.
		msg := fmt.Sprintf("SandboxTemplate %q does not exist in namespace %q; the sandbox starts when it is created",
			sbx.Spec.TemplateRef.Name, sbx.Namespace)
		r.setNotServing(sbx, v1alpha1.SandboxPhasePending, v1alpha1.ReasonTemplateNotFound, msg)
		r.eventOnNewReason(prevReason, sbx, nil, corev1.EventTypeWarning, EventTemplateNotFound, "Wait", msg)
		return ctrl.Result{}, nil
	}

	result, activityClock, deleted, err := r.ensureAccess(ctx, sbx)
	if err != nil || deleted {
		return ctrl.Result{}, err
	}
	// A reused warm sandbox's reset (releasePolicy Reuse) replaces the
	// pod before anything else looks at it.
	resetDone, resetWait, err := r.continuePoolReset(ctx, sbx, pod)
	requeueWithin(&result, resetWait)
	if err != nil || resetDone {
		return result, err
	}
	act := r.activityOf(sbx, tpl, activityClock)
	prevPhase := sbx.Status.Phase
	defer func() { recordActivity(prevPhase, sbx, act) }()
	if done, err := r.handleNodeLoss(ctx, sbx, tpl, pod, activityClock); err != nil || done {
		return result, err
	}
	if done, err := r.idleCycle(ctx, prevReason, sbx, tpl, act, pod, &result); err != nil || done {
		return result, err
	}
	return r.runWorkload(ctx, prevReason, sbx, tpl, pod, act, result)
}

// ensureAccess ensures the children through which the sandbox is reached
// and watched: its serving certificate and its activity clock. It returns
// the requeue they ask for, the activity clock (nil when it was only just
// created, and so holds nothing to look at), and whether the sandbox was
// deleted: an ephemeral one whose pool lease ended.
func (r *SandboxReconciler) ensureAccess(ctx context.Context, sbx *v1alpha1.Sandbox) (ctrl.Result, *coordinationv1.Lease, bool, error) {
	renewIn, err := r.ensureTLSSecret(ctx, sbx)
	if err != nil {
		return ctrl.Result{}, nil, false, err
	}
	result := ctrl.Result{RequeueAfter: min(renewIn, maxRequeue)}
	activityClock, err := r.ensureActivityClock(ctx, sbx)
	if err != nil {
		return ctrl.Result{}, nil, false, err
	}
	if activityClock == nil {
		return result, nil, false, nil
	}
	deleted, recheck, err := r.recycleEphemeral(ctx, sbx, activityClock)
	if err != nil || deleted {
		return ctrl.Result{}, nil, deleted, err
	}
	requeueWithin(&result, recheck)
	holdExpiresIn, err := r.reconcileHold(ctx, sbx, activityClock)
	if err != nil {
		return ctrl.Result{}, nil, false, err
	}
	requeueWithin(&result, holdExpiresIn)
	return result, activityClock, false, nil
}

// requeueWithin brings result's requeue forward to d, when d is set.
func requeueWithin(result *ctrl.Result, d time.Duration) {
	if d > 0 {
		result.RequeueAfter = min(result.RequeueAfter, d)
	}
}

// idleCycle runs this pass's part of the idle-stop cycle: it calls off a
// stop that activity interrupted, runs the next step of a stop, or keeps
// a stopped sandbox without a pod. It reports whether the pass is done;
// otherwise the sandbox is to run, and result may have been brought
// forward to when it turns idle.
func (r *SandboxReconciler) idleCycle(ctx context.Context, prevReason string, sbx *v1alpha1.Sandbox, tpl *v1alpha1.SandboxTemplate, act activity, pod *corev1.Pod, result *ctrl.Result) (bool, error) {
	// Only a sandbox that can be stopped needs waking when it turns idle.
	if (r.Snapshots != nil || sbx.Spec.Ephemeral) && !isWarm(sbx) {
		requeueWithin(result, act.untilIdle())
	}
	r.clearPassedCheck(sbx)
	if sbx.Status.Phase == v1alpha1.SandboxPhaseIdleStopping && !sbx.Spec.Ephemeral && !act.idle() {
		// Activity during a stop that can still be undone calls it off.
		serving, err := r.callOffStop(ctx, sbx, pod, act)
		if err != nil || serving {
			return true, err
		}
	}
	if r.stopping(sbx, tpl, act, pod != nil) {
		wait, held := r.stopHeldBack(sbx, act)
		if !held {
			res, err := r.idleStop(ctx, prevReason, sbx, tpl, act, pod)
			requeueWithin(result, res.RequeueAfter)
			return true, err
		}
		// Not stopped: it goes on serving.
		result.RequeueAfter = min(result.RequeueAfter, wait)
	}
	if parked(sbx, act) {
		return true, r.stayStopped(ctx, sbx, pod)
	}
	return false, nil
}

// runWorkload ensures the workspace claim and the pod of a sandbox that is
// to run, and sets the status from the pod.
func (r *SandboxReconciler) runWorkload(ctx context.Context, prevReason string, sbx *v1alpha1.Sandbox, tpl *v1alpha1.SandboxTemplate, pod *corev1.Pod, act activity, result ctrl.Result) (ctrl.Result, error) {
	var claim *corev1.PersistentVolumeClaim
	workspaceReady := true
	if tpl != nil {
		var err error
		if claim, workspaceReady, err = r.ensureWorkspace(ctx, prevReason, sbx, tpl); err != nil {
			return ctrl.Result{}, err
		}
	}
	if pod == nil {
		return r.startPod(ctx, prevReason, sbx, tpl, claim, workspaceReady, result)
	}
	if err := r.observePod(ctx, prevReason, sbx, pod, claim, act); err != nil {
		return ctrl.Result{}, err
	}
	next, err := r.checkpoint(ctx, sbx, tpl, pod, act)
	if err != nil {
		return ctrl.Result{}, err
	}
	requeueWithin(&result, next)
	requeueWithin(&result, r.prewarm(sbx, tpl, pod))
	if r.pulls.pending(sbx.UID) {
		requeueWithin(&result, pullRecheck)
	}
	return result, nil
}

// startPod creates the pod of a sandbox that has none, once its workspace
// claim is ready, and says what the sandbox waits for.
func (r *SandboxReconciler) startPod(ctx context.Context, prevReason string, sbx *v1alpha1.Sandbox, tpl *v1alpha1.SandboxTemplate, claim *corev1.PersistentVolumeClaim, workspaceReady bool, result ctrl.Result) (ctrl.Result, error) {
	if !workspaceReady {
		r.setNotServing(sbx, v1alpha1.SandboxPhasePending, v1alpha1.ReasonCreating,
			fmt.Sprintf("waiting for the old workspace claim %s to be deleted before creating a new one", WorkspaceClaimName(workloadName(sbx))))
		return result, nil
	}
	var noProxy *errEgressProxyNotFound
	if err := r.createPod(ctx, sbx, tpl); apierrors.IsNotFound(err) && tpl.Spec.NodePoolRef != nil {
		// Waiting for a person to create the pool, not an error to
		// back off from.
		r.setNotServing(sbx, v1alpha1.SandboxPhasePending, v1alpha1.ReasonNodePoolNotFound,
			fmt.Sprintf("template %s names GVisorNodePool %s, which does not exist", tpl.Name, *tpl.Spec.NodePoolRef))
		return ctrl.Result{RequeueAfter: nodePoolRetry}, nil
	} else if errors.As(err, &noProxy) {
		// The same: no pod may start without the proxy it must use.
		r.setNotServing(sbx, v1alpha1.SandboxPhasePending, v1alpha1.ReasonEgressProxyNotFound, noProxy.Error())
		r.eventOnNewReason(prevReason, sbx, nil, corev1.EventTypeWarning, v1alpha1.ReasonEgressProxyNotFound, "Wait", noProxy.Error())
		return ctrl.Result{RequeueAfter: nodePoolRetry}, nil
	} else if err != nil {
		return ctrl.Result{}, err
	}
	msg := fmt.Sprintf("created pod %s; waiting for it to become ready", PodName(workloadName(sbx)))
	if snap := restoring(claim); snap != "" {
		r.setNotServing(sbx, v1alpha1.SandboxPhaseResuming, v1alpha1.ReasonResuming,
			fmt.Sprintf("restoring the workspace from snapshot %s; %s", snap, msg))
	} else {
		r.setNotServing(sbx, v1alpha1.SandboxPhasePending, v1alpha1.ReasonCreating, msg)
	}
	sbx.Status.PodName = PodName(workloadName(sbx))
	return result, nil
}
