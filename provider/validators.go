package provider

import (
	"context"
	"errors"
	"fmt"
	"net/netip"
	"net/url"
	"regexp"
	"strings"
	"time"
	// Time zones are checked as the control plane reads them, with the
	// zone database built in, whatever the machine running Terraform has.
	_ "time/tzdata"

	"github.com/hashicorp/terraform-plugin-framework/schema/validator"
	"github.com/robfig/cron/v3"
	corev1 "k8s.io/api/core/v1"
	k8sresource "k8s.io/apimachinery/pkg/api/resource"
	"k8s.io/apimachinery/pkg/util/validation"

	agentboxv1alpha1 "github.com/agentbox/terraform-provider-agentbox/internal/api/v1alpha1"
)

// The provider's validators. Each rule is one value that carries both its
// check and its description, and schemas quote the description, so the
// documentation, the validator and its error message cannot drift apart.

// stringCheck is one validation rule: its description is what the docs and
// the error message say, so the two cannot drift apart.
type stringCheck struct {
	description string
	check       func(string) error
}

func (c stringCheck) Description(context.Context) string         { return c.description }
func (c stringCheck) MarkdownDescription(context.Context) string { return c.description }

func (c stringCheck) ValidateString(_ context.Context, req validator.StringRequest, resp *validator.StringResponse) {
	if req.ConfigValue.IsNull() || req.ConfigValue.IsUnknown() {
		return
	}
	if err := c.check(req.ConfigValue.ValueString()); err != nil {
		resp.Diagnostics.AddAttributeError(req.Path, "Invalid value",
			fmt.Sprintf("%q: %v (must be %s)", req.ConfigValue.ValueString(), err, c.description))
	}
}

// pullPolicies are the image pull policies, which OneOf validators check and
// descriptions list.
var pullPolicies = []string{string(corev1.PullAlways), string(corev1.PullIfNotPresent), string(corev1.PullNever)}

