package provider

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"encoding/json"
	"fmt"
	"net/netip"
	"regexp"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/hashicorp/terraform-plugin-framework/path"
	"github.com/hashicorp/terraform-plugin-framework/resource"
	"github.com/hashicorp/terraform-plugin-framework/resource/schema"
	"github.com/hashicorp/terraform-plugin-framework/schema/validator"
	fwtypes "github.com/hashicorp/terraform-plugin-framework/types"
	tfresource "github.com/hashicorp/terraform-plugin-testing/helper/resource"
	"github.com/hashicorp/terraform-plugin-testing/knownvalue"
	"github.com/hashicorp/terraform-plugin-testing/plancheck"
	"github.com/hashicorp/terraform-plugin-testing/statecheck"
	"github.com/hashicorp/terraform-plugin-testing/terraform"
	"github.com/hashicorp/terraform-plugin-testing/tfjsonpath"
	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	apimeta "k8s.io/apimachinery/pkg/api/meta"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/apimachinery/pkg/util/wait"
	"sigs.k8s.io/controller-runtime/pkg/client"

	agentboxv1alpha1 "github.com/agentbox/terraform-provider-agentbox/internal/api/v1alpha1"
	"github.com/agentbox/terraform-provider-agentbox/internal/egressproxy"
)

// TestEgressProxySchema holds the resource to the rules TestPoolSchemas
// sets, plus what is particular to it: the credentials are write-only and
// sensitive, and the validators' documentation matches what they enforce.
func TestEgressProxySchema(t *testing.T) {
	ctx := context.Background()
	r := NewEgressProxyResource()
	var meta resource.MetadataResponse
	r.Metadata(ctx, resource.MetadataRequest{ProviderTypeName: "agentbox"}, &meta)
	if meta.TypeName != "agentbox_egress_proxy" {
		t.Fatalf("type name %q", meta.TypeName)
	}
	var resp resource.SchemaResponse
	r.Schema(ctx, resource.SchemaRequest{}, &resp)
	if resp.Diagnostics.HasError() {
		t.Fatal(resp.Diagnostics)
	}
	if diags := resp.Schema.ValidateImplementation(ctx); diags.HasError() {
		t.Fatalf("schema: %v", diags)
	}
	if resp.Schema.MarkdownDescription == "" {
		t.Error("no MarkdownDescription")
	}
	var walk func(prefix string, attrs map[string]schema.Attribute)
	walk = func(prefix string, attrs map[string]schema.Attribute) {
		for name, a := range attrs {
			if a.GetMarkdownDescription() == "" {
				t.Errorf("%s%s has no MarkdownDescription", prefix, name)
			}
			switch n := a.(type) {
			case schema.SingleNestedAttribute:
				walk(prefix+name+".", n.Attributes)
			case schema.ListNestedAttribute:
				walk(prefix+name+"[].", n.NestedObject.Attributes)
			}
		}
	}
	walk(meta.TypeName+".", resp.Schema.Attributes)

	creds := resp.Schema.Attributes["credentials"].(schema.ListNestedAttribute).NestedObject.Attributes
	for name, wo := range map[string]schema.Attribute{"upstream_credentials_wo": resp.Schema.Attributes["upstream_credentials_wo"],
		"credentials[].value_wo": creds["value_wo"]} {
		if !wo.IsWriteOnly() || !wo.IsSensitive() || wo.IsComputed() {
			t.Errorf("%s: write-only %v, sensitive %v, computed %v; want write-only, sensitive, not computed",
				name, wo.IsWriteOnly(), wo.IsSensitive(), wo.IsComputed())
		}
	}
	for _, rule := range egressCredentialRules {
		for _, a := range rule.attrs {
			if !strings.Contains(creds[a].GetMarkdownDescription(), rule.description) {
				t.Errorf("credentials[].%s's description does not state the rule it is in: %s", a, rule.description)
			}
		}
	}
	if !strings.Contains(resp.Schema.Attributes["destination_ca_bundle"].GetMarkdownDescription(), pemBundleDescription) {
		t.Error("destination_ca_bundle's description does not say what its validator enforces")
	}
	for attr, check := range map[string]stringCheck{"name": credentialNameCheck, "hosts": domainCheck} {
		if !strings.Contains(creds[attr].GetMarkdownDescription(), check.description) {
			t.Errorf("credentials[].%s's description does not say what its validator enforces (%s)", attr, check.description)
		}
	}
	modeDoc := resp.Schema.Attributes["mode"].GetMarkdownDescription()
	for _, m := range egressProxyModes {
		if !strings.Contains(modeDoc, "`"+string(m.name)+"`: "+m.description) {
			t.Errorf("mode's description lacks %s: %s", m.name, modeDoc)
		}
	}
	for attr, check := range map[string]stringCheck{"allowed_domains": domainCheck, "denied_cidrs": cidrCheck, "allowed_cidrs": allowedCIDRCheck,
		"upstream_url": upstreamURLCheck, "runtime_class_name": dnsSubdomainCheck} {
		if !strings.Contains(resp.Schema.Attributes[attr].GetMarkdownDescription(), check.description) {
			t.Errorf("%s's description does not say what its validator enforces (%s)", attr, check.description)
		}
	}
}

