package supervisorapi

import (
	"context"
	"errors"
	"net"
	"sync/atomic"
	"syscall"
	"testing"
	"time"
)

// freeLoopbackAddr returns a loopback address nothing listens on, which
// refuses connects until something does.
func freeLoopbackAddr(t *testing.T) string {
	t.Helper()
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	addr := l.Addr().String()
	if err := l.Close(); err != nil {
		t.Fatal(err)
	}
	return addr
}

// countingDial counts the connects made through it.
func countingDial(n *atomic.Int32) dialFunc {
	d := &net.Dialer{Timeout: time.Second}
	return func(ctx context.Context, network, addr string) (net.Conn, error) {
		n.Add(1)
		return d.DialContext(ctx, network, addr)
	}
}

// A supervisor that starts listening a moment after the first connect is
// refused is reached by the same dial.
func TestRetryRefusedReachesALateListener(t *testing.T) {
	addr := freeLoopbackAddr(t)
	var dials atomic.Int32
	dial := retryRefused(countingDial(&dials), 5*time.Second)
	listening := make(chan net.Listener, 1)
	go func() {
		// Listen only once the first connect has been refused.
		for dials.Load() == 0 {
			time.Sleep(10 * time.Millisecond)
		}
		time.Sleep(200 * time.Millisecond)
		l, err := net.Listen("tcp", addr)
		if err != nil {
			t.Error(err)
			close(listening)
			return
		}
		listening <- l
	}()
	conn, err := dial(context.Background(), "tcp", addr)
	if err != nil {
		t.Fatalf("dial after the listener came up: %v", err)
	}
	conn.Close()
	if l, ok := <-listening; ok {
		l.Close()
	}
	if n := dials.Load(); n < 2 {
		t.Fatalf("connected after %d dial(s); the first one should have been refused", n)
	}
}

// A supervisor that keeps refusing gets the refusal back once the window
// has passed, and a cancelled context ends the retries at once.
func TestRetryRefusedGivesUp(t *testing.T) {
	addr := freeLoopbackAddr(t)
	var dials atomic.Int32
	_, err := retryRefused(countingDial(&dials), 300*time.Millisecond)(context.Background(), "tcp", addr)
	if !errors.Is(err, syscall.ECONNREFUSED) {
		t.Fatalf("err = %v, want a refused connect", err)
	}
	if n := dials.Load(); n < 2 {
		t.Fatalf("%d dial(s) within the window; want the refused connect retried", n)
	}

	ctx, cancel := context.WithCancel(context.Background())
	cancel()
	dials.Store(0)
	if _, err := retryRefused(countingDial(&dials), time.Hour)(ctx, "tcp", addr); err == nil {
		t.Fatal("dial with a cancelled context succeeded")
	}
	if n := dials.Load(); n > 1 {
		t.Fatalf("%d dials with a cancelled context; want at most one", n)
	}
}

// Errors other than a refusal are returned at once: a timeout or a TLS
// failure may have carried something, and is the caller's to judge.
func TestRetryRefusedReturnsOtherErrorsAtOnce(t *testing.T) {
	var dials atomic.Int32
	boom := errors.New("no route")
	dial := retryRefused(func(context.Context, string, string) (net.Conn, error) {
		dials.Add(1)
		return nil, boom
	}, time.Hour)
	if _, err := dial(context.Background(), "tcp", "127.0.0.1:1"); !errors.Is(err, boom) {
		t.Fatalf("err = %v, want %v", err, boom)
	}
	if n := dials.Load(); n != 1 {
		t.Fatalf("%d dials, want 1", n)
	}
}
