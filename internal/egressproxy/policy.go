package egressproxy

import (
	"errors"
	"fmt"
	"net/netip"
	"strings"
)

// DefaultDeniedCIDRs are the destinations a sandbox may never reach, whatever
// name it uses for them: the cluster, the node and the cloud around it live
// in these ranges, and reaching them would let sandboxed code escape the
// allowlist through an innocent-looking DNS name.
var DefaultDeniedCIDRs = mustPrefixes(
	// IPv4
	"0.0.0.0/8",          // "this network": connecting to 0.0.0.0 reaches the local host
	"10.0.0.0/8",         // private (RFC 1918)
	"100.64.0.0/10",      // carrier-grade NAT; also some clouds' metadata (100.100.100.200)
	"127.0.0.0/8",        // loopback
	"169.254.0.0/16",     // link-local, where cloud metadata services live
	"169.254.169.254/32", // the metadata address, listed on its own so it stays denied if link-local is dropped
	"172.16.0.0/12",      // private (RFC 1918)
	"192.0.0.0/24",       // IETF protocol assignments
	"192.168.0.0/16",     // private (RFC 1918)
	"198.18.0.0/15",      // benchmarking; test clusters put pod and service networks here
	"224.0.0.0/4",        // multicast
	"240.0.0.0/4",        // reserved, including broadcast
	// IPv6
	"::/128",         // unspecified, reaches the local host like 0.0.0.0
	"::1/128",        // loopback
	"64:ff9b:1::/48", // local-use NAT64, which maps onto private IPv4
	"fc00::/7",       // unique local, the IPv6 private range (includes AWS's fd00:ec2::254 metadata)
	"fe80::/10",      // link-local
	"ff00::/8",       // multicast
)

// NeverAllowedCIDRs are the addresses that AllowedCIDRs may not overlap:
// reaching "this network" or loopback would reach the proxy itself,
// link-local holds the cloud metadata services (listed again on their own
// for the clouds that put them elsewhere), and IPv4-mapped IPv6 would name
// any of these again. The EgressProxy CRD's AllowedCIDR rule lists the
// same networks.
var NeverAllowedCIDRs = []netip.Prefix{
	netip.MustParsePrefix("0.0.0.0/8"),
	netip.MustParsePrefix("127.0.0.0/8"),
	netip.MustParsePrefix("169.254.0.0/16"),
	netip.MustParsePrefix("100.100.100.200/32"),
	netip.MustParsePrefix("::/128"),
	netip.MustParsePrefix("::1/128"),
	netip.MustParsePrefix("fe80::/10"),
	netip.MustParsePrefix("fd00:ec2::254/128"),
	netip.MustParsePrefix("::ffff:0:0/96"),
}

// ParseAllowedCIDRs parses CIDRs meant as exceptions to the denied ranges
// and refuses any that overlaps NeverAllowedCIDRs. IPv4-mapped forms are
// refused rather than unmapped, so that the rule reads the same here and
// in the CRD.
func ParseAllowedCIDRs(s []string) ([]netip.Prefix, error) {
	out := make([]netip.Prefix, 0, len(s))
	for _, c := range s {
		c = strings.TrimSpace(c)
		if c == "" {
			continue
		}
		var p netip.Prefix
		if strings.Contains(c, "/") {
			var err error
			if p, err = netip.ParsePrefix(c); err != nil {
				return nil, fmt.Errorf("allowed CIDR %q: %w", c, err)
			}
		} else {
			a, err := netip.ParseAddr(c)
			if err != nil {
				return nil, fmt.Errorf("allowed CIDR %q: %w", c, err)
			}
			p = netip.PrefixFrom(a, a.BitLen())
		}
		p = p.Masked()
		for _, never := range NeverAllowedCIDRs {
			if p.Overlaps(never) {
				return nil, fmt.Errorf("allowed CIDR %q overlaps %s, which is never reachable", c, never)
			}
		}
		out = append(out, p)
	}
	return out, nil
}

func mustPrefixes(s ...string) []netip.Prefix {
	p, err := ParseCIDRs(s)
	if err != nil {
		panic(err)
	}
	return p
}

