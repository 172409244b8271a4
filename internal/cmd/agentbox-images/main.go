// Command agentbox-images builds agentbox's container images as OCI
// archives, without Docker:
//
//	agentbox-images -out DIR -tag TAG [-only controlplane,egress-proxy,supervisor,sandbox,sandbox-minimal]
//	agentbox-images -out DIR [-tag TAG] -spec my-image.json [-spec ...]
//
// The first form writes DIR/agentbox-<name>.tar for each image, named
// docker.io/agentbox/agentbox-<name>:TAG, ready for `ctr -n k8s.io images
// import` or `agentbox-testenv import`; run it from the repository root. The
// sandbox images are made from Debian packages fetched with the host's apt,
// so they need a Debian or Ubuntu host with apt lists in place (`apt-get
// update`); run as root to check the result with chroot and to give files
// their owners.
//
// The second form builds images from JSON specs (see internal/imagebuild's
// Spec and the images guide): each spec file NAME.json becomes DIR/NAME.tar,
// named by the spec's ref (with TAG when the ref has none). -only and -spec
// combine.
//
// -only runsc-installer builds the image of the chart's runsc installer
// (DIR/agentbox-runsc-installer.tar), which is not built by default: it
// holds the runsc and containerd-shim-runsc-v1 that `agentbox-testenv
// build` (make testenv) compiles, read from -runsc-dir.
package main

import (
	"context"
	"flag"
	"fmt"
	"os"
	"os/signal"
	"strings"
	"syscall"

	"github.com/agentbox/terraform-provider-agentbox/internal/imagebuild"
	"github.com/agentbox/terraform-provider-agentbox/internal/testenv/toolchain"
)

func main() {
	var o imagebuild.Options
	var only string
	var specs []string
	flag.StringVar(&o.OutDir, "out", "", "folder to write the image archives into (required)")
	flag.StringVar(&o.Tag, "tag", "", "image tag, also the binaries' version (required for the built-in images)")
	flag.StringVar(&only, "only", "", "comma-separated images to build: "+strings.Join(imagebuild.All, ",")+" (the default without -spec), "+strings.Join(imagebuild.OnRequest, ","))
	flag.Func("spec", "JSON file describing an image to build from Debian packages (repeatable); NAME.json is written to NAME.tar", func(s string) error {
		specs = append(specs, s)
		return nil
	})
	flag.StringVar(&o.ModuleDir, "C", ".", "repository root to build the commands from")
	flag.StringVar(&o.Go, "go", "go", "go command")
	flag.StringVar(&o.DebCache, "deb-cache", "", "folder caching downloaded .debs (default: the user cache folder's agentbox/debs)")
	// The toolchain's gVisor is the one the test node runs, so the image
	// installs exactly what the tests have run.
	var runscDir string
	if d, err := toolchain.DefaultDir(); err == nil {
		runscDir = toolchain.BinDir(d)
	}
	flag.StringVar(&o.RunscDir, "runsc-dir", runscDir, "folder holding runsc and containerd-shim-runsc-v1 for the runsc-installer image")
	flag.Parse()
	if o.OutDir == "" || (o.Tag == "" && len(specs) == 0) || flag.NArg() > 0 {
		fmt.Fprintln(os.Stderr, "usage: agentbox-images -out DIR -tag TAG [-only "+strings.Join(imagebuild.All, ",")+"] [-spec FILE.json ...]")
		os.Exit(2)
	}
	o.Only = split(only)
	// Every spec is read and checked before anything is built.
	for _, f := range specs {
		s, err := imagebuild.LoadSpec(f)
		if err != nil {
			fmt.Fprintln(os.Stderr, "agentbox-images:", err)
			os.Exit(2)
		}
		o.Specs = append(o.Specs, s)
	}
	o.Out = os.Stdout

	ctx, stop := signal.NotifyContext(context.Background(), syscall.SIGINT, syscall.SIGTERM)
	defer stop()
	if _, err := imagebuild.Build(ctx, o); err != nil {
		fmt.Fprintln(os.Stderr, "agentbox-images:", err)
		os.Exit(1)
	}
}

func split(s string) []string {
	var out []string
	for _, f := range strings.Split(s, ",") {
		if f = strings.TrimSpace(f); f != "" {
			out = append(out, f)
		}
	}
	return out
}