func TestEgressProxyChecks(t *testing.T) {
	cases := []struct {
		check     stringCheck
		good, bad []string
	}{
		{credentialNameCheck, []string{"api", "gh-token", "a1"}, []string{"", "API", "-a", "a_b", strings.Repeat("a", 64)}},
		{headerNameCheck, []string{"Authorization", "X-Api-Key", "x_custom"}, []string{"", "Proxy-Authorization", "host", "Bad Header", "a:b"}},
		{valueTemplateCheck, []string{"Bearer {{secret}}", "{{secret}}"}, []string{"Bearer", "{{ secret }}", strings.Repeat("x", 4097) + "{{secret}}"}},
		{basicAuthUserCheck, []string{"bot", ""}, []string{"a:b", "a\nb", strings.Repeat("u", 257)}},
		{domainCheck, []string{"example.com", "*.example.com", "a", "x-1.example.co"}, []string{"", "Example.com", "*.", "a..b", "-a.com", "*example.com", "a.*.com", strings.Repeat("a.", 127) + "ab"}},
		{cidrCheck, []string{"10.0.0.0/8", "192.168.1.1/32", "fd00::/8", "0.0.0.0/0"}, []string{"10.0.0.1/8", "10.0.0.0", "10.0.0.0/33", "fe80::/10%eth0", "example.com/8"}},
		{allowedCIDRCheck, []string{"10.20.0.0/16", "198.18.0.7/32", "fd12::/64", "172.16.0.0/12", "169.255.0.0/16"},
			[]string{"127.0.0.1/32", "169.254.169.254/32", "169.254.1.0/24", "0.0.0.0/0", "128.0.0.0/1", "::/0", "fe80::/64",
				"fd00:ec2::/32", "100.100.100.200/32", "::ffff:10.0.0.0/104", "10.0.0.1/8", "10.0.0.0"}},
		{upstreamURLCheck, []string{"http://proxy.example.com:8080", "https://10.1.2.3:3128/"}, []string{"proxy:8080", "ftp://proxy", "http://user:pw@proxy:8080", "http://proxy/path"}},
	}
	for _, tc := range cases {
		for _, s := range tc.good {
			if err := tc.check.check(s); err != nil {
				t.Errorf("%q fails the check for %s: %v", s, tc.check.description, err)
			}
		}
		for _, s := range tc.bad {
			if tc.check.check(s) == nil {
				t.Errorf("%q passes the check for %s", s, tc.check.description)
			}
		}
	}
}

// TestNeverAllowedCIDRsMatchProxy holds the provider's copy of the
// networks allowed_cidrs may not overlap to the proxy's own list, so that a
// plan fails exactly where the proxy would refuse its policy.
func TestNeverAllowedCIDRsMatchProxy(t *testing.T) {
	var want []netip.Prefix
	for _, p := range egressproxy.NeverAllowedCIDRs {
		if !p.Addr().Is4In6() {
			want = append(want, p)
		}
	}
	if !slices.Equal(neverAllowedCIDRs, want) {
		t.Errorf("provider %v, proxy %v", neverAllowedCIDRs, want)
	}
}

// TestCredentialsCheck: a malformed credential is refused without being
// repeated in the error, which Terraform prints and CI logs keep.
func TestCredentialsCheck(t *testing.T) {
	for value, ok := range map[string]bool{
		"agent:s3cret": true, "agent:": true, "agent:pa:ss": true,
		"no-colon-s3cret": false, ":s3cret-only": false, "agent:s3cret\nx": false,
	} {
		resp := &validator.StringResponse{}
		credentialsCheck{}.ValidateString(context.Background(),
			validator.StringRequest{Path: path.Root("upstream_credentials_wo"), ConfigValue: fwtypes.StringValue(value)}, resp)
		if resp.Diagnostics.HasError() == ok {
			t.Errorf("credentials %q: errors %v, want valid %v", value, resp.Diagnostics, ok)
		}
		for _, d := range resp.Diagnostics {
			if strings.Contains(d.Summary()+d.Detail(), "s3cret") {
				t.Errorf("the error shows the credentials: %s: %s", d.Summary(), d.Detail())
			}
		}
	}
}

func randomSuffix(t *testing.T) string {
	b := make([]byte, 6)
	if _, err := rand.Read(b); err != nil {
		t.Fatal(err)
	}
	return hex.EncodeToString(b)
}

