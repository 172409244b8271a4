// Package pki is the platform's certificate authority logic: it loads the CA
// the chart generates, issues leaf certificates whose identity is a
// SPIFFE-style URI SAN, and builds TLS configurations that authenticate
// peers by that URI rather than by host name.
//
// Identities follow the SPIFFE ID format so that a SPIRE deployment can
// replace the platform CA without changing how peers are checked:
//
//	control plane:      spiffe://<trust-domain>/ns/<namespace>/sa/agentbox-controlplane
//	sandbox supervisor: spiffe://<trust-domain>/ns/<namespace>/sandbox/<sandbox-name>
//
// The package uses the standard library only, so that the in-sandbox
// supervisor can link it without pulling in control-plane dependencies.
package pki

import (
	"crypto"
	"crypto/ecdsa"
	"crypto/elliptic"
	"crypto/rand"
	"crypto/tls"
	"crypto/x509"
	"crypto/x509/pkix"
	"encoding/pem"
	"errors"
	"fmt"
	"math/big"
	"net"
	"net/url"
	"strings"
	"time"
)

const (
	// DefaultTrustDomain is used when a caller passes an empty trust domain.
	DefaultTrustDomain = "agentbox.local"

	// ControlPlaneServiceAccount is the service account name in the control
	// plane's identity.
	ControlPlaneServiceAccount = "agentbox-controlplane"

	// DefaultServingCertLifetime suits sandbox serving certificates: a pod
	// never lives that long (idle sandboxes are stopped after an hour), so
	// the certificate never needs rotating in place.
	DefaultServingCertLifetime = 365 * 24 * time.Hour

	// DefaultClientCertLifetime suits the control plane's client
	// certificate, which it reissues from the CA at start-up.
	DefaultClientCertLifetime = 90 * 24 * time.Hour

	// DefaultCALifetime is the lifetime NewCA gives a new CA.
	DefaultCALifetime = 10 * 365 * 24 * time.Hour

	// backdate tolerates clock skew between the issuer and the verifier.
	backdate = 5 * time.Minute
)

// SandboxID returns the identity of the supervisor of sandbox name in
// namespace ns. An empty trustDomain means DefaultTrustDomain.
func SandboxID(trustDomain, ns, name string) *url.URL {
	return spiffeID(trustDomain, "ns", ns, "sandbox", name)
}

// ControlPlaneID returns the identity of the control plane running in
// namespace ns. An empty trustDomain means DefaultTrustDomain.
func ControlPlaneID(trustDomain, ns string) *url.URL {
	return spiffeID(trustDomain, "ns", ns, "sa", ControlPlaneServiceAccount)
}

func spiffeID(trustDomain string, segments ...string) *url.URL {
	if trustDomain == "" {
		trustDomain = DefaultTrustDomain
	}
	escaped := make([]string, len(segments))
	for i, s := range segments {
		escaped[i] = url.PathEscape(s)
	}
	return &url.URL{Scheme: "spiffe", Host: trustDomain, Path: "/" + strings.Join(segments, "/"),
		RawPath: "/" + strings.Join(escaped, "/")}
}

// ValidateID checks that id is a well-formed SPIFFE ID: scheme spiffe, a
// trust domain, a path, and nothing else.
func ValidateID(id *url.URL) error {
	switch {
	case id == nil:
		return errors.New("empty identity")
	case id.Scheme != "spiffe":
		return fmt.Errorf("identity %q: scheme must be spiffe", id)
	case id.Host == "" || id.Port() != "":
		return fmt.Errorf("identity %q: needs a trust domain and no port", id)
	case id.User != nil || id.RawQuery != "" || id.Fragment != "" || id.Opaque != "":
		return fmt.Errorf("identity %q: must not have user info, query, fragment or opaque part", id)
	case id.Path == "" || id.Path == "/" || strings.HasSuffix(id.Path, "/"):
		return fmt.Errorf("identity %q: needs a path without a trailing slash", id)
	}
	return nil
}

// ParseID parses and validates a SPIFFE ID.
func ParseID(s string) (*url.URL, error) {
	u, err := url.Parse(s)
	if err != nil {
		return nil, fmt.Errorf("identity %q: %w", s, err)
	}
	if err := ValidateID(u); err != nil {
		return nil, err
	}
	return u, nil
}

