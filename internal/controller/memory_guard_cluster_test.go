package controller

import (
	"context"
	"fmt"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	corev1 "k8s.io/api/core/v1"
	"k8s.io/apimachinery/pkg/api/resource"
	"k8s.io/client-go/kubernetes"

	"github.com/agentbox/terraform-provider-agentbox/internal/api/v1alpha1"
	apiclient "github.com/agentbox/terraform-provider-agentbox/internal/computeapi/client"
)

// TestMemoryGuardRepeatedOnCluster: in a real gVisor sandbox, through the
// Compute API, a run of big commands that each stay under the sandbox's
// memory all complete, and then memory bombs in a row are each stopped by
// the supervisor's memory guard (out_of_memory), without the sandbox
// being OOM-killed (no container restart) and with a background process
// started before them still alive after. The sandbox kernel (gVisor's
// sentry) keeps memory charged to the pod that the sandbox's meminfo does
// not show, and it grows with what commands did, so one bomb passing is
// not enough: the second and third meet what the first left behind.
//
// The pod's own memory cgroup is read from the node when the test runs on
// it (the test cluster's node is this machine), and logged beside the
// sandbox's meminfo at every step, so that a failure shows what was
// charged.
func TestMemoryGuardRepeatedOnCluster(t *testing.T) {
	for _, c := range []struct {
		name    string
		limit   string
		command int // MiB that each big command allocates and touches
	}{
		{"256Mi", "256Mi", 110},
		{"1Gi", "1Gi", 440},
	} {
		t.Run(c.name, func(t *testing.T) {
			memoryGuardRepeated(t, "memrep-"+strings.ToLower(c.name), c.limit, c.command)
		})
	}
}

// touchMiB allocates N MiB and writes one byte in every page, so that all
// of it is really in use, then exits 0.
const touchMiB = `
import os, sys
n = int(sys.argv[1]) << 20
b = bytearray(n)
b[::4096] = b'\x01' * len(range(0, n, 4096))
print(sum(b[::4096]) * 4096 >> 20, 'MiB touched', flush=True)
`

// holder is the background process: it holds a little memory of its own
// and sleeps, so that a guard that killed anything but the bomb, or a
// sandbox that was OOM-killed whole, shows as its absence.
const holder = `
import time
b = bytearray(4 << 20)
b[::4096] = b'\x01' * (len(b) // 4096)
time.sleep(3600)
`