// egressProxyConfig renders the resource; body holds its arguments beyond
// name and namespace.
func egressProxyConfig(ns, name, body string) string {
	return testAccProviderConfig() + fmt.Sprintf(`
resource "agentbox_egress_proxy" "test" {
  name           = %q
  namespace      = %q
  wait_for_ready = false
%s
}
`, name, ns, body)
}

func sharedProxyBody(creds string, version int) string {
	return fmt.Sprintf(`
  mode            = "Shared"
  replicas        = 2
  allowed_domains = ["pypi.org", "*.pythonhosted.org", "github.com"]
  denied_domains  = ["gist.github.com"]
  denied_cidrs    = ["203.0.113.0/24", "2001:db8::/32"]
  allowed_cidrs   = ["10.20.0.0/16"]
  upstream_url    = "http://upstream.invalid:3128"

  runtime_class_name = "gvisor"

  upstream_credentials_wo         = %q
  upstream_credentials_wo_version = %d
`, creds, version)
}

// The lifecycle against the API server alone: no control plane runs the
// proxy, so it is created without waiting and the test writes the status
// the way the controller would. Credentials are random per run, so finding
// them anywhere in a plan or the state is a leak and not a coincidence.
// It does not run in parallel with the tests that install a platform: one
// of those would tell the proxy, in a namespace it does not serve,
// NamespaceNotServed before the test writes its status.
func TestAccEgressProxy_lifecycle(t *testing.T) {
	c, ns := testAccCluster(t)
	addr := "agentbox_egress_proxy.test"
	name := "egress"
	key := types.NamespacedName{Namespace: ns, Name: name}
	secretKey := types.NamespacedName{Namespace: ns, Name: upstreamSecretName(name)}
	creds1 := "agent:first-" + randomSuffix(t)
	creds2 := "agent:second-" + randomSuffix(t)
	secrets := []string{creds1, creds2}
	config1 := egressProxyConfig(ns, name, sharedProxyBody(creds1, 1))
	config2 := egressProxyConfig(ns, name, sharedProxyBody(creds2, 2))
	userSecretConfig := egressProxyConfig(ns, name, `
  allowed_domains = ["pypi.org"]
  upstream_url    = "http://upstream.invalid:3128"
  upstream_credentials_secret = { name = "corp-proxy", key = "auth" }
`)
	noLeak := []statecheck.StateCheck{stateLacks(secrets...)}
	planNoLeak := plancheck.PlanCheck(planLacks(secrets...))
	tfresource.Test(t, tfresource.TestCase{
		ProtoV6ProviderFactories: testAccProtoV6ProviderFactories,
		Steps: []tfresource.TestStep{
			{
				Config:           config1,
				ConfigPlanChecks: tfresource.ConfigPlanChecks{PreApply: []plancheck.PlanCheck{planNoLeak}},
				ConfigStateChecks: append([]statecheck.StateCheck{
					statecheck.ExpectKnownValue(addr, tfjsonpath.New("id"), knownvalue.StringExact(ns+"/"+name)),
					statecheck.ExpectKnownValue(addr, tfjsonpath.New("mode"), knownvalue.StringExact("Shared")),
					statecheck.ExpectKnownValue(addr, tfjsonpath.New("replicas"), knownvalue.Int64Exact(2)),
					statecheck.ExpectKnownValue(addr, tfjsonpath.New("allowed_domains"), knownvalue.SetExact([]knownvalue.Check{
						knownvalue.StringExact("pypi.org"), knownvalue.StringExact("*.pythonhosted.org"), knownvalue.StringExact("github.com"),
					})),
					statecheck.ExpectKnownValue(addr, tfjsonpath.New("denied_cidrs"), knownvalue.SetSizeExact(2)),
					statecheck.ExpectKnownValue(addr, tfjsonpath.New("allowed_cidrs"), knownvalue.SetExact([]knownvalue.Check{knownvalue.StringExact("10.20.0.0/16")})),
					statecheck.ExpectKnownValue(addr, tfjsonpath.New("runtime_class_name"), knownvalue.StringExact("gvisor")),
					statecheck.ExpectKnownValue(addr, tfjsonpath.New("upstream_url"), knownvalue.StringExact("http://upstream.invalid:3128")),
					statecheck.ExpectKnownValue(addr, tfjsonpath.New("upstream_credentials_wo"), knownvalue.Null()),
					statecheck.ExpectKnownValue(addr, tfjsonpath.New("upstream_credentials_wo_version"), knownvalue.Int64Exact(1)),
					statecheck.ExpectKnownValue(addr, tfjsonpath.New("upstream_credentials_secret"), knownvalue.Null()),
					statecheck.ExpectKnownValue(addr, tfjsonpath.New("status"), knownvalue.ObjectExact(map[string]knownvalue.Check{
						"ready": knownvalue.Bool(false), "reason": knownvalue.Null(), "message": knownvalue.Null(),
						"ready_endpoints": knownvalue.ListExact([]knownvalue.Check{}),
					})),
				}, noLeak...),
				Check: tfresource.ComposeTestCheckFunc(
					checkEgressProxy(c, key, func(ep *agentboxv1alpha1.EgressProxy) error {
						s := ep.Spec
						if s.Mode != agentboxv1alpha1.EgressProxyModeShared || s.Replicas == nil || *s.Replicas != 2 ||
							!slices.Equal(s.AllowedDomains, []agentboxv1alpha1.Domain{"*.pythonhosted.org", "github.com", "pypi.org"}) ||
							!slices.Equal(s.DeniedCIDRs, []agentboxv1alpha1.CIDR{"2001:db8::/32", "203.0.113.0/24"}) ||
							!slices.Equal(s.AllowedCIDRs, []agentboxv1alpha1.AllowedCIDR{"10.20.0.0/16"}) || s.RuntimeClassName != "gvisor" ||
							s.Upstream == nil || s.Upstream.CredentialsSecretRef == nil || *s.Upstream.CredentialsSecretRef != *ownedSecretRef(name) {
							return fmt.Errorf("spec %+v", s)
						}
						return nil
					}),
					checkUpstreamSecret(c, secretKey, name, creds1),
				),
			},
			{
				Config:           config1,
				ConfigPlanChecks: tfresource.ConfigPlanChecks{PreApply: []plancheck.PlanCheck{plancheck.ExpectEmptyPlan()}},
			},
			{
				ResourceName:      addr,
				ImportState:       true,
				ImportStateId:     ns + "/" + name,
				ImportStateVerify: true,
				// Terraform's own settings; and the version of a write-only
				// value, which only the configuration knows. The write-only
				// value itself is null on both sides.
				ImportStateVerifyIgnore: []string{"wait_for_ready", "timeouts", "upstream_credentials_wo_version"},
			},
			{
				// Status written by the controller is refreshed into state
				// but never plans a change.
				PreConfig: func() {
					ep := getObject[agentboxv1alpha1.EgressProxy](t, c, key)
					ep.Status = agentboxv1alpha1.EgressProxyStatus{
						ObservedGeneration: ep.Generation,
						ReadyEndpoints:     []string{"http://egress-egress." + ns + ".svc:3128"},
						Conditions: []metav1.Condition{{
							Type: agentboxv1alpha1.ConditionReady, Status: metav1.ConditionTrue, Reason: agentboxv1alpha1.ReasonProxyAvailable,
							Message: "2 of 2 replicas ready", LastTransitionTime: metav1.Now(), ObservedGeneration: ep.Generation,
						}},
					}
					if err := c.Status().Update(context.Background(), ep); err != nil {
						t.Fatal(err)
					}
				},
				Config:           config1,
				ConfigPlanChecks: tfresource.ConfigPlanChecks{PreApply: []plancheck.PlanCheck{plancheck.ExpectEmptyPlan()}},
				ConfigStateChecks: []statecheck.StateCheck{
					statecheck.ExpectKnownValue(addr, tfjsonpath.New("status"), knownvalue.ObjectExact(map[string]knownvalue.Check{
						"ready": knownvalue.Bool(true), "reason": knownvalue.StringExact("ProxyAvailable"),
						"message":         knownvalue.StringExact("2 of 2 replicas ready"),
						"ready_endpoints": knownvalue.ListExact([]knownvalue.Check{knownvalue.StringExact("http://egress-egress." + ns + ".svc:3128")}),
					})),
				},
			},
			{
				// Out-of-band edit: the plan shows it, the apply repairs it.
				PreConfig: func() {
					mutate(t, c, key, func(ep *agentboxv1alpha1.EgressProxy) {
						ep.Spec.AllowedDomains = append(ep.Spec.AllowedDomains, "evil.example")
						ep.Spec.DeniedCIDRs = nil
						ep.Spec.AllowedCIDRs = append(ep.Spec.AllowedCIDRs, "10.0.0.0/8")
						ep.Spec.RuntimeClassName = ""
						ep.Spec.Upstream.CredentialsSecretRef = &agentboxv1alpha1.SecretKeySelector{Name: "elsewhere", Key: "k"}
					})
				},
				Config: config1,
				ConfigPlanChecks: tfresource.ConfigPlanChecks{PreApply: []plancheck.PlanCheck{
					plancheck.ExpectResourceAction(addr, plancheck.ResourceActionUpdate),
					plancheck.ExpectKnownValue(addr, tfjsonpath.New("allowed_domains"), knownvalue.SetSizeExact(3)),
					plancheck.ExpectKnownValue(addr, tfjsonpath.New("allowed_cidrs"), knownvalue.SetSizeExact(1)),
					plancheck.ExpectKnownValue(addr, tfjsonpath.New("runtime_class_name"), knownvalue.StringExact("gvisor")),
					plancheck.ExpectKnownValue(addr, tfjsonpath.New("upstream_credentials_secret"), knownvalue.Null()),
					planNoLeak,
				}},
				ConfigStateChecks: noLeak,
				Check: checkEgressProxy(c, key, func(ep *agentboxv1alpha1.EgressProxy) error {
					if len(ep.Spec.AllowedDomains) != 3 || len(ep.Spec.DeniedCIDRs) != 2 || len(ep.Spec.AllowedCIDRs) != 1 ||
						ep.Spec.RuntimeClassName != "gvisor" || *ep.Spec.Upstream.CredentialsSecretRef != *ownedSecretRef(name) {
						return fmt.Errorf("out-of-band edit not repaired: %+v", ep.Spec)
					}
					return nil
				}),
			},
			{
				// Rotation: a new version writes the new value.
				Config: config2,
				ConfigPlanChecks: tfresource.ConfigPlanChecks{PreApply: []plancheck.PlanCheck{
					plancheck.ExpectResourceAction(addr, plancheck.ResourceActionUpdate), planNoLeak,
				}},
				ConfigStateChecks: noLeak,
				Check:             checkUpstreamSecret(c, secretKey, name, creds2),
			},
			{
				// The owned Secret deleted out of band: the plan shows the
				// version as changed, the apply writes the Secret again.
				PreConfig: func() {
					if err := c.Delete(context.Background(), &corev1.Secret{ObjectMeta: objectMeta(secretKey)}); err != nil {
						t.Fatal(err)
					}
				},
				Config: config2,
				ConfigPlanChecks: tfresource.ConfigPlanChecks{PreApply: []plancheck.PlanCheck{
					plancheck.ExpectResourceAction(addr, plancheck.ResourceActionUpdate), planNoLeak,
				}},
				ConfigStateChecks: noLeak,
				Check:             checkUpstreamSecret(c, secretKey, name, creds2),
			},
			{
				// Credentials from a Secret of the user's: the proxy refers to
				// it, and the resource's own Secret goes.
				PreConfig: func() {
					s := &corev1.Secret{ObjectMeta: metav1.ObjectMeta{Namespace: ns, Name: "corp-proxy"}, StringData: map[string]string{"auth": "corp:pw"}}
					if err := c.Create(context.Background(), s); err != nil {
						t.Fatal(err)
					}
				},
				Config: userSecretConfig,
				ConfigStateChecks: []statecheck.StateCheck{
					statecheck.ExpectKnownValue(addr, tfjsonpath.New("mode"), knownvalue.StringExact("PerAgent")),
					statecheck.ExpectKnownValue(addr, tfjsonpath.New("replicas"), knownvalue.Null()),
					statecheck.ExpectKnownValue(addr, tfjsonpath.New("denied_cidrs"), knownvalue.Null()),
					statecheck.ExpectKnownValue(addr, tfjsonpath.New("allowed_cidrs"), knownvalue.Null()),
					statecheck.ExpectKnownValue(addr, tfjsonpath.New("runtime_class_name"), knownvalue.Null()),
					statecheck.ExpectKnownValue(addr, tfjsonpath.New("upstream_credentials_wo_version"), knownvalue.Null()),
					statecheck.ExpectKnownValue(addr, tfjsonpath.New("upstream_credentials_secret"), knownvalue.ObjectExact(map[string]knownvalue.Check{
						"name": knownvalue.StringExact("corp-proxy"), "key": knownvalue.StringExact("auth"),
					})),
				},
				Check: tfresource.ComposeTestCheckFunc(
					checkEgressProxy(c, key, func(ep *agentboxv1alpha1.EgressProxy) error {
						ref := ep.Spec.Upstream.CredentialsSecretRef
						if ep.Spec.Mode != agentboxv1alpha1.EgressProxyModePerAgent || ep.Spec.Replicas != nil || ref == nil || ref.Name != "corp-proxy" || ref.Key != "auth" {
							return fmt.Errorf("spec %+v", ep.Spec)
						}
						return nil
					}),
					checkSecretGone(c, secretKey),
				),
			},
			{
				Config:           userSecretConfig,
				ConfigPlanChecks: tfresource.ConfigPlanChecks{PreApply: []plancheck.PlanCheck{plancheck.ExpectEmptyPlan()}},
			},
			{
				// Disappears: deleted out of band, the next plan creates it.
				PreConfig: func() {
					if err := c.Delete(context.Background(), &agentboxv1alpha1.EgressProxy{ObjectMeta: objectMeta(key)}); err != nil {
						t.Fatal(err)
					}
				},
				Config: config1,
				ConfigPlanChecks: tfresource.ConfigPlanChecks{PreApply: []plancheck.PlanCheck{
					plancheck.ExpectResourceAction(addr, plancheck.ResourceActionCreate), planNoLeak,
				}},
				ConfigStateChecks: noLeak,
				Check:             checkUpstreamSecret(c, secretKey, name, creds1),
			},
			{
				// The name is immutable: changing it replaces the proxy, and
				// the old proxy's Secret goes with it.
				Config: egressProxyConfig(ns, name+"-2", sharedProxyBody(creds1, 1)),
				ConfigPlanChecks: tfresource.ConfigPlanChecks{PreApply: []plancheck.PlanCheck{
					plancheck.ExpectResourceAction(addr, plancheck.ResourceActionDestroyBeforeCreate),
				}},
				Check: tfresource.ComposeTestCheckFunc(
					checkSecretGone(c, secretKey),
					checkUpstreamSecret(c, types.NamespacedName{Namespace: ns, Name: upstreamSecretName(name + "-2")}, name+"-2", creds1),
				),
			},
		},
		CheckDestroy: func(*terraform.State) error {
			for _, n := range []string{name, name + "-2"} {
				k := types.NamespacedName{Namespace: ns, Name: n}
				if err := c.Get(context.Background(), k, &agentboxv1alpha1.EgressProxy{}); !apierrors.IsNotFound(err) {
					return fmt.Errorf("egress proxy %s after destroy: %v", k, err)
				}
				if err := checkSecretGone(c, types.NamespacedName{Namespace: ns, Name: upstreamSecretName(n)})(nil); err != nil {
					return err
				}
			}
			return nil
		},
	})
}

