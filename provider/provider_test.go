package provider

import (
	"context"
	"encoding/pem"
	"path/filepath"
	"strings"
	"testing"

	"github.com/hashicorp/terraform-plugin-framework/diag"
	"github.com/hashicorp/terraform-plugin-framework/provider"
	"github.com/hashicorp/terraform-plugin-framework/provider/schema"
	"github.com/hashicorp/terraform-plugin-framework/tfsdk"
	"github.com/hashicorp/terraform-plugin-go/tftypes"
)

func testProviderSchema(t *testing.T) schema.Schema {
	t.Helper()
	var resp provider.SchemaResponse
	New("test")().Schema(context.Background(), provider.SchemaRequest{}, &resp)
	if resp.Diagnostics.HasError() {
		t.Fatalf("schema: %v", resp.Diagnostics)
	}
	return resp.Schema
}

// testConfig builds a provider configuration. kube nil means no kubernetes
// block; attributes missing from kube are null. A nil namespace is null.
func testConfig(t *testing.T, kube map[string]tftypes.Value, namespace *tftypes.Value) tfsdk.Config {
	t.Helper()
	s := testProviderSchema(t)
	objType := s.Type().TerraformType(context.Background()).(tftypes.Object)
	kubeType := objType.AttributeTypes[kubernetesBlock].(tftypes.Object)

	kubeVal := tftypes.NewValue(kubeType, nil)
	if kube != nil {
		attrs := map[string]tftypes.Value{}
		for name, typ := range kubeType.AttributeTypes {
			attrs[name] = tftypes.NewValue(typ, nil)
		}
		for name, v := range kube {
			if _, ok := attrs[name]; !ok {
				t.Fatalf("no attribute kubernetes.%s", name)
			}
			attrs[name] = v
		}
		kubeVal = tftypes.NewValue(kubeType, attrs)
	}
	ns := tftypes.NewValue(tftypes.String, nil)
	if namespace != nil {
		ns = *namespace
	}
	return tfsdk.Config{Schema: s, Raw: tftypes.NewValue(objType, map[string]tftypes.Value{
		kubernetesBlock: kubeVal, namespaceSetting.name: ns,
	})}
}

func str(s string) tftypes.Value { return tftypes.NewValue(tftypes.String, s) }

func unknownStr() tftypes.Value { return tftypes.NewValue(tftypes.String, tftypes.UnknownValue) }

// isolateEnv keeps the developer's KUBE_* variables and kubeconfig out of the
// test.
func isolateEnv(t *testing.T) {
	t.Helper()
	for _, s := range allSettings() {
		t.Setenv(s.env, "")
	}
	t.Setenv("KUBECONFIG", filepath.Join(t.TempDir(), "absent"))
	t.Setenv("KUBERNETES_SERVICE_HOST", "")
	t.Setenv("KUBERNETES_MASTER", "")
}

var testPEM = string(pem.EncodeToMemory(&pem.Block{Type: "CERTIFICATE", Bytes: []byte("not checked")}))

func TestProviderSchema(t *testing.T) {
	s := testProviderSchema(t)
	if diags := s.ValidateImplementation(context.Background()); diags.HasError() {
		t.Fatalf("schema implementation: %v", diags)
	}
	if s.MarkdownDescription == "" {
		t.Error("provider has no MarkdownDescription")
	}

	var walk func(prefix string, attrs map[string]schema.Attribute)
	seen := map[string]schema.Attribute{}
	walk = func(prefix string, attrs map[string]schema.Attribute) {
		for name, a := range attrs {
			seen[prefix+name] = a
			if a.GetMarkdownDescription() == "" {
				t.Errorf("%s%s has no MarkdownDescription", prefix, name)
			}
			if n, ok := a.(schema.SingleNestedAttribute); ok {
				walk(prefix+name+".", n.Attributes)
			}
		}
	}
	walk("", s.Attributes)

	for _, st := range allSettings() {
		a, ok := seen[st.path().String()]
		if !ok {
			t.Errorf("setting %s is not in the schema", st.path())
			continue
		}
		if !strings.Contains(a.GetMarkdownDescription(), "`"+st.env+"`") {
			t.Errorf("%s does not document %s", st.path(), st.env)
		}
		if a.IsSensitive() != st.sensitive {
			t.Errorf("%s: sensitive = %v, want %v", st.path(), a.IsSensitive(), st.sensitive)
		}
	}
	if got := seen["kubernetes.token"].GetMarkdownDescription(); !strings.Contains(got, "Conflicts with `client_certificate` and `client_key`.") {
		t.Errorf("token description does not come from the rules: %q", got)
	}
}

