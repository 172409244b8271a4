package provider

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"io/fs"
	"maps"
	"os"
	"path/filepath"
	"reflect"
	"slices"
	"strings"
	"testing"
	"time"

	tfresource "github.com/hashicorp/terraform-plugin-testing/helper/resource"
	"github.com/hashicorp/terraform-plugin-testing/knownvalue"
	"github.com/hashicorp/terraform-plugin-testing/plancheck"
	"github.com/hashicorp/terraform-plugin-testing/statecheck"
	"github.com/hashicorp/terraform-plugin-testing/terraform"
	"github.com/hashicorp/terraform-plugin-testing/tfjsonpath"
	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/apimachinery/pkg/util/wait"
	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/tools/clientcmd"
	"k8s.io/utils/ptr"
	"sigs.k8s.io/controller-runtime/pkg/client"

	agentboxv1alpha1 "github.com/agentbox/terraform-provider-agentbox/internal/api/v1alpha1"
	"github.com/agentbox/terraform-provider-agentbox/internal/pki"
	"github.com/agentbox/terraform-provider-agentbox/internal/testenv/toolchain"
)

// injectedCred is one credential of the test's configurations.
type injectedCred struct {
	name, hosts, how string
	// value and version for value_wo; secretRef otherwise.
	value     string
	version   int
	secretRef string
}

func (c injectedCred) hcl() string {
	src := c.secretRef
	if src == "" {
		src = fmt.Sprintf("value_wo = %q\n      value_wo_version = %d", c.value, c.version)
	}
	return fmt.Sprintf(`    {
      name  = %q
      hosts = [%s]
      %s
      %s
    },
`, c.name, c.hosts, c.how, src)
}

// injectedProxyBody renders the proxy's arguments with the credentials.
func injectedProxyBody(bundle string, creds ...injectedCred) string {
	var b strings.Builder
	fmt.Fprintf(&b, `
  allowed_domains       = ["api.example.com", "search.example.com", "registry.example.com"]
  destination_ca_bundle = %q
  credentials = [
`, bundle)
	for _, c := range creds {
		b.WriteString(c.hcl())
	}
	b.WriteString("  ]\n")
	return b.String()
}