// TestAccEgressProxy_wait: with wait_for_ready the apply returns once the
// Ready condition is True for the current generation, which the test writes
// the way the controller would; without it, the apply times out with the
// condition in the error.
func TestAccEgressProxy_wait(t *testing.T) {
	t.Parallel()
	c, ns := testAccCluster(t)
	addr := "agentbox_egress_proxy.test"
	key := types.NamespacedName{Namespace: ns, Name: "waited"}
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	go func() {
		// Not Ready at first, as the controller reports a proxy waiting for
		// its pods; Ready a few polls later.
		_ = wait.PollUntilContextCancel(ctx, 200*time.Millisecond, true, func(ctx context.Context) (bool, error) {
			return setEgressReady(ctx, c, key, metav1.ConditionFalse, agentboxv1alpha1.ReasonProxyProgressing) == nil, nil
		})
		time.Sleep(2 * time.Second)
		_ = wait.PollUntilContextCancel(ctx, 200*time.Millisecond, true, func(ctx context.Context) (bool, error) {
			return setEgressReady(ctx, c, key, metav1.ConditionTrue, agentboxv1alpha1.ReasonProxyAvailable) == nil, nil
		})
	}()
	start := time.Now()
	tfresource.Test(t, tfresource.TestCase{
		ProtoV6ProviderFactories: testAccProtoV6ProviderFactories,
		Steps: []tfresource.TestStep{
			{
				Config: strings.Replace(egressProxyConfig(ns, "waited", `allowed_domains = ["pypi.org"]`), "wait_for_ready = false", "wait_for_ready = true", 1),
				ConfigStateChecks: []statecheck.StateCheck{
					statecheck.ExpectKnownValue(addr, tfjsonpath.New("status").AtMapKey("ready"), knownvalue.Bool(true)),
					statecheck.ExpectKnownValue(addr, tfjsonpath.New("status").AtMapKey("reason"), knownvalue.StringExact("ProxyAvailable")),
				},
			},
			{
				Config: strings.Replace(egressProxyConfig(ns, "never", `allowed_domains = ["pypi.org"]`), "wait_for_ready = false",
					"wait_for_ready = true\n  timeouts = { create = \"3s\" }", 1),
				ExpectError: regexp.MustCompile(`(?s)did\s+not\s+become\s+ready.*no\s+Ready\s+condition\s+yet`),
			},
		},
	})
	t.Logf("wait test took %s", time.Since(start))
}