func TestProviderValidateConfig(t *testing.T) {
	ns := func(s string) *tftypes.Value { v := str(s); return &v }
	for _, tc := range []struct {
		name      string
		kube      map[string]tftypes.Value
		namespace *tftypes.Value
		env       map[string]string
		errAt     []string // attribute paths with errors
		warnAt    []string
	}{
		{name: "empty"},
		{name: "kubeconfig", kube: map[string]tftypes.Value{"config_path": str("~/.kube/config"), "config_context": str("kind")}},
		{name: "host and token", kube: map[string]tftypes.Value{"host": str("https://h"), "token": str("t")}},
		{
			name:  "token conflicts with client certificate",
			kube:  map[string]tftypes.Value{"token": str("t"), "client_certificate": str(testPEM), "client_key": str(testPEM)},
			errAt: []string{"kubernetes.token", "kubernetes.token"},
		},
		{
			name:  "token from the environment conflicts too",
			kube:  map[string]tftypes.Value{"client_certificate": str(testPEM), "client_key": str(testPEM)},
			env:   map[string]string{"KUBE_TOKEN": "t"},
			errAt: []string{"kubernetes.token", "kubernetes.token"},
		},
		{
			name:  "certificate without key",
			kube:  map[string]tftypes.Value{"client_certificate": str(testPEM)},
			errAt: []string{"kubernetes.client_key"},
		},
		{
			name: "key from the environment completes the certificate",
			kube: map[string]tftypes.Value{"client_certificate": str(testPEM)},
			env:  map[string]string{"KUBE_CLIENT_KEY_DATA": testPEM},
		},
		{
			name: "unknown key may yet be set",
			kube: map[string]tftypes.Value{"client_certificate": str(testPEM), "client_key": unknownStr()},
		},
		{
			name: "unknown token may yet be empty",
			kube: map[string]tftypes.Value{"token": unknownStr(), "client_certificate": str(testPEM), "client_key": str(testPEM)},
		},
		{
			name:  "insecure with a CA",
			kube:  map[string]tftypes.Value{"insecure": tftypes.NewValue(tftypes.Bool, true), "cluster_ca_certificate": str(testPEM)},
			errAt: []string{"kubernetes.insecure"},
		},
		{
			name: "insecure false with a CA",
			kube: map[string]tftypes.Value{"insecure": tftypes.NewValue(tftypes.Bool, false), "cluster_ca_certificate": str(testPEM)},
		},
		{
			name:  "file name instead of PEM",
			kube:  map[string]tftypes.Value{"host": str("https://h"), "cluster_ca_certificate": str("/etc/ca.crt")},
			errAt: []string{"kubernetes.cluster_ca_certificate"},
		},
		{
			name:  "invalid KUBE_INSECURE",
			env:   map[string]string{"KUBE_INSECURE": "maybe"},
			errAt: []string{"kubernetes.insecure"},
		},
		{name: "invalid namespace", namespace: ns("Agent_Box"), errAt: []string{"namespace"}},
		{name: "invalid namespace from the environment", env: map[string]string{"AGENTBOX_NAMESPACE": "-x"}, errAt: []string{"namespace"}},
		{
			name:   "host makes config_path in the block ignored",
			kube:   map[string]tftypes.Value{"host": str("https://h"), "config_path": str("/k"), "config_context": str("c")},
			warnAt: []string{"kubernetes.config_path", "kubernetes.config_context"},
		},
		{
			name: "host makes KUBE_CONFIG_PATH ignored silently",
			kube: map[string]tftypes.Value{"host": str("https://h")},
			env:  map[string]string{"KUBE_CONFIG_PATH": "/k"},
		},
	} {
		t.Run(tc.name, func(t *testing.T) {
			isolateEnv(t)
			for k, v := range tc.env {
				t.Setenv(k, v)
			}
			var resp provider.ValidateConfigResponse
			New("test")().(provider.ProviderWithValidateConfig).ValidateConfig(context.Background(),
				provider.ValidateConfigRequest{Config: testConfig(t, tc.kube, tc.namespace)}, &resp)

			assertPaths(t, "errors", resp.Diagnostics.Errors(), tc.errAt)
			assertPaths(t, "warnings", resp.Diagnostics.Warnings(), tc.warnAt)
		})
	}
}

