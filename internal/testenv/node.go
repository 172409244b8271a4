package testenv

import (
	"context"
	"fmt"
	"net/http"
	"os"
	"path/filepath"
	"strings"
	"time"

	corev1 "k8s.io/api/core/v1"
	nodev1 "k8s.io/api/node/v1"
	storagev1 "k8s.io/api/storage/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/client-go/kubernetes"

	"github.com/agentbox/terraform-provider-agentbox/internal/progress"
	"github.com/agentbox/terraform-provider-agentbox/internal/testenv/toolchain"
)

var metav1GetOptions = metav1.GetOptions{}

const ipForwardPath = "/proc/sys/net/ipv4/ip_forward"

// setupHostNetwork gives the node its address and fences the test ranges
// in. Each host change is recorded in the state before it is made, so a
// crash between the two still gets undone.
//
// The fence matters: a Service IP that kube-proxy has not programmed yet, or
// a pod address to a destination outside the test ranges, would otherwise
// follow the host's default route off the machine.
func (c *Cluster) setupHostNetwork(ctx context.Context) error {
	st := c.st
	st.NodeIP = NodeIP
	st.LoAddr = true
	st.Fence = true
	if b, err := os.ReadFile(ipForwardPath); err == nil {
		st.IPForward = strings.TrimSpace(string(b))
	}
	if err := st.save(); err != nil {
		return err
	}
	if err := run(ctx, "ip", "addr", "replace", NodeIP+"/32", "dev", "lo"); err != nil {
		return fmt.Errorf("add the node address to lo: %w", err)
	}
	// The CNI bridge plugin adopts an existing bridge of its name, so making
	// it now lets the whole test range be routed into it before any pod
	// exists: unprogrammed addresses then time out here instead of leaving.
	for _, args := range [][]string{
		{"link", "add", Bridge, "type", "bridge"},
		{"link", "set", Bridge, "up"},
		{"route", "replace", TestRange, "dev", Bridge},
	} {
		if err := run(ctx, "ip", args...); err != nil {
			return fmt.Errorf("fence the test range: %w", err)
		}
	}
	for _, args := range [][]string{
		{"-N", fenceChain},
		{"-A", fenceChain, "-s", PodCIDR, "!", "-d", TestRange, "-j", "DROP"},
		{"-I", "FORWARD", "1", "-j", fenceChain},
	} {
		if err := run(ctx, "iptables", append([]string{"-w"}, args...)...); err != nil {
			return fmt.Errorf("fence pod egress: %w", err)
		}
	}
	// Pods reach Services and the host through the node's forwarding path.
	if err := os.WriteFile(ipForwardPath, []byte("1"), 0o644); err != nil {
		return fmt.Errorf("enable ip_forward: %w", err)
	}
	return nil
}

// fenceChain holds the rule that keeps pod traffic inside the test ranges.
const fenceChain = "AGENTBOX-FENCE"

func (c *Cluster) sock() string { return filepath.Join(c.st.Dir, "containerd", "containerd.sock") }

