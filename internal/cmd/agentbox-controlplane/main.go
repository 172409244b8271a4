// Command agentbox-controlplane runs the agentbox controllers and serves the
// Compute API.
//
// It reads the platform CA (the Secret agentbox-ca, mounted at --ca-dir),
// issues itself a client certificate for calling sandbox supervisors and a
// serving certificate for the API, keeps only the SHA-256 of the admin
// token, and runs a controller-runtime manager: the reconcilers (on the
// leader only when --leader-elect is set), the Compute API over HTTPS on
// --api-listen (on every replica), metrics on --metrics-listen and /healthz
// and /readyz on --health-listen. SIGTERM shuts it down gracefully.
package main

import (
	"cmp"
	"context"
	"errors"
	"flag"
	"fmt"
	"io"
	"net"
	"net/http"
	"net/http/pprof"
	"net/url"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"time"

	"github.com/go-logr/logr"
	"github.com/prometheus/client_golang/prometheus/promhttp"
	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	"k8s.io/apimachinery/pkg/runtime"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/apimachinery/pkg/util/validation"
	"k8s.io/client-go/kubernetes"
	clientgoscheme "k8s.io/client-go/kubernetes/scheme"
	ctrl "sigs.k8s.io/controller-runtime"
	"sigs.k8s.io/controller-runtime/pkg/client"
	"sigs.k8s.io/controller-runtime/pkg/client/config"
	"sigs.k8s.io/controller-runtime/pkg/healthz"
	"sigs.k8s.io/controller-runtime/pkg/log/zap"
	"sigs.k8s.io/controller-runtime/pkg/metrics"
	metricsserver "sigs.k8s.io/controller-runtime/pkg/metrics/server"

	"github.com/agentbox/terraform-provider-agentbox/internal/api/v1alpha1"
	"github.com/agentbox/terraform-provider-agentbox/internal/computeapi"
	"github.com/agentbox/terraform-provider-agentbox/internal/controller"
	"github.com/agentbox/terraform-provider-agentbox/internal/filespace"
	"github.com/agentbox/terraform-provider-agentbox/internal/pki"
	"github.com/agentbox/terraform-provider-agentbox/internal/redact"
	"github.com/agentbox/terraform-provider-agentbox/internal/snapshot"
	"github.com/agentbox/terraform-provider-agentbox/internal/snapshot/volumesnapshot"
	"github.com/agentbox/terraform-provider-agentbox/internal/store"
)

// version is set at build time with -ldflags "-X main.version=...".
var version = "dev"

const (
	defaultNamespace = "agentbox-system"
	// leaderElectionID names the Lease in the platform namespace that
	// replicas compete for.
	leaderElectionID = "agentbox-controlplane.agentbox.dev"
	// shutdownGrace lets calls in flight finish after SIGTERM or the loss
	// of the leader election Lease; it stays under Kubernetes' default
	// 30 s termination grace period.
	shutdownGrace = 25 * time.Second
)

type options struct {
	namespace      string
	caDir          string
	adminTokenFile string
	apiListen      string
	metricsListen  string
	healthListen   string
	apiService     string
	deployment     string
	sandboxImage   string
	// supervisorImage holds the supervisor that every sandbox pod's init
	// container installs, with its pull policy.
	supervisorImage      string
	supervisorPullPolicy corev1.PullPolicy
	sandboxPullPolicy    corev1.PullPolicy
	egressImage          string
	trustDomain          string
	leaderElect          bool
	pprof                bool
	kubeQPS              float64
	kubeBurst            int
	sandboxWorkers       int
	pushDelay            time.Duration
	runRetention         time.Duration
	// userTokens configure the user token issuer (POST /v1/token).
	userTokens    userTokenFlags
	runArtifacts  computeapi.RunArtifactsOptions // limits; the store is the snapshot driver's, set once it is made
	purgeInterval time.Duration
	showVersion   bool
	storeDSN      string
	dataDir       string
	// defaultTemplate is what deploy_or_resume creates a missing sandbox
	// from when the call names no template; zero if not configured.
	defaultTemplate types.NamespacedName
	// sandboxNamespaces are the namespaces served besides the platform
	// namespace (which is always served); nil serves every namespace.
	sandboxNamespaces controller.ServedNamespaces
	// managedNodePools is whether Managed GVisorNodePools may label and
	// taint nodes and write RuntimeClasses (the chart grants the rights).
	managedNodePools bool
	zap              zap.Options
	// snapshot selects the snapshot driver; see snapshot_flags.go.
	snapshot *snapshotFlags
}

// maxSandboxWorkers bounds --sandbox-workers: past the client's rate limit
// more workers only wait, each with a pass's memory.
const maxSandboxWorkers = 256