// IDFromCert returns the SPIFFE ID a certificate carries. Like an X.509
// SVID, the certificate must have exactly one URI SAN, so that there is no
// question which identity a peer is.
func IDFromCert(cert *x509.Certificate) (*url.URL, error) {
	if cert == nil {
		return nil, errors.New("no certificate")
	}
	if len(cert.URIs) != 1 {
		return nil, fmt.Errorf("certificate %q has %d URI SANs, want exactly 1", cert.Subject.CommonName, len(cert.URIs))
	}
	id := cert.URIs[0]
	if err := ValidateID(id); err != nil {
		return nil, err
	}
	return id, nil
}

// CA is a certificate authority that can issue leaf certificates.
type CA struct {
	Cert *x509.Certificate
	Key  crypto.Signer
	// CertPEM is the CA certificate as it was loaded or created; it is what
	// goes into a serving Secret's ca.crt.
	CertPEM []byte
}

// NewCA creates a self-signed ECDSA P-256 CA valid for DefaultCALifetime.
func NewCA(commonName string) (*CA, error) {
	key, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	if err != nil {
		return nil, fmt.Errorf("generate CA key: %w", err)
	}
	serial, err := newSerial()
	if err != nil {
		return nil, err
	}
	now := time.Now()
	tmpl := &x509.Certificate{
		SerialNumber:          serial,
		Subject:               pkix.Name{CommonName: commonName},
		NotBefore:             now.Add(-backdate),
		NotAfter:              now.Add(DefaultCALifetime),
		KeyUsage:              x509.KeyUsageCertSign | x509.KeyUsageCRLSign | x509.KeyUsageDigitalSignature,
		BasicConstraintsValid: true,
		IsCA:                  true,
	}
	der, err := x509.CreateCertificate(rand.Reader, tmpl, tmpl, key.Public(), key)
	if err != nil {
		return nil, fmt.Errorf("create CA certificate: %w", err)
	}
	cert, err := x509.ParseCertificate(der)
	if err != nil {
		return nil, fmt.Errorf("parse CA certificate: %w", err)
	}
	return &CA{Cert: cert, Key: key, CertPEM: encodePEM("CERTIFICATE", der)}, nil
}

// LoadCA loads a CA from PEM, as stored in a kubernetes.io/tls Secret
// (tls.crt, tls.key). The key may be PKCS#1, SEC 1 or PKCS#8, so a CA made
// by Helm's genCA (RSA) works as well as one made by NewCA.
func LoadCA(certPEM, keyPEM []byte) (*CA, error) {
	pair, err := tls.X509KeyPair(certPEM, keyPEM)
	if err != nil {
		return nil, fmt.Errorf("load CA key pair: %w", err)
	}
	cert := pair.Leaf
	if cert == nil {
		if cert, err = x509.ParseCertificate(pair.Certificate[0]); err != nil {
			return nil, fmt.Errorf("parse CA certificate: %w", err)
		}
	}
	if !cert.IsCA || !cert.BasicConstraintsValid {
		return nil, fmt.Errorf("certificate %q is not a CA", cert.Subject.CommonName)
	}
	if cert.KeyUsage != 0 && cert.KeyUsage&x509.KeyUsageCertSign == 0 {
		return nil, fmt.Errorf("CA %q may not sign certificates (key usage)", cert.Subject.CommonName)
	}
	key, ok := pair.PrivateKey.(crypto.Signer)
	if !ok {
		return nil, fmt.Errorf("CA key of type %T cannot sign", pair.PrivateKey)
	}
	return &CA{Cert: cert, Key: key, CertPEM: encodePEM("CERTIFICATE", pair.Certificate[0])}, nil
}

// KeyPEM returns the CA key as PKCS#8 PEM, for tooling that stores a CA
// made by NewCA.
func (ca *CA) KeyPEM() ([]byte, error) {
	der, err := x509.MarshalPKCS8PrivateKey(ca.Key)
	if err != nil {
		return nil, fmt.Errorf("marshal CA key: %w", err)
	}
	return encodePEM("PRIVATE KEY", der), nil
}

// Pool returns a pool that trusts only this CA.
func (ca *CA) Pool() *x509.CertPool {
	pool := x509.NewCertPool()
	pool.AddCert(ca.Cert)
	return pool
}

// Usage says what a leaf certificate may authenticate.
type Usage uint8

const (
	UsageServer Usage = 1 << iota
	UsageClient
)

