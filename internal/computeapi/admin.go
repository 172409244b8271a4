package computeapi

import (
	"crypto/rand"
	"encoding/base64"
	"encoding/hex"
	"errors"
	"net/http"
	"strconv"
	"time"

	api "github.com/agentbox/terraform-provider-agentbox/internal/computeapi/client"
	"github.com/agentbox/terraform-provider-agentbox/internal/store"
)

// TokenPrefix starts every token the API mints, so that secret scanners
// and log redaction can recognise them.
const TokenPrefix = "abx_"

// maxTokenTTL bounds a minted token's life; long-lived credentials belong
// in a secret manager that can rotate them, not in a ten-year token.
const maxTokenTTL = 366 * 24 * time.Hour

// maxAuditPage bounds one page of /v1/audit.
const maxAuditPage = 1000

// admin checks that the caller holds an admin token and that the store the
// endpoint needs is configured.
func (s *Server) admin(r *http.Request) *api.Error {
	if p := PrincipalFrom(r.Context()); p == nil || !p.AllAgents {
		return api.Errorf(api.CodePermissionDenied, "this endpoint needs an admin token")
	}
	if s.store == nil {
		return api.Errorf(api.CodeUnavailable, "the control plane runs without a store, which tokens and the audit log live in")
	}
	return nil
}

func (s *Server) createToken(w http.ResponseWriter, r *http.Request) {
	if apiErr := s.admin(r); apiErr != nil {
		writeError(w, apiErr)
		return
	}
	var req api.CreateTokenRequest
	if apiErr := s.decode(w, r, &req); apiErr != nil {
		writeError(w, apiErr)
		return
	}
	kind := store.TokenKind(req.Kind)
	switch {
	case kind != store.TokenAgent && kind != store.TokenAdmin && kind != store.TokenStaff && kind != store.TokenExchange:
		writeError(w, api.Errorf(api.CodeInvalidArgument, "kind must be %q, %q, %q or %q, got %q",
			api.TokenKindAgent, api.TokenKindAdmin, api.TokenKindStaff, api.TokenKindExchange, req.Kind))
		return
	case (kind == store.TokenAgent) != (req.AgentID != ""):
		writeError(w, api.Errorf(api.CodeInvalidArgument, "agent_id is required for agent tokens and refused for the others"))
		return
	case req.TTLSeconds < 0 || req.TTLSeconds > int64(maxTokenTTL/time.Second):
		// Compared in seconds: multiplied into a Duration first, a large
		// value wraps around to a short or negative lifetime.
		writeError(w, api.Errorf(api.CodeInvalidArgument, "ttl_seconds must be between 0 (no expiry) and %d, got %d",
			int64(maxTokenTTL/time.Second), req.TTLSeconds))
		return
	}
	secret := make([]byte, 32)
	if _, err := rand.Read(secret); err != nil {
		s.log.Error(err, "read random token")
		writeError(w, api.Errorf(api.CodeInternal, "could not create a token"))
		return
	}
	token := TokenPrefix + base64.RawURLEncoding.EncodeToString(secret)
	t := store.Token{Hash: store.TokenHash(HashToken(token)), Kind: kind, AgentID: req.AgentID, Subject: req.Subject}
	if req.TTLSeconds > 0 {
		exp := s.clock.Now().Add(time.Duration(req.TTLSeconds) * time.Second)
		t.ExpiresAt = &exp
	}
	t, err := s.store.CreateToken(r.Context(), t)
	if errors.Is(err, store.ErrInvalid) {
		writeError(w, api.Errorf(api.CodeInvalidArgument, "%v", err))
		return
	}
	if err != nil {
		s.log.Error(err, "create token")
		writeError(w, api.Errorf(api.CodeInternal, "could not store the token"))
		return
	}
	writeJSON(w, http.StatusCreated, api.CreatedToken{ID: t.ID, Token: token, Kind: string(t.Kind), AgentID: t.AgentID,
		Subject: t.Subject, CreatedAt: t.CreatedAt, ExpiresAt: t.ExpiresAt})
}

