package benchreport

import (
	"math"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"
)

func TestPercentile(t *testing.T) {
	vs := []float64{5, 1, 4, 2, 3}
	for _, c := range []struct{ pct, want float64 }{{50, 3}, {99, 5}, {0, 1}, {20, 1}, {40, 2}} {
		if got := Percentile(vs, c.pct); got != c.want {
			t.Errorf("Percentile(%v, %v) = %v, want %v", vs, c.pct, got, c.want)
		}
	}
	if got := Percentile([]float64{1, 2, 3, 10}, 50); got != 2.5 {
		t.Errorf("median of an even count = %v, want 2.5", got)
	}
	if !math.IsNaN(Percentile(nil, 50)) {
		t.Error("percentile of nothing should be NaN")
	}
	if got := Millis([]time.Duration{1500 * time.Microsecond}); got[0] != 1.5 {
		t.Errorf("Millis = %v", got)
	}
}

func TestRecordReadTable(t *testing.T) {
	out := filepath.Join(t.TempDir(), "bench.jsonl")
	t.Setenv(EnvOut, out)
	Record(t, Figure{Name: "claim", Unit: "ms", Values: []float64{40, 45, 300}, Target: "p50 <= 50 ms", Met: Bool(true)})
	Record(t, Figure{Name: "rate", Unit: "/s", Values: []float64{120}, Target: ">= 300/s", Met: Bool(false), Note: "burst of 24"})
	Record(t, Figure{Name: "claim", Unit: "ms", Values: []float64{60}, Target: "p50 <= 50 ms", Met: Bool(false)})
	Record(t, Figure{Name: "plan", Unit: "s", Values: []float64{2}, Target: "report"})

	f, err := os.Open(out)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	figs, err := Read(f)
	if err != nil {
		t.Fatal(err)
	}
	if len(figs) != 4 {
		t.Fatalf("read %d figures, want 4", len(figs))
	}
	var b strings.Builder
	if err := Table(&b, figs); err != nil {
		t.Fatal(err)
	}
	lines := strings.Split(strings.TrimSpace(b.String()), "\n")
	if len(lines) != 4 {
		t.Fatalf("table has %d lines, want a header and 3 rows:\n%s", len(lines), b.String())
	}
	// The figure recorded twice keeps its first place and its last value.
	if !strings.HasPrefix(lines[1], "claim") || !strings.Contains(lines[1], "60.0 ms") || !strings.Contains(lines[1], "MISSED") {
		t.Errorf("claim row = %q", lines[1])
	}
	if !strings.Contains(lines[2], "120/s") || !strings.Contains(lines[2], "MISSED") || !strings.Contains(lines[2], "burst of 24") {
		t.Errorf("rate row = %q", lines[2])
	}
	if !strings.Contains(lines[3], "see note") {
		t.Errorf("a target without a verdict should say so: %q", lines[3])
	}
}

func TestReadRejectsGarbageAndEmpty(t *testing.T) {
	if _, err := Read(strings.NewReader("")); err == nil {
		t.Error("an empty file should be an error: a bench that measured nothing is not a result")
	}
	if _, err := Read(strings.NewReader("{\"name\":\"a\",\"values\":[1]}\nnot json\n")); err == nil || !strings.Contains(err.Error(), "line 2") {
		t.Errorf("bad line: %v", err)
	}
}