func main() {
	o, err := parseOptions(os.Args[1:], os.Getenv, os.Stderr)
	if errors.Is(err, flag.ErrHelp) {
		return
	}
	if err != nil {
		fmt.Fprintln(os.Stderr, "agentbox-controlplane:", err)
		os.Exit(2)
	}
	if o.showVersion {
		fmt.Println(version)
		return
	}
	// Request logs quote what callers sent (paths, commands, error
	// messages from the sandbox); known secret formats are kept out.
	ctrl.SetLogger(redact.Logger(zap.New(zap.UseFlagOptions(&o.zap))))
	if err := run(ctrl.SetupSignalHandler(), o); err != nil {
		// Plain text rather than the structured log: a start-up failure is
		// read by a person, and a stack trace would bury the cause.
		fmt.Fprintln(os.Stderr, "agentbox-controlplane:", err)
		os.Exit(1)
	}
}

// parsePullPolicy checks the value of a pull policy flag.
func parsePullPolicy(flagName, v string) (corev1.PullPolicy, error) {
	switch p := corev1.PullPolicy(v); p {
	case corev1.PullAlways, corev1.PullIfNotPresent, corev1.PullNever:
		return p, nil
	}
	return "", fmt.Errorf("%s %q: want Always, IfNotPresent or Never", flagName, v)
}

