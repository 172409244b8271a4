package controller

import (
	"time"

	"k8s.io/utils/clock"
	"sigs.k8s.io/controller-runtime/pkg/client"
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