func memoryGuardRepeated(t *testing.T, name, limit string, commandMiB int) {
	e, _, api, sbx := apiSandbox(t, name, func(tpl *v1alpha1.SandboxTemplate) {
		tpl.Spec.Resources = corev1.ResourceRequirements{
			Requests: corev1.ResourceList{corev1.ResourceCPU: resource.MustParse("100m"), corev1.ResourceMemory: resource.MustParse("64Mi")},
			Limits:   corev1.ResourceList{corev1.ResourceMemory: resource.MustParse(limit)},
		}
	})
	agent := sbx.Spec.AgentID
	ctx := e.ctx
	podName := PodName(sbx.WorkloadName())
	var pod corev1.Pod
	must(t, e.get(podName, &pod))
	cg := podMemoryCgroup(string(pod.UID))
	run := func(req apiclient.RunCommandRequest) (*apiclient.CommandResult, error) {
		if req.Cwd == "" {
			req.Cwd = "/tmp"
		}
		return api.RunCommand(ctx, agent, req)
	}
	// inUseMiB is what the sandbox's meminfo says is in use (what the
	// guard reads), -1 if it could not be read.
	inUseMiB := func() int64 {
		res, err := run(apiclient.RunCommandRequest{Command: []string{"sh", "-c",
			`awk '/^MemTotal/{t=$2} /^MemAvailable/{a=$2} END{print int((t-a)/1024)}' /proc/meminfo`}})
		if err != nil || res.ExitCode != 0 {
			return -1
		}
		n, err := strconv.ParseInt(strings.TrimSpace(res.Stdout), 10, 64)
		if err != nil {
			return -1
		}
		return n
	}
	// charged says what the sandbox's meminfo says is in use and what
	// the pod is charged on the node.
	charged := func(when string) {
		t.Helper()
		t.Logf("%s: sandbox meminfo in use %d MiB; pod cgroup on the node: %s", when, inUseMiB(), cg.describe())
	}

	res, err := run(apiclient.RunCommandRequest{Command: []string{"sh", "-c",
		`python3 -c "$HOLDER" >/dev/null 2>&1 & echo $!`}, Env: map[string]string{"HOLDER": holder}})
	if err != nil || res.ExitCode != 0 {
		t.Fatalf("starting the background process: %+v, %v", res, err)
	}
	holderPID := strings.TrimSpace(res.Stdout)
	time.Sleep(time.Second)
	baseline := inUseMiB()
	charged("start, background process " + holderPID + " running")

	for i := range 10 {
		start := time.Now()
		res, err := run(apiclient.RunCommandRequest{Command: []string{"python3", "-c", touchMiB, strconv.Itoa(commandMiB)}, TimeoutSeconds: 120})
		switch {
		case err != nil:
			t.Fatalf("%d MiB command %d: %v", commandMiB, i+1, err)
		case res.ExitCode != 0 || res.OutOfMemory:
			charged(fmt.Sprintf("after %d MiB command %d failed", commandMiB, i+1))
			t.Fatalf("%d MiB command %d: exit %d, signal %q, out of memory %v, stdout %q, stderr %q",
				commandMiB, i+1, res.ExitCode, res.Signal, res.OutOfMemory, res.Stdout, tail(res.Stderr, 300))
		}
		t.Logf("%d MiB command %d: %s in %v", commandMiB, i+1, strings.TrimSpace(res.Stdout), time.Since(start).Round(time.Millisecond))
	}
	charged(fmt.Sprintf("after ten %d MiB commands", commandMiB))

	// The guard's kills, as the supervisor logged them (the charge it
	// read, or the floor it held, and the group it killed).
	t.Cleanup(func() {
		cs, err := kubernetes.NewForConfig(e.cfg)
		if err != nil {
			return
		}
		logs, err := cs.CoreV1().Pods(e.ns).GetLogs(podName, &corev1.PodLogOptions{Container: ContainerName}).DoRaw(context.Background())
		if err != nil {
			t.Logf("supervisor logs: %v", err)
			return
		}
		for _, l := range strings.Split(string(logs), "\n") {
			if strings.Contains(l, "near its limit") {
				t.Log(l)
			}
		}
	})
	sampler := cg.sample(t)
	defer sampler.stop()
	mark := sampler.mark
	for i := range 3 {
		start := time.Now()
		mark(fmt.Sprintf("bomb %d", i+1))
		res, err := run(apiclient.RunCommandRequest{Command: []string{"python3", "-c", memoryBomb}, TimeoutSeconds: 120})
		mark(fmt.Sprintf("the end of bomb %d", i+1))
		took := time.Since(start).Round(time.Millisecond)
		if err != nil {
			charged(fmt.Sprintf("after memory bomb %d failed", i+1))
			t.Fatalf("memory bomb %d: the API did not answer after %v: %v", i+1, took, err)
		}
		lines := strings.Split(strings.TrimSpace(res.Stdout), "\n")
		if !res.OutOfMemory || res.Signal != "SIGKILL" {
			charged(fmt.Sprintf("after memory bomb %d", i+1))
			t.Fatalf("memory bomb %d: want it stopped by the memory guard (out_of_memory, SIGKILL), got exit %d, signal %q, out of memory %v, timed out %v after %v, last output %q, stderr %q",
				i+1, res.ExitCode, res.Signal, res.OutOfMemory, res.TimedOut, took, lines[len(lines)-1], tail(res.Stderr, 300))
		}
		charged(fmt.Sprintf("memory bomb %d stopped by the guard after %v at %q", i+1, took, lines[len(lines)-1]))
	}

	// The killed bombs' memory goes back to the host a moment after the
	// kill (gVisor's page allocator releases it in the background), and
	// until then the sandbox's meminfo counts it too: both come back to
	// about where they started.
	start := time.Now()
	for {
		used := inUseMiB()
		if used >= 0 && used <= baseline+32 {
			t.Logf("%d MiB in use again %v after the last bomb (%d MiB at the start)", used, time.Since(start).Round(time.Millisecond), baseline)
			break
		}
		if time.Since(start) > 30*time.Second {
			t.Errorf("%d MiB still in use 30 s after the last bomb, %d MiB at the start: the sandbox kept the bombs' memory", used, baseline)
			break
		}
		time.Sleep(100 * time.Millisecond)
	}
	charged("after the bombs' memory came back")

	res, err = run(apiclient.RunCommandRequest{Command: []string{"sh", "-c", "kill -0 " + holderPID + " && echo alive"}})
	if err != nil || strings.TrimSpace(res.Stdout) != "alive" {
		t.Errorf("the background process %s after the bombs: %+v, %v", holderPID, res, err)
	}
	must(t, e.get(podName, &pod))
	for _, cs := range pod.Status.ContainerStatuses {
		if cs.RestartCount != 0 {
			t.Errorf("container %s restarted %d times (last state %+v)", cs.Name, cs.RestartCount, cs.LastTerminationState)
		}
	}
	cg.logPeak(t)
}