func parseOptions(args []string, getenv func(string) string, out io.Writer) (*options, error) {
	fs := flag.NewFlagSet("agentbox-controlplane", flag.ContinueOnError)
	fs.SetOutput(out)
	o := &options{}
	fs.StringVar(&o.namespace, "namespace", cmp.Or(getenv("POD_NAMESPACE"), defaultNamespace), "platform namespace, where the CA, the API Service and the leader election Lease live [POD_NAMESPACE]")
	fs.StringVar(&o.caDir, "ca-dir", "/etc/agentbox/ca", "directory holding the platform CA's tls.crt and tls.key (the mounted Secret agentbox-ca)")
	fs.StringVar(&o.adminTokenFile, "admin-token-file", "/etc/agentbox/admin/token", "file holding the admin token (the mounted Secret agentbox-admin-token, key token); only its SHA-256 is kept")
	fs.StringVar(&o.apiListen, "api-listen", ":8443", "HTTPS listen address of the Compute API")
	fs.StringVar(&o.metricsListen, "metrics-listen", ":8080", `listen address of the Prometheus metrics endpoint ("0" disables it)`)
	fs.StringVar(&o.healthListen, "health-listen", ":8081", "listen address of /healthz and /readyz")
	fs.StringVar(&o.apiService, "api-service", "agentbox-api", "name of the API's Service in the platform namespace; its DNS names and ClusterIP go into the serving certificate")
	fs.StringVar(&o.deployment, "deployment", "agentbox-controlplane", "name of the control plane's Deployment in the platform namespace; it owns the status ConfigMap and carries the snapshot check's events")
	fs.StringVar(&o.sandboxImage, "sandbox-image", "", "sandbox image for templates that name none")
	sandboxPull := fs.String("sandbox-image-pull-policy", cmp.Or(getenv("AGENTBOX_SANDBOX_IMAGE_PULL_POLICY"), string(corev1.PullIfNotPresent)),
		"pull policy of -sandbox-image for templates that set none: Always, IfNotPresent or Never [AGENTBOX_SANDBOX_IMAGE_PULL_POLICY]")
	fs.StringVar(&o.supervisorImage, "supervisor-image", controller.DefaultSupervisorImage,
		"image holding the supervisor at /usr/local/bin/agentbox-supervisor; every sandbox pod's init container installs it from there, so that any image can be a sandbox")
	supervisorPull := fs.String("supervisor-image-pull-policy", string(corev1.PullIfNotPresent), "pull policy of -supervisor-image: Always, IfNotPresent or Never")
	fs.StringVar(&o.egressImage, "egress-proxy-image", controller.DefaultEgressProxyImage, "image of the egress proxy pods EgressProxies run")
	fs.StringVar(&o.trustDomain, "trust-domain", pki.DefaultTrustDomain, "SPIFFE trust domain of the platform's identities")
	fs.BoolVar(&o.leaderElect, "leader-elect", false, "elect a leader to run the controllers (needed with more than one replica); the API serves on every replica")
	fs.StringVar(&o.storeDSN, "store-dsn", getenv("AGENTBOX_STORE_DSN"), "PostgreSQL connection string (postgres://...) of the token and audit store; needed with more than one replica [AGENTBOX_STORE_DSN]")
	fs.StringVar(&o.dataDir, "data-dir", getenv("AGENTBOX_DATA_DIR"), "directory (the store volume) of the SQLite store, used without -store-dsn; empty runs without a store: admin token only, no audit log [AGENTBOX_DATA_DIR]")
	fs.BoolVar(&o.pprof, "pprof", false, "serve Go's profiles under /debug/pprof/ on the metrics listener, for `make bench` and for chasing a slow path in production; off by default because profiles show request internals")
	// controller-runtime's defaults (20/s, burst 30) cap how fast a thousand
	// Sandboxes are first reconciled and how many claims per second the API
	// can write; the apiserver's priority and fairness protects it either way.
	fs.Float64Var(&o.kubeQPS, "kube-api-qps", 100, "requests per second the control plane may send to the Kubernetes API")
	fs.IntVar(&o.kubeBurst, "kube-api-burst", 200, "requests the control plane may send to the Kubernetes API in a burst above -kube-api-qps")
	sandboxWorkers := fs.String("sandbox-workers", cmp.Or(getenv("AGENTBOX_SANDBOX_WORKERS"), strconv.Itoa(controller.DefaultSandboxWorkers)),
		"how many Sandboxes the controller reconciles at once; each pass mostly waits for the API server, and one slow sandbox holds one worker only [AGENTBOX_SANDBOX_WORKERS]")
	fs.DurationVar(&o.purgeInterval, "filespace-purge-interval", filespace.DefaultPurgeInterval, "how often the leader removes filespace contents no file names any more (rewritten or deleted files' old contents)")
	fs.DurationVar(&o.pushDelay, "filespace-push-delay", computeapi.DefaultFilespacePushDelay, "how long after an agent's last call that can change its workspace the workspace is pushed into its filespace; negative turns these pushes off (the idle stop still pushes), 0 takes the default")
	runRetention := fs.String("run-retention", cmp.Or(getenv("AGENTBOX_RUN_RETENTION"), computeapi.DefaultRunRetention.String()),
		"how long the records of finished runs, with their event logs, and agents' events are kept before the run sweeper deletes them; 0 keeps them forever [AGENTBOX_RUN_RETENTION]")
	defaultTemplate := fs.String("default-template", getenv("AGENTBOX_DEFAULT_TEMPLATE"),
		"NAMESPACE/NAME of the SandboxTemplate the Compute API's deploy_or_resume creates an agent's missing sandbox from when the call names none; empty means such calls must name one [AGENTBOX_DEFAULT_TEMPLATE]")
	sandboxNamespaces, err := registerScopeFlags(fs, getenv, o)
	if err != nil {
		return nil, err
	}
	fs.BoolVar(&o.showVersion, "version", false, "print the version and exit")
	o.snapshot = registerSnapshotFlags(fs, getenv)
	o.userTokens.register(fs, getenv)
	artifactFlags := registerRunArtifactFlags(fs, getenv)
	config.RegisterFlags(fs)
	o.zap.BindFlags(fs)
	if err := fs.Parse(args); err != nil {
		return nil, err
	}
	if fs.NArg() > 0 {
		return nil, fmt.Errorf("unexpected arguments: %q", fs.Args())
	}
	if o.namespace == "" {
		return nil, errors.New("--namespace must not be empty")
	}
	if o.supervisorImage == "" {
		return nil, errors.New("--supervisor-image must not be empty: sandbox pods install the supervisor from it")
	}
	if o.supervisorPullPolicy, err = parsePullPolicy("--supervisor-image-pull-policy", *supervisorPull); err != nil {
		return nil, err
	}
	if o.sandboxPullPolicy, err = parsePullPolicy("--sandbox-image-pull-policy", *sandboxPull); err != nil {
		return nil, err
	}
	if o.purgeInterval <= 0 {
		return nil, fmt.Errorf("--filespace-purge-interval %s must be positive", o.purgeInterval)
	}
	if o.kubeQPS <= 0 || o.kubeBurst <= 0 {
		return nil, fmt.Errorf("--kube-api-qps (%v) and --kube-api-burst (%d) must be positive", o.kubeQPS, o.kubeBurst)
	}
	if o.sandboxWorkers, err = strconv.Atoi(*sandboxWorkers); err != nil || o.sandboxWorkers < 1 || o.sandboxWorkers > maxSandboxWorkers {
		return nil, fmt.Errorf("--sandbox-workers %q: want a whole number from 1 to %d", *sandboxWorkers, maxSandboxWorkers)
	}
	if o.runArtifacts, err = artifactFlags.limits(); err != nil {
		return nil, err
	}
	if o.runRetention, err = time.ParseDuration(*runRetention); err != nil || o.runRetention < 0 {
		return nil, fmt.Errorf("--run-retention %q: want a duration of 0 or more, such as 168h", *runRetention)
	}
	if t := *defaultTemplate; t != "" {
		ns, name, ok := strings.Cut(t, "/")
		if !ok || len(validation.IsDNS1123Label(ns)) > 0 || len(validation.IsDNS1123Subdomain(name)) > 0 {
			return nil, fmt.Errorf("--default-template %q: want NAMESPACE/NAME of a SandboxTemplate", t)
		}
		o.defaultTemplate = types.NamespacedName{Namespace: ns, Name: name}
	}
	if o.sandboxNamespaces, err = parseSandboxNamespaces(*sandboxNamespaces, o.namespace); err != nil {
		return nil, err
	}
	if err := o.userTokens.check(); err != nil {
		return nil, err
	}
	return o, nil
}

