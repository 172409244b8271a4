package main

import (
	"cmp"
	"flag"
	"fmt"

	"k8s.io/apimachinery/pkg/api/resource"

	"github.com/agentbox/terraform-provider-agentbox/internal/computeapi"
	"github.com/agentbox/terraform-provider-agentbox/internal/snapshot"
	"github.com/agentbox/terraform-provider-agentbox/internal/snapshot/archive"
)

// runArtifactFlags bound the runs' artifacts. Where they go is not a
// setting of their own: the archive snapshot driver's object store, the
// platform's one.
type runArtifactFlags struct {
	maxFile, maxRun *string
}

func registerRunArtifactFlags(fs *flag.FlagSet, getenv func(string) string) *runArtifactFlags {
	return &runArtifactFlags{
		maxFile: fs.String("run-artifact-max-file-size",
			cmp.Or(getenv("AGENTBOX_RUN_ARTIFACT_MAX_FILE_SIZE"), resource.NewQuantity(computeapi.DefaultRunArtifactMaxFileBytes, resource.BinarySI).String()),
			"largest file a run keeps as an artifact, as a quantity such as 1Gi; a larger one is recorded as not kept [AGENTBOX_RUN_ARTIFACT_MAX_FILE_SIZE]"),
		maxRun: fs.String("run-artifact-max-run-size",
			cmp.Or(getenv("AGENTBOX_RUN_ARTIFACT_MAX_RUN_SIZE"), resource.NewQuantity(computeapi.DefaultRunArtifactMaxRunBytes, resource.BinarySI).String()),
			"most a run keeps as artifacts in all, as a quantity such as 4Gi; files past it are recorded as not kept [AGENTBOX_RUN_ARTIFACT_MAX_RUN_SIZE]"),
	}
}

// limits parses the flags into the API's options, without the store.
func (f *runArtifactFlags) limits() (computeapi.RunArtifactsOptions, error) {
	var o computeapi.RunArtifactsOptions
	for _, l := range []struct {
		name string
		v    string
		dst  *int64
	}{{"--run-artifact-max-file-size", *f.maxFile, &o.MaxFileBytes}, {"--run-artifact-max-run-size", *f.maxRun, &o.MaxRunBytes}} {
		q, err := resource.ParseQuantity(l.v)
		if err != nil || q.Sign() <= 0 {
			return o, fmt.Errorf("%s %q: want a positive quantity of bytes, such as 512Mi or 2Gi", l.name, l.v)
		}
		*l.dst = q.Value()
	}
	return o, nil
}

// withStore completes o with the object store of the snapshot driver,
// when it has one, or says why there is none.
func withStore(o computeapi.RunArtifactsOptions, d snapshot.Driver) computeapi.RunArtifactsOptions {
	if a, ok := d.(*archive.Driver); ok {
		o.Store, o.Prefix = a.ObjectStore(), a.Prefix()
		return o
	}
	o.Unavailable = fmt.Sprintf("the platform keeps no run artifacts: they go to the archive snapshot driver's object store, "+
		"and the snapshot driver is %q (set snapshot.driver: archive)", snapshot.ID(d))
	return o
}