func setEgressReady(ctx context.Context, c client.Client, key types.NamespacedName, status metav1.ConditionStatus, reason string) error {
	var ep agentboxv1alpha1.EgressProxy
	if err := c.Get(ctx, key, &ep); err != nil {
		return err
	}
	ep.Status.ObservedGeneration = ep.Generation
	apimeta.SetStatusCondition(&ep.Status.Conditions, metav1.Condition{
		Type: agentboxv1alpha1.ConditionReady, Status: status, Reason: reason, Message: "set by the test", ObservedGeneration: ep.Generation,
	})
	return c.Status().Update(ctx, &ep)
}

// TestAccEgressProxy_foreignSecret: a Secret of the owned Secret's name
// that the resource did not make is never overwritten.
func TestAccEgressProxy_foreignSecret(t *testing.T) {
	t.Parallel()
	c, ns := testAccCluster(t)
	key := types.NamespacedName{Namespace: ns, Name: upstreamSecretName("egress")}
	foreign := &corev1.Secret{ObjectMeta: objectMeta(key), StringData: map[string]string{"credentials": "someone:else"}}
	if err := c.Create(context.Background(), foreign); err != nil {
		t.Fatal(err)
	}
	tfresource.Test(t, tfresource.TestCase{
		ProtoV6ProviderFactories: testAccProtoV6ProviderFactories,
		Steps: []tfresource.TestStep{{
			Config:      egressProxyConfig(ns, "egress", sharedProxyBody("agent:pw", 1)),
			ExpectError: regexp.MustCompile(`was\s+not\s+made\s+by\s+this\s+resource`),
		}},
	})
	var s corev1.Secret
	if err := c.Get(context.Background(), key, &s); err != nil {
		t.Fatal(err)
	}
	if string(s.Data["credentials"]) != "someone:else" {
		t.Errorf("foreign Secret overwritten: %q", s.Data["credentials"])
	}
}

