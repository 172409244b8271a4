package controller

import (
	"bytes"
	"context"
	"crypto/rand"
	"crypto/x509"
	"encoding/hex"
	"encoding/pem"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"runtime"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/go-logr/logr"
	"github.com/go-logr/logr/funcr"
	coordinationv1 "k8s.io/api/coordination/v1"
	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	"k8s.io/apimachinery/pkg/api/meta"
	"k8s.io/apimachinery/pkg/api/resource"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	k8sruntime "k8s.io/apimachinery/pkg/runtime"
	"k8s.io/apimachinery/pkg/types"
	clientgoscheme "k8s.io/client-go/kubernetes/scheme"
	"k8s.io/client-go/rest"
	"k8s.io/utils/ptr"
	ctrl "sigs.k8s.io/controller-runtime"
	"sigs.k8s.io/controller-runtime/pkg/cache"
	"sigs.k8s.io/controller-runtime/pkg/client"
	"sigs.k8s.io/controller-runtime/pkg/config"
	"sigs.k8s.io/controller-runtime/pkg/controller/controllerutil"
	logf "sigs.k8s.io/controller-runtime/pkg/log"
	metricsserver "sigs.k8s.io/controller-runtime/pkg/metrics/server"

	"github.com/agentbox/terraform-provider-agentbox/internal/api/v1alpha1"
	"github.com/agentbox/terraform-provider-agentbox/internal/computeapi"
	"github.com/agentbox/terraform-provider-agentbox/internal/pki"
	"github.com/agentbox/terraform-provider-agentbox/internal/supervisor/supervisorapi"
	"github.com/agentbox/terraform-provider-agentbox/internal/testenv"
	"github.com/agentbox/terraform-provider-agentbox/internal/testenv/toolchain"
)

// EnvSandboxImage names a sandbox image (with the supervisor) already
// imported into the test node. `make test` builds and imports the real one;
// without it, the tests that need a ready pod are skipped.
const EnvSandboxImage = "AGENTBOX_TEST_SANDBOX_IMAGE"

// EnvSupervisorImage names the supervisor image imported into the test
// node, which every sandbox pod's init container installs the supervisor
// from. Unset, it is agentbox/agentbox-supervisor with the tag of
// EnvImageTag (the image `make test` builds beside the others).
const EnvSupervisorImage = "AGENTBOX_TEST_SUPERVISOR_IMAGE"

// testSupervisorImage is the supervisor image the tests' control planes
// inject into sandbox pods.
func testSupervisorImage() string {
	if img := os.Getenv(EnvSupervisorImage); img != "" {
		return img
	}
	if tag := os.Getenv(EnvImageTag); tag != "" {
		return "agentbox/agentbox-supervisor:" + tag
	}
	return DefaultSupervisorImage
}

const (
	testPlatformNamespace = "agentbox-system"
	testTrustDomain       = "agentbox.test"
	// waitTimeout bounds every wait on the cluster: a pod on gVisor starts
	// in seconds, but CI machines are slow and the node is shared.
	waitTimeout = 3 * time.Minute
)

func TestMain(m *testing.M) {
	// Keep controller-runtime from warning that no logger was set; each
	// manager below logs into its own test's buffer.
	logf.SetLogger(logr.Discard())
	os.Exit(m.Run())
}

var (
	crdsOnce sync.Once
	crdsErr  error
)

// clusterEnv is one test's share of the shared cluster: its own namespace
// and its own manager running the reconciler, so tests can run in parallel.
type clusterEnv struct {
	t   *testing.T
	ctx context.Context
	// c reads and writes straight through to the API server, never through
	// the manager's cache, so assertions see the cluster as it is.
	c  client.Client
	ns string
	ca *pki.CA
	// r is the reconciler of the manager started last, and stop ends
	// that manager.
	r    *SandboxReconciler
	stop func()

	cfg    *rest.Config
	scheme *k8sruntime.Scheme
	// storePath is the SQLite file of platformEnv's store, for tests that
	// tamper with it behind the store's back.
	storePath string
	// apiCAPEM verifies the serving certificate of computeAPI's API.
	apiCAPEM []byte
	// supervisors is platformEnv's supervisor pool.
	supervisors *computeapi.SupervisorPool
	// agentEvents is platformEnv's agent event log writer, shared by the
	// reconciler and computeAPIWithStore's API as in the control plane.
	agentEvents *computeapi.AgentEvents
	// apiServer is the Server computeAPIWithStore started last.
	apiServer *computeapi.Server
}

