package provider

import (
	"context"
	"fmt"
	"os"
	"path/filepath"
	"testing"

	"github.com/hashicorp/terraform-plugin-testing/helper/resource"
	"github.com/hashicorp/terraform-plugin-testing/knownvalue"
	"github.com/hashicorp/terraform-plugin-testing/plancheck"
	"github.com/hashicorp/terraform-plugin-testing/statecheck"
	"github.com/hashicorp/terraform-plugin-testing/terraform"
	"github.com/hashicorp/terraform-plugin-testing/tfjsonpath"
	corev1 "k8s.io/api/core/v1"
	apiextensionsv1 "k8s.io/apiextensions-apiserver/pkg/apis/apiextensions/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/runtime"
	k8stypes "k8s.io/apimachinery/pkg/types"
	clientgoscheme "k8s.io/client-go/kubernetes/scheme"
	"sigs.k8s.io/controller-runtime/pkg/client"
	"sigs.k8s.io/controller-runtime/pkg/envtest"

	agentboxv1alpha1 "github.com/agentbox/terraform-provider-agentbox/internal/api/v1alpha1"
	"github.com/agentbox/terraform-provider-agentbox/internal/testenv"
)

// TestAccOneApplyFromNothing applies the platform and a sandbox template in
// one `terraform apply` against a fresh kube-apiserver that has never seen
// agentbox: no CRD exists when the plan is made, and the template is
// created, by the same provider process, right after the platform's Helm
// install created its CRD. The shared test cluster cannot show this, since
// the acceptance tests put the CRDs there first. There is no node (envtest:
// etcd and kube-apiserver only), so the platform does not wait for its
// pods.
func TestAccOneApplyFromNothing(t *testing.T) {
	t.Parallel()
	testAccPreCheck(t)
	env := &envtest.Environment{BinaryAssetsDirectory: testenv.EnvtestAssets(t)}
	cfg, err := env.Start()
	if err != nil {
		t.Fatalf("start envtest: %v", err)
	}
	t.Cleanup(func() { _ = env.Stop() })
	user, err := env.AddUser(envtest.User{Name: "admin", Groups: []string{"system:masters"}}, nil)
	if err != nil {
		t.Fatal(err)
	}
	kubeconfig, err := user.KubeConfig()
	if err != nil {
		t.Fatal(err)
	}
	path := filepath.Join(t.TempDir(), "kubeconfig")
	if err := os.WriteFile(path, kubeconfig, 0o600); err != nil {
		t.Fatal(err)
	}
	scheme := runtime.NewScheme()
	for _, add := range []func(*runtime.Scheme) error{clientgoscheme.AddToScheme, apiextensionsv1.AddToScheme, agentboxv1alpha1.AddToScheme} {
		if err := add(scheme); err != nil {
			t.Fatal(err)
		}
	}
	c, err := client.New(cfg, client.Options{Scheme: scheme})
	if err != nil {
		t.Fatal(err)
	}
	ctx := context.Background()
	const ns = "agentbox"
	if err := c.Create(ctx, &corev1.Namespace{ObjectMeta: metav1.ObjectMeta{Name: ns}}); err != nil {
		t.Fatal(err)
	}
	crd := "sandboxtemplates." + agentboxv1alpha1.GroupVersion.Group
	if err := c.Get(ctx, k8stypes.NamespacedName{Name: crd}, &apiextensionsv1.CustomResourceDefinition{}); !apierrors.IsNotFound(err) {
		t.Fatalf("CRD %s before the apply: %v; the test needs a cluster without agentbox", crd, err)
	}

	config := fmt.Sprintf(`
provider "agentbox" {
  kubernetes = {
    config_path = %q
  }
}

resource "agentbox_platform" "this" {
  namespace         = %q
  image_tag         = "absent"
  image_pull_policy = "Never"
  wait              = false
}

resource "agentbox_sandbox_template" "python" {
  name      = "python"
  namespace = agentbox_platform.this.namespace
  image     = "example.invalid/python:3.12"
}
`, path, ns)
	resource.Test(t, resource.TestCase{
		ProtoV6ProviderFactories: testAccProtoV6ProviderFactories,
		Steps: []resource.TestStep{
			{
				Config: config,
				ConfigPlanChecks: resource.ConfigPlanChecks{PreApply: []plancheck.PlanCheck{
					plancheck.ExpectResourceAction("agentbox_platform.this", plancheck.ResourceActionCreate),
					plancheck.ExpectResourceAction("agentbox_sandbox_template.python", plancheck.ResourceActionCreate),
				}},
				ConfigStateChecks: []statecheck.StateCheck{
					statecheck.ExpectKnownValue("agentbox_platform.this", tfjsonpath.New("status"), knownvalue.StringExact("deployed")),
					statecheck.ExpectKnownValue("agentbox_sandbox_template.python", tfjsonpath.New("id"), knownvalue.StringExact(ns+"/python")),
				},
				Check: func(*terraform.State) error {
					var tpl agentboxv1alpha1.SandboxTemplate
					if err := c.Get(ctx, k8stypes.NamespacedName{Namespace: ns, Name: "python"}, &tpl); err != nil {
						return fmt.Errorf("template after the apply: %w", err)
					}
					return nil
				},
			},
			{
				Config:           config,
				ConfigPlanChecks: resource.ConfigPlanChecks{PreApply: []plancheck.PlanCheck{plancheck.ExpectEmptyPlan()}},
			},
		},
	})
}
