package holds

import (
	"slices"
	"testing"
	"time"

	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"

	"github.com/agentbox/terraform-provider-agentbox/internal/api/v1alpha1"
	api "github.com/agentbox/terraform-provider-agentbox/internal/computeapi/client"
)

func TestRouteByEnv(t *testing.T) {
	const key = "reqs-0123456789abcdef"
	t0 := time.Date(2026, 1, 1, 0, 0, 0, 0, time.UTC)
	sb := func(name string, age int, envs map[string]string) *v1alpha1.Sandbox {
		s := &v1alpha1.Sandbox{ObjectMeta: metav1.ObjectMeta{Name: name, Annotations: map[string]string{},
			CreationTimestamp: metav1.NewTime(t0.Add(time.Duration(-age) * time.Minute))}}
		for k, v := range envs {
			s.Annotations[v1alpha1.AnnotationPythonEnvPrefix+k] = v
		}
		return s
	}
	// Given oldest first, as freeOldestFirst lists them.
	free := []*v1alpha1.Sandbox{
		sb("old-miss", 9, nil),
		sb("old-building", 8, map[string]string{key: v1alpha1.PythonEnvBuilding}),
		sb("other-env", 7, map[string]string{"reqs-ffffffffffffffff": v1alpha1.PythonEnvBuilt}),
		sb("hit-a", 6, map[string]string{key: v1alpha1.PythonEnvBuilt}),
		sb("young-building", 5, map[string]string{key: v1alpha1.PythonEnvBuildingAt(time.Now())}),
		// Marked by a call that never saw its build end: as good as none.
		sb("dead-building", 4, map[string]string{key: v1alpha1.PythonEnvBuildingAt(time.Now().Add(-v1alpha1.PythonEnvBuildingMaxAge - time.Minute))}),
		sb("hit-b", 4, map[string]string{key: v1alpha1.PythonEnvBuilt, "named": v1alpha1.PythonEnvBuilt}),
		sb("young-miss", 3, nil),
	}
	names := func(l []*v1alpha1.Sandbox) []string {
		var out []string
		for _, s := range l {
			out = append(out, s.Name)
		}
		return out
	}
	want := []string{"hit-a", "hit-b", "old-building", "young-building", "old-miss", "other-env", "dead-building", "young-miss"}
	if got := names(RouteByEnv(free, key)); !slices.Equal(got, want) {
		t.Errorf("routed order %v, want %v", got, want)
	}
	if got := names(RouteByEnv(free, "")); !slices.Equal(got, names(free)) {
		t.Errorf("no key: order %v, want the given %v", got, names(free))
	}
	if got := names(RouteByEnv(free, "named")); got[0] != "hit-b" || len(got) != len(free) {
		t.Errorf("by name: order %v", got)
	}
	for _, c := range []struct {
		sb   *v1alpha1.Sandbox
		want string
	}{{free[3], api.RoutingHit}, {free[1], api.RoutingBuilding}, {free[4], api.RoutingBuilding}, {free[5], api.RoutingMiss},
		{free[0], api.RoutingMiss}, {free[2], api.RoutingMiss}} {
		if got := EnvRouting(c.sb, key); got != c.want {
			t.Errorf("%s: routing %q, want %q", c.sb.Name, got, c.want)
		}
	}
}

func TestValidatePoolEnv(t *testing.T) {
	for _, c := range []struct {
		req api.AcquireLeaseRequest
		ok  bool
	}{
		{api.AcquireLeaseRequest{}, true},
		{api.AcquireLeaseRequest{Requirements: []string{"pandas>=2"}}, true},
		{api.AcquireLeaseRequest{EnvName: "data"}, true},
		{api.AcquireLeaseRequest{Requirements: []string{"pandas"}, EnvName: "data"}, false},
		{api.AcquireLeaseRequest{Requirements: []string{"-r x.txt"}}, false},
		{api.AcquireLeaseRequest{EnvName: ".hidden"}, false},
	} {
		if apiErr := ValidatePoolEnv(c.req); (apiErr == nil) != c.ok || (apiErr != nil && apiErr.Code != api.CodeInvalidArgument) {
			t.Errorf("%+v: %v", c.req, apiErr)
		}
	}
}
