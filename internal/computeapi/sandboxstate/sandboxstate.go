// Package sandboxstate reads a Sandbox's status the way the Compute API
// needs it: whether the sandbox takes calls now, will without anyone's
// help, or why not, in the API's words.
package sandboxstate

import (
	"fmt"
	"time"

	"k8s.io/apimachinery/pkg/api/meta"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"

	"github.com/agentbox/terraform-provider-agentbox/internal/api/v1alpha1"
	api "github.com/agentbox/terraform-provider-agentbox/internal/computeapi/client"
)

// PollInterval is how often a call waiting for a sandbox looks at it
// again. It reads the manager's cache, so polling costs no API requests.
const PollInterval = 100 * time.Millisecond

// StillDoing says what a sandbox that is not Serving yet was doing when a
// call gave up waiting for it.
func StillDoing(sb *v1alpha1.Sandbox) string {
	switch sb.Status.Phase {
	case v1alpha1.SandboxPhaseIdleStopping:
		return "its idle stop finished, which the resume follows"
	case v1alpha1.SandboxPhaseStopped:
		return "the resume was about to begin"
	case v1alpha1.SandboxPhaseResuming:
		return "its workspace was being restored from its snapshot"
	case v1alpha1.SandboxPhaseError:
		return "it was being started again after the error its status names"
	}
	return "its pod was Starting"
}

// NodeLossKey identifies the node loss a sandbox waits after, empty when it
// waits after none.
func NodeLossKey(sb *v1alpha1.Sandbox) string {
	loss := sb.Status.NodeLoss
	if loss == nil || sb.Status.Phase != v1alpha1.SandboxPhaseError {
		return ""
	}
	key := loss.NodeName + "@" + loss.Time.UTC().Format(time.RFC3339)
	if loss.ActivityTime != nil {
		key += "/" + loss.ActivityTime.UTC().Format(time.RFC3339Nano)
	}
	return key
}

// Serving reports whether the sandbox takes calls now.
func Serving(sb *v1alpha1.Sandbox) bool {
	ready := meta.FindStatusCondition(sb.Status.Conditions, v1alpha1.ConditionReady)
	return sb.Status.Phase == v1alpha1.SandboxPhaseRunning && ready != nil && ready.Status == metav1.ConditionTrue &&
		sb.Status.ServiceEndpoint != ""
}

// Starting reports whether the sandbox will take calls without anyone's
// help: it is stopped (and the call wakes it), being stopped (the resume
// follows), resuming, its pod is being created, or in an Error that the
// next activity ends (v1alpha1.ErrorResumesOnActivity: a lost node, after
// which it resumes on another node, or an idle stop that failed after its
// pod was gone; the call wakes it). Every other Error needs a person, and
// fails the call at once with the condition's message.
func Starting(sb *v1alpha1.Sandbox) bool {
	switch sb.Status.Phase {
	case v1alpha1.SandboxPhaseStopped, v1alpha1.SandboxPhaseIdleStopping, v1alpha1.SandboxPhaseResuming:
		return true
	case v1alpha1.SandboxPhaseError:
		// status.nodeLoss too: a retried API error of the controller can
		// stand in the Ready condition for a moment.
		ready := meta.FindStatusCondition(sb.Status.Conditions, v1alpha1.ConditionReady)
		return sb.Status.NodeLoss != nil || (ready != nil && v1alpha1.ErrorResumesOnActivity(ready.Reason))
	case v1alpha1.SandboxPhasePending, "":
		ready := meta.FindStatusCondition(sb.Status.Conditions, v1alpha1.ConditionReady)
		return ready == nil || ready.Reason == v1alpha1.ReasonCreating || ready.Reason == v1alpha1.ReasonAdoptedFromWarmPool
	case v1alpha1.SandboxPhaseRunning:
		// Running but the Ready condition or endpoint lags a moment.
		return true
	}
	return false
}

// NotReady is the sandbox_not_ready error of a call on agentID's sandbox
// sb, naming its phase and the reason of its Ready condition.
func NotReady(agentID string, sb *v1alpha1.Sandbox) *api.Error {
	ready := meta.FindStatusCondition(sb.Status.Conditions, v1alpha1.ConditionReady)
	phase, reason := string(sb.Status.Phase), ""
	if phase == "" {
		phase = string(v1alpha1.SandboxPhasePending)
	}
	msg := fmt.Sprintf("the sandbox of agent %q is not ready: phase %s", agentID, phase)
	if ready != nil {
		reason = ready.Reason
		msg += ", reason " + ready.Reason
		if ready.Message != "" {
			msg += ": " + ready.Message
		}
	}
	e := api.Errorf(api.CodeSandboxNotReady, "%s", msg)
	e.Details = map[string]string{"phase": phase, "reason": reason}
	return e
}

// Phase is sb's phase, Pending when it has none yet.
func Phase(sb *v1alpha1.Sandbox) string {
	if sb.Status.Phase == "" {
		return string(v1alpha1.SandboxPhasePending)
	}
	return string(sb.Status.Phase)
}

// ReadyReason is the reason of sb's Ready condition, or "".
func ReadyReason(sb *v1alpha1.Sandbox) string {
	for _, c := range sb.Status.Conditions {
		if c.Type == v1alpha1.ConditionReady {
			return c.Reason
		}
	}
	return ""
}