// newClusterEnv starts a manager for a fresh namespace; configure adds to
// the reconciler before it starts.
func newClusterEnv(t *testing.T, configure ...func(*SandboxReconciler)) *clusterEnv {
	t.Helper()
	cfg, _ := testenv.Shared(t)
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Minute)
	t.Cleanup(cancel)

	crdsOnce.Do(func() {
		_, file, _, _ := runtime.Caller(0)
		crdsErr = testenv.ApplyCRDs(ctx, cfg, filepath.Join(filepath.Dir(file), "..", "..", "charts", "agentbox", "crds", "*.yaml"))
	})
	if crdsErr != nil {
		t.Fatalf("install CRDs: %v", crdsErr)
	}

	scheme := k8sruntime.NewScheme()
	must(t, clientgoscheme.AddToScheme(scheme))
	must(t, v1alpha1.AddToScheme(scheme))
	c, err := client.New(cfg, client.Options{Scheme: scheme})
	must(t, err)

	b := make([]byte, 4)
	_, _ = rand.Read(b)
	ns := "ctrl-" + hex.EncodeToString(b)
	must(t, c.Create(ctx, &corev1.Namespace{ObjectMeta: metav1.ObjectMeta{Name: ns}}))
	t.Cleanup(func() {
		if t.Failed() {
			dumpNamespace(t, c, ns)
		}
		releaseSandboxes(t, c, ns)
		_ = c.Delete(context.Background(), &corev1.Namespace{ObjectMeta: metav1.ObjectMeta{Name: ns}})
	})

	ca, err := pki.NewCA("agentbox test CA")
	must(t, err)

	e := &clusterEnv{t: t, ctx: ctx, c: c, ns: ns, ca: ca, cfg: cfg, scheme: scheme}
	e.startManager(configure...)
	return e
}

// startManager runs a manager with a SandboxReconciler for the test's
// namespace until the test ends or the returned stop is called; stop
// returns once the manager has, as a killed control plane would be gone.
func (e *clusterEnv) startManager(configure ...func(*SandboxReconciler)) (stop func()) {
	t := e.t
	// The manager's log goes to a buffer that is printed only when the test
	// fails: controller goroutines may log after the test has returned,
	// which t.Log does not allow.
	var logMu sync.Mutex
	var logBuf bytes.Buffer
	logger := funcr.New(func(prefix, args string) {
		logMu.Lock()
		defer logMu.Unlock()
		fmt.Fprintln(&logBuf, time.Now().Format("15:04:05.000"), prefix, args)
	}, funcr.Options{Verbosity: 1})

	mgr, err := ctrl.NewManager(e.cfg, ctrl.Options{
		Scheme: e.scheme,
		Logger: logger,
		// Each test's manager watches only its namespace, so parallel tests
		// do not reconcile each other's sandboxes.
		Cache:                  cache.Options{DefaultNamespaces: map[string]cache.Config{e.ns: {}}},
		Metrics:                metricsserver.Options{BindAddress: "0"},
		HealthProbeBindAddress: "0",
		// Several managers in one process register the same controller.
		Controller: config.Controller{SkipNameValidation: ptr.To(true)},
	})
	must(t, err)
	r := &SandboxReconciler{
		Client:       mgr.GetClient(),
		Scheme:       e.scheme,
		Namespace:    testPlatformNamespace,
		TrustDomain:  testTrustDomain,
		DefaultImage: toolchain.BusyboxImage,
		// Imported into the node, never pulled: the tests reach no
		// registry.
		SupervisorImage:           testSupervisorImage(),
		SupervisorImagePullPolicy: corev1.PullNever,
		CA:                        e.ca,
	}
	for _, f := range configure {
		f(r)
	}
	must(t, r.SetupWithManager(mgr))
	e.r = r
	// Every manager runs the warm pool controller too, as the control
	// plane does, taking warm sandboxes through the same WarmTakes; tests
	// without pools never wake it.
	must(t, (&SandboxWarmPoolReconciler{WarmTakes: r.WarmTakes}).SetupWithManager(mgr))

	mgrCtx, cancel := context.WithCancel(e.ctx)
	done := make(chan error, 1)
	go func() { done <- mgr.Start(mgrCtx) }()
	var once sync.Once
	stop = func() {
		once.Do(func() {
			cancel()
			if err := <-done; err != nil {
				t.Errorf("manager: %v", err)
			}
		})
	}
	t.Cleanup(func() {
		stop()
		if t.Failed() {
			logMu.Lock()
			t.Logf("controller log:\n%s", logBuf.String())
			logMu.Unlock()
		}
	})
	e.stop = stop
	return stop
}

func must(t testing.TB, err error) {
	t.Helper()
	if err != nil {
		t.Fatal(err)
	}
}

func (e *clusterEnv) template(name string, mutate func(*v1alpha1.SandboxTemplate)) *v1alpha1.SandboxTemplate {
	e.t.Helper()
	tpl := &v1alpha1.SandboxTemplate{
		ObjectMeta: metav1.ObjectMeta{Name: name, Namespace: e.ns},
		Spec: v1alpha1.SandboxTemplateSpec{
			Image:           toolchain.BusyboxImage,
			ImagePullPolicy: corev1.PullNever,
		},
	}
	if mutate != nil {
		mutate(tpl)
	}
	must(e.t, e.c.Create(e.ctx, tpl))
	return tpl
}

func (e *clusterEnv) sandbox(name, template string) *v1alpha1.Sandbox {
	e.t.Helper()
	sbx := &v1alpha1.Sandbox{
		ObjectMeta: metav1.ObjectMeta{Name: name, Namespace: e.ns},
		Spec: v1alpha1.SandboxSpec{
			AgentID:     "agent:" + name + "@example.com",
			TemplateRef: v1alpha1.LocalObjectReference{Name: template},
		},
	}
	must(e.t, e.c.Create(e.ctx, sbx))
	return sbx
}

