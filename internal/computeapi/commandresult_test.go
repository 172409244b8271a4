package computeapi

import (
	"encoding/json"
	"reflect"
	"slices"
	"strings"
	"testing"

	api "github.com/agentbox/terraform-provider-agentbox/internal/computeapi/client"
	"github.com/agentbox/terraform-provider-agentbox/internal/supervisor"
	"github.com/agentbox/terraform-provider-agentbox/internal/supervisor/supervisorapi"
)

// The API's command result is the supervisor's, passed on: a field the
// supervisor gains must reach callers (REST, the stream's exit event, the
// Go client, the CLI, MCP) unless it is listed here with the reason it is
// kept back. These tests fail when the supervisor's result has a field that
// the API's type, commandResult or the OpenAPI document does not carry.

// commandResultNotForwarded lists the supervisor's CommandResult fields
// (by JSON name) that the API deliberately leaves out, each with why.
// None today.
var commandResultNotForwarded = map[string]string{}

// jsonFields returns the JSON names of t's exported fields, and whether
// each is omitempty.
func jsonFields(t reflect.Type) map[string]bool {
	out := map[string]bool{}
	for f := range t.Fields() {
		if !f.IsExported() {
			continue
		}
		name, opts, _ := strings.Cut(f.Tag.Get("json"), ",")
		if name == "-" {
			continue
		}
		if name == "" {
			name = f.Name
		}
		out[name] = slices.Contains(strings.Split(opts, ","), "omitempty")
	}
	return out
}

func TestCommandResultCarriesEverySupervisorField(t *testing.T) {
	sup := jsonFields(reflect.TypeFor[supervisorapi.CommandResult]())
	ours := jsonFields(reflect.TypeFor[api.CommandResult]())
	for name := range sup {
		if _, kept := commandResultNotForwarded[name]; kept {
			continue
		}
		if _, ok := ours[name]; !ok {
			t.Errorf("the supervisor's command result has %q, which the API's CommandResult does not carry; add it there "+
				"(and to commandResult and the OpenAPI document), or list it in commandResultNotForwarded with the reason", name)
		}
	}
	for name := range commandResultNotForwarded {
		if _, ok := sup[name]; !ok {
			t.Errorf("commandResultNotForwarded lists %q, which the supervisor's result no longer has", name)
		}
	}
}

// TestCommandResultCopiesEveryField fills every field of a supervisor
// result with a value that is not its zero and checks that commandResult
// passes each one on.
func TestCommandResultCopiesEveryField(t *testing.T) {
	var in supervisorapi.CommandResult
	v := reflect.ValueOf(&in).Elem()
	for i := range v.NumField() {
		f := v.Field(i)
		switch f.Kind() {
		case reflect.String:
			f.SetString("value of " + v.Type().Field(i).Name)
		case reflect.Bool:
			f.SetBool(true)
		case reflect.Int, reflect.Int64:
			f.SetInt(int64(40 + i))
		default:
			t.Fatalf("field %s is a %s; teach this test to fill it", v.Type().Field(i).Name, f.Kind())
		}
	}
	want := asJSONMap(t, in)
	got := asJSONMap(t, commandResult(&in))
	for name, w := range want {
		if _, kept := commandResultNotForwarded[name]; kept {
			continue
		}
		if !reflect.DeepEqual(got[name], w) {
			t.Errorf("commandResult: %q is %v, the supervisor said %v", name, got[name], w)
		}
	}
}

func asJSONMap(t *testing.T, v any) map[string]any {
	t.Helper()
	b, err := json.Marshal(v)
	if err != nil {
		t.Fatal(err)
	}
	var m map[string]any
	if err := json.Unmarshal(b, &m); err != nil {
		t.Fatal(err)
	}
	return m
}

// TestCommandResultMatchesOpenAPI checks the document's CommandResult
// against the Go type both ways, and against the supervisor's result: every
// field is a property, and every field that is always sent is required.
func TestCommandResultMatchesOpenAPI(t *testing.T) {
	c := loadContract(t)
	schema := c.doc["components"].(map[string]any)["schemas"].(map[string]any)["CommandResult"].(map[string]any)
	props := schema["properties"].(map[string]any)
	var required []string
	for _, r := range schema["required"].([]any) {
		required = append(required, r.(string))
	}
	ours := jsonFields(reflect.TypeFor[api.CommandResult]())
	for name, omitempty := range ours {
		if _, ok := props[name]; !ok {
			t.Errorf("the OpenAPI CommandResult has no property %q, which the API sends", name)
		}
		if !omitempty && !slices.Contains(required, name) {
			t.Errorf("the OpenAPI CommandResult does not require %q, which the API always sends", name)
		}
	}
	for name := range props {
		if _, ok := ours[name]; !ok {
			t.Errorf("the OpenAPI CommandResult has property %q, which the API's type does not have", name)
		}
	}
	for name := range jsonFields(reflect.TypeFor[supervisorapi.CommandResult]()) {
		if _, kept := commandResultNotForwarded[name]; kept {
			continue
		}
		if _, ok := props[name]; !ok {
			t.Errorf("the supervisor's command result has %q, which the OpenAPI CommandResult does not describe", name)
		}
	}
}

// TestOutOfMemoryReachesEveryCaller has the real supervisor's memory guard
// kill a command and checks that each way of running one says so: the REST
// result, the stream's exit event and the MCP tool's structured result.
// The sandbox's memory use is injected (the guard's real source is gVisor's
// meminfo, which the cluster test's memory bomb exercises).
func TestOutOfMemoryReachesEveryCaller(t *testing.T) {
	clients := realSupervisorAPI(t, nil, func(c *supervisor.Config) {
		c.MemoryLimit, c.MemoryReserve = 256<<20, 56<<20
		c.MemoryInUse = func() (int64, error) { return 250 << 20, nil }
	})
	c := clients(adminToken)
	ctx := t.Context()
	hog := api.RunCommandRequest{Command: []string{"sleep", "30"}, TimeoutSeconds: 60}
	check := func(how string, res *api.CommandResult, err error) {
		t.Helper()
		if err != nil {
			t.Fatalf("%s: %v", how, err)
		}
		if !res.OutOfMemory || res.Signal != "SIGKILL" || res.TimedOut {
			t.Errorf("%s: %+v; want out_of_memory with SIGKILL", how, res)
		}
	}
	res, err := c.RunCommand(ctx, "agent-1", hog)
	check("run_command", res, err)
	res, err = c.RunCommandStream(ctx, "agent-1", hog, func(api.CommandEvent) error { return nil })
	check("run_command_stream", res, err)

	cs, err := connectMCP(ctx, c, "agent-1")
	if err != nil {
		t.Fatal(err)
	}
	defer cs.Close()
	var out api.CommandResult
	if r := callTool(t, cs, "run_command", map[string]any{"command": hog.Command, "timeout_seconds": 60}, &out); r.IsError {
		t.Fatalf("MCP run_command: %s", toolText(r))
	}
	check("MCP run_command", &out, nil)
}