// run starts the control plane and serves until ctx ends or the replica
// loses its leader election Lease. Then the Compute API's calls in flight
// are drained before anything they use is closed: the deferred closes run
// in reverse, the Compute API first (it writes the audit records still
// queued), then the snapshot driver, the supervisor pool (which calls in
// flight use to reach sandboxes), and the store (which they record in)
// last.
//
// On SIGTERM the manager itself waits for the API's graceful shutdown. On
// leader loss it does not: controller-runtime zeroes its graceful shutdown
// timeout, cancels the runnables without waiting for any of them and
// returns "leader election lost" at once, so run waits for the API
// (drainAPI) before it returns. The reconcilers, cancelled with it, are not waited
// for: a replica that is no longer leader must stop acting as one, and
// whatever they were doing the next leader redoes.
func run(ctx context.Context, o *options) error {
	log := ctrl.Log.WithName("setup")
	in, err := loadInputs(ctx, o, log)
	if err != nil {
		return err
	}
	if in.store != nil {
		defer in.store.Close()
		// One log writer for the sandbox controller and the Compute API,
		// closed after both, before the store.
		in.agentEvents = computeapi.NewAgentEvents(in.store, ctrl.Log.WithName("agent-events"))
		defer in.agentEvents.Close()
	}
	mgr, err := newManager(o)
	if err != nil {
		return err
	}
	servingCert, servingIPs, err := newServingCert(ctx, o, in, mgr.GetAPIReader(), log)
	if err != nil {
		return err
	}
	// One pool for the controller and the API, so a sandbox's verified
	// connection serves both the agent's calls and the flush before a stop.
	pool, err := computeapi.NewSupervisorPool(in.clientCert.getClient, in.ca.Pool())
	if err != nil {
		return err
	}
	defer pool.Close()
	snapshots, err := o.snapshot.newSnapshotDriver(mgr.GetClient(), mgr.GetAPIReader())
	if err != nil {
		return fmt.Errorf("snapshot driver: %w", err)
	}
	// The archive driver uploads in the background; stopping it cancels
	// uploads in flight, which the next Take on a new leader finds and redoes.
	if c, ok := snapshots.(interface{ Close() }); ok {
		defer c.Close()
	}
	o.runArtifacts = withStore(o.runArtifacts, snapshots)
	if err := addControllers(mgr, o, in, pool, snapshots); err != nil {
		return err
	}
	api, apiRunnable, err := addComputeAPI(mgr, o, in, pool, servingCert)
	if err != nil {
		return err
	}
	defer api.Close()
	// After the API: a schedule's runs start through it.
	if err := addRunSchedules(mgr, o, in.store, api); err != nil {
		return err
	}

	log.Info("starting", "version", version, "namespace", o.namespace, "sandboxNamespaces", servedOrAll(o.sandboxNamespaces), "identity", in.selfID.String(),
		"api", o.apiListen, "snapshotDriver", snapshot.ID(snapshots), "apiCertificateIPs", fmt.Sprint(servingIPs), "leaderElection", o.leaderElect)
	err = mgr.Start(ctx)
	drainAPI(apiRunnable, log)
	switch {
	case err == nil:
		log.Info("stopped")
		return nil
	case o.leaderElect && ctx.Err() == nil && strings.Contains(err.Error(), leaderElectionLost):
		// Exiting is how a replica rejoins: the restart campaigns again,
		// and serves the API meanwhile.
		return fmt.Errorf("lost the leader election Lease %s/%s (another replica holds it, or it could not be renewed within the renew deadline); exiting so that the restart rejoins the election: %w",
			o.namespace, leaderElectionID, err)
	}
	return fmt.Errorf("run manager: %w", err)
}

// leaderElectionLost is the text of the error controller-runtime's manager
// returns when the replica loses its Lease; it exports no value to match.
const leaderElectionLost = "leader election lost"

