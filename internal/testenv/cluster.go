// Package testenv starts and stops a real local Kubernetes cluster for tests
// and the quickstart: etcd, kube-apiserver, kube-controller-manager and
// kube-scheduler, and on request one real node (containerd with runc and
// gVisor, kubelet and kube-proxy), which on request also enforces
// NetworkPolicies (kube-router's firewall). The binaries come from the
// toolchain cache that `make testenv` fills.
//
// Addresses come from the 198.18.0.0/15 benchmarking range, which no real
// network uses, so test traffic can only ever reach this host and the pods
// the cluster made.
package testenv

import (
	"context"
	"crypto/tls"
	"crypto/x509"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"time"

	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/rest"
	"k8s.io/client-go/tools/clientcmd"
	clientcmdapi "k8s.io/client-go/tools/clientcmd/api"

	"github.com/agentbox/terraform-provider-agentbox/internal/testenv/loopvol"
	"github.com/agentbox/terraform-provider-agentbox/internal/testenv/toolchain"
)

// Network layout of the test node.
const (
	// TestRange holds every address the cluster uses; nothing in it is
	// routed off this host while a node runs.
	TestRange   = "198.18.0.0/15"
	PodCIDR     = "198.18.0.0/16"
	ServiceCIDR = "198.19.0.0/17"
	// NodeIP is added to lo while a node runs: pods cannot reach 127.0.0.1
	// of the host, so the apiserver and kubelet listen here instead.
	NodeIP   = "198.19.128.1"
	NodeName = "agentbox-node-0"
	Bridge   = "abx-cni0"
	// RuntimeClass is the gVisor RuntimeClass every node cluster has.
	RuntimeClass = "gvisor"
	// RestoreRuntimeClass is gVisor through the restoring runsc shim
	// (toolchain.RestoreShim): a pod annotated RestoreAnnotation starts
	// from the sandbox checkpoint it names instead of afresh. A node has it
	// only when the toolchain built that shim (`make testenv`); pods
	// without the annotation run as under RuntimeClass.
	RestoreRuntimeClass = "gvisor-restore"
	// RestoreAnnotation names a checkpoint directory below RestoreDir(); the
	// restoring shim reads it from every container's OCI spec, where
	// containerd's CRI copies it from the pod.
	RestoreAnnotation = "agentbox.dev/restore-from"
	// StorageClass is the default class. Its provisioner makes folders any
	// user may write: kube-controller-manager's hostPath provisioner (also
	// enabled) makes root-only folders, which non-root sandboxes cannot use.
	// Each folder is a filesystem of the claim's size (at least
	// loopvol.MinSize), so writes past it fail with ENOSPC.
	StorageClass = "standard"
	// StorageProvisioner is the provisioner name of StorageClass.
	StorageProvisioner = "agentbox.test/local-path"
)

// Options configure Start.
type Options struct {
	// Dir is the toolchain cache (default toolchain.DefaultDir()).
	Dir string
	// Node adds a real node with containerd, kubelet and kube-proxy.
	Node bool
	// NetworkPolicy runs a NetworkPolicy enforcer on the node (kube-router's
	// firewall alone); it needs Node and the enforcer from a full `make
	// testenv`. Off, NetworkPolicies are stored and never enforced.
	NetworkPolicy bool
	// Images are OCI archives to import into the node.
	Images []string
	// Log receives progress lines; nil discards them.
	Log io.Writer
}

// Cluster is a running test cluster.
type Cluster struct {
	st *state
	// Kubeconfig is the path of an admin kubeconfig.
	Kubeconfig string
	// Config is the admin REST configuration.
	Config *rest.Config
	log    io.Writer
}

// ErrRunning is returned when a cluster of the same cache is already up.
var ErrRunning = errors.New("a test cluster is already running")

func runDir(dir string) string { return filepath.Join(dir, "run") }