// podCgroup is a pod's memory cgroup on the node, when the node is this
// machine (the test cluster's is); dir is empty otherwise.
type podCgroup struct {
	dir string
	v2  bool
}

// podMemoryCgroup finds the pod's memory cgroup under the test node's
// cgroup root, in a cgroup v1 memory hierarchy or in cgroup v2.
func podMemoryCgroup(uid string) podCgroup {
	for _, p := range []struct {
		glob string
		v2   bool
	}{
		{"/sys/fs/cgroup/memory/*/kubepods*/*/pod" + uid, false},
		{"/sys/fs/cgroup/memory/*/kubepods*/pod" + uid, false},
		{"/sys/fs/cgroup/*/kubepods*/*/pod" + uid, true},
		{"/sys/fs/cgroup/*/kubepods*/pod" + uid, true},
	} {
		if m, _ := filepath.Glob(p.glob); len(m) == 1 {
			return podCgroup{dir: m[0], v2: p.v2}
		}
	}
	return podCgroup{}
}

func (c podCgroup) read(name string) string {
	data, err := os.ReadFile(filepath.Join(c.dir, name))
	if err != nil {
		return "?"
	}
	return strings.TrimSpace(string(data))
}

func mib(bytes string) string {
	n, err := strconv.ParseInt(bytes, 10, 64)
	if err != nil {
		return bytes
	}
	return strconv.FormatInt(n>>20, 10) + " MiB"
}

// describe reads what the pod is charged and its main parts.
func (c podCgroup) describe() string {
	if c.dir == "" {
		return "not readable here"
	}
	stat := map[string]string{}
	for _, line := range strings.Split(c.read("memory.stat"), "\n") {
		if k, v, ok := strings.Cut(line, " "); ok {
			stat[k] = v
		}
	}
	if c.v2 {
		return fmt.Sprintf("current %s (anon %s, file %s, shmem %s, kernel %s)", mib(c.read("memory.current")),
			mib(stat["anon"]), mib(stat["file"]), mib(stat["shmem"]), mib(stat["kernel"]))
	}
	return fmt.Sprintf("usage %s (rss %s, cache %s, shmem %s, mapped_file %s, kmem %s)", mib(c.read("memory.usage_in_bytes")),
		mib(stat["total_rss"]), mib(stat["total_cache"]), mib(stat["total_shmem"]), mib(stat["total_mapped_file"]),
		mib(c.read("memory.kmem.usage_in_bytes")))
}

