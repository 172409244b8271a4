package computeapi

import (
	"context"
	"net/http"
	"net/url"
	"strings"
	"sync"
	"time"

	"sigs.k8s.io/controller-runtime/pkg/client"

	"github.com/agentbox/terraform-provider-agentbox/internal/api/v1alpha1"
	"github.com/agentbox/terraform-provider-agentbox/internal/store"
	"github.com/agentbox/terraform-provider-agentbox/internal/supervisor/supervisorapi"
)

// The supervisor's own records.
//
// Every answer of a supervisor carries its record of the call
// (supervisorapi.AuditRecord): the record leaves the sandbox as it is
// made, so nothing that runs in the sandbox afterwards can alter it. The
// SupervisorPool's transport hands each one to the Server, which appends
// it to the store's hash-chained audit log:
//
//   - for a supervisor call made while serving an API call, right after
//     the API's own record of that call, with its caller, agent and request
//     ID (which the supervisor was sent and recorded too);
//   - for one made outside any API call (the controller's idle-stop flush
//     and sync, the filespace push after calls), at once, with the caller
//     "control-plane" of kind "system" and the agent whose sandbox it is.
//
// The stored record's operation is "supervisor:" and the supervisor's tool
// name (supervisor:run_command, supervisor:read_file, ...); its time is
// when the control plane got it; its detail is the supervisor's record,
// the JSON exactly as the supervisor sent it. What the supervisor says is
// the sandbox's word: a sandbox whose code has taken over its supervisor
// can lie in the records it makes from then on, but not change those it
// made before.

const (
	supervisorOpPrefix = "supervisor:"
	// The caller of a supervisor call no API call made.
	controlPlaneCaller = "control-plane"
	callerKindSystem   = "system"
	// maxSupervisorField bounds the fields taken from a record (untrusted
	// text) into the stored record's own columns.
	maxSupervisorField = 128
)

type supervisorCallsKey struct{}

// supervisorCalls collects the supervisor records of one API call, to be
// appended after the call's own record.
type supervisorCalls struct {
	mu   sync.Mutex
	recs []supervisorRecord
	// done is set once the call's own record is made; call is that record.
	done bool
	call store.AuditEntry
}

type supervisorRecord struct {
	rec supervisorapi.AuditRecord
	raw []byte
	at  time.Time
}

// withSupervisorCalls makes r collect the records of the supervisor calls
// made while serving it.
func withSupervisorCalls(r *http.Request) (*http.Request, *supervisorCalls) {
	c := &supervisorCalls{}
	return r.WithContext(context.WithValue(r.Context(), supervisorCallsKey{}, c)), c
}

// add keeps rec for the call's end; after it, it returns false and the
// call's own record, for the caller to append rec with.
func (c *supervisorCalls) add(r supervisorRecord) (store.AuditEntry, bool) {
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.done {
		return c.call, false
	}
	c.recs = append(c.recs, r)
	return store.AuditEntry{}, true
}

// finish records that call is the API call's own record and returns the
// supervisor records collected so far, as stored records.
func (c *supervisorCalls) finish(call store.AuditEntry) []store.AuditEntry {
	c.mu.Lock()
	defer c.mu.Unlock()
	c.done, c.call = true, call
	out := make([]store.AuditEntry, len(c.recs))
	for i, r := range c.recs {
		out[i] = supervisorEntry(call, r)
	}
	c.recs = nil
	return out
}

// supervisorEntry is the stored record of r, made for the API call call
// (whose caller, agent and request ID it takes).
func supervisorEntry(call store.AuditEntry, r supervisorRecord) store.AuditEntry {
	e := store.AuditEntry{
		Time:       r.at,
		Caller:     call.Caller,
		CallerKind: call.CallerKind,
		AgentID:    call.AgentID,
		Operation:  supervisorOpPrefix + cleanField(r.rec.Tool),
		ParamsHash: paramsHash(r.rec.ParamsSHA256),
		Duration:   time.Duration(max(r.rec.DurationMS, 0)) * time.Millisecond,
		Status:     r.rec.HTTPStatus,
		RequestID:  call.RequestID,
		// Valid UTF-8 JSON (DecodeAuditRecord checks), so the store takes
		// it: a record it refused would hold up the whole audit log.
		Detail: string(r.raw),
	}
	switch {
	case r.rec.ErrorCode != "":
		e.Result = cleanField(r.rec.ErrorCode)
	case r.rec.HTTPStatus >= 400:
		e.Result = "error"
	default:
		e.Result = resultOK
	}
	return e
}

// paramsHash is h if it is a hex SHA-256, as every record's is, else "".
func paramsHash(h string) string {
	if len(h) != 64 || strings.Trim(h, "0123456789abcdef") != "" {
		return ""
	}
	return h
}

// cleanField makes text from a sandbox fit for a column of the store.
func cleanField(s string) string {
	s = strings.ToValidUTF8(strings.ReplaceAll(s, "\x00", ""), "")
	if len(s) > maxSupervisorField {
		s = strings.ToValidUTF8(s[:maxSupervisorField], "")
	}
	return s
}

// recordSupervisor is the Server's supervisors.AuditSink.Record.
func (s *Server) recordSupervisor(ctx context.Context, peer string, rec supervisorapi.AuditRecord, raw []byte) {
	r := supervisorRecord{rec: rec, raw: raw, at: s.clock.Now()}
	if calls, ok := ctx.Value(supervisorCallsKey{}).(*supervisorCalls); ok {
		call, kept := calls.add(r)
		if !kept {
			// A supervisor call that outlived the API call that made it.
			s.audit.tryRecord(supervisorEntry(call, r))
		}
		return
	}
	call := store.AuditEntry{Caller: controlPlaneCaller, CallerKind: callerKindSystem,
		AgentID: s.agentOfSupervisor(ctx, peer), RequestID: cleanField(rec.RequestID)}
	s.audit.tryRecord(supervisorEntry(call, r))
}

// invalidSupervisorRecord is the Server's supervisors.AuditSink.Invalid.
func (s *Server) invalidSupervisorRecord(_ context.Context, peer string, err error) {
	s.log.Info("a supervisor answered with an audit record that cannot be read", "supervisor", peer, "error", err.Error())
}

// agentOfSupervisor is the agent whose sandbox's supervisor has the
// identity peer (pki.SandboxID), or "" if it cannot be told.
func (s *Server) agentOfSupervisor(ctx context.Context, peer string) string {
	u, err := url.Parse(peer)
	if err != nil {
		return ""
	}
	seg := strings.Split(strings.TrimPrefix(u.Path, "/"), "/")
	if len(seg) != 4 || seg[0] != "ns" || seg[2] != "sandbox" {
		return ""
	}
	ctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), 5*time.Second)
	defer cancel()
	var list v1alpha1.SandboxList
	if err := s.sandboxes.List(ctx, &list, client.InNamespace(seg[1])); err != nil {
		return ""
	}
	for _, sb := range list.Items {
		if sb.WorkloadName() == seg[3] {
			return sb.Spec.AgentID
		}
	}
	return ""
}
