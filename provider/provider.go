package provider

import (
	"context"
	"encoding/pem"
	"errors"
	"fmt"
	"os"
	"slices"
	"strconv"
	"strings"

	"github.com/hashicorp/terraform-plugin-framework/attr"
	"github.com/hashicorp/terraform-plugin-framework/datasource"
	"github.com/hashicorp/terraform-plugin-framework/diag"
	"github.com/hashicorp/terraform-plugin-framework/ephemeral"
	"github.com/hashicorp/terraform-plugin-framework/path"
	"github.com/hashicorp/terraform-plugin-framework/provider"
	"github.com/hashicorp/terraform-plugin-framework/provider/schema"
	"github.com/hashicorp/terraform-plugin-framework/resource"
	"github.com/hashicorp/terraform-plugin-framework/tfsdk"
	"github.com/hashicorp/terraform-plugin-framework/types"
	"github.com/hashicorp/terraform-plugin-log/tflog"
	"k8s.io/apimachinery/pkg/util/validation"
	"k8s.io/client-go/rest"
	"sigs.k8s.io/controller-runtime/pkg/client"

	"github.com/agentbox/terraform-provider-agentbox/internal/kube"
)

var (
	_ provider.Provider                   = (*AgentboxProvider)(nil)
	_ provider.ProviderWithValidateConfig = (*AgentboxProvider)(nil)
	// The user token is ephemeral, never written to plan or state.
	_ provider.ProviderWithEphemeralResources = (*AgentboxProvider)(nil)
)

const (
	// DefaultNamespace is where resources that name no namespace live, and
	// where the chart installs the control plane unless told otherwise.
	DefaultNamespace = "agentbox-system"

	kubernetesBlock = "kubernetes"
)

// AgentboxProvider is the agentbox provider.
type AgentboxProvider struct {
	// version is "dev" for local builds, the release version when built by
	// the release pipeline, and "test" in tests.
	version string
}

// New returns a constructor, which is what providerserver and the acceptance
// test framework expect.
func New(version string) func() provider.Provider {
	return func() provider.Provider {
		return &AgentboxProvider{version: version}
	}
}

func (p *AgentboxProvider) Metadata(_ context.Context, _ provider.MetadataRequest, resp *provider.MetadataResponse) {
	resp.TypeName = "agentbox"
	resp.Version = p.version
}

// setting is one provider argument. Everything Terraform and the
// documentation learn about an argument is derived from this table and from
// rules, so the docs cannot drift from what is enforced.
type setting struct {
	name        string
	nested      bool // inside the kubernetes block
	env         string
	isBool      bool
	sensitive   bool
	description string
}

func (s setting) path() path.Path {
	if s.nested {
		return path.Root(kubernetesBlock).AtName(s.name)
	}
	return path.Root(s.name)
}

var kubernetesSettings = []setting{
	{
		name: "config_path", nested: true, env: "KUBE_CONFIG_PATH",
		description: "Path of a kubeconfig file. A leading `~/` is expanded. When neither this nor `host` is set, " +
			"the default kubeconfig is used: the files in `KUBECONFIG`, else `~/.kube/config`, else the " +
			"in-cluster service account.",
	},
	{
		name: "config_context", nested: true, env: "KUBE_CTX",
		description: "Context of the kubeconfig to use. Defaults to the kubeconfig's current context.",
	},
	{
		name: "host", nested: true, env: "KUBE_HOST",
		description: "Address of the Kubernetes API server, for example `https://10.0.0.1:6443`. " +
			"Use it with `token` or `client_certificate` and `client_key` to connect without a kubeconfig.",
	},
	{
		name: "token", nested: true, env: "KUBE_TOKEN", sensitive: true,
		description: "Bearer token to authenticate to the API server with.",
	},
	{
		name: "client_certificate", nested: true, env: "KUBE_CLIENT_CERT_DATA",
		description: "Client certificate to authenticate to the API server with.",
	},
	{
		name: "client_key", nested: true, env: "KUBE_CLIENT_KEY_DATA", sensitive: true,
		description: "Private key of `client_certificate`.",
	},
	{
		name: "cluster_ca_certificate", nested: true, env: "KUBE_CLUSTER_CA_CERT_DATA",
		description: "Certificate authority to verify the API server's certificate with. " +
			"Defaults to the kubeconfig's, or to the system's trusted authorities.",
	},
	{
		name: "insecure", nested: true, env: "KUBE_INSECURE", isBool: true,
		description: "Skip verification of the API server's certificate. Only for throwaway test clusters.",
	},
}