// Start starts a cluster. On failure it tears down whatever it started.
func Start(ctx context.Context, opts Options) (_ *Cluster, err error) {
	if opts.Dir == "" {
		if opts.Dir, err = toolchain.DefaultDir(); err != nil {
			return nil, err
		}
	}
	if opts.Log == nil {
		opts.Log = io.Discard
	}
	if missing := toolchain.Missing(opts.Dir); len(missing) > 0 {
		return nil, fmt.Errorf("test cluster binaries missing from %s (%s): run `make testenv`", toolchain.BinDir(opts.Dir), strings.Join(missing, ", "))
	}
	if opts.NetworkPolicy {
		if !opts.Node {
			return nil, fmt.Errorf("NetworkPolicy enforcement needs a node")
		}
		if bin := filepath.Join(toolchain.BinDir(opts.Dir), toolchain.KubeRouter); !fileExists(bin) {
			return nil, fmt.Errorf("the NetworkPolicy enforcer %s is missing: run `make testenv`", bin)
		}
	}
	if opts.Node && os.Geteuid() != 0 {
		return nil, fmt.Errorf("a test node needs root (containerd, kubelet, iptables)")
	}
	// The default StorageClass's volumes are filesystems on loop devices.
	if err := loopvol.Check(); err != nil {
		return nil, fmt.Errorf("the test cluster's volumes cannot be made (run `make testenv`, which installs the tools): %w", err)
	}
	dir := runDir(opts.Dir)
	if old, err := loadState(dir); err == nil {
		if r := old.running(); len(r) > 0 {
			return nil, fmt.Errorf("%w (%s pid %d); stop it with `agentbox-testenv down`", ErrRunning, r[0].Name, r[0].PID)
		}
		// A previous run died without cleaning up: undo what it left.
		if err := teardown(ctx, old, opts.Log); err != nil {
			return nil, fmt.Errorf("clean up the previous run: %w", err)
		}
	}
	if err := os.RemoveAll(dir); err != nil {
		return nil, err
	}
	if err := os.MkdirAll(dir, 0o755); err != nil {
		return nil, err
	}
	st := &state{Dir: dir, BinDir: toolchain.BinDir(opts.Dir), Node: opts.Node, NetworkPolicy: opts.NetworkPolicy, Kubeconfig: filepath.Join(dir, "kubeconfig")}
	if err := st.save(); err != nil {
		return nil, err
	}
	c := &Cluster{st: st, Kubeconfig: st.Kubeconfig, log: opts.Log}
	defer func() {
		if err != nil {
			_ = teardown(context.Background(), st, opts.Log)
		}
	}()
	if err := c.startControlPlane(ctx); err != nil {
		return nil, err
	}
	if opts.Node {
		if err := c.startNode(ctx, opts.Images); err != nil {
			return nil, err
		}
	}
	return c, nil
}

func (c *Cluster) logf(format string, args ...any) {
	fmt.Fprintf(c.log, "testenv: "+format+"\n", args...)
}

func (c *Cluster) bin(name string) string { return filepath.Join(c.st.BinDir, name) }

// startControlPlane starts etcd, kube-apiserver, the controller manager,
// the scheduler and the volume provisioner, each once what it needs is up.
func (c *Cluster) startControlPlane(ctx context.Context) error {
	st := c.st
	t0 := time.Now()
	apiIP := "127.0.0.1"
	if st.Node {
		if err := c.setupHostNetwork(ctx); err != nil {
			return err
		}
		apiIP = NodeIP
	}
	p, err := issueClusterPKI(filepath.Join(st.Dir, "pki"))
	if err != nil {
		return err
	}

	etcdURL, err := c.startEtcd(ctx)
	if err != nil {
		return err
	}
	c.logf("etcd ready (%s)", time.Since(t0).Round(time.Millisecond))

	t1 := time.Now()
	server, err := c.startAPIServer(ctx, p, apiIP, etcdURL)
	if err != nil {
		return err
	}
	c.logf("kube-apiserver ready at %s (%s)", server, time.Since(t1).Round(time.Millisecond))

	if err := c.startControllers(ctx, p); err != nil {
		return err
	}
	if err := c.startStorageDefaults(ctx); err != nil {
		return err
	}
	c.logf("control plane ready (%s)", time.Since(t0).Round(time.Millisecond))
	return st.save()
}

