package provider

import (
	"context"
	"errors"
	"fmt"
	"os"
	"regexp"
	"strings"
	"testing"
	"time"

	"github.com/hashicorp/terraform-plugin-framework/attr"
	"github.com/hashicorp/terraform-plugin-framework/diag"
	fwresource "github.com/hashicorp/terraform-plugin-framework/resource"
	"github.com/hashicorp/terraform-plugin-framework/resource/schema"
	"github.com/hashicorp/terraform-plugin-framework/types"
	"github.com/hashicorp/terraform-plugin-testing/compare"
	"github.com/hashicorp/terraform-plugin-testing/helper/resource"
	"github.com/hashicorp/terraform-plugin-testing/knownvalue"
	"github.com/hashicorp/terraform-plugin-testing/plancheck"
	"github.com/hashicorp/terraform-plugin-testing/statecheck"
	"github.com/hashicorp/terraform-plugin-testing/terraform"
	"github.com/hashicorp/terraform-plugin-testing/tfjsonpath"
	appsv1 "k8s.io/api/apps/v1"
	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	k8stypes "k8s.io/apimachinery/pkg/types"
	"k8s.io/client-go/tools/clientcmd"
	"sigs.k8s.io/controller-runtime/pkg/client"

	"github.com/agentbox/terraform-provider-agentbox/internal/chart"
)

const testAccPlatformAddr = "agentbox_platform.test"

func TestPlatformSchema(t *testing.T) {
	var resp fwresource.SchemaResponse
	NewPlatformResource().Schema(context.Background(), fwresource.SchemaRequest{}, &resp)
	if resp.Diagnostics.HasError() {
		t.Fatal(resp.Diagnostics)
	}
	if diags := resp.Schema.ValidateImplementation(context.Background()); diags.HasError() {
		t.Fatal(diags)
	}
	for name, a := range resp.Schema.Attributes {
		if a.GetMarkdownDescription() == "" {
			t.Errorf("attribute %s has no description", name)
		}
	}
	if !resp.Schema.Attributes["admin_token"].IsSensitive() {
		t.Error("admin_token is not sensitive")
	}
	if d := resp.Schema.Attributes["image_tag"].(schema.StringAttribute).Default; d == nil {
		t.Error("image_tag has no default")
	}
}

func TestPlatformFromReleaseConfig(t *testing.T) {
	two := 2
	v := chart.Values{ImageTag: "v1", ImagePullPolicy: "Never", Replicas: &two, Raw: "metrics:\n  enabled: false\n"}
	cfg, err := v.Map()
	if err != nil {
		t.Fatal(err)
	}
	rel := &chart.Release{Config: cfg, AppVersion: "dev"}

	// An import knows nothing but the ID: everything comes from the release.
	var m platformModel
	m.ImageTag = types.StringNull()
	var diags diag.Diagnostics
	m.fromReleaseConfig(rel, &diags)
	if diags.HasError() {
		t.Fatal(diags)
	}
	if m.ImageTag.ValueString() != "v1" || m.ImagePullPolicy.ValueString() != "Never" || m.Replicas.ValueInt64() != 2 ||
		m.Values.ValueString() != "metrics:\n  enabled: false\n" || !m.ImageRegistry.IsNull() || !m.Wait.ValueBool() {
		t.Errorf("imported %+v", m)
	}

	// Configured values that produce the release's are kept as written.
	m.Values = types.StringValue("metrics: {enabled: false}")
	m.fromReleaseConfig(rel, &diags)
	if m.Values.ValueString() != "metrics: {enabled: false}" {
		t.Errorf("values rewritten to %q", m.Values.ValueString())
	}

	// A release changed by hand shows up in the attributes.
	rel.Config["replicaCount"] = 3
	m.fromReleaseConfig(rel, &diags)
	if m.Replicas.ValueInt64() != 3 {
		t.Errorf("replicas %d, want 3", m.Replicas.ValueInt64())
	}

	// A release installed without values runs the chart's appVersion.
	empty := platformModel{ImageTag: types.StringNull()}
	empty.fromReleaseConfig(&chart.Release{Config: map[string]any{}, AppVersion: "dev"}, &diags)
	if empty.ImageTag.ValueString() != "dev" || empty.Replicas.ValueInt64() != 1 || !empty.Values.IsNull() {
		t.Errorf("defaults %+v", empty)
	}
}

