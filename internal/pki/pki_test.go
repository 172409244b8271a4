package pki

import (
	"crypto/rand"
	"crypto/rsa"
	"crypto/tls"
	"crypto/x509"
	"crypto/x509/pkix"
	"encoding/pem"
	"errors"
	"io"
	"math/big"
	"net"
	"net/url"
	"strings"
	"testing"
	"time"
)

const td = "agentbox.local"

func TestIDs(t *testing.T) {
	if got, want := SandboxID("", "team-a", "sb-1").String(), "spiffe://agentbox.local/ns/team-a/sandbox/sb-1"; got != want {
		t.Errorf("SandboxID = %s, want %s", got, want)
	}
	if got, want := ControlPlaneID("example.org", "agentbox-system").String(), "spiffe://example.org/ns/agentbox-system/sa/agentbox-controlplane"; got != want {
		t.Errorf("ControlPlaneID = %s, want %s", got, want)
	}
	for _, bad := range []string{"https://agentbox.local/ns/a", "spiffe:///ns/a", "spiffe://td", "spiffe://td/ns/a/", "spiffe://td:8/ns/a", "spiffe://td/ns/a?x=1", "spiffe://u@td/ns/a"} {
		u, err := url.Parse(bad)
		if err != nil {
			t.Fatal(err)
		}
		if ValidateID(u) == nil {
			t.Errorf("ValidateID(%s) accepted a malformed ID", bad)
		}
	}
}

func TestCARoundTripAndIssue(t *testing.T) {
	ca := mustCA(t, "test-ca")
	keyPEM, err := ca.KeyPEM()
	if err != nil {
		t.Fatal(err)
	}
	loaded, err := LoadCA(ca.CertPEM, keyPEM)
	if err != nil {
		t.Fatalf("LoadCA: %v", err)
	}
	id := SandboxID(td, "ns1", "box")
	leaf, err := loaded.Issue(LeafOptions{ID: id, Usage: UsageServer})
	if err != nil {
		t.Fatal(err)
	}
	if _, err := leaf.Cert.Verify(x509.VerifyOptions{Roots: ca.Pool(), KeyUsages: []x509.ExtKeyUsage{x509.ExtKeyUsageServerAuth}}); err != nil {
		t.Fatalf("leaf does not verify against the CA: %v", err)
	}
	got, err := IDFromCert(leaf.Cert)
	if err != nil || got.String() != id.String() {
		t.Fatalf("IDFromCert = %v, %v; want %s", got, err, id)
	}
	if leaf.Cert.Subject.CommonName != "box" {
		t.Errorf("CommonName = %q, want box", leaf.Cert.Subject.CommonName)
	}
	if life := leaf.Cert.NotAfter.Sub(time.Now()); life < DefaultServingCertLifetime-time.Minute || life > DefaultServingCertLifetime {
		t.Errorf("default lifetime = %s, want about %s", life, DefaultServingCertLifetime)
	}
	if _, err := leaf.TLSCertificate(); err != nil {
		t.Fatal(err)
	}

	client, err := ca.Issue(LeafOptions{ID: ControlPlaneID(td, "sys"), Usage: UsageClient, Lifetime: DefaultClientCertLifetime})
	if err != nil {
		t.Fatal(err)
	}
	if life := client.Cert.NotAfter.Sub(time.Now()); life > DefaultClientCertLifetime {
		t.Errorf("client lifetime = %s, want at most %s", life, DefaultClientCertLifetime)
	}
	if _, err := client.Cert.Verify(x509.VerifyOptions{Roots: ca.Pool(), KeyUsages: []x509.ExtKeyUsage{x509.ExtKeyUsageServerAuth}}); err == nil {
		t.Error("a client-only certificate verified for server use")
	}

	long, err := ca.Issue(LeafOptions{ID: id, Usage: UsageServer, Lifetime: 2 * DefaultCALifetime})
	if err != nil {
		t.Fatal(err)
	}
	if long.Cert.NotAfter.After(ca.Cert.NotAfter) {
		t.Errorf("leaf outlives its CA: %s > %s", long.Cert.NotAfter, ca.Cert.NotAfter)
	}

	if _, err := ca.Issue(LeafOptions{ID: id}); err == nil {
		t.Error("Issue without a usage succeeded")
	}
	if _, err := ca.Issue(LeafOptions{Usage: UsageServer}); err == nil {
		t.Error("Issue without an ID succeeded")
	}
}