// LeafOptions describes a leaf certificate to issue.
type LeafOptions struct {
	// ID is the SPIFFE ID; it becomes the certificate's only URI SAN.
	ID *url.URL
	// Usage is UsageServer, UsageClient or both.
	Usage Usage
	// Lifetime defaults to DefaultServingCertLifetime. The certificate
	// never outlives the CA.
	Lifetime time.Duration
	// CommonName defaults to the last segment of ID's path; it is only for
	// people reading logs, verification never looks at it.
	CommonName string
	// DNSNames and IPAddresses are for peers that verify by host name, such
	// as users of the Compute API; agentbox's own peers verify the URI.
	DNSNames    []string
	IPAddresses []net.IP
}

// Leaf is an issued certificate with its private key.
type Leaf struct {
	Cert *x509.Certificate
	Key  *ecdsa.PrivateKey
	// CertPEM holds the leaf followed by nothing else: the CA is distributed
	// separately as ca.crt.
	CertPEM []byte
	// KeyPEM is the key as PKCS#8 PEM.
	KeyPEM []byte
}

// TLSCertificate returns the leaf as a tls.Certificate.
func (l *Leaf) TLSCertificate() (tls.Certificate, error) {
	c, err := tls.X509KeyPair(l.CertPEM, l.KeyPEM)
	if err != nil {
		return tls.Certificate{}, fmt.Errorf("leaf key pair: %w", err)
	}
	return c, nil
}

// Issue issues an ECDSA P-256 leaf certificate for opts.ID.
func (ca *CA) Issue(opts LeafOptions) (*Leaf, error) {
	if err := ValidateID(opts.ID); err != nil {
		return nil, err
	}
	var eku []x509.ExtKeyUsage
	if opts.Usage&UsageServer != 0 {
		eku = append(eku, x509.ExtKeyUsageServerAuth)
	}
	if opts.Usage&UsageClient != 0 {
		eku = append(eku, x509.ExtKeyUsageClientAuth)
	}
	if len(eku) == 0 {
		return nil, errors.New("leaf certificate needs server or client usage")
	}
	lifetime := opts.Lifetime
	if lifetime <= 0 {
		lifetime = DefaultServingCertLifetime
	}
	cn := opts.CommonName
	if cn == "" {
		cn = opts.ID.Path[strings.LastIndexByte(opts.ID.Path, '/')+1:]
	}
	now := time.Now()
	notAfter := now.Add(lifetime)
	if notAfter.After(ca.Cert.NotAfter) {
		notAfter = ca.Cert.NotAfter
	}
	if !notAfter.After(now) {
		return nil, fmt.Errorf("CA %q expired at %s", ca.Cert.Subject.CommonName, ca.Cert.NotAfter)
	}

	key, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	if err != nil {
		return nil, fmt.Errorf("generate key: %w", err)
	}
	serial, err := newSerial()
	if err != nil {
		return nil, err
	}
	id := *opts.ID
	tmpl := &x509.Certificate{
		SerialNumber:          serial,
		Subject:               pkix.Name{CommonName: cn},
		NotBefore:             now.Add(-backdate),
		NotAfter:              notAfter,
		KeyUsage:              x509.KeyUsageDigitalSignature,
		ExtKeyUsage:           eku,
		BasicConstraintsValid: true,
		URIs:                  []*url.URL{&id},
		DNSNames:              opts.DNSNames,
		IPAddresses:           opts.IPAddresses,
	}
	der, err := x509.CreateCertificate(rand.Reader, tmpl, ca.Cert, key.Public(), ca.Key)
	if err != nil {
		return nil, fmt.Errorf("issue certificate for %s: %w", opts.ID, err)
	}
	cert, err := x509.ParseCertificate(der)
	if err != nil {
		return nil, fmt.Errorf("parse issued certificate: %w", err)
	}
	keyDER, err := x509.MarshalPKCS8PrivateKey(key)
	if err != nil {
		return nil, fmt.Errorf("marshal key: %w", err)
	}
	return &Leaf{Cert: cert, Key: key, CertPEM: encodePEM("CERTIFICATE", der), KeyPEM: encodePEM("PRIVATE KEY", keyDER)}, nil
}