func TestPlatformNeedsUpgrade(t *testing.T) {
	base := platformModel{
		ImageTag: types.StringValue("dev"), Replicas: types.Int64Value(1), Values: types.StringNull(),
		Status: types.StringValue("deployed"), ChartVersion: types.StringValue(chart.Version()),
		Drift: types.ListValueMust(types.StringType, nil), Wait: types.BoolValue(true),
	}
	same := base
	same.Wait = types.BoolValue(false)
	if base.needsUpgrade(same) {
		t.Error("changing only wait upgrades the release")
	}
	spelled := base
	spelled.Values = types.StringValue("{}")
	if base.needsUpgrade(spelled) {
		t.Error("empty values spelled differently upgrade the release")
	}
	tag := base
	tag.ImageTag = types.StringValue("v2")
	if !base.needsUpgrade(tag) {
		t.Error("a new tag does not upgrade")
	}
	drifted := base
	drifted.Drift = types.ListValueMust(types.StringType, []attr.Value{types.StringValue("Deployment x/y is missing")})
	if !drifted.needsUpgrade(base) {
		t.Error("drift does not upgrade")
	}
	failed := base
	failed.Status = types.StringValue("failed")
	if !failed.needsUpgrade(base) {
		t.Error("a failed release does not upgrade")
	}
}

// TestPlatformAccessChanges checks which updates plan api_endpoint,
// ca_certificate and admin_token as unknown: only those that can change
// them (TestAccPlatform_accessKnownAcrossUpdates shows the plans).
func TestPlatformAccessChanges(t *testing.T) {
	const ns = "agentbox-system"
	lines := func(l ...string) types.List {
		var v []attr.Value
		for _, s := range l {
			v = append(v, types.StringValue(s))
		}
		return types.ListValueMust(types.StringType, v)
	}
	base := platformModel{
		Namespace: types.StringValue(ns), ImageTag: types.StringValue("dev"), Replicas: types.Int64Value(1),
		Values: types.StringValue("metrics: {enabled: true}"), Status: types.StringValue("deployed"),
		ChartVersion: types.StringValue(chart.Version()), Drift: lines(),
		APIEndpoint:   types.StringValue("https://10.96.0.20:443"),
		CACertificate: types.StringValue("-----BEGIN CERTIFICATE-----\n"), AdminToken: types.StringValue("token"),
	}
	type access struct{ endpoint, ca, token bool }
	none, all := access{}, access{true, true, true}
	cases := []struct {
		name  string
		state func(*platformModel)
		plan  func(*platformModel)
		want  access
	}{
		{"nothing", nil, nil, none},
		{"replicas", nil, func(m *platformModel) { m.Replicas = types.Int64Value(3) }, none},
		{"images", nil, func(m *platformModel) {
			m.ImageTag = types.StringValue("v2")
			m.ImageRegistry = types.StringValue("r.example.com")
		}, none},
		{"other values", nil, func(m *platformModel) {
			m.Values = types.StringValue("metrics: {enabled: false}\ntrustDomain: example.org")
		}, none},
		{"values dropped", nil, func(m *platformModel) { m.Values = types.StringNull() }, none},
		{"default port spelled out", nil, func(m *platformModel) { m.Values = types.StringValue("service: {port: 443, type: NodePort}") }, none},
		{"CA Secret named", nil, func(m *platformModel) { m.Values = types.StringValue("ca: {existingSecret: my-ca}") }, access{ca: true}},
		{"token Secret named", nil, func(m *platformModel) { m.Values = types.StringValue("adminToken: {existingSecret: my-token}") }, access{token: true}},
		{"service port", nil, func(m *platformModel) { m.Values = types.StringValue("service: {port: 8443}") }, access{endpoint: true}},
		{"values unknown", nil, func(m *platformModel) { m.Values = types.StringUnknown() }, all},
		{"replicas unknown", nil, func(m *platformModel) { m.Replicas = types.Int64Unknown() }, none},
		{"another chart", nil, func(m *platformModel) { m.ChartVersion = types.StringValue("0.0.0-other") }, all},
		{"release failed", func(m *platformModel) { m.Status = types.StringValue("failed") }, nil, all},
		{"Deployment drift", func(m *platformModel) {
			m.Drift = lines("Deployment " + ns + "/agentbox-controlplane is missing")
		}, nil, none},
		{"Service drift", func(m *platformModel) {
			m.Drift = lines("Service " + ns + "/agentbox-api changed out of band: spec.ports[0].port")
		}, nil, access{endpoint: true}},
		{"CA Secret drift", func(m *platformModel) { m.Drift = lines("Secret " + ns + "/agentbox-ca is missing") }, nil, access{ca: true}},
		{"token Secret drift", func(m *platformModel) {
			m.Drift = lines("Secret "+ns+"/agentbox-admin-token is being deleted", "Deployment "+ns+"/agentbox-controlplane is missing")
		}, nil, access{token: true}},
		{"drift in another namespace's objects", func(m *platformModel) { m.Drift = lines("Secret other/agentbox-ca is missing") }, nil, none},
		{"no endpoint yet", func(m *platformModel) { m.APIEndpoint = types.StringValue("") }, nil, access{endpoint: true}},
		{"no CA yet", func(m *platformModel) { m.CACertificate = types.StringValue("") }, nil, access{ca: true}},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			state := base
			if tc.state != nil {
				tc.state(&state)
			}
			plan := state
			if tc.plan != nil {
				tc.plan(&plan)
			}
			var got access
			got.endpoint, got.ca, got.token = state.accessChanges(context.Background(), plan)
			if got != tc.want {
				t.Errorf("unknown (endpoint, ca, token) = %+v, want %+v", got, tc.want)
			}
		})
	}
}

