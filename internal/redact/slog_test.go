package redact

import (
	"bytes"
	"errors"
	"log/slog"
	"strings"
	"testing"
)

// The handler redacts the message and attributes of every shape a
// program logs, at any depth.
func TestSlogHandler(t *testing.T) {
	const key = "AKIAIOSFODNN7EXAMPLE"
	var buf bytes.Buffer
	log := slog.New(SlogHandler(slog.NewJSONHandler(&buf, &slog.HandlerOptions{Level: slog.LevelDebug})))
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