// Names and values that Kubernetes and Helm define.
var (
	durationCheck = stringCheck{
		description: "a positive Go duration such as `30s`, `15m` or `1h`",
		check: func(s string) error {
			d, err := time.ParseDuration(s)
			if err != nil {
				return err
			}
			if d <= 0 {
				return fmt.Errorf("not positive")
			}
			return nil
		},
	}
	// envTTLCheck is the CRD's floor on python.environments.ttl.
	envTTLCheck = stringCheck{
		description: "a Go duration of at least `1m`, such as `24h`",
		check: func(s string) error {
			d, err := time.ParseDuration(s)
			if err != nil {
				return err
			}
			if d < time.Minute {
				return fmt.Errorf("shorter than 1m")
			}
			return nil
		},
	}
	// checkpointIntervalCheck is the CRD's floor on checkpointInterval.
	checkpointIntervalCheck = stringCheck{
		description: "a Go duration of at least `10s`, such as `5m`",
		check: func(s string) error {
			d, err := time.ParseDuration(s)
			if err != nil {
				return err
			}
			if d < 10*time.Second {
				return fmt.Errorf("shorter than 10s")
			}
			return nil
		},
	}
	dnsSubdomainCheck = stringCheck{
		description: "a Kubernetes object name: at most 253 lower-case letters, digits, `-` and `.`, starting and ending with a letter or digit",
		check: func(s string) error {
			if errs := validation.IsDNS1123Subdomain(s); len(errs) > 0 {
				return fmt.Errorf("%s", errs[0])
			}
			return nil
		},
	}
	// cronCheck reads a schedule as the control plane does: five fields
	// or a descriptor, never @every (not cron) or a TZ= prefix (time_zone
	// says it).
	cronCheck = stringCheck{
		description: "a standard five-field cron expression (minute hour day-of-month month day-of-week, such as " +
			"`*/15 * * * *` or `0 3 * * 1-5`) or one of `@yearly`, `@monthly`, `@weekly`, `@daily`, `@hourly`",
		check: func(s string) error {
			if strings.Contains(s, "TZ=") {
				return errors.New("set the time zone in time_zone, not with a TZ= or CRON_TZ= prefix")
			}
			if strings.HasPrefix(strings.TrimSpace(s), "@every") {
				return errors.New("@every is not a cron schedule")
			}
			_, err := cron.NewParser(cron.Minute | cron.Hour | cron.Dom | cron.Month | cron.Dow | cron.Descriptor).Parse(strings.TrimSpace(s))
			return err
		},
	}
	timeZoneCheck = stringCheck{
		description: "an IANA time zone name such as `Europe/Berlin` or `America/New_York`",
		check: func(s string) error {
			if s == "" || s == "Local" || strings.HasPrefix(s, "/") {
				return errors.New("not a time zone name")
			}
			_, err := time.LoadLocation(s)
			return err
		},
	}
	agentIDPattern = regexp.MustCompile(`^[A-Za-z0-9][A-Za-z0-9._@:+-]*$`)
	agentIDCheck   = stringCheck{
		description: "1 to 253 letters, digits and `. _ @ : + -`, starting with a letter or digit",
		check: func(s string) error {
			if len(s) == 0 || len(s) > 253 || !agentIDPattern.MatchString(s) {
				return fmt.Errorf("not a valid agent id")
			}
			return nil
		},
	}
	// releaseNamePattern is Helm's own rule for release names (it stores
	// them in Secret names and labels, hence 53 characters).
	releaseNamePattern = regexp.MustCompile(`^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$`)
	releaseNameCheck   = stringCheck{
		description: "a Helm release name: at most 53 lower-case letters, digits, `-` and `.`, starting and ending with a letter or digit",
		check: func(s string) error {
			if len(s) > 53 || !releaseNamePattern.MatchString(s) {
				return errors.New("not a valid release name")
			}
			return nil
		},
	}
	namespaceCheck = stringCheck{
		description: "a namespace name (an RFC 1123 label)",
		check: func(s string) error {
			if errs := validation.IsDNS1123Label(s); len(errs) > 0 {
				return errors.New(errs[0])
			}
			return nil
		},
	}
	quantityCheck = stringCheck{
		description: "a Kubernetes quantity such as `100m`, `64Mi` or `1`",
		check: func(s string) error {
			_, err := k8sresource.ParseQuantity(s)
			return err
		},
	}
	labelValueCheck = stringCheck{
		description: "a label value: at most 63 letters, digits, `-`, `_` and `.`, starting and ending with a letter or digit, or empty",
		check: func(s string) error {
			if errs := validation.IsValidLabelValue(s); len(errs) > 0 {
				return fmt.Errorf("%s", errs[0])
			}
			return nil
		},
	}
	// mountPathCheck refuses, at plan time, what the CRD refuses at apply:
	// the folders the platform mounts itself.
	mountPathCheck = stringCheck{
		description: "an absolute folder other than " + codeList(agentboxv1alpha1.ReservedMountPaths) + " and not inside them (the platform mounts its own volumes there)",
		check: func(s string) error {
			if !strings.HasPrefix(s, "/") || s == "/" {
				return errors.New("not an absolute folder below /")
			}
			for _, p := range agentboxv1alpha1.ReservedMountPaths {
				if s == p || strings.HasPrefix(s, p+"/") {
					return fmt.Errorf("%s is the platform's", p)
				}
			}
			return nil
		},
	}
	// mcpURLCheck is the CRD's rule for a remote MCP server's url.
	mcpURLCheck = stringCheck{
		description: "an `http://` or `https://` URL with a host",
		check: func(s string) error {
			u, err := url.Parse(s)
			switch {
			case err != nil:
				return err
			case u.Scheme != "http" && u.Scheme != "https":
				return fmt.Errorf("scheme %q is not http or https", u.Scheme)
			case u.Hostname() == "":
				return errors.New("no host")
			}
			return nil
		},
	}
	qualifiedNameCheck = stringCheck{
		description: "a label or taint key: an optional DNS subdomain prefix and `/`, then at most 63 letters, digits, `-`, `_` and `.`",
		check: func(s string) error {
			if errs := validation.IsQualifiedName(s); len(errs) > 0 {
				return fmt.Errorf("%s", errs[0])
			}
			return nil
		},
	}
)

