package provider

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"os"
	"path/filepath"
	"runtime"
	"sync"
	"testing"
	"time"

	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/client-go/tools/clientcmd"
	"sigs.k8s.io/controller-runtime/pkg/client"

	"github.com/agentbox/terraform-provider-agentbox/internal/testenv"
	"github.com/agentbox/terraform-provider-agentbox/internal/testenv/kwok"
)

var crdsOnce sync.Once
var crdsErr error

// Which tests call t.Parallel. Go runs the serial tests first, one at a
// time, and then the parallel ones side by side. Parallel: the tests that
// install a platform in their own namespace (platforms that share a
// cluster leave each other's namespaces alone), and the tests that install
// none, whose objects a platform tells NamespaceNotServed only once no
// controller has reported on them for a grace of 10 seconds. Serial: the
// tests that touch what is cluster-wide (node pools and the node, which
// every platform's node pool controller acts on), the quickstart (it sets
// the provider namespace with t.Setenv), and those that check a status
// nothing writes for longer than that grace.

// testAccCluster prepares the shared test cluster for a resource test: the
// agentbox CRDs installed, and a fresh namespace removed afterwards. It
// returns a client for out-of-band changes and the namespace.
func testAccCluster(t *testing.T) (client.Client, string) {
	t.Helper()
	testAccPreCheck(t)
	cfg, err := clientcmd.BuildConfigFromFlags("", os.Getenv(testAccKubeconfigEnv))
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	crdsOnce.Do(func() {
		_, file, _, _ := runtime.Caller(0)
		crdsErr = testenv.ApplyCRDs(ctx, cfg, filepath.Join(filepath.Dir(file), "..", "charts", "agentbox", "crds", "*.yaml"))
	})
	if crdsErr != nil {
		t.Fatal(crdsErr)
	}
	c, err := newObjectClient(cfg)
	if err != nil {
		t.Fatal(err)
	}
	b := make([]byte, 3)
	_, _ = rand.Read(b)
	ns := "acc-" + hex.EncodeToString(b)
	if err := c.Create(ctx, &corev1.Namespace{ObjectMeta: metav1.ObjectMeta{Name: ns}}); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		_ = c.Delete(context.Background(), &corev1.Namespace{ObjectMeta: metav1.ObjectMeta{Name: ns}})
	})
	return c, ns
}

// testAccRealNode is the test cluster's one real node. Tests of other
// packages add simulated (kwok) nodes to the same cluster while the
// provider's tests run, so those are left out: they run no pods, and a
// node pool on one would never become Ready.
func testAccRealNode(t *testing.T, c client.Client) corev1.Node {
	t.Helper()
	var nodes corev1.NodeList
	if err := c.List(context.Background(), &nodes); err != nil {
		t.Fatal(err)
	}
	var real []corev1.Node
	for _, n := range nodes.Items {
		if n.Annotations[kwok.ManageAnnotation] != kwok.ManageAnnotationValue {
			real = append(real, n)
		}
	}
	if len(real) != 1 {
		t.Fatalf("%d real nodes (of %d); the test needs the test cluster's one node", len(real), len(nodes.Items))
	}
	return real[0]
}

// testAccPlatformImageTag is the tag of the platform images imported into
// the test node, for tests that install the platform and run its pods. It
// skips without one, except in CI, where `make test` always sets it.
func testAccPlatformImageTag(t *testing.T) string {
	t.Helper()
	tag := os.Getenv(testAccImageTagEnv)
	if tag == "" {
		if os.Getenv("CI") != "" && os.Getenv("TF_ACC") != "" {
			t.Fatalf("%s is not set: `make test` builds and imports the platform images", testAccImageTagEnv)
		}
		t.Skipf("needs the platform images on the test node: run `make test` (sets %s)", testAccImageTagEnv)
	}
	return tag
}
