package holds

import (
	"testing"

	"k8s.io/apimachinery/pkg/types"
)

func TestPoolWaitersTakeTurns(t *testing.T) {
	var p poolWaiters
	key := types.NamespacedName{Namespace: "ns", Name: "p"}
	a, b, c := p.join(key), p.join(key), p.join(key)
	isTurn := func(w *poolWaiter) bool {
		select {
		case <-w.turn:
			return true
		default:
			return false
		}
	}
	if !isTurn(a) || isTurn(b) || isTurn(c) || p.queued(key) != 3 {
		t.Fatalf("after three joins: turns %v %v %v, %d queued", isTurn(a), isTurn(b), isTurn(c), p.queued(key))
	}
	// One behind the first gives up: the first keeps the turn.
	p.leave(key, b)
	if !isTurn(a) || isTurn(c) {
		t.Fatal("a waiter behind the first left, and the turn moved")
	}
	p.leave(key, a)
	if !isTurn(c) || p.queued(key) != 1 {
		t.Fatal("the first left, and the next did not get the turn")
	}
	p.leave(key, c)
	if p.queued(key) != 0 || len(p.queues) != 0 {
		t.Fatalf("empty queue kept: %v", p.queues)
	}
}