func testAccPlatformConfig(ns, tag string, extra ...string) string {
	return testAccProviderConfig() + fmt.Sprintf(`
resource "agentbox_platform" "test" {
  namespace = %q
  image_tag = %q
  # Images are imported into the test node; nothing may be pulled.
  image_pull_policy = "Never"
%s
}
`, ns, tag, strings.Join(extra, "\n"))
}

// platformChecks are the state checks every successful apply must pass.
func platformChecks(ns string, revision int64) []statecheck.StateCheck {
	attr := func(name string, v knownvalue.Check) statecheck.StateCheck {
		return statecheck.ExpectKnownValue(testAccPlatformAddr, tfjsonpath.New(name), v)
	}
	return []statecheck.StateCheck{
		attr("id", knownvalue.StringExact(ns+"/agentbox")),
		attr("namespace", knownvalue.StringExact(ns)),
		attr("release_name", knownvalue.StringExact("agentbox")),
		attr("revision", knownvalue.Int64Exact(revision)),
		attr("status", knownvalue.StringExact("deployed")),
		attr("chart_version", knownvalue.StringExact(chart.Version())),
		attr("api_service_dns", knownvalue.StringExact("agentbox-api."+ns+".svc")),
		attr("api_endpoint", knownvalue.StringRegexp(regexp.MustCompile(`^https://[0-9.]+:443$`))),
		attr("ca_certificate", knownvalue.StringRegexp(regexp.MustCompile(`^-----BEGIN CERTIFICATE-----\n`))),
		attr("admin_token", knownvalue.StringRegexp(regexp.MustCompile(`^[A-Za-z0-9]{48}$`))),
		attr("drift", knownvalue.ListExact([]knownvalue.Check{})),
		attr("replicas", knownvalue.Int64Exact(1)),
	}
}

// deleteControlPlane deletes the control plane Deployment out of band and
// waits until it is gone, so that the next refresh finds it missing.
func deleteControlPlane(t *testing.T, c client.Client, ns string) {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	key := k8stypes.NamespacedName{Namespace: ns, Name: chart.ControlPlaneDeployment}
	if err := c.Delete(ctx, &appsv1.Deployment{ObjectMeta: metav1.ObjectMeta{Name: key.Name, Namespace: key.Namespace}}); err != nil {
		t.Fatal(err)
	}
	if err := waitGone(ctx, c, key, &appsv1.Deployment{}, time.Minute); err != nil {
		t.Fatal(err)
	}
}

func controlPlaneExists(c client.Client, ns, image string) resource.TestCheckFunc {
	return func(*terraform.State) error {
		var d appsv1.Deployment
		key := k8stypes.NamespacedName{Namespace: ns, Name: chart.ControlPlaneDeployment}
		if err := c.Get(context.Background(), key, &d); err != nil {
			return err
		}
		if got := d.Spec.Template.Spec.Containers[0].Image; got != image {
			return fmt.Errorf("control plane image %q, want %q", got, image)
		}
		return nil
	}
}

