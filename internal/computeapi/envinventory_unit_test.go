package computeapi

import (
	"context"
	"reflect"
	"testing"
	"time"

	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"

	"github.com/agentbox/terraform-provider-agentbox/internal/api/v1alpha1"
	"github.com/agentbox/terraform-provider-agentbox/internal/store"
	"github.com/agentbox/terraform-provider-agentbox/internal/supervisor/supervisorapi"
)

// What a call that learned of a change writes into the inventory: only
// what differs, a build as a mark of now (none over a build under way),
// and, with any write, the removal of building marks that have expired.
func TestEnvInventoryChanges(t *testing.T) {
	now := time.Unix(1_800_000_000, 0)
	p := v1alpha1.AnnotationPythonEnvPrefix
	sb := &v1alpha1.Sandbox{ObjectMeta: metav1.ObjectMeta{Annotations: map[string]string{
		p + "held":    v1alpha1.PythonEnvBuilt,
		p + "running": v1alpha1.PythonEnvBuildingAt(now.Add(-time.Minute)),
		p + "dead":    v1alpha1.PythonEnvBuildingAt(now.Add(-v1alpha1.PythonEnvBuildingMaxAge - time.Minute)),
		"other":       "kept",
	}}}
	for _, tc := range []struct {
		name string
		set  map[string]string
		want map[string]any
	}{
		{"nothing new", map[string]string{"held": v1alpha1.PythonEnvBuilt, "running": v1alpha1.PythonEnvBuilding, "gone": ""}, map[string]any{}},
		{"a build starts", map[string]string{"new": v1alpha1.PythonEnvBuilding},
			map[string]any{p + "new": "building@1800000000", p + "dead": nil}},
		{"an expired build starts again", map[string]string{"dead": v1alpha1.PythonEnvBuilding},
			map[string]any{p + "dead": "building@1800000000"}},
		{"a build ends", map[string]string{"running": v1alpha1.PythonEnvBuilt},
			map[string]any{p + "running": v1alpha1.PythonEnvBuilt, p + "dead": nil}},
		{"an eviction", map[string]string{"held": ""}, map[string]any{p + "held": nil, p + "dead": nil}},
	} {
		if got := envInventoryChanges(sb, tc.set, now); !reflect.DeepEqual(got, tc.want) {
			t.Errorf("%s: patch %v, want %v", tc.name, got, tc.want)
		}
	}
}

// The keep-alive health call of a free warm sandbox's kept connection
// brings its supervisor's evictions to its inventory, with no list call:
// an environment recorded built that the answer no longer lists goes, one
// it lists stays, and an expired building mark goes with the write.
func TestWarmHealthEvictsFromInventory(t *testing.T) {
	f := servedPoolFixture(t)
	p := v1alpha1.AnnotationPythonEnvPrefix
	sb := f.sandboxNamed(t, "w-1")
	if sb.Annotations == nil {
		sb.Annotations = map[string]string{}
	}
	sb.Annotations[p+"kept"] = v1alpha1.PythonEnvBuilt
	sb.Annotations[p+"evicted"] = v1alpha1.PythonEnvBuilt
	sb.Annotations[p+"dead"] = v1alpha1.PythonEnvBuildingAt(time.Now().Add(-v1alpha1.PythonEnvBuildingMaxAge - time.Minute))
	if err := f.kube.Update(context.Background(), sb); err != nil {
		t.Fatal(err)
	}
	f.sup.envs.Store(&[]supervisorapi.EnvInfo{{Name: "kept"}})
	f.services.conns.SetKeepAlive(100 * time.Millisecond)
	f.services.WarmPoolEvents().OnAdd(f.sandboxNamed(t, "w-1"), true)
	waitFor(t, "the evicted environment to leave the inventory", func() bool {
		a := f.sandboxNamed(t, "w-1").Annotations
		_, evicted := a[p+"evicted"]
		_, dead := a[p+"dead"]
		return !evicted && !dead && a[p+"kept"] == v1alpha1.PythonEnvBuilt
	})
	// A supervisor that keeps no environments tells nothing.
	f.sup.envs.Store(nil)
	calls := f.sup.healthCalls.Load()
	waitFor(t, "more health calls", func() bool { return f.sup.healthCalls.Load() >= calls+2 })
	if a := f.sandboxNamed(t, "w-1").Annotations; a[p+"kept"] != v1alpha1.PythonEnvBuilt {
		t.Errorf("an answer without environments emptied the inventory: %v", a)
	}
}

// A job run's sandbox carries the environment the run named, by which the
// Sandbox controller routes its adoption of a warm sandbox.
func TestJobSandboxAnnotations(t *testing.T) {
	for _, c := range []struct {
		name, envName string
		reqs          []string
		want          map[string]string
	}{
		{"none", "", nil, map[string]string{v1alpha1.AnnotationCreatedByRequest: "run-1"}},
		{"by name", "data", nil, map[string]string{v1alpha1.AnnotationCreatedByRequest: "run-1", v1alpha1.AnnotationPythonEnvName: "data"}},
		{"by requirements", "", []string{"numpy", "pandas>=2"},
			map[string]string{v1alpha1.AnnotationCreatedByRequest: "run-1", v1alpha1.AnnotationPythonRequirements: "numpy pandas>=2"}},
	} {
		run := store.Run{ID: "run-1"}
		run.Command.PoolEnvName, run.Command.PoolRequirements = c.envName, c.reqs
		if got := jobSandboxAnnotations(run); !reflect.DeepEqual(got, c.want) {
			t.Errorf("%s: %v, want %v", c.name, got, c.want)
		}
	}
}
