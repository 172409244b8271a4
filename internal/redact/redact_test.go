package redact

import (
	"bytes"
	"errors"
	"fmt"
	"strings"
	"testing"

	"github.com/go-logr/logr/funcr"
)

// Fake secrets of each format, made up for the tests.
var (
	fakeSK      = "sk-proj-" + strings.Repeat("Ab1_", 10)
	fakeAgentTk = "abx_" + strings.Repeat("Q2hh", 10) + "bmd"
	fakePEM     = "-----BEGIN RSA PRIVATE KEY-----\nMIIEowIBAAKCAQEA\nabcdef==\n-----END RSA PRIVATE KEY-----"
)

// Every pattern must have a case here.
var cases = map[string]struct{ text, secret string }{
	"aws_access_key_id":       {"aws configure set aws_access_key_id AKIAIOSFODNN7EXAMPLE", "AKIAIOSFODNN7EXAMPLE"},
	"github_token":            {"git clone https://x:ghp_aBcDeFgHiJkLmNoPqRsTuVwXyZ0123456789@github.invalid/r", "ghp_aBcDeFgHiJkLmNoPqRsTuVwXyZ0123456789"},
	"github_fine_grained_pat": {"GH_TOKEN=github_pat_11ABCDEFG0123456789_abcdefghijklmnopqrstuvwxyzABCDEFGHIJ", "github_pat_11ABCDEFG0123456789_abcdefghijklmnopqrstuvwxyzABCDEFGHIJ"},
	"slack_token":             {"curl -d token=xoxb-123456789012-1234567890123-AbCdEfGhIjKlMnOpQrStUvWx", "xoxb-123456789012-1234567890123-AbCdEfGhIjKlMnOpQrStUvWx"},
	"sk_api_key":              {"export OPENAI_API_KEY=" + fakeSK, fakeSK},
	"agentbox_token":          {"export AGENTBOX_TOKEN=" + fakeAgentTk, fakeAgentTk},
	"jwt":                     {"token eyJhbGciOiJIUzI1NiJ9.eyJzdWIiOiIxMjM0NTY3ODkwIn0.dozjgNryP4J3jVmNHl0w5N_XgL0n3I9PlFUP0THsR8U", "dozjgNryP4J3jVmNHl0w5N_XgL0n3I9PlFUP0THsR8U"},
	"bearer_token":            {"curl -H 'Authorization: Bearer s3cr3t-t0ken.value/xyz=' https://api.invalid", "s3cr3t-t0ken.value/xyz="},
	"pem_private_key":         {"key: " + fakePEM + " trailing", "MIIEowIBAAKCAQEA"},
}

func TestPatterns(t *testing.T) {
	if len(fakeAgentTk) != 47 {
		t.Fatalf("the fake platform token has %d characters, a real one 47", len(fakeAgentTk))
	}
	for _, p := range patterns {
		t.Run(p.name, func(t *testing.T) {
			c, ok := cases[p.name]
			if !ok {
				t.Fatalf("pattern %s has no test case", p.name)
			}
			if !p.re.MatchString(c.text) {
				t.Fatalf("pattern %s does not match its case %q", p.name, c.text)
			}
			got := String(c.text)
			if strings.Contains(got, c.secret) || !strings.Contains(got, Placeholder(p.name)) {
				t.Fatalf("String(%q) = %q, want the secret replaced by %s", c.text, got, Placeholder(p.name))
			}
			if b := Bytes([]byte(c.text)); string(b) != got {
				t.Fatalf("Bytes = %q, String = %q", b, got)
			}
		})
	}
	if len(cases) != len(patterns) {
		t.Errorf("%d cases for %d patterns: remove cases of patterns that are gone", len(cases), len(patterns))
	}
}

func TestSpecifics(t *testing.T) {
	for in, want := range map[string]string{
		// What is not a secret is left alone.
		"ls -la /workspace":                          "ls -la /workspace",
		"pip install scikit-learn":                   "pip install scikit-learn",
		"sk-learn and sk-short-name":                 "sk-learn and sk-short-name",
		"the bearer of bad news":                     "the bearer of bad news",
		"abx_tooshort":                               "abx_tooshort",
		"-----BEGIN PUBLIC KEY-----\nMIIB\n-----END": "-----BEGIN PUBLIC KEY-----\nMIIB\n-----END",
		// Text around a secret survives; a key cut short is redacted to
		// the end.
		"id=ASIAIOSFODNN7EXAMPLE, next":                  "id=[REDACTED:aws_access_key_id], next",
		"-----BEGIN PRIVATE KEY-----\nMIIEvQIBADANBgkqh": "[REDACTED:pem_private_key]",
		"authorization: bearer abcdefgh12345678":         "authorization: [REDACTED:bearer_token]",
		"$ echo " + fakeSK + "\r\n" + fakeSK + "\r\n$ ":  "$ echo [REDACTED:sk_api_key]\r\n[REDACTED:sk_api_key]\r\n$ ",
	} {
		if got := String(in); got != want {
			t.Errorf("String(%q) = %q, want %q", in, got, want)
		}
	}
	clean := []byte("nothing to hide")
	if got := Bytes(clean); &got[0] != &clean[0] {
		t.Error("Bytes copied a text with nothing to redact")
	}
}

