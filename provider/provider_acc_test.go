package provider

import (
	"context"
	"fmt"
	"os"
	"slices"
	"testing"
	"time"

	"github.com/hashicorp/terraform-plugin-framework/providerserver"
	"github.com/hashicorp/terraform-plugin-go/tfprotov6"
	"github.com/hashicorp/terraform-plugin-go/tftypes"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
)

// testAccKubeconfigEnv names the kubeconfig of the cluster the test harness
// started; acceptance tests never fall back to the developer's own cluster.
const testAccKubeconfigEnv = "AGENTBOX_TEST_KUBECONFIG"

var testAccProtoV6ProviderFactories = map[string]func() (tfprotov6.ProviderServer, error){
	"agentbox": providerserver.NewProtocol6WithError(New("test")()),
}

// testAccPreCheck fails rather than skips a requested acceptance run without
// a cluster, so that CI cannot pass by testing nothing.
func testAccPreCheck(t *testing.T) {
	t.Helper()
	if os.Getenv("TF_ACC") == "" {
		t.Skip("acceptance test: set TF_ACC=1 and " + testAccKubeconfigEnv)
	}
	if os.Getenv(testAccKubeconfigEnv) == "" {
		t.Fatal("TF_ACC is set but " + testAccKubeconfigEnv + " (the test cluster's kubeconfig) is not")
	}
}

// testAccProviderConfig points the provider at the test cluster. Tests put it
// in front of their own configuration.
func testAccProviderConfig() string {
	return fmt.Sprintf("provider \"agentbox\" {\n  kubernetes = {\n    config_path = %q\n  }\n}\n",
		os.Getenv(testAccKubeconfigEnv))
}

func TestAccProvider_connects(t *testing.T) {
	testAccPreCheck(t)
	resp := configure(t, testConfig(t, map[string]tftypes.Value{"config_path": str(os.Getenv(testAccKubeconfigEnv))}, nil), true)
	if resp.Diagnostics.HasError() || resp.Deferred != nil {
		t.Fatalf("diagnostics %v, deferred %v", resp.Diagnostics, resp.Deferred)
	}
	clients, err := providerDataFrom(resp.ResourceData, &resp.Diagnostics).Clients()
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	list, err := clients.Kubernetes.CoreV1().Namespaces().List(ctx, metav1.ListOptions{})
	if err != nil {
		t.Fatal(err)
	}
	names := make([]string, 0, len(list.Items))
	for _, ns := range list.Items {
		names = append(names, ns.Name)
	}
	if !slices.Contains(names, "default") {
		t.Errorf("namespaces %v lack \"default\"", names)
	}
}
