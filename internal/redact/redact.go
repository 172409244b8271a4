// Package redact recognises secrets in text and replaces them with
// [REDACTED:<kind>]: the platform's own API tokens, common API key shapes,
// bearer tokens and PEM private keys. It is for what the platform keeps or
// shows to people other than the agent (audit records, console
// transcripts, logs), never for what a command hands back to its caller.
//
// String and Bytes redact a whole text; Stream redacts text that arrives
// in pieces, so that a secret split between two pieces is caught as well;
// Logger (logr, the control plane's) and SlogHandler (slog, the
// supervisor's) redact what a program logs.
// The package depends on the standard library and logr only, so that any
// part of the platform can use the one list of formats.
package redact

import (
	"bytes"
	"regexp"
)

// pattern is one secret format. Each needs a case in TestPatterns.
type pattern struct {
	name string
	re   *regexp.Regexp
}

// patterns is the one list of secret formats. Order matters where formats
// overlap: the first to match names the secret.
var patterns = []pattern{
	// AWS access key IDs: long-term (AKIA), temporary (ASIA) and the
	// rarer prefixes, with 16 base-32 characters after them.
	{"aws_access_key_id", regexp.MustCompile(`\b(?:AKIA|ASIA|ABIA|ACCA)[A-Z2-7]{16}\b`)},
	// GitHub's classic tokens: personal, OAuth, user-to-server,
	// server-to-server and refresh.
	{"github_token", regexp.MustCompile(`\bgh[pousr]_[A-Za-z0-9]{36,255}\b`)},
	{"github_fine_grained_pat", regexp.MustCompile(`\bgithub_pat_[A-Za-z0-9_]{22,255}`)},
	{"slack_token", regexp.MustCompile(`\bxox[abeoprs]-[A-Za-z0-9-]{10,}`)},
	// OpenAI's and Anthropic's keys and the many services that copied
	// their shape: sk-, sk-proj-, sk-ant-api03-, ... The length keeps
	// ordinary hyphenated words such as sk-learn out.
	{"sk_api_key", regexp.MustCompile(`\bsk-[A-Za-z0-9][A-Za-z0-9_-]{19,}`)},
	// The Compute API's own tokens (abx_ and 32 random bytes in unpadded
	// base64url), which agents may well hand to code.
	{"agentbox_token", regexp.MustCompile(`\babx_[A-Za-z0-9_-]{43}\b`)},
	// Before bearer_token, so that a JWT in an Authorization header is
	// reported as a JWT.
	{"jwt", regexp.MustCompile(`\beyJ[A-Za-z0-9_-]{8,}\.eyJ[A-Za-z0-9_-]{8,}\.[A-Za-z0-9_-]*`)},
	{"bearer_token", regexp.MustCompile(`(?i)\bbearer\s+[A-Za-z0-9\-._~+/]{8,}=*`)},
	// The whole block, or everything after its header if the text ends
	// before the block does.
	{"pem_private_key", regexp.MustCompile(`-----BEGIN[A-Z0-9 ]*PRIVATE KEY-----(?s:.*?)(?:-----END[A-Z0-9 ]*PRIVATE KEY-----|\z)`)},
}

// Placeholder is what a secret of the named kind is replaced with.
func Placeholder(kind string) string { return "[REDACTED:" + kind + "]" }

// String replaces every match of a known secret format in s with
// Placeholder(kind).
func String(s string) string {
	for _, p := range patterns {
		s = p.re.ReplaceAllLiteralString(s, Placeholder(p.name))
	}
	return s
}

// Bytes is String for bytes. It returns b itself when nothing matched.
func Bytes(b []byte) []byte {
	out := b
	for _, p := range patterns {
		if p.re.Match(out) {
			out = p.re.ReplaceAllLiteral(out, []byte(Placeholder(p.name)))
		}
	}
	return out
}

// Stream redacts text that arrives in pieces, such as a terminal's output
// written to a transcript a chunk at a time. Write returns what can be
// passed on: redacted, without the end of the text that may be the start
// of a secret still arriving, which it holds back; Flush returns that at
// the end. What a Stream lets through, taken together, is what String
// makes of the whole text. A private key block is replaced by one
// placeholder as soon as its header is seen, and the rest of it up to its
// END line is dropped as it comes. The zero value is ready to use; a
// Stream is not safe for concurrent use.
type Stream struct {
	held []byte
	// inKey is set inside a private key block whose END line is still
	// to come.
	inKey bool
}

