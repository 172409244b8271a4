package terminal

import (
	"net/url"
	"strings"
	"testing"

	api "github.com/agentbox/terraform-provider-agentbox/internal/supervisor/supervisorapi"
)

func TestPTYQueryRoundTrip(t *testing.T) {
	in := api.PTYRequest{Command: []string{"sh", "-c", "echo a=b&c"}, Cwd: "sub dir", Env: map[string]string{"A": "1=2", "B": ""}, Cols: 132, Rows: 43}
	got, e := parsePTYQuery(in.Query())
	if e != nil {
		t.Fatal(e)
	}
	if strings.Join(got.command, "|") != "sh|-c|echo a=b&c" || got.cwd != in.Cwd || got.env["A"] != "1=2" || got.env["B"] != "" ||
		len(got.env) != 2 || got.cols != 132 || got.rows != 43 {
		t.Fatalf("parsed %+v from %v", got, in.Query())
	}
	got, e = parsePTYQuery(url.Values{})
	if e != nil || got.cols != api.DefaultPTYCols || got.rows != api.DefaultPTYRows || len(got.command) != 0 {
		t.Fatalf("defaults: %+v, %v", got, e)
	}
}
