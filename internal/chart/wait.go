package chart

import (
	"context"
	"errors"
	"fmt"
	"sort"
	"strings"
	"time"

	appsv1 "k8s.io/api/apps/v1"
	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/labels"
	"k8s.io/apimachinery/pkg/util/wait"
	"k8s.io/client-go/kubernetes"
)

// waitReady waits until the control plane Deployment has rolled out: every
// replica updated and available, and no old ones left. When it gives up it
// says why in terms a person can act on (the pods' states), because "context
// deadline exceeded" alone sends everyone to kubectl.
func (c *Client) waitReady(ctx context.Context, o Options) error {
	cs, err := c.clientset()
	if err != nil {
		return err
	}
	var last string
	err = wait.PollUntilContextCancel(ctx, 2*time.Second, true, func(ctx context.Context) (bool, error) {
		d, err := cs.AppsV1().Deployments(o.Namespace).Get(ctx, ControlPlaneDeployment, metav1.GetOptions{})
		switch {
		case apierrors.IsNotFound(err):
			last = "the Deployment does not exist"
			return false, nil
		case err != nil:
			last = err.Error()
			return false, nil
		}
		ready, why, failed := deploymentReady(d)
		last = why
		if failed {
			return false, errors.New(why)
		}
		if !ready {
			if why := hopelessPod(ctx, cs, o.Namespace); why != "" {
				return false, errors.New(why)
			}
		}
		return ready, nil
	})
	if err == nil {
		return nil
	}
	msg := fmt.Sprintf("the control plane (Deployment %s/%s) did not become ready", o.Namespace, ControlPlaneDeployment)
	if ctx.Err() != nil {
		msg += fmt.Sprintf(" within %s: %s", o.timeout(), last)
	} else {
		msg += ": " + err.Error()
	}
	// The wait's context is spent; the diagnosis gets its own short one.
	dctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), 15*time.Second)
	defer cancel()
	if d := diagnose(dctx, cs, o.Namespace); d != "" {
		msg += "\n\n" + d
	}
	return errors.New(msg)
}

// deploymentReady reports whether d has rolled out, why not, and whether it
// never will (its progress deadline passed).
func deploymentReady(d *appsv1.Deployment) (ready bool, why string, failed bool) {
	want := int32(1)
	if d.Spec.Replicas != nil {
		want = *d.Spec.Replicas
	}
	st := d.Status
	for _, c := range st.Conditions {
		if c.Type == appsv1.DeploymentProgressing && c.Status == corev1.ConditionFalse && c.Reason == "ProgressDeadlineExceeded" {
			return false, "rollout stopped: " + c.Message, true
		}
	}
	switch {
	case st.ObservedGeneration < d.Generation:
		return false, "the Deployment controller has not seen the latest spec yet", false
	case st.UpdatedReplicas < want:
		return false, fmt.Sprintf("%d of %d replicas updated", st.UpdatedReplicas, want), false
	case st.Replicas > st.UpdatedReplicas:
		return false, fmt.Sprintf("%d old replicas still running", st.Replicas-st.UpdatedReplicas), false
	case st.AvailableReplicas < want:
		return false, fmt.Sprintf("%d of %d replicas available", st.AvailableReplicas, want), false
	}
	if want > 0 {
		available := false
		for _, c := range st.Conditions {
			if c.Type == appsv1.DeploymentAvailable && c.Status == corev1.ConditionTrue {
				available = true
			}
		}
		if !available {
			return false, "the Deployment is not Available yet", false
		}
	}
	return true, "", false
}

// hopeless are waiting reasons that no amount of waiting cures: the image
// reference is wrong, or pulls are forbidden and the image is not on the
// node. Failing at once saves the user the whole timeout.
var hopeless = map[string]bool{"ErrImageNeverPull": true, "InvalidImageName": true}