func TestProviderValidateConfig_unknownBlock(t *testing.T) {
	isolateEnv(t)
	// Alone it would be incomplete, but the block may yet supply the key.
	t.Setenv("KUBE_CLIENT_CERT_DATA", testPEM)
	cfg := testConfig(t, nil, nil)
	objType := cfg.Raw.Type().(tftypes.Object)
	cfg.Raw = tftypes.NewValue(objType, map[string]tftypes.Value{
		kubernetesBlock:       tftypes.NewValue(objType.AttributeTypes[kubernetesBlock], tftypes.UnknownValue),
		namespaceSetting.name: tftypes.NewValue(tftypes.String, nil),
	})
	var resp provider.ValidateConfigResponse
	New("test")().(provider.ProviderWithValidateConfig).ValidateConfig(context.Background(),
		provider.ValidateConfigRequest{Config: cfg}, &resp)
	if len(resp.Diagnostics) > 0 {
		t.Fatalf("unexpected diagnostics: %v", resp.Diagnostics)
	}
}

func assertPaths(t *testing.T, what string, diags diag.Diagnostics, want []string) {
	t.Helper()
	var got []string
	for _, d := range diags {
		p := "<no path>"
		if wp, ok := d.(diag.DiagnosticWithPath); ok {
			p = wp.Path().String()
		}
		got = append(got, p)
	}
	if strings.Join(got, ",") != strings.Join(want, ",") {
		t.Errorf("%s at %v, want %v: %v", what, got, want, diags)
	}
}

func configure(t *testing.T, cfg tfsdk.Config, deferralAllowed bool) provider.ConfigureResponse {
	t.Helper()
	var resp provider.ConfigureResponse
	New("test")().Configure(context.Background(), provider.ConfigureRequest{
		Config:             cfg,
		ClientCapabilities: provider.ConfigureProviderClientCapabilities{DeferralAllowed: deferralAllowed},
	}, &resp)
	return resp
}

func TestProviderConfigure_unknownHost(t *testing.T) {
	isolateEnv(t)
	cfg := testConfig(t, map[string]tftypes.Value{"host": unknownStr(), "token": str("t")}, nil)

	t.Run("without deferral support", func(t *testing.T) {
		resp := configure(t, cfg, false)
		if resp.Diagnostics.HasError() || resp.Deferred != nil {
			t.Fatalf("diagnostics %v, deferred %v", resp.Diagnostics, resp.Deferred)
		}
		data := providerDataFrom(resp.ResourceData, &resp.Diagnostics)
		if data == nil || data.Known() || resp.DataSourceData != resp.ResourceData {
			t.Fatalf("want the same unknown provider data for resources and data sources, got %#v and %#v",
				resp.ResourceData, resp.DataSourceData)
		}
		if _, err := data.Clients(); err == nil || !strings.Contains(err.Error(), "not known until apply") {
			t.Errorf("Clients() error = %v", err)
		}
		if _, err := data.RESTConfig(); err == nil {
			t.Error("RESTConfig() returned no error")
		}
		if ns, ok := data.Namespace(); !ok || ns != DefaultNamespace {
			t.Errorf("Namespace() = %q, %v; a known namespace should survive an unknown host", ns, ok)
		}
	})

	t.Run("with deferral support", func(t *testing.T) {
		resp := configure(t, cfg, true)
		if resp.Diagnostics.HasError() {
			t.Fatal(resp.Diagnostics)
		}
		if resp.Deferred == nil || resp.Deferred.Reason != provider.DeferredReasonProviderConfigUnknown {
			t.Errorf("Deferred = %v, want reason ProviderConfigUnknown", resp.Deferred)
		}
	})
}