// ParseCIDRs parses CIDR prefixes; a bare address counts as a single-address
// prefix.
func ParseCIDRs(s []string) ([]netip.Prefix, error) {
	out := make([]netip.Prefix, 0, len(s))
	for _, c := range s {
		c = strings.TrimSpace(c)
		if c == "" {
			continue
		}
		if !strings.Contains(c, "/") {
			a, err := netip.ParseAddr(c)
			if err != nil {
				return nil, fmt.Errorf("CIDR %q: %w", c, err)
			}
			out = append(out, netip.PrefixFrom(a.Unmap(), a.Unmap().BitLen()))
			continue
		}
		p, err := netip.ParsePrefix(c)
		if err != nil {
			return nil, fmt.Errorf("CIDR %q: %w", c, err)
		}
		if p.Addr().Is4In6() {
			// Addresses are unmapped before matching, so a mapped prefix
			// would never match; its IPv4 form is what was meant.
			bits := p.Bits() - 96
			if bits < 0 {
				return nil, fmt.Errorf("CIDR %q: IPv4-mapped prefix shorter than /96", c)
			}
			p = netip.PrefixFrom(p.Addr().Unmap(), bits)
		}
		out = append(out, p.Masked())
	}
	return out, nil
}

// domainList matches host names against exact names and "*.suffix"
// wildcards. IP literals are matched as exact names, so a test or an
// operator can allow one address explicitly.
type domainList struct {
	all      bool
	exact    map[string]bool
	suffixes []string // each with its leading dot, e.g. ".example.com"
}

func newDomainList(patterns []string) (domainList, error) {
	l := domainList{exact: map[string]bool{}}
	for _, raw := range patterns {
		p := normalizeHost(raw)
		switch {
		case p == "":
			continue
		case p == "*" && strings.TrimSpace(raw) == "*":
			l.all = true
		case strings.HasPrefix(p, "*."):
			rest := p[1:]
			if strings.Contains(rest, "*") || len(rest) < 2 {
				return l, fmt.Errorf("domain pattern %q: only a leading \"*.\" wildcard is supported", raw)
			}
			l.suffixes = append(l.suffixes, rest)
		case strings.Contains(p, "*"):
			return l, fmt.Errorf("domain pattern %q: only a leading \"*.\" wildcard is supported", raw)
		default:
			if a, err := netip.ParseAddr(strings.Trim(p, "[]")); err == nil {
				p = a.Unmap().String()
			}
			l.exact[p] = true
		}
	}
	return l, nil
}

// match reports whether host is listed. "*.example.com" matches
// "a.example.com" and "a.b.example.com" but not "example.com" itself, as in
// TLS certificates and most proxies; list both to allow both.
func (l domainList) match(host string) bool {
	if l.all || l.exact[host] {
		return true
	}
	for _, s := range l.suffixes {
		if strings.HasSuffix(host, s) {
			return true
		}
	}
	return false
}

func (l domainList) empty() bool { return !l.all && len(l.exact) == 0 && len(l.suffixes) == 0 }

// normalizeHost lowercases host and drops a trailing dot, so that
// "Example.COM." cannot slip past a rule for "example.com".
func normalizeHost(h string) string {
	h = strings.ToLower(strings.TrimSpace(h))
	h = strings.TrimSuffix(h, ".")
	if a, err := netip.ParseAddr(strings.Trim(h, "[]")); err == nil {
		return a.Unmap().String()
	}
	return h
}

// Reasons a request is denied, as logged and returned to the client.
const (
	ReasonNotAllowed   = "not_allowed"   // host not on the allowlist
	ReasonDenylisted   = "denylisted"    // host on the denylist
	ReasonDeniedIP     = "denied_ip"     // every address of the host is in a denied CIDR
	ReasonBadRequest   = "bad_request"   // not a proxy request this proxy understands
	ReasonResolveError = "resolve_error" // DNS failed
	ReasonDialError    = "dial_error"    // the destination (or upstream proxy) refused or timed out
	// With an upstream proxy: it refused our credentials (407) or the
	// CONNECT (any other non-2xx). The client gets 502 either way, never
	// the upstream's 407, which would invite it to send credentials.
	ReasonUpstreamAuth    = "upstream_auth"
	ReasonUpstreamRefused = "upstream_refused"
	// Credential injection (credentials.go): the destination's certificate
	// failed verification, the sandbox's TLS handshake with the proxy
	// failed (usually: it does not trust the proxy's CA), or the proxy
	// could not issue a certificate.
	ReasonUpstreamTLS    = "upstream_tls"
	ReasonClientTLS      = "client_tls"
	ReasonInterceptError = "intercept_error"
)

