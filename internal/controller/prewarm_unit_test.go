package controller

import (
	"strings"
	"testing"

	"k8s.io/apimachinery/pkg/api/meta"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/client-go/tools/events"

	"github.com/agentbox/terraform-provider-agentbox/internal/api/v1alpha1"
	"github.com/agentbox/terraform-provider-agentbox/internal/supervisor/pyenv"
)

// A warm sandbox's PythonEnvironmentsReady condition, from its inventory
// and a recorded failure, and the pool's from its sandboxes'; each change
// of reason comes with an event. (The builds themselves are the cluster
// test's.)
func TestPrewarmConditions(t *testing.T) {
	tpl := &v1alpha1.SandboxTemplate{Spec: v1alpha1.SandboxTemplateSpec{Python: v1alpha1.PythonPolicy{IndexURL: "http://127.0.0.1:9/simple/"}}}
	envs := []v1alpha1.WarmPythonEnvironment{{Requirements: []string{"numpy"}}, {Name: "plots", Requirements: []string{"matplotlib"}}}
	key, err := pyenv.RequirementsKey([]string{"numpy"}, tpl.Spec.Python.IndexURL, nil)
	must(t, err)
	rec := events.NewFakeRecorder(10)
	r := &SandboxReconciler{Recorder: rec}
	sb := func(annotations map[string]string) *v1alpha1.Sandbox {
		s := &v1alpha1.Sandbox{ObjectMeta: metav1.ObjectMeta{Name: "w", UID: "uid-w", Labels: map[string]string{v1alpha1.LabelWarmPool: "p"},
			Annotations: map[string]string{v1alpha1.AnnotationPrewarmEnvs: v1alpha1.PrewarmEnvsAnnotation(envs)}},
			Status: v1alpha1.SandboxStatus{Phase: v1alpha1.SandboxPhaseRunning,
				Conditions: []metav1.Condition{{Type: v1alpha1.ConditionReady, Status: metav1.ConditionTrue, Reason: v1alpha1.ReasonRunning}}}}
		for k, v := range annotations {
			s.Annotations[k] = v
		}
		return s
	}
	reason := func(s *v1alpha1.Sandbox) string {
		if c := meta.FindStatusCondition(s.Status.Conditions, v1alpha1.ConditionPythonEnvironmentsReady); c != nil {
			return c.Reason
		}
		return ""
	}

	done := sb(map[string]string{v1alpha1.AnnotationPythonEnvPrefix + key: v1alpha1.PythonEnvBuilt,
		v1alpha1.AnnotationPythonEnvPrefix + "plots": v1alpha1.PythonEnvBuilt})
	if next := r.prewarm(done, tpl, nil); next != 0 || reason(done) != v1alpha1.ReasonPrewarmed || !v1alpha1.PrewarmSettled(done) {
		t.Errorf("all built: requeue %v, reason %q", next, reason(done))
	}
	hash := prewarmHash(done.Annotations[v1alpha1.AnnotationPrewarmEnvs])
	failed := sb(map[string]string{v1alpha1.AnnotationPrewarmFailed: hash + ": no matching distribution for matplotlib"})
	if r.prewarm(failed, tpl, nil); reason(failed) != v1alpha1.ReasonPrewarmFailed || !v1alpha1.PrewarmSettled(failed) ||
		!strings.Contains(meta.FindStatusCondition(failed.Status.Conditions, v1alpha1.ConditionPythonEnvironmentsReady).Message, "no matching distribution") {
		t.Errorf("failed: conditions %+v", failed.Status.Conditions)
	}
	// A failure of other environments (the pool changed them since) is
	// not this one's: it is built again, and not leased meanwhile.
	stale := sb(map[string]string{v1alpha1.AnnotationPrewarmFailed: "0123456789ab: old", v1alpha1.AnnotationPythonEnvPrefix + key: v1alpha1.PythonEnvBuilt})
	r.prewarming.start(stale.UID, "busy") // as if a build were under way: none is started
	if next := r.prewarm(stale, tpl, nil); next == 0 || reason(stale) != v1alpha1.ReasonPrewarming || v1alpha1.PrewarmSettled(stale) {
		t.Errorf("stale failure: requeue %v, reason %q", next, reason(stale))
	}
	if got := strings.Join(drain(rec), "\n"); !strings.Contains(got, EventPrewarmed) || !strings.Contains(got, EventPrewarmFailed) ||
		!strings.Contains(got, EventPrewarmingEnvironments) {
		t.Errorf("events:\n%s", got)
	}

	// The pool: failed wins over building, building over done.
	pr := &SandboxWarmPoolReconciler{Recorder: rec}
	pool := &v1alpha1.SandboxWarmPool{Spec: v1alpha1.SandboxWarmPoolSpec{PythonEnvironments: envs}}
	pr.reportPrewarm(pool, tpl, []*v1alpha1.Sandbox{done, stale})
	if c := meta.FindStatusCondition(pool.Status.Conditions, v1alpha1.ConditionPythonEnvironmentsReady); c == nil || c.Reason != v1alpha1.ReasonPrewarming {
		t.Errorf("pool building: %+v", c)
	}
	pr.reportPrewarm(pool, tpl, []*v1alpha1.Sandbox{done, stale, failed})
	if c := meta.FindStatusCondition(pool.Status.Conditions, v1alpha1.ConditionPythonEnvironmentsReady); c == nil || c.Reason != v1alpha1.ReasonPrewarmFailed ||
		!strings.Contains(c.Message, "no matching distribution") {
		t.Errorf("pool failed: %+v", c)
	}
	pr.reportPrewarm(pool, tpl, []*v1alpha1.Sandbox{done})
	if c := meta.FindStatusCondition(pool.Status.Conditions, v1alpha1.ConditionPythonEnvironmentsReady); c == nil || c.Status != metav1.ConditionTrue {
		t.Errorf("pool done: %+v", c)
	}
	pool.Spec.PythonEnvironments = nil
	if pr.reportPrewarm(pool, tpl, []*v1alpha1.Sandbox{done}); meta.FindStatusCondition(pool.Status.Conditions, v1alpha1.ConditionPythonEnvironmentsReady) != nil {
		t.Error("a pool without environments keeps the condition")
	}
}