// eventually polls check until it returns nil and fails the test with the
// last error otherwise.
func (e *clusterEnv) eventually(what string, check func() error) {
	e.t.Helper()
	deadline := time.Now().Add(waitTimeout)
	var err error
	for {
		if err = check(); err == nil {
			return
		}
		if time.Now().After(deadline) || e.ctx.Err() != nil {
			e.t.Fatalf("timed out waiting for %s: %v", what, err)
		}
		time.Sleep(250 * time.Millisecond)
	}
}

func (e *clusterEnv) get(name string, obj client.Object) error {
	return e.c.Get(e.ctx, types.NamespacedName{Namespace: e.ns, Name: name}, obj)
}

// waitReady waits for the sandbox's Ready condition to have reason and
// returns the sandbox.
func (e *clusterEnv) waitReason(name, reason string) *v1alpha1.Sandbox {
	e.t.Helper()
	var sbx v1alpha1.Sandbox
	e.eventually(fmt.Sprintf("sandbox %s to report %s", name, reason), func() error {
		if err := e.get(name, &sbx); err != nil {
			return err
		}
		c := meta.FindStatusCondition(sbx.Status.Conditions, v1alpha1.ConditionReady)
		if c == nil {
			return errors.New("no Ready condition yet")
		}
		if c.Reason != reason {
			return fmt.Errorf("phase %s, Ready %s/%s: %s", sbx.Status.Phase, c.Status, c.Reason, c.Message)
		}
		return nil
	})
	return &sbx
}

// releaseSandboxes takes the finalizer off the namespace's sandboxes once
// the test's manager has stopped. Nothing would ever finalize them, and a
// namespace that cannot finish terminating costs the kube-apiserver a
// sweep of every namespaced kind (two requests each) up to once a minute
// until the cluster goes: with a few dozen such namespaces, the largest
// load the suite put on it.
func releaseSandboxes(t *testing.T, c client.Client, ns string) {
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	var sbxs v1alpha1.SandboxList
	if err := c.List(ctx, &sbxs, client.InNamespace(ns)); err != nil {
		t.Logf("cleanup: list sandboxes: %v", err)
		return
	}
	for i := range sbxs.Items {
		sbx := &sbxs.Items[i]
		if !controllerutil.ContainsFinalizer(sbx, v1alpha1.Finalizer) {
			continue
		}
		patch := client.MergeFrom(sbx.DeepCopy())
		controllerutil.RemoveFinalizer(sbx, v1alpha1.Finalizer)
		if err := c.Patch(ctx, sbx, patch); err != nil && !apierrors.IsNotFound(err) {
			t.Logf("cleanup: release sandbox %s: %v", sbx.Name, err)
		}
	}
}

func dumpNamespace(t *testing.T, c client.Client, ns string) {
	ctx := context.Background()
	var sbxs v1alpha1.SandboxList
	if err := c.List(ctx, &sbxs, client.InNamespace(ns)); err == nil {
		for _, s := range sbxs.Items {
			t.Logf("sandbox %s: phase=%s podIP=%s conditions=%+v", s.Name, s.Status.Phase, s.Status.PodIP, s.Status.Conditions)
		}
	}
	var pods corev1.PodList
	if err := c.List(ctx, &pods, client.InNamespace(ns)); err == nil {
		for _, p := range pods.Items {
			t.Logf("pod %s: phase=%s conditions=%+v containers=%+v", p.Name, p.Status.Phase, p.Status.Conditions, p.Status.ContainerStatuses)
		}
	}
	var evs corev1.EventList
	if err := c.List(ctx, &evs, client.InNamespace(ns)); err == nil {
		for _, ev := range evs.Items {
			t.Logf("event %s %s/%s: %s %s", ev.Type, ev.InvolvedObject.Kind, ev.InvolvedObject.Name, ev.Reason, ev.Message)
		}
	}
}

func assertControlledBy(t *testing.T, obj client.Object, sbx *v1alpha1.Sandbox) {
	t.Helper()
	ref := metav1.GetControllerOf(obj)
	if ref == nil || ref.UID != sbx.UID || ref.Kind != "Sandbox" || !ptr.Deref(ref.BlockOwnerDeletion, false) {
		t.Errorf("%T %s: controller reference %+v, want Sandbox %s (%s) with blockOwnerDeletion", obj, obj.GetName(), ref, sbx.Name, sbx.UID)
	}
}

