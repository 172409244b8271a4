package controller

import (
	"bytes"
	"context"
	"crypto/rand"
	"crypto/sha256"
	"encoding/hex"
	"fmt"
	"io"
	"net/http"
	"os"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	corev1 "k8s.io/api/core/v1"
	"k8s.io/apimachinery/pkg/api/resource"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"

	"github.com/agentbox/terraform-provider-agentbox/internal/api/v1alpha1"
	"github.com/agentbox/terraform-provider-agentbox/internal/pki"
	"github.com/agentbox/terraform-provider-agentbox/internal/supervisor/supervisorapi"
	"github.com/agentbox/terraform-provider-agentbox/internal/testenv"
)

// gvisorPod is a sandbox pod started from the controller's own pod spec
// (desiredPod), with the supervisor reachable over mTLS as the control
// plane reaches it.
//
// The pod is created directly rather than through a Sandbox because the
// test cluster's workspace claims are kube-controller-manager hostPath
// volumes, root-owned mode 0750, that ignore fsGroup (see
// workspaceWritable): the sandbox user could not write /workspace, and
// every file case below would be untestable. Swapping that one volume for
// an emptyDir, which does honour fsGroup, keeps everything else the
// controller decides: gVisor, user 65532, read-only root, dropped
// capabilities, seccomp, the template's resources and the supervisor's
// environment.
type gvisorPod struct {
	e    *clusterEnv
	name string
	pod  *corev1.Pod
	sup  *supervisorapi.Client
}

type gvisorPodOptions struct {
	memoryLimit  string          // the container's memory limit
	workspaceCap string          // the template's workspace size, which is the supervisor's cap, e.g. 32MiB
	emptyDirSize string          // the workspace volume's sizeLimit
	pidsLimit    string          // AGENTBOX_COMMAND_PIDS_LIMIT; empty: the supervisor's default
	env          []corev1.EnvVar // more of the template's env (the supervisor's settings)
}

func (e *clusterEnv) gvisorPod(t *testing.T, name string, o gvisorPodOptions) *gvisorPod {
	t.Helper()
	image := os.Getenv(EnvSandboxImage)
	if image == "" {
		t.Skipf("%s is not set: no sandbox image with the supervisor on the node (make test imports one)", EnvSandboxImage)
	}
	tpl := &v1alpha1.SandboxTemplate{
		ObjectMeta: metav1.ObjectMeta{Name: "direct", Namespace: e.ns},
		Spec: v1alpha1.SandboxTemplateSpec{
			Image:           image,
			ImagePullPolicy: corev1.PullNever,
			Workspace:       v1alpha1.WorkspaceSpec{Size: resource.MustParse(strings.TrimSuffix(o.workspaceCap, "B"))},
			Resources: corev1.ResourceRequirements{
				Requests: corev1.ResourceList{corev1.ResourceCPU: resource.MustParse("100m"), corev1.ResourceMemory: resource.MustParse("64Mi")},
				Limits:   corev1.ResourceList{corev1.ResourceMemory: resource.MustParse(o.memoryLimit)},
			},
		},
	}
	sbx := &v1alpha1.Sandbox{
		ObjectMeta: metav1.ObjectMeta{Name: name, Namespace: e.ns},
		Spec: v1alpha1.SandboxSpec{
			AgentID:     "agent:" + name + "@example.com",
			TemplateRef: v1alpha1.LocalObjectReference{Name: tpl.Name},
		},
	}
	if o.pidsLimit != "" {
		tpl.Spec.Env = append(tpl.Spec.Env, corev1.EnvVar{Name: "AGENTBOX_COMMAND_PIDS_LIMIT", Value: o.pidsLimit})
	}
	tpl.Spec.Env = append(tpl.Spec.Env, o.env...)
	pod := e.r.desiredPod(sbx, tpl)
	replaced := false
	for i, v := range pod.Spec.Volumes {
		if v.Name == volumeWorkspace {
			size := resource.MustParse(o.emptyDirSize)
			pod.Spec.Volumes[i].VolumeSource = corev1.VolumeSource{EmptyDir: &corev1.EmptyDirVolumeSource{SizeLimit: &size}}
			replaced = true
		}
	}
	if !replaced {
		t.Fatalf("desiredPod has no %q volume", volumeWorkspace)
	}
	data, err := tlsSecretData(e.ca, pki.SandboxID(testTrustDomain, e.ns, name))
	must(t, err)
	must(t, e.c.Create(e.ctx, &corev1.Secret{
		ObjectMeta: metav1.ObjectMeta{Name: TLSSecretName(name), Namespace: e.ns},
		Type:       corev1.SecretTypeTLS,
		Data:       data,
	}))
	must(t, e.c.Create(e.ctx, pod))

	start := time.Now()
	var got corev1.Pod
	e.eventually("pod "+name+" to be ready", func() error {
		if err := e.get(name, &got); err != nil {
			return err
		}
		for _, c := range got.Status.Conditions {
			if c.Type == corev1.PodReady && c.Status == corev1.ConditionTrue && got.Status.PodIP != "" {
				return nil
			}
		}
		return fmt.Errorf("phase %s, conditions %+v", got.Status.Phase, got.Status.Conditions)
	})
	t.Logf("pod %s ready in %v (runtimeClass %s, memory limit %s)", name, time.Since(start).Round(time.Millisecond),
		*got.Spec.RuntimeClassName, o.memoryLimit)
	sbx.Status.ServiceEndpoint = v1alpha1.SupervisorEndpoint(got.Status.PodIP)
	return &gvisorPod{e: e, name: name, pod: &got, sup: e.supervisor(t, sbx)}
}

