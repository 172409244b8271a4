package main

import (
	"io"
	"net/http"
	"net/http/httptest"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"testing"

	"github.com/agentbox/terraform-provider-agentbox/internal/computeapi/client"
)

// agentbox mcp request sends the request as given, from the argument or
// stdin, with the user token of --user-token-file or AGENTBOX_USER_TOKEN,
// and prints the response.
func TestMCPRequestCommand(t *testing.T) {
	type seen struct{ path, token, body string }
	var mu sync.Mutex
	var got seen
	srv := httptest.NewTLSServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		b, _ := io.ReadAll(r.Body)
		mu.Lock()
		got = seen{r.URL.EscapedPath(), r.Header.Get(client.HeaderUserToken), string(b)}
		mu.Unlock()
		w.Header().Set("Content-Type", "application/json")
		_, _ = io.WriteString(w, `{"jsonrpc":"2.0","id":1,"result":{"tools":[]}}`)
	}))
	t.Cleanup(srv.Close)
	caFile := filepath.Join(t.TempDir(), "ca.crt")
	if err := os.WriteFile(caFile, pemOf(srv), 0o600); err != nil {
		t.Fatal(err)
	}
	env := map[string]string{"AGENTBOX_TOKEN": token, "AGENTBOX_ENDPOINT": srv.URL, "AGENTBOX_CA_FILE": caFile}
	const req = `{"jsonrpc":"2.0","id":1,"method":"tools/list"}`
	tokenFile := filepath.Join(t.TempDir(), "user-token")
	if err := os.WriteFile(tokenFile, []byte("from.the.file\n"), 0o600); err != nil {
		t.Fatal(err)
	}
	for name, tc := range map[string]struct {
		env   map[string]string
		stdin string
		args  []string
		token string
	}{
		"argument, no token":   {env: env, args: []string{"agent-1", "gh", req}},
		"stdin, env token":     {env: with(env, "AGENTBOX_USER_TOKEN", "from.the.env"), stdin: req + "\n", args: []string{"agent-1", "gh"}, token: "from.the.env"},
		"dash, file over env":  {env: with(env, "AGENTBOX_USER_TOKEN", "from.the.env"), stdin: req, args: []string{"--user-token-file", tokenFile, "agent-1", "gh", "-"}, token: "from.the.file"},
		"flag after arguments": {env: env, args: []string{"agent-1", "gh", req, "--user-token-file", tokenFile}, token: "from.the.file"},
	} {
		r := runCLI(t, tc.env, tc.stdin, append([]string{"mcp", "request"}, tc.args...)...)
		mu.Lock()
		g := got
		mu.Unlock()
		if r.code != 0 || strings.TrimSpace(r.stdout) != `{"jsonrpc":"2.0","id":1,"result":{"tools":[]}}` {
			t.Errorf("%s: exit %d, stdout %q, stderr %q", name, r.code, r.stdout, r.stderr)
		}
		if g.path != "/v1/agents/agent-1/mcp/gh" || g.token != tc.token || g.body != req {
			t.Errorf("%s: the API got %+v, want token %q and the request as given", name, g, tc.token)
		}
	}
	for name, tc := range map[string]struct {
		args []string
		want string
	}{
		"no subcommand": {[]string{"mcp"}, "usage: agentbox mcp request"},
		"no server":     {[]string{"mcp", "request", "agent-1"}, "missing SERVER"},
		"extra":         {[]string{"mcp", "request", "agent-1", "gh", req, "x"}, `unexpected argument "x"`},
		"not JSON":      {[]string{"mcp", "request", "agent-1", "gh", "{oops"}, "REQUEST is not JSON"},
		"empty file":    {[]string{"mcp", "request", "--user-token-file", os.DevNull, "agent-1", "gh", req}, "is empty"},
	} {
		if r := runCLI(t, env, "", tc.args...); r.code != exitUsage || !strings.Contains(r.stderr, tc.want) {
			t.Errorf("%s: exit %d, stderr %q, want 2 and %q", name, r.code, r.stderr, tc.want)
		}
	}
}