// TestSandboxChildren checks everything the controller creates for a
// sandbox, and that deleting the Sandbox takes it all away.
func TestSandboxChildren(t *testing.T) {
	t.Parallel()
	e := newClusterEnv(t)
	storageClass := testenv.StorageClass
	tpl := e.template("py", func(tpl *v1alpha1.SandboxTemplate) {
		tpl.Spec.Env = []corev1.EnvVar{
			{Name: "FROM_TEMPLATE", Value: "yes"},
			// The platform's own variables win over the template's.
			{Name: "AGENTBOX_SANDBOX", Value: "spoofed"},
		}
		tpl.Spec.Resources = corev1.ResourceRequirements{
			Requests: corev1.ResourceList{corev1.ResourceCPU: resource.MustParse("10m"), corev1.ResourceMemory: resource.MustParse("32Mi")},
			Limits:   corev1.ResourceList{corev1.ResourceMemory: resource.MustParse("256Mi")},
		}
		tpl.Spec.Workspace.Size = resource.MustParse("64Mi")
		tpl.Spec.Workspace.StorageClassName = &storageClass
		tpl.Spec.NodeSelector = map[string]string{"kubernetes.io/os": "linux"}
		tpl.Spec.Tolerations = []corev1.Toleration{{Key: "agentbox.dev/test", Operator: corev1.TolerationOpExists, Effect: corev1.TaintEffectNoSchedule}}
	})
	created := e.sandbox("alpha", tpl.Name)
	name := created.Name
	agentHash := v1alpha1.AgentIDHash(created.Spec.AgentID)

	var sbx v1alpha1.Sandbox
	e.eventually("the agent-ID label on the sandbox", func() error {
		if err := e.get(name, &sbx); err != nil {
			return err
		}
		if got := sbx.Labels[v1alpha1.LabelAgentIDHash]; got != agentHash {
			return fmt.Errorf("label %s=%q, want %q", v1alpha1.LabelAgentIDHash, got, agentHash)
		}
		return nil
	})

	t.Run("tls secret", func(t *testing.T) {
		var s corev1.Secret
		e.eventually("the TLS secret", func() error { return e.get(TLSSecretName(name), &s) })
		assertControlledBy(t, &s, &sbx)
		if s.Type != corev1.SecretTypeTLS {
			t.Errorf("type %s, want %s", s.Type, corev1.SecretTypeTLS)
		}
		if !bytes.Equal(s.Data["ca.crt"], e.ca.CertPEM) {
			t.Error("ca.crt is not the platform CA")
		}
		block, _ := pem.Decode(s.Data["tls.crt"])
		if block == nil {
			t.Fatal("tls.crt holds no PEM certificate")
		}
		cert, err := x509.ParseCertificate(block.Bytes)
		must(t, err)
		if _, err := cert.Verify(x509.VerifyOptions{Roots: e.ca.Pool(), KeyUsages: []x509.ExtKeyUsage{x509.ExtKeyUsageServerAuth}}); err != nil {
			t.Errorf("serving certificate does not verify against the CA: %v", err)
		}
		wantID := pki.SandboxID(testTrustDomain, e.ns, name).String()
		if id, err := pki.IDFromCert(cert); err != nil || id.String() != wantID {
			t.Errorf("URI SAN %v (%v), want %s", cert.URIs, err, wantID)
		}
		if _, err := certRenewTime(s.Data, e.ca, pki.SandboxID(testTrustDomain, e.ns, name), time.Now()); err != nil {
			t.Errorf("key pair does not check out: %v", err)
		}
	})

	t.Run("workspace claim", func(t *testing.T) {
		var pvc corev1.PersistentVolumeClaim
		e.eventually("the workspace claim", func() error { return e.get(WorkspaceClaimName(name), &pvc) })
		assertControlledBy(t, &pvc, &sbx)
		if got := pvc.Spec.Resources.Requests[corev1.ResourceStorage]; got.Cmp(resource.MustParse("64Mi")) != 0 {
			t.Errorf("size %s, want 64Mi", got.String())
		}
		if got := ptr.Deref(pvc.Spec.StorageClassName, ""); got != storageClass {
			t.Errorf("storage class %q, want %q", got, storageClass)
		}
		if len(pvc.Spec.AccessModes) != 1 || pvc.Spec.AccessModes[0] != corev1.ReadWriteOnce {
			t.Errorf("access modes %v, want [ReadWriteOnce]", pvc.Spec.AccessModes)
		}
	})

	t.Run("lease", func(t *testing.T) {
		var lease coordinationv1.Lease
		e.eventually("the lease", func() error { return e.get(ActivityClockName(name), &lease) })
		assertControlledBy(t, &lease, &sbx)
		if lease.Spec.RenewTime == nil || time.Since(lease.Spec.RenewTime.Time) > 5*time.Minute {
			t.Errorf("renewTime %v, want about now", lease.Spec.RenewTime)
		}
		if lease.Spec.HolderIdentity != nil {
			t.Errorf("holderIdentity %q, want none", *lease.Spec.HolderIdentity)
		}
	})

	t.Run("pod", func(t *testing.T) {
		var pod corev1.Pod
		e.eventually("the pod", func() error { return e.get(PodName(name), &pod) })
		assertControlledBy(t, &pod, &sbx)
		checkPodSpec(t, &pod, e.ns, name, tpl, agentHash)
	})

	t.Run("status", func(t *testing.T) {
		e.eventually("status to name the pod", func() error {
			if err := e.get(name, &sbx); err != nil {
				return err
			}
			if sbx.Status.PodName != PodName(name) || sbx.Status.ObservedGeneration != sbx.Generation {
				return fmt.Errorf("podName %q observedGeneration %d", sbx.Status.PodName, sbx.Status.ObservedGeneration)
			}
			return nil
		})
		if sbx.Status.Phase == v1alpha1.SandboxPhaseRunning {
			t.Errorf("phase Running with busybox, which has no supervisor")
		}
	})

	t.Run("deletion collects the children", func(t *testing.T) {
		must(t, e.c.Delete(e.ctx, &sbx))
		children := map[string]client.Object{
			"pod " + PodName(name):              &corev1.Pod{},
			"claim " + WorkspaceClaimName(name): &corev1.PersistentVolumeClaim{},
			"secret " + TLSSecretName(name):     &corev1.Secret{},
			"lease " + ActivityClockName(name):  &coordinationv1.Lease{},
		}
		for what, obj := range children {
			objName := what[strings.IndexByte(what, ' ')+1:]
			e.eventually(what+" to be garbage-collected", func() error {
				err := e.get(objName, obj)
				if apierrors.IsNotFound(err) {
					return nil
				}
				if err != nil {
					return err
				}
				return fmt.Errorf("still there (deletionTimestamp %v)", obj.GetDeletionTimestamp())
			})
		}
	})
}