// platformDestroyed checks that the release and its Deployment are gone.
func platformDestroyed(c client.Client, ns string) resource.TestCheckFunc {
	return func(*terraform.State) error {
		cfg, err := clientcmd.BuildConfigFromFlags("", os.Getenv(testAccKubeconfigEnv))
		if err != nil {
			return err
		}
		if _, err := chart.New(cfg).Status(context.Background(), ns, chart.DefaultReleaseName); !errors.Is(err, chart.ErrNotFound) {
			return fmt.Errorf("release still there after destroy: %v", err)
		}
		err = c.Get(context.Background(), k8stypes.NamespacedName{Namespace: ns, Name: chart.ControlPlaneDeployment}, &appsv1.Deployment{})
		if !apierrors.IsNotFound(err) {
			return fmt.Errorf("control plane Deployment still there after destroy: %v", err)
		}
		return nil
	}
}

// TestAccPlatform_basic installs the real control plane and waits for it.
func TestAccPlatform_basic(t *testing.T) {
	t.Parallel()
	testAccPreCheck(t)
	tag := os.Getenv(testAccImageTagEnv)
	if tag == "" {
		t.Skip(testAccImageTagEnv + " is not set: the agentbox images were not built and imported into the test node " +
			"(CI sets it; TestAccPlatform_noWait covers the lifecycle without images)")
	}
	c, ns := testAccCluster(t)
	config := testAccPlatformConfig(ns, tag)
	image := "agentbox/agentbox-controlplane:" + tag
	resource.Test(t, resource.TestCase{
		ProtoV6ProviderFactories: testAccProtoV6ProviderFactories,
		CheckDestroy:             platformDestroyed(c, ns),
		Steps: []resource.TestStep{
			{
				Config:            config,
				ConfigStateChecks: platformChecks(ns, 1),
				Check:             controlPlaneExists(c, ns, image),
			},
			{
				Config: config,
				ConfigPlanChecks: resource.ConfigPlanChecks{
					PreApply: []plancheck.PlanCheck{plancheck.ExpectEmptyPlan()},
				},
			},
			{
				ResourceName:      testAccPlatformAddr,
				ImportState:       true,
				ImportStateId:     ns + "/agentbox",
				ImportStateVerify: true,
			},
			{
				PreConfig:          func() { deleteControlPlane(t, c, ns) },
				Config:             config,
				PlanOnly:           true,
				ExpectNonEmptyPlan: true,
			},
			{
				Config: config,
				ConfigPlanChecks: resource.ConfigPlanChecks{
					PreApply: []plancheck.PlanCheck{
						plancheck.ExpectResourceAction(testAccPlatformAddr, plancheck.ResourceActionUpdate),
						plancheck.ExpectUnknownValue(testAccPlatformAddr, tfjsonpath.New("revision")),
					},
				},
				ConfigStateChecks: platformChecks(ns, 2),
				Check:             controlPlaneExists(c, ns, image),
			},
			{
				// A field of the release changed out of band is drift, and
				// the upgrade sets it back.
				PreConfig: func() { setControlPlaneEnv(t, c, ns, sandboxPullPolicyEnv, "Always") },
				Config:    config,
				ConfigPlanChecks: resource.ConfigPlanChecks{
					PreApply: []plancheck.PlanCheck{
						plancheck.ExpectResourceAction(testAccPlatformAddr, plancheck.ResourceActionUpdate),
						expectRefreshedDrift(testAccPlatformAddr, "Deployment "+ns+"/"+chart.ControlPlaneDeployment+
							" changed out of band: spec.template.spec.containers[0].env[2].value"),
						plancheck.ExpectKnownValue(testAccPlatformAddr, tfjsonpath.New("drift"), knownvalue.ListExact([]knownvalue.Check{})),
					},
				},
				ConfigStateChecks: platformChecks(ns, 3),
				Check: resource.ComposeTestCheckFunc(
					controlPlaneExists(c, ns, image),
					controlPlaneEnv(c, ns, sandboxPullPolicyEnv, "Never"),
				),
			},
			{
				// With the controllers running, and labels and annotations
				// that others add, there is nothing to do.
				PreConfig: func() { addForeignMetadata(t, c, ns) },
				Config:    config,
				ConfigPlanChecks: resource.ConfigPlanChecks{
					PreApply: []plancheck.PlanCheck{plancheck.ExpectEmptyPlan()},
				},
				ConfigStateChecks: platformChecks(ns, 3),
			},
		},
	})
}