// startNode starts the node's processes in the order they need each
// other: containerd, the base images, kubelet, kube-proxy, then the
// NetworkPolicy enforcer if asked for.
func (c *Cluster) startNode(ctx context.Context, images []string) error {
	t0 := time.Now()
	// containerd finds its shims, and the runc shim finds runc, on PATH.
	path := "PATH=" + c.st.BinDir + ":" + os.Getenv("PATH")
	if err := c.startContainerd(ctx, path); err != nil {
		return err
	}
	c.logf("containerd ready (%s)", time.Since(t0).Round(time.Millisecond))

	imgDir := toolchain.ImageDir(filepath.Dir(c.st.BinDir))
	base := []string{filepath.Join(imgDir, "pause.tar"), filepath.Join(imgDir, "busybox.tar")}
	if err := c.ImportImages(ctx, append(base, images...)...); err != nil {
		return err
	}

	t1 := time.Now()
	cs, err := c.startKubelet(ctx, path)
	if err != nil {
		return err
	}
	c.logf("kubelet ready, node %s (%s)", NodeName, time.Since(t1).Round(time.Millisecond))

	t2 := time.Now()
	if err := c.startKubeProxy(ctx, path); err != nil {
		return err
	}
	c.logf("kube-proxy ready (%s)", time.Since(t2).Round(time.Millisecond))

	if c.st.NetworkPolicy {
		t3 := time.Now()
		if err := c.startNetworkPolicy(ctx); err != nil {
			return err
		}
		c.logf("NetworkPolicy enforcer (kube-router %s) ready (%s)", toolchain.KubeRouterVersion, time.Since(t3).Round(time.Millisecond))
	}

	classes := map[string]string{RuntimeClass: "runsc"}
	if c.restoreShim() {
		classes[RestoreRuntimeClass] = "runsc-restore"
	}
	for name, handler := range classes {
		rc := &nodev1.RuntimeClass{ObjectMeta: metav1.ObjectMeta{Name: name}, Handler: handler}
		if _, err := cs.NodeV1().RuntimeClasses().Create(ctx, rc, metav1.CreateOptions{}); err != nil && !apierrors.IsAlreadyExists(err) {
			return fmt.Errorf("create RuntimeClass %s: %w", name, err)
		}
	}
	c.logf("node ready (%s)", time.Since(t0).Round(time.Millisecond))
	return c.st.save()
}

// startContainerd writes the CNI and containerd configuration and starts
// containerd, returning once it answers.
func (c *Cluster) startContainerd(ctx context.Context, path string) error {
	st := c.st
	cdDir := filepath.Join(st.Dir, "containerd")
	cniConf := filepath.Join(st.Dir, "cni")
	for _, d := range []string{cdDir, cniConf} {
		if err := os.MkdirAll(d, 0o755); err != nil {
			return err
		}
	}
	if len(c.sock()) > 100 {
		return fmt.Errorf("containerd socket path %s is too long for a unix socket; use a shorter AGENTBOX_TESTENV_DIR", c.sock())
	}
	if err := os.WriteFile(filepath.Join(cniConf, "10-agentbox.conflist"), []byte(c.cniConfig()), 0o644); err != nil {
		return err
	}
	if err := os.WriteFile(filepath.Join(cdDir, "runsc.toml"), []byte(c.runscConfig("")), 0o644); err != nil {
		return err
	}
	// gVisor checks that a restored container's spec matches the
	// checkpointed one, including the dev.gvisor.spec.cgroup-parent
	// annotation runsc derives from the pod's cgroup, which names the pod's
	// UID: a new pod never matches. The restoring handler logs mismatches
	// instead of refusing them.
	if err := os.WriteFile(filepath.Join(cdDir, "runsc-restore.toml"), []byte(c.runscConfig(`  restore-spec-validation = "warning"
`)), 0o644); err != nil {
		return err
	}
	cdConfPath := filepath.Join(cdDir, "config.toml")
	if err := os.WriteFile(cdConfPath, []byte(c.containerdConfig(cdDir, cniConf)), 0o644); err != nil {
		return err
	}
	env := []string{path}
	if c.restoreShim() {
		if err := os.MkdirAll(c.RestoreDir(), 0o755); err != nil {
			return err
		}
		// The restoring shim inherits containerd's environment and
		// restores only checkpoints below this folder.
		env = append(env, "AGENTBOX_RESTORE_ROOT="+c.RestoreDir())
	}
	if err := startProcess(st, "containerd", c.bin("containerd"), []string{"--config", cdConfPath}, env); err != nil {
		return err
	}
	return waitFor(ctx, st, "containerd", 30*time.Second, func(ctx context.Context) error {
		return run(ctx, c.bin("ctr"), "-a", c.sock(), "version")
	})
}