func checkPodSpec(t *testing.T, pod *corev1.Pod, ns, name string, tpl *v1alpha1.SandboxTemplate, agentHash string) {
	t.Helper()
	spec := pod.Spec
	wantLabels := map[string]string{
		v1alpha1.LabelSandbox:     name,
		v1alpha1.LabelAgentIDHash: agentHash,
		v1alpha1.LabelTemplate:    tpl.Name,
	}
	for k, v := range wantLabels {
		if pod.Labels[k] != v {
			t.Errorf("label %s=%q, want %q", k, pod.Labels[k], v)
		}
	}
	if got := ptr.Deref(spec.RuntimeClassName, ""); got != v1alpha1.DefaultRuntimeClassName {
		t.Errorf("runtimeClassName %q, want %q", got, v1alpha1.DefaultRuntimeClassName)
	}
	if ptr.Deref(spec.AutomountServiceAccountToken, true) {
		t.Error("automountServiceAccountToken is not false")
	}
	if ptr.Deref(spec.EnableServiceLinks, true) {
		t.Error("enableServiceLinks is not false")
	}
	psc := spec.SecurityContext
	if psc == nil || !ptr.Deref(psc.RunAsNonRoot, false) || ptr.Deref(psc.RunAsUser, 0) != 65532 ||
		ptr.Deref(psc.RunAsGroup, 0) != 65532 || ptr.Deref(psc.FSGroup, 0) != 65532 ||
		psc.SeccompProfile == nil || psc.SeccompProfile.Type != corev1.SeccompProfileTypeRuntimeDefault {
		t.Errorf("pod security context %+v is not the restricted one", psc)
	}
	if got := spec.NodeSelector["kubernetes.io/os"]; got != "linux" {
		t.Errorf("nodeSelector %v, want the template's", spec.NodeSelector)
	}
	foundTol := false
	for _, tol := range spec.Tolerations {
		foundTol = foundTol || tol.Key == "agentbox.dev/test"
	}
	if !foundTol {
		t.Errorf("tolerations %v lack the template's", spec.Tolerations)
	}

	checkSupervisorInjected(t, &spec, testSupervisorImage())
	ctr := spec.Containers[0]
	if ctr.Image != tpl.Spec.Image || ctr.ImagePullPolicy != tpl.Spec.ImagePullPolicy {
		t.Errorf("image %s (%s), want %s (%s)", ctr.Image, ctr.ImagePullPolicy, tpl.Spec.Image, tpl.Spec.ImagePullPolicy)
	}
	sc := ctr.SecurityContext
	if sc == nil || !ptr.Deref(sc.RunAsNonRoot, false) || ptr.Deref(sc.AllowPrivilegeEscalation, true) ||
		!ptr.Deref(sc.ReadOnlyRootFilesystem, false) || sc.Capabilities == nil ||
		len(sc.Capabilities.Drop) != 1 || sc.Capabilities.Drop[0] != "ALL" || len(sc.Capabilities.Add) != 0 ||
		sc.SeccompProfile == nil || sc.SeccompProfile.Type != corev1.SeccompProfileTypeRuntimeDefault {
		t.Errorf("container security context %+v is not the restricted one", sc)
	}
	if len(ctr.Ports) != 1 || ctr.Ports[0].Name != "supervisor" || ctr.Ports[0].ContainerPort != 8443 {
		t.Errorf("ports %+v, want supervisor 8443", ctr.Ports)
	}
	if p := ctr.ReadinessProbe; p == nil || p.TCPSocket == nil || p.TCPSocket.Port.StrVal != "supervisor" {
		t.Errorf("readiness probe %+v, want tcpSocket on supervisor", p)
	}
	if !equalResources(ctr.Resources, tpl.Spec.Resources) {
		t.Errorf("resources %+v, want %+v", ctr.Resources, tpl.Spec.Resources)
	}

	env := map[string]string{}
	for _, ev := range ctr.Env {
		if _, dup := env[ev.Name]; dup {
			t.Errorf("env %s set twice", ev.Name)
		}
		env[ev.Name] = ev.Value
	}
	cp := pki.ControlPlaneID(testTrustDomain, testPlatformNamespace).String()
	for k, v := range map[string]string{
		"FROM_TEMPLATE":               "yes",
		"AGENTBOX_SANDBOX":            name,
		"AGENTBOX_SANDBOX_NAMESPACE":  ns,
		"AGENTBOX_NAMESPACE":          testPlatformNamespace,
		"AGENTBOX_AGENT_ID":           "agent:" + name + "@example.com",
		"AGENTBOX_TRUST_DOMAIN":       testTrustDomain,
		"AGENTBOX_CONTROLPLANE_ID":    cp,
		"AGENTBOX_ALLOWED_CLIENT_IDS": cp,
		"AGENTBOX_TLS_DIR":            "/etc/agentbox/tls",
		"AGENTBOX_WORKDIR":            "/workspace",
	} {
		if env[k] != v {
			t.Errorf("env %s=%q, want %q", k, env[k], v)
		}
	}

	mounts := map[string]corev1.VolumeMount{}
	for _, m := range ctr.VolumeMounts {
		mounts[m.MountPath] = m
	}
	volumes := map[string]corev1.Volume{}
	for _, v := range spec.Volumes {
		volumes[v.Name] = v
	}
	if m, ok := mounts["/workspace"]; !ok || volumes[m.Name].PersistentVolumeClaim == nil ||
		volumes[m.Name].PersistentVolumeClaim.ClaimName != WorkspaceClaimName(name) {
		t.Errorf("/workspace is not the workspace claim: %+v", m)
	}
	if m, ok := mounts["/tmp"]; !ok || volumes[m.Name].EmptyDir == nil {
		t.Errorf("/tmp is not an emptyDir: %+v", m)
	}
	if m, ok := mounts["/etc/agentbox/tls"]; !ok || !m.ReadOnly || volumes[m.Name].Secret == nil ||
		volumes[m.Name].Secret.SecretName != TLSSecretName(name) {
		t.Errorf("/etc/agentbox/tls is not the TLS secret, read-only: %+v", m)
	}
}

