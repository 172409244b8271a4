// Package wire is the contract both HTTP surfaces of agentbox share: the
// Compute API (served by the control plane, called by the CLI, the
// Terraform provider and agents) and the sandbox supervisor (served in
// every sandbox, called by the control plane). It holds what crosses
// either wire in the same shape, written once: the error codes, the error
// body and its *Error type, the command request and result, the events of
// a streamed command, and the client transport (JSON calls, streamed
// bodies, error decoding and the NDJSON event reader).
//
// The packages that own each surface, computeapi/client and
// supervisor/supervisorapi, re-export these under their own names, so that
// a caller imports one contract package, and so that a field added here
// reaches both. Each side's *Error is Error instantiated with its Peer: the
// two stay distinct types (the control plane tells a supervisor's error
// from its own with errors.As) while sharing one definition.
//
// The package depends on the standard library and a WebSocket library
// only, so neither side links the other's code.
package wire
