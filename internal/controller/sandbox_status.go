package controller

import (
	"context"
	"fmt"
	"strings"
	"time"

	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/runtime"
	"sigs.k8s.io/controller-runtime/pkg/client"

	"github.com/agentbox/terraform-provider-agentbox/internal/api/v1alpha1"
	api "github.com/agentbox/terraform-provider-agentbox/internal/computeapi/client"
)

// The Sandbox reconciler's status: what it observes of the pod, and the
// phase, conditions and events it reports from that.

// writeStatus writes sbx's status if it differs from base's. Writing only on
// change keeps a settled sandbox from generating watch events (and
// resourceVersion bumps) on every resync.
func (r *SandboxReconciler) writeStatus(ctx context.Context, base, sbx *v1alpha1.Sandbox) error {
	return patchStatusIfChanged(ctx, r.Client, base, sbx, base.Status, sbx.Status, "sandbox")
}

// observePod sets the status from the pod, and removes a pod that has
// stopped for good so that the next pass replaces it.
func (r *SandboxReconciler) observePod(ctx context.Context, prevReason string, sbx *v1alpha1.Sandbox, pod *corev1.Pod, claim *corev1.PersistentVolumeClaim, act activity) error {
	sbx.Status.PodName = pod.Name
	switch {
	case !pod.DeletionTimestamp.IsZero():
		r.setNotServing(sbx, v1alpha1.SandboxPhasePending, v1alpha1.ReasonCreating,
			fmt.Sprintf("pod %s is being deleted; a new one is created when it is gone", pod.Name))
		sbx.Status.PodName = pod.Name
		return nil
	case pod.Status.Phase == corev1.PodFailed || pod.Status.Phase == corev1.PodSucceeded:
		return r.dropStoppedPod(ctx, sbx, pod)
	}

	sbx.Status.PodIP = pod.Status.PodIP
	sbx.Status.ServiceEndpoint = ""
	if pod.Status.PodIP != "" {
		sbx.Status.ServiceEndpoint = v1alpha1.SupervisorEndpoint(pod.Status.PodIP)
	}
	snap := restoring(claim)
	if podReady(pod) {
		return r.observeReadyPod(ctx, prevReason, sbx, pod, claim, act)
	}
	if msg, root := imageRunsAsRoot(pod); root {
		r.setPhase(sbx, v1alpha1.SandboxPhaseError, metav1.ConditionFalse, v1alpha1.ReasonImageRunsAsRoot, msg)
		r.eventOnNewReason(prevReason, sbx, pod, corev1.EventTypeWarning, v1alpha1.ReasonImageRunsAsRoot, "Start", msg)
		return nil
	}
	if msg, failed := containerProblem(pod); failed {
		r.setPhase(sbx, v1alpha1.SandboxPhaseError, metav1.ConditionFalse, v1alpha1.ReasonPodFailed, msg)
		r.eventOnNewReason(prevReason, sbx, pod, corev1.EventTypeWarning, EventPodFailed, "Start", msg)
		return nil
	}
	if snap != "" {
		r.setPhase(sbx, v1alpha1.SandboxPhaseResuming, metav1.ConditionFalse, v1alpha1.ReasonResuming,
			fmt.Sprintf("restoring the workspace from snapshot %s; %s", snap, podWaitingMessage(pod)))
		return nil
	}
	r.setPhase(sbx, v1alpha1.SandboxPhasePending, metav1.ConditionFalse, v1alpha1.ReasonCreating, podWaitingMessage(pod))
	return nil
}

// dropStoppedPod reports a pod that stopped for good and deletes it, so
// that the next pass creates it again.
func (r *SandboxReconciler) dropStoppedPod(ctx context.Context, sbx *v1alpha1.Sandbox, pod *corev1.Pod) error {
	// With restartPolicy Always this is eviction or an admission
	// failure on the node: kubelet will not restart it. (A pod on a
	// node that was deleted never gets here: handleNodeLoss.)
	msg := fmt.Sprintf("pod %s stopped (phase %s): %s; it is deleted and created again",
		pod.Name, pod.Status.Phase, podStopReason(pod))
	r.setNotServing(sbx, v1alpha1.SandboxPhaseError, v1alpha1.ReasonPodFailed, msg)
	sbx.Status.PodName = pod.Name
	r.event(sbx, pod, corev1.EventTypeWarning, EventPodFailed, "Delete", msg)
	err := r.Delete(ctx, pod, client.Preconditions{UID: &pod.UID}, client.PropagationPolicy(metav1.DeletePropagationBackground))
	if err != nil && !apierrors.IsNotFound(err) && !apierrors.IsConflict(err) {
		return fmt.Errorf("delete stopped pod %s: %w", pod.Name, err)
	}
	return nil
}