// issueClusterPKI makes the cluster's CA and the certificates and keys of
// the API server, the admin, the kubelet and service accounts.
func issueClusterPKI(dir string) (*pki, error) {
	p, err := newPKI(dir)
	if err != nil {
		return nil, fmt.Errorf("pki: %w", err)
	}
	serviceIP := firstServiceIP()
	clientAuth := []x509.ExtKeyUsage{x509.ExtKeyUsageClientAuth}
	serverAuth := []x509.ExtKeyUsage{x509.ExtKeyUsageServerAuth}
	for _, e := range []error{
		p.issue("apiserver", "kube-apiserver", nil,
			[]string{"localhost", "kubernetes", "kubernetes.default", "kubernetes.default.svc", "kubernetes.default.svc.cluster.local"},
			[]net.IP{net.ParseIP("127.0.0.1"), net.ParseIP(NodeIP), serviceIP}, serverAuth),
		p.issue("admin", "admin", []string{"system:masters"}, nil, nil, clientAuth),
		p.issue("kubelet", NodeName, nil, []string{NodeName, "localhost"}, []net.IP{net.ParseIP(NodeIP)}, serverAuth),
		p.serviceAccountKeys(),
	} {
		if e != nil {
			return nil, fmt.Errorf("pki: %w", e)
		}
	}
	return p, nil
}

// startEtcd starts etcd and returns its client URL once it is healthy.
func (c *Cluster) startEtcd(ctx context.Context) (string, error) {
	st := c.st
	etcdPort, err := freePort("127.0.0.1")
	if err != nil {
		return "", err
	}
	peerPort, err := freePort("127.0.0.1")
	if err != nil {
		return "", err
	}
	etcdURL := fmt.Sprintf("http://127.0.0.1:%d", etcdPort)
	peerURL := fmt.Sprintf("http://127.0.0.1:%d", peerPort)
	if err := startProcess(st, "etcd", c.bin("etcd"), []string{
		"--data-dir", filepath.Join(st.Dir, "etcd"),
		"--listen-client-urls", etcdURL, "--advertise-client-urls", etcdURL,
		"--listen-peer-urls", peerURL, "--initial-advertise-peer-urls", peerURL,
		"--initial-cluster", "default=" + peerURL,
		"--unsafe-no-fsync", "--log-level=warn",
	}, nil); err != nil {
		return "", err
	}
	if err := waitFor(ctx, st, "etcd", 30*time.Second, httpOK(http.DefaultClient, etcdURL+"/health")); err != nil {
		return "", err
	}
	return etcdURL, nil
}

// startAPIServer starts kube-apiserver, writes the admin kubeconfig and
// sets c.Config from it, and returns the server's URL once it is ready.
func (c *Cluster) startAPIServer(ctx context.Context, p *pki, apiIP, etcdURL string) (string, error) {
	st := c.st
	apiPort, err := freePort(apiIP)
	if err != nil {
		return "", err
	}
	apiArgs := []string{
		"--etcd-servers=" + etcdURL,
		"--bind-address=" + apiIP, "--advertise-address=" + apiIP,
		"--secure-port=" + strconv.Itoa(apiPort),
		"--tls-cert-file=" + p.path("apiserver.crt"), "--tls-private-key-file=" + p.path("apiserver.key"),
		"--client-ca-file=" + p.path("ca.crt"),
		"--service-account-issuer=https://kubernetes.default.svc.cluster.local",
		"--service-account-key-file=" + p.path("sa.pub"), "--service-account-signing-key-file=" + p.path("sa.key"),
		"--service-cluster-ip-range=" + ServiceCIDR,
		"--authorization-mode=Node,RBAC",
		"--kubelet-preferred-address-types=InternalIP,Hostname",
		"--kubelet-client-certificate=" + p.path("admin.crt"), "--kubelet-client-key=" + p.path("admin.key"),
		"--profiling=false",
	}
	if !st.Node {
		// The endpoint reconciler refuses loopback addresses; without a node
		// nothing needs the kubernetes Service's endpoints anyway.
		apiArgs = append(apiArgs, "--endpoint-reconciler-type=none")
	}
	if err := startProcess(st, "kube-apiserver", c.bin("kube-apiserver"), apiArgs, nil); err != nil {
		return "", err
	}
	server := "https://" + net.JoinHostPort(apiIP, strconv.Itoa(apiPort))
	if err := writeKubeconfig(st.Kubeconfig, server, p); err != nil {
		return "", err
	}
	cfg, err := clientcmd.BuildConfigFromFlags("", st.Kubeconfig)
	if err != nil {
		return "", err
	}
	c.Config = cfg
	hc, err := rest.HTTPClientFor(cfg)
	if err != nil {
		return "", err
	}
	if err := waitFor(ctx, st, "kube-apiserver", 90*time.Second, httpOK(hc, server+"/readyz")); err != nil {
		return "", err
	}
	return server, nil
}

