package v1alpha1

import (
	"strings"
	"testing"
	"time"

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

// A building mark carries its time and counts for PythonEnvBuildingMaxAge;
// an older one, or one that does not parse, reads as absent. A plain
// "building" of before reads as building.
func TestPythonEnvBuildingMark(t *testing.T) {
	now := time.Unix(1_800_000_000, 0)
	fresh := PythonEnvBuildingAt(now.Add(-time.Minute))
	if fresh != "building@1799999940" {
		t.Errorf("mark %q", fresh)
	}
	sb := &Sandbox{ObjectMeta: metav1.ObjectMeta{Annotations: map[string]string{
		AnnotationPythonEnvPrefix + "fresh":   fresh,
		AnnotationPythonEnvPrefix + "stale":   PythonEnvBuildingAt(now.Add(-PythonEnvBuildingMaxAge - time.Second)),
		AnnotationPythonEnvPrefix + "old":     PythonEnvBuilding,
		AnnotationPythonEnvPrefix + "junk":    "building@soon",
		AnnotationPythonEnvPrefix + "unknown": "half-built",
	}}}
	for name, want := range map[string]string{"fresh": PythonEnvBuilding, "stale": "", "old": PythonEnvBuilding, "junk": "", "unknown": ""} {
		if got := PythonEnvStateAt(sb, name, now); got != want {
			t.Errorf("%s: state %q, want %q", name, got, want)
		}
	}
}
