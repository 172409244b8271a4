package mcpbridge

import (
	"os"
	"path/filepath"
	"reflect"
	"testing"
)

func TestLoadServers(t *testing.T) {
	path := filepath.Join(t.TempDir(), "mcp.json")
	data := `[{"name":"fs","command":"node","args":["server.js","stdio"],"env":{"A":"b"},"dir":"tools"}]`
	if err := os.WriteFile(path, []byte(data), 0o600); err != nil {
		t.Fatal(err)
	}
	got, err := LoadServers(path)
	if err != nil {
		t.Fatal(err)
	}
	want := []ServerConfig{{Name: "fs", Command: "node", Args: []string{"server.js", "stdio"}, Env: map[string]string{"A": "b"}, Dir: "tools"}}
	if !reflect.DeepEqual(got, want) {
		t.Fatalf("got %+v", got)
	}
	for _, bad := range []string{`[{"name":"a","command":"x","argz":[]}]`, `{"name":"a"}`, `[] []`, ``} {
		if _, err := ParseServers([]byte(bad)); err == nil {
			t.Errorf("%q: accepted", bad)
		}
	}
}
