package wire

import (
	"context"
	"errors"
	"net/http"
	"net/http/httptest"
	"strings"
	"testing"
)

// Each side's errors read as they did before the two clients shared this
// code: the supervisor's start with "supervisor", the API's with
// "agentbox" and end with the call's request ID.
func TestErrorMessages(t *testing.T) {
	sup := &Error[Supervisor]{Code: CodeNotFound, Message: "no file", Status: 404}
	if got, want := sup.Error(), "supervisor: not_found (404): no file"; got != want {
		t.Errorf("supervisor error %q, want %q", got, want)
	}
	api := &Error[API]{Code: CodeLeaseHeld, Message: "held", Status: 409, RequestID: "r-1"}
	if got, want := api.Error(), "agentbox: lease_held (409): held (request r-1)"; got != want {
		t.Errorf("API error %q, want %q", got, want)
	}
	if got, want := (&Error[API]{Code: CodeInternal, Message: "m"}).Error(), "agentbox: internal: m"; got != want {
		t.Errorf("API error without status %q, want %q", got, want)
	}
}

// The two sides' errors are distinct types: the control plane tells a
// supervisor's error from its own, and matching goes by code alone.
func TestErrorsOfEachPeerAreTheirOwn(t *testing.T) {
	err := error(Errorf[Supervisor](CodeWorkspaceFull, "full"))
	if CodeOf[Supervisor](err) != CodeWorkspaceFull || CodeOf[API](err) != "" {
		t.Errorf("CodeOf: supervisor %q, API %q", CodeOf[Supervisor](err), CodeOf[API](err))
	}
	if !errors.Is(err, &Error[Supervisor]{Code: CodeWorkspaceFull}) || errors.Is(err, &Error[API]{Code: CodeWorkspaceFull}) {
		t.Error("errors.Is does not match by peer and code")
	}
	if e := Errorf[API](CodePoolExhausted, "x"); e.Status != 503 {
		t.Errorf("Errorf status %d, want 503", e.Status)
	}
}

// Every code keeps the status each side sent with it.
func TestCodeStatuses(t *testing.T) {
	for code, status := range map[Code]int{
		CodeInvalidArgument: 400, CodeUnauthenticated: 401, CodePermissionDenied: 403,
		CodePathEscapesWorkspace: 403, CodeInvalidUserToken: 403, CodeNotFound: 404, CodeSandboxNotFound: 404, CodePoolNotFound: 404,
		CodeFileNotFound: 404, CodeEnvNotFound: 404, CodeMethodNotAllowed: 405, CodeSandboxNotReady: 409, CodeLeaseHeld: 409,
		CodeLeaseNotHeld: 409, CodeLeaseExpired: 409, CodeIsADirectory: 409, CodeNotADirectory: 409,
		CodeConsoleExpired: 410, CodePayloadTooLarge: 413, CodeEnvBuildFailed: 422, CodeResourceExhausted: 429,
		CodeInternal: 500, CodeUnknown: 500, CodeSupervisorUnavailable: 502, CodeUnavailable: 503,
		CodePoolExhausted: 503, CodeTimeout: 504, CodeWorkspaceFull: 507,
	} {
		if got := code.HTTPStatus(); got != status {
			t.Errorf("%s: status %d, want %d", code, got, status)
		}
	}
}

// An error response is decoded into the peer's *Error; only the API's
// carries the response's request ID, and a body that is not an error body
// is reported as unknown with its text.
func TestDecodeError(t *testing.T) {
	resp := &http.Response{StatusCode: 409, Header: http.Header{"X-Request-Id": {"r-9"}}}
	body := []byte(`{"error":{"code":"lease_held","message":"m","details":{"holder":"h"}}}`)
	if e := DecodeError[API](resp, body); e.Code != CodeLeaseHeld || e.Status != 409 || e.RequestID != "r-9" || e.Details["holder"] != "h" {
		t.Errorf("API error %#v", e)
	}
	if e := DecodeError[Supervisor](resp, body); e.RequestID != "" {
		t.Errorf("supervisor error took the request ID: %#v", e)
	}
	e := DecodeError[Supervisor](&http.Response{StatusCode: 502}, []byte(" upstream "+strings.Repeat("x", 600)))
	if e.Code != CodeUnknown || e.Status != 502 || !strings.HasPrefix(e.Message, "upstream x") || !strings.HasSuffix(e.Message, "...") || len(e.Message) != 515 {
		t.Errorf("foreign body: %#v", e)
	}
	if e := DecodeError[API](&http.Response{StatusCode: 503}, nil); e.Message != "Service Unavailable" {
		t.Errorf("empty body: %#v", e)
	}
}

