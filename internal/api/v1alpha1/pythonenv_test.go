package v1alpha1

import (
	"strings"
	"testing"

	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
)

func TestPythonEnvInventory(t *testing.T) {
	sb := &Sandbox{ObjectMeta: metav1.ObjectMeta{Annotations: map[string]string{
		AnnotationPythonEnvPrefix + "reqs-0123456789abcdef": PythonEnvBuilt,
		AnnotationPythonEnvPrefix + "data.v2":               PythonEnvBuilding,
	}}}
	for name, want := range map[string]string{"reqs-0123456789abcdef": PythonEnvBuilt, "data.v2": PythonEnvBuilding, "other": ""} {
		if got := PythonEnvState(sb, name); got != want {
			t.Errorf("%s: state %q, want %q", name, got, want)
		}
	}
	// Environment names may be 64 bytes; an annotation's name part only 63.
	long := strings.Repeat("a", 64)
	if got := PythonEnvAnnotation(long); got != "" {
		t.Errorf("a 64-byte name got annotation %q", got)
	}
	if got := PythonEnvAnnotation(long[:63]); got != AnnotationPythonEnvPrefix+long[:63] {
		t.Errorf("a 63-byte name got annotation %q", got)
	}
}
