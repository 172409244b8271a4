package controller

import (
	"fmt"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"testing"
	"time"

	corev1 "k8s.io/api/core/v1"
)

// EnvRSSImages lists sandbox images (comma-separated) whose supervisors
// TestSupervisorGVisorIdleRSS compares; empty: the one in EnvSandboxImage.
// An image may be followed by space-separated NAME=VALUE variables for the
// supervisor, to price a runtime setting such as GODEBUG.
const EnvRSSImages = "AGENTBOX_RSS_IMAGES"

// TestSupervisorGVisorIdleRSS measures only part (c) of
// TestSupervisorGVisorBench, the supervisor's idle RSS in a fresh gVisor
// pod (one health call, 10 s idle, gVisor's /proc/1/status), for several
// images in alternation, so that a change to the supervisor can be priced
// in minutes rather than the bench's full run (AGENTBOX_RSS_ROUNDS pods of
// each, 3 by default: the figure moves by a few MiB from pod to pod, with
// where the randomised Go heap falls among gVisor's 2 MiB allocation
// units). gVisor's /proc/1/smaps, which says which mappings the RSS is in,
// goes to AGENTBOX_BENCH_PROFILE_DIR when that is set.
func TestSupervisorGVisorIdleRSS(t *testing.T) {
	if os.Getenv(EnvBench) == "" {
		t.Skipf("%s is not set: the supervisor benchmarks run only on request", EnvBench)
	}
	images := splitImages(os.Getenv(EnvRSSImages))
	if len(images) == 0 {
		images = []string{os.Getenv(EnvSandboxImage)}
	}
	e := newClusterEnv(t)
	rounds := 3
	if n, err := strconv.Atoi(os.Getenv("AGENTBOX_RSS_ROUNDS")); err == nil && n > 0 {
		rounds = n
	}
	got := map[string][]int64{}
	for r := range rounds {
		for i, image := range images {
			fields := strings.Fields(image)
			var env []corev1.EnvVar
			for _, kv := range fields[1:] {
				k, v, _ := strings.Cut(kv, "=")
				env = append(env, corev1.EnvVar{Name: k, Value: v})
			}
			t.Setenv(EnvSandboxImage, fields[0])
			name := fmt.Sprintf("idle-%d-%d", r, i)
			p := e.gvisorPod(t, name, gvisorPodOptions{memoryLimit: "256Mi", workspaceCap: "64MiB", emptyDirSize: "128Mi", env: env})
			time.Sleep(10 * time.Second)
			st := p.procStatus(t)
			got[image] = append(got[image], st["VmRSS"])
			t.Logf("%s (%s): %v", name, image, st)
			if dir := os.Getenv("AGENTBOX_BENCH_PROFILE_DIR"); dir != "" {
				smaps := p.run(t, "cat", "/proc/1/smaps").Stdout
				must(t, os.MkdirAll(dir, 0o755))
				must(t, os.WriteFile(filepath.Join(dir, fmt.Sprintf("smaps-%s-%s", name, imageTag(image))), []byte(smaps), 0o644))
			}
			must(t, e.c.Delete(e.ctx, p.pod))
		}
	}
	for _, image := range images {
		t.Logf("supervisor idle VmRSS, fresh pod, %s: %v kB", image, got[image])
	}
}

func splitImages(s string) []string {
	var out []string
	for _, f := range strings.Split(s, ",") {
		if f = strings.TrimSpace(f); f != "" {
			out = append(out, f)
		}
	}
	return out
}

func imageTag(image string) string {
	image = strings.NewReplacer(" ", "_", "=", "-", ",", "_").Replace(image)
	if i := strings.LastIndex(image, ":"); i >= 0 {
		return image[i+1:]
	}
	return image
}
