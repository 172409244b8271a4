package workspace

import (
	"io"
	"log/slog"
	"os"
	"path/filepath"
	"testing"
	"time"

	api "github.com/agentbox/terraform-provider-agentbox/internal/supervisor/supervisorapi"
)

// TestResolveLinks checks the walk that keeps the file API inside the
// workspace where os.Root alone does not (gVisor; see resolveLinks). The
// host's kernel would also stop these through os.Root; here the walk's own
// answers are checked, whatever the kernel.
func TestResolveLinks(t *testing.T) {
	ws := t.TempDir()
	for _, d := range []string{"sub/deep", "other"} {
		if err := os.MkdirAll(filepath.Join(ws, d), 0o755); err != nil {
			t.Fatal(err)
		}
	}
	for link, target := range map[string]string{
		"etc":         "/etc",
		"sub/up":      "../..",
		"in":          "sub",
		"chain":       "in/deep",
		"loop":        "loop",
		"self":        ".",
		"sub/sibling": "../other",
		"file-link":   "sub/deep/f",
	} {
		if err := os.Symlink(target, filepath.Join(ws, link)); err != nil {
			t.Fatal(err)
		}
	}
	s, err := Open(ws, api.DefaultWorkspaceCapBytes, time.Second, slog.New(slog.NewTextHandler(io.Discard, nil)))
	if err != nil {
		t.Fatal(err)
	}
	defer s.Close()
	for _, tc := range []struct {
		in    string
		final bool
		want  string
		code  api.Code
	}{
		{in: "etc/passwd", code: api.CodePathEscapesWorkspace},
		{in: "sub/up/tmp/x", code: api.CodePathEscapesWorkspace},
		{in: "sub/up/etc/passwd", code: api.CodePathEscapesWorkspace},
		{in: "in/deep/f", want: "sub/deep/f"},
		{in: "chain/f", want: "sub/deep/f"},
		{in: "self/self/in/f", want: "sub/f"},
		{in: "sub/sibling/x", want: "other/x"},
		{in: "loop/x", code: api.CodeInvalidArgument},
		{in: "etc", want: "etc"}, // the link itself, not followed
		{in: "etc", final: true, code: api.CodePathEscapesWorkspace},
		{in: "file-link", final: true, want: "sub/deep/f"},
		{in: "missing/dir/f", want: "missing/dir/f"},
		{in: ".", want: "."},
	} {
		got, apiErr := s.resolveLinks(tc.in, tc.final)
		switch {
		case tc.code != "" && (apiErr == nil || apiErr.Code != tc.code):
			t.Errorf("resolveLinks(%q, %v) = %q, %v; want %s", tc.in, tc.final, got, apiErr, tc.code)
		case tc.code == "" && (apiErr != nil || got != tc.want):
			t.Errorf("resolveLinks(%q, %v) = %q, %v; want %q", tc.in, tc.final, got, apiErr, tc.want)
		}
	}
}
