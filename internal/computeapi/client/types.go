// Package client is the wire contract of the agentbox Compute API and a Go
// client for it. It depends on the standard library, a WebSocket library
// and the contract packages (wire, and supervisorapi for the terminal
// protocol the API relays) only, so that tools (the agentbox CLI, the
// Terraform provider, agents written in Go) can call the API without
// linking the control plane; the server imports these types so that both
// sides share one definition. What the API shares with the supervisor's
// contract (error codes and *Error, the command request and events, the
// client transport) is defined once in package wire and named here.
//
// The API is served over HTTPS by the control plane:
//
//	POST   /v1/agents/{agent_id}/run_command     RunCommandRequest -> CommandResult
//	POST   /v1/agents/{agent_id}/lease           AcquireLeaseRequest -> Lease
//	POST   /v1/agents/{agent_id}/lease/heartbeat HeartbeatLeaseRequest -> Lease
//	DELETE /v1/agents/{agent_id}/lease           ReleaseLeaseRequest -> 204 No Content
//	POST   /v1/namespaces/{namespace}/warm-pools/{pool}/leases
//	                                             AcquireLeaseRequest (with WaitSeconds) -> PoolLease
//	GET    /v1/agents/{agent_id}/status          -> SandboxStatus (never wakes the sandbox)
//	POST   /v1/agents/{agent_id}/deploy_or_resume DeployRequest (optional) -> SandboxStatus once it
//	                                             serves; creates the sandbox if the agent has none
//	PUT    /v1/agents/{agent_id}/files/{path}?mode=0644  raw bytes -> FileInfo
//	GET    /v1/agents/{agent_id}/files/{path}    -> raw bytes
//	DELETE /v1/agents/{agent_id}/files/{path}?recursive=true -> 204 No Content
//	POST   /v1/agents/{agent_id}/tools/{tool}    the tool's JSON input -> its JSON output
//	POST   /v1/agents/{agent_id}/execute         an execute request (code, requirements, files) -> its result
//	POST   /v1/agents/{agent_id}/mcp             MCP streamable HTTP (stateless): the sandbox's
//	                                             operations as MCP tools, for any MCP client
//	POST   /v1/agents/{agent_id}/mcp/{server}    a JSON-RPC request -> its response (wakes the sandbox)
//	GET    /v1/agents/{agent_id}/mcp/{server}/tools?refresh= -> MCPToolCatalog (cached; never wakes
//	                                             the sandbox unless refresh=true)
//	POST   /v1/runs                              StartRunRequest -> Run (202; 200 for a repeated request_id)
//	GET    /v1/runs?agent_id=&status=&since=&page_token=&limit= -> RunList
//	GET    /v1/runs/{run_id}                     -> Run
//	POST   /v1/runs/{run_id}/cancel              -> Run (200, also for a run that had finished)
//	POST   /v1/tokens                            CreateTokenRequest -> CreatedToken (admin)
//	DELETE /v1/tokens/{token_id}                 -> 204 No Content (admin)
//	GET    /v1/audit?agent_id=&caller=&operation=&since=&until=&cursor=&limit=&newest=
//	                                             -> AuditPage (admin)
//	GET    /v1/audit/verify                      -> AuditVerification (admin)
//
// A lease on an agent's sandbox makes it the holder's: while it is held,
// calls that do not present its lease ID in HeaderLeaseID are refused with
// CodeLeaseHeld. A lease from a warm pool hands the caller a ready sandbox
// of the pool for one ephemeral run, held the same way: heartbeat and
// release it through the agent paths with PoolLease.AgentID; once
// released or expired the sandbox is deleted with its workspace and the
// pool makes a fresh one. A pool lease with WaitSeconds waits for a ready
// sandbox when the pool has none free, or, for a pool with
// coldStartWhenExhausted, starts one for it.
//
// Every call carries "Authorization: Bearer <token>". Errors are JSON bodies
// {"error": {"code": ..., "message": ...}} whose HTTP status follows from
// the code (see Code.HTTPStatus).
package client

import (
	"encoding/json"
	"net/url"
	"strings"
	"time"

	"github.com/agentbox/terraform-provider-agentbox/internal/wire"
)

// PathRunCommand returns the path of run_command for an agent. The agent ID
// is escaped because it may contain characters such as ":" and "@".
func PathRunCommand(agentID string) string {
	return "/v1/agents/" + url.PathEscape(agentID) + "/run_command"
}

// PathLease returns the path of an agent's sandbox lease (acquire with POST,
// release with DELETE).
func PathLease(agentID string) string {
	return "/v1/agents/" + url.PathEscape(agentID) + "/lease"
}