// apiDrainMargin is how much longer than shutdownGrace drainAPI waits: the
// API closes the calls still running at shutdownGrace, which takes moments.
const apiDrainMargin = 5 * time.Second

// drainAPI waits, once the manager has returned, for the Compute API's
// graceful shutdown, so that calls in flight get their answers before the
// API and what it uses are closed.
func drainAPI(a *apiServer, log logr.Logger) {
	began := time.Now()
	started, finished := a.drain(shutdownGrace + apiDrainMargin)
	switch {
	case !started:
		log.Info("the Compute API had not started; nothing to drain")
	case !finished:
		log.Info("the Compute API did not stop in time; closing it with calls still running", "waitedSeconds", roundSeconds(time.Since(began)))
	default:
		log.Info("the Compute API has stopped", "waitedSeconds", roundSeconds(time.Since(began)))
	}
}

// inputs are what the control plane reads before it talks to the
// cluster.
type inputs struct {
	ca    *pki.CA
	authn computeapi.Authenticator
	// store is nil when the control plane runs without one.
	store      *store.Store
	selfID     *url.URL
	clientCert *renewingCert
	// agentEvents records the agents' events; nil without a store.
	agentEvents *computeapi.AgentEvents
}

// loadInputs reads the local inputs first, so that a misconfigured pod
// fails with a clear message before anything talks to the cluster: the
// CA, the admin token, the store, and the client certificate for calling
// supervisors. The caller closes the store.
func loadInputs(ctx context.Context, o *options, log logr.Logger) (*inputs, error) {
	ca, err := loadCA(o.caDir)
	if err != nil {
		return nil, err
	}
	authn, err := loadAdminToken(o.adminTokenFile)
	if err != nil {
		return nil, err
	}
	st, err := openStore(ctx, o)
	if err != nil {
		return nil, err
	}
	in := &inputs{ca: ca, authn: authn, store: st, selfID: pki.ControlPlaneID(o.trustDomain, o.namespace)}
	if st != nil {
		in.authn = computeapi.ChainAuthenticators(authn, computeapi.NewStoreAuthenticator(st))
	} else {
		log.Info("running without a store: only the admin token is accepted and calls are not audited; set --data-dir or --store-dsn")
	}
	in.clientCert, err = newRenewingCert(ca, pki.LeafOptions{ID: in.selfID, Usage: pki.UsageClient, Lifetime: pki.DefaultClientCertLifetime})
	if err != nil {
		if st != nil {
			st.Close()
		}
		return nil, fmt.Errorf("client certificate: %w", err)
	}
	return in, nil
}

// newManager makes the controller-runtime manager: the Kubernetes client
// at the configured rate, the scheme, metrics, health probes and leader
// election.
func newManager(o *options) (ctrl.Manager, error) {
	restConfig, err := config.GetConfig()
	if err != nil {
		return nil, fmt.Errorf("kubernetes client configuration: %w", err)
	}
	restConfig.QPS, restConfig.Burst = float32(o.kubeQPS), o.kubeBurst
	scheme, err := newScheme()
	if err != nil {
		return nil, err
	}
	managerGrace := shutdownGrace + 5*time.Second
	mgr, err := ctrl.NewManager(restConfig, ctrl.Options{
		Scheme: scheme,
		Cache:  cacheOptions(o.sandboxNamespaces),
		Metrics: metricsserver.Options{BindAddress: o.metricsListen, ExtraHandlers: profileHandlers(o.pprof),
			// OpenMetrics, to a scraper that asks for it, carries the
			// exemplars that tie the runs' samples to their records.
			HandlerOpts: []func(*promhttp.HandlerOpts){func(h *promhttp.HandlerOpts) { h.EnableOpenMetrics = true }}},
		HealthProbeBindAddress:        o.healthListen,
		LeaderElection:                o.leaderElect,
		LeaderElectionID:              leaderElectionID,
		LeaderElectionNamespace:       o.namespace,
		LeaderElectionReleaseOnCancel: true,
		GracefulShutdownTimeout:       &managerGrace,
	})
	if err != nil {
		return nil, fmt.Errorf("create manager: %w", err)
	}
	return mgr, nil
}

// newScheme registers the Kubernetes, agentbox and VolumeSnapshot types.
func newScheme() (*runtime.Scheme, error) {
	scheme := runtime.NewScheme()
	if err := clientgoscheme.AddToScheme(scheme); err != nil {
		return nil, fmt.Errorf("register Kubernetes types: %w", err)
	}
	if err := v1alpha1.AddToScheme(scheme); err != nil {
		return nil, fmt.Errorf("register agentbox types: %w", err)
	}
	// Registered whatever the driver: the types are only used when the
	// volumesnapshot driver creates VolumeSnapshots, and registering them
	// costs nothing on a cluster without the CRDs.
	if err := volumesnapshot.AddToScheme(scheme); err != nil {
		return nil, fmt.Errorf("register VolumeSnapshot types: %w", err)
	}
	return scheme, nil
}