var namespaceSetting = setting{
	name: "namespace", env: "AGENTBOX_NAMESPACE",
	description: "Namespace for resources that do not set their own. Defaults to `" + DefaultNamespace + "`.",
}

func allSettings() []setting {
	return append([]setting{namespaceSetting}, kubernetesSettings...)
}

// markdownDescription adds to s.description what every user needs to know and
// would otherwise have to find out by trial: the rules and the environment
// variable.
func (s setting) markdownDescription() string {
	parts := []string{s.description}
	for _, r := range rules {
		if d := r.describe(s.name); d != "" {
			parts = append(parts, d)
		}
	}
	parts = append(parts, "Can also be set with the `"+s.env+"` environment variable; the provider block wins.")
	return strings.Join(parts, " ")
}

func (p *AgentboxProvider) Schema(_ context.Context, _ provider.SchemaRequest, resp *provider.SchemaResponse) {
	kubeAttrs := make(map[string]schema.Attribute, len(kubernetesSettings))
	for _, s := range kubernetesSettings {
		if s.isBool {
			kubeAttrs[s.name] = schema.BoolAttribute{Optional: true, MarkdownDescription: s.markdownDescription()}
			continue
		}
		kubeAttrs[s.name] = schema.StringAttribute{
			Optional:            true,
			Sensitive:           s.sensitive,
			MarkdownDescription: s.markdownDescription(),
		}
	}

	resp.Schema = schema.Schema{
		MarkdownDescription: "The agentbox provider installs the agentbox platform on a Kubernetes cluster and " +
			"manages its gVisor node pools, sandbox templates, warm pools, egress proxies and per-agent sandboxes.",
		Attributes: map[string]schema.Attribute{
			kubernetesBlock: schema.SingleNestedAttribute{
				Optional: true,
				MarkdownDescription: "How to reach the Kubernetes cluster that runs agentbox. Without it, the default " +
					"kubeconfig is used, as by `kubectl`. With a kubeconfig, `token`, `client_certificate`, `client_key`, " +
					"`cluster_ca_certificate` and `insecure` override the values of its selected context. When the cluster " +
					"is created in the same apply, reference its outputs here: the provider then waits for them instead of failing.",
				Attributes: kubeAttrs,
			},
			namespaceSetting.name: schema.StringAttribute{
				Optional:            true,
				MarkdownDescription: namespaceSetting.markdownDescription(),
			},
		},
	}
}

// value is a setting as it was found in the configuration or the environment.
type value struct {
	setting
	str     string
	boolean bool
	unknown bool
	fromEnv bool
}

func (v value) set() bool {
	if v.unknown {
		return false
	}
	if v.isBool {
		return v.boolean
	}
	return v.str != ""
}

// label names a value in diagnostics the way the user wrote it.
func (v value) label() string {
	if v.fromEnv {
		return "`" + v.env + "` (environment)"
	}
	return "`" + v.path().String() + "`"
}

type values map[string]value

// readValues reads every setting from config, falling back to the
// environment for settings the configuration leaves null.
func readValues(ctx context.Context, config tfsdk.Config) (values, diag.Diagnostics) {
	var diags diag.Diagnostics
	// The framework reads the attributes of an unknown block as null, which
	// would let the environment stand in for values still to come.
	var block attr.Value
	diags.Append(config.GetAttribute(ctx, path.Root(kubernetesBlock), &block)...)
	if diags.HasError() {
		return nil, diags
	}
	out := values{}
	for _, s := range allSettings() {
		v := value{setting: s}
		var av attr.Value
		diags.Append(config.GetAttribute(ctx, s.path(), &av)...)
		if diags.HasError() {
			return nil, diags
		}
		switch {
		case s.nested && block.IsUnknown():
			v.unknown = true
		case av == nil || av.IsNull():
			env := os.Getenv(s.env)
			if env == "" {
				break
			}
			v.fromEnv = true
			if !s.isBool {
				v.str = env
				break
			}
			b, err := strconv.ParseBool(env)
			if err != nil {
				diags.AddAttributeError(s.path(), "Invalid environment variable",
					fmt.Sprintf("%s must be true or false, got %q.", s.env, env))
			}
			v.boolean = b
		case av.IsUnknown():
			v.unknown = true
		case s.isBool:
			v.boolean = av.(types.Bool).ValueBool()
		default:
			v.str = av.(types.String).ValueString()
		}
		out[s.name] = v
	}
	return out, diags
}

