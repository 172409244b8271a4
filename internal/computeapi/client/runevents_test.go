package client

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"net/http"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"
)

// eventServer serves a fixed log of n events (the last one the end) the
// way the API does, resuming after Last-Event-ID, but cuts each
// connection after cut events without ending the stream. It records the
// Last-Event-ID of each connection.
func eventServer(t *testing.T, n, cut int) (*Client, func() []string) {
	var (
		mu      sync.Mutex
		resumes []string
	)
	srv, ca := newTLSServer(t, func(w http.ResponseWriter, r *http.Request) {
		if r.URL.Path != PathRunEvents("run-1") || r.Header.Get("Authorization") != "Bearer tok" {
			http.Error(w, "wrong request", http.StatusBadRequest)
			return
		}
		mu.Lock()
		resumes = append(resumes, r.Header.Get(HeaderLastEventID))
		mu.Unlock()
		after, _ := strconv.Atoi(r.Header.Get(HeaderLastEventID))
		w.Header().Set("Content-Type", ContentTypeEventStream)
		fmt.Fprint(w, ": keepalive\n\nretry: 1000\n\n")
		for id := after + 1; id <= n && id <= after+cut; id++ {
			typ := RunEventStdout
			if id == n {
				typ = RunEventEnd
			}
			b, _ := json.Marshal(RunEvent{ID: int64(id), Type: typ, Text: fmt.Sprintf("line %d\n", id)})
			fmt.Fprintf(w, "id: %d\nevent: %s\ndata: %s\n\n", id, typ, b)
		}
	})
	c, err := New(srv.URL, "tok", ca)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(c.CloseIdleConnections)
	return c, func() []string {
		mu.Lock()
		defer mu.Unlock()
		return append([]string(nil), resumes...)
	}
}

// FollowRun reconnects by itself after a cut stream, with the last id it
// gave to its callback, and gives each event once.
func TestFollowRunReconnects(t *testing.T) {
	c, resumes := eventServer(t, 10, 4)
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	var got []string
	err := c.FollowRun(ctx, "run-1", 0, func(e RunEvent) error {
		got = append(got, fmt.Sprintf("%d:%s", e.ID, e.Type))
		return nil
	})
	if err != nil {
		t.Fatal(err)
	}
	want := "1:stdout 2:stdout 3:stdout 4:stdout 5:stdout 6:stdout 7:stdout 8:stdout 9:stdout 10:end"
	if strings.Join(got, " ") != want {
		t.Errorf("events %v", got)
	}
	if r := strings.Join(resumes(), ","); r != ",4,8" {
		t.Errorf("Last-Event-IDs sent %q, want \",4,8\"", r)
	}
	// Resuming from an id skips what came before it.
	got = nil
	if err := c.FollowRun(ctx, "run-1", 8, func(e RunEvent) error {
		got = append(got, fmt.Sprint(e.ID))
		return nil
	}); err != nil || strings.Join(got, " ") != "9 10" {
		t.Errorf("from 8: %v, %v", got, err)
	}
}

// A stream that keeps breaking without an event is given up after the
// retries, with ErrFollowIncomplete; the callback's error and the API's
// refusals end following at once.
func TestFollowRunGivesUp(t *testing.T) {
	first, most := followBackoffFirst, followBackoffMax
	followBackoffFirst, followBackoffMax = time.Millisecond, 10*time.Millisecond
	t.Cleanup(func() { followBackoffFirst, followBackoffMax = first, most })
	c, resumes := eventServer(t, 10, 0)
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	err := c.FollowRun(ctx, "run-1", 0, func(RunEvent) error { return nil })
	if !errors.Is(err, ErrFollowIncomplete) || len(resumes()) != followRetries+1 {
		t.Errorf("%v after %d connections", err, len(resumes()))
	}

	c, _ = eventServer(t, 10, 3)
	stop := errors.New("stop")
	n := 0
	if err := c.FollowRun(ctx, "run-1", 0, func(RunEvent) error { n++; return stop }); !errors.Is(err, stop) || n != 1 {
		t.Errorf("callback error: %v after %d events", err, n)
	}
	srv, ca := newTLSServer(t, func(w http.ResponseWriter, r *http.Request) {
		w.Header().Set("Content-Type", "application/json")
		w.WriteHeader(http.StatusNotFound)
		fmt.Fprint(w, `{"error":{"code":"not_found","message":"no run \"run-1\""}}`)
	})
	c404, err := New(srv.URL, "tok", ca)
	if err != nil {
		t.Fatal(err)
	}
	defer c404.CloseIdleConnections()
	if err := c404.FollowRun(ctx, "run-1", 0, func(RunEvent) error { return nil }); CodeOf(err) != CodeNotFound {
		t.Errorf("missing run: %v", err)
	}
}

func TestReadEventStream(t *testing.T) {
	in := ": comment\r\n\r\nid: 1\r\nevent: a\r\ndata: x\r\ndata:y\r\n\r\nretry: 5\n\nid: 2\ndata: z\n\nid: 3\ndata: unended"
	var got []string
	if err := ReadEventStream(strings.NewReader(in), func(e EventStreamEvent) error {
		got = append(got, e.ID+"/"+e.Event+"/"+e.Data)
		return nil
	}); err != nil {
		t.Fatal(err)
	}
	// An event the stream ends in the middle of is not dispatched.
	if strings.Join(got, "|") != "1/a/x\ny|2//z" {
		t.Errorf("events %q", got)
	}
}

// Once its context is done, FollowRun gives no more events, even those it
// has already read.
func TestFollowRunStopsAtCancel(t *testing.T) {
	c, _ := eventServer(t, 10, 10)
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	n := 0
	err := c.FollowRun(ctx, "run-1", 0, func(RunEvent) error {
		n++
		if n == 3 {
			cancel()
		}
		return nil
	})
	if !errors.Is(err, context.Canceled) || n != 3 {
		t.Errorf("%v after %d events, want 3", err, n)
	}
}