func equalResources(a, b corev1.ResourceRequirements) bool {
	eq := func(x, y corev1.ResourceList) bool {
		if len(x) != len(y) {
			return false
		}
		for k, v := range x {
			if w, ok := y[k]; !ok || v.Cmp(w) != 0 {
				return false
			}
		}
		return true
	}
	return eq(a.Requests, b.Requests) && eq(a.Limits, b.Limits)
}

// TestSandboxPodFailure checks that a sandbox whose container cannot run
// says why, and, with a real sandbox image, that one that can run turns
// Running with a reachable supervisor.
func TestSandboxPodFailure(t *testing.T) {
	t.Parallel()
	e := newClusterEnv(t)

	t.Run("container exits", func(t *testing.T) {
		// A supervisor knob the template may set, set to nonsense: the
		// supervisor exits at start, and kubelet restarts it into
		// CrashLoopBackOff.
		tpl := e.template("bad-knob", func(tpl *v1alpha1.SandboxTemplate) {
			tpl.Spec.Env = []corev1.EnvVar{{Name: "AGENTBOX_LOG_LEVEL", Value: "loudest"}}
		})
		e.sandbox("crash", tpl.Name)
		sbx := e.waitReason("crash", v1alpha1.ReasonPodFailed)
		c := meta.FindStatusCondition(sbx.Status.Conditions, v1alpha1.ConditionReady)
		if sbx.Status.Phase == v1alpha1.SandboxPhaseRunning || c.Status != metav1.ConditionFalse {
			t.Errorf("phase %s, Ready %s; want not Running, False", sbx.Status.Phase, c.Status)
		}
		if !strings.Contains(c.Message, "exited with code") && !strings.Contains(c.Message, "CrashLoopBackOff") {
			t.Errorf("message %q does not say the container exits", c.Message)
		}
	})

	t.Run("image missing", func(t *testing.T) {
		tpl := e.template("missing-image", func(tpl *v1alpha1.SandboxTemplate) {
			tpl.Spec.Image = "agentbox.test/does-not-exist:never"
		})
		e.sandbox("noimage", tpl.Name)
		sbx := e.waitReason("noimage", v1alpha1.ReasonPodFailed)
		c := meta.FindStatusCondition(sbx.Status.Conditions, v1alpha1.ConditionReady)
		if sbx.Status.Phase != v1alpha1.SandboxPhaseError || !strings.Contains(c.Message, "ErrImageNeverPull") {
			t.Errorf("phase %s, message %q; want Error and ErrImageNeverPull", sbx.Status.Phase, c.Message)
		}
	})

	t.Run("real sandbox image", func(t *testing.T) {
		image := os.Getenv(EnvSandboxImage)
		if image == "" {
			t.Skipf("%s is not set: no sandbox image with the supervisor on the node (make test imports one)", EnvSandboxImage)
		}
		tpl := e.template("real", func(tpl *v1alpha1.SandboxTemplate) { tpl.Spec.Image = image })
		e.sandbox("real", tpl.Name)
		sbx := e.waitReason("real", v1alpha1.ReasonRunning)
		e.checkRunning(t, sbx)
		sup := e.supervisor(t, sbx)
		// /tmp rather than the default /workspace: see workspaceWritable.
		res, err := sup.RunCommand(e.ctx, supervisorapi.CommandRequest{Command: []string{"id", "-u"}, Cwd: "/tmp"})
		if err != nil {
			t.Fatalf("run id -u through the supervisor: %v", err)
		}
		if strings.TrimSpace(res.Stdout) != "65532" {
			t.Errorf("id -u = %q (exit %d, stderr %q), want 65532", res.Stdout, res.ExitCode, res.Stderr)
		}
	})
}