type ruleKind int

const (
	// conflicts: attrs[0] cannot be set together with any of attrs[1:].
	conflicts ruleKind = iota
	// together: all of attrs or none.
	together
	// supersedes: when attrs[0] is set, attrs[1:] are ignored. A warning, not
	// an error, because a kubeconfig path exported in the environment must
	// not break a provider block that sets host.
	supersedes
	pemEncoded
	namespaceName
)

type rule struct {
	kind  ruleKind
	attrs []string
	why   string
}

var rules = []rule{
	{kind: conflicts, attrs: []string{"token", "client_certificate", "client_key"},
		why: "a connection authenticates either with a bearer token or with a client certificate."},
	{kind: together, attrs: []string{"client_certificate", "client_key"},
		why: "a client certificate is useless without its private key, and the other way round."},
	{kind: conflicts, attrs: []string{"insecure", "cluster_ca_certificate"},
		why: "a certificate authority is only used to verify the server, which `insecure` turns off."},
	{kind: supersedes, attrs: []string{"host", "config_path", "config_context"},
		why: "when `host` is set, the connection is built from the explicit settings alone, so that no kubeconfig credentials are mixed in."},
	{kind: pemEncoded, attrs: []string{"client_certificate", "client_key", "cluster_ca_certificate"}},
	{kind: namespaceName, attrs: []string{namespaceSetting.name}},
}

func (r rule) describe(name string) string {
	i := slices.Index(r.attrs, name)
	if i < 0 {
		return ""
	}
	others := append(append([]string{}, r.attrs[:i]...), r.attrs[i+1:]...)
	switch r.kind {
	case conflicts:
		if i == 0 {
			return "Conflicts with " + codeList(others) + "."
		}
		return "Conflicts with " + codeList(r.attrs[:1]) + "."
	case together:
		return "Must be set together with " + codeList(others) + "."
	case supersedes:
		if i == 0 {
			return "When set, " + codeList(others) + " are ignored."
		}
		return "Ignored when " + codeList(r.attrs[:1]) + " is set."
	case pemEncoded:
		return "PEM-encoded: the contents, not a file name (use `file()` to read one)."
	case namespaceName:
		return "Must be a valid namespace name (an RFC 1123 label)."
	}
	return ""
}

// check reports the rule's violations. Unknown values never violate a rule:
// they may yet turn out fine, and Configure checks again once they are known.
func (r rule) check(vs values, diags *diag.Diagnostics) {
	switch r.kind {
	case conflicts:
		first := vs[r.attrs[0]]
		if !first.set() {
			return
		}
		for _, name := range r.attrs[1:] {
			if other := vs[name]; other.set() {
				diags.AddAttributeError(first.path(), "Conflicting provider settings",
					fmt.Sprintf("%s and %s cannot both be set: %s", first.label(), other.label(), r.why))
			}
		}
	case together:
		var set, unset []value
		for _, name := range r.attrs {
			v := vs[name]
			switch {
			case v.set():
				set = append(set, v)
			case !v.unknown:
				unset = append(unset, v)
			}
		}
		if len(set) > 0 && len(unset) > 0 {
			diags.AddAttributeError(unset[0].path(), "Incomplete provider settings",
				fmt.Sprintf("%s is set but %s is not: %s", set[0].label(), unset[0].label(), r.why))
		}
	case supersedes:
		winner := vs[r.attrs[0]]
		if !winner.set() {
			return
		}
		for _, name := range r.attrs[1:] {
			// Only a setting the user wrote into the provider block is worth a
			// warning; ignoring one from the environment is the design.
			if loser := vs[name]; loser.set() && !loser.fromEnv {
				diags.AddAttributeWarning(loser.path(), "Provider setting ignored",
					fmt.Sprintf("%s is ignored because %s is set: %s", loser.label(), winner.label(), r.why))
			}
		}
	case pemEncoded:
		for _, name := range r.attrs {
			if v := vs[name]; v.set() {
				if block, _ := pem.Decode([]byte(v.str)); block == nil {
					diags.AddAttributeError(v.path(), "Invalid PEM data",
						v.label()+" must hold PEM-encoded data (\"-----BEGIN ...\"), not a file name. "+
							"To read a file, use file(\"path\").")
				}
			}
		}
	case namespaceName:
		if v := vs[r.attrs[0]]; v.set() {
			if errs := validation.IsDNS1123Label(v.str); len(errs) > 0 {
				diags.AddAttributeError(v.path(), "Invalid namespace",
					fmt.Sprintf("%s is not a valid namespace name: %s.", v.label(), strings.Join(errs, "; ")))
			}
		}
	}
}