// PathLeaseHeartbeat returns the path of the lease heartbeat for an agent.
func PathLeaseHeartbeat(agentID string) string { return PathLease(agentID) + "/heartbeat" }

// PathPoolLeases returns the path that leases a sandbox from a warm pool.
func PathPoolLeases(namespace, pool string) string {
	return "/v1/namespaces/" + url.PathEscape(namespace) + "/warm-pools/" + url.PathEscape(pool) + "/leases"
}

// HeaderLeaseID carries, on a call to an agent's sandbox, the lease ID of
// the hold the caller has on it. While a sandbox is held, the API serves
// only calls that present the hold's lease ID, whatever their token; any
// other call is refused with CodeLeaseHeld (HTTP 409), naming the holder
// and the expiry. A lease ID that is no longer held is ignored. The lease
// calls, status and the staff console are not refused (the console's
// audit record says it passed a hold). The Client sends the header for
// the leases it acquired; see Client.UseLease.
const HeaderLeaseID = "Agentbox-Lease-Id"

// HeaderUserToken carries the user token (a JWT from ExchangeToken) that
// an mcp_request passes on to the MCP server: the API verifies it for the
// agent and the server's audience and the server receives it in the
// request's params._meta under MetaUserToken. It is a header, never a
// tool argument, so that a model never sees it. A refused token is
// CodeInvalidUserToken. See WithUserToken.
const HeaderUserToken = "X-Agentbox-User-Token"

// MetaUserToken is the params._meta key under which a stdio MCP server
// receives the user token of a call.
const MetaUserToken = "agentbox.dev/user-token"

// Lease TTL bounds. A hold is kept alive by heartbeats, so the TTL is how
// long a crashed holder can keep the sandbox "busy"; an hour caps that.
const (
	DefaultLeaseTTLSeconds = 60
	MaxLeaseTTLSeconds     = 3600
)

// MaxPoolLeaseWaitSeconds bounds a pool lease's WaitSeconds: a call that
// waits longer than a cold start takes is better retried than held open
// through proxies and load balancers.
const MaxPoolLeaseWaitSeconds = 300

// AcquireLeaseRequest asks for the exclusive lease on the agent's sandbox:
// while it is held, only calls that present its lease ID (HeaderLeaseID)
// reach the sandbox. Acquiring is idempotent on (Holder, RequestID):
// retrying a request whose answer was lost returns the same lease instead
// of failing with CodeLeaseHeld against the caller's own hold.
type AcquireLeaseRequest struct {
	// Holder identifies who holds the lease (a user, a run); required.
	Holder string `json:"holder"`
	// RequestID makes the acquire idempotent; required.
	RequestID string `json:"request_id"`
	// TTLSeconds is how long the lease lasts without a heartbeat: 0 means
	// DefaultLeaseTTLSeconds; at most MaxLeaseTTLSeconds.
	TTLSeconds int `json:"ttl_seconds,omitempty"`
	// WaitSeconds applies to pool leases only (an agent's lease refuses
	// it): how long a lease that finds no ready sandbox free may wait for
	// one, at most MaxPoolLeaseWaitSeconds. 0 answers CodePoolExhausted at
	// once. Waiters of one control plane replica are served in the order
	// they came; a pool with coldStartWhenExhausted starts a sandbox for
	// the caller instead, and hands it out once it is ready. When the wait
	// runs out the answer is CodePoolExhausted; a retry with the same
	// Holder and RequestID picks up a cold start still under way.
	WaitSeconds int `json:"wait_seconds,omitempty"`
}

// HeartbeatLeaseRequest extends a held lease by its TTL from now.
type HeartbeatLeaseRequest struct {
	Holder  string `json:"holder"`
	LeaseID string `json:"lease_id"`
}

// ReleaseLeaseRequest gives a held lease up.
type ReleaseLeaseRequest struct {
	Holder  string `json:"holder"`
	LeaseID string `json:"lease_id"`
}

// Lease is a held lease on an agent's sandbox.
type Lease struct {
	// LeaseID names this hold; heartbeat and release must present it, so a
	// holder whose lease expired and was taken by someone else cannot
	// touch the new hold even if it reuses its holder name.
	LeaseID    string    `json:"lease_id"`
	Holder     string    `json:"holder"`
	RequestID  string    `json:"request_id"`
	TTLSeconds int       `json:"ttl_seconds"`
	AcquiredAt time.Time `json:"acquired_at"`
	RenewedAt  time.Time `json:"renewed_at"`
	// ExpiresAt is RenewedAt plus the TTL. Activity on the sandbox (any
	// Compute API call, renewed about every 30 s while a call such as a
	// terminal or a streamed command stays open) also moves RenewedAt, so
	// a hold whose sandbox is in use does not expire under it.
	ExpiresAt time.Time `json:"expires_at"`
}