func (e *clusterEnv) checkRunning(t *testing.T, sbx *v1alpha1.Sandbox) {
	t.Helper()
	c := meta.FindStatusCondition(sbx.Status.Conditions, v1alpha1.ConditionReady)
	if sbx.Status.Phase != v1alpha1.SandboxPhaseRunning || c.Status != metav1.ConditionTrue {
		t.Errorf("phase %s, Ready %s; want Running, True", sbx.Status.Phase, c.Status)
	}
	if sbx.Status.PodIP == "" || sbx.Status.ServiceEndpoint != v1alpha1.SupervisorEndpoint(sbx.Status.PodIP) {
		t.Errorf("podIP %q, serviceEndpoint %q", sbx.Status.PodIP, sbx.Status.ServiceEndpoint)
	}
}

// supervisor returns a client for the sandbox's supervisor that
// authenticates as the control plane, the way the Compute API will.
func (e *clusterEnv) supervisor(t *testing.T, sbx *v1alpha1.Sandbox) *supervisorapi.Client {
	t.Helper()
	return e.supervisorAs(t, sbx, testPlatformNamespace)
}

// supervisorAs is supervisor for a control plane whose namespace is
// platformNS, for tests whose reconciler runs with its own.
func (e *clusterEnv) supervisorAs(t *testing.T, sbx *v1alpha1.Sandbox, platformNS string) *supervisorapi.Client {
	t.Helper()
	leaf, err := e.ca.Issue(pki.LeafOptions{ID: pki.ControlPlaneID(testTrustDomain, platformNS), Usage: pki.UsageClient})
	must(t, err)
	cert, err := leaf.TLSCertificate()
	must(t, err)
	tlsConf := pki.ClientTLS(cert, e.ca.Pool(), pki.SandboxID(testTrustDomain, sbx.Namespace, sbx.WorkloadName()).String())
	sup := supervisorapi.NewClient(sbx.Status.ServiceEndpoint, supervisorapi.NewHTTPClient(tlsConf))
	ctx, cancel := context.WithTimeout(e.ctx, 30*time.Second)
	defer cancel()
	if _, err := sup.Health(ctx); err != nil {
		t.Fatalf("supervisor health over mTLS: %v", err)
	}
	return sup
}

// workspaceWritable reports whether the sandbox user can write its
// workspace, and logs why not when it cannot. That is the storage's doing, not the
// controller's: the pod asks for fsGroup 65532, but the test cluster's
// StorageClass is kube-controller-manager's hostPath provisioner, whose
// volumes are root-owned mode 0750 directories that kubelet never applies
// fsGroup to (hostPath volumes do not support ownership management). CSI
// drivers and k3s's local-path provisioner do not have this problem.
func (e *clusterEnv) workspaceWritable(t *testing.T, sup *supervisorapi.Client) bool {
	t.Helper()
	res, err := sup.RunCommand(e.ctx, supervisorapi.CommandRequest{
		Command: []string{"sh", "-c", "touch /workspace/.probe && rm /workspace/.probe"}, Cwd: "/tmp",
	})
	if err != nil {
		t.Fatalf("probe the workspace: %v", err)
	}
	if res.ExitCode != 0 {
		t.Logf("not checking the workspace's data: the sandbox user cannot write /workspace (%s); the test cluster's hostPath volumes ignore fsGroup, see workspaceWritable",
			strings.TrimSpace(res.Stderr))
		return false
	}
	return true
}

// TestSandboxTemplateNotFound checks that a sandbox waits for its template
// and starts once the template is created.
func TestSandboxTemplateNotFound(t *testing.T) {
	t.Parallel()
	e := newClusterEnv(t)
	e.sandbox("early", "later")
	sbx := e.waitReason("early", v1alpha1.ReasonTemplateNotFound)
	if sbx.Status.Phase != v1alpha1.SandboxPhasePending {
		t.Errorf("phase %s, want Pending", sbx.Status.Phase)
	}
	if err := e.get(PodName("early"), &corev1.Pod{}); !apierrors.IsNotFound(err) {
		t.Errorf("pod exists before its template (get: %v)", err)
	}

	e.template("later", nil)
	e.eventually("the sandbox to progress past TemplateNotFound", func() error {
		if err := e.get("early", sbx); err != nil {
			return err
		}
		if c := meta.FindStatusCondition(sbx.Status.Conditions, v1alpha1.ConditionReady); c.Reason == v1alpha1.ReasonTemplateNotFound {
			return fmt.Errorf("still %s", c.Reason)
		}
		return e.get(PodName("early"), &corev1.Pod{})
	})
}

