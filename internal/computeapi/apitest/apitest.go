// Package apitest runs the real Compute API in process, for tests of its
// clients, as net/http/httptest does for HTTP handlers.
//
// A Server wires the real computeapi.Server to a real in-process supervisor
// (the sandbox's HTTP handler, run as the test's user on a temporary
// workspace) over mutual TLS with the identities the platform CA issues,
// and to a controller-runtime fake Kubernetes client that holds one agent's
// Sandbox and its Lease (its activity clock). Clients therefore meet the
// real authentication, scoping, hold, file, command and error code paths;
// only the cluster and the sandbox's isolation are stand-ins. Nothing listens beyond loopback.
//
// It is meant for tests only: commands run unsandboxed on the host.
package apitest

import (
	"context"
	"crypto/rand"
	"crypto/subtle"
	"crypto/tls"
	"encoding/pem"
	"fmt"
	"log/slog"
	"net/http/httptest"
	"os"
	"time"

	coordinationv1 "k8s.io/api/coordination/v1"
	"k8s.io/apimachinery/pkg/api/meta"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/runtime"
	clientgoscheme "k8s.io/client-go/kubernetes/scheme"
	ctrlclient "sigs.k8s.io/controller-runtime/pkg/client"
	"sigs.k8s.io/controller-runtime/pkg/client/fake"

	"github.com/agentbox/terraform-provider-agentbox/internal/api/v1alpha1"
	"github.com/agentbox/terraform-provider-agentbox/internal/computeapi"
	"github.com/agentbox/terraform-provider-agentbox/internal/computeapi/client"
	"github.com/agentbox/terraform-provider-agentbox/internal/computeapi/holds"
	"github.com/agentbox/terraform-provider-agentbox/internal/pki"
	"github.com/agentbox/terraform-provider-agentbox/internal/store"
	"github.com/agentbox/terraform-provider-agentbox/internal/supervisor"
	"github.com/agentbox/terraform-provider-agentbox/internal/supervisor/supervisorapi"
)

// Defaults of Options.
const (
	DefaultAgentID   = "agent-1"
	DefaultNamespace = "team-a"
	DefaultSandbox   = "sb-1"
)

// platformNamespace is where the control plane's identity says it runs;
// both ends of the mutual TLS are made here, so any name would do.
const platformNamespace = "agentbox-system"

// Options configure a Server. The zero value serves DefaultAgentID's ready
// sandbox DefaultNamespace/DefaultSandbox.
type Options struct {
	AgentID, Namespace, Sandbox string
	// Supervisor configures the in-process supervisor. An empty Workspace
	// is a temporary directory that Close removes; the Logger defaults to
	// one that discards.
	Supervisor supervisor.Config
	// Store, when set, audits every call and authenticates the tokens it
	// holds besides AdminToken and AgentToken. The caller closes it after
	// the Server.
	Store *store.Store
	// Objects are added to the fake cluster beside the agent's Sandbox
	// and Lease (other sandboxes, warm pools, ...).
	Objects []ctrlclient.Object
	// ResumeTimeout bounds how long a call waits for a sandbox that is
	// not ready; zero means computeapi.DefaultResumeTimeout.
	ResumeTimeout time.Duration
	// RunArtifacts says where runs' artifacts go; none are kept without
	// a store.
	RunArtifacts computeapi.RunArtifactsOptions
}

// Server is a running Compute API. Its fields are set by NewServer and
// must not be changed.
type Server struct {
	// URL is the API's base URL, https://127.0.0.1:port.
	URL string
	// CAPEM is the PEM certificate that verifies the API's serving
	// certificate, for client.New or a --ca-file.
	CAPEM []byte
	// AdminToken addresses every agent; AgentToken addresses AgentID's
	// sandbox only.
	AdminToken, AgentToken string
	// AgentID's sandbox is Namespace/Sandbox, Running and Ready.
	AgentID, Namespace, Sandbox string
	// Workspace is the supervisor's workspace directory, the sandbox's
	// /workspace.
	Workspace string
	// Kube is the fake cluster the API reads Sandboxes and writes Leases
	// in; tests may change objects in it (see SetSandboxState).
	Kube ctrlclient.WithWatch
	// API and Supervisor are the servers, for tests that need more than
	// the HTTP surface.
	API        *computeapi.Server
	Supervisor *supervisor.Server

	apiHTTP, supHTTP *httptest.Server
	pool             *computeapi.SupervisorPool
	ca               *pki.CA
	tempWorkspace    string
}