// checkRules runs every rule. Configure keeps only the errors: Terraform
// validates the configuration, with its final values, right before each
// Configure, so warnings would only be repeated.
func checkRules(vs values, errorsOnly bool) diag.Diagnostics {
	var diags diag.Diagnostics
	for _, r := range rules {
		r.check(vs, &diags)
	}
	if errorsOnly {
		return diags.Errors()
	}
	return diags
}

func (p *AgentboxProvider) ValidateConfig(ctx context.Context, req provider.ValidateConfigRequest, resp *provider.ValidateConfigResponse) {
	// The environment is read here too: a client key exported as
	// KUBE_CLIENT_KEY_DATA completes a client_certificate written in the
	// provider block, and a conflict is better reported before plan starts.
	vs, diags := readValues(ctx, req.Config)
	resp.Diagnostics.Append(diags...)
	if resp.Diagnostics.HasError() {
		return
	}
	resp.Diagnostics.Append(checkRules(vs, false)...)
}

func (p *AgentboxProvider) Configure(ctx context.Context, req provider.ConfigureRequest, resp *provider.ConfigureResponse) {
	vs, diags := readValues(ctx, req.Config)
	resp.Diagnostics.Append(diags...)
	if resp.Diagnostics.HasError() {
		return
	}

	// A cluster created in the same apply leaves its address unknown during
	// plan. Failing here would make such configurations impossible, and
	// connecting with partial settings could reach the wrong cluster.
	if !req.Config.Raw.IsFullyKnown() {
		data := &providerData{namespace: namespaceOf(vs)}
		resp.ResourceData, resp.DataSourceData = data, data
		if req.ClientCapabilities.DeferralAllowed {
			resp.Deferred = &provider.Deferred{Reason: provider.DeferredReasonProviderConfigUnknown}
		}
		tflog.Debug(ctx, "provider configuration not known yet", map[string]any{
			"deferred": resp.Deferred != nil,
		})
		return
	}

	resp.Diagnostics.Append(checkRules(vs, true)...)
	if resp.Diagnostics.HasError() {
		return
	}

	cfg, err := kube.RESTConfig(kube.Options{
		ConfigPath:           vs["config_path"].str,
		ConfigContext:        vs["config_context"].str,
		Host:                 vs["host"].str,
		Token:                vs["token"].str,
		ClientCertificate:    vs["client_certificate"].str,
		ClientKey:            vs["client_key"].str,
		ClusterCACertificate: vs["cluster_ca_certificate"].str,
		Insecure:             vs["insecure"].boolean,
	})
	if err != nil {
		detail := err.Error()
		if errors.Is(err, kube.ErrNoConfig) {
			detail += "\n\nSet kubernetes.config_path or kubernetes.host in the provider block, " +
				"or the KUBE_CONFIG_PATH, KUBE_HOST or KUBECONFIG environment variable."
		}
		resp.Diagnostics.AddAttributeError(path.Root(kubernetesBlock), "Cannot configure the Kubernetes client", detail)
		return
	}
	cfg.UserAgent = "terraform-provider-agentbox/" + p.version

	clients, err := kube.NewClients(cfg)
	if err != nil {
		resp.Diagnostics.AddAttributeError(path.Root(kubernetesBlock), "Cannot configure the Kubernetes client", err.Error())
		return
	}

	objects, err := newObjectClient(cfg)
	if err != nil {
		resp.Diagnostics.AddAttributeError(path.Root(kubernetesBlock), "Cannot configure the Kubernetes client", err.Error())
		return
	}

	data := &providerData{config: cfg, clients: clients, objects: objects, namespace: namespaceOf(vs)}
	resp.ResourceData, resp.DataSourceData = data, data
	tflog.Debug(ctx, "configured Kubernetes client", map[string]any{"host": cfg.Host, "namespace": data.namespace})
}