// newServingCert issues the API's serving certificate, for the Service's
// DNS names, loopback and the Service's ClusterIPs, and returns it with
// the IP addresses it names.
func newServingCert(ctx context.Context, o *options, in *inputs, r client.Reader, log logr.Logger) (*renewingCert, []net.IP, error) {
	servingOpts := pki.LeafOptions{ID: in.selfID, Usage: pki.UsageServer, CommonName: o.apiService,
		DNSNames: serviceDNSNames(o.apiService, o.namespace), IPAddresses: []net.IP{net.IPv4(127, 0, 0, 1)}}
	ips, err := serviceClusterIPs(ctx, r, o.namespace, o.apiService)
	if err != nil {
		// Clients that connect by name still work, so this is no reason to
		// stay down; those that use the IP will see a name mismatch.
		log.Error(err, "the API serving certificate will not name the Service's ClusterIP")
	}
	servingOpts.IPAddresses = append(servingOpts.IPAddresses, ips...)
	servingCert, err := newRenewingCert(in.ca, servingOpts)
	if err != nil {
		return nil, nil, fmt.Errorf("API serving certificate: %w", err)
	}
	return servingCert, servingOpts.IPAddresses, nil
}

// addControllers adds the snapshot check, the filespace purge (with a
// store) and the reconcilers to mgr.
func addControllers(mgr ctrl.Manager, o *options, in *inputs, pool *computeapi.SupervisorPool, snapshots snapshot.Driver) error {
	// A driver that cannot work in this cluster does not stop the control
	// plane: it serves, reports the check's result, and begins no idle stop
	// until the check passes.
	snapshotCheck := &controller.SnapshotCheck{
		Driver:     snapshots,
		Client:     mgr.GetClient(),
		Reader:     mgr.GetAPIReader(),
		Recorder:   mgr.GetEventRecorder("agentbox-controlplane"),
		Namespace:  o.namespace,
		Deployment: o.deployment,
		PodName:    os.Getenv("POD_NAME"),
		Hint:       o.snapshot.hint,
		Log:        ctrl.Log.WithName("snapshot-check"),
	}
	if err := mgr.Add(snapshotCheck); err != nil {
		return fmt.Errorf("add the snapshot check: %w", err)
	}
	sandboxes := &controller.SandboxReconciler{
		Namespace:                 o.namespace,
		TrustDomain:               o.trustDomain,
		DefaultImage:              o.sandboxImage,
		DefaultImagePullPolicy:    o.sandboxPullPolicy,
		SupervisorImage:           o.supervisorImage,
		SupervisorImagePullPolicy: o.supervisorPullPolicy,
		CA:                        in.ca,
		Supervisors:               pool,
		Snapshots:                 snapshots,
		// The interface must stay nil without a check.
		SnapshotHealth:          snapshotCheck,
		Namespaces:              o.sandboxNamespaces,
		MaxConcurrentReconciles: o.sandboxWorkers,
	}
	warmPools := &controller.SandboxWarmPoolReconciler{Namespaces: o.sandboxNamespaces}
	if st := in.store; st != nil {
		// Only with a store: the interfaces must stay nil without one.
		sandboxes.Filespaces = filespace.Syncer{Store: st}
		// The Compute API's pool leases take warm sandboxes through the
		// same store.
		sandboxes.WarmTakes, warmPools.WarmTakes = st, st
		sandboxes.AgentEvents = in.agentEvents
		logs, err := kubernetes.NewForConfig(mgr.GetConfig())
		if err != nil {
			return fmt.Errorf("egress denials: %w", err)
		}
		denials := &controller.EgressDenials{Pods: mgr.GetAPIReader(), Logs: logs, Namespaces: o.sandboxNamespaces,
			Events: in.agentEvents, Log: ctrl.Log.WithName("egress-denials")}
		if err := mgr.Add(denials); err != nil {
			return fmt.Errorf("add the egress denials: %w", err)
		}
		purger := filespace.BlobPurger{Store: st, Interval: o.purgeInterval, Log: ctrl.Log.WithName("filespace-purge")}
		if err := mgr.Add(purger); err != nil {
			return fmt.Errorf("add the filespace purge: %w", err)
		}
	}
	return setupReconcilers(mgr, o, sandboxes, warmPools)
}