// Destinations of the egress proxy.
var (
	// domainPattern is the CRD's, so a plan fails where the API server would.
	domainPattern = regexp.MustCompile(`^(\*\.)?([a-z0-9]([-a-z0-9]*[a-z0-9])?\.)*[a-z0-9]([-a-z0-9]*[a-z0-9])?$`)
	domainCheck   = stringCheck{
		description: "a lower-case DNS name of at most 253 characters, optionally starting with `*.` to match every " +
			"subdomain (but not the name itself), such as `api.example.com` or `*.example.com`",
		check: func(s string) error {
			if len(s) == 0 || len(s) > 253 {
				return fmt.Errorf("length %d is not 1 to 253", len(s))
			}
			if !domainPattern.MatchString(s) {
				return fmt.Errorf("not a lower-case domain name")
			}
			return nil
		},
	}
	cidrCheck = stringCheck{
		description: "an IPv4 or IPv6 network in CIDR notation with no host bits set, such as `10.0.0.0/8` or `fd00::/8`",
		check: func(s string) error {
			p, err := netip.ParsePrefix(s)
			if err != nil {
				return err
			}
			if p.Masked() != p {
				return fmt.Errorf("host bits are set; the network is %s", p.Masked())
			}
			return nil
		},
	}
	// neverAllowedCIDRs are the proxy's (egressproxy.NeverAllowedCIDRs, which
	// a test holds this list to), less the IPv4-mapped range that
	// allowedCIDRCheck refuses on its own.
	neverAllowedCIDRs = []netip.Prefix{
		netip.MustParsePrefix("0.0.0.0/8"), netip.MustParsePrefix("127.0.0.0/8"), netip.MustParsePrefix("169.254.0.0/16"),
		netip.MustParsePrefix("100.100.100.200/32"), netip.MustParsePrefix("::/128"), netip.MustParsePrefix("::1/128"),
		netip.MustParsePrefix("fe80::/10"), netip.MustParsePrefix("fd00:ec2::254/128"),
	}
	allowedCIDRCheck = stringCheck{
		description: cidrCheck.description + ", in plain IPv4 or IPv6 form (not IPv4-mapped), that overlaps none of " +
			"`0.0.0.0/8`, loopback (`127.0.0.0/8`, `::1/128`), `::/128`, link-local (`169.254.0.0/16`, `fe80::/10`) and the " +
			"metadata addresses `100.100.100.200` and `fd00:ec2::254`",
		check: func(s string) error {
			if err := cidrCheck.check(s); err != nil {
				return err
			}
			p := netip.MustParsePrefix(s)
			if p.Addr().Is4In6() {
				return fmt.Errorf("an IPv4-mapped IPv6 network; write it as IPv4")
			}
			for _, never := range neverAllowedCIDRs {
				if p.Overlaps(never) {
					return fmt.Errorf("overlaps %s, which the proxy never reaches", never)
				}
			}
			return nil
		},
	}
	upstreamURLPattern = regexp.MustCompile(`^https?://[^/@\s]+/?$`)
	upstreamURLCheck   = stringCheck{
		description: "an `http://` or `https://` URL of a host and optional port, such as `http://proxy.example.com:8080`, " +
			"without a path or credentials",
		check: func(s string) error {
			if len(s) > 2048 {
				return fmt.Errorf("longer than 2048 characters")
			}
			if strings.Contains(s, "@") {
				return fmt.Errorf("credentials in the URL; set upstream_credentials_wo or upstream_credentials_secret instead")
			}
			if !upstreamURLPattern.MatchString(s) {
				return fmt.Errorf("not a proxy URL")
			}
			return nil
		},
	}
)

// credentialsCheck validates upstream credentials without ever repeating
// them in an error, unlike stringCheck.
type credentialsCheck struct{}

const credentialsDescription = "`user:password`: a user name without `:`, a colon, then the password, on one line"

func (credentialsCheck) Description(context.Context) string         { return credentialsDescription }
func (credentialsCheck) MarkdownDescription(context.Context) string { return credentialsDescription }

func (credentialsCheck) ValidateString(_ context.Context, req validator.StringRequest, resp *validator.StringResponse) {
	if req.ConfigValue.IsNull() || req.ConfigValue.IsUnknown() {
		return
	}
	s := req.ConfigValue.ValueString()
	user, _, found := strings.Cut(s, ":")
	if !found || user == "" || strings.ContainsAny(s, "\r\n") {
		resp.Diagnostics.AddAttributeError(req.Path, "Invalid upstream credentials",
			"The value (not shown, it is secret) must be "+credentialsDescription+".")
	}
}
