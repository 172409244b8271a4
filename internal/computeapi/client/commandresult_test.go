package client

import (
	"reflect"
	"strings"
	"testing"

	"github.com/agentbox/terraform-provider-agentbox/internal/wire"
)

// Every field of the supervisor's command result reaches the API's caller
// under the same JSON name: the API converts one type to the other, and a
// field the supervisor gained but the API's result lacked would be lost on
// the way, as out_of_memory once was.
func TestCommandResultCarriesEverySupervisorField(t *testing.T) {
	apiFields := jsonFields(reflect.TypeFor[CommandResult]())
	for name, goName := range jsonFields(reflect.TypeFor[wire.CommandResult]()) {
		if got, ok := apiFields[name]; !ok || got != goName {
			t.Errorf("the supervisor's command result field %s (%q) is not in the API's CommandResult", goName, name)
		}
	}
	if len(apiFields) != len(jsonFields(reflect.TypeFor[wire.CommandResult]())) {
		t.Errorf("the API's CommandResult has fields %v, the supervisor's %v", apiFields, jsonFields(reflect.TypeFor[wire.CommandResult]()))
	}
}

func jsonFields(t reflect.Type) map[string]string {
	out := map[string]string{}
	for f := range t.Fields() {
		name, _, _ := strings.Cut(f.Tag.Get("json"), ",")
		out[name] = f.Name
	}
	return out
}
