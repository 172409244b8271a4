package mcpbridge

import (
	"encoding/json"
	"net/http"
	"strings"
	"testing"
	"time"

	api "github.com/agentbox/terraform-provider-agentbox/internal/supervisor/supervisorapi"
)

// postWithToken sends a JSON-RPC request with the user token header (none
// if token is empty) and returns the reply.
func postWithToken(t *testing.T, url, token, body string) rpcReply {
	t.Helper()
	req, err := http.NewRequest(http.MethodPost, url, strings.NewReader(body))
	if err != nil {
		t.Fatal(err)
	}
	req.Header.Set("Content-Type", "application/json")
	if token != "" {
		req.Header.Set(api.HeaderUserToken, token)
	}
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	var r rpcReply
	if err := json.NewDecoder(resp.Body).Decode(&r); err != nil || resp.StatusCode != http.StatusOK {
		t.Fatalf("HTTP %d: %v", resp.StatusCode, err)
	}
	return r
}

// metaSeen calls the helper's meta tool with the caller's _meta (none if
// nil) and returns the _meta the server got.
func metaSeen(t *testing.T, url, token string, callerMeta map[string]any) map[string]any {
	t.Helper()
	params := map[string]any{"name": "meta", "arguments": map[string]any{}}
	if callerMeta != nil {
		params["_meta"] = callerMeta
	}
	p, _ := json.Marshal(params)
	r := postWithToken(t, url, token, `{"jsonrpc":"2.0","id":1,"method":"tools/call","params":`+string(p)+`}`)
	if r.Error != nil {
		t.Fatalf("tools/call meta: %d %s", r.Error.Code, r.Error.Message)
	}
	var res struct {
		Content []struct{ Text string } `json:"content"`
	}
	if err := json.Unmarshal(r.Result, &res); err != nil || len(res.Content) != 1 {
		t.Fatalf("tools/call meta: %s (%v)", r.Result, err)
	}
	var meta map[string]any
	if err := json.Unmarshal([]byte(res.Content[0].Text), &meta); err != nil {
		t.Fatalf("the server's _meta %q: %v", res.Content[0].Text, err)
	}
	return meta
}

// The user token header reaches a stdio server in _meta, over whatever a
// caller put under the key, and a caller's own value never reaches it
// without the header; the caller's other _meta keys pass as they are.
func TestUserTokenMeta(t *testing.T) {
	m, ts := startManager(t, Config{Servers: []ServerConfig{helperServer(t, "h", "plain")}, CallTimeout: 10 * time.Second})
	waitRunning(t, m, "h", 10*time.Second)
	url := ts.URL + "/mcp/h"
	const token, forged, other = "header.token.value", "forged.by.caller", "other.example/key"

	for _, tc := range []struct {
		name       string
		header     string
		callerMeta map[string]any
		wantToken  any
		wantOther  bool
	}{
		{name: "header, no _meta", header: token, wantToken: token},
		{name: "header over the caller's value", header: token, callerMeta: map[string]any{api.MetaUserToken: forged, other: "kept"}, wantToken: token, wantOther: true},
		{name: "caller's value without the header", callerMeta: map[string]any{api.MetaUserToken: forged, other: "kept"}, wantOther: true},
		{name: "caller's value alone without the header", callerMeta: map[string]any{api.MetaUserToken: forged}},
		{name: "neither", callerMeta: map[string]any{other: "kept"}, wantOther: true},
	} {
		t.Run(tc.name, func(t *testing.T) {
			meta := metaSeen(t, url, tc.header, tc.callerMeta)
			if got := meta[api.MetaUserToken]; got != tc.wantToken {
				t.Errorf("the server got %s = %v, want %v", api.MetaUserToken, got, tc.wantToken)
			}
			if _, ok := meta[other]; ok != tc.wantOther {
				t.Errorf("the caller's other key reached the server: %v, want %v (%v)", ok, tc.wantOther, meta)
			}
		})
	}

	// Methods whose params the caller left out get the token too, and a
	// _meta that is not an object is refused rather than passed over.
	if r := postWithToken(t, url, token, `{"jsonrpc":"2.0","id":2,"method":"ping"}`); r.Error != nil {
		t.Errorf("ping with a token: %+v", r.Error)
	}
	if r := postWithToken(t, url, token, `{"jsonrpc":"2.0","id":3,"method":"tools/list","params":null}`); r.Error != nil {
		t.Errorf("tools/list with a token and null params: %+v", r.Error)
	}
	for _, tok := range []string{"", token} {
		r := postWithToken(t, url, tok, `{"jsonrpc":"2.0","id":4,"method":"tools/call","params":{"name":"meta","_meta":"`+forged+`"}}`)
		if r.Error == nil || r.Error.Code != -32602 {
			t.Errorf("a _meta that is not an object (token %q): %+v", tok, r)
		}
	}
}

// userTokenParams leaves params it need not change byte for byte as they
// came.
func TestUserTokenParamsUnchanged(t *testing.T) {
	for _, p := range []string{``, `null`, `{"name":"x", "arguments": {"a": 1}}`, `{"_meta":{"k":"v"}}`, `[1,2]`} {
		out, e := userTokenParams(json.RawMessage(p), "")
		if e != nil || string(out) != p {
			t.Errorf("params %q without a token became %q (%v)", p, out, e)
		}
	}
}