// TestAccEgressProxy_credentials: injected credentials through the real
// terraform CLI against the API server, without a control plane (the
// proxy is created without waiting). Two credentials are given by value_wo
// and one by secret_ref. The values are random per run, so finding one in
// a plan, in `terraform show -json` or in the raw state file is a leak and
// not a coincidence.
//
// Not parallel: it points TF_ACC_TEMP_DIR at a folder of its own, so that
// it can read the raw state files Terraform writes there.
func TestAccEgressProxy_credentials(t *testing.T) {
	c, ns := testAccCluster(t)
	workDir := t.TempDir()
	t.Setenv("TF_ACC_TEMP_DIR", workDir)
	ctx := context.Background()
	addr := "agentbox_egress_proxy.test"
	name := "injecting"
	key := types.NamespacedName{Namespace: ns, Name: name}
	secretKey := types.NamespacedName{Namespace: ns, Name: injectedSecretName(name)}
	api1, api2, api3 := "sk-first-"+randomSuffix(t), "sk-second-"+randomSuffix(t), "sk-unapplied-"+randomSuffix(t)
	search1, search2 := "search-"+randomSuffix(t), "search-later-"+randomSuffix(t)
	registry := "registry-pw-" + randomSuffix(t)
	secrets := []string{api1, api2, api3, search1, search2, registry}
	ca, err := pki.NewCA("private destinations CA")
	if err != nil {
		t.Fatal(err)
	}
	bundle := string(ca.CertPEM)

	header := `header = { name = "Authorization", value_template = "Bearer {{secret}}" }`
	api := func(value string, version int) injectedCred {
		return injectedCred{name: "api-token", hosts: `"api.example.com"`, how: header, value: value, version: version}
	}
	searchWith := func(value string) injectedCred {
		return injectedCred{name: "search", hosts: `"search.example.com"`, how: `header = { name = "X-Api-Key" }`, value: value, version: 1}
	}
	search := searchWith(search1)
	reg := injectedCred{name: "registry", hosts: `"registry.example.com"`, how: `basic_auth = { username = "bot" }`,
		secretRef: `secret_ref = { name = "registry-creds", key = "password" }`}
	config := func(creds ...injectedCred) string {
		return egressProxyConfig(ns, name, injectedProxyBody(bundle, creds...))
	}
	config1 := config(api(api1, 1), search, reg)

	str := knownvalue.StringExact
	credState := func(name string, version knownvalue.Check, secretRef knownvalue.Check, header, basic knownvalue.Check) knownvalue.Check {
		return knownvalue.ObjectExact(map[string]knownvalue.Check{
			"name": str(name), "hosts": knownvalue.SetSizeExact(1), "header": header, "basic_auth": basic,
			"secret_ref": secretRef, "value_wo": knownvalue.Null(), "value_wo_version": version,
		})
	}
	apiState := func(version int64) knownvalue.Check {
		return credState("api-token", knownvalue.Int64Exact(version), knownvalue.Null(),
			knownvalue.ObjectExact(map[string]knownvalue.Check{"name": str("Authorization"), "value_template": str("Bearer {{secret}}")}),
			knownvalue.Null())
	}
	searchState := credState("search", knownvalue.Int64Exact(1), knownvalue.Null(),
		knownvalue.ObjectExact(map[string]knownvalue.Check{"name": str("X-Api-Key"), "value_template": knownvalue.Null()}), knownvalue.Null())
	regState := credState("registry", knownvalue.Null(),
		knownvalue.ObjectExact(map[string]knownvalue.Check{"name": str("registry-creds"), "key": str("password")}),
		knownvalue.Null(), knownvalue.ObjectExact(map[string]knownvalue.Check{"username": str("bot")}))

	noLeak := tfresource.ComposeTestCheckFunc(flatStateLacks(secrets...), rawStateLacks(workDir, name, secrets...))
	stateNoLeak := stateLacks(secrets...)
	planNoLeak := plancheck.PlanCheck(planLacks(secrets...))
	tfresource.Test(t, tfresource.TestCase{
		ProtoV6ProviderFactories: testAccProtoV6ProviderFactories,
		Steps: []tfresource.TestStep{
			{
				PreConfig: func() {
					s := &corev1.Secret{ObjectMeta: metav1.ObjectMeta{Namespace: ns, Name: "registry-creds"}, StringData: map[string]string{"password": registry}}
					if err := c.Create(ctx, s); err != nil {
						t.Fatal(err)
					}
				},
				Config:           config1,
				ConfigPlanChecks: tfresource.ConfigPlanChecks{PreApply: []plancheck.PlanCheck{planNoLeak}},
				ConfigStateChecks: []statecheck.StateCheck{
					statecheck.ExpectKnownValue(addr, tfjsonpath.New("credentials"), knownvalue.ListExact([]knownvalue.Check{
						apiState(1), searchState, regState,
					})),
					statecheck.ExpectKnownValue(addr, tfjsonpath.New("credentials").AtSliceIndex(0).AtMapKey("hosts"),
						knownvalue.SetExact([]knownvalue.Check{str("api.example.com")})),
					statecheck.ExpectKnownValue(addr, tfjsonpath.New("destination_ca_bundle"), str(bundle)),
					stateNoLeak,
				},
				Check: tfresource.ComposeTestCheckFunc(
					checkEgressProxy(c, key, func(ep *agentboxv1alpha1.EgressProxy) error {
						want := []agentboxv1alpha1.EgressCredential{
							{Name: "api-token", Hosts: []agentboxv1alpha1.Domain{"api.example.com"}, SecretRef: injectedSecretRef(name, "api-token"),
								Header: &agentboxv1alpha1.EgressCredentialHeader{Name: "Authorization", ValueTemplate: "Bearer {{secret}}"}},
							{Name: "search", Hosts: []agentboxv1alpha1.Domain{"search.example.com"}, SecretRef: injectedSecretRef(name, "search"),
								Header: &agentboxv1alpha1.EgressCredentialHeader{Name: "X-Api-Key"}},
							{Name: "registry", Hosts: []agentboxv1alpha1.Domain{"registry.example.com"},
								SecretRef: agentboxv1alpha1.SecretKeySelector{Name: "registry-creds", Key: "password"},
								BasicAuth: &agentboxv1alpha1.EgressCredentialBasicAuth{Username: "bot"}},
						}
						if !reflect.DeepEqual(ep.Spec.Credentials, want) || ep.Spec.DestinationCABundle != bundle {
							got, _ := json.Marshal(ep.Spec.Credentials)
							return fmt.Errorf("spec.credentials %s, want them in the configuration's order; bundle as configured %v",
								got, ep.Spec.DestinationCABundle == bundle)
						}
						return nil
					}),
					checkInjectedSecret(c, secretKey, name, map[string]string{"api-token": api1, "search": search1}),
					noLeak,
				),
			},
			{
				// A new value under the same version is not applied, and
				// plans nothing: the version is what asks for a write.
				Config:           config(api(api3, 1), search, reg),
				ConfigPlanChecks: tfresource.ConfigPlanChecks{PreApply: []plancheck.PlanCheck{plancheck.ExpectEmptyPlan()}},
				Check:            checkInjectedSecret(c, secretKey, name, map[string]string{"api-token": api1, "search": search1}),
			},
			{
				ResourceName:      addr,
				ImportState:       true,
				ImportStateId:     ns + "/" + name,
				ImportStateVerify: true,
				// Terraform's own settings; and the versions of the
				// write-only values, which only the configuration knows:
				// they import as null (the value itself is null on both
				// sides). The secret_ref credential imports whole.
				ImportStateVerifyIgnore: []string{"wait_for_ready", "timeouts", "credentials.0.value_wo_version", "credentials.1.value_wo_version"},
				ImportStateCheck: func(states []*terraform.InstanceState) error {
					if len(states) != 1 {
						return fmt.Errorf("%d imported states", len(states))
					}
					a := states[0].Attributes
					if a["credentials.0.value_wo_version"] != "" || a["credentials.1.value_wo_version"] != "" ||
						a["credentials.2.secret_ref.name"] != "registry-creds" {
						return fmt.Errorf("imported credentials %v", a)
					}
					return nil
				},
			},
			{
				// Rotation: a new version writes the new value. The other
				// credential's key is left as it was, although its value in
				// the configuration changed: its version did not.
				Config: config(api(api2, 2), searchWith(search2), reg),
				ConfigPlanChecks: tfresource.ConfigPlanChecks{PreApply: []plancheck.PlanCheck{
					plancheck.ExpectResourceAction(addr, plancheck.ResourceActionUpdate), planNoLeak,
				}},
				ConfigStateChecks: []statecheck.StateCheck{
					statecheck.ExpectKnownValue(addr, tfjsonpath.New("credentials"), knownvalue.ListExact([]knownvalue.Check{
						apiState(2), searchState, regState,
					})),
					stateNoLeak,
				},
				Check: tfresource.ComposeTestCheckFunc(
					checkInjectedSecret(c, secretKey, name, map[string]string{"api-token": api2, "search": search1}), noLeak),
			},
			{
				Config:           config(api(api2, 2), searchWith(search2), reg),
				ConfigPlanChecks: tfresource.ConfigPlanChecks{PreApply: []plancheck.PlanCheck{plancheck.ExpectEmptyPlan()}},
			},
			{
				// The owned Secret deleted out of band: the plan shows the
				// versions as changed, the apply writes the Secret again,
				// with the configuration's values.
				PreConfig: func() {
					if err := c.Delete(ctx, &corev1.Secret{ObjectMeta: objectMeta(secretKey)}); err != nil {
						t.Fatal(err)
					}
				},
				Config: config(api(api2, 2), searchWith(search2), reg),
				ConfigPlanChecks: tfresource.ConfigPlanChecks{PreApply: []plancheck.PlanCheck{
					plancheck.ExpectResourceAction(addr, plancheck.ResourceActionUpdate),
					plancheck.ExpectKnownValue(addr, tfjsonpath.New("credentials").AtSliceIndex(0).AtMapKey("value_wo_version"), knownvalue.Int64Exact(2)),
					planNoLeak,
				}},
				ConfigStateChecks: []statecheck.StateCheck{
					statecheck.ExpectKnownValue(addr, tfjsonpath.New("credentials"), knownvalue.ListExact([]knownvalue.Check{
						apiState(2), searchState, regState,
					})),
					stateNoLeak,
				},
				Check: tfresource.ComposeTestCheckFunc(
					checkInjectedSecret(c, secretKey, name, map[string]string{"api-token": api2, "search": search2}), noLeak),
			},
			{
				// A credential dropped: its key goes.
				Config: config(api(api2, 2), reg),
				Check: tfresource.ComposeTestCheckFunc(
					checkInjectedSecret(c, secretKey, name, map[string]string{"api-token": api2}),
					checkEgressProxy(c, key, func(ep *agentboxv1alpha1.EgressProxy) error {
						if len(ep.Spec.Credentials) != 2 {
							return fmt.Errorf("spec.credentials %+v, want api-token and registry", ep.Spec.Credentials)
						}
						return nil
					}),
				),
			},
			{
				// No value_wo left: the Secret goes.
				Config: config(reg),
				Check:  checkSecretGone(c, secretKey),
			},
			{
				// And comes back with one, to go with the proxy on destroy.
				Config: config(api(api2, 2), reg),
				Check:  checkInjectedSecret(c, secretKey, name, map[string]string{"api-token": api2}),
			},
		},
		CheckDestroy: func(*terraform.State) error {
			if err := c.Get(ctx, key, &agentboxv1alpha1.EgressProxy{}); !apierrors.IsNotFound(err) {
				return fmt.Errorf("egress proxy %s after destroy: %v", key, err)
			}
			return checkSecretGone(c, secretKey)(nil)
		},
	})
}