// TestSandboxPodRecreated checks that a pod deleted out of band comes back,
// on the same workspace claim.
func TestSandboxPodRecreated(t *testing.T) {
	t.Parallel()
	e := newClusterEnv(t)
	image := os.Getenv(EnvSandboxImage)
	haveImage := image != ""
	tpl := e.template("tpl", func(tpl *v1alpha1.SandboxTemplate) {
		if haveImage {
			tpl.Spec.Image = image
		}
	})
	e.sandbox("phoenix", tpl.Name)

	checkData := false
	var old corev1.Pod
	e.eventually("the first pod", func() error { return e.get(PodName("phoenix"), &old) })
	var pvc corev1.PersistentVolumeClaim
	e.eventually("the workspace claim", func() error { return e.get(WorkspaceClaimName("phoenix"), &pvc) })

	if haveImage {
		// With a supervisor, prove that the workspace survives the pod.
		sbx := e.waitReason("phoenix", v1alpha1.ReasonRunning)
		sup := e.supervisor(t, sbx)
		if checkData = e.workspaceWritable(t, sup); checkData {
			res, err := sup.RunCommand(e.ctx, supervisorapi.CommandRequest{
				Command: []string{"sh", "-c", "echo kept > /workspace/marker"}, Cwd: "/tmp",
			})
			if err != nil || res.ExitCode != 0 {
				t.Fatalf("write marker: %v %+v", err, res)
			}
		}
	}

	must(t, e.c.Delete(e.ctx, &old))
	var pod corev1.Pod
	e.eventually("a new pod", func() error {
		if err := e.get(PodName("phoenix"), &pod); err != nil {
			return err
		}
		if pod.UID == old.UID {
			return errors.New("still the old pod")
		}
		return nil
	})
	var pvcAfter corev1.PersistentVolumeClaim
	must(t, e.get(WorkspaceClaimName("phoenix"), &pvcAfter))
	if pvcAfter.UID != pvc.UID {
		t.Errorf("workspace claim was replaced (%s -> %s)", pvc.UID, pvcAfter.UID)
	}
	if haveImage {
		sbx := e.waitReason("phoenix", v1alpha1.ReasonRunning)
		e.checkRunning(t, sbx)
		sup := e.supervisor(t, sbx)
		if checkData {
			res, err := sup.RunCommand(e.ctx, supervisorapi.CommandRequest{Command: []string{"cat", "/workspace/marker"}, Cwd: "/tmp"})
			if err != nil || strings.TrimSpace(res.Stdout) != "kept" {
				t.Errorf("marker after recreation: %v %+v", err, res)
			}
		}
	}
}

// TestSandboxStatusSettles checks that a reconcile that finds nothing
// changed writes nothing: not the Sandbox's status, not its children.
func TestSandboxStatusSettles(t *testing.T) {
	t.Parallel()
	e := newClusterEnv(t)
	// ErrImageNeverPull is a state kubelet reports once and keeps, so the
	// sandbox settles without depending on a real sandbox image.
	tpl := e.template("settled", func(tpl *v1alpha1.SandboxTemplate) {
		tpl.Spec.Image = "agentbox.test/does-not-exist:never"
	})
	e.sandbox("quiet", tpl.Name)
	e.waitReason("quiet", v1alpha1.ReasonPodFailed)

	objs := map[string]client.Object{
		"sandbox": &v1alpha1.Sandbox{ObjectMeta: metav1.ObjectMeta{Name: "quiet"}},
		"pod":     &corev1.Pod{ObjectMeta: metav1.ObjectMeta{Name: PodName("quiet")}},
		"claim":   &corev1.PersistentVolumeClaim{ObjectMeta: metav1.ObjectMeta{Name: WorkspaceClaimName("quiet")}},
		"secret":  &corev1.Secret{ObjectMeta: metav1.ObjectMeta{Name: TLSSecretName("quiet")}},
		"lease":   &coordinationv1.Lease{ObjectMeta: metav1.ObjectMeta{Name: ActivityClockName("quiet")}},
	}
	versions := func() map[string]string {
		out := map[string]string{}
		for what, o := range objs {
			must(t, e.get(o.GetName(), o))
			out[what] = o.GetResourceVersion()
		}
		return out
	}
	// Let the claim bind and the pod's status settle before comparing.
	var before map[string]string
	e.eventually("the sandbox and its children to settle", func() error {
		v1 := versions()
		time.Sleep(3 * time.Second)
		if v2 := versions(); fmt.Sprint(v1) != fmt.Sprint(v2) {
			return fmt.Errorf("still changing: %v -> %v", v1, v2)
		}
		before = v1
		return nil
	})

	req := ctrl.Request{NamespacedName: types.NamespacedName{Namespace: e.ns, Name: "quiet"}}
	for range 3 {
		if _, err := e.r.Reconcile(e.ctx, req); err != nil {
			t.Fatalf("reconcile: %v", err)
		}
	}
	time.Sleep(time.Second)
	if after := versions(); fmt.Sprint(before) != fmt.Sprint(after) {
		t.Errorf("an extra reconcile wrote objects: resourceVersions %v -> %v", before, after)
	}
}
