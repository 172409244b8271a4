// Package benchreport collects the figures of `make bench` from the
// benchmarks that measure them, in whatever package they live, and prints
// them as one table.
//
// A benchmark records a Figure with Record. When AGENTBOX_BENCH_OUT names
// a file, the figure is appended to it as one JSON line, so that figures
// from several test binaries (and several runs) end up in one place;
// `agentbox-bench table FILE` prints them. Figures are printed, never
// asserted: the machines they run on are shared and noisy.
package benchreport

import (
	"bufio"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"math"
	"os"
	"slices"
	"strings"
	"sync"
	"text/tabwriter"
	"time"
)

// EnvOut names the JSON-lines file that Record appends to.
const EnvOut = "AGENTBOX_BENCH_OUT"

// Figure is one row of the table: one measured quantity, its samples and
// its target.
type Figure struct {
	// Name says what was measured, as the table names it.
	Name string `json:"name"`
	// Unit is the unit of Values: "ms", "s", "MiB", "/s", "x" (a ratio).
	Unit string `json:"unit"`
	// Values are the samples. A figure measured once has one.
	Values []float64 `json:"values"`
	// Target is the goal in words ("p50 <= 50 ms"); empty if none.
	Target string `json:"target,omitempty"`
	// Met says whether the target was reached; nil when there is no
	// target or it cannot be judged from these samples alone.
	Met *bool `json:"met,omitempty"`
	// Note carries what a reader needs to interpret the figure: the
	// other side of a comparison, the load, the sample size's reason.
	Note string `json:"note,omitempty"`
}

// Median returns the figure's median, NaN without samples.
func (f Figure) Median() float64 { return Percentile(f.Values, 50) }

// P99 returns the figure's 99th percentile (nearest rank).
func (f Figure) P99() float64 { return Percentile(f.Values, 99) }

// Percentile returns the nearest-rank percentile of vs, NaN if empty.
func Percentile(vs []float64, pct float64) float64 {
	if len(vs) == 0 {
		return math.NaN()
	}
	s := slices.Clone(vs)
	slices.Sort(s)
	if pct == 50 && len(s)%2 == 0 {
		return (s[len(s)/2-1] + s[len(s)/2]) / 2
	}
	i := int(math.Ceil(pct / 100 * float64(len(s))))
	return s[min(max(i-1, 0), len(s)-1)]
}

// Millis converts durations to the "ms" unit.
func Millis(ds []time.Duration) []float64 {
	out := make([]float64, len(ds))
	for i, d := range ds {
		out[i] = float64(d) / float64(time.Millisecond)
	}
	return out
}

// Bool returns a pointer to b, for Figure.Met.
func Bool(b bool) *bool { return &b }

// TB is the part of testing.TB that Record uses.
type TB interface {
	Helper()
	Logf(format string, args ...any)
	Errorf(format string, args ...any)
}

var mu sync.Mutex

// Record logs f and, when AGENTBOX_BENCH_OUT is set, appends it to that file.
func Record(t TB, f Figure) {
	t.Helper()
	t.Logf("bench: %s", f)
	path := os.Getenv(EnvOut)
	if path == "" {
		return
	}
	line, err := json.Marshal(f)
	if err != nil {
		t.Errorf("bench figure %q: %v", f.Name, err)
		return
	}
	mu.Lock()
	defer mu.Unlock()
	// O_APPEND writes of one line are atomic enough for the test binaries
	// that `make bench` runs one after another.
	file, err := os.OpenFile(path, os.O_CREATE|os.O_APPEND|os.O_WRONLY, 0o644)
	if err != nil {
		t.Errorf("bench figure %q: %v", f.Name, err)
		return
	}
	_, err = file.Write(append(line, '\n'))
	if cerr := file.Close(); err == nil {
		err = cerr
	}
	if err != nil {
		t.Errorf("bench figure %q: %v", f.Name, err)
	}
}

// String formats f on one line, as Record logs it.
func (f Figure) String() string {
	s := fmt.Sprintf("%s: median %s, p99 %s, n=%d", f.Name, f.format(f.Median()), f.format(f.P99()), len(f.Values))
	if f.Target != "" {
		s += fmt.Sprintf(" (target %s: %s)", f.Target, f.verdict())
	}
	if f.Note != "" {
		s += "; " + f.Note
	}
	return s
}

func (f Figure) format(v float64) string {
	if math.IsNaN(v) {
		return "-"
	}
	var num string
	switch a := math.Abs(v); {
	case a >= 100:
		num = fmt.Sprintf("%.0f", v)
	case a >= 10:
		num = fmt.Sprintf("%.1f", v)
	default:
		num = fmt.Sprintf("%.2f", v)
	}
	switch f.Unit {
	case "x":
		return num + "x"
	case "/s":
		return num + "/s"
	case "":
		return num
	}
	return num + " " + f.Unit
}

func (f Figure) verdict() string {
	switch {
	case f.Target == "":
		return ""
	case f.Met == nil:
		return "see note"
	case *f.Met:
		return "met"
	}
	return "MISSED"
}

// Read parses a JSON-lines file of figures written by Record.
func Read(r io.Reader) ([]Figure, error) {
	var out []Figure
	sc := bufio.NewScanner(r)
	sc.Buffer(make([]byte, 0, 64<<10), 16<<20)
	for n := 1; sc.Scan(); n++ {
		line := strings.TrimSpace(sc.Text())
		if line == "" {
			continue
		}
		var f Figure
		if err := json.Unmarshal([]byte(line), &f); err != nil {
			return nil, fmt.Errorf("line %d: %w", n, err)
		}
		out = append(out, f)
	}
	if err := sc.Err(); err != nil {
		return nil, err
	}
	if len(out) == 0 {
		return nil, errors.New("no figures")
	}
	return out, nil
}

// Table writes figures as one aligned table, in the order given; a figure
// recorded twice (two runs into one file) keeps its last value.
func Table(w io.Writer, figures []Figure) error {
	var order []string
	last := map[string]Figure{}
	for _, f := range figures {
		if _, seen := last[f.Name]; !seen {
			order = append(order, f.Name)
		}
		last[f.Name] = f
	}
	tw := tabwriter.NewWriter(w, 0, 0, 2, ' ', 0)
	fmt.Fprintln(tw, "figure\tmedian\tp99\tn\ttarget\tverdict\tnote")
	for _, name := range order {
		f := last[name]
		fmt.Fprintf(tw, "%s\t%s\t%s\t%d\t%s\t%s\t%s\n", f.Name, f.format(f.Median()), f.format(f.P99()), len(f.Values), f.Target, f.verdict(), f.Note)
	}
	return tw.Flush()
}