// startControllers starts kube-controller-manager and kube-scheduler and
// returns once both are healthy.
func (c *Cluster) startControllers(ctx context.Context, p *pki) error {
	st := c.st
	kc := st.Kubeconfig
	common := []string{"--kubeconfig=" + kc, "--authentication-kubeconfig=" + kc, "--authorization-kubeconfig=" + kc, "--bind-address=127.0.0.1", "--leader-elect=false"}
	kcmPort, err := freePort("127.0.0.1")
	if err != nil {
		return err
	}
	if err := startProcess(st, "kube-controller-manager", c.bin("kube-controller-manager"), append(common,
		"--secure-port="+strconv.Itoa(kcmPort),
		"--service-account-private-key-file="+p.path("sa.key"), "--root-ca-file="+p.path("ca.crt"),
		"--cluster-signing-cert-file="+p.path("ca.crt"), "--cluster-signing-key-file="+p.path("ca.key"),
		"--use-service-account-credentials=true",
		"--enable-hostpath-provisioner=true",
		"--controllers=*,-nodeipam,-cloud-node-lifecycle",
		"--service-cluster-ip-range="+ServiceCIDR,
	), nil); err != nil {
		return err
	}
	schedPort, err := freePort("127.0.0.1")
	if err != nil {
		return err
	}
	// A pod the scheduler found unschedulable waits for an event that
	// may make it schedulable. Once in a few dozen installs the event of
	// its claim being bound was missed (the control plane's pod, whose
	// store volume the provisioner had made a moment after the pod's
	// first try), and the pod waited for the scheduler's periodic retry
	// of every unschedulable pod: 5 minutes by default, as long as an
	// install waits. Binding at first consumer instead put the
	// scheduler's 1-second bind poll on every sandbox's start.
	if err := startProcess(st, "kube-scheduler", c.bin("kube-scheduler"), append(common, "--secure-port="+strconv.Itoa(schedPort),
		"--pod-max-in-unschedulable-pods-duration=15s"), nil); err != nil {
		return err
	}
	insecure := &http.Client{Transport: &http.Transport{TLSClientConfig: &tls.Config{InsecureSkipVerify: true}}} // self-signed health endpoints on loopback
	if err := waitFor(ctx, st, "kube-controller-manager", 60*time.Second, httpOK(insecure, fmt.Sprintf("https://127.0.0.1:%d/healthz", kcmPort))); err != nil {
		return err
	}
	return waitFor(ctx, st, "kube-scheduler", 60*time.Second, httpOK(insecure, fmt.Sprintf("https://127.0.0.1:%d/healthz", schedPort)))
}

// startStorageDefaults starts the volume provisioner, makes its
// StorageClass the default, and waits for the default ServiceAccount.
func (c *Cluster) startStorageDefaults(ctx context.Context) error {
	st := c.st
	if err := startProcess(st, toolchain.LocalPathProvisioner, c.bin(toolchain.LocalPathProvisioner), []string{
		"-kubeconfig=" + st.Kubeconfig, "-dir=" + filepath.Join(st.Dir, "volumes"),
		"-provisioner=" + StorageProvisioner, "-node=" + NodeName,
	}, nil); err != nil {
		return err
	}
	cs, err := kubernetes.NewForConfig(c.Config)
	if err != nil {
		return err
	}
	if err := ensureDefaults(ctx, cs); err != nil {
		return err
	}
	// Pods are refused until the service-account controller has made the
	// default ServiceAccount, so "ready" means that has happened.
	return waitFor(ctx, st, "kube-controller-manager", 60*time.Second, func(ctx context.Context) error {
		_, err := cs.CoreV1().ServiceAccounts("default").Get(ctx, "default", metav1GetOptions)
		return err
	})
}

