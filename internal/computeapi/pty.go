package computeapi

import (
	"context"
	"encoding/json"
	"errors"
	"net/http"
	"strconv"
	"strings"
	"sync"
	"time"

	"github.com/coder/websocket"

	api "github.com/agentbox/terraform-provider-agentbox/internal/computeapi/client"
	"github.com/agentbox/terraform-provider-agentbox/internal/supervisor/supervisorapi"
)

// Interactive terminals through the API: an agent's own PTY sessions
// (run_command_pty) and the staff console both relay the supervisor's
// agentbox.pty.v1 WebSocket frame for frame, so a client speaks the same
// protocol to either and the control plane never interprets terminal
// bytes beyond keeping a console's transcript. The one frame not relayed is
// the supervisor's audit message, which the API keeps.

// agentPTY opens a PTY session in the agent's sandbox (waking it) and
// relays it to the caller.
func (s *Server) agentPTY(w http.ResponseWriter, r *http.Request) {
	req, apiErr := ptyRequest(r)
	if apiErr != nil {
		writeError(w, apiErr)
		return
	}
	sup, log, apiErr := s.supervisorFor(r, "run_command_pty")
	if apiErr != nil {
		writeError(w, apiErr)
		return
	}
	upstream, err := sup.DialPTY(r.Context(), req)
	if err != nil {
		apiErr := supervisorError(r.Context(), err)
		s.logFailure(log, apiErr, err)
		writeError(w, apiErr)
		return
	}
	defer upstream.CloseNow()
	client, err := acceptPTY(w, r)
	if err != nil {
		return
	}
	defer client.CloseNow()
	relayPTY(r.Context(), client, upstream, nil, nil)
}

// ptyRequest reads what to run from the query, as the supervisor's
// GET /v1/pty takes it; the supervisor checks the command and cwd.
func ptyRequest(r *http.Request) (supervisorapi.PTYRequest, *api.Error) {
	q := r.URL.Query()
	req := supervisorapi.PTYRequest{Command: q["command"], Cwd: q.Get("cwd")}
	for _, kv := range q["env"] {
		k, v, ok := strings.Cut(kv, "=")
		if !ok || k == "" {
			return req, api.Errorf(api.CodeInvalidArgument, "env must be NAME=VALUE, got %q", kv)
		}
		if req.Env == nil {
			req.Env = map[string]string{}
		}
		req.Env[k] = v
	}
	for k, dst := range map[string]*uint16{"cols": &req.Cols, "rows": &req.Rows} {
		if v := q.Get(k); v != "" {
			n, err := strconv.ParseUint(v, 10, 16)
			if err != nil || n == 0 {
				return req, api.Errorf(api.CodeInvalidArgument, "%s must be a number from 1 to 65535, got %q", k, v)
			}
			*dst = uint16(n)
		}
	}
	return req, nil
}

// acceptPTY upgrades the caller's request. On an error Accept has
// answered the client.
func acceptPTY(w http.ResponseWriter, r *http.Request) (*websocket.Conn, error) {
	c, err := websocket.Accept(w, r, &websocket.AcceptOptions{Subprotocols: []string{supervisorapi.PTYSubprotocol}})
	if err != nil {
		return nil, err
	}
	if c.Subprotocol() != supervisorapi.PTYSubprotocol {
		// Frames of an unknown protocol would reach the supervisor as
		// keystrokes or malformed control messages.
		c.Close(websocket.StatusPolicyViolation, "the subprotocol "+supervisorapi.PTYSubprotocol+" is required")
		return nil, errors.New("subprotocol not negotiated")
	}
	c.SetReadLimit(2 * supervisorapi.PTYMaxInputFrame)
	return c, nil
}

// relayPTY copies frames both ways until either side ends or ctx ends,
// passing a closing side's code and reason on. input and output, if set,
// see the terminal bytes the client typed and the terminal showed (binary
// frames; the text frames are the protocol's resize and exit messages). A
// ctx that passes its deadline (a console's time box) closes both with a
// policy violation.
func relayPTY(ctx context.Context, client, upstream *websocket.Conn, input, output func([]byte)) {
	ctx, cancel := context.WithCancel(ctx)
	defer cancel()
	var wg sync.WaitGroup
	wg.Add(2)
	closeBoth := func(code websocket.StatusCode, reason string) {
		_ = client.Close(code, reason)
		_ = upstream.Close(code, reason)
	}
	relay := func(from, to *websocket.Conn, record func([]byte)) {
		defer wg.Done()
		defer cancel()
		for {
			typ, data, err := from.Read(ctx)
			if err == nil && from == upstream && typ == websocket.MessageText && keepPTYAudit(ctx, data) {
				// The supervisor's record of the session is the control
				// plane's to keep, not the client's to see.
				continue
			}
			if err != nil {
				if code := websocket.CloseStatus(err); code != -1 {
					var ce websocket.CloseError
					errors.As(err, &ce)
					closeBoth(code, ce.Reason)
				} else if errors.Is(ctx.Err(), context.DeadlineExceeded) {
					closeBoth(websocket.StatusPolicyViolation, "session expired")
				}
				return
			}
			if record != nil && typ == websocket.MessageBinary {
				record(data)
			}
			if err := to.Write(ctx, typ, data); err != nil {
				return
			}
		}
	}
	go relay(client, upstream, input)
	go relay(upstream, client, output)
	wg.Wait()
}

// keepPTYAudit reports whether data, a control message of a PTY session's
// supervisor, is its audit message, and hands the record to the API call
// the session is relayed for (see supervisoraudit.go).
func keepPTYAudit(ctx context.Context, data []byte) bool {
	var m supervisorapi.PTYMessage
	if json.Unmarshal(data, &m) != nil || m.Type != supervisorapi.PTYMessageAudit {
		return false
	}
	rec, raw, err := supervisorapi.DecodeAuditRecord(m.Audit)
	if err != nil {
		return true
	}
	if calls, ok := ctx.Value(supervisorCallsKey{}).(*supervisorCalls); ok {
		calls.add(supervisorRecord{rec: rec, raw: raw, at: time.Now()})
	}
	return true
}