// run runs argv through the supervisor in /tmp and fails the test unless
// it exits 0.
func (p *gvisorPod) run(t *testing.T, argv ...string) *supervisorapi.CommandResult {
	t.Helper()
	res, err := p.sup.RunCommand(p.e.ctx, supervisorapi.CommandRequest{Command: argv, Cwd: "/tmp", TimeoutSeconds: 120})
	if err != nil {
		t.Fatalf("%q: %v", argv, err)
	}
	if res.ExitCode != 0 {
		t.Fatalf("%q: exit %d signal %q, stdout %q, stderr %q", argv, res.ExitCode, res.Signal, res.Stdout, res.Stderr)
	}
	return res
}

func (p *gvisorPod) python(t *testing.T, code string) string {
	t.Helper()
	return p.run(t, "python3", "-c", code).Stdout
}

// alive checks that the supervisor still answers health and runs a
// command, and returns how long both took.
func (p *gvisorPod) alive(ctx context.Context) (time.Duration, error) {
	start := time.Now()
	if _, err := p.sup.Health(ctx); err != nil {
		return 0, fmt.Errorf("health: %w", err)
	}
	res, err := p.sup.RunCommand(ctx, supervisorapi.CommandRequest{Command: []string{"true"}, Cwd: "/tmp"})
	if err != nil {
		return 0, fmt.Errorf("true: %w", err)
	}
	if res.ExitCode != 0 {
		return 0, fmt.Errorf("true: exit %d signal %q", res.ExitCode, res.Signal)
	}
	return time.Since(start), nil
}

// restarts is the sandbox container's restart count: a supervisor that
// "keeps serving" only because kubelet restarted it would show here.
func (p *gvisorPod) restarts(t *testing.T) int32 {
	t.Helper()
	var pod corev1.Pod
	must(t, p.e.get(p.name, &pod))
	for _, cs := range pod.Status.ContainerStatuses {
		if cs.Name == ContainerName {
			return cs.RestartCount
		}
	}
	t.Fatalf("pod %s has no %s container status", p.name, ContainerName)
	return 0
}