func firstServiceIP() net.IP {
	_, n, _ := net.ParseCIDR(ServiceCIDR)
	ip := n.IP.To4()
	return net.IPv4(ip[0], ip[1], ip[2], ip[3]+1)
}

func httpOK(hc *http.Client, url string) func(context.Context) error {
	return func(ctx context.Context) error {
		req, err := http.NewRequestWithContext(ctx, http.MethodGet, url, nil)
		if err != nil {
			return err
		}
		rctx, cancel := context.WithTimeout(ctx, 2*time.Second)
		defer cancel()
		resp, err := hc.Do(req.WithContext(rctx))
		if err != nil {
			return err
		}
		defer resp.Body.Close()
		_, _ = io.Copy(io.Discard, resp.Body)
		if resp.StatusCode != http.StatusOK {
			return fmt.Errorf("%s: %s", url, resp.Status)
		}
		return nil
	}
}

func writeKubeconfig(path, server string, p *pki) error {
	cfg := clientcmdapi.NewConfig()
	cfg.Clusters["agentbox-test"] = &clientcmdapi.Cluster{Server: server, CertificateAuthority: p.path("ca.crt")}
	cfg.AuthInfos["admin"] = &clientcmdapi.AuthInfo{ClientCertificate: p.path("admin.crt"), ClientKey: p.path("admin.key")}
	cfg.Contexts["agentbox-test"] = &clientcmdapi.Context{Cluster: "agentbox-test", AuthInfo: "admin"}
	cfg.CurrentContext = "agentbox-test"
	// Embed the files so the kubeconfig can be copied and used on its own.
	if err := clientcmdapi.FlattenConfig(cfg); err != nil {
		return err
	}
	return clientcmd.WriteToFile(*cfg, path)
}

// Stop stops the cluster and undoes every change it made to the host. It is
// safe to call more than once.
func (c *Cluster) Stop(ctx context.Context) error {
	return teardown(ctx, c.st, c.log)
}

// StopDir stops the cluster whose state is in the cache dir, whichever
// process started it. It is a no-op when nothing is running.
func StopDir(ctx context.Context, dir string, log io.Writer) error {
	if log == nil {
		log = io.Discard
	}
	st, err := loadState(runDir(dir))
	if errors.Is(err, os.ErrNotExist) {
		return nil
	}
	if err != nil {
		return err
	}
	return teardown(ctx, st, log)
}

// Attach returns the cluster that is running from the cache dir; its
// progress lines go to log (nil discards them).
func Attach(dir string, log io.Writer) (*Cluster, error) {
	if log == nil {
		log = io.Discard
	}
	st, err := loadState(runDir(dir))
	if err != nil {
		return nil, fmt.Errorf("no test cluster state in %s: %w", runDir(dir), err)
	}
	if len(st.running()) == 0 {
		return nil, fmt.Errorf("the test cluster in %s is not running", runDir(dir))
	}
	cfg, err := clientcmd.BuildConfigFromFlags("", st.Kubeconfig)
	if err != nil {
		return nil, err
	}
	return &Cluster{st: st, Kubeconfig: st.Kubeconfig, Config: cfg, log: log}, nil
}

// HasNode reports whether the cluster runs a real node.
func (c *Cluster) HasNode() bool { return c.st.Node }

// EnforcesNetworkPolicy reports whether the node enforces NetworkPolicies.
func (c *Cluster) EnforcesNetworkPolicy() bool { return c.st.NetworkPolicy }

// LogDir is where the components write their logs.
func (c *Cluster) LogDir() string { return c.st.Dir }