// observeReadyPod brings a sandbox whose pod is ready to serving: it
// finishes a resume's restore, pulls the agent's filespace into a
// workspace that was not serving yet, and sets the sandbox Running.
func (r *SandboxReconciler) observeReadyPod(ctx context.Context, prevReason string, sbx *v1alpha1.Sandbox, pod *corev1.Pod, claim *corev1.PersistentVolumeClaim, act activity) error {
	snap := restoring(claim)
	// An adoption says AdoptedFromWarmPool before it serves too, so the
	// phase tells whether the sandbox took calls already.
	wasServing := serving(prevReason) && sbx.Status.Phase == v1alpha1.SandboxPhaseRunning
	if !wasServing {
		// Once serving, a proxy pod being replaced (its EgressProxy
		// changed) does not take the sandbox out of service: the Service
		// keeps its address and the new pod answers in seconds.
		wait, err := r.egressProxyPending(ctx, sbx, pod)
		if err != nil {
			return err
		}
		if wait != "" {
			phase, reason := v1alpha1.SandboxPhasePending, v1alpha1.ReasonCreating
			switch {
			case snap != "":
				phase, reason = v1alpha1.SandboxPhaseResuming, v1alpha1.ReasonResuming
			case readyReason(sbx) == v1alpha1.ReasonAdoptedFromWarmPool:
				reason = v1alpha1.ReasonAdoptedFromWarmPool
			}
			r.setPhase(sbx, phase, metav1.ConditionFalse, reason, wait)
			return nil
		}
	}
	// resumed is the snapshot that serving now resumes from: the one
	// restored in this pass, or in an earlier one whose filespace pull
	// outlasted it (the claim's mark is gone then, and the sandbox still
	// says Resuming).
	resumed := snap
	if snap != "" {
		ok, err := r.finishRestore(ctx, sbx, pod, claim)
		if err != nil || !ok {
			return err
		}
	} else if !wasServing && sbx.Status.Phase == v1alpha1.SandboxPhaseResuming && sbx.Status.Snapshot != nil {
		resumed = sbx.Status.Snapshot.Name
	}
	if !wasServing {
		// An adopter too: the agent's files outlive its sandboxes.
		done, err := r.pullFilespace(ctx, sbx, pod)
		if err != nil {
			return err
		}
		if !done {
			phase, reason := v1alpha1.SandboxPhasePending, v1alpha1.ReasonCreating
			switch {
			case resumed != "":
				phase, reason = v1alpha1.SandboxPhaseResuming, v1alpha1.ReasonResuming
			case readyReason(sbx) == v1alpha1.ReasonAdoptedFromWarmPool:
				reason = v1alpha1.ReasonAdoptedFromWarmPool
			}
			r.setPhase(sbx, phase, metav1.ConditionFalse, reason,
				fmt.Sprintf("pod %s is ready; pulling the agent's filespace into the workspace before it serves", pod.Name))
			return nil
		}
	}
	if resumed != "" {
		took := ""
		if !act.last.IsZero() {
			took = fmt.Sprintf(" %s after the activity that woke it", r.now().Sub(act.last).Round(time.Millisecond))
		}
		r.event(sbx, pod, corev1.EventTypeNormal, EventResumed, "Resume",
			fmt.Sprintf("resumed from snapshot %s%s", resumed, took))
		metricResumes.Inc()
	}
	// An adopted sandbox keeps saying so until its pod next changes
	// (an idle stop, a restart): that is how one tells a fast start
	// from a cold one. Its pod's start was the warm sandbox's, long
	// before this one was asked for, so it is not a start time.
	reason := v1alpha1.ReasonRunning
	if resumed == "" && readyReason(sbx) == v1alpha1.ReasonAdoptedFromWarmPool {
		reason = v1alpha1.ReasonAdoptedFromWarmPool
	}
	r.setPhase(sbx, v1alpha1.SandboxPhaseRunning, metav1.ConditionTrue, reason,
		fmt.Sprintf("pod %s is ready; the supervisor listens on %s", pod.Name, sbx.Status.ServiceEndpoint))
	if prevReason != v1alpha1.ReasonRunning && reason == v1alpha1.ReasonRunning {
		metricPodStartSeconds.Observe(r.now().Sub(pod.CreationTimestamp.Time).Seconds())
	}
	r.eventOnNewReason(prevReason, sbx, pod, corev1.EventTypeNormal, EventSandboxReady, "Start",
		fmt.Sprintf("sandbox is running in pod %s at %s", pod.Name, sbx.Status.ServiceEndpoint))
	return nil
}