// checkInjectedSecret requires the resource's injected-credentials Secret
// to hold exactly want, owned by the proxy and labelled as the resource's.
func checkInjectedSecret(c client.Client, key types.NamespacedName, proxy string, want map[string]string) tfresource.TestCheckFunc {
	return func(*terraform.State) error {
		var s corev1.Secret
		if err := c.Get(context.Background(), key, &s); err != nil {
			return fmt.Errorf("injected credentials Secret: %w", err)
		}
		got := map[string]string{}
		for k, v := range s.Data {
			got[k] = string(v)
		}
		if !maps.Equal(got, want) {
			// Keys only: the values are secret.
			return fmt.Errorf("Secret %s has keys %v, want %v, or other values than the configuration's",
				key, slices.Sorted(maps.Keys(got)), slices.Sorted(maps.Keys(want)))
		}
		owners := s.GetOwnerReferences()
		if len(owners) != 1 || owners[0].Kind != egressProxyKind || owners[0].Name != proxy || s.Labels[injectedSecretLabel] != proxy {
			return fmt.Errorf("Secret %s: owners %+v, labels %v", key, owners, s.Labels)
		}
		return nil
	}
}

// flatStateLacks looks at every attribute of the state the testing
// framework read back (the shimmed state that Check functions see).
func flatStateLacks(secrets ...string) tfresource.TestCheckFunc {
	return func(s *terraform.State) error {
		for _, m := range s.Modules {
			for addr, r := range m.Resources {
				for k, v := range r.Primary.Attributes {
					for _, sec := range secrets {
						if strings.Contains(v, sec) {
							return fmt.Errorf("state attribute %s.%s holds a secret value", addr, k)
						}
					}
				}
			}
		}
		return nil
	}
}