// Helm's genCA, which a chart may use to make the platform CA, produces an
// RSA key in PKCS#1 form.
func TestLoadCARSA(t *testing.T) {
	key, err := rsa.GenerateKey(rand.Reader, 2048)
	if err != nil {
		t.Fatal(err)
	}
	tmpl := &x509.Certificate{
		SerialNumber: big.NewInt(1), Subject: pkix.Name{CommonName: "helm-ca"},
		NotBefore: time.Now().Add(-time.Hour), NotAfter: time.Now().Add(24 * time.Hour),
		KeyUsage:              x509.KeyUsageKeyEncipherment | x509.KeyUsageDigitalSignature | x509.KeyUsageCertSign,
		BasicConstraintsValid: true, IsCA: true,
	}
	der, err := x509.CreateCertificate(rand.Reader, tmpl, tmpl, key.Public(), key)
	if err != nil {
		t.Fatal(err)
	}
	ca, err := LoadCA(pem.EncodeToMemory(&pem.Block{Type: "CERTIFICATE", Bytes: der}),
		pem.EncodeToMemory(&pem.Block{Type: "RSA PRIVATE KEY", Bytes: x509.MarshalPKCS1PrivateKey(key)}))
	if err != nil {
		t.Fatalf("LoadCA: %v", err)
	}
	leaf, err := ca.Issue(LeafOptions{ID: SandboxID(td, "a", "b"), Usage: UsageServer | UsageClient})
	if err != nil {
		t.Fatal(err)
	}
	if _, err := leaf.Cert.Verify(x509.VerifyOptions{Roots: ca.Pool()}); err != nil {
		t.Fatal(err)
	}
	if !leaf.Cert.NotAfter.Equal(ca.Cert.NotAfter) {
		t.Errorf("leaf NotAfter %s, want clamped to CA's %s", leaf.Cert.NotAfter, ca.Cert.NotAfter)
	}
}

func TestLoadCARejects(t *testing.T) {
	ca := mustCA(t, "ca")
	leaf := mustLeaf(t, ca, SandboxID(td, "a", "b"), UsageServer)
	if _, err := LoadCA(leaf.CertPEM, leaf.KeyPEM); err == nil || !strings.Contains(err.Error(), "not a CA") {
		t.Errorf("LoadCA(leaf) = %v, want a not-a-CA error", err)
	}
	other := mustCA(t, "other")
	otherKey, _ := other.KeyPEM()
	if _, err := LoadCA(ca.CertPEM, otherKey); err == nil {
		t.Error("LoadCA accepted a key that does not match the certificate")
	}
	if _, err := CertPoolFromPEM([]byte("garbage")); err == nil {
		t.Error("CertPoolFromPEM accepted data without certificates")
	}
}

// pair holds a CA and the certificates the handshake tests combine.
type pair struct {
	ca, otherCA                  *CA
	serverID, clientID           *url.URL
	server, client               tls.Certificate
	wrongServer, wrongClient     tls.Certificate
	foreignClient, foreignServer tls.Certificate
	serverOnlyClient             tls.Certificate
	clientOnlyServer             tls.Certificate
}

func newPair(t *testing.T) *pair {
	p := &pair{ca: mustCA(t, "platform"), otherCA: mustCA(t, "attacker")}
	p.serverID = SandboxID(td, "agents", "sb-1")
	p.clientID = ControlPlaneID(td, "agentbox-system")
	p.server = mustTLS(t, p.ca, p.serverID, UsageServer)
	p.client = mustTLS(t, p.ca, p.clientID, UsageClient)
	// Another sandbox's identity: valid chain, wrong URI. This is the case
	// that matters most: one sandbox must not pose as the control plane or
	// as another sandbox.
	p.wrongServer = mustTLS(t, p.ca, SandboxID(td, "agents", "sb-2"), UsageServer)
	p.wrongClient = mustTLS(t, p.ca, SandboxID(td, "agents", "sb-2"), UsageClient|UsageServer)
	p.foreignClient = mustTLS(t, p.otherCA, p.clientID, UsageClient)
	p.foreignServer = mustTLS(t, p.otherCA, p.serverID, UsageServer)
	p.serverOnlyClient = mustTLS(t, p.ca, p.clientID, UsageServer)
	p.clientOnlyServer = mustTLS(t, p.ca, p.serverID, UsageClient)
	return p
}

