package controller

import (
	"slices"
	"strings"
	"testing"
	"time"

	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"

	"github.com/agentbox/terraform-provider-agentbox/internal/api/v1alpha1"
	"github.com/agentbox/terraform-provider-agentbox/internal/supervisor/pyenv"
)

// The environment a new Sandbox adopts by, from its annotations, and the
// order it tries the warm sandboxes in: holders, then builders, then the
// rest, oldest first within each.
func TestAdoptionEnvRouting(t *testing.T) {
	tpl := &v1alpha1.SandboxTemplate{Spec: v1alpha1.SandboxTemplateSpec{Python: v1alpha1.PythonPolicy{IndexURL: "http://127.0.0.1:9/simple/"}}}
	key, err := pyenv.RequirementsKey([]string{"numpy", "pandas>=2"}, tpl.Spec.Python.IndexURL, nil)
	must(t, err)
	adopter := func(a map[string]string) *v1alpha1.Sandbox {
		return &v1alpha1.Sandbox{ObjectMeta: metav1.ObjectMeta{Name: "x", Annotations: a}}
	}
	for _, c := range []struct {
		name      string
		a         map[string]string
		want, why string
	}{
		{"none", nil, "", ""},
		{"by name", map[string]string{v1alpha1.AnnotationPythonEnvName: "data"}, "data", ""},
		{"by requirements", map[string]string{v1alpha1.AnnotationPythonRequirements: " numpy\n pandas>=2 "}, key, ""},
		{"both", map[string]string{v1alpha1.AnnotationPythonEnvName: "data", v1alpha1.AnnotationPythonRequirements: "numpy"}, "", "twice"},
		{"bad name", map[string]string{v1alpha1.AnnotationPythonEnvName: "../x"}, "", v1alpha1.AnnotationPythonEnvName},
		{"bad requirement", map[string]string{v1alpha1.AnnotationPythonRequirements: "x@https://example.invalid/x.whl"}, "", v1alpha1.AnnotationPythonRequirements},
	} {
		got, why := adoptEnvKey(adopter(c.a), tpl)
		if got != c.want || (c.why == "") != (why == "") || !strings.Contains(why, c.why) {
			t.Errorf("%s: key %q (%q), want %q (%q)", c.name, got, why, c.want, c.why)
		}
	}

	t0 := time.Date(2026, 1, 1, 0, 0, 0, 0, time.UTC)
	warm := func(name string, age int, state string) v1alpha1.Sandbox {
		s := v1alpha1.Sandbox{ObjectMeta: metav1.ObjectMeta{Name: name, Annotations: map[string]string{},
			CreationTimestamp: metav1.NewTime(t0.Add(time.Duration(-age) * time.Minute))}}
		if state != "" {
			s.Annotations[v1alpha1.AnnotationPythonEnvPrefix+key] = state
		}
		return s
	}
	list := []v1alpha1.Sandbox{warm("old", 5, ""), warm("builder", 4, v1alpha1.PythonEnvBuildingAt(time.Now())), warm("holder", 3, v1alpha1.PythonEnvBuilt), warm("young", 2, "")}
	var names []string
	for _, s := range routeWarm(list, key) {
		names = append(names, s.Name)
	}
	if want := []string{"holder", "builder", "old", "young"}; !slices.Equal(names, want) {
		t.Errorf("order %v, want %v", names, want)
	}
	if got := adoptionEnvRouting(&list[2], key); got != "hit" {
		t.Errorf("routing to the holder: %q", got)
	}
	if got := adoptionEnvRouting(&list[0], ""); got != "" {
		t.Errorf("routing without a key: %q", got)
	}
}
