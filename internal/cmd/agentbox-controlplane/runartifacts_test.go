package main

import (
	"io"
	"strings"
	"testing"

	"github.com/agentbox/terraform-provider-agentbox/internal/computeapi"
	"github.com/agentbox/terraform-provider-agentbox/internal/snapshot/archive"
	"github.com/agentbox/terraform-provider-agentbox/internal/snapshot/volumesnapshot"
)

// The chart's computeApi.runArtifacts arrive as variables; the flags win
// over them, and a size that is not a positive quantity is refused. The
// store is the archive driver's, with its prefix; another driver leaves
// none and says why.
func TestRunArtifactOptions(t *testing.T) {
	none := func(string) string { return "" }
	env := func(k string) string {
		if k == "AGENTBOX_RUN_ARTIFACT_MAX_FILE_SIZE" {
			return "10Mi"
		}
		return ""
	}
	if o, err := parseOptions(nil, none, io.Discard); err != nil || o.runArtifacts.MaxFileBytes != computeapi.DefaultRunArtifactMaxFileBytes ||
		o.runArtifacts.MaxRunBytes != computeapi.DefaultRunArtifactMaxRunBytes {
		t.Errorf("default: %+v, %v", o.runArtifacts, err)
	}
	if o, err := parseOptions([]string{"--run-artifact-max-run-size=1G"}, env, io.Discard); err != nil ||
		o.runArtifacts.MaxFileBytes != 10<<20 || o.runArtifacts.MaxRunBytes != 1e9 {
		t.Errorf("from the variable and the flag: %+v, %v", o.runArtifacts, err)
	}
	for _, bad := range []string{"0", "-1Mi", "lots"} {
		if _, err := parseOptions([]string{"--run-artifact-max-file-size=" + bad}, none, io.Discard); err == nil ||
			!strings.Contains(err.Error(), "--run-artifact-max-file-size") {
			t.Errorf("--run-artifact-max-file-size=%s: %v", bad, err)
		}
	}

	d, err := archive.New(archive.Config{Dir: t.TempDir(), Prefix: "/agentbox/"})
	if err != nil {
		t.Fatal(err)
	}
	defer d.Close()
	if o := withStore(computeapi.RunArtifactsOptions{}, d); o.Store == nil || o.Prefix != "agentbox" || o.Unavailable != "" {
		t.Errorf("with the archive driver: %+v", o)
	}
	vs := volumesnapshot.New(nil, volumesnapshot.Options{})
	if o := withStore(computeapi.RunArtifactsOptions{}, vs); o.Store != nil || !strings.Contains(o.Unavailable, "snapshot.driver: archive") {
		t.Errorf("with the volumesnapshot driver: %+v", o)
	}
}