func TestHandshakes(t *testing.T) {
	p := newPair(t)
	pool := p.ca.Pool()
	srv := func(cert tls.Certificate, allowed ...string) *tls.Config { return ServerTLS(cert, pool, allowed...) }
	cli := func(cert tls.Certificate) *tls.Config { return ClientTLS(cert, pool, p.serverID.String()) }
	forced := func(cert tls.Certificate) *tls.Config {
		// Go's client only offers a certificate issued by a CA the server
		// named, so force it to show that the server itself refuses.
		c := cli(tls.Certificate{})
		c.Certificates = nil
		c.GetClientCertificate = func(*tls.CertificateRequestInfo) (*tls.Certificate, error) { return &cert, nil }
		return c
	}
	noCert := cli(tls.Certificate{})
	noCert.Certificates = nil

	cases := []struct {
		name       string
		server     *tls.Config
		client     *tls.Config
		wantErrIn  string // "" for success, else "server" or "client"
		wantErrMsg string
	}{
		{name: "allowed client", server: srv(p.server, p.clientID.String()), client: cli(p.client)},
		{name: "one of several allowed", server: srv(p.server, "spiffe://agentbox.local/ns/x/sa/y", p.clientID.String()), client: cli(p.client)},
		{name: "client with wrong URI", server: srv(p.server, p.clientID.String()), client: cli(p.wrongClient), wantErrIn: "server", wantErrMsg: "not allowed"},
		{name: "client from another CA", server: srv(p.server, p.clientID.String()), client: forced(p.foreignClient), wantErrIn: "server", wantErrMsg: "unknown authority"},
		{name: "client from another CA, not offered", server: srv(p.server, p.clientID.String()), client: cli(p.foreignClient), wantErrIn: "server", wantErrMsg: "certificate"},
		{name: "no client certificate", server: srv(p.server, p.clientID.String()), client: noCert, wantErrIn: "server", wantErrMsg: "certificate"},
		{name: "client cert without client usage", server: srv(p.server, p.clientID.String()), client: forced(p.serverOnlyClient), wantErrIn: "server", wantErrMsg: "usage"},
		{name: "no allowed IDs fails closed", server: srv(p.server), client: cli(p.client), wantErrIn: "server", wantErrMsg: "not allowed"},
		{name: "server with wrong URI", server: srv(p.wrongServer, p.clientID.String()), client: cli(p.client), wantErrIn: "client", wantErrMsg: "want " + p.serverID.String()},
		{name: "server from another CA", server: srv(p.foreignServer, p.clientID.String()), client: cli(p.client), wantErrIn: "client", wantErrMsg: "unknown authority"},
		{name: "server cert without server usage", server: srv(p.clientOnlyServer, p.clientID.String()), client: cli(p.client), wantErrIn: "client", wantErrMsg: "usage"},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			serverErr, clientErr := handshake(t, tc.server, tc.client)
			switch tc.wantErrIn {
			case "":
				if serverErr != nil || clientErr != nil {
					t.Fatalf("handshake failed: server: %v, client: %v", serverErr, clientErr)
				}
			case "server":
				if serverErr == nil || !strings.Contains(serverErr.Error(), tc.wantErrMsg) {
					t.Fatalf("server error = %v, want one containing %q", serverErr, tc.wantErrMsg)
				}
				if clientErr == nil {
					t.Fatal("client got data from a server that refused it")
				}
			case "client":
				if clientErr == nil || !strings.Contains(clientErr.Error(), tc.wantErrMsg) {
					t.Fatalf("client error = %v, want one containing %q", clientErr, tc.wantErrMsg)
				}
			}
		})
	}
}