// setPhase sets the phase and the Ready condition that explains it.
func (r *SandboxReconciler) setPhase(sbx *v1alpha1.Sandbox, phase v1alpha1.SandboxPhase, status metav1.ConditionStatus, reason, msg string) {
	sbx.Status.Phase = phase
	r.setReady(sbx, status, reason, msg)
}

// setNotServing is setPhase for states without a usable pod: the pod fields
// are cleared, so that nothing dials an address that is gone.
func (r *SandboxReconciler) setNotServing(sbx *v1alpha1.Sandbox, phase v1alpha1.SandboxPhase, reason, msg string) {
	sbx.Status.PodName = ""
	sbx.Status.PodIP = ""
	sbx.Status.ServiceEndpoint = ""
	r.setPhase(sbx, phase, metav1.ConditionFalse, reason, msg)
}

func (r *SandboxReconciler) setReady(sbx *v1alpha1.Sandbox, status metav1.ConditionStatus, reason, msg string) {
	setCondition(&sbx.Status.Conditions, v1alpha1.ConditionReady, sbx.Generation, r.now(), status, reason, msg)
}

// eventOnNewReason records an event only when the Ready reason has just
// changed from prevReason (see readyReasonIsNew). Call it after setReady.
func (r *SandboxReconciler) eventOnNewReason(prevReason string, sbx *v1alpha1.Sandbox, related runtime.Object, eventType, reason, action, note string) {
	if readyReasonIsNew(sbx.Status.Conditions, prevReason) {
		r.event(sbx, related, eventType, reason, action, note)
	}
}

func (r *SandboxReconciler) event(sbx *v1alpha1.Sandbox, related runtime.Object, eventType, reason, action, note string) {
	recordEvent(r.Recorder, sbx, related, eventType, reason, action, note)
	r.recordAgentEvent(sbx, related, api.AgentEvent{Type: agentEventType(eventType, reason), Reason: reason,
		Message: truncateMessage(note)})
}

func readyReason(sbx *v1alpha1.Sandbox) string { return readyReasonOf(sbx.Status.Conditions) }

func podReady(pod *corev1.Pod) bool {
	if pod.Status.Phase != corev1.PodRunning {
		return false
	}
	for _, c := range pod.Status.Conditions {
		if c.Type == corev1.PodReady {
			return c.Status == corev1.ConditionTrue
		}
	}
	return false
}

// imageRunsAsRoot explains kubelet's refusal to start the sandbox container
// of a template with runAsImageUser whose image's user is root, unset, or a
// name kubelet cannot check (it says "container has runAsNonRoot and image
// will run as root" or "... has non-numeric user").
func imageRunsAsRoot(pod *corev1.Pod) (string, bool) {
	for _, cs := range pod.Status.ContainerStatuses {
		w := cs.State.Waiting
		if cs.Name != ContainerName || w == nil || w.Reason != "CreateContainerConfigError" || !strings.Contains(w.Message, "runAsNonRoot") {
			continue
		}
		return fmt.Sprintf("the template runs the sandbox as its image's user (runAsImageUser), and kubelet will not start it: %s. "+
			"A sandbox never runs as root: give the image a numeric non-root USER, or turn runAsImageUser off to run it as user %d",
			strings.TrimSpace(w.Message), sandboxUID), true
	}
	return "", false
}