// procStatus returns PID 1's (the supervisor's) /proc status fields in
// kB, as gVisor's /proc reports them.
func (p *gvisorPod) procStatus(t *testing.T) map[string]int64 {
	t.Helper()
	out := p.run(t, "cat", "/proc/1/status").Stdout
	fields := map[string]int64{}
	for _, line := range strings.Split(out, "\n") {
		k, v, ok := strings.Cut(line, ":")
		if !ok || !strings.HasPrefix(k, "Vm") {
			continue
		}
		if n, err := strconv.ParseInt(strings.TrimSuffix(strings.TrimSpace(v), " kB"), 10, 64); err == nil {
			fields[k] = n
		}
	}
	if _, ok := fields["VmRSS"]; !ok {
		t.Fatalf("no VmRSS in /proc/1/status:\n%s", out)
	}
	return fields
}

// otherProcesses lists the processes in the pod other than the
// supervisor, the python3 that lists them and a liveness probe that
// happens to run, as "pid cmdline".
const listProcesses = `
import os
me = os.getpid()
for p in sorted(int(d) for d in os.listdir('/proc') if d.isdigit()):
    if p in (1, me):
        continue
    try:
        argv = open('/proc/%d/cmdline' % p, 'rb').read().split(b'\0')
        if argv[1:2] == [b'-probe']:
            continue
        cmd = b' '.join(argv).decode(errors='replace').strip()
        state = [l for l in open('/proc/%d/status' % p) if l.startswith('State:')][0].split()[1]
    except OSError:
        continue
    print(p, state, cmd)
`

func (p *gvisorPod) otherProcesses(t *testing.T) []string {
	t.Helper()
	out := strings.TrimSpace(p.python(t, listProcesses))
	if out == "" {
		return nil
	}
	return strings.Split(out, "\n")
}