// TestAccEgressProxy_invalid: mistakes are refused at plan time with the
// rule they break, and a bad credential is never echoed.
func TestAccEgressProxy_invalid(t *testing.T) {
	t.Parallel()
	testAccPreCheck(t)
	cases := []struct{ name, body, want string }{
		{"bad CIDR", `denied_cidrs = ["10.0.0.0/33"]`, `"10.0.0.0/33": netip.ParsePrefix`},
		{"CIDR host bits", `denied_cidrs = ["10.1.2.3/8"]`, `host bits are set; the network is 10.0.0.0/8`},
		{"allowed CIDR over loopback", `allowed_cidrs = ["127.0.0.1/32"]`, `overlaps 127.0.0.0/8, which the proxy never reaches`},
		{"allowed CIDR over metadata", `allowed_cidrs = ["169.254.0.0/16"]`, `overlaps 169.254.0.0/16, which the proxy never reaches`},
		{"bad runtime class", `runtime_class_name = "gVisor"`, `a Kubernetes object name`},
		{"bad mode", `mode = "Sometimes"`, `value must be one of: ["PerAgent" "Shared"]`},
		{"bad domain", `allowed_domains = ["Example.COM"]`, `not a lower-case domain name`},
		{"replicas per agent", `replicas = 3`, `replicas needs mode Shared`},
		{"replicas range", "mode = \"Shared\"\n  replicas = 0", `must be between 1 and 100`},
		{"URL with credentials", `upstream_url = "http://u:p@proxy:3128"`, `credentials in the URL`},
		{"credentials without URL", "upstream_credentials_wo = \"a:b\"\n  upstream_credentials_wo_version = 1", `"upstream_url" must be specified`},
		{"credentials without version", "upstream_url = \"http://proxy:3128\"\n  upstream_credentials_wo = \"a:b\"", `"upstream_credentials_wo_version" must be specified`},
		{"both credentials", `
  upstream_url                    = "http://proxy:3128"
  upstream_credentials_wo         = "a:b"
  upstream_credentials_wo_version = 1
  upstream_credentials_secret     = { name = "s", key = "k" }`, `cannot be specified when`},
		{"credentials without colon", `
  upstream_url                    = "http://proxy:3128"
  upstream_credentials_wo         = "no-colon-supersecret"
  upstream_credentials_wo_version = 1`, `must be ` + "`user:password`"},
	}
	cred := func(body string) string {
		return "credentials = [{\n    name  = \"api\"\n    hosts = [\"api.example.com\"]\n    " + body + "\n  }]"
	}
	const hdr, src = `header = { name = "X-Key" }`, `secret_ref = { name = "s", key = "k" }`
	const wo = "value_wo = \"x\"\n    value_wo_version = 1"
	cases = append(cases, []struct{ name, body, want string }{
		{"credential with both sources", cred(hdr + "\n    " + src + "\n    " + wo), egressCredentialRules[1].description + " (`secret_ref` and `value_wo` set)"},
		{"credential without a source", cred(hdr), egressCredentialRules[1].description + " (none is set)"},
		{"credential with header and basic_auth", cred(hdr + "\n    basic_auth = { username = \"u\" }\n    " + src),
			egressCredentialRules[0].description + " (`header` and `basic_auth` set)"},
		{"credential without header or basic_auth", cred(src), egressCredentialRules[0].description + " (none is set)"},
		{"value_wo without version", cred(hdr + "\n    value_wo = \"x\""), egressCredentialRules[2].description + " (`value_wo` set)"},
		{"value_wo_version without value", cred(hdr + "\n    " + src + "\n    value_wo_version = 1"), egressCredentialRules[2].description},
		{"duplicate credential names", "credentials = [\n    { name = \"api\", hosts = [\"a.example.com\"], " + hdr + ", " + src + " },\n" +
			"    { name = \"api\", hosts = [\"b.example.com\"], " + hdr + ", " + src + " },\n  ]", `are both named "api"`},
		{"secret_ref to the owned Secret", cred(hdr + "\n    secret_ref = { name = \"invalid-egress-injected\", key = \"api\" }"),
			"is where the resource keeps the values given by value_wo"},
		{"hop-by-hop header", cred(`header = { name = "Proxy-Authorization" }` + "\n    " + src), "Proxy-Authorization never reaches the destination"},
		{"template without placeholder", cred(`header = { name = "X-Key", value_template = "Bearer" }` + "\n    " + src), "no {{secret}} in it"},
		{"basic_auth value without colon", cred("basic_auth = {}\n    value_wo = \"no-colon-supersecret\"\n    value_wo_version = 1"),
			"must be " + credentialsDescription},
		{"bad credential host", strings.Replace(cred(hdr+"\n    "+src), "api.example.com", "API.example.com", 1), "not a lower-case domain name"},
		{"CA bundle without a certificate", `destination_ca_bundle = "not a certificate"`, "no CA certificate found in PEM data"},
	}...)
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			tfresource.Test(t, tfresource.TestCase{
				ProtoV6ProviderFactories: testAccProtoV6ProviderFactories,
				Steps: []tfresource.TestStep{{
					Config:      egressProxyConfig("invalid", "invalid", tc.body),
					PlanOnly:    true,
					ExpectError: regexp.MustCompile(strings.ReplaceAll(regexp.QuoteMeta(tc.want), ` `, `\s+`)),
				}},
			})
		})
	}
}

