package supervisor

import (
	"context"
	"fmt"
	"log/slog"
	"regexp"
)

// secretPatterns is the one list of secret formats kept out of the logs.
// Commands, paths and error messages can quote whatever an agent typed,
// and a token pasted into a command line must not end up in the pod's log
// stream, which is collected and kept far longer than the sandbox lives.
// Each pattern needs a case in TestRedactPatterns.
var secretPatterns = []struct {
	name string
	re   *regexp.Regexp
}{
	// AWS access key IDs: long-term (AKIA), temporary (ASIA) and the
	// rarer prefixes, with 16 base-32 characters after them.
	{"aws_access_key_id", regexp.MustCompile(`\b(?:AKIA|ASIA|ABIA|ACCA)[A-Z2-7]{16}\b`)},
	// GitHub's classic tokens: personal, OAuth, user-to-server,
	// server-to-server and refresh.
	{"github_token", regexp.MustCompile(`\bgh[pousr]_[A-Za-z0-9]{36,255}\b`)},
	{"github_fine_grained_pat", regexp.MustCompile(`\bgithub_pat_[A-Za-z0-9_]{22,255}`)},
	{"slack_token", regexp.MustCompile(`\bxox[abeoprs]-[A-Za-z0-9-]{10,}`)},
	// The Compute API's own tokens (computeapi.TokenPrefix, 32 random
	// bytes in unpadded base64url), which agents may well hand to code.
	{"agentbox_token", regexp.MustCompile(`\babx_[A-Za-z0-9_-]{43}\b`)},
	// Before bearer_token, so that a JWT in an Authorization header is
	// reported as a JWT.
	{"jwt", regexp.MustCompile(`\beyJ[A-Za-z0-9_-]{8,}\.eyJ[A-Za-z0-9_-]{8,}\.[A-Za-z0-9_-]*`)},
	{"bearer_token", regexp.MustCompile(`(?i)\bbearer\s+[A-Za-z0-9\-._~+/]{8,}=*`)},
	// The whole block, or everything after its header if the log line cut
	// it short.
	{"pem_private_key", regexp.MustCompile(`-----BEGIN[A-Z0-9 ]*PRIVATE KEY-----(?s:.*?)(?:-----END[A-Z0-9 ]*PRIVATE KEY-----|\z)`)},
}

// Redact replaces every match of a known secret format in s with
// [REDACTED:name].
func Redact(s string) string {
	for _, p := range secretPatterns {
		s = p.re.ReplaceAllLiteralString(s, "[REDACTED:"+p.name+"]")
	}
	return s
}

// NewRedactingHandler returns a handler that passes records to h with
// secrets redacted from the message and from every attribute, at any
// depth of groups. Errors, Stringers and other values are redacted in
// their printed form, which is how a text or JSON handler would show
// them anyway.
func NewRedactingHandler(h slog.Handler) slog.Handler { return &redactingHandler{h: h} }

type redactingHandler struct{ h slog.Handler }

func (r *redactingHandler) Enabled(ctx context.Context, l slog.Level) bool {
	return r.h.Enabled(ctx, l)
}

func (r *redactingHandler) Handle(ctx context.Context, rec slog.Record) error {
	out := slog.NewRecord(rec.Time, rec.Level, Redact(rec.Message), rec.PC)
	rec.Attrs(func(a slog.Attr) bool {
		out.AddAttrs(redactAttr(a))
		return true
	})
	return r.h.Handle(ctx, out)
}

func (r *redactingHandler) WithAttrs(attrs []slog.Attr) slog.Handler {
	red := make([]slog.Attr, len(attrs))
	for i, a := range attrs {
		red[i] = redactAttr(a)
	}
	return &redactingHandler{h: r.h.WithAttrs(red)}
}

func (r *redactingHandler) WithGroup(name string) slog.Handler {
	return &redactingHandler{h: r.h.WithGroup(name)}
}

func redactAttr(a slog.Attr) slog.Attr {
	a.Value = a.Value.Resolve()
	switch a.Value.Kind() {
	case slog.KindString:
		a.Value = slog.StringValue(Redact(a.Value.String()))
	case slog.KindGroup:
		group := a.Value.Group()
		red := make([]slog.Attr, len(group))
		for i, g := range group {
			red[i] = redactAttr(g)
		}
		a.Value = slog.GroupValue(red...)
	case slog.KindAny:
		var s string
		switch v := a.Value.Any().(type) {
		case error:
			s = v.Error()
		case fmt.Stringer:
			s = v.String()
		default:
			s = fmt.Sprint(v)
		}
		// Values with nothing to hide keep their type, so a handler can
		// still render a slice or map as structure.
		if red := Redact(s); red != s {
			a.Value = slog.StringValue(red)
		}
	}
	return a
}
