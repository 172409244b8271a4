package supervisor

import (
	"bytes"
	"log/slog"
	"strings"
	"testing"

	"github.com/agentbox/terraform-provider-agentbox/internal/redact"
)

// The server's own request lines go through the handler: a secret in a
// file path that is logged is redacted.
func TestServerLogsAreRedacted(t *testing.T) {
	var buf bytes.Buffer
	s := newServer(t, Config{Logger: slog.New(redact.SlogHandler(slog.NewJSONHandler(&buf, nil)))})
	post(t, s, map[string]any{"command": []string{"no-such-AKIAIOSFODNN7EXAMPLE"}})
	if strings.Contains(buf.String(), "AKIAIOSFODNN7EXAMPLE") || !strings.Contains(buf.String(), "[REDACTED:aws_access_key_id]") {
		t.Fatalf("log line: %s", buf.String())
	}
}