// PoolLease is a lease on a sandbox taken from a warm pool. The sandbox is
// addressed like any agent's, by AgentID (a placeholder the pool gave it),
// for commands, heartbeats and the release.
type PoolLease struct {
	Lease
	AgentID   string `json:"agent_id"`
	Namespace string `json:"namespace"`
	Sandbox   string `json:"sandbox"`
}

// PathAgent returns the path of one of an agent's operations (status,
// deploy_or_resume, execute, ...).
func PathAgent(agentID, op string) string {
	return "/v1/agents/" + url.PathEscape(agentID) + "/" + op
}

// PathMCP returns the path of an agent's MCP endpoint (streamable HTTP):
// an MCP client connects to the API's endpoint followed by it, sending
// the bearer token on every request.
func PathMCP(agentID string) string { return PathAgent(agentID, "mcp") }

// PathFile returns the path of a workspace file of an agent's sandbox; each
// segment of the workspace path is escaped.
func PathFile(agentID, path string) string {
	segs := strings.Split(strings.TrimPrefix(path, "/"), "/")
	for i, s := range segs {
		segs[i] = url.PathEscape(s)
	}
	return PathAgent(agentID, "files/"+strings.Join(segs, "/"))
}

// DeployRequest is deploy_or_resume's body, which may be left out: the
// call resumes the agent's sandbox, or creates it when the agent has none.
type DeployRequest struct {
	// Template is the SandboxTemplate a missing sandbox is created from,
	// as "<namespace>/<name>"; the sandbox is created in the template's
	// namespace. Empty means the platform's default template (the chart's
	// computeApi.defaultTemplate). It is not looked at when the agent has
	// a sandbox. An agent's token may create its sandbox from the default
	// template only; an admin token may name any.
	Template string `json:"template,omitempty"`
	// RequestID names the create: a retry with the same ID is answered
	// with Created set, like the call that created the sandbox. Empty
	// means the call's X-Request-Id. Repeated and concurrent calls for one
	// agent get one sandbox whatever their IDs: its name derives from the
	// agent ID.
	RequestID string `json:"request_id,omitempty"`
}

// SandboxStatus is what status and deploy_or_resume report.
type SandboxStatus struct {
	AgentID   string `json:"agent_id"`
	Namespace string `json:"namespace"`
	Name      string `json:"name"`
	// Phase is Pending, Running, IdleStopping, Stopped, Resuming or Error.
	Phase string `json:"phase"`
	Ready bool   `json:"ready"`
	// Reason and Message are the Ready condition's.
	Reason   string        `json:"reason,omitempty"`
	Message  string        `json:"message,omitempty"`
	Snapshot *SnapshotInfo `json:"snapshot,omitempty"`
	// IdleStopBlocked is set while the sandbox is idle but not stopped
	// because its snapshot cannot be taken; it keeps serving meanwhile.
	IdleStopBlocked *IdleStopBlocked `json:"idle_stop_blocked,omitempty"`
	// Created is set by deploy_or_resume when the sandbox was created for
	// this call's request ID.
	Created bool `json:"created,omitempty"`
}

// SnapshotInfo is the latest snapshot the sandbox can resume from.
type SnapshotInfo struct {
	Name      string    `json:"name"`
	SizeBytes int64     `json:"size_bytes,omitempty"`
	ReadyAt   time.Time `json:"ready_at,omitzero"`
	// Driver took the snapshot: "volumesnapshot", "archive/s3" or
	// "archive/embedded"; empty for snapshots from before it was recorded.
	Driver string `json:"driver,omitempty"`
	// Checkpoint: a periodic checkpoint of the running sandbox, not an
	// idle stop's snapshot; changes made after ReadyAt are not in it.
	Checkpoint bool `json:"checkpoint,omitempty"`
}

// IdleStopBlocked says why idle stops of a sandbox do not happen: the
// reason and message of its IdleStopBlocked condition, and, after failed
// attempts, how many failed in a row and when the next one is due.
type IdleStopBlocked struct {
	Reason        string    `json:"reason"`
	Message       string    `json:"message"`
	Failures      int       `json:"failures,omitempty"`
	NextAttemptAt time.Time `json:"next_attempt_at,omitzero"`
}

