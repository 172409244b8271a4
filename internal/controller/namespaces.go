package controller

import (
	"fmt"
	"slices"
	"strings"
)

// ServedNamespaces are the namespaces whose sandboxes, warm pools and egress
// proxies the platform runs: the control plane's Kubernetes rights over
// pods, Secrets and the other children reach only there (the chart's Roles),
// and its cache watches those children only there. Empty means every
// namespace, for a control plane run with cluster-wide rights (the
// controllers' own cluster tests); the chart always names the namespaces.
//
// The agentbox kinds themselves are watched in every namespace, so that one
// made where the platform does not serve is told so (NamespaceNotServed)
// rather than left waiting for a controller that cannot act on it.
type ServedNamespaces []string

// Serves reports whether the platform runs objects in namespace ns.
func (s ServedNamespaces) Serves(ns string) bool {
	return len(s) == 0 || slices.Contains(s, ns)
}

// notServedMessage explains, for a condition and an event, why an object in
// namespace ns is left alone and how to fix it.
func (s ServedNamespaces) notServedMessage(kind, ns string) string {
	return fmt.Sprintf("the agentbox platform does not serve namespace %q (it serves %s): the control plane has no rights "+
		"over pods and Secrets there, so this %s stays idle. Add %q to the platform's sandbox namespaces "+
		"(chart value sandboxNamespaces, agentbox_platform's sandbox_namespaces), or create the %s in a served namespace",
		ns, strings.Join(s, ", "), kind, ns, kind)
}

// EventNamespaceNotServed is the event that goes with the NamespaceNotServed
// reason, recorded once when an object first gets it.
const EventNamespaceNotServed = "NamespaceNotServed"
