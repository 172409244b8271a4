package store_test

import (
	"context"
	"encoding/json"
	"errors"
	"testing"
	"time"

	"github.com/agentbox/terraform-provider-agentbox/internal/store"
)

// testRunArtifacts: a run's artifacts are recorded while it is live, each
// with its artifact event before the end; nothing is recorded once it has
// ended; the records list by path and go with the run; and retention
// leaves a run whose objects were not deleted yet.
func testRunArtifacts(t *testing.T, b backend) {
	ctx := context.Background()
	clk := newClock()
	s := open(t, b.newDSN(t), store.Options{Now: clk.Now})

	run := mustCreateRun(t, s, agentRun("tok-1", ""))
	mustStartRun(t, s, run.ID, "replica-a")
	prefix := "agentbox/_runs/" + run.ID + "/"
	if err := s.BeginRunArtifacts(ctx, run.ID, "s3", prefix); err != nil {
		t.Fatal(err)
	}
	clk.Advance(time.Second)
	ev, err := s.RecordRunArtifact(ctx, store.RunArtifact{RunID: run.ID, Path: "artifacts/b.json", Size: 5,
		SHA256: "aa", ObjectKey: prefix + "artifacts/b.json"})
	if err != nil {
		t.Fatal(err)
	}
	var data store.ArtifactEventData
	if err := json.Unmarshal([]byte(ev.Data), &data); err != nil || ev.Type != store.RunEventArtifact ||
		data.Path != "artifacts/b.json" || data.Size != 5 || data.SHA256 != "aa" || data.Error != "" {
		t.Fatalf("artifact event %+v (%+v, %v)", ev, data, err)
	}
	if _, err := s.RecordRunArtifact(ctx, store.RunArtifact{RunID: run.ID, Path: "artifacts/a.bin", Size: 9 << 20,
		Error: "9437184 bytes is over the per-file limit of 1048576"}); err != nil {
		t.Fatal(err)
	}
	for _, bad := range []store.RunArtifact{
		{RunID: run.ID, Path: "", Size: 1, ObjectKey: "k"},
		{RunID: run.ID, Path: "x", Size: -1, ObjectKey: "k"},
		{RunID: run.ID, Path: "x", Size: 1},
		{RunID: run.ID, Path: "x", Size: 1, ObjectKey: "k", Error: "both"},
	} {
		if _, err := s.RecordRunArtifact(ctx, bad); !errors.Is(err, store.ErrInvalid) {
			t.Errorf("record %+v: %v, want ErrInvalid", bad, err)
		}
	}
	if _, err := s.RecordRunArtifact(ctx, store.RunArtifact{RunID: "run-none", Path: "x", Size: 1, ObjectKey: "k"}); !errors.Is(err, store.ErrNotFound) {
		t.Errorf("record for no run: %v", err)
	}
	if err := s.EndRunArtifacts(ctx, run.ID, store.ArtifactsCollected, ""); err != nil {
		t.Fatal(err)
	}
	if _, err := s.FinishRun(ctx, run.ID, store.RunResult{Status: store.RunSucceeded}); err != nil {
		t.Fatal(err)
	}
	if _, err := s.RecordRunArtifact(ctx, store.RunArtifact{RunID: run.ID, Path: "late", Size: 1, ObjectKey: "k"}); !errors.Is(err, store.ErrRunFinished) {
		t.Errorf("record after the end: %v, want ErrRunFinished", err)
	}
	evs := allEvents(t, s, run.ID)
	checkSeqs(t, evs)
	var types []store.RunEventType
	for _, e := range evs {
		types = append(types, e.Type)
	}
	want := []store.RunEventType{store.RunEventState, store.RunEventArtifact, store.RunEventArtifact, store.RunEventState, store.RunEventEnd}
	if len(types) != len(want) {
		t.Fatalf("log types %v, want %v", types, want)
	}
	for i := range want {
		if types[i] != want[i] {
			t.Fatalf("log types %v, want %v", types, want)
		}
	}

	arts, coll, err := s.ListRunArtifacts(ctx, run.ID)
	if err != nil || len(arts) != 2 || coll == nil {
		t.Fatalf("list: %+v, %+v, %v", arts, coll, err)
	}
	if a := arts[0]; a.Path != "artifacts/a.bin" || a.Uploaded() || a.Error == "" || a.UploadedAt != nil {
		t.Errorf("first artifact %+v", a)
	}
	if a := arts[1]; a.Path != "artifacts/b.json" || !a.Uploaded() || a.UploadedAt == nil || !a.UploadedAt.Equal(clk.Now().Add(-0).Truncate(time.Microsecond)) {
		t.Errorf("second artifact %+v (now %s)", a, clk.Now())
	}
	if coll.State != store.ArtifactsCollected || coll.Store != "s3" || coll.Prefix != prefix || coll.FinishedAt == nil {
		t.Errorf("collection %+v", coll)
	}
	if a, err := s.GetRunArtifact(ctx, run.ID, "artifacts/b.json"); err != nil || a.Size != 5 || a.SHA256 != "aa" {
		t.Errorf("get: %+v, %v", a, err)
	}
	if _, err := s.GetRunArtifact(ctx, run.ID, "nope"); !errors.Is(err, store.ErrNotFound) {
		t.Errorf("get a missing artifact: %v", err)
	}

	// A run whose platform keeps no artifacts says why, in its record and
	// its log.
	bare := mustCreateRun(t, s, agentRun("tok-1", ""))
	mustStartRun(t, s, bare.ID, "replica-a")
	if err := s.EndRunArtifacts(ctx, bare.ID, store.ArtifactsNotKept, ""); !errors.Is(err, store.ErrInvalid) {
		t.Errorf("not kept without a reason: %v", err)
	}
	if err := s.EndRunArtifacts(ctx, bare.ID, store.ArtifactsNotKept, "no object store"); err != nil {
		t.Fatal(err)
	}
	if _, err := s.FinishRun(ctx, bare.ID, store.RunResult{Status: store.RunFailed}); err != nil {
		t.Fatal(err)
	}
	if _, coll, err := s.ListRunArtifacts(ctx, bare.ID); err != nil || coll == nil || coll.State != store.ArtifactsNotKept || coll.Message != "no object store" {
		t.Errorf("not kept: %+v, %v", coll, err)
	}
	if evs := allEvents(t, s, bare.ID); len(evs) != 4 || evs[1].Type != store.RunEventArtifact {
		t.Errorf("log of a run that kept none: %+v", evs)
	}

	// Retention: the run with objects stays until they are forgotten.
	clk.Advance(time.Hour)
	bound := clk.Now()
	todo, err := s.RunArtifactsToDelete(ctx, bound, bound, 10)
	if err != nil || len(todo) != 1 || todo[0].RunID != run.ID || todo[0].Prefix != prefix {
		t.Fatalf("to delete: %+v, %v", todo, err)
	}
	if n, err := s.DeleteFinishedRuns(ctx, bound); err != nil || n != 1 {
		t.Fatalf("delete with objects left: %d, %v; want the run without objects alone", n, err)
	}
	if _, err := s.GetRun(ctx, run.ID); err != nil {
		t.Fatalf("the run with objects left was deleted: %v", err)
	}
	if err := s.ForgetRunArtifactObjects(ctx, run.ID); err != nil {
		t.Fatal(err)
	}
	if todo, err := s.RunArtifactsToDelete(ctx, bound, bound, 10); err != nil || len(todo) != 0 {
		t.Fatalf("to delete after forgetting: %+v, %v", todo, err)
	}
	if n, err := s.DeleteFinishedRuns(ctx, bound); err != nil || n != 1 {
		t.Fatalf("delete: %d, %v", n, err)
	}
	if arts, coll, err := s.ListRunArtifacts(ctx, run.ID); err != nil || len(arts) != 0 || coll != nil {
		t.Errorf("records outlived their run: %+v, %+v, %v", arts, coll, err)
	}

	// A run with a TTL of its own: its objects are due at its expiry,
	// whatever the retention, and its record goes only after them.
	ttl := 60
	tr := agentRun("tok-1", "")
	tr.TTLSecondsAfterFinished = &ttl
	timed := mustCreateRun(t, s, tr)
	mustStartRun(t, s, timed.ID, "replica-a")
	if err := s.BeginRunArtifacts(ctx, timed.ID, "s3", "agentbox/_runs/"+timed.ID+"/"); err != nil {
		t.Fatal(err)
	}
	if _, err := s.FinishRun(ctx, timed.ID, store.RunResult{Status: store.RunSucceeded}); err != nil {
		t.Fatal(err)
	}
	var noRetention time.Time
	if todo, err := s.RunArtifactsToDelete(ctx, noRetention, clk.Now(), 10); err != nil || len(todo) != 0 {
		t.Fatalf("to delete before the TTL: %+v, %v", todo, err)
	}
	clk.Advance(2 * time.Minute)
	todo, err = s.RunArtifactsToDelete(ctx, noRetention, clk.Now(), 10)
	if err != nil || len(todo) != 1 || todo[0].RunID != timed.ID {
		t.Fatalf("to delete past the TTL: %+v, %v", todo, err)
	}
	if n, err := s.DeleteExpiredRuns(ctx, clk.Now()); err != nil || n != 0 {
		t.Fatalf("delete an expired run with objects left: %d, %v", n, err)
	}
	if err := s.ForgetRunArtifactObjects(ctx, timed.ID); err != nil {
		t.Fatal(err)
	}
	if n, err := s.DeleteExpiredRuns(ctx, clk.Now()); err != nil || n != 1 {
		t.Fatalf("delete the expired run once its objects are gone: %d, %v", n, err)
	}

	// A schedule's history limits leave a run with objects to retention.
	const sched = "team-a/nightly"
	r := agentRun("schedule:"+sched, "")
	r.Schedule = sched
	scheduled := mustCreateRun(t, s, r)
	mustStartRun(t, s, scheduled.ID, "replica-a")
	if err := s.BeginRunArtifacts(ctx, scheduled.ID, "s3", "agentbox/_runs/"+scheduled.ID+"/"); err != nil {
		t.Fatal(err)
	}
	if _, err := s.FinishRun(ctx, scheduled.ID, store.RunResult{Status: store.RunSucceeded}); err != nil {
		t.Fatal(err)
	}
	if n, err := s.PruneScheduleRuns(ctx, sched, 0, 0); err != nil || n != 0 {
		t.Fatalf("prune a schedule's run with objects left: %d, %v", n, err)
	}
	if err := s.ForgetRunArtifactObjects(ctx, scheduled.ID); err != nil {
		t.Fatal(err)
	}
	if n, err := s.PruneScheduleRuns(ctx, sched, 0, 0); err != nil || n != 1 {
		t.Fatalf("prune a schedule's run once its objects are gone: %d, %v", n, err)
	}
}