// NewServer starts a Compute API in front of a ready sandbox. Close it when
// done.
func NewServer(opts Options) (s *Server, err error) {
	s = &Server{AgentID: opts.AgentID, Namespace: opts.Namespace, Sandbox: opts.Sandbox}
	if s.AgentID == "" {
		s.AgentID = DefaultAgentID
	}
	if s.Namespace == "" {
		s.Namespace = DefaultNamespace
	}
	if s.Sandbox == "" {
		s.Sandbox = DefaultSandbox
	}
	defer func() {
		if err != nil {
			s.Close()
			s = nil
		}
	}()
	s.AdminToken, s.AgentToken = "apitest-admin-"+rand.Text(), "apitest-agent-"+rand.Text()
	ca, err := pki.NewCA("apitest CA")
	if err != nil {
		return nil, fmt.Errorf("apitest: platform CA: %w", err)
	}
	s.ca = ca
	// The trust domain is left at pki's default on both sides, as in a
	// default installation.
	if err := s.startSupervisor(opts.Supervisor, ca); err != nil {
		return nil, err
	}

	scheme := runtime.NewScheme()
	if err := clientgoscheme.AddToScheme(scheme); err != nil {
		return nil, fmt.Errorf("apitest: scheme: %w", err)
	}
	if err := v1alpha1.AddToScheme(scheme); err != nil {
		return nil, fmt.Errorf("apitest: scheme: %w", err)
	}
	sb := s.readySandbox()
	renew := metav1.NewMicroTime(time.Now())
	lease := &coordinationv1.Lease{ObjectMeta: metav1.ObjectMeta{Namespace: s.Namespace, Name: holds.ActivityLeaseKey(sb).Name},
		Spec: coordinationv1.LeaseSpec{RenewTime: &renew}}
	s.Kube = fake.NewClientBuilder().WithScheme(scheme).
		WithObjects(append([]ctrlclient.Object{sb, lease}, opts.Objects...)...).
		WithStatusSubresource(&v1alpha1.Sandbox{}).Build()

	if s.pool, err = controlPlanePool(ca); err != nil {
		return nil, err
	}
	admin, err := computeapi.NewAdminTokenAuthenticator(computeapi.HashToken(s.AdminToken))
	if err != nil {
		return nil, fmt.Errorf("apitest: %w", err)
	}
	auth := computeapi.ChainAuthenticators(admin, agentAuth{token: s.AgentToken, agentID: s.AgentID})
	if opts.Store != nil {
		auth = computeapi.ChainAuthenticators(auth, computeapi.NewStoreAuthenticator(opts.Store))
	}
	s.API, err = computeapi.NewServer(computeapi.Options{Sandboxes: s.Kube, Leases: s.Kube, Supervisors: s.pool,
		Authenticator: auth, Store: opts.Store, ResumeTimeout: opts.ResumeTimeout, RunArtifacts: opts.RunArtifacts})
	if err != nil {
		return nil, fmt.Errorf("apitest: %w", err)
	}
	s.apiHTTP = httptest.NewTLSServer(s.API.Handler())
	s.URL = s.apiHTTP.URL
	s.CAPEM = pem.EncodeToMemory(&pem.Block{Type: "CERTIFICATE", Bytes: s.apiHTTP.Certificate().Raw})
	return s, nil
}

// startSupervisor serves a real supervisor over mutual TLS: it presents
// the sandbox's identity and accepts only the control plane's.
func (s *Server) startSupervisor(cfg supervisor.Config, ca *pki.CA) error {
	if cfg.Workspace == "" {
		dir, err := os.MkdirTemp("", "apitest-workspace-")
		if err != nil {
			return fmt.Errorf("apitest: workspace: %w", err)
		}
		s.tempWorkspace, cfg.Workspace = dir, dir
	}
	if cfg.Logger == nil {
		cfg.Logger = slog.New(slog.DiscardHandler)
	}
	sup, err := supervisor.New(cfg)
	if err != nil {
		return fmt.Errorf("apitest: supervisor: %w", err)
	}
	s.Supervisor, s.Workspace = sup, cfg.Workspace
	leaf, err := ca.Issue(pki.LeafOptions{ID: pki.SandboxID("", s.Namespace, s.Sandbox), Usage: pki.UsageServer})
	if err != nil {
		return fmt.Errorf("apitest: supervisor certificate: %w", err)
	}
	cert, err := leaf.TLSCertificate()
	if err != nil {
		return fmt.Errorf("apitest: supervisor certificate: %w", err)
	}
	s.supHTTP = httptest.NewUnstartedServer(sup)
	s.supHTTP.TLS = pki.ServerTLS(cert, ca.Pool(), pki.ControlPlaneID("", platformNamespace).String())
	s.supHTTP.StartTLS()
	return nil
}