// rawStateLacks reads the state files Terraform wrote under dir (the
// TF_ACC_TEMP_DIR of the test), byte for byte. control is a string the
// state must hold, so that a state file that is not the test's, or none at
// all, cannot pass.
func rawStateLacks(dir, control string, secrets ...string) tfresource.TestCheckFunc {
	return func(*terraform.State) error {
		found := 0
		err := filepath.WalkDir(dir, func(p string, d fs.DirEntry, err error) error {
			if err != nil {
				return err
			}
			if d.IsDir() && d.Name() == ".terraform" {
				return filepath.SkipDir
			}
			if d.IsDir() || !strings.Contains(d.Name(), ".tfstate") {
				return nil
			}
			b, err := os.ReadFile(p)
			if err != nil {
				return err
			}
			if !bytes.Contains(b, []byte(control)) {
				return nil
			}
			found++
			for _, s := range secrets {
				if bytes.Contains(b, []byte(s)) {
					return fmt.Errorf("the state file %s holds a secret value", p)
				}
			}
			return nil
		})
		if err != nil {
			return err
		}
		if found == 0 {
			return fmt.Errorf("no state file naming %q under %s: the check proves nothing", control, dir)
		}
		return nil
	}
}

// TestAccEgressCredentialsThroughProxy: a credential given by value_wo
// reaches its destination, put in by the proxy, while the sandbox sends
// no such header and Terraform's state never holds the value. The
// platform, a PerAgent proxy, a template and a sandbox are applied with
// the real terraform CLI; the agent fetches, through the Compute API, a
// page from a web server pod the test made, whose CGI script logs the
// header it received (to the pod's log, which the test reads).
//
// Network safety: the only destination is that pod, allowed by its IP as
// in TestAccEgressSandboxThroughProxy.
func TestAccEgressCredentialsThroughProxy(t *testing.T) {
	t.Parallel()
	tag := testAccPlatformImageTag(t)
	c, ns := testAccCluster(t)
	cfg, err := clientcmd.BuildConfigFromFlags("", os.Getenv(testAccKubeconfigEnv))
	if err != nil {
		t.Fatal(err)
	}
	cs, err := kubernetes.NewForConfig(cfg)
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 15*time.Minute)
	defer cancel()

	web := startHeaderEchoPod(ctx, t, c, ns, "echo")
	secret := "sk-live-" + randomSuffix(t)
	const agent = "cred-agent"
	config := testAccProviderConfig() + fmt.Sprintf(`
resource "agentbox_platform" "this" {
  namespace    = %[1]q
  release_name = "acc-egress-creds"
  image_tag    = %[2]q
}

resource "agentbox_egress_proxy" "web" {
  name               = "web"
  namespace          = agentbox_platform.this.namespace
  allowed_domains    = [%[3]q]
  allowed_cidrs      = ["%[3]s/32"]
  runtime_class_name = "gvisor"
  credentials = [{
    name             = "echo-key"
    hosts            = [%[3]q]
    header           = { name = "X-Api-Key" }
    value_wo         = %[4]q
    value_wo_version = 1
  }]
}

resource "agentbox_sandbox_template" "python" {
  name               = "python"
  namespace          = agentbox_platform.this.namespace
  runtime_class_name = "gvisor"
  egress_proxy       = agentbox_egress_proxy.web.name
  workspace = {
    size = "256Mi"
  }
}

resource "agentbox_sandbox" "agent" {
  name      = %[5]q
  namespace = agentbox_platform.this.namespace
  agent_id  = %[5]q
  template  = agentbox_sandbox_template.python.name
}
`, ns, tag, web, secret, agent)

	start := time.Now()
	tfresource.Test(t, tfresource.TestCase{
		ProtoV6ProviderFactories: testAccProtoV6ProviderFactories,
		Steps: []tfresource.TestStep{{
			Config: config,
			ConfigStateChecks: []statecheck.StateCheck{
				statecheck.ExpectKnownValue("agentbox_egress_proxy.web", tfjsonpath.New("status").AtMapKey("ready"), knownvalue.Bool(true)),
				statecheck.ExpectKnownValue("agentbox_egress_proxy.web", tfjsonpath.New("credentials").AtSliceIndex(0).AtMapKey("value_wo_version"),
					knownvalue.Int64Exact(1)),
				stateLacks(secret),
			},
			Check: tfresource.ComposeTestCheckFunc(
				flatStateLacks(secret),
				func(s *terraform.State) error {
					t.Logf("apply (platform, proxy with a credential, template, sandbox running): %s", time.Since(start).Round(time.Millisecond))
					out, err := runEgressAccProbe(ctx, s, agent, "http://"+web+":8080/cgi-bin/echo")
					if err != nil {
						return err
					}
					if got := strings.TrimSpace(out.Body); got != "echo-ok" {
						return fmt.Errorf("the page through the proxy: %q", got)
					}
					// The server logged the header the proxy put in (the
					// sandbox sent none), and the proxy the credential's name
					// but not its value. Logs reach the kubelet a little
					// later, so they are polled.
					var pods corev1.PodList
					if err := c.List(ctx, &pods, client.InNamespace(ns), client.MatchingLabels{agentboxv1alpha1.LabelEgressProxy: "web"}); err != nil {
						return err
					}
					if len(pods.Items) != 1 {
						return fmt.Errorf("%d proxy pods, want the sandbox's one", len(pods.Items))
					}
					var webLogs, proxyLogs []byte
					err = wait.PollUntilContextTimeout(ctx, time.Second, time.Minute, true, func(ctx context.Context) (bool, error) {
						var err error
						if webLogs, err = cs.CoreV1().Pods(ns).GetLogs("echo", &corev1.PodLogOptions{}).DoRaw(ctx); err != nil {
							return false, nil
						}
						proxyLogs, err = cs.CoreV1().Pods(ns).GetLogs(pods.Items[0].Name, &corev1.PodLogOptions{Container: "proxy"}).DoRaw(ctx)
						return err == nil && bytes.Contains(webLogs, []byte("X_API_KEY=")) &&
							bytes.Contains(proxyLogs, []byte(`"credential":"echo-key"`)), nil
					})
					hide := func(b []byte) []byte { return bytes.ReplaceAll(b, []byte(secret), []byte("<secret>")) }
					if err != nil || !bytes.Contains(webLogs, []byte("X_API_KEY="+secret+"\n")) || bytes.Contains(proxyLogs, []byte(secret)) {
						return fmt.Errorf("want the credential in the web server's log and its name alone in the proxy's (%v):\n%s\n%s",
							err, hide(webLogs), hide(proxyLogs))
					}
					return nil
				},
			),
		}},
	})
}

