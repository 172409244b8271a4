package supervisor

import (
	"bytes"
	"errors"
	"log/slog"
	"strings"
	"testing"
)

// Every pattern in secretPatterns must have a case here.
var redactCases = map[string]struct{ text, secret string }{
	"aws_access_key_id":       {"aws configure set aws_access_key_id AKIAIOSFODNN7EXAMPLE", "AKIAIOSFODNN7EXAMPLE"},
	"github_token":            {"git clone https://x:ghp_aBcDeFgHiJkLmNoPqRsTuVwXyZ0123456789@github.invalid/r", "ghp_aBcDeFgHiJkLmNoPqRsTuVwXyZ0123456789"},
	"github_fine_grained_pat": {"GH_TOKEN=github_pat_11ABCDEFG0123456789_abcdefghijklmnopqrstuvwxyzABCDEFGHIJ", "github_pat_11ABCDEFG0123456789_abcdefghijklmnopqrstuvwxyzABCDEFGHIJ"},
	"agentbox_token":          {"export AGENTBOX_TOKEN=abx_Q2hhbmdlTWUtdGhpcy1pcy1hLXRlc3QtdG9rZW4tMDA", "abx_Q2hhbmdlTWUtdGhpcy1pcy1hLXRlc3QtdG9rZW4tMDA"},
	"slack_token":             {"curl -d token=xoxb-123456789012-1234567890123-AbCdEfGhIjKlMnOpQrStUvWx", "xoxb-123456789012-1234567890123-AbCdEfGhIjKlMnOpQrStUvWx"},
	"jwt":                     {"token eyJhbGciOiJIUzI1NiJ9.eyJzdWIiOiIxMjM0NTY3ODkwIn0.dozjgNryP4J3jVmNHl0w5N_XgL0n3I9PlFUP0THsR8U", "dozjgNryP4J3jVmNHl0w5N_XgL0n3I9PlFUP0THsR8U"},
	"bearer_token":            {"curl -H 'Authorization: Bearer s3cr3t-t0ken.value/xyz=' https://api.invalid", "s3cr3t-t0ken.value/xyz="},
	"pem_private_key": {"key: -----BEGIN RSA PRIVATE KEY-----\nMIIEowIBAAKCAQEA\nabcdef==\n-----END RSA PRIVATE KEY----- trailing",
		"MIIEowIBAAKCAQEA"},
}

func TestRedactPatterns(t *testing.T) {
	for _, p := range secretPatterns {
		t.Run(p.name, func(t *testing.T) {
			c, ok := redactCases[p.name]
			if !ok {
				t.Fatalf("pattern %s has no test case", p.name)
			}
			if !p.re.MatchString(c.text) {
				t.Fatalf("pattern %s does not match its case %q", p.name, c.text)
			}
			got := Redact(c.text)
			if strings.Contains(got, c.secret) {
				t.Fatalf("Redact(%q) = %q still holds the secret", c.text, got)
			}
			if !strings.Contains(got, "[REDACTED:"+p.name+"]") {
				t.Fatalf("Redact(%q) = %q, want it to name %s", c.text, got, p.name)
			}
		})
	}
	if len(redactCases) != len(secretPatterns) {
		t.Errorf("%d cases for %d patterns: remove cases of patterns that are gone", len(redactCases), len(secretPatterns))
	}
}

func TestRedactSpecifics(t *testing.T) {
	for in, want := range map[string]string{
		// What is not a secret is left alone.
		"ls -la /workspace":      "ls -la /workspace",
		"AKIA is a prefix":       "AKIA is a prefix",
		"ghp_short":              "ghp_short",
		"the bearer of bad news": "the bearer of bad news",
		"xoxb-":                  "xoxb-",
		"-----BEGIN PUBLIC KEY-----\nMIIB\n-----END": "-----BEGIN PUBLIC KEY-----\nMIIB\n-----END",
		// Text around a secret survives; a key cut short by the log line
		// is redacted to the end.
		"id=ASIAIOSFODNN7EXAMPLE, next":                                                    "id=[REDACTED:aws_access_key_id], next",
		"-----BEGIN PRIVATE KEY-----\nMIIEvQIBADANBgkqh":                                   "[REDACTED:pem_private_key]",
		"-----BEGIN OPENSSH PRIVATE KEY-----\nb3Bl\n-----END OPENSSH PRIVATE KEY-----\nok": "[REDACTED:pem_private_key]\nok",
		"authorization: bearer abcdefgh12345678":                                           "authorization: [REDACTED:bearer_token]",
		"two AKIAIOSFODNN7EXAMPLE AKIAIOSFODNN7EXAMPLF":                                    "two [REDACTED:aws_access_key_id] [REDACTED:aws_access_key_id]",
	} {
		if got := Redact(in); got != want {
			t.Errorf("Redact(%q) = %q, want %q", in, got, want)
		}
	}
}

type stringer string

func (s stringer) String() string { return string(s) }

// The handler redacts the message and attributes of every shape the
// supervisor logs, at any depth.
func TestRedactingHandler(t *testing.T) {
	const key = "AKIAIOSFODNN7EXAMPLE"
	var buf bytes.Buffer
	log := slog.New(NewRedactingHandler(slog.NewJSONHandler(&buf, &slog.HandlerOptions{Level: slog.LevelDebug})))
	log = log.With("bound", "x-"+key).WithGroup("g")
	log.Info("running "+key,
		"program", key,
		"error", errors.New("start "+key+": not found"),
		"stringer", stringer(key),
		"slice", []string{key},
		slog.Group("nested", slog.String("deep", "Bearer abcdefgh12345678")),
		"count", 3,
		"plain", []string{"kept"},
	)
	out := buf.String()
	if strings.Contains(out, key) || strings.Contains(out, "abcdefgh12345678") {
		t.Fatalf("secret in the log: %s", out)
	}
	for _, want := range []string{`"msg":"running [REDACTED:aws_access_key_id]"`, `"bound":"x-[REDACTED:aws_access_key_id]"`,
		`"count":3`, `"plain":["kept"]`, `"deep":"[REDACTED:bearer_token]"`} {
		if !strings.Contains(out, want) {
			t.Errorf("log lacks %s: %s", want, out)
		}
	}
}

// The server's own request lines go through the handler: a secret in a
// file path that is logged is redacted.
func TestServerLogsAreRedacted(t *testing.T) {
	var buf bytes.Buffer
	s := newServer(t, Config{Logger: slog.New(NewRedactingHandler(slog.NewJSONHandler(&buf, nil)))})
	post(t, s, map[string]any{"command": []string{"no-such-AKIAIOSFODNN7EXAMPLE"}})
	if strings.Contains(buf.String(), "AKIAIOSFODNN7EXAMPLE") || !strings.Contains(buf.String(), "[REDACTED:aws_access_key_id]") {
		t.Fatalf("log line: %s", buf.String())
	}
}