// FileInfo describes a file written to a workspace.
type FileInfo struct {
	Path string `json:"path"`
	Size int64  `json:"size"`
	Mode string `json:"mode"`
}

// Staff console paths: POST PathConsoleSessions mints a session (staff
// token); GET PathConsoleSession reads it back (its staff member or an
// admin); GET PathConsolePTY?cols=&rows= opens its terminal, a WebSocket
// of subprotocol "agentbox.pty.v1" (the supervisor's PTY protocol:
// binary frames are terminal bytes, text frames JSON resize and exit
// messages), once.
const PathConsoleSessions = "/v1/console/sessions"

// PathConsoleSession returns the path of one console session.
func PathConsoleSession(id string) string { return PathConsoleSessions + "/" + url.PathEscape(id) }

// PathConsolePTY returns the path of a console session's terminal.
func PathConsolePTY(id string) string { return PathConsoleSession(id) + "/pty" }

// CreateConsoleSessionRequest asks for a staff console on an agent's
// sandbox. Reason is required and recorded.
type CreateConsoleSessionRequest struct {
	AgentID string `json:"agent_id"`
	Reason  string `json:"reason"`
	// TTLSeconds is how long the session may be used; 0 means 900, at most
	// 3600. The terminal closes when it passes.
	TTLSeconds int `json:"ttl_seconds,omitempty"`
}

// ConsoleSession is a staff console session as recorded.
type ConsoleSession struct {
	ID             string     `json:"id"`
	StaffID        string     `json:"staff_id"`
	AgentID        string     `json:"agent_id"`
	Reason         string     `json:"reason"`
	CreatedAt      time.Time  `json:"created_at"`
	ExpiresAt      time.Time  `json:"expires_at"`
	ConnectedAt    *time.Time `json:"connected_at,omitempty"`
	DisconnectedAt *time.Time `json:"disconnected_at,omitempty"`
	// SnapshotID is the sandbox's latest snapshot when the terminal opened.
	SnapshotID string `json:"snapshot_id,omitempty"`
	// Transcript is the terminal's output (which echoes what was typed),
	// up to the store's cap; only GET of the session returns it.
	Transcript []byte `json:"transcript,omitempty"`
	// TranscriptRecords are the terminal's bytes both ways, in the order
	// they were recorded: what the staff member typed (TranscriptInput)
	// and what the terminal showed (TranscriptOutput). Known secret
	// formats are redacted from both. Only GET of the session returns
	// them.
	TranscriptRecords   []TranscriptRecord `json:"transcript_records,omitempty"`
	TranscriptTruncated bool               `json:"transcript_truncated,omitempty"`
}

// Directions of a TranscriptRecord.
const (
	TranscriptInput  = "in"
	TranscriptOutput = "out"
)

// TranscriptRecord is a run of a console's terminal bytes in one
// direction.
type TranscriptRecord struct {
	// Direction is TranscriptInput or TranscriptOutput.
	Direction string    `json:"direction"`
	At        time.Time `json:"at"`
	Data      []byte    `json:"data"`
}

// MCPToolCatalog is the tool list of one of a sandbox's stdio MCP servers,
// as cached by the control plane (GET /v1/agents/{id}/mcp/{server}/tools).
type MCPToolCatalog struct {
	Server string `json:"server"`
	// ConfigHash keys the cache: the server's configuration and the image.
	ConfigHash  string    `json:"config_hash"`
	RefreshedAt time.Time `json:"refreshed_at"`
	// Discovered is true when this call asked the running sandbox rather
	// than answering from the cache.
	Discovered bool `json:"discovered,omitempty"`
	// Tools is the server's tools/list result: MCP Tool objects.
	Tools json.RawMessage `json:"tools"`
}

// Paths of the admin endpoints.
const (
	PathTokens      = "/v1/tokens"
	PathAudit       = "/v1/audit"
	PathAuditVerify = "/v1/audit/verify"
)

// PathToken returns the path of one token, for revoking it.
func PathToken(id string) string { return PathTokens + "/" + url.PathEscape(id) }

// Token kinds.
const (
	// TokenKindAgent addresses the sandbox of AgentID only.
	TokenKindAgent = "agent"
	// TokenKindAdmin addresses every sandbox and manages tokens and audit.
	TokenKindAdmin = "admin"
	// TokenKindStaff mints time-boxed console sessions.
	TokenKindStaff = "staff"
	// TokenKindExchange acts for users: it exchanges a user's identity for
	// user tokens (POST /v1/token) and revokes them, and addresses no
	// sandbox.
	TokenKindExchange = "exchange"
)