// A stream that ends without a result is the peer's incomplete-stream
// error; a supervisor's exit event is returned once the body is read.
func TestStreamCommand(t *testing.T) {
	lines := map[string]string{
		"/cut":  `{"stream":"stdout","data":"a"}` + "\n",
		"/exit": `{"stream":"stdout","data":"a"}` + "\n" + `{"exit":{"stdout":"","stderr":"","exit_code":3,"signal":"","timed_out":false,"truncated":false,"duration_ms":1}}` + "\n",
		"/err":  `{"error":{"code":"internal","message":"broke"}}` + "\n",
	}
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if r.Header.Get("Accept") != ContentTypeNDJSON || r.Header.Get("Content-Type") != "application/json" {
			http.Error(w, "bad headers", http.StatusBadRequest)
			return
		}
		w.Header().Set("X-Request-Id", "r-2")
		_, _ = w.Write([]byte(lines[r.URL.Path]))
	}))
	defer srv.Close()
	sup := &Transport[Supervisor]{BaseURL: srv.URL}
	var data []string
	res, err := StreamCommand(context.Background(), sup, "/exit", []byte(`{}`), func(ev CommandEvent[CommandResult, Supervisor]) error {
		data = append(data, ev.Data)
		return nil
	})
	if err != nil || res.ExitCode != 3 || len(data) != 1 || data[0] != "a" {
		t.Errorf("exit: %+v, %v, events %q", res, err, data)
	}
	ignore := func(CommandEvent[CommandResult, Supervisor]) error { return nil }
	if _, err := StreamCommand(context.Background(), sup, "/cut", nil, ignore); !errors.Is(err, ErrSupervisorStreamIncomplete) {
		t.Errorf("cut stream: %v", err)
	}
	api := &Transport[API]{BaseURL: srv.URL}
	_, err = StreamCommand(context.Background(), api, "/err", nil, func(CommandEvent[CommandResult, API]) error { return nil })
	if got, want := err.Error(), "agentbox: internal (200): broke (request r-2)"; got != want {
		t.Errorf("error event: %q, want %q", got, want)
	}
	if _, err := StreamCommand(context.Background(), api, "/cut", nil, func(CommandEvent[CommandResult, API]) error { return nil }); !errors.Is(err, ErrAPIStreamIncomplete) {
		t.Errorf("cut API stream: %v", err)
	}
}

// Transport failures name the call as each client did.
func TestTransportFailureMessages(t *testing.T) {
	srv := httptest.NewServer(http.NotFoundHandler())
	srv.Close()
	err := (&Transport[Supervisor]{BaseURL: srv.URL}).Do(context.Background(), http.MethodGet, "/healthz", nil, nil)
	if err == nil || !strings.HasPrefix(err.Error(), "supervisor GET /healthz: ") {
		t.Errorf("supervisor: %v", err)
	}
	err = (&Transport[API]{BaseURL: srv.URL}).Do(context.Background(), http.MethodPost, "/v1/x", []byte(`{}`), nil)
	if err == nil || !strings.HasPrefix(err.Error(), "POST /v1/x: ") {
		t.Errorf("API: %v", err)
	}
	err = (&Transport[API]{BaseURL: "http://h"}).Do(context.Background(), "BAD METHOD", "/x", nil, nil)
	if err == nil || !strings.HasPrefix(err.Error(), "build request: ") {
		t.Errorf("API build: %v", err)
	}
	err = (&Transport[Supervisor]{BaseURL: "http://h"}).Do(context.Background(), "BAD METHOD", "/x", nil, nil)
	if err == nil || !strings.HasPrefix(err.Error(), "supervisor request: ") {
		t.Errorf("supervisor build: %v", err)
	}
}