const (
	// maxHeld bounds what is held back of a word-like run at the end: no
	// single-line secret format above is that long, and holding more
	// would delay a transcript for nothing.
	maxHeld = 8 << 10
	// endTail is what is kept of a private key's body while its END line
	// is awaited: enough for the longest END line, split anywhere.
	endTail = 64
)

var (
	pemHeader = regexp.MustCompile(`-----BEGIN[A-Z0-9 ]*PRIVATE KEY-----`)
	pemEnd    = regexp.MustCompile(`-----END[A-Z0-9 ]*PRIVATE KEY-----`)
	// pemPartial is a private key header that the text ends in the middle
	// of.
	pemPartial = regexp.MustCompile(`-----BEGIN[A-Z0-9 ]*-{0,4}\z`)
)

// Write takes the next piece of the text and returns what of the text so
// far is final, redacted. The result does not alias p.
func (s *Stream) Write(p []byte) []byte {
	buf := make([]byte, 0, len(s.held)+len(p))
	buf = append(append(buf, s.held...), p...)
	s.held = nil
	var out []byte
	for {
		if s.inKey {
			loc := pemEnd.FindIndex(buf)
			if loc == nil {
				s.held = bytes.Clone(buf[max(0, len(buf)-endTail):])
				return out
			}
			buf, s.inKey = buf[loc[1]:], false
		}
		h := openKey(buf)
		if h == nil {
			break
		}
		out = append(out, Bytes(buf[:h[0]])...)
		out = append(out, Placeholder("pem_private_key")...)
		buf, s.inKey = buf[h[1]:], true
	}
	cut := safeCut(buf)
	if len(buf)-cut > maxHeld {
		cut = len(buf)
	}
	out = append(out, Bytes(buf[:cut])...)
	s.held = bytes.Clone(buf[cut:])
	return out
}

// Flush returns what Write held back, redacted, and resets the Stream.
// The remains of a private key block that never ended are dropped.
func (s *Stream) Flush() []byte {
	held, inKey := s.held, s.inKey
	s.held, s.inKey = nil, false
	if inKey {
		return nil
	}
	return bytes.Clone(Bytes(held))
}

// Pending is how many bytes Write is holding back.
func (s *Stream) Pending() int { return len(s.held) }

// openKey returns the header of the last private key block in b if no END
// line follows it.
func openKey(b []byte) []int {
	all := pemHeader.FindAllIndex(b, -1)
	if len(all) == 0 {
		return nil
	}
	last := all[len(all)-1]
	if pemEnd.Match(b[last[1]:]) {
		return nil
	}
	return last
}

// secretByte reports whether c can be part of a single-line secret of the
// formats above (base64, base64url, JWT and bearer token characters).
func secretByte(c byte) bool {
	switch {
	case 'a' <= c && c <= 'z', 'A' <= c && c <= 'Z', '0' <= c && c <= '9':
		return true
	}
	return c == '-' || c == '_' || c == '.' || c == '+' || c == '/' || c == '=' || c == '~'
}

func wordByte(c byte) bool {
	return 'a' <= c && c <= 'z' || 'A' <= c && c <= 'Z' || '0' <= c && c <= '9' || c == '_'
}

// safeCut returns where the final part of b ends: before the run of
// secret characters b ends with (more of it may follow), before a
// "Bearer " that run follows, before a private key header b ends in the
// middle of, and before any secret that reaches past that point.
func safeCut(b []byte) int {
	cut := len(b)
	for cut > 0 && secretByte(b[cut-1]) {
		cut--
	}
	// A bearer token's scheme: without it the token would not be
	// recognised once it is complete.
	j := cut
	for j > 0 && (b[j-1] == ' ' || b[j-1] == '\t' || b[j-1] == '\r' || b[j-1] == '\n' || b[j-1] == '\f') {
		j--
	}
	const scheme = "bearer"
	if n := len(scheme); j < cut && j >= n && bytes.EqualFold(b[j-n:j], []byte(scheme)) && (j == n || !wordByte(b[j-n-1])) {
		cut = j - n
	}
	if loc := pemPartial.FindIndex(b); loc != nil && loc[0] < cut {
		cut = loc[0]
	}
	// Whatever a format matches across the cut is held back whole, so
	// that it is matched whole once it has ended.
	for moved := true; moved; {
		moved = false
		for _, p := range patterns {
			for _, m := range p.re.FindAllIndex(b, -1) {
				if m[0] < cut && cut < m[1] {
					cut, moved = m[0], true
				}
			}
		}
	}
	return cut
}