// benignWaiting are the waiting reasons of a container that is on its way
// up; every other reason (ImagePullBackOff, ErrImageNeverPull,
// CrashLoopBackOff, CreateContainerConfigError, ...) needs a fix or at
// least explains why the sandbox is not ready.
var benignWaiting = map[string]bool{"": true, "ContainerCreating": true, "PodInitializing": true}

// containerProblem explains why the sandbox container cannot run, if it
// cannot: kubelet's waiting reason, or the last exit of a container that
// has stopped or is being restarted; the init container that installs the
// supervisor first (a supervisor image that cannot be pulled, say).
func containerProblem(pod *corev1.Pod) (string, bool) {
	for _, cs := range pod.Status.InitContainerStatuses {
		if cs.Name == InstallContainerName {
			if msg, ok := statusProblem(cs); ok {
				return "the supervisor cannot be installed: " + msg, true
			}
		}
	}
	for _, cs := range pod.Status.ContainerStatuses {
		if cs.Name == ContainerName {
			return statusProblem(cs)
		}
	}
	return "", false
}

// statusProblem explains why one container cannot run, if it cannot. A
// terminated container is a problem unless it exited 0, which is how an
// init container ends.
func statusProblem(cs corev1.ContainerStatus) (string, bool) {
	last := ""
	if t := cs.LastTerminationState.Terminated; t != nil {
		last = "; it last " + describeExit(t)
	}
	switch {
	case cs.State.Waiting != nil && !benignWaiting[cs.State.Waiting.Reason]:
		w := cs.State.Waiting
		msg := fmt.Sprintf("container %s is waiting: %s", cs.Name, w.Reason)
		if w.Message != "" {
			msg += ": " + w.Message
		}
		return msg + last, true
	case cs.State.Terminated != nil && (cs.Name == ContainerName || cs.State.Terminated.ExitCode != 0):
		return fmt.Sprintf("container %s %s", cs.Name, describeExit(cs.State.Terminated)), true
	case cs.State.Terminated == nil && !cs.Ready && cs.RestartCount > 0 && last != "":
		// Running again after a crash but not ready: report the crash
		// rather than flip to Creating between restarts.
		return fmt.Sprintf("container %s restarted %d times%s", cs.Name, cs.RestartCount, last), true
	}
	return "", false
}

func describeExit(t *corev1.ContainerStateTerminated) string {
	s := fmt.Sprintf("exited with code %d", t.ExitCode)
	if t.Signal != 0 {
		s = fmt.Sprintf("was killed by signal %d", t.Signal)
	}
	if t.Reason != "" {
		s += " (" + t.Reason + ")"
	}
	if m := strings.TrimSpace(t.Message); m != "" {
		s += ": " + m
	}
	return s
}

// podStopReason explains why a pod stopped for good.
func podStopReason(pod *corev1.Pod) string {
	if pod.Status.Reason != "" || pod.Status.Message != "" {
		return strings.TrimSpace(pod.Status.Reason + " " + pod.Status.Message)
	}
	if msg, ok := containerProblem(pod); ok {
		return msg
	}
	return "no reason given"
}

// podWaitingMessage says what a pod that is neither ready nor failing waits
// for.
func podWaitingMessage(pod *corev1.Pod) string {
	for _, c := range pod.Status.Conditions {
		if c.Type == corev1.PodScheduled && c.Status == corev1.ConditionFalse {
			return fmt.Sprintf("pod %s is not scheduled: %s: %s", pod.Name, c.Reason, c.Message)
		}
	}
	for _, cs := range pod.Status.ContainerStatuses {
		if cs.Name == ContainerName && cs.State.Waiting != nil && cs.State.Waiting.Reason != "" {
			return fmt.Sprintf("waiting for pod %s to become ready: container %s", pod.Name, cs.State.Waiting.Reason)
		}
	}
	return fmt.Sprintf("waiting for pod %s to become ready", pod.Name)
}
