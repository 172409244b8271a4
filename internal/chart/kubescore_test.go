package chart

import (
	"bytes"
	"encoding/json"
	"errors"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"

	"sigs.k8s.io/yaml"
)

// kubeScoreVariants are the renders kube-score checks: the default
// install, a highly available one (two replicas on PostgreSQL, so leader
// election, the PodDisruptionBudget and the pod anti-affinity are on), and
// one with the runsc installer.
var kubeScoreVariants = map[string]string{
	"default": "",
	"ha": "replicaCount: 2\nstore: {dsn: 'postgres://agentbox@db.invalid/agentbox'}\n" +
		"snapshot: {archive: {endpoint: 'https://s3.invalid', bucket: agentbox, credentialsSecret: agentbox-s3}}\n",
	"runsc-installer": "runscInstaller: {enabled: true}\n",
}

// kubeScoreReviewed is a CRITICAL kube-score finding kept on purpose.
type kubeScoreReviewed struct {
	// Object is "<kind>/<name>".
	Object    string `json:"object"`
	Check     string `json:"check"`
	Container string `json:"container"`
	Summary   string `json:"summary"`
	Reason    string `json:"reason"`
}

type kubeScoreObject struct {
	TypeMeta   struct{ Kind string } `json:"type_meta"`
	ObjectMeta struct{ Name string } `json:"object_meta"`
	Checks     []struct {
		Check struct {
			ID string `json:"id"`
		} `json:"check"`
		Grade    int  `json:"grade"`
		Skipped  bool `json:"skipped"`
		Comments []struct {
			Path    string `json:"path"`
			Summary string `json:"summary"`
		} `json:"comments"`
	} `json:"checks"`
}

// kubeScoreCritical is kube-score's grade for a CRITICAL finding.
const kubeScoreCritical = 1

// TestKubeScore runs kube-score on the chart's renders: every CRITICAL
// finding must be fixed in the chart or be on the reviewed list
// (testdata/kube-score-reviewed.yaml) with its reason, and every entry on
// that list must still be found, so the list never outlives its reason.
// `make lint-chart` builds kube-score and runs this with
// AGENTBOX_KUBE_SCORE set; without it the test skips.
func TestKubeScore(t *testing.T) {
	bin := os.Getenv("AGENTBOX_KUBE_SCORE")
	if bin == "" {
		t.Skip("AGENTBOX_KUBE_SCORE is not set: run `make lint-chart`, which builds kube-score")
	}
	raw, err := os.ReadFile(filepath.Join("testdata", "kube-score-reviewed.yaml"))
	if err != nil {
		t.Fatal(err)
	}
	var reviewed []kubeScoreReviewed
	if err := yaml.UnmarshalStrict(raw, &reviewed); err != nil {
		t.Fatalf("kube-score-reviewed.yaml: %v", err)
	}
	used := make([]bool, len(reviewed))
	for i, r := range reviewed {
		if r.Object == "" || r.Check == "" || r.Summary == "" || strings.TrimSpace(r.Reason) == "" {
			t.Errorf("reviewed entry %d %+v: object, check, summary and reason are required", i, r)
		}
	}

	dir := t.TempDir()
	for variant, values := range kubeScoreVariants {
		rel, err := RenderInstall(testNamespace, DefaultReleaseName, Values{Raw: values})
		if err != nil {
			t.Fatalf("%s: %v", variant, err)
		}
		file := filepath.Join(dir, variant+".yaml")
		if err := os.WriteFile(file, []byte(rel.Manifest), 0o600); err != nil {
			t.Fatal(err)
		}
		var stdout, stderr bytes.Buffer
		cmd := exec.Command(bin, "score", "--output-format", "json", file)
		cmd.Stdout, cmd.Stderr = &stdout, &stderr
		// kube-score exits 1 when it finds anything CRITICAL; the
		// findings are judged below.
		if err := cmd.Run(); err != nil {
			if ee := (*exec.ExitError)(nil); !errors.As(err, &ee) || ee.ExitCode() != 1 {
				t.Fatalf("%s: kube-score: %v: %s", variant, err, stderr.Bytes())
			}
		}
		var objects []kubeScoreObject
		if err := json.Unmarshal(stdout.Bytes(), &objects); err != nil {
			t.Fatalf("%s: kube-score output: %v: %s", variant, err, stderr.Bytes())
		}
		if len(objects) == 0 {
			t.Fatalf("%s: kube-score scored no objects", variant)
		}
		for _, o := range objects {
			object := o.TypeMeta.Kind + "/" + o.ObjectMeta.Name
			for _, c := range o.Checks {
				if c.Skipped || c.Grade != kubeScoreCritical {
					continue
				}
				for _, m := range c.Comments {
					found := false
					for i, r := range reviewed {
						if r.Object == object && r.Check == c.Check.ID && r.Container == m.Path && r.Summary == m.Summary {
							used[i], found = true, true
						}
					}
					if !found {
						t.Errorf("%s: CRITICAL %s %s (container %q): %s; fix the chart or review it in testdata/kube-score-reviewed.yaml",
							variant, object, c.Check.ID, m.Path, m.Summary)
					}
				}
			}
		}
	}
	for i, r := range reviewed {
		if !used[i] {
			t.Errorf("reviewed entry %s %s (container %q) %q: kube-score no longer reports it; remove it", r.Object, r.Check, r.Container, r.Summary)
		}
	}
}