// TestSupervisorGVisorHostile runs the supervisor's hostile cases in a real
// gVisor pod: the supervisor is PID 1 of a sandbox whose code is trying to
// escape the workspace, exhaust the pod or drown the supervisor.
func TestSupervisorGVisorHostile(t *testing.T) {
	t.Parallel()
	e := newClusterEnv(t)
	const wsCap = 32 << 20
	const pidsLimit = 256
	p := e.gvisorPod(t, "hostile", gvisorPodOptions{memoryLimit: "256Mi", workspaceCap: "32MiB", emptyDirSize: "256Mi", pidsLimit: strconv.Itoa(pidsLimit)})
	ctx := e.ctx
	t.Logf("pod resources: %+v; commands' RLIMIT_NPROC %d; the node's podPidsLimit %d", p.pod.Spec.Containers[0].Resources, pidsLimit, testenv.PodPidsLimit)

	t.Run("path traversal", func(t *testing.T) {
		// Links planted by code in the sandbox, pointing out of the
		// workspace in each way a link can.
		p.python(t, `
import os
os.makedirs('/workspace/sub/deep', exist_ok=True)
os.symlink('/etc', '/workspace/etc')
os.symlink('/tmp', '/workspace/tmpout')
os.symlink('../..', '/workspace/sub/up')
os.symlink('../../..', '/workspace/sub/deep/up2')
os.symlink('../' * 8, '/workspace/rootlink')
open('/tmp/outside-secret', 'w').write('outside secret')
`)
		// os.Root, which confines the supervisor's file access, relies on
		// openat(O_NOFOLLOW|O_DIRECTORY) failing on a symbolic link. Log
		// what this kernel (gVisor's Sentry) does, to explain a failure.
		t.Logf("in the pod, openat(ws, \"etc\" -> /etc, O_NOFOLLOW|O_DIRECTORY): %s", strings.TrimSpace(p.python(t, `
import os
ws = os.open('/workspace', os.O_RDONLY | os.O_DIRECTORY)
for name, flags in (('O_NOFOLLOW|O_DIRECTORY', os.O_NOFOLLOW | os.O_DIRECTORY), ('O_NOFOLLOW', os.O_NOFOLLOW)):
    try:
        fd = os.open('etc', os.O_RDONLY | flags, dir_fd=ws)
        print(name, 'opened the link target:', sorted(os.listdir(fd))[:3], end='; ')
    except OSError as e:
        print(name, 'refused:', e.strerror, end='; ')
`)))
		for _, path := range []string{
			"../etc/passwd", "a/../../etc/passwd", "..", "sub/../../tmp/outside-secret",
			"/etc/passwd", "/tmp/outside-secret", "/workspace/../etc/passwd",
			"etc/passwd", "tmpout/outside-secret", "sub/up/etc/passwd", "sub/deep/up2/etc/passwd", "rootlink/etc/passwd",
		} {
			rc, err := p.sup.GetFile(ctx, path)
			if err == nil {
				data, _ := io.ReadAll(rc)
				rc.Close()
				t.Errorf("GET %q succeeded, read %d bytes", path, len(data))
			} else if code := supervisorapi.CodeOf(err); code != supervisorapi.CodePathEscapesWorkspace {
				t.Errorf("GET %q: %v (code %q), want %s", path, err, code, supervisorapi.CodePathEscapesWorkspace)
			}
			if _, err := p.sup.PutFile(ctx, path, strings.NewReader("pwned"), 0); supervisorapi.CodeOf(err) != supervisorapi.CodePathEscapesWorkspace {
				t.Errorf("PUT %q: %v, want %s", path, err, supervisorapi.CodePathEscapesWorkspace)
			}
			if _, err := p.sup.List(ctx, path); supervisorapi.CodeOf(err) != supervisorapi.CodePathEscapesWorkspace {
				t.Errorf("LIST %q: %v, want %s", path, err, supervisorapi.CodePathEscapesWorkspace)
			}
		}
		// Writes through links planted toward /tmp must not land there.
		for _, path := range []string{"tmpout/pwned", "sub/up/tmp/pwned"} {
			if _, err := p.sup.PutFile(ctx, path, strings.NewReader("pwned"), 0); supervisorapi.CodeOf(err) != supervisorapi.CodePathEscapesWorkspace {
				t.Errorf("PUT %q: %v, want %s", path, err, supervisorapi.CodePathEscapesWorkspace)
			}
		}
		if out := p.python(t, "import os; print(os.path.exists('/tmp/pwned'), open('/tmp/outside-secret').read())"); strings.TrimSpace(out) != "False outside secret" {
			t.Errorf("outside the workspace after the attempts: %q", out)
		}
		// Escapes the client would never produce, sent raw.
		for _, raw := range []string{"/v1/files/%2e%2e/etc/passwd", "/v1/files//etc/passwd", "/v1/files/sub/%2e%2e/%2e%2e/etc/passwd"} {
			req, err := http.NewRequestWithContext(ctx, http.MethodGet, p.sup.BaseURL+raw, nil)
			must(t, err)
			resp, err := p.sup.HTTPClient.Do(req)
			must(t, err)
			body, _ := io.ReadAll(resp.Body)
			resp.Body.Close()
			if resp.StatusCode != http.StatusForbidden || strings.Contains(string(body), "root:") {
				t.Errorf("raw GET %s: %d %q, want 403", raw, resp.StatusCode, body)
			}
		}
	})

	t.Run("binary round trip", func(t *testing.T) {
		data := make([]byte, 8<<20)
		_, _ = rand.Read(data)
		start := time.Now()
		fi, err := p.sup.PutFile(ctx, "bin/random.bin", bytes.NewReader(data), 0o600)
		must(t, err)
		put := time.Since(start)
		if fi.Size != int64(len(data)) {
			t.Errorf("PUT size %d, want %d", fi.Size, len(data))
		}
		start = time.Now()
		rc, err := p.sup.GetFile(ctx, "bin/random.bin")
		must(t, err)
		back, err := io.ReadAll(rc)
		rc.Close()
		must(t, err)
		get := time.Since(start)
		if !bytes.Equal(back, data) {
			t.Fatalf("GET returned %d bytes that differ from the %d put", len(back), len(data))
		}
		// What is on the volume is the same bytes, not just what the
		// supervisor hands back.
		sum := sha256.Sum256(data)
		if got := strings.TrimSpace(p.python(t, "import hashlib; print(hashlib.sha256(open('/workspace/bin/random.bin','rb').read()).hexdigest())")); got != hex.EncodeToString(sum[:]) {
			t.Errorf("sha256 in the pod %s, want %s", got, hex.EncodeToString(sum[:]))
		}
		t.Logf("8 MiB random: put %v, get %v, byte-for-byte equal", put.Round(time.Millisecond), get.Round(time.Millisecond))
	})

	t.Run("write past the workspace cap", func(t *testing.T) {
		keep := make([]byte, 1<<20)
		_, _ = rand.Read(keep)
		_, err := p.sup.PutFile(ctx, "keep.bin", bytes.NewReader(keep), 0)
		must(t, err)
		before, err := p.sup.Health(ctx)
		must(t, err)
		big := io.LimitReader(rand.Reader, wsCap+(4<<20))
		_, err = p.sup.PutFile(ctx, "big.bin", big, 0)
		if code := supervisorapi.CodeOf(err); code != supervisorapi.CodeWorkspaceFull {
			t.Errorf("PUT past the cap: %v (code %q), want %s", err, code, supervisorapi.CodeWorkspaceFull)
		} else {
			t.Logf("PUT past the cap refused: %v", err)
		}
		// Replacing an existing file with something too big must leave
		// the old content, not a truncated one.
		_, err = p.sup.PutFile(ctx, "keep.bin", io.LimitReader(rand.Reader, wsCap+(4<<20)), 0)
		if code := supervisorapi.CodeOf(err); code != supervisorapi.CodeWorkspaceFull {
			t.Errorf("overwrite past the cap: %v (code %q), want %s", err, code, supervisorapi.CodeWorkspaceFull)
		}
		rc, err := p.sup.GetFile(ctx, "keep.bin")
		must(t, err)
		got, _ := io.ReadAll(rc)
		rc.Close()
		if !bytes.Equal(got, keep) {
			t.Errorf("keep.bin after the refused writes: %d bytes, not the original %d", len(got), len(keep))
		}
		if _, err := p.sup.Stat(ctx, "big.bin"); supervisorapi.CodeOf(err) != supervisorapi.CodeNotFound {
			t.Errorf("big.bin after the refused write: %v, want not_found", err)
		}
		// No temporary file of the refused writes is left behind.
		// The image has no find(1).
		listing := strings.TrimSpace(p.python(t, "import os\nfor d, _, fs in os.walk('/workspace'):\n    for f in fs: print(os.path.join(d, f))"))
		if n := strings.Count(listing, "\n") + 1; n != 2 {
			t.Errorf("files in the workspace: %q, want bin/random.bin and keep.bin", listing)
		}
		after, err := p.sup.Health(ctx)
		must(t, err)
		// Usage is a cached walk (DefaultWorkspaceUsageTTL), so only
		// growth is an error: the refused writes must not have added.
		if after.Workspace == nil || after.Workspace.CapBytes != wsCap || after.Workspace.UsedBytes > before.Workspace.UsedBytes {
			t.Errorf("workspace usage %+v after, %+v before, want no growth with cap %d", after.Workspace, before.Workspace, wsCap)
		}
		t.Logf("workspace usage %d (before the refused writes %d) of %d bytes", after.Workspace.UsedBytes, before.Workspace.UsedBytes, after.Workspace.CapBytes)
	})

	t.Run("100 MB of output", func(t *testing.T) {
		before := p.procStatus(t)
		start := time.Now()
		res, err := p.sup.RunCommand(ctx, supervisorapi.CommandRequest{
			Command: []string{"head", "-c", "100000000", "/dev/zero"}, Cwd: "/tmp", TimeoutSeconds: 120,
		})
		must(t, err)
		took := time.Since(start)
		if res.ExitCode != 0 || !res.Truncated || res.TimedOut {
			t.Errorf("exit %d, truncated %v, timed out %v; want 0, true, false", res.ExitCode, res.Truncated, res.TimedOut)
		}
		if n := len(res.Stdout) + len(res.Stderr); n > supervisorapi.DefaultMaxOutputBytes || n == 0 {
			t.Errorf("returned %d bytes of output, want (0, %d]", n, supervisorapi.DefaultMaxOutputBytes)
		}
		after := p.procStatus(t)
		growth := after["VmRSS"] - before["VmRSS"]
		t.Logf("100 MB of output: %v, returned %d bytes, truncated; supervisor VmRSS %d -> %d kB, VmHWM %d kB",
			took.Round(time.Millisecond), len(res.Stdout), before["VmRSS"], after["VmRSS"], after["VmHWM"])
		// The cap is 1 MB; the supervisor buffers it once and encodes it
		// once. Holding the stream would show as ~100 MB.
		if growth > 32<<10 {
			t.Errorf("supervisor RSS grew by %d kB while capping 100 MB of output", growth)
		}
		if hwm, ok := after["VmHWM"]; ok && hwm > before["VmRSS"]+(32<<10) {
			t.Errorf("supervisor peak RSS %d kB, %d kB before: the output was not bounded", hwm, before["VmRSS"])
		}
	})

	t.Run("16 concurrent commands", func(t *testing.T) {
		const n = 16
		start := time.Now()
		var wg sync.WaitGroup
		results := make([]*supervisorapi.CommandResult, n)
		errs := make([]error, n)
		for i := range n {
			wg.Add(1)
			go func() {
				defer wg.Done()
				results[i], errs[i] = p.sup.RunCommand(ctx, supervisorapi.CommandRequest{
					Command: []string{"sh", "-c", "sleep 2; echo $N"}, Env: map[string]string{"N": strconv.Itoa(i)}, Cwd: "/tmp",
				})
			}()
		}
		wg.Wait()
		took := time.Since(start)
		for i := range n {
			if errs[i] != nil {
				t.Errorf("command %d: %v", i, errs[i])
				continue
			}
			if got := strings.TrimSpace(results[i].Stdout); results[i].ExitCode != 0 || got != strconv.Itoa(i) {
				t.Errorf("command %d: exit %d, stdout %q", i, results[i].ExitCode, got)
			}
		}
		t.Logf("16 concurrent `sleep 2` commands: %v wall (serially they would take 32 s)", took.Round(time.Millisecond))
		if took > 16*time.Second {
			t.Errorf("16 concurrent 2 s commands took %v: they did not run concurrently", took)
		}
	})

	// The memory bomb gets a fresh pod of its own, so that its figures do
	// not depend on what the subtests above left in the sandbox (files in
	// /tmp, the sandbox kernel's heap). Bombs in a row in one sandbox, and
	// what the pod is charged meanwhile, are TestMemoryGuardRepeatedOnCluster's.
	t.Run("memory bomb", func(t *testing.T) {
		p := e.gvisorPod(t, "hostile-memory", gvisorPodOptions{memoryLimit: "256Mi", workspaceCap: "32MiB", emptyDirSize: "256Mi", pidsLimit: strconv.Itoa(pidsLimit)})
		restarts := p.restarts(t)
		h0, err := p.sup.Health(ctx)
		must(t, err)
		// Touch every page, so the memory is really used, well past the
		// pod's 256 MiB limit.
		bomb := `
b = []
while True:
    b.append(bytearray(b'x' * (16 << 20)))
    print(len(b) * 16, 'MiB', flush=True)
`
		start := time.Now()
		// The node enforces the pod's limit, which would end the whole
		// sandbox; the supervisor's guard must stop the bomb first. The
		// timeout is only the backstop.
		res, err := p.sup.RunCommand(ctx, supervisorapi.CommandRequest{Command: []string{"python3", "-c", bomb}, Cwd: "/tmp", TimeoutSeconds: 60})
		took := time.Since(start)
		if err != nil {
			t.Errorf("memory bomb: the supervisor did not answer after %v: %v", took.Round(time.Millisecond), err)
		} else {
			lines := strings.Split(strings.TrimSpace(res.Stdout), "\n")
			t.Logf("memory bomb: %v, exit %d, signal %q, timed out %v, out of memory %v, last output %q, stderr tail %q",
				took.Round(time.Millisecond), res.ExitCode, res.Signal, res.TimedOut, res.OutOfMemory, lines[len(lines)-1], tail(res.Stderr, 200))
			if !res.OutOfMemory || res.Signal != "SIGKILL" {
				t.Errorf("memory bomb: want it killed by the supervisor's memory guard (out_of_memory, SIGKILL), got %+v", res)
			}
		}
		// If the bomb took the whole sandbox down, kubelet restarts it;
		// wait for that, so that the restart count below says so.
		var d time.Duration
		for deadline := time.Now().Add(waitTimeout); ; time.Sleep(time.Second) {
			if d, err = p.alive(ctx); err == nil {
				break
			}
			if time.Now().After(deadline) {
				t.Fatalf("after the memory bomb: %v", err)
			}
		}
		h1, err := p.sup.Health(ctx)
		must(t, err)
		if r := p.restarts(t); r != restarts || h1.UptimeSeconds < h0.UptimeSeconds {
			t.Errorf("the supervisor did not survive the memory bomb: %d container restarts, uptime %d -> %d s", r-restarts, h0.UptimeSeconds, h1.UptimeSeconds)
		}
		t.Logf("after the memory bomb: health+true %v, supervisor uptime %d s", d.Round(time.Millisecond), h1.UptimeSeconds)
	})

	t.Run("fork bomb", func(t *testing.T) {
		restarts := p.restarts(t)
		// The shell stays the group's leader (sleep) so that the bomb is
		// still running when the timeout kills the group. Without job
		// control, the bomb's background jobs stay in that group.
		bomb := "f(){ f | f & }; f; sleep 300"
		// A sampler started first counts the pod's processes while the
		// bomb runs (it may itself be starved, so it reports what it saw).
		sampled := make(chan string, 1)
		go func() {
			res, err := p.sup.RunCommand(ctx, supervisorapi.CommandRequest{Command: []string{"python3", "-c", `
import os, time
peak, n, end = 0, 0, time.time() + 12
while time.time() < end:
    peak = max(peak, sum(d.isdigit() for d in os.listdir('/proc'))); n += 1
    time.sleep(0.2)
print(peak, 'processes at peak over', n, 'samples')
`}, Cwd: "/tmp", TimeoutSeconds: 60})
			if err != nil {
				sampled <- err.Error()
				return
			}
			sampled <- strings.TrimSpace(res.Stdout + " " + res.Stderr)
		}()
		time.Sleep(time.Second)
		done := make(chan struct{})
		var res *supervisorapi.CommandResult
		var bombErr error
		start := time.Now()
		go func() {
			defer close(done)
			res, bombErr = p.sup.RunCommand(ctx, supervisorapi.CommandRequest{Command: []string{"sh", "-c", bomb}, Cwd: "/tmp", TimeoutSeconds: 10})
		}()
		// Probe the supervisor while the bomb runs.
		time.Sleep(3 * time.Second)
		var probes []string
		for range 3 {
			pctx, cancel := context.WithTimeout(ctx, 30*time.Second)
			d, err := p.alive(pctx)
			cancel()
			if err != nil {
				t.Errorf("during the fork bomb, at %v: %v", time.Since(start).Round(time.Millisecond), err)
			}
			probes = append(probes, d.Round(time.Millisecond).String())
		}
		<-done
		during := <-sampled
		switch {
		case bombErr != nil:
			t.Errorf("fork bomb: the supervisor did not answer: %v", bombErr)
		case !res.TimedOut && !res.OutOfMemory:
			// Each process costs the pod memory on the host that the
			// sandbox does not show, which the memory guard counts, so
			// the guard may stop the bomb before the timeout does.
			t.Errorf("fork bomb: exit %d, signal %q, neither timed out nor out of memory; want killed by the timeout or the memory guard", res.ExitCode, res.Signal)
		case peakOver(during, pidsLimit):
			// The limit counts the sandbox user's tasks, the supervisor's
			// threads included, so the processes can never exceed it.
			t.Errorf("fork bomb: %s, past the commands' limit of %d", during, pidsLimit)
		default:
			t.Logf("fork bomb: ended after %v (timed out %v, out of memory %v, signal %s); health+true during it took %v; in the pod during it: %s",
				time.Since(start).Round(time.Millisecond), res.TimedOut, res.OutOfMemory, res.Signal, probes, during)
		}

		// The group was killed; every process of the bomb must be gone,
		// and reaped (no zombies).
		var left []string
		deadline := time.Now().Add(30 * time.Second)
		for {
			if left = p.otherProcesses(t); len(left) == 0 || time.Now().After(deadline) {
				break
			}
			time.Sleep(time.Second)
		}
		if len(left) > 0 {
			t.Errorf("%d processes left after the fork bomb's group was killed, e.g. %q", len(left), left[:min(5, len(left))])
		}
		d, err := p.alive(ctx)
		if err != nil {
			t.Fatalf("after the fork bomb: %v", err)
		}
		if r := p.restarts(t); r != restarts {
			t.Errorf("container restarted %d times during the fork bomb", r-restarts)
		}
		t.Logf("after the fork bomb: no processes left, health+true %v", d.Round(time.Millisecond))
	})
}