// cniConfig is the pods' network: no ipMasq, so pods can reach this host
// and each other, never the outside.
func (c *Cluster) cniConfig() string {
	st := c.st
	conflist := fmt.Sprintf(`{
  "cniVersion": "1.0.0",
  "name": "agentbox-test",
  "plugins": [
    {"type": "bridge", "bridge": %q, "isGateway": true, "ipMasq": false, "hairpinMode": true,
     "ipam": {"type": "host-local", "dataDir": %q, "ranges": [[{"subnet": %q}]], "routes": [{"dst": %q}, {"dst": %q}]}},
    {"type": "portmap", "capabilities": {"portMappings": true}},
    {"type": "loopback"}
  ]
}
`, Bridge, filepath.Join(st.Dir, "cni-ipam"), PodCIDR, ServiceCIDR, NodeIP+"/32")
	return conflist
}

// runscConfig is the options file of containerd's runsc runtime, with
// extra runsc flags.
func (c *Cluster) runscConfig(extra string) string {
	st := c.st
	runscToml := fmt.Sprintf(`binary_name = %q
root = %q
[runsc_config]
  platform = "systrap"
%s`, c.bin("runsc"), filepath.Join(st.Dir, "runsc"), extra)
	return runscToml
}

// restoreShim says whether the toolchain built the restoring runsc shim,
// which RestoreRuntimeClass runs on.
func (c *Cluster) restoreShim() bool { return fileExists(c.bin(toolchain.RestoreShim)) }

// RestoreDir is the node's folder of sandbox checkpoints that pods of
// RestoreRuntimeClass may restore from.
func (c *Cluster) RestoreDir() string { return filepath.Join(c.st.Dir, "checkpoints") }

// containerdConfig is containerd's configuration, with runc as the
// default runtime, runsc for the RuntimeClass and, when built, the
// restoring runsc shim for RestoreRuntimeClass (the same runsc root, its
// own options file).
func (c *Cluster) containerdConfig(cdDir, cniConf string) string {
	restore := ""
	if c.restoreShim() {
		restore = fmt.Sprintf(`
    [plugins."io.containerd.cri.v1.runtime".containerd.runtimes.runsc-restore]
      runtime_type = "io.containerd.runsc.v1"
      runtime_path = %q
      pod_annotations = [%q]
      [plugins."io.containerd.cri.v1.runtime".containerd.runtimes.runsc-restore.options]
        TypeUrl = "io.containerd.runsc.v1.options"
        ConfigPath = %q`, c.bin(toolchain.RestoreShim), RestoreAnnotation, filepath.Join(cdDir, "runsc-restore.toml"))
	}
	cdConfig := fmt.Sprintf(`version = 3
root = %[1]q
state = %[2]q
[grpc]
  address = %[3]q
[ttrpc]
  address = %[4]q
[plugins."io.containerd.cri.v1.images"]
  snapshotter = "overlayfs"
  [plugins."io.containerd.cri.v1.images".pinned_images]
    sandbox = %[7]q
[plugins."io.containerd.cri.v1.runtime"]
  # This host has no CAP_SYS_RESOURCE: lowering oom_score_adj fails.
  restrict_oom_score_adj = true
  netns_mounts_under_state_dir = true
  [plugins."io.containerd.cri.v1.runtime".containerd]
    default_runtime_name = "runc"
    [plugins."io.containerd.cri.v1.runtime".containerd.runtimes.runc]
      runtime_type = "io.containerd.runc.v2"
    [plugins."io.containerd.cri.v1.runtime".containerd.runtimes.runsc]
      runtime_type = "io.containerd.runsc.v1"
      [plugins."io.containerd.cri.v1.runtime".containerd.runtimes.runsc.options]
        TypeUrl = "io.containerd.runsc.v1.options"
        ConfigPath = %[5]q%[8]s
  [plugins."io.containerd.cri.v1.runtime".cni]
    bin_dirs = ["/usr/lib/cni"]
    conf_dir = %[6]q
[plugins."io.containerd.grpc.v1.cri"]
  stream_server_address = "127.0.0.1"
  stream_server_port = "0"
`, filepath.Join(cdDir, "root"), filepath.Join(cdDir, "state"), c.sock(), c.sock()+".ttrpc",
		filepath.Join(cdDir, "runsc.toml"), cniConf, toolchain.PauseImage, restore)
	return cdConfig
}