// sandboxPullPolicyEnv is the control plane's third variable (env[2]); the
// test config sets it to Never through image_pull_policy.
const sandboxPullPolicyEnv = "AGENTBOX_SANDBOX_IMAGE_PULL_POLICY"

// setControlPlaneEnv changes a variable of the control plane out of band, as
// `kubectl set env` would.
func setControlPlaneEnv(t *testing.T, c client.Client, ns, name, value string) {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	var d appsv1.Deployment
	if err := c.Get(ctx, k8stypes.NamespacedName{Namespace: ns, Name: chart.ControlPlaneDeployment}, &d); err != nil {
		t.Fatal(err)
	}
	env := d.Spec.Template.Spec.Containers[0].Env
	for i := range env {
		if env[i].Name == name {
			env[i].Value = value
			if err := c.Update(ctx, &d); err != nil {
				t.Fatal(err)
			}
			return
		}
	}
	t.Fatalf("the control plane has no variable %s: %v", name, env)
}

func controlPlaneEnv(c client.Client, ns, name, want string) resource.TestCheckFunc {
	return func(*terraform.State) error {
		var d appsv1.Deployment
		if err := c.Get(context.Background(), k8stypes.NamespacedName{Namespace: ns, Name: chart.ControlPlaneDeployment}, &d); err != nil {
			return err
		}
		for _, e := range d.Spec.Template.Spec.Containers[0].Env {
			if e.Name == name {
				if e.Value != want {
					return fmt.Errorf("control plane %s=%q, want %q", name, e.Value, want)
				}
				return nil
			}
		}
		return fmt.Errorf("the control plane has no variable %s", name)
	}
}

// addForeignMetadata labels and annotates release objects the way other
// tools do; the release sets none of these keys.
func addForeignMetadata(t *testing.T, c client.Client, ns string) {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	patch := client.RawPatch(k8stypes.MergePatchType,
		[]byte(`{"metadata":{"labels":{"example.com/team":"platform"},"annotations":{"example.com/owner":"someone else"}}}`))
	for _, o := range []client.Object{
		&appsv1.Deployment{ObjectMeta: metav1.ObjectMeta{Namespace: ns, Name: chart.ControlPlaneDeployment}},
		&corev1.Service{ObjectMeta: metav1.ObjectMeta{Namespace: ns, Name: chart.APIService}},
	} {
		if err := c.Patch(ctx, o, patch); err != nil {
			t.Fatal(err)
		}
	}
}

// expectRefreshedDrift checks that the refresh before the plan recorded
// want in the drift attribute, which the plan then empties.
func expectRefreshedDrift(addr, want string) plancheck.PlanCheck {
	return refreshedDrift{addr: addr, want: want}
}

type refreshedDrift struct{ addr, want string }

func (c refreshedDrift) CheckPlan(_ context.Context, req plancheck.CheckPlanRequest, resp *plancheck.CheckPlanResponse) {
	for _, rc := range req.Plan.ResourceChanges {
		if rc.Address != c.addr || rc.Change == nil {
			continue
		}
		before, _ := rc.Change.Before.(map[string]any)
		drift, _ := before["drift"].([]any)
		for _, d := range drift {
			if d == c.want {
				return
			}
		}
		resp.Error = fmt.Errorf("%s: refreshed drift %q does not hold %q", c.addr, drift, c.want)
		return
	}
	resp.Error = fmt.Errorf("%s is not in the plan", c.addr)
}