func checkEgressProxy(c client.Client, key types.NamespacedName, check func(*agentboxv1alpha1.EgressProxy) error) tfresource.TestCheckFunc {
	return func(*terraform.State) error {
		var ep agentboxv1alpha1.EgressProxy
		if err := c.Get(context.Background(), key, &ep); err != nil {
			return err
		}
		return check(&ep)
	}
}

func checkUpstreamSecret(c client.Client, key types.NamespacedName, proxy, want string) tfresource.TestCheckFunc {
	return func(*terraform.State) error {
		var s corev1.Secret
		if err := c.Get(context.Background(), key, &s); err != nil {
			return fmt.Errorf("upstream Secret: %w", err)
		}
		if got := string(s.Data[upstreamCredentialsKey]); got != want {
			return fmt.Errorf("upstream Secret %s holds other credentials than the configuration's", key)
		}
		owners := s.GetOwnerReferences()
		if len(owners) != 1 || owners[0].Kind != egressProxyKind || owners[0].Name != proxy || s.Labels[upstreamSecretLabel] != proxy {
			return fmt.Errorf("upstream Secret %s: owners %+v, labels %v", key, owners, s.Labels)
		}
		return nil
	}
}

func checkSecretGone(c client.Client, key types.NamespacedName) tfresource.TestCheckFunc {
	return func(*terraform.State) error {
		err := c.Get(context.Background(), key, &corev1.Secret{})
		if !apierrors.IsNotFound(err) {
			return fmt.Errorf("Secret %s should be gone: %v", key, err)
		}
		return nil
	}
}