// startKubelet writes kubelet's configuration and starts it, returning a
// client once the node is Ready.
func (c *Cluster) startKubelet(ctx context.Context, path string) (*kubernetes.Clientset, error) {
	st := c.st
	kubeletConfig, err := c.kubeletConfig()
	if err != nil {
		return nil, err
	}
	kubeletDir := kubeletRoot(st.Dir)
	if err := os.MkdirAll(kubeletDir, 0o755); err != nil {
		return nil, err
	}
	// Pod cgroups make the pods' limits real: the memory limit and the
	// node's pids limit bound a gVisor sandbox as a whole.
	st.Cgroups = true
	if err := st.save(); err != nil {
		return nil, err
	}
	if err := makeCgroupRoot(); err != nil {
		return nil, err
	}
	kubeletConfPath := filepath.Join(st.Dir, "kubelet.yaml")
	if err := os.WriteFile(kubeletConfPath, []byte(kubeletConfig), 0o644); err != nil {
		return nil, err
	}
	if err := startProcess(st, "kubelet", c.bin("kubelet"), []string{
		"--config=" + kubeletConfPath, "--kubeconfig=" + st.Kubeconfig,
		"--root-dir=" + kubeletDir, "--cert-dir=" + filepath.Join(kubeletDir, "pki"),
		"--hostname-override=" + NodeName, "--node-ip=" + NodeIP,
	}, []string{path}); err != nil {
		return nil, err
	}
	cs, err := kubernetes.NewForConfig(c.Config)
	if err != nil {
		return nil, err
	}
	if err := waitFor(ctx, st, "kubelet", 90*time.Second, nodeReady(cs)); err != nil {
		return nil, err
	}
	return cs, nil
}

// nodeReady checks that the node reports Ready.
func nodeReady(cs kubernetes.Interface) func(ctx context.Context) error {
	return func(ctx context.Context) error {
		n, err := cs.CoreV1().Nodes().Get(ctx, NodeName, metav1.GetOptions{})
		if err != nil {
			return err
		}
		for _, cond := range n.Status.Conditions {
			if cond.Type == corev1.NodeReady && cond.Status == corev1.ConditionTrue {
				return nil
			}
		}
		return fmt.Errorf("node %s not Ready", NodeName)
	}
}

// kubeletConfig picks kubelet's ports, writes the pods' resolver and
// returns kubelet's configuration.
func (c *Cluster) kubeletConfig() (string, error) {
	st := c.st
	kubeletPort, err := freePort(NodeIP)
	if err != nil {
		return "", err
	}
	healthzPort, err := freePort("127.0.0.1")
	if err != nil {
		return "", err
	}
	// Pods get a resolver that answers nothing, so a stray lookup fails on
	// the spot instead of reaching the host's real DNS servers.
	resolv := filepath.Join(st.Dir, "resolv.conf")
	if err := os.WriteFile(resolv, []byte("nameserver 127.0.0.1\noptions timeout:1 attempts:1\n"), 0o644); err != nil {
		return "", err
	}
	pkiDir := filepath.Join(st.Dir, "pki")
	kubeletConfig := fmt.Sprintf(`apiVersion: kubelet.config.k8s.io/v1beta1
kind: KubeletConfiguration
address: %s
port: %d
healthzBindAddress: 127.0.0.1
healthzPort: %d
readOnlyPort: 0
authentication:
  anonymous: {enabled: false}
  webhook: {enabled: true}
  x509: {clientCAFile: %s}
authorization: {mode: Webhook}
tlsCertFile: %s
tlsPrivateKeyFile: %s
containerRuntimeEndpoint: unix://%s
cgroupDriver: cgroupfs
cgroupsPerQOS: true
cgroupRoot: %s
podPidsLimit: %d
enforceNodeAllocatable: []
failSwapOn: false
resolvConf: %s
evictionHard: {"memory.available": "0%%", "nodefs.available": "0%%", "imagefs.available": "0%%", "nodefs.inodesFree": "0%%"}
imageGCHighThresholdPercent: 100
imageGCLowThresholdPercent: 99
podCIDR: %s
serializeImagePulls: false
maxPods: 250
`, NodeIP, kubeletPort, healthzPort, filepath.Join(pkiDir, "ca.crt"), filepath.Join(pkiDir, "kubelet.crt"), filepath.Join(pkiDir, "kubelet.key"),
		c.sock(), CgroupRoot, PodPidsLimit, resolv, PodCIDR)
	return kubeletConfig, nil
}