// CertPoolFromPEM returns a pool holding every certificate in pemData and
// fails if there is none, so that an empty ca.crt cannot silently trust
// nothing and look like a peer problem.
func CertPoolFromPEM(pemData []byte) (*x509.CertPool, error) {
	pool := x509.NewCertPool()
	if !pool.AppendCertsFromPEM(pemData) {
		return nil, errors.New("no CA certificate found in PEM data")
	}
	return pool, nil
}

// ServerTLS returns a server configuration that serves cert and accepts
// only clients whose certificate chains to ca and whose URI SAN is one of
// allowedClientIDs. With no allowed IDs every client is refused: the
// supervisor runs arbitrary commands, so a configuration mistake must fail
// closed.
func ServerTLS(cert tls.Certificate, ca *x509.CertPool, allowedClientIDs ...string) *tls.Config {
	allowed := make(map[string]bool, len(allowedClientIDs))
	for _, id := range allowedClientIDs {
		// Compare in the canonical form IDFromCert produces.
		if u, err := url.Parse(id); err == nil {
			id = u.String()
		}
		allowed[id] = true
	}
	return &tls.Config{
		MinVersion:   tls.VersionTLS13,
		Certificates: []tls.Certificate{cert},
		ClientAuth:   tls.RequireAndVerifyClientCert,
		ClientCAs:    ca,
		// VerifyConnection rather than VerifyPeerCertificate: it also runs on
		// resumed sessions, so a resumed session is held to the same rule.
		VerifyConnection: func(cs tls.ConnectionState) error {
			if len(cs.PeerCertificates) == 0 {
				return errors.New("pki: client sent no certificate")
			}
			id, err := IDFromCert(cs.PeerCertificates[0])
			if err != nil {
				return fmt.Errorf("pki: client identity: %w", err)
			}
			if !allowed[id.String()] {
				return fmt.Errorf("pki: client %s is not allowed", id)
			}
			return nil
		},
	}
}

// ClientTLS returns a client configuration that presents cert and accepts
// only a server whose certificate chains to ca and carries exactly the URI
// SAN expectedServerID.
func ClientTLS(cert tls.Certificate, ca *x509.CertPool, expectedServerID string) *tls.Config {
	return &tls.Config{
		MinVersion:   tls.VersionTLS13,
		Certificates: []tls.Certificate{cert},
		// The standard verification checks the server's certificate against
		// the dialled host name or IP. Peers are dialled by pod IP, which is
		// not known when the certificate is issued and is reused by other
		// pods, so a name check would be both impossible and meaningless.
		// InsecureSkipVerify turns off only that built-in check: the
		// VerifyConnection below redoes the chain verification against ca
		// (never the system roots) and replaces the name check with an exact
		// match on the SPIFFE ID. VerifyConnection runs on every handshake,
		// resumed ones included, so nothing gets through unverified.
		InsecureSkipVerify: true,
		VerifyConnection: func(cs tls.ConnectionState) error {
			return verifyServer(cs, ca, expectedServerID)
		},
	}
}

func verifyServer(cs tls.ConnectionState, ca *x509.CertPool, expectedServerID string) error {
	if ca == nil {
		return errors.New("pki: no CA to verify the server against")
	}
	if len(cs.PeerCertificates) == 0 {
		return errors.New("pki: server sent no certificate")
	}
	intermediates := x509.NewCertPool()
	for _, c := range cs.PeerCertificates[1:] {
		intermediates.AddCert(c)
	}
	leaf := cs.PeerCertificates[0]
	if _, err := leaf.Verify(x509.VerifyOptions{
		Roots:         ca,
		Intermediates: intermediates,
		KeyUsages:     []x509.ExtKeyUsage{x509.ExtKeyUsageServerAuth},
	}); err != nil {
		return fmt.Errorf("pki: server certificate: %w", err)
	}
	id, err := IDFromCert(leaf)
	if err != nil {
		return fmt.Errorf("pki: server identity: %w", err)
	}
	if id.String() != expectedServerID {
		return fmt.Errorf("pki: server is %s, want %s", id, expectedServerID)
	}
	return nil
}

func newSerial() (*big.Int, error) {
	s, err := rand.Int(rand.Reader, new(big.Int).Lsh(big.NewInt(1), 127))
	if err != nil {
		return nil, fmt.Errorf("generate serial: %w", err)
	}
	return s, nil
}

func encodePEM(typ string, der []byte) []byte {
	return pem.EncodeToMemory(&pem.Block{Type: typ, Bytes: der})
}