// TestAccPlatform_noWait runs the whole lifecycle without waiting for the
// control plane, so it needs no images: the Deployment exists but its pod
// never starts.
func TestAccPlatform_noWait(t *testing.T) {
	t.Parallel()
	c, ns := testAccCluster(t)
	values := "values = <<-EOT\n    metrics:\n      enabled: false\n  EOT"
	config := testAccPlatformConfig(ns, "absent", "  wait = false", "  "+values)
	resource.Test(t, resource.TestCase{
		ProtoV6ProviderFactories: testAccProtoV6ProviderFactories,
		CheckDestroy:             platformDestroyed(c, ns),
		Steps: []resource.TestStep{
			{
				Config: config,
				ConfigStateChecks: append(platformChecks(ns, 1),
					statecheck.ExpectKnownValue(testAccPlatformAddr, tfjsonpath.New("wait"), knownvalue.Bool(false)),
					statecheck.ExpectKnownValue(testAccPlatformAddr, tfjsonpath.New("values"), knownvalue.StringExact("metrics:\n  enabled: false\n")),
				),
				Check: resource.ComposeTestCheckFunc(
					controlPlaneExists(c, ns, "agentbox/agentbox-controlplane:absent"),
					func(*terraform.State) error {
						err := c.Get(context.Background(), k8stypes.NamespacedName{Namespace: ns, Name: "agentbox-controlplane-metrics"}, &corev1.Service{})
						if !apierrors.IsNotFound(err) {
							return fmt.Errorf("metrics Service exists although values disable it: %v", err)
						}
						return nil
					},
				),
			},
			{
				Config: config,
				ConfigPlanChecks: resource.ConfigPlanChecks{
					PreApply: []plancheck.PlanCheck{plancheck.ExpectEmptyPlan()},
				},
			},
			{
				ResourceName:      testAccPlatformAddr,
				ImportState:       true,
				ImportStateId:     ns + "/agentbox",
				ImportStateVerify: true,
				// How the provider waits is not recorded in the release.
				ImportStateVerifyIgnore: []string{"wait"},
			},
			{
				PreConfig:          func() { deleteControlPlane(t, c, ns) },
				Config:             config,
				PlanOnly:           true,
				ExpectNonEmptyPlan: true,
			},
			{
				Config: config,
				ConfigPlanChecks: resource.ConfigPlanChecks{
					PreApply: []plancheck.PlanCheck{
						plancheck.ExpectResourceAction(testAccPlatformAddr, plancheck.ResourceActionUpdate),
						plancheck.ExpectUnknownValue(testAccPlatformAddr, tfjsonpath.New("revision")),
						plancheck.ExpectKnownValue(testAccPlatformAddr, tfjsonpath.New("drift"), knownvalue.ListExact([]knownvalue.Check{})),
					},
				},
				ConfigStateChecks: platformChecks(ns, 2),
				Check:             controlPlaneExists(c, ns, "agentbox/agentbox-controlplane:absent"),
			},
			{
				// An ordinary change upgrades in place and keeps the endpoint,
				// the CA and the token.
				Config: testAccPlatformConfig(ns, "absent2", "  wait = false", "  "+values),
				ConfigPlanChecks: resource.ConfigPlanChecks{
					PreApply: []plancheck.PlanCheck{
						plancheck.ExpectResourceAction(testAccPlatformAddr, plancheck.ResourceActionUpdate),
						plancheck.ExpectKnownValue(testAccPlatformAddr, tfjsonpath.New("ca_certificate"),
							knownvalue.StringRegexp(regexp.MustCompile(`^-----BEGIN CERTIFICATE-----`))),
					},
				},
				ConfigStateChecks: platformChecks(ns, 3),
				Check:             controlPlaneExists(c, ns, "agentbox/agentbox-controlplane:absent2"),
			},
			{
				// Changing only how the provider waits needs no new revision.
				Config: testAccPlatformConfig(ns, "absent2", "  wait = false", "  "+values, "  timeouts = { update = \"2m\" }"),
				ConfigPlanChecks: resource.ConfigPlanChecks{
					PreApply: []plancheck.PlanCheck{plancheck.ExpectResourceAction(testAccPlatformAddr, plancheck.ResourceActionUpdate)},
				},
				ConfigStateChecks: platformChecks(ns, 3),
			},
		},
	})
}