// startKubeProxy writes kube-proxy's configuration and starts it,
// returning once it is healthy.
func (c *Cluster) startKubeProxy(ctx context.Context, path string) error {
	st := c.st
	proxyHealth, err := freePort("127.0.0.1")
	if err != nil {
		return err
	}
	proxyMetrics, err := freePort("127.0.0.1")
	if err != nil {
		return err
	}
	// masqueradeAll: the plain bridge does not send pod-to-pod replies back
	// through the host, so Service traffic must be source-NATed to return.
	// No localhost NodePorts: they need route_localnet on the whole host.
	proxyConfig := fmt.Sprintf(`apiVersion: kubeproxy.config.k8s.io/v1alpha1
kind: KubeProxyConfiguration
clientConnection: {kubeconfig: %s}
mode: iptables
clusterCIDR: %s
hostnameOverride: %s
bindAddress: 127.0.0.1
healthzBindAddress: 127.0.0.1:%d
metricsBindAddress: 127.0.0.1:%d
nodePortAddresses: ["%s/32"]
oomScoreAdj: 0
iptables: {masqueradeAll: true, localhostNodePorts: false, minSyncPeriod: 0s, syncPeriod: 30s}
conntrack: {maxPerCore: 0, min: 0, tcpEstablishedTimeout: 0s, tcpCloseWaitTimeout: 0s}
`, st.Kubeconfig, PodCIDR, NodeName, proxyHealth, proxyMetrics, NodeIP)
	proxyConfPath := filepath.Join(st.Dir, "kube-proxy.yaml")
	if err := os.WriteFile(proxyConfPath, []byte(proxyConfig), 0o644); err != nil {
		return err
	}
	if err := startProcess(st, "kube-proxy", c.bin("kube-proxy"), []string{"--config=" + proxyConfPath}, []string{path}); err != nil {
		return err
	}
	return waitFor(ctx, st, "kube-proxy", 60*time.Second, httpOK(http.DefaultClient, fmt.Sprintf("http://127.0.0.1:%d/healthz", proxyHealth)))
}

// ImportImages imports OCI archives into the node's containerd, where the
// kubelet finds them; no registry is reachable from these machines.
func (c *Cluster) ImportImages(ctx context.Context, archives ...string) error {
	if !c.st.Node {
		return fmt.Errorf("the cluster has no node to import images into")
	}
	for _, a := range archives {
		t := time.Now()
		// Unpacking a large image into the snapshotter takes a while.
		step := progress.Start(c.logf, "importing "+filepath.Base(a), "unpacking into containerd", 0)
		err := run(ctx, c.bin("ctr"), "-a", c.sock(), "-n", "k8s.io", "images", "import", "--no-unpack=false", a)
		step.Stop()
		if err != nil {
			return fmt.Errorf("import image %s: %w", a, err)
		}
		c.logf("imported %s (%s)", filepath.Base(a), time.Since(t).Round(time.Millisecond))
	}
	return nil
}

func ensureDefaults(ctx context.Context, cs kubernetes.Interface) error {
	sc := &storagev1.StorageClass{
		ObjectMeta: metav1.ObjectMeta{
			Name:        StorageClass,
			Annotations: map[string]string{"storageclass.kubernetes.io/is-default-class": "true"},
		},
		Provisioner: StorageProvisioner,
	}
	if _, err := cs.StorageV1().StorageClasses().Create(ctx, sc, metav1.CreateOptions{}); err != nil && !apierrors.IsAlreadyExists(err) {
		return fmt.Errorf("create StorageClass %s: %w", StorageClass, err)
	}
	return nil
}