// streamed feeds text to a Stream in the given pieces and returns what it
// let through.
func streamed(pieces ...string) string {
	var s Stream
	var out bytes.Buffer
	for _, p := range pieces {
		out.Write(s.Write([]byte(p)))
	}
	out.Write(s.Flush())
	return out.String()
}

// A Stream lets through what String makes of the whole text, wherever the
// text is split: in two, in three, and a byte at a time (typing).
func TestStreamMatchesStringAtEverySplit(t *testing.T) {
	texts := []string{
		"$ export OPENAI_API_KEY=" + fakeSK + "\r\n$ echo $OPENAI_API_KEY\r\n" + fakeSK + "\r\n$ ",
		"AGENTBOX_TOKEN=" + fakeAgentTk + " agentbox exec a -- true\n",
		"curl -H 'Authorization: Bearer s3cr3t-t0ken.value/xyz=' https://api.invalid\n",
		"before\n" + fakePEM + "\nafter AKIAIOSFODNN7EXAMPLE done\n",
		"unfinished -----BEGIN PRIVATE KEY-----\nMIIEvQIBADANBgkqhkiG9w0BAQEFAASCBKcwggSjAgEAAoIBAQC",
		"two keys: " + fakeSK + " " + fakeSK + "x and ghp_aBcDeFgHiJkLmNoPqRsTuVwXyZ0123456789.",
		"plain output with no secret at all, ending in a word",
		"token eyJhbGciOiJIUzI1NiJ9.eyJzdWIiOiIxMjM0NTY3ODkwIn0.dozjgNryP4J3jVmNHl0w5N_XgL0n3I9PlFUP0THsR8U end",
	}
	for _, text := range texts {
		want := String(text)
		if got := streamed(text); got != want {
			t.Errorf("whole: %q, want %q", got, want)
		}
		for i := 0; i <= len(text); i++ {
			if got := streamed(text[:i], text[i:]); got != want {
				t.Fatalf("split at %d of %q:\n got %q\nwant %q", i, text, got, want)
			}
		}
		for i := 0; i <= len(text); i += 3 {
			for j := i; j <= len(text); j += 5 {
				if got := streamed(text[:i], text[i:j], text[j:]); got != want {
					t.Fatalf("split at %d and %d of %q:\n got %q\nwant %q", i, j, text, got, want)
				}
			}
		}
		bytewise := make([]string, len(text))
		for i := range text {
			bytewise[i] = text[i : i+1]
		}
		if got := streamed(bytewise...); got != want {
			t.Errorf("a byte at a time: %q, want %q", got, want)
		}
	}
}

// What is held back is only a possible secret's start: a line or a
// prompt goes through at once, and a private key's body is never held.
func TestStreamHoldsBackLittle(t *testing.T) {
	var s Stream
	if out := s.Write([]byte("$ ls\r\nfile1  file2\r\n$ ")); string(out) != "$ ls\r\nfile1  file2\r\n$ " || s.Pending() != 0 {
		t.Errorf("a prompt: passed %q, held %d", out, s.Pending())
	}
	if out := s.Write([]byte("echo sk-abc")); string(out) != "echo " || s.Pending() != len("sk-abc") {
		t.Errorf("a word being typed: passed %q, held %d", out, s.Pending())
	}
	s.Flush()
	out := s.Write([]byte("x -----BEGIN EC PRIVATE KEY-----\n" + strings.Repeat("QUJD", 4000)))
	if string(out) != "x "+Placeholder("pem_private_key") || s.Pending() > endTail {
		t.Errorf("an open private key: passed %q, held %d", out, s.Pending())
	}
	if out := s.Write([]byte("\n-----END EC PRIVATE KEY-----\nok\n")); string(out) != "\nok\n" {
		t.Errorf("after the key's END line: passed %q", out)
	}
	if out := s.Write([]byte(strings.Repeat("a", maxHeld+1))); len(out) != maxHeld+1 {
		t.Errorf("a run longer than any secret is passed on, got %d bytes", len(out))
	}
}

type stringer string

func (s stringer) String() string { return string(s) }

func TestLogger(t *testing.T) {
	var lines []string
	base := funcr.New(func(prefix, args string) { lines = append(lines, prefix+" "+args) }, funcr.Options{Verbosity: 1})
	log := Logger(base).WithName("api").WithValues("request_id", "id-"+fakeSK)
	if Logger(log).GetSink() != log.GetSink() {
		t.Error("Logger wrapped a redacting logger again")
	}
	log.Info("ran "+fakeAgentTk, "command", []string{"echo", fakeSK}, "who", stringer("AKIAIOSFODNN7EXAMPLE"), "n", 3,
		"m", map[string]int{"a": 1})
	log.V(1).Error(fmt.Errorf("call failed: %w", errors.New("Authorization: Bearer abcdefgh12345678")), "refused", "plain", "ok")
	all := strings.Join(lines, "\n")
	for _, secret := range []string{fakeSK, fakeAgentTk, "AKIAIOSFODNN7EXAMPLE", "abcdefgh12345678"} {
		if strings.Contains(all, secret) {
			t.Errorf("the log holds %q:\n%s", secret, all)
		}
	}
	for _, want := range []string{`"n"=3`, `"plain"="ok"`, "api ", "[REDACTED:sk_api_key]", "[REDACTED:bearer_token]", `"m"={"a"=1}`} {
		if !strings.Contains(all, want) {
			t.Errorf("the log lacks %s:\n%s", want, all)
		}
	}
}