// A warm sandbox of a pool with pythonEnvironments counts as ready once
// they are built in it or their build failed, never while they are being
// built nor before it was handed the pool's current environments; a
// failure shows in the Ready condition's message, naming the environment.
func TestPoolReadyCountsPrewarm(t *testing.T) {
	tpl := &v1alpha1.SandboxTemplate{Spec: v1alpha1.SandboxTemplateSpec{Python: v1alpha1.PythonPolicy{IndexURL: "http://127.0.0.1:9/simple/"}}}
	envs := []v1alpha1.WarmPythonEnvironment{{Name: "plots", Requirements: []string{"matplotlib"}}}
	want := v1alpha1.PrewarmEnvsAnnotation(envs)
	ready := func(name string, annotations map[string]string) *v1alpha1.Sandbox {
		return &v1alpha1.Sandbox{ObjectMeta: metav1.ObjectMeta{Name: name, Annotations: annotations},
			Status: v1alpha1.SandboxStatus{Phase: v1alpha1.SandboxPhaseRunning,
				Conditions: []metav1.Condition{{Type: v1alpha1.ConditionReady, Status: metav1.ConditionTrue, Reason: v1alpha1.ReasonRunning}}}}
	}
	built := ready("built", map[string]string{v1alpha1.AnnotationPrewarmEnvs: want, v1alpha1.AnnotationPythonEnvPrefix + "plots": v1alpha1.PythonEnvBuilt})
	building := ready("building", map[string]string{v1alpha1.AnnotationPrewarmEnvs: want})
	// Holds the environment, but the pool's current set was not handed to
	// it yet (the pool just changed): not settled.
	unhanded := ready("unhanded", map[string]string{v1alpha1.AnnotationPythonEnvPrefix + "plots": v1alpha1.PythonEnvBuilt})
	failed := ready("failed", map[string]string{v1alpha1.AnnotationPrewarmEnvs: want,
		v1alpha1.AnnotationPrewarmFailed: prewarmHash(want) + `: environment "plots": no matching distribution`})

	rec := events.NewFakeRecorder(10)
	pr := &SandboxWarmPoolReconciler{Recorder: rec}
	pool := &v1alpha1.SandboxWarmPool{Spec: v1alpha1.SandboxWarmPoolSpec{Replicas: 2, PythonEnvironments: envs}}
	readyCond := func() *metav1.Condition {
		return meta.FindStatusCondition(pool.Status.Conditions, v1alpha1.ConditionReady)
	}

	pr.report("", pool, tpl, []*v1alpha1.Sandbox{built, building, unhanded}, 0, 0)
	if pool.Status.ReadyReplicas != 1 || readyCond().Status != metav1.ConditionFalse || !strings.Contains(readyCond().Message, "2 are building") {
		t.Errorf("one built, two building: ready %d, %+v", pool.Status.ReadyReplicas, readyCond())
	}
	pr.report("", pool, tpl, []*v1alpha1.Sandbox{built, failed}, 0, 0)
	if pool.Status.ReadyReplicas != 2 || readyCond().Reason != v1alpha1.ReasonPoolFull || !strings.Contains(readyCond().Message, "build failed") {
		t.Errorf("built and failed: ready %d, %+v", pool.Status.ReadyReplicas, readyCond())
	}
	pr.reportPrewarm(pool, tpl, []*v1alpha1.Sandbox{built, failed})
	if c := meta.FindStatusCondition(pool.Status.Conditions, v1alpha1.ConditionPythonEnvironmentsReady); c == nil ||
		c.Reason != v1alpha1.ReasonPrewarmFailed || !strings.Contains(c.Message, `environment "plots": no matching distribution`) {
		t.Errorf("the pool's PythonEnvironmentsReady names no failed environment: %+v", c)
	}
	// Without environments, readiness is the sandbox's own.
	pool.Spec.PythonEnvironments = nil
	pr.report("", pool, tpl, []*v1alpha1.Sandbox{building, unhanded}, 0, 0)
	if pool.Status.ReadyReplicas != 2 {
		t.Errorf("a pool without environments counts %d ready", pool.Status.ReadyReplicas)
	}
	if got := prewarmLabel(v1alpha1.WarmPythonEnvironment{Requirements: []string{"numpy", "pandas>=2"}}); got != "of requirements numpy pandas>=2" {
		t.Errorf("label of an unnamed environment: %q", got)
	}
}