// setupReconcilers registers the four reconcilers, and the metrics of the
// state they keep, with mgr.
func setupReconcilers(mgr ctrl.Manager, o *options, sandboxes *controller.SandboxReconciler, warmPools *controller.SandboxWarmPoolReconciler) error {
	if err := sandboxes.SetupWithManager(mgr); err != nil {
		return fmt.Errorf("set up the sandbox controller: %w", err)
	}
	if err := (&controller.EgressProxyReconciler{
		Namespace:  o.namespace,
		Image:      o.egressImage,
		Namespaces: o.sandboxNamespaces,
	}).SetupWithManager(mgr); err != nil {
		return fmt.Errorf("set up the egress proxy controller: %w", err)
	}
	if err := warmPools.SetupWithManager(mgr); err != nil {
		return fmt.Errorf("set up the warm pool controller: %w", err)
	}
	if err := (&controller.GVisorNodePoolReconciler{ManagedModeDisabled: !o.managedNodePools}).SetupWithManager(mgr); err != nil {
		return fmt.Errorf("set up the node pool controller: %w", err)
	}
	// Unregistered first: a control plane started again in one process
	// (its tests) replaces the collector of the previous manager.
	state := &controller.StateMetrics{Reader: mgr.GetCache(), Elected: mgr.Elected(), Namespaces: o.sandboxNamespaces}
	metrics.Registry.Unregister(state)
	if err := metrics.Registry.Register(state); err != nil {
		return fmt.Errorf("register the state metrics: %w", err)
	}
	return nil
}

// addComputeAPI makes the Compute API and adds its HTTPS server, on every
// replica, and the health checks to mgr. The caller drains the server
// (drainAPI) once the manager has returned, then closes the API.
func addComputeAPI(mgr ctrl.Manager, o *options, in *inputs, pool *computeapi.SupervisorPool, servingCert *renewingCert) (*computeapi.Server, *apiServer, error) {
	issuer, err := o.userTokens.issuer(in.store, o)
	if err != nil {
		return nil, nil, err
	}
	api, err := computeapi.NewServer(computeapi.Options{
		Sandboxes:          mgr.GetCache(),
		Serves:             o.sandboxNamespaces.Serves,
		Leases:             mgr.GetClient(),
		LeaseReader:        mgr.GetAPIReader(),
		Supervisors:        pool,
		Authenticator:      in.authn,
		TrustDomain:        o.trustDomain,
		Logger:             ctrl.Log.WithName("computeapi"),
		Store:              in.store,
		FilespacePushDelay: o.pushDelay,
		RunRetention:       o.runRetention,
		RunArtifacts:       o.runArtifacts,
		AgentEvents:        in.agentEvents,
		UserTokens:         issuer,
		DefaultTemplate:    o.defaultTemplate,
		Replica:            replicaName(),
	})
	if err != nil {
		return nil, nil, err
	}
	apiRunnable := newAPIServer(o.apiListen, api.Handler(), servingCert.getServing, mgr.GetCache(), ctrl.Log.WithName("computeapi"))
	apiRunnable.sandboxEvents = api.WarmPoolEvents()
	err = mgr.Add(apiRunnable)
	if err != nil {
		err = fmt.Errorf("add the Compute API: %w", err)
	} else if err = mgr.AddHealthzCheck("ping", healthz.Ping); err != nil {
		err = fmt.Errorf("add health check: %w", err)
	} else if err = mgr.AddReadyzCheck("compute-api", apiRunnable.readyCheck); err != nil {
		err = fmt.Errorf("add readiness check: %w", err)
	}
	if err != nil {
		api.Close()
		return nil, nil, err
	}
	return api, apiRunnable, nil
}

// openStore opens the PostgreSQL store of --store-dsn, or the SQLite store
// in --data-dir, or returns nil when neither is set. Migrations run here,
// so a store this binary cannot use fails the start with a clear error.
func openStore(ctx context.Context, o *options) (*store.Store, error) {
	ctx, cancel := context.WithTimeout(ctx, time.Minute)
	defer cancel()
	switch {
	case o.storeDSN != "":
		st, err := store.OpenPostgres(ctx, o.storeDSN, store.Options{})
		if err != nil {
			// The DSN holds a password: say which flag, not its value.
			return nil, fmt.Errorf("open the store of --store-dsn: %w", err)
		}
		return st, nil
	case o.dataDir != "":
		path := filepath.Join(o.dataDir, "agentbox.db")
		st, err := store.OpenSQLite(ctx, path, store.Options{})
		if err != nil {
			return nil, fmt.Errorf("open the SQLite store %s: %w", path, err)
		}
		return st, nil
	}
	return nil, nil
}