func (s *Server) revokeToken(w http.ResponseWriter, r *http.Request) {
	if apiErr := s.admin(r); apiErr != nil {
		writeError(w, apiErr)
		return
	}
	err := s.store.RevokeToken(r.Context(), r.PathValue("token_id"))
	if err != nil && !errors.Is(err, store.ErrNotFound) {
		s.log.Error(err, "revoke token")
		writeError(w, api.Errorf(api.CodeInternal, "could not revoke the token"))
		return
	}
	if errors.Is(err, store.ErrNotFound) {
		writeError(w, api.Errorf(api.CodeNotFound, "no token %q", r.PathValue("token_id")))
		return
	}
	w.WriteHeader(http.StatusNoContent)
}

func (s *Server) queryAudit(w http.ResponseWriter, r *http.Request) {
	if apiErr := s.admin(r); apiErr != nil {
		writeError(w, apiErr)
		return
	}
	q, apiErr := auditQuery(r)
	if apiErr != nil {
		writeError(w, apiErr)
		return
	}
	page, err := s.store.QueryAudit(r.Context(), q)
	if err != nil {
		s.log.Error(err, "query audit log")
		writeError(w, api.Errorf(api.CodeInternal, "could not read the audit log"))
		return
	}
	out := api.AuditPage{Records: make([]api.AuditRecord, len(page.Records)), Next: page.Next}
	for i, rec := range page.Records {
		out.Records[i] = api.AuditRecord{Seq: rec.Seq, Time: rec.Time, Caller: rec.Caller, CallerKind: rec.CallerKind,
			AgentID: rec.AgentID, Operation: rec.Operation, ParamsHash: rec.ParamsHash, DurationMS: rec.Duration.Milliseconds(),
			Result: rec.Result, Status: rec.Status, RequestID: rec.RequestID, Detail: rec.Detail,
			Hash: hex.EncodeToString(rec.Hash), PrevHash: hex.EncodeToString(rec.PrevHash)}
	}
	writeJSON(w, http.StatusOK, out)
}

// auditQuery reads /v1/audit's query parameters, refusing unknown ones so
// that a misspelt filter does not silently return everything.
func auditQuery(r *http.Request) (store.AuditQuery, *api.Error) {
	var q store.AuditQuery
	for k, vs := range r.URL.Query() {
		v := vs[len(vs)-1]
		var err error
		switch k {
		case "agent_id":
			q.AgentID = v
		case "caller":
			q.Caller = v
		case "operation":
			q.Operation = v
		case "since":
			q.Since, err = time.Parse(time.RFC3339Nano, v)
		case "until":
			q.Until, err = time.Parse(time.RFC3339Nano, v)
		case "cursor":
			q.Cursor, err = strconv.ParseInt(v, 10, 64)
		case "limit":
			q.Limit, err = strconv.Atoi(v)
			if err == nil && (q.Limit < 1 || q.Limit > maxAuditPage) {
				return q, api.Errorf(api.CodeInvalidArgument, "limit must be between 1 and %d", maxAuditPage)
			}
		case "newest":
			q.Newest, err = strconv.ParseBool(v)
		default:
			return q, api.Errorf(api.CodeInvalidArgument, "unknown query parameter %q (known: agent_id, caller, operation, since, until, cursor, limit, newest)", k)
		}
		if err != nil {
			return q, api.Errorf(api.CodeInvalidArgument, "query parameter %s=%q: %v", k, v, err)
		}
	}
	return q, nil
}

func (s *Server) verifyAudit(w http.ResponseWriter, r *http.Request) {
	if apiErr := s.admin(r); apiErr != nil {
		writeError(w, apiErr)
		return
	}
	rep, err := s.store.VerifyAudit(r.Context())
	if err != nil {
		s.log.Error(err, "verify audit log")
		writeError(w, api.Errorf(api.CodeInternal, "could not read the audit log"))
		return
	}
	out := api.AuditVerification{OK: rep.OK(), Records: rep.Records, Head: rep.Head.String()}
	if b := rep.Break; b != nil {
		out.Break = &api.AuditBreak{Seq: b.Seq, Kind: string(b.Kind), Detail: b.Detail}
	}
	writeJSON(w, http.StatusOK, out)
}
