package controller

import (
	"context"
	"strings"
	"testing"

	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"

	"github.com/agentbox/terraform-provider-agentbox/internal/api/v1alpha1"
)

// TestRunScheduleAdmission: the CRD's validation refuses at admission what
// can never be a schedule (six fields, @every, a TZ= prefix, a policy or
// limit out of range, no command, a target that is not exactly one of
// an agent, a pool and a template, job options without a template), and
// defaults the policy and the history limits.
func TestRunScheduleAdmission(t *testing.T) {
	c, _ := startEnvtest(t)
	ctx := context.Background()
	must(t, c.Create(ctx, &corev1.Namespace{ObjectMeta: metav1.ObjectMeta{Name: unitNS}}))

	schedule := func(name string, mutate func(*v1alpha1.RunScheduleSpec)) *v1alpha1.RunSchedule {
		rs := &v1alpha1.RunSchedule{ObjectMeta: metav1.ObjectMeta{Name: name, Namespace: unitNS},
			Spec: v1alpha1.RunScheduleSpec{Schedule: "*/5 * * * *", Target: v1alpha1.RunScheduleTarget{AgentID: "agent-1"},
				Command: v1alpha1.RunScheduleCommand{Argv: []string{"true"}}}}
		if mutate != nil {
			mutate(&rs.Spec)
		}
		return rs
	}
	ok := schedule("ok", nil)
	must(t, c.Create(ctx, ok))
	if ok.Spec.ConcurrencyPolicy != v1alpha1.ConcurrencyForbid || ok.Spec.SuccessfulRunsHistoryLimit == nil ||
		*ok.Spec.SuccessfulRunsHistoryLimit != 3 || ok.Spec.FailedRunsHistoryLimit == nil || *ok.Spec.FailedRunsHistoryLimit != 1 {
		t.Errorf("defaults: %+v", ok.Spec)
	}
	must(t, c.Create(ctx, schedule("daily", func(s *v1alpha1.RunScheduleSpec) { s.Schedule = "@daily"; s.TimeZone = "Europe/Berlin" })))
	// The other targets: a pool, and a template with or without the job's
	// options.
	must(t, c.Create(ctx, schedule("pool", func(s *v1alpha1.RunScheduleSpec) { s.Target = v1alpha1.RunScheduleTarget{Pool: "py"} })))
	must(t, c.Create(ctx, schedule("job", func(s *v1alpha1.RunScheduleSpec) {
		s.Target = v1alpha1.RunScheduleTarget{Template: "standard", Job: &v1alpha1.RunScheduleJob{BackoffLimit: new(int32(10)),
			ActiveDeadlineSeconds: new(int64(600)), TTLSecondsAfterFinished: new(int32(0))}}
	})))
	must(t, c.Create(ctx, schedule("job-plain", func(s *v1alpha1.RunScheduleSpec) {
		s.Target = v1alpha1.RunScheduleTarget{Template: "standard"}
	})))
	// A schedule written before the other targets (agentID alone, as
	// JSON without the new fields) is still valid, and stays so on update.
	must(t, c.Update(ctx, ok))

	for _, bad := range []struct {
		name, want string
		mutate     func(*v1alpha1.RunScheduleSpec)
	}{
		{"six-fields", "five fields", func(s *v1alpha1.RunScheduleSpec) { s.Schedule = "0 */5 * * * *" }},
		{"four-fields", "five fields", func(s *v1alpha1.RunScheduleSpec) { s.Schedule = "* * * *" }},
		{"every", "@every", func(s *v1alpha1.RunScheduleSpec) { s.Schedule = "@every 1m" }},
		{"tz", "spec.timeZone", func(s *v1alpha1.RunScheduleSpec) { s.Schedule = "CRON_TZ=UTC * * * * *" }},
		{"policy", "concurrencyPolicy", func(s *v1alpha1.RunScheduleSpec) { s.ConcurrencyPolicy = "Sometimes" }},
		{"limit", "successfulRunsHistoryLimit", func(s *v1alpha1.RunScheduleSpec) { s.SuccessfulRunsHistoryLimit = new(int32(-1)) }},
		{"deadline", "startingDeadlineSeconds", func(s *v1alpha1.RunScheduleSpec) { s.StartingDeadlineSeconds = new(int64(0)) }},
		{"no-command", "argv", func(s *v1alpha1.RunScheduleSpec) { s.Command.Argv = nil }},
		{"no-target", "exactly one of agentID, pool and template", func(s *v1alpha1.RunScheduleSpec) { s.Target.AgentID = "" }},
		{"agent-and-pool", "exactly one of agentID, pool and template", func(s *v1alpha1.RunScheduleSpec) { s.Target.Pool = "py" }},
		{"pool-and-template", "exactly one of agentID, pool and template", func(s *v1alpha1.RunScheduleSpec) {
			s.Target = v1alpha1.RunScheduleTarget{Pool: "py", Template: "standard"}
		}},
		{"job-of-agent", "job applies only to a template target", func(s *v1alpha1.RunScheduleSpec) {
			s.Target.Job = &v1alpha1.RunScheduleJob{BackoffLimit: new(int32(1))}
		}},
		{"job-of-pool", "job applies only to a template target", func(s *v1alpha1.RunScheduleSpec) {
			s.Target = v1alpha1.RunScheduleTarget{Pool: "py", Job: &v1alpha1.RunScheduleJob{}}
		}},
		{"backoff", "backoffLimit", func(s *v1alpha1.RunScheduleSpec) {
			s.Target = v1alpha1.RunScheduleTarget{Template: "standard", Job: &v1alpha1.RunScheduleJob{BackoffLimit: new(int32(11))}}
		}},
		{"deadline-zero", "activeDeadlineSeconds", func(s *v1alpha1.RunScheduleSpec) {
			s.Target = v1alpha1.RunScheduleTarget{Template: "standard", Job: &v1alpha1.RunScheduleJob{ActiveDeadlineSeconds: new(int64(0))}}
		}},
		{"ttl-negative", "ttlSecondsAfterFinished", func(s *v1alpha1.RunScheduleSpec) {
			s.Target = v1alpha1.RunScheduleTarget{Template: "standard", Job: &v1alpha1.RunScheduleJob{TTLSecondsAfterFinished: new(int32(-1))}}
		}},
		{"pool-name", "spec.target.pool", func(s *v1alpha1.RunScheduleSpec) { s.Target = v1alpha1.RunScheduleTarget{Pool: "team-a/py"} }},
		{"template-name", "spec.target.template", func(s *v1alpha1.RunScheduleSpec) {
			s.Target = v1alpha1.RunScheduleTarget{Template: "Standard"}
		}},
	} {
		err := c.Create(ctx, schedule(bad.name, bad.mutate))
		if err == nil || !strings.Contains(err.Error(), bad.want) {
			t.Errorf("%s: %v, want a refusal naming %s", bad.name, err, bad.want)
		}
	}
}