// chargeSampler reads the pod's charge every millisecond, when the test
// runs on the node, so that the peak of each step is known: the
// charge can pass the limit between two of the test's own readings.
type chargeSampler struct {
	t    *testing.T
	mu   sync.Mutex
	t0   time.Time
	line []string // the charge every 10 ms, and the marks
	// peaks is the highest charge since each mark.
	names []string
	peaks []int64
	done  chan struct{}
	ended chan struct{}
}

func (c podCgroup) sample(t *testing.T) *chargeSampler {
	s := &chargeSampler{t: t, t0: time.Now(), done: make(chan struct{}), ended: make(chan struct{})}
	if c.dir == "" {
		close(s.ended)
		return s
	}
	usage := "memory.usage_in_bytes"
	if c.v2 {
		usage = "memory.current"
	}
	go func() {
		defer close(s.ended)
		last := time.Duration(-1)
		for {
			select {
			case <-s.done:
				return
			case <-time.After(time.Millisecond):
			}
			n, err := strconv.ParseInt(c.read(usage), 10, 64)
			if err != nil {
				continue
			}
			s.mu.Lock()
			if len(s.peaks) > 0 {
				s.peaks[len(s.peaks)-1] = max(s.peaks[len(s.peaks)-1], n)
			}
			if d := time.Since(s.t0); d-last >= 10*time.Millisecond {
				last = d
				s.line = append(s.line, fmt.Sprintf("%d:%d", d.Milliseconds(), n>>20))
			}
			s.mu.Unlock()
		}
	}()
	return s
}

// mark starts a step: the peak is taken from here to the next mark.
func (s *chargeSampler) mark(name string) {
	s.mu.Lock()
	defer s.mu.Unlock()
	s.line = append(s.line, fmt.Sprintf("[%d %s]", time.Since(s.t0).Milliseconds(), name))
	s.names = append(s.names, name)
	s.peaks = append(s.peaks, 0)
}

// stop logs each step's peak charge, and on failure the whole timeline
// (ms since the first mark: MiB).
func (s *chargeSampler) stop() {
	close(s.done)
	<-s.ended
	s.mu.Lock()
	defer s.mu.Unlock()
	for i, name := range s.names {
		if s.peaks[i] > 0 {
			s.t.Logf("pod charge peak from %s to the next step: %d MiB", name, s.peaks[i]>>20)
		}
	}
	if s.t.Failed() && len(s.line) > 0 {
		s.t.Logf("pod charge timeline: %s", strings.Join(s.line, " "))
	}
}

func (c podCgroup) logPeak(t *testing.T) {
	t.Helper()
	switch {
	case c.dir == "":
	case c.v2:
		t.Logf("pod cgroup: peak %s, limit %s, events %q", mib(c.read("memory.peak")), mib(c.read("memory.max")),
			strings.ReplaceAll(c.read("memory.events"), "\n", ", "))
	default:
		t.Logf("pod cgroup: peak %s, limit %s, failcnt %s", mib(c.read("memory.max_usage_in_bytes")), mib(c.read("memory.limit_in_bytes")),
			c.read("memory.failcnt"))
	}
}