// TestAccPlatform_accessKnownAcrossUpdates updates the platform under a
// resource and outputs that read its endpoint, CA and admin token: updates
// that cannot change them keep them known in the plan, so the reader has
// nothing to do, and one that can (another admin token Secret) plans only
// that one unknown. It also shows global.commonLabels reaching the control
// plane pods on the cluster. Needs no images: nothing waits for the pods.
func TestAccPlatform_accessKnownAcrossUpdates(t *testing.T) {
	t.Parallel()
	c, ns := testAccCluster(t)
	const consumer = "terraform_data.consumer"
	config := func(replicas int, values string) string {
		return testAccPlatformConfig(ns, "absent", "  wait = false", fmt.Sprintf("  replicas = %d", replicas),
			"  values = <<-EOT\n"+values+"\n  EOT") + `
resource "terraform_data" "consumer" {
  input = {
    endpoint = agentbox_platform.test.api_endpoint
    ca       = agentbox_platform.test.ca_certificate
    token    = agentbox_platform.test.admin_token
  }
}

output "api_endpoint" {
  value = agentbox_platform.test.api_endpoint
}

output "ca_certificate" {
  value = agentbox_platform.test.ca_certificate
}
`
	}
	endpointRe := knownvalue.StringRegexp(regexp.MustCompile(`^https://[0-9.]+:443$`))
	caRe := knownvalue.StringRegexp(regexp.MustCompile(`^-----BEGIN CERTIFICATE-----\n`))
	generatedToken := knownvalue.StringRegexp(regexp.MustCompile(`^[A-Za-z0-9]{48}$`))
	platformAttr := func(name string) tfjsonpath.Path { return tfjsonpath.New(name) }

	// An update that cannot change them: the platform is updated, the
	// reader is not, and the outputs are known.
	unrelatedUpdate := []plancheck.PlanCheck{
		plancheck.ExpectResourceAction(testAccPlatformAddr, plancheck.ResourceActionUpdate),
		plancheck.ExpectUnknownValue(testAccPlatformAddr, platformAttr("revision")),
		plancheck.ExpectKnownValue(testAccPlatformAddr, platformAttr("api_endpoint"), endpointRe),
		plancheck.ExpectKnownValue(testAccPlatformAddr, platformAttr("ca_certificate"), caRe),
		plancheck.ExpectKnownValue(testAccPlatformAddr, platformAttr("admin_token"), generatedToken),
		plancheck.ExpectResourceAction(consumer, plancheck.ResourceActionNoop),
		plancheck.ExpectKnownOutputValue("api_endpoint", endpointRe),
		plancheck.ExpectKnownOutputValue("ca_certificate", caRe),
	}
	// The reader holds what the platform holds.
	readerMatches := func(key, attr string) statecheck.StateCheck {
		return statecheck.CompareValuePairs(consumer, tfjsonpath.New("output").AtMapKey(key),
			testAccPlatformAddr, platformAttr(attr), compare.ValuesSame())
	}
	sameCA, sameEndpoint, sameToken := statecheck.CompareValue(compare.ValuesSame()),
		statecheck.CompareValue(compare.ValuesSame()), statecheck.CompareValue(compare.ValuesSame())
	revision := func(n int64) statecheck.StateCheck {
		return statecheck.ExpectKnownValue(testAccPlatformAddr, platformAttr("revision"), knownvalue.Int64Exact(n))
	}

	const ownToken = "0123456789abcdef0123456789abcdef"
	labelled := "    global: {commonLabels: {example.com/team: infra}}\n    metrics: {enabled: false}"
	resource.Test(t, resource.TestCase{
		ProtoV6ProviderFactories: testAccProtoV6ProviderFactories,
		CheckDestroy:             platformDestroyed(c, ns),
		Steps: []resource.TestStep{
			{
				Config: config(1, "    metrics: {enabled: true}"),
				ConfigStateChecks: []statecheck.StateCheck{
					revision(1),
					sameCA.AddStateValue(testAccPlatformAddr, platformAttr("ca_certificate")),
					sameEndpoint.AddStateValue(testAccPlatformAddr, platformAttr("api_endpoint")),
					sameToken.AddStateValue(testAccPlatformAddr, platformAttr("admin_token")),
					readerMatches("ca", "ca_certificate"), readerMatches("endpoint", "api_endpoint"), readerMatches("token", "admin_token"),
				},
			},
			{
				// replicas
				Config:           config(0, "    metrics: {enabled: true}"),
				ConfigPlanChecks: resource.ConfigPlanChecks{PreApply: unrelatedUpdate},
				ConfigStateChecks: []statecheck.StateCheck{
					revision(2),
					statecheck.ExpectKnownValue(testAccPlatformAddr, platformAttr("replicas"), knownvalue.Int64Exact(0)),
					sameCA.AddStateValue(testAccPlatformAddr, platformAttr("ca_certificate")),
					sameEndpoint.AddStateValue(testAccPlatformAddr, platformAttr("api_endpoint")),
					sameToken.AddStateValue(testAccPlatformAddr, platformAttr("admin_token")),
				},
			},
			{
				// values that do not touch them, among them labels for
				// every object and pod
				Config:           config(0, labelled),
				ConfigPlanChecks: resource.ConfigPlanChecks{PreApply: unrelatedUpdate},
				ConfigStateChecks: []statecheck.StateCheck{
					revision(3),
					sameCA.AddStateValue(testAccPlatformAddr, platformAttr("ca_certificate")),
					sameEndpoint.AddStateValue(testAccPlatformAddr, platformAttr("api_endpoint")),
					sameToken.AddStateValue(testAccPlatformAddr, platformAttr("admin_token")),
				},
				Check: controlPlaneLabels(c, ns, "example.com/team", "infra"),
			},
			{
				// Another admin token Secret: only admin_token is unknown,
				// and the reader is updated with it.
				PreConfig: func() { createTokenSecret(t, c, ns, "acc-admin-token", ownToken) },
				Config:    config(0, labelled+"\n    adminToken: {existingSecret: acc-admin-token}"),
				ConfigPlanChecks: resource.ConfigPlanChecks{
					PreApply: []plancheck.PlanCheck{
						plancheck.ExpectResourceAction(testAccPlatformAddr, plancheck.ResourceActionUpdate),
						plancheck.ExpectUnknownValue(testAccPlatformAddr, platformAttr("admin_token")),
						plancheck.ExpectKnownValue(testAccPlatformAddr, platformAttr("ca_certificate"), caRe),
						plancheck.ExpectKnownValue(testAccPlatformAddr, platformAttr("api_endpoint"), endpointRe),
						plancheck.ExpectResourceAction(consumer, plancheck.ResourceActionUpdate),
						plancheck.ExpectKnownOutputValue("ca_certificate", caRe),
					},
				},
				ConfigStateChecks: []statecheck.StateCheck{
					revision(4),
					statecheck.ExpectKnownValue(testAccPlatformAddr, platformAttr("admin_token"), knownvalue.StringExact(ownToken)),
					sameCA.AddStateValue(testAccPlatformAddr, platformAttr("ca_certificate")),
					sameEndpoint.AddStateValue(testAccPlatformAddr, platformAttr("api_endpoint")),
					readerMatches("token", "admin_token"),
				},
			},
			{
				Config:           config(0, labelled+"\n    adminToken: {existingSecret: acc-admin-token}"),
				ConfigPlanChecks: resource.ConfigPlanChecks{PreApply: []plancheck.PlanCheck{plancheck.ExpectEmptyPlan()}},
			},
		},
	})
}

