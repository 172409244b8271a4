package controller

import (
	"fmt"
	"slices"
	"strings"
	"time"

	"k8s.io/apimachinery/pkg/api/meta"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"

	"github.com/agentbox/terraform-provider-agentbox/internal/api/v1alpha1"
)

// ServedNamespaces are the namespaces whose sandboxes, warm pools and egress
// proxies the platform runs: the control plane's Kubernetes rights over
// pods, Secrets and the other children reach only there (the chart's Roles),
// and its cache watches those children only there. Empty means every
// namespace, for a control plane run with cluster-wide rights (the
// controllers' own cluster tests); the chart always names the namespaces.
//
// The agentbox kinds themselves are watched in every namespace, so that one
// made where no platform serves is told so (NamespaceNotServed) rather than
// left waiting for a controller that cannot act on it.
//
// Several platforms may share a cluster, each in its own namespace and
// serving its own: every one of them sees every agentbox object, so each
// leaves alone what it does not serve (notServedNow), and agent IDs are the
// platform's own (the duplicate check and the Compute API look only in the
// served namespaces).
type ServedNamespaces []string

// Serves reports whether the platform runs objects in namespace ns.
func (s ServedNamespaces) Serves(ns string) bool {
	return len(s) == 0 || slices.Contains(s, ns)
}

// notServedGrace is how long a platform that does not serve an object's
// namespace leaves it for the platform that does: that one reports on a
// new object in its first pass, well within this, even across a control
// plane restart or a leader change.
const notServedGrace = 10 * time.Second

// notServedNow decides, for an object in a namespace this platform does not
// serve, whether to tell it NamespaceNotServed now. Only an object that no
// platform has reported on (no Ready condition) once notServedGrace has
// passed since it was made is told, by whichever platform comes first; an
// object with a Ready condition is served by another platform, or was told
// already, and is left alone. Before the grace is over, wait says when to
// look again.
func notServedNow(created metav1.Time, conditions []metav1.Condition, now time.Time) (tell bool, wait time.Duration) {
	if meta.FindStatusCondition(conditions, v1alpha1.ConditionReady) != nil {
		return false, 0
	}
	if wait := created.Add(notServedGrace).Sub(now); wait > 0 {
		return false, wait
	}
	return true, 0
}

// notServedMessage explains, for a condition and an event, why an object in
// namespace ns is left alone and how to fix it.
func (s ServedNamespaces) notServedMessage(kind, ns string) string {
	return fmt.Sprintf("no agentbox platform took up this %s within %s: the one that reports this does not serve namespace %q "+
		"(it serves %s), and its control plane has no rights over pods and Secrets there, so the %s stays idle. Add %q to "+
		"the platform's sandbox namespaces (chart value sandboxNamespaces, agentbox_platform's sandbox_namespaces), "+
		"or create the %s in a served namespace",
		kind, notServedGrace, ns, strings.Join(s, ", "), kind, ns, kind)
}

// EventNamespaceNotServed is the event that goes with the NamespaceNotServed
// reason, recorded once when an object first gets it.
const EventNamespaceNotServed = "NamespaceNotServed"
