package controller

import (
	"strings"
	"testing"
	"unicode/utf8"
)

// An event's note is cut to the API server's limit, which refuses longer
// ones (and the event is then lost), without splitting a UTF-8 sequence.
func TestUnitTruncateEventNote(t *testing.T) {
	if got := truncateEventNote("short"); got != "short" {
		t.Errorf("a short note changed: %q", got)
	}
	long := "container sandbox exited with code 128 (OOMKilled): " + strings.Repeat("é", 2000)
	got := truncateEventNote(long)
	if len(got) > maxEventNote || !strings.HasSuffix(got, "...") || !utf8.ValidString(got) || !strings.HasPrefix(got, "container sandbox") {
		t.Errorf("cut note: %d bytes, valid UTF-8 %v, %q...", len(got), utf8.ValidString(got), got[:40])
	}
	if got := truncateMessage(long); len(got) > maxMessage || len(got) <= maxEventNote {
		t.Errorf("condition messages keep their longer limit: %d bytes", len(got))
	}
}