// lacks fails when any of the secrets occurs in what Terraform produced.
type lacks struct{ secrets []string }

func stateLacks(secrets ...string) lacks { return lacks{secrets} }
func planLacks(secrets ...string) lacks  { return lacks{secrets} }

func (l lacks) find(what string, v any) error {
	b, err := json.Marshal(v)
	if err != nil {
		return err
	}
	for _, s := range l.secrets {
		if strings.Contains(string(b), s) {
			return fmt.Errorf("the %s holds upstream credentials in clear", what)
		}
	}
	return nil
}

// CheckState looks at the whole state as `terraform show -json` has it,
// which shows sensitive values unredacted: a write-only value must not be
// there at all.
func (l lacks) CheckState(_ context.Context, req statecheck.CheckStateRequest, resp *statecheck.CheckStateResponse) {
	resp.Error = l.find("state", req.State)
}

// CheckPlan looks at every value of the plan. The plan's copy of the
// configuration is left out: it repeats the literals of the test's .tf file,
// which is where the credentials come from.
func (l lacks) CheckPlan(_ context.Context, req plancheck.CheckPlanRequest, resp *plancheck.CheckPlanResponse) {
	p := *req.Plan
	if p.Config == nil {
		resp.Error = fmt.Errorf("the plan has no configuration: is this the JSON plan?")
		return
	}
	p.Config = nil
	resp.Error = l.find("plan", p)
}