// DeniedError is returned when policy refuses a destination. It is kept
// apart from other dial errors so that the client gets 403, not 502.
type DeniedError struct {
	Host   string
	Reason string
	Detail string
}

func (e *DeniedError) Error() string {
	if e.Detail != "" {
		return fmt.Sprintf("egress to %s denied (%s): %s", e.Host, e.Reason, e.Detail)
	}
	return fmt.Sprintf("egress to %s denied (%s)", e.Host, e.Reason)
}

func isDenied(err error) (*DeniedError, bool) {
	var d *DeniedError
	ok := errors.As(err, &d)
	return d, ok
}

// Policy is what decides which requests pass: the name rules and the denied
// address ranges. It is the part of the configuration that can change while
// the proxy runs.
type Policy struct {
	// Allow and Deny are host patterns; see Config.
	Allow, Deny []string
	// DeniedCIDRs: nil means DefaultDeniedCIDRs, empty denies no address.
	DeniedCIDRs []netip.Prefix
	// AllowedCIDRs are holes in DeniedCIDRs, such as an in-cluster
	// service's pod network. Only names on the allowlist reach them. They
	// may not overlap NeverAllowedCIDRs.
	AllowedCIDRs []netip.Prefix
	// ExtraDeniedCIDRs are denied even inside AllowedCIDRs: an operator who
	// allows 10.0.0.0/8 and denies 10.1.0.0/16 means the latter to hold.
	ExtraDeniedCIDRs []netip.Prefix
}

// policy is a Policy compiled for matching. It is never modified once
// built, so requests can share it without locks.
type policy struct {
	src         Policy
	allow, deny domainList
	denied      []netip.Prefix
	allowed     []netip.Prefix
	extraDenied []netip.Prefix
}

func compilePolicy(src Policy) (*policy, error) {
	allow, err := newDomainList(src.Allow)
	if err != nil {
		return nil, fmt.Errorf("allow: %w", err)
	}
	deny, err := newDomainList(src.Deny)
	if err != nil {
		return nil, fmt.Errorf("deny: %w", err)
	}
	for _, a := range src.AllowedCIDRs {
		for _, never := range NeverAllowedCIDRs {
			if a.Overlaps(never) {
				return nil, fmt.Errorf("allowed CIDR %s overlaps %s, which is never reachable", a, never)
			}
		}
	}
	p := &policy{src: src, allow: allow, deny: deny, denied: src.DeniedCIDRs, allowed: src.AllowedCIDRs, extraDenied: src.ExtraDeniedCIDRs}
	if p.denied == nil {
		p.denied = DefaultDeniedCIDRs
		p.src.DeniedCIDRs = DefaultDeniedCIDRs
	}
	return p, nil
}

// checkHost applies the name rules, before any DNS lookup or connection.
func (p *policy) checkHost(host string) *DeniedError {
	if host == "" {
		return &DeniedError{Host: host, Reason: ReasonBadRequest, Detail: "no host"}
	}
	if p.deny.match(host) {
		return &DeniedError{Host: host, Reason: ReasonDenylisted}
	}
	if !p.allow.match(host) {
		return &DeniedError{Host: host, Reason: ReasonNotAllowed}
	}
	return nil
}

// deniedAddr reports the denied prefix containing a, if any. The extra
// denied ranges come first, then the holes AllowedCIDRs make in the rest.
func (p *policy) deniedAddr(a netip.Addr) (netip.Prefix, bool) {
	a = a.Unmap()
	for _, pr := range p.extraDenied {
		if pr.Contains(a) {
			return pr, true
		}
	}
	for _, pr := range p.allowed {
		if pr.Contains(a) {
			return netip.Prefix{}, false
		}
	}
	for _, pr := range p.denied {
		if pr.Contains(a) {
			return pr, true
		}
	}
	return netip.Prefix{}, false
}
