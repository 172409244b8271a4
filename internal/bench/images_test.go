package bench

import (
	"context"
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"

	"github.com/agentbox/terraform-provider-agentbox/internal/benchreport"
)

// EnvImagesDir is the folder of the OCI archives `make images` and `make
// test-images` wrote; the images benchmark reports their sizes from it.
const EnvImagesDir = "AGENTBOX_BENCH_IMAGES_DIR"

// imagesNamespace holds the images benchmark's templates and pools.
const imagesNamespace = "agentbox-bench-images"

// benchImage is one sandbox image the images benchmark compares.
type benchImage struct {
	key     string // the template and pool names: cold-<key>, warm-<key>
	label   string // how the figures name it
	ref     string // the template's image; empty for the platform's default
	archive string // its archive under EnvImagesDir
}

// benchImages are the platform's two images and one that nobody here
// wrote (a plain Debian with Python, whose user is root and whose command
// is its own), measured side by side.
func benchImages(tag string) []benchImage {
	return []benchImage{
		{key: "standard", label: "standard image", archive: "agentbox-sandbox.tar"},
		{key: "minimal", label: "minimal image", ref: "agentbox/agentbox-sandbox-minimal:" + tag, archive: "agentbox-sandbox-minimal.tar"},
		{key: "debian-python", label: "brought image (Debian with Python)", ref: "agentbox-test/debian-python:" + tag, archive: "test-debian-python.tar"},
	}
}

// imagesConfig declares, per image, a template no pool serves and a
// template with a warm pool of one.
func imagesConfig(images []benchImage) string {
	var b strings.Builder
	b.WriteString(configHeader)
	for _, im := range images {
		image := ""
		if im.ref != "" {
			image = fmt.Sprintf("image = %q", im.ref)
		}
		for _, kind := range []string{"cold", "warm"} {
			fmt.Fprintf(&b, `
resource "agentbox_sandbox_template" "%[1]s_%[2]s" {
  name               = "%[1]s-%[3]s"
  namespace          = %[4]q
  runtime_class_name = "gvisor"
  %[5]s
  resources = {
    requests = { cpu = "10m", memory = "64Mi" }
    limits   = { memory = "256Mi" }
  }
  workspace = { size = "64Mi" }
}
`, kind, strings.ReplaceAll(im.key, "-", "_"), im.key, imagesNamespace, image)
		}
		fmt.Fprintf(&b, `
resource "agentbox_warm_pool" %[1]q {
  name      = "warm-%[2]s"
  namespace = %[3]q
  template  = agentbox_sandbox_template.warm_%[1]s.name
  replicas  = 1
  timeouts  = { create = "10m" }
}
`, strings.ReplaceAll(im.key, "-", "_"), im.key, imagesNamespace)
	}
	return b.String()
}

// TestBenchSandboxImages measures, for the standard image, the minimal one
// and a brought image, a cold start (create to first output) and a
// warm-pool claim (lease to first output). The images take turns within
// each round so that every one sees the same node.
func TestBenchSandboxImages(t *testing.T) {
	p := platform(t)
	ctx := t.Context()
	ns := &corev1.Namespace{ObjectMeta: metav1.ObjectMeta{Name: imagesNamespace}}
	if err := p.kube.Create(ctx, ns); err != nil && !apierrors.IsAlreadyExists(err) {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = p.kube.Delete(context.Background(), ns) })
	images := benchImages(p.imageTag)
	dir := p.workspace(t, imagesConfig(images))
	if err := p.tf.exec(dir, p.applyArgs()...); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		if err := p.tf.exec(dir, p.destroyArgs()...); err != nil {
			t.Errorf("destroying the images benchmark's templates: %v", err)
		}
	})
	api := p.admin(t)

	const rounds = 5
	benches := make([]*apiBench, len(images))
	for i, im := range images {
		benches[i] = &apiBench{p: p, api: api, dir: dir, ns: imagesNamespace, pool: "warm-" + im.key}
	}
	// settle waits, untimed, until every pool is whole again and nothing
	// is tearing down: a replacement starting for the image measured
	// before would otherwise share the node with the one measured now.
	settle := func() {
		for _, b := range benches {
			b.waitClaimable(t, 1)
		}
		benches[0].waitQuiet(t)
	}
	// The first sandbox of an image on a node also unpacks the image: it
	// is reported beside the figures, which are of later starts.
	first := make([]time.Duration, len(images))
	for i, im := range images {
		settle()
		first[i] = benches[i].createToFirstOutput(t, "cold-"+im.key)
	}
	cold := make([][]time.Duration, len(images))
	claim := make([][]time.Duration, len(images))
	for r := range rounds {
		for i, im := range images {
			b := benches[i]
			settle()
			cold[i] = append(cold[i], b.createToFirstOutput(t, "cold-"+im.key))
			settle()
			l, start, err := b.acquire(ctx)
			if err != nil {
				t.Fatalf("round %d, %s: claim: %v", r, im.label, err)
			}
			if _, err := b.echoTimed(ctx, l.AgentID); err != nil {
				t.Fatalf("round %d, %s: first command: %v", r, im.label, err)
			}
			claim[i] = append(claim[i], time.Since(start))
			b.release(t, l)
		}
	}
	for i, im := range images {
		size := archiveSize(im.archive)
		coldS := benchreport.Millis(cold[i])
		for j := range coldS {
			coldS[j] /= 1000
		}
		benchreport.Record(t, benchreport.Figure{
			Name: "cold create to first output, " + im.label, Unit: "s", Values: coldS,
			Note: fmt.Sprintf("%s; Sandbox created through the Kubernetes API, echo through the Compute API polled every 25 ms; the images take turns, %d rounds; "+
				"the image's first sandbox on the node (which unpacks it) took %.1f s", size, rounds, first[i].Seconds()),
		})
		benchreport.Record(t, benchreport.Figure{
			Name: "warm claim to first output, " + im.label, Unit: "ms", Values: benchreport.Millis(claim[i]),
			Note: fmt.Sprintf("%s; pool lease then echo through the API, on a pool of one ready sandbox", size),
		})
	}
}

// archiveSize describes the size of an image's OCI archive, or says why it
// cannot.
func archiveSize(name string) string {
	dir := os.Getenv(EnvImagesDir)
	if dir == "" {
		return "archive size unknown (" + EnvImagesDir + " is not set)"
	}
	fi, err := os.Stat(filepath.Join(dir, name))
	if err != nil {
		return "archive size unknown: " + err.Error()
	}
	return fmt.Sprintf("archive %.1f MB", float64(fi.Size())/1e6)
}
