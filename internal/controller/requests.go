package controller

import (
	"context"
	"time"

	"k8s.io/utils/clock"
	"sigs.k8s.io/controller-runtime/pkg/client"
	logf "sigs.k8s.io/controller-runtime/pkg/log"
	"sigs.k8s.io/controller-runtime/pkg/reconcile"
)

// requestsFor turns listed objects into reconcile requests, for the map
// functions that wake every object a watched one concerns.
func requestsFor[T any, PT interface {
	*T
	client.Object
}](items []T) []reconcile.Request {
	reqs := make([]reconcile.Request, 0, len(items))
	for i := range items {
		reqs = append(reqs, reconcile.Request{NamespacedName: client.ObjectKeyFromObject(PT(&items[i]))})
	}
	return reqs
}

// nowOf is c's time, or the real time when the reconciler was given no
// clock (tests give one).
func nowOf(c clock.PassiveClock) time.Time {
	if c == nil {
		return time.Now()
	}
	return c.Now()
}

// listOfTemplate lists into list the objects that name the template tpl
// (through templateRefIndex), for the watches that wake them when it
// changes. A failure is logged, as a map function cannot return it, and
// reported as false; what names the objects in the log.
func listOfTemplate(ctx context.Context, c client.Reader, list client.ObjectList, tpl client.Object, what string) bool {
	if err := c.List(ctx, list, client.InNamespace(tpl.GetNamespace()),
		client.MatchingFields{templateRefIndex: tpl.GetName()}); err != nil {
		logf.FromContext(ctx).Error(err, "list "+what+" of template", "template", client.ObjectKeyFromObject(tpl))
		return false
	}
	return true
}