// CreateTokenRequest asks for a new API token.
type CreateTokenRequest struct {
	// Kind is TokenKindAgent, TokenKindAdmin, TokenKindStaff or
	// TokenKindExchange.
	Kind string `json:"kind"`
	// AgentID binds an agent token; required for agent tokens, refused for
	// the others.
	AgentID string `json:"agent_id,omitempty"`
	// Subject says who holds the token (a staff id, a service); it shows
	// in the audit log.
	Subject string `json:"subject,omitempty"`
	// TTLSeconds bounds the token's life; 0 means it does not expire, and
	// it is at most 366 days (31622400).
	TTLSeconds int64 `json:"ttl_seconds,omitempty"`
}

// CreatedToken is a new token. Token is shown only here: the control plane
// keeps its SHA-256 alone.
type CreatedToken struct {
	ID        string     `json:"id"`
	Token     string     `json:"token"`
	Kind      string     `json:"kind"`
	AgentID   string     `json:"agent_id,omitempty"`
	Subject   string     `json:"subject,omitempty"`
	CreatedAt time.Time  `json:"created_at"`
	ExpiresAt *time.Time `json:"expires_at,omitempty"`
}

// AuditRecord is one call in the audit log.
type AuditRecord struct {
	Seq        int64     `json:"seq"`
	Time       time.Time `json:"time"`
	Caller     string    `json:"caller"`
	CallerKind string    `json:"caller_kind"`
	AgentID    string    `json:"agent_id,omitempty"`
	Operation  string    `json:"operation"`
	// ParamsHash is the hex SHA-256 of the request's query and body.
	ParamsHash string `json:"params_hash"`
	DurationMS int64  `json:"duration_ms"`
	// Result is "ok" or the error code the call answered with.
	Result    string `json:"result"`
	Status    int    `json:"status"`
	RequestID string `json:"request_id,omitempty"`
	// Detail is what the call added for a reviewer, a JSON object: for
	// example "lease_bypassed" (the holder and expiry of a hold the staff
	// console passed). The records whose Operation starts with
	// "supervisor:" are the sandbox supervisor's own record of a call it
	// served, which came back with its answer; Detail is that record as the
	// supervisor sent it. Known secret formats are redacted from it.
	Detail string `json:"detail,omitempty"`
	// Hash chains the record to PrevHash (hex SHA-256).
	Hash     string `json:"hash"`
	PrevHash string `json:"prev_hash"`
}

// AuditPage is one page of audit records; Next is the cursor of the
// following page, 0 when there is none.
type AuditPage struct {
	Records []AuditRecord `json:"records"`
	Next    int64         `json:"next,omitempty"`
}

// AuditVerification is the result of walking the audit chain.
type AuditVerification struct {
	OK      bool   `json:"ok"`
	Records int64  `json:"records"`
	Head    string `json:"head"`
	// Break is the first record that cannot be trusted, when !OK.
	Break *AuditBreak `json:"break,omitempty"`
}

// AuditBreak describes where the audit chain is broken.
type AuditBreak struct {
	Seq    int64  `json:"seq"`
	Kind   string `json:"kind"`
	Detail string `json:"detail"`
}

// RunCommandRequest runs Command[0] with arguments Command[1:] in the
// agent's sandbox; see wire.CommandRequest. It is the supervisor's command
// request, which the API passes on as it came.
type RunCommandRequest = wire.CommandRequest

// CommandResult is the outcome of a command that was started. A non-zero
// exit, a signal or a timeout is a result, not an error.
//
// Its fields are exactly the supervisor's (wire.CommandResult), and the API
// converts one to the other, so a field added to either and not the other
// does not compile. It is a type of its own only because the API always
// sends out_of_memory, as its OpenAPI document requires, while the
// supervisor sends it only when set.
type CommandResult struct {
	// Stdout and Stderr are UTF-8; invalid bytes are replaced by U+FFFD.
	Stdout string `json:"stdout"`
	Stderr string `json:"stderr"`
	// ExitCode is -1 when the process was ended by a signal.
	ExitCode int `json:"exit_code"`
	// Signal names the signal that ended the process, e.g. "SIGKILL".
	Signal   string `json:"signal"`
	TimedOut bool   `json:"timed_out"`
	// OutOfMemory means the sandbox's supervisor killed the command because
	// the sandbox neared its memory limit and this command held the most
	// memory (Signal is then SIGKILL). The sandbox itself lives on.
	OutOfMemory bool  `json:"out_of_memory"`
	Truncated   bool  `json:"truncated"`
	DurationMS  int64 `json:"duration_ms"`
}