// TestMemoryGuardAfterForkBombOnCluster: every process in a gVisor
// sandbox costs the pod memory on the host that the sandbox's meminfo
// does not show, and keeps part of it charged after it ends (see
// runner.ChargeEstimate). Under a process limit of 1024, the default for
// every sandbox before, a fork bomb took a 256 MiB sandbox down in two
// seconds, faster than the guard could act. Now the default limit is what
// the pod's memory holds (256 here), the guard counts what processes cost,
// the guard or the timeout stops the bomb, and memory bombs after it, in
// the same sandbox, still meet the guard and not the pod's limit.
func TestMemoryGuardAfterForkBombOnCluster(t *testing.T) {
	e, _, api, sbx := apiSandbox(t, "memfork", func(tpl *v1alpha1.SandboxTemplate) {
		tpl.Spec.Resources = corev1.ResourceRequirements{
			Requests: corev1.ResourceList{corev1.ResourceCPU: resource.MustParse("100m"), corev1.ResourceMemory: resource.MustParse("64Mi")},
			Limits:   corev1.ResourceList{corev1.ResourceMemory: resource.MustParse("256Mi")},
		}
	})
	agent := sbx.Spec.AgentID
	ctx := e.ctx
	podName := PodName(sbx.WorkloadName())
	var pod corev1.Pod
	must(t, e.get(podName, &pod))
	cg := podMemoryCgroup(string(pod.UID))
	run := func(req apiclient.RunCommandRequest) (*apiclient.CommandResult, error) {
		req.Cwd = "/tmp"
		return api.RunCommand(ctx, agent, req)
	}
	charged := func(when string) {
		t.Helper()
		res, err := run(apiclient.RunCommandRequest{Command: []string{"sh", "-c",
			`awk '/^MemTotal/{t=$2} /^MemAvailable/{a=$2} END{print int((t-a)/1024)}' /proc/meminfo`}})
		inside := "?"
		if err == nil && res.ExitCode == 0 {
			inside = strings.TrimSpace(res.Stdout)
		}
		t.Logf("%s: sandbox meminfo in use %s MiB; pod cgroup on the node: %s", when, inside, cg.describe())
	}
	charged("start")
	res, err := run(apiclient.RunCommandRequest{Command: []string{"sh", "-c", "grep 'Max processes' /proc/self/limits"}})
	if err != nil {
		t.Fatalf("reading the commands' process limit: %v", err)
	}
	if f := strings.Fields(res.Stdout); len(f) < 4 || f[2] != "256" {
		t.Errorf("the commands' process limit in a 256 MiB sandbox: %+v, %v; want 256", res, err)
	}
	start := time.Now()
	res, err = run(apiclient.RunCommandRequest{Command: []string{"sh", "-c", "f(){ f | f & }; f; sleep 300"}, TimeoutSeconds: 10})
	if err != nil {
		t.Fatalf("fork bomb: %v", err)
	}
	t.Logf("fork bomb: ended after %v, timed out %v, signal %q, out of memory %v", time.Since(start).Round(time.Millisecond), res.TimedOut, res.Signal, res.OutOfMemory)
	if !res.TimedOut && !res.OutOfMemory {
		t.Errorf("fork bomb: exit %d, signal %q; want it stopped by the memory guard or the timeout", res.ExitCode, res.Signal)
	}
	charged("right after the fork bomb")
	time.Sleep(5 * time.Second)
	charged("5 s after the fork bomb")

	for i := range 3 {
		start = time.Now()
		res, err = run(apiclient.RunCommandRequest{Command: []string{"python3", "-c", memoryBomb}, TimeoutSeconds: 120})
		if err != nil {
			t.Fatalf("memory bomb %d after the fork bomb: the API did not answer after %v: %v", i+1, time.Since(start).Round(time.Millisecond), err)
		}
		lines := strings.Split(strings.TrimSpace(res.Stdout), "\n")
		if !res.OutOfMemory || res.Signal != "SIGKILL" {
			t.Fatalf("memory bomb %d after the fork bomb: want it stopped by the memory guard, got exit %d, signal %q, out of memory %v, last output %q",
				i+1, res.ExitCode, res.Signal, res.OutOfMemory, lines[len(lines)-1])
		}
		charged(fmt.Sprintf("memory bomb %d after the fork bomb stopped at %q", i+1, lines[len(lines)-1]))
	}
	must(t, e.get(podName, &pod))
	for _, cs := range pod.Status.ContainerStatuses {
		if cs.RestartCount != 0 {
			t.Errorf("container %s restarted %d times (last state %+v)", cs.Name, cs.RestartCount, cs.LastTerminationState.Terminated)
		}
	}
	cg.logPeak(t)
}