// controlPlaneLabels checks that the control plane Deployment and its pod
// template carry the label, and that its selector does not.
func controlPlaneLabels(c client.Client, ns, key, value string) resource.TestCheckFunc {
	return func(*terraform.State) error {
		var d appsv1.Deployment
		if err := c.Get(context.Background(), k8stypes.NamespacedName{Namespace: ns, Name: chart.ControlPlaneDeployment}, &d); err != nil {
			return err
		}
		if d.Labels[key] != value || d.Spec.Template.Labels[key] != value {
			return fmt.Errorf("labels %v, pod template labels %v: want %s=%s on both", d.Labels, d.Spec.Template.Labels, key, value)
		}
		if _, ok := d.Spec.Selector.MatchLabels[key]; ok {
			return fmt.Errorf("selector %v holds the common label %s", d.Spec.Selector.MatchLabels, key)
		}
		return nil
	}
}

// createTokenSecret creates a Secret for adminToken.existingSecret.
func createTokenSecret(t *testing.T, c client.Client, ns, name, token string) {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	s := &corev1.Secret{
		ObjectMeta: metav1.ObjectMeta{Namespace: ns, Name: name},
		Data:       map[string][]byte{chart.AdminTokenKey: []byte(token)},
	}
	if err := c.Create(ctx, s); err != nil {
		t.Fatal(err)
	}
}