// SupervisorClient calls the supervisor directly, with the control
// plane's identity, for tests that compare a call through the API with
// the same call made straight to the sandbox.
func (s *Server) SupervisorClient() (*supervisorapi.Client, error) {
	cert, err := controlPlaneCertificate(s.ca)
	if err != nil {
		return nil, err
	}
	tlsConfig := pki.ClientTLS(cert, s.ca.Pool(), pki.SandboxID("", s.Namespace, s.Sandbox).String())
	return supervisorapi.NewClient(s.supHTTP.URL, supervisorapi.NewHTTPClient(tlsConfig)), nil
}

func controlPlaneCertificate(ca *pki.CA) (tls.Certificate, error) {
	leaf, err := ca.Issue(pki.LeafOptions{ID: pki.ControlPlaneID("", platformNamespace), Usage: pki.UsageClient})
	if err != nil {
		return tls.Certificate{}, fmt.Errorf("apitest: control plane certificate: %w", err)
	}
	cert, err := leaf.TLSCertificate()
	if err != nil {
		return tls.Certificate{}, fmt.Errorf("apitest: control plane certificate: %w", err)
	}
	return cert, nil
}

// controlPlanePool dials supervisors with the control plane's client
// identity.
func controlPlanePool(ca *pki.CA) (*computeapi.SupervisorPool, error) {
	cert, err := controlPlaneCertificate(ca)
	if err != nil {
		return nil, err
	}
	pool, err := computeapi.NewSupervisorPool(computeapi.StaticCertificate(cert), ca.Pool())
	if err != nil {
		return nil, fmt.Errorf("apitest: %w", err)
	}
	return pool, nil
}

func (s *Server) readySandbox() *v1alpha1.Sandbox {
	return &v1alpha1.Sandbox{
		ObjectMeta: metav1.ObjectMeta{Namespace: s.Namespace, Name: s.Sandbox,
			Labels: map[string]string{v1alpha1.LabelAgentIDHash: v1alpha1.AgentIDHash(s.AgentID)}},
		Spec: v1alpha1.SandboxSpec{AgentID: s.AgentID, TemplateRef: v1alpha1.LocalObjectReference{Name: "default"}},
		Status: v1alpha1.SandboxStatus{
			Phase:           v1alpha1.SandboxPhaseRunning,
			ServiceEndpoint: s.supHTTP.URL,
			Conditions: []metav1.Condition{{Type: v1alpha1.ConditionReady, Status: metav1.ConditionTrue,
				Reason: v1alpha1.ReasonRunning, LastTransitionTime: metav1.Now()}},
		},
	}
}

// SetSandboxState sets the phase and the Ready condition (with reason) of
// the agent's Sandbox, as the controller would. The supervisor keeps
// serving whatever the phase says, so a test can stop a sandbox and "resume"
// it by setting Running and ready again.
func (s *Server) SetSandboxState(ctx context.Context, phase v1alpha1.SandboxPhase, ready bool, reason string) error {
	var sb v1alpha1.Sandbox
	if err := s.Kube.Get(ctx, ctrlclient.ObjectKey{Namespace: s.Namespace, Name: s.Sandbox}, &sb); err != nil {
		return fmt.Errorf("apitest: get sandbox: %w", err)
	}
	status := metav1.ConditionFalse
	if ready {
		status = metav1.ConditionTrue
	}
	sb.Status.Phase = phase
	meta.SetStatusCondition(&sb.Status.Conditions, metav1.Condition{Type: v1alpha1.ConditionReady, Status: status, Reason: reason})
	if err := s.Kube.Status().Update(ctx, &sb); err != nil {
		return fmt.Errorf("apitest: update sandbox status: %w", err)
	}
	return nil
}

// Client returns a client of the API that authenticates with token and
// trusts the API's certificate.
func (s *Server) Client(token string) (*client.Client, error) {
	return client.New(s.URL, token, s.CAPEM)
}

// Close stops the servers, writes the queued audit records and removes a
// temporary workspace. It does not close Options.Store.
func (s *Server) Close() {
	if s.apiHTTP != nil {
		s.apiHTTP.Close()
	}
	if s.API != nil {
		s.API.Close()
	}
	if s.pool != nil {
		s.pool.Close()
	}
	if s.supHTTP != nil {
		s.supHTTP.Close()
	}
	if s.Supervisor != nil {
		_ = s.Supervisor.Close()
	}
	if s.tempWorkspace != "" {
		_ = os.RemoveAll(s.tempWorkspace)
	}
}

// agentAuth accepts one agent token, as the store would one it minted.
type agentAuth struct{ token, agentID string }

func (a agentAuth) Authenticate(_ context.Context, token string) (*computeapi.Principal, error) {
	if subtle.ConstantTimeCompare([]byte(token), []byte(a.token)) != 1 {
		return nil, computeapi.ErrInvalidToken
	}
	return &computeapi.Principal{Name: "agent:apitest", Kind: string(store.TokenAgent), AgentID: a.agentID}, nil
}
