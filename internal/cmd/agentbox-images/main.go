// Command agentbox-images builds agentbox's container images as OCI
// archives, without Docker:
//
//	agentbox-images -out DIR -tag TAG [-only controlplane,sandbox,egress-proxy]
//
// It writes DIR/agentbox-controlplane.tar, DIR/agentbox-sandbox.tar and
// DIR/agentbox-egress-proxy.tar, named docker.io/agentbox/<name>:TAG, ready
// for `ctr -n k8s.io images import` or `agentbox-testenv import`. Run it
// from the repository root. The sandbox image is made from Debian packages
// fetched with the host's apt, so it needs a Debian or Ubuntu host with apt
// lists in place (`apt-get update`); run as root to check the result with
// chroot and to give files their owners.
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
	var only, packages, exclude string
	flag.StringVar(&o.OutDir, "out", "", "folder to write the image archives into (required)")
	flag.StringVar(&o.Tag, "tag", "", "image tag, also the binaries' version (required)")
	flag.StringVar(&only, "only", "", "comma-separated images to build: "+strings.Join(imagebuild.All, ",")+" (the default), "+strings.Join(imagebuild.OnRequest, ","))
	flag.StringVar(&o.ModuleDir, "C", ".", "repository root to build the commands from")
	flag.StringVar(&o.Go, "go", "go", "go command")
	flag.StringVar(&packages, "sandbox-packages", strings.Join(imagebuild.DefaultSandboxPackages, ","), "Debian packages of the sandbox image (their dependencies are added)")
	flag.StringVar(&exclude, "sandbox-exclude", strings.Join(imagebuild.DefaultSandboxExclude, ","), "Debian packages left out of the sandbox image with what only they need")
	flag.StringVar(&o.Sandbox.CacheDir, "deb-cache", "", "folder caching downloaded .debs (default: the user cache folder's agentbox/debs)")
	// The toolchain's gVisor is the one the test node runs, so the image
	// installs exactly what the tests have run.
	var runscDir string
	if d, err := toolchain.DefaultDir(); err == nil {
		runscDir = toolchain.BinDir(d)
	}
	flag.StringVar(&o.RunscDir, "runsc-dir", runscDir, "folder holding runsc and containerd-shim-runsc-v1 for the runsc-installer image")
	flag.Parse()
	if o.OutDir == "" || o.Tag == "" || flag.NArg() > 0 {
		fmt.Fprintln(os.Stderr, "usage: agentbox-images -out DIR -tag TAG [-only "+strings.Join(imagebuild.All, ",")+"]")
		os.Exit(2)
	}
	o.Only = split(only)
	o.Sandbox.Packages = split(packages)
	o.Sandbox.Exclude = split(exclude)
	if o.Sandbox.Exclude == nil {
		// An empty -sandbox-exclude means "exclude nothing", not "defaults".
		o.Sandbox.Exclude = []string{}
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
