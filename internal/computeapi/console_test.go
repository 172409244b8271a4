package computeapi

import (
	"bytes"
	"context"
	"io"
	"net/http"
	"strings"
	"testing"
	"time"

	api "github.com/agentbox/terraform-provider-agentbox/internal/computeapi/client"
)

// TestStaffConsole: a staff member with a reason gets a time-boxed shell
// in an agent's sandbox, once; everything about the access is recorded.
func TestStaffConsole(t *testing.T) {
	st := tempStore(t)
	clients := realSupervisorAPI(t, st, nil)
	ctx := context.Background()
	admin := clients(adminToken)
	staffTok, err := admin.CreateToken(ctx, api.CreateTokenRequest{Kind: api.TokenKindStaff, Subject: "alice@ops"})
	if err != nil {
		t.Fatal(err)
	}
	staff := clients(staffTok.Token)

	_, err = staff.CreateConsoleSession(ctx, api.CreateConsoleSessionRequest{AgentID: "agent-1", Reason: "  "})
	wantAPIError(t, err, api.CodeInvalidArgument, http.StatusBadRequest)
	_, err = clients("agent-token:agent-1").CreateConsoleSession(ctx, api.CreateConsoleSessionRequest{AgentID: "agent-1", Reason: "x"})
	wantAPIError(t, err, api.CodePermissionDenied, http.StatusForbidden)
	_, err = admin.CreateConsoleSession(ctx, api.CreateConsoleSessionRequest{AgentID: "agent-1", Reason: "x"})
	wantAPIError(t, err, api.CodePermissionDenied, http.StatusForbidden)

	sess, err := staff.CreateConsoleSession(ctx, api.CreateConsoleSessionRequest{AgentID: "agent-1", Reason: "ticket 4711: agent stuck", TTLSeconds: 300})
	if err != nil {
		t.Fatal(err)
	}
	if sess.StaffID != "alice@ops" || sess.AgentID != "agent-1" || sess.ExpiresAt.Sub(sess.CreatedAt) != 5*time.Minute {
		t.Fatalf("session %+v", sess)
	}

	start := time.Now()
	pty, err := staff.OpenConsole(ctx, sess.ID, 100, 30)
	if err != nil {
		t.Fatal(err)
	}
	opened := time.Since(start)
	// A fake API key, typed in two frames: the transcript must not hold
	// it in either direction, although no frame holds all of it.
	key := "sk-ant-api03-" + strings.Repeat("Fa4e", 8)
	for _, frame := range []string{"stty size; echo console-$((40+2)); K=" + key[:9], key[9:] + "; echo $K; exit 3\n"} {
		if _, err := pty.Write([]byte(frame)); err != nil {
			t.Fatal(err)
		}
	}
	out, err := io.ReadAll(pty)
	if err != nil {
		t.Fatal(err)
	}
	exit, err := pty.Wait(ctx)
	if err != nil || exit.ExitCode != 3 {
		t.Fatalf("exit %+v, %v", exit, err)
	}
	pty.Close()
	// The staff member's own terminal shows what the shell printed.
	if !bytes.Contains(out, []byte("console-42")) || !bytes.Contains(out, []byte("30 100")) || !bytes.Contains(out, []byte(key)) {
		t.Fatalf("terminal output %q", out)
	}
	t.Logf("console opened in %s, shell exited with %d", opened.Round(time.Millisecond), exit.ExitCode)

	// Once only.
	_, err = staff.OpenConsole(ctx, sess.ID, 0, 0)
	wantAPIError(t, err, api.CodeConsoleExpired, http.StatusGone)
	// Another staff member cannot use it.
	bobTok, err := admin.CreateToken(ctx, api.CreateTokenRequest{Kind: api.TokenKindStaff, Subject: "bob@ops"})
	if err != nil {
		t.Fatal(err)
	}
	_, err = clients(bobTok.Token).OpenConsole(ctx, sess.ID, 0, 0)
	wantAPIError(t, err, api.CodeNotFound, http.StatusNotFound)

	// The record: who, why, when, what was seen. The disconnect is written
	// as the relay ends, just after the client saw the exit.
	var rec *api.ConsoleSession
	for deadline := time.Now().Add(5 * time.Second); ; time.Sleep(20 * time.Millisecond) {
		if rec, err = admin.GetConsoleSession(ctx, sess.ID); err != nil {
			t.Fatal(err)
		}
		if rec.DisconnectedAt != nil || time.Now().After(deadline) {
			break
		}
	}
	if rec.ConnectedAt == nil || rec.DisconnectedAt == nil || rec.Reason != "ticket 4711: agent stuck" ||
		!bytes.Contains(rec.Transcript, []byte("console-42")) {
		t.Errorf("recorded session %+v (transcript %q)", rec, rec.Transcript)
	}
	// Both directions are recorded, told apart, and redacted.
	var typed, shown []byte
	for _, r := range rec.TranscriptRecords {
		switch r.Direction {
		case api.TranscriptInput:
			typed = append(typed, r.Data...)
		case api.TranscriptOutput:
			shown = append(shown, r.Data...)
		default:
			t.Errorf("a transcript record of direction %q", r.Direction)
		}
		if r.At.Before(rec.ConnectedAt.Add(-time.Second)) || r.At.After(rec.DisconnectedAt.Add(time.Second)) {
			t.Errorf("a transcript record at %v, outside the connection %v-%v", r.At, rec.ConnectedAt, rec.DisconnectedAt)
		}
	}
	wantTyped := "stty size; echo console-$((40+2)); K=[REDACTED:sk_api_key]; echo $K; exit 3\n"
	if string(typed) != wantTyped {
		t.Errorf("recorded input %q, want %q", typed, wantTyped)
	}
	if !bytes.Equal(shown, rec.Transcript) || !bytes.Contains(shown, []byte("console-42")) ||
		bytes.Count(shown, []byte("[REDACTED:sk_api_key]")) < 2 {
		t.Errorf("recorded output %q (transcript %q)", shown, rec.Transcript)
	}
	for _, b := range [][]byte{typed, shown, rec.Transcript} {
		if bytes.Contains(b, []byte(key[9:])) {
			t.Errorf("the transcript holds the key: %q", b)
		}
	}
	if _, err := clients(bobTok.Token).GetConsoleSession(ctx, sess.ID); api.CodeOf(err) != api.CodeNotFound {
		t.Errorf("another staff member reads the session: %v", err)
	}

	// An expired session cannot connect.
	short, err := staff.CreateConsoleSession(ctx, api.CreateConsoleSessionRequest{AgentID: "agent-1", Reason: "later", TTLSeconds: 1})
	if err != nil {
		t.Fatal(err)
	}
	time.Sleep(1100 * time.Millisecond)
	_, err = staff.OpenConsole(ctx, short.ID, 0, 0)
	wantAPIError(t, err, api.CodeConsoleExpired, http.StatusGone)
}
