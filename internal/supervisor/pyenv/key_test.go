package pyenv

import (
	"strings"
	"testing"
)

// RequirementsKey is the name the manager gives an environment asked for
// by requirements alone: the control plane routes pool leases by it, so
// the two must never differ.
func TestRequirementsKeyIsTheManagersName(t *testing.T) {
	cases := []struct {
		index  string
		extras []string
		reqs   []string
	}{
		{"", nil, []string{"pandas>=2.0"}},
		{"http://127.0.0.1:9/simple/", nil, []string{"Pandas >= 2.0", "numpy"}},
		{"http://127.0.0.1:9/simple/", []string{"http://127.0.0.1:8/simple/"}, []string{"requests[security,socks]", "idna==3.7"}},
	}
	for _, c := range cases {
		m := &Manager{cfg: Config{IndexURL: c.index, ExtraIndexURLs: c.extras}}
		name, _, _, err := m.resolve(Request{Requirements: c.reqs})
		if err != nil {
			t.Fatalf("resolve %v: %v", c.reqs, err)
		}
		key, err := RequirementsKey(c.reqs, c.index, c.extras)
		if err != nil {
			t.Fatalf("key %v: %v", c.reqs, err)
		}
		if key != name || !strings.HasPrefix(key, "reqs-") || len(key) != len("reqs-")+16 {
			t.Errorf("requirements %v, index %q: key %q, the manager's name %q", c.reqs, c.index, key, name)
		}
	}
}

func TestRequirementsKeyIsStable(t *testing.T) {
	key := func(reqs []string, index string) string {
		t.Helper()
		k, err := RequirementsKey(reqs, index, nil)
		if err != nil {
			t.Fatal(err)
		}
		return k
	}
	a := key([]string{"numpy", "Pandas>=2.0"}, "")
	if b := key([]string{"pandas >= 2.0", "numpy", "numpy"}, ""); a != b {
		t.Errorf("the same set spelled otherwise: %q and %q", a, b)
	}
	if b := key([]string{"numpy", "pandas>=2.1"}, ""); a == b {
		t.Errorf("another set has the same key %q", a)
	}
	if b := key([]string{"numpy", "pandas>=2.0"}, "http://127.0.0.1:9/simple/"); a == b {
		t.Errorf("another index has the same key %q", a)
	}
	if _, err := RequirementsKey(nil, "", nil); err == nil {
		t.Error("a key for no requirements")
	}
	if _, err := RequirementsKey([]string{"x @ http://h/x.whl"}, "", nil); err == nil {
		t.Error("a key for a URL requirement")
	}
}