func TestProviderConfigure_unknownNamespace(t *testing.T) {
	isolateEnv(t)
	ns := unknownStr()
	resp := configure(t, testConfig(t, nil, &ns), false)
	data := providerDataFrom(resp.ResourceData, &resp.Diagnostics)
	if resp.Diagnostics.HasError() || data == nil {
		t.Fatal(resp.Diagnostics)
	}
	if _, ok := data.Namespace(); ok {
		t.Error("an unknown namespace was reported as known")
	}
}

func TestProviderConfigure_known(t *testing.T) {
	isolateEnv(t)
	t.Setenv("AGENTBOX_NAMESPACE", "from-env")
	t.Setenv("KUBE_TOKEN", "env-token")

	resp := configure(t, testConfig(t, map[string]tftypes.Value{
		"host":     str("https://127.0.0.1:6443"),
		"insecure": tftypes.NewValue(tftypes.Bool, true),
	}, nil), true)
	if resp.Diagnostics.HasError() || resp.Deferred != nil {
		t.Fatalf("diagnostics %v, deferred %v", resp.Diagnostics, resp.Deferred)
	}
	data := providerDataFrom(resp.ResourceData, &resp.Diagnostics)
	cfg, err := data.RESTConfig()
	if err != nil {
		t.Fatal(err)
	}
	if cfg.Host != "https://127.0.0.1:6443" || cfg.BearerToken != "env-token" || !cfg.Insecure {
		t.Errorf("got host %q token %q insecure %v", cfg.Host, cfg.BearerToken, cfg.Insecure)
	}
	if cfg.UserAgent != "terraform-provider-agentbox/test" {
		t.Errorf("UserAgent = %q", cfg.UserAgent)
	}
	if ns, _ := data.Namespace(); ns != "from-env" {
		t.Errorf("namespace = %q, want the one from AGENTBOX_NAMESPACE", ns)
	}

	// The provider block wins over the environment.
	own := str("from-config")
	resp = configure(t, testConfig(t, map[string]tftypes.Value{"host": str("https://h")}, &own), false)
	if ns, _ := providerDataFrom(resp.ResourceData, &resp.Diagnostics).Namespace(); ns != "from-config" {
		t.Errorf("namespace = %q, want the one from the provider block", ns)
	}
}

func TestProviderConfigure_noKubeconfig(t *testing.T) {
	isolateEnv(t)
	resp := configure(t, testConfig(t, nil, nil), false)
	assertPaths(t, "errors", resp.Diagnostics.Errors(), []string{kubernetesBlock})
	if d := resp.Diagnostics.Errors(); len(d) == 1 && !strings.Contains(d[0].Detail(), "KUBE_CONFIG_PATH") {
		t.Errorf("detail does not say how to fix it: %s", d[0].Detail())
	}
	if resp.ResourceData != nil {
		t.Error("provider data set despite the error")
	}
}

func TestProviderConfigure_envConflict(t *testing.T) {
	isolateEnv(t)
	t.Setenv("KUBE_TOKEN", "t")
	resp := configure(t, testConfig(t, map[string]tftypes.Value{
		"host": str("https://h"), "client_certificate": str(testPEM), "client_key": str(testPEM),
	}, nil), false)
	assertPaths(t, "errors", resp.Diagnostics.Errors(), []string{"kubernetes.token", "kubernetes.token"})
}

func TestProviderDataFrom(t *testing.T) {
	var diags diag.Diagnostics
	if d := providerDataFrom(nil, &diags); d != nil || diags.HasError() {
		t.Errorf("nil provider data: got %v, %v", d, diags)
	}
	if d := providerDataFrom("wrong", &diags); d != nil || !diags.HasError() {
		t.Errorf("wrong type: got %v, %v", d, diags)
	}
}