// startHeaderEchoPod runs a busybox web server whose CGI script
// /cgi-bin/echo logs the X-Api-Key header it receives to the pod's log
// and answers "echo-ok", and returns the pod's IP.
func startHeaderEchoPod(ctx context.Context, t *testing.T, c client.Client, ns, name string) string {
	t.Helper()
	script := `#!/bin/sh\necho "X_API_KEY=$HTTP_X_API_KEY" >&2\necho "Content-Type: text/plain"\necho\necho echo-ok\n`
	pod := &corev1.Pod{
		ObjectMeta: metav1.ObjectMeta{Name: name, Namespace: ns, Labels: map[string]string{"app": name}},
		Spec: corev1.PodSpec{
			TerminationGracePeriodSeconds: ptr.To[int64](0),
			Containers: []corev1.Container{{
				Name: "httpd", Image: toolchain.BusyboxImage, ImagePullPolicy: corev1.PullNever,
				Command: []string{"/bin/sh", "-c", "mkdir -p /tmp/www/cgi-bin && printf '" + script + "' > /tmp/www/cgi-bin/echo && " +
					"chmod +x /tmp/www/cgi-bin/echo && exec httpd -f -vv -p 8080 -h /tmp/www"},
			}},
		},
	}
	if err := c.Create(ctx, pod); err != nil {
		t.Fatal(err)
	}
	err := wait.PollUntilContextTimeout(ctx, 500*time.Millisecond, 2*time.Minute, true, func(ctx context.Context) (bool, error) {
		if err := c.Get(ctx, client.ObjectKeyFromObject(pod), pod); err != nil {
			return false, nil
		}
		return pod.Status.Phase == corev1.PodRunning && pod.Status.PodIP != "", nil
	})
	if err != nil {
		t.Fatalf("web server pod %s: %v (phase %s)", name, err, pod.Status.Phase)
	}
	return pod.Status.PodIP
}