func namespaceOf(vs values) string {
	switch v := vs[namespaceSetting.name]; {
	case v.unknown:
		return ""
	case v.set():
		return v.str
	}
	return DefaultNamespace
}

func (p *AgentboxProvider) Resources(_ context.Context) []func() resource.Resource {
	return []func() resource.Resource{
		NewPlatformResource,
		NewNodePoolResource,
		NewSandboxTemplateResource,
		NewWarmPoolResource,
		NewEgressProxyResource,
		NewSandboxResource,
		NewRunScheduleResource,
	}
}

func (p *AgentboxProvider) DataSources(_ context.Context) []func() datasource.DataSource {
	return []func() datasource.DataSource{
		NewPlatformDataSource,
		NewNodePoolDataSource,
		NewSandboxTemplateDataSource,
		NewSandboxDataSource,
	}
}

// EphemeralResources are what is opened for one plan or apply and never
// stored.
func (p *AgentboxProvider) EphemeralResources(_ context.Context) []func() ephemeral.EphemeralResource {
	return []func() ephemeral.EphemeralResource{
		NewUserTokenEphemeralResource,
	}
}

// errConfigUnknown is what resources get when they need the cluster during a
// plan whose provider configuration depends on values known only at apply.
var errConfigUnknown = errors.New("the provider configuration is not known until apply " +
	"(it depends on resources that are not created yet), so the cluster cannot be reached during this plan")

// providerData is what Configure hands to every resource and data source.
// During a plan with unknown provider configuration it exists but holds no
// client, so resources can still plan what needs no cluster.
type providerData struct {
	config  *rest.Config
	clients *kube.Clients
	// objects reads and writes agentbox's custom resources as typed objects.
	objects   client.Client
	namespace string
}

// Known reports whether the provider configuration was known, i.e. whether
// the cluster can be reached.
func (d *providerData) Known() bool { return d.clients != nil }

// Clients returns the clients, or errConfigUnknown.
func (d *providerData) Clients() (*kube.Clients, error) {
	if d.clients == nil {
		return nil, errConfigUnknown
	}
	return d.clients, nil
}

// Objects returns the typed client for agentbox's custom resources, or
// errConfigUnknown.
func (d *providerData) Objects() (client.Client, error) {
	if d.objects == nil {
		return nil, errConfigUnknown
	}
	return d.objects, nil
}

// RESTConfig returns a copy, so that a resource can tune its own client
// (timeouts, rate limits) without affecting others.
func (d *providerData) RESTConfig() (*rest.Config, error) {
	if d.config == nil {
		return nil, errConfigUnknown
	}
	return rest.CopyConfig(d.config), nil
}

// Namespace returns the default namespace; ok is false while it is unknown.
func (d *providerData) Namespace() (ns string, ok bool) {
	return d.namespace, d.namespace != ""
}

// providerDataFrom is for the Configure method of resources and data
// sources. It returns nil without diagnostics when the provider is not
// configured yet, which Terraform does for example during validation.
func providerDataFrom(v any, diags *diag.Diagnostics) *providerData {
	if v == nil {
		return nil
	}
	d, ok := v.(*providerData)
	if !ok {
		diags.AddError("Unexpected provider data",
			fmt.Sprintf("Expected *providerData, got %T. This is a bug in the provider.", v))
		return nil
	}
	return d
}