// peakOver reports whether the fork bomb's sampler, which prints "N
// processes at peak ...", saw more than limit processes.
func peakOver(sampled string, limit int) bool {
	n, err := strconv.Atoi(strings.Fields(sampled + " x")[0])
	return err == nil && n > limit
}

func tail(s string, n int) string {
	s = strings.TrimSpace(s)
	if len(s) > n {
		return s[len(s)-n:]
	}
	return s
}

// TestSupervisorGVisorPTY opens an interactive terminal in a real gVisor
// pod: the shell sees a terminal of the requested size, runs what is typed
// and its exit code comes back when the session ends.
func TestSupervisorGVisorPTY(t *testing.T) {
	e := newClusterEnv(t)
	p := e.gvisorPod(t, "pty", gvisorPodOptions{memoryLimit: "256Mi", workspaceCap: "32MiB", emptyDirSize: "64Mi"})
	ctx, cancel := context.WithTimeout(e.ctx, 2*time.Minute)
	defer cancel()
	term, err := p.sup.OpenPTY(ctx, supervisorapi.PTYRequest{Command: []string{"sh"}, Cwd: "/tmp", Cols: 100, Rows: 30})
	must(t, err)
	defer term.Close()
	if _, err := term.Write([]byte("stty size; tty; exit 3\n")); err != nil {
		t.Fatal(err)
	}
	out, err := io.ReadAll(term)
	must(t, err)
	exit, err := term.Wait(ctx)
	must(t, err)
	if exit.ExitCode != 3 || !strings.Contains(string(out), "30 100") || !strings.Contains(string(out), "/dev/pts/") {
		t.Errorf("PTY session: exit %+v, output %q; want exit 3, size 30 100 and a /dev/pts terminal", exit, out)
	}
}