// A resumed TLS 1.3 session skips certificate exchange; the checks must
// still run on it, or a cached session could reach a server the current
// configuration would refuse.
func TestResumedSessionIsStillVerified(t *testing.T) {
	p := newPair(t)
	server := ServerTLS(p.server, p.ca.Pool(), p.clientID.String())
	cache := tls.NewLRUClientSessionCache(4)
	client := func(expected string) *tls.Config {
		c := ClientTLS(p.client, p.ca.Pool(), expected)
		c.ClientSessionCache = cache
		c.ServerName = "sandbox" // one cache key for all connections
		return c
	}
	ln := listen(t, server)
	for i := 0; i < 2; i++ {
		if _, err := dialAndRead(ln.Addr().String(), client(p.serverID.String())); err != nil {
			t.Fatalf("connection %d: %v", i, err)
		}
	}
	state, err := dialAndRead(ln.Addr().String(), client(p.serverID.String()))
	if err != nil {
		t.Fatal(err)
	}
	if !state.DidResume {
		t.Fatal("session was not resumed; the test would prove nothing")
	}
	if _, err := dialAndRead(ln.Addr().String(), client(SandboxID(td, "agents", "other").String())); err == nil || !strings.Contains(err.Error(), "want spiffe://") {
		t.Fatalf("resumed session with the wrong expected ID: err = %v, want an identity mismatch", err)
	}
}

// handshake runs one TLS connection over loopback and returns each side's
// error. On success the server writes "ok" and the client must read it: in
// TLS 1.3 the client finishes its handshake before the server has checked
// the client's certificate, so only a read proves the server accepted it.
func handshake(t *testing.T, serverCfg, clientCfg *tls.Config) (serverErr, clientErr error) {
	t.Helper()
	ln, err := tls.Listen("tcp", "127.0.0.1:0", serverCfg)
	if err != nil {
		t.Fatal(err)
	}
	defer ln.Close()
	done := make(chan error, 1)
	go func() { done <- serveOne(ln) }()
	_, clientErr = dialAndRead(ln.Addr().String(), clientCfg)
	select {
	case serverErr = <-done:
	case <-time.After(10 * time.Second):
		t.Fatal("server did not finish")
	}
	return serverErr, clientErr
}

func listen(t *testing.T, cfg *tls.Config) net.Listener {
	t.Helper()
	ln, err := tls.Listen("tcp", "127.0.0.1:0", cfg)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { ln.Close() })
	go func() {
		for serveOne(ln) != net.ErrClosed {
		}
	}()
	return ln
}

func serveOne(ln net.Listener) error {
	conn, err := ln.Accept()
	if err != nil {
		if errors.Is(err, net.ErrClosed) {
			return net.ErrClosed
		}
		return err
	}
	defer conn.Close()
	_ = conn.SetDeadline(time.Now().Add(10 * time.Second))
	if err := conn.(*tls.Conn).Handshake(); err != nil {
		return err
	}
	_, err = conn.Write([]byte("ok"))
	return err
}

func dialAndRead(addr string, cfg *tls.Config) (tls.ConnectionState, error) {
	conn, err := tls.DialWithDialer(&net.Dialer{Timeout: 10 * time.Second}, "tcp", addr, cfg)
	if err != nil {
		return tls.ConnectionState{}, err
	}
	defer conn.Close()
	_ = conn.SetDeadline(time.Now().Add(10 * time.Second))
	buf := make([]byte, 2)
	if _, err := io.ReadFull(conn, buf); err != nil {
		return conn.ConnectionState(), err
	}
	if string(buf) != "ok" {
		return conn.ConnectionState(), errors.New("unexpected data " + string(buf))
	}
	return conn.ConnectionState(), nil
}

func mustCA(t *testing.T, cn string) *CA {
	t.Helper()
	ca, err := NewCA(cn)
	if err != nil {
		t.Fatal(err)
	}
	return ca
}

func mustLeaf(t *testing.T, ca *CA, id *url.URL, usage Usage) *Leaf {
	t.Helper()
	leaf, err := ca.Issue(LeafOptions{ID: id, Usage: usage})
	if err != nil {
		t.Fatal(err)
	}
	return leaf
}

func mustTLS(t *testing.T, ca *CA, id *url.URL, usage Usage) tls.Certificate {
	t.Helper()
	c, err := mustLeaf(t, ca, id, usage).TLSCertificate()
	if err != nil {
		t.Fatal(err)
	}
	return c
}