// hopelessPod returns why a control plane pod can never start, or "".
func hopelessPod(ctx context.Context, cs kubernetes.Interface, namespace string) string {
	pods, err := cs.CoreV1().Pods(namespace).List(ctx, metav1.ListOptions{LabelSelector: controlPlaneSelector})
	if err != nil {
		return ""
	}
	for _, p := range pods.Items {
		for _, s := range p.Status.ContainerStatuses {
			if w := s.State.Waiting; w != nil && hopeless[w.Reason] {
				return fmt.Sprintf("pod %s cannot start: %s: %s", p.Name, w.Reason, w.Message)
			}
		}
	}
	return ""
}

var controlPlaneSelector = labels.SelectorFromSet(labels.Set{
	"app.kubernetes.io/name": "agentbox", "app.kubernetes.io/component": "controlplane",
}).String()

// diagnose describes the control plane pods that are not ready and the
// recent warnings about them, or returns "".
func diagnose(ctx context.Context, cs kubernetes.Interface, namespace string) string {
	pods, err := cs.CoreV1().Pods(namespace).List(ctx, metav1.ListOptions{LabelSelector: controlPlaneSelector})
	if err != nil {
		return "(could not list the control plane pods: " + err.Error() + ")"
	}
	var lines []string
	for _, p := range pods.Items {
		lines = append(lines, describePod(&p)...)
	}
	if len(pods.Items) == 0 {
		lines = append(lines, "no control plane pod exists")
	}

	// Scheduling, volume and pull failures are only told as events.
	events, err := cs.CoreV1().Events(namespace).List(ctx, metav1.ListOptions{FieldSelector: "type=Warning"})
	if err == nil {
		sort.Slice(events.Items, func(i, j int) bool {
			return eventTime(&events.Items[i]).After(eventTime(&events.Items[j]))
		})
		n := 0
		for _, e := range events.Items {
			if !strings.HasPrefix(e.InvolvedObject.Name, ControlPlaneDeployment) && e.InvolvedObject.Name != "agentbox-store" {
				continue
			}
			lines = append(lines, fmt.Sprintf("event on %s %s: %s: %s", e.InvolvedObject.Kind, e.InvolvedObject.Name, e.Reason, strings.TrimSpace(e.Message)))
			if n++; n == 5 {
				break
			}
		}
	}
	return strings.Join(lines, "\n")
}

func describePod(p *corev1.Pod) []string {
	var out []string
	prefix := "pod " + p.Name + ": "
	for _, c := range p.Status.Conditions {
		if c.Type == corev1.PodScheduled && c.Status == corev1.ConditionFalse {
			out = append(out, prefix+"not scheduled: "+c.Reason+": "+c.Message)
		}
	}
	for _, s := range append(p.Status.InitContainerStatuses, p.Status.ContainerStatuses...) {
		if s.Ready {
			continue
		}
		cp := prefix + "container " + s.Name + " "
		switch {
		case s.State.Waiting != nil:
			out = append(out, cp+"is waiting: "+s.State.Waiting.Reason+": "+s.State.Waiting.Message)
		case s.State.Running != nil:
			out = append(out, cp+"is running but not ready (failing its readiness probe on /readyz)")
		case s.State.Terminated != nil:
			t := s.State.Terminated
			out = append(out, fmt.Sprintf("%sexited with code %d: %s %s", cp, t.ExitCode, t.Reason, strings.TrimSpace(t.Message)))
		}
		if t := s.LastTerminationState.Terminated; t != nil {
			out = append(out, fmt.Sprintf("%slast exited with code %d (%s) after %d restarts: %s", cp, t.ExitCode, t.Reason, s.RestartCount, strings.TrimSpace(t.Message)))
		}
	}
	if len(out) == 0 && p.Status.Phase != corev1.PodRunning {
		out = append(out, prefix+"phase "+string(p.Status.Phase))
	}
	return out
}

func eventTime(e *corev1.Event) time.Time {
	switch {
	case !e.LastTimestamp.IsZero():
		return e.LastTimestamp.Time
	case e.Series != nil:
		return e.Series.LastObservedTime.Time
	case !e.EventTime.IsZero():
		return e.EventTime.Time
	}
	return e.CreationTimestamp.Time
}
