package chart

import (
	"reflect"
	"testing"
)

func intPtr(i int) *int { return &i }

func TestValuesMap(t *testing.T) {
	got, err := Values{
		ImageRegistry: "reg.example.com", ImageTag: "v1", ImagePullPolicy: "Always", Replicas: intPtr(0),
		SandboxNamespaces: []string{"agents"},
		Raw:               "image:\n  sandbox:\n    tag: v2\nmetrics:\n  enabled: false\n",
	}.Map()
	if err != nil {
		t.Fatal(err)
	}
	want := map[string]any{
		"imageRegistry":     "reg.example.com",
		"replicaCount":      float64(0),
		"sandboxNamespaces": []any{"agents"},
		"image": map[string]any{
			"controlPlane": map[string]any{"tag": "v1", "pullPolicy": "Always"},
			"sandbox":      map[string]any{"tag": "v2", "pullPolicy": "Always"},
			"supervisor":   map[string]any{"tag": "v1", "pullPolicy": "Always"},
			"egressProxy":  map[string]any{"tag": "v1", "pullPolicy": "Always"},
		},
		"metrics": map[string]any{"enabled": false},
	}
	if !reflect.DeepEqual(got, want) {
		t.Errorf("Map()\n got %#v\nwant %#v", got, want)
	}

	if _, err := (Values{Raw: "- a list"}).Map(); err == nil {
		t.Error("a YAML list was accepted as values")
	}
	if m, err := (Values{}).Map(); err != nil || len(m) != 0 {
		t.Errorf("empty values: %v %v", m, err)
	}
}

func TestValuesFromConfigRoundTrip(t *testing.T) {
	cases := []Values{
		{},
		{ImageTag: "dev", Replicas: intPtr(1)},
		{ImageRegistry: "r.example.com/x", ImageTag: "v1", ImagePullPolicy: "Never", Replicas: intPtr(3),
			Raw: "metrics:\n  enabled: false\n"},
		// A tag that differs per image stays in Raw.
		{ImageTag: "v1", Raw: "image:\n  sandbox:\n    tag: v2\n"},
		{Replicas: intPtr(0)},
		{SandboxNamespaces: []string{"agents", "team-b"}},
	}
	for _, v := range cases {
		m, err := v.Map()
		if err != nil {
			t.Fatal(err)
		}
		back, err := ValuesFromConfig(m)
		if err != nil {
			t.Fatal(err)
		}
		again, err := back.Map()
		if err != nil {
			t.Fatal(err)
		}
		if !SameValues(m, again) {
			t.Errorf("%+v -> %+v: maps differ\n%v\n%v", v, back, m, again)
		}
		if back.ImageTag != v.ImageTag && v.Raw == "" {
			t.Errorf("%+v -> %+v: tag lost", v, back)
		}
	}

	// Typed fields are recovered exactly where they are unambiguous.
	v := Values{ImageRegistry: "r.example.com", ImageTag: "v1", ImagePullPolicy: "Never", Replicas: intPtr(2),
		SandboxNamespaces: []string{"agents"}, Raw: "metrics:\n  enabled: false\n"}
	m, _ := v.Map()
	back, err := ValuesFromConfig(m)
	if err != nil {
		t.Fatal(err)
	}
	if !reflect.DeepEqual(back, v) {
		t.Errorf("got %+v, want %+v", back, v)
	}
}

func TestSameValues(t *testing.T) {
	if !SameValues(map[string]any{"replicaCount": 1}, map[string]any{"replicaCount": float64(1)}) {
		t.Error("int and float64 differ")
	}
	if !SameValues(nil, map[string]any{}) {
		t.Error("nil and empty differ")
	}
	if SameValues(map[string]any{"a": 1}, map[string]any{"a": 2}) {
		t.Error("1 and 2 are the same")
	}
}