// loadCA reads the platform CA the chart generated.
func loadCA(dir string) (*pki.CA, error) {
	certPEM, err := os.ReadFile(filepath.Join(dir, "tls.crt"))
	if err != nil {
		return nil, fmt.Errorf("load the platform CA from --ca-dir %s: %w", dir, err)
	}
	keyPEM, err := os.ReadFile(filepath.Join(dir, "tls.key"))
	if err != nil {
		return nil, fmt.Errorf("load the platform CA from --ca-dir %s: %w", dir, err)
	}
	ca, err := pki.LoadCA(certPEM, keyPEM)
	if err != nil {
		return nil, fmt.Errorf("load the platform CA from --ca-dir %s: %w", dir, err)
	}
	return ca, nil
}

// loadAdminToken reads the admin token and keeps only its hash, so that the
// token itself is not held in memory for the life of the process.
func loadAdminToken(path string) (computeapi.Authenticator, error) {
	data, err := os.ReadFile(path)
	if err != nil {
		return nil, fmt.Errorf("read the admin token from --admin-token-file: %w", err)
	}
	// Secrets edited by hand often end in a newline that is not part of
	// the token.
	token := strings.TrimSpace(string(data))
	if token == "" {
		return nil, fmt.Errorf("--admin-token-file %s is empty", path)
	}
	return computeapi.NewAdminTokenAuthenticator(computeapi.HashToken(token))
}

// serviceDNSNames are the names clients inside the cluster use for the
// API's Service.
func serviceDNSNames(service, ns string) []string {
	return []string{
		service,
		service + "." + ns,
		service + "." + ns + ".svc",
		service + "." + ns + ".svc.cluster.local",
	}
}

// serviceLookupBound and serviceLookupInterval bound the retries of the
// Service's lookup at start. A replica that restarts while the API server
// does (one that lost its leader election Lease then exits) would
// otherwise serve, until its next restart, a certificate without the
// ClusterIP, which clients connecting to the Service's address refuse.
var (
	serviceLookupBound    = time.Minute
	serviceLookupInterval = time.Second
)

// serviceClusterIPs reads the API Service's ClusterIPs directly from the API
// server (the manager's cache has not started yet), retrying while the API
// server cannot be reached, for up to serviceLookupBound. A missing Service
// is not retried.
func serviceClusterIPs(ctx context.Context, r client.Reader, ns, name string) ([]net.IP, error) {
	ctx, cancel := context.WithTimeout(ctx, serviceLookupBound)
	defer cancel()
	var svc corev1.Service
	for {
		err := r.Get(ctx, types.NamespacedName{Namespace: ns, Name: name}, &svc)
		if err == nil {
			break
		}
		if apierrors.IsNotFound(err) || ctx.Err() != nil {
			return nil, fmt.Errorf("look up Service %s/%s: %w", ns, name, err)
		}
		select {
		case <-ctx.Done():
			return nil, fmt.Errorf("look up Service %s/%s: %w", ns, name, err)
		case <-time.After(serviceLookupInterval):
		}
	}
	addrs := svc.Spec.ClusterIPs
	if len(addrs) == 0 && svc.Spec.ClusterIP != "" {
		addrs = []string{svc.Spec.ClusterIP}
	}
	var ips []net.IP
	for _, a := range addrs {
		if ip := net.ParseIP(a); ip != nil {
			ips = append(ips, ip)
		}
	}
	return ips, nil
}

// logWriter sends the HTTP server's own messages (mostly failed TLS
// handshakes from scanners and probes) to the structured log at debug
// level.
type logWriter struct{ log logr.Logger }

func (w logWriter) Write(p []byte) (int, error) {
	w.log.V(1).Info(strings.TrimSpace(string(p)))
	return len(p), nil
}

// profileHandlers returns net/http/pprof's handlers for the metrics
// server when on; the metrics listener is already cluster-internal.
func profileHandlers(on bool) map[string]http.Handler {
	if !on {
		return nil
	}
	return map[string]http.Handler{
		"/debug/pprof/":        http.HandlerFunc(pprof.Index),
		"/debug/pprof/cmdline": http.HandlerFunc(pprof.Cmdline),
		"/debug/pprof/profile": http.HandlerFunc(pprof.Profile),
		"/debug/pprof/symbol":  http.HandlerFunc(pprof.Symbol),
		"/debug/pprof/trace":   http.HandlerFunc(pprof.Trace),
	}
}

// replicaName names this replica as the executor of the runs it starts:
// the pod's name, which Kubernetes sets as HOSTNAME and as the host name.
func replicaName() string {
	if h := os.Getenv("HOSTNAME"); h != "" {
		return h
	}
	h, _ := os.Hostname()
	return h
}
