// Command agentbox-testenv builds and runs the real local cluster that the
// tests and the quickstart use.
//
//	agentbox-testenv build [-cluster-only]
//	                                  build the toolchain into the cache (make testenv);
//	                                  -cluster-only leaves out what only tests start
//	agentbox-testenv up [-node] [-netpol]
//	                                  start a cluster; print its kubeconfig path;
//	                                  -netpol enforces NetworkPolicies on the node
//	agentbox-testenv import FILE...   import OCI archives into the running node
//	agentbox-testenv exec [-node] [-netpol] -- CMD...
//	                                  run CMD with a cluster up (its kubeconfig in
//	                                  AGENTBOX_TEST_KUBECONFIG), then tear it down
//	agentbox-testenv down             stop it and undo every host change
//	agentbox-testenv dir              print the cache directory
package main

import (
	"context"
	"flag"
	"fmt"
	"os"
	"os/exec"
	"os/signal"
	"syscall"
	"time"

	"github.com/agentbox/terraform-provider-agentbox/internal/testenv"
	"github.com/agentbox/terraform-provider-agentbox/internal/testenv/toolchain"
)

func main() {
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	defer stop()
	if err := run(ctx, os.Args[1:]); err != nil {
		fmt.Fprintf(os.Stderr, "agentbox-testenv: %v\n", err)
		os.Exit(1)
	}
}

const usage = "usage: agentbox-testenv build [-cluster-only]|up [-node] [-netpol] [-reuse] [-image FILE]...|exec [-node] [-netpol] [-image FILE]... -- CMD...|import FILE...|down|dir"

type files []string

func (f *files) String() string     { return fmt.Sprint(*f) }
func (f *files) Set(s string) error { *f = append(*f, s); return nil }

func run(ctx context.Context, args []string) error {
	if len(args) == 0 {
		return fmt.Errorf(usage)
	}
	dir, err := toolchain.DefaultDir()
	if err != nil {
		return err
	}
	switch args[0] {
	case "build":
		return buildCommand(ctx, dir, args[1:])
	case "up":
		return upCommand(ctx, dir, args[1:])
	case "exec":
		return execCommand(ctx, dir, args[1:])
	case "import":
		c, err := testenv.Attach(dir, os.Stderr)
		if err != nil {
			return err
		}
		return c.ImportImages(ctx, args[1:]...)
	case "down":
		return testenv.StopDir(ctx, dir, os.Stderr)
	case "dir":
		fmt.Println(dir)
		return nil
	default:
		return fmt.Errorf("unknown command %q; %s", args[0], usage)
	}
}

// buildCommand: agentbox-testenv build.
func buildCommand(ctx context.Context, dir string, args []string) error {
	fs := flag.NewFlagSet("build", flag.ExitOnError)
	skipPkgs := fs.Bool("skip-packages", false, "do not install missing Debian packages")
	clusterOnly := fs.Bool("cluster-only", false, "build what a cluster runs (the quickstart's needs), not the servers only tests start")
	spikes := fs.Bool("spikes", false, "also build what only the research spikes use (the restoring runsc shim)")
	_ = fs.Parse(args)
	b := &toolchain.Builder{Dir: dir, Out: os.Stdout, SkipPackages: *skipPkgs, ClusterOnly: *clusterOnly, Spikes: *spikes}
	return b.Build(ctx)
}

const netpolUsage = "enforce NetworkPolicies on the node (kube-router's firewall; needs -node and a full build)"

// upCommand: agentbox-testenv up, which prints the kubeconfig's path.
func upCommand(ctx context.Context, dir string, args []string) error {
	fs := flag.NewFlagSet("up", flag.ExitOnError)
	node := fs.Bool("node", false, "start a real node (containerd, kubelet, kube-proxy, gVisor)")
	netpol := fs.Bool("netpol", false, netpolUsage)
	reuse := fs.Bool("reuse", false, "if a cluster is already running, import the images into it instead of failing")
	var images files
	fs.Var(&images, "image", "OCI archive to import into the node (repeatable)")
	_ = fs.Parse(args)
	if *reuse {
		if c, err := testenv.Attach(dir, os.Stderr); err == nil && c.HasNode() == *node && c.EnforcesNetworkPolicy() == *netpol {
			fmt.Fprintf(os.Stderr, "testenv: reusing the running cluster; logs in %s\n", c.LogDir())
			if len(images) > 0 {
				if err := c.ImportImages(ctx, images...); err != nil {
					return err
				}
			}
			fmt.Println(c.Kubeconfig)
			return nil
		}
	}
	t := time.Now()
	c, err := testenv.Start(ctx, testenv.Options{Dir: dir, Node: *node, NetworkPolicy: *netpol, Images: images, Log: os.Stderr})
	if err != nil {
		return err
	}
	fmt.Fprintf(os.Stderr, "testenv: cluster up in %s; logs in %s\n", time.Since(t).Round(time.Millisecond), c.LogDir())
	fmt.Println(c.Kubeconfig)
	return nil
}

// execCommand: agentbox-testenv exec, a command against a cluster of its
// own.
func execCommand(ctx context.Context, dir string, args []string) error {
	fs := flag.NewFlagSet("exec", flag.ExitOnError)
	node := fs.Bool("node", false, "start a real node")
	netpol := fs.Bool("netpol", false, netpolUsage)
	var images files
	fs.Var(&images, "image", "OCI archive to import into the node (repeatable)")
	_ = fs.Parse(args)
	if fs.NArg() == 0 {
		return fmt.Errorf(usage)
	}
	return execWithCluster(ctx, testenv.Options{Dir: dir, Node: *node, NetworkPolicy: *netpol, Images: images, Log: os.Stderr}, fs.Args())
}

// execWithCluster runs a command against a fresh cluster and always tears
// the cluster down, also when the command fails or is interrupted, so a
// red test run leaves the machine as clean as a green one.
func execWithCluster(ctx context.Context, opts testenv.Options, argv []string) error {
	t := time.Now()
	c, err := testenv.Start(ctx, opts)
	if err != nil {
		return err
	}
	fmt.Fprintf(os.Stderr, "testenv: cluster up in %s; logs in %s\n", time.Since(t).Round(time.Millisecond), c.LogDir())
	cmd := exec.Command(argv[0], argv[1:]...)
	cmd.Stdin, cmd.Stdout, cmd.Stderr = os.Stdin, os.Stdout, os.Stderr
	cmd.Env = append(os.Environ(), testenv.EnvKubeconfig+"="+c.Kubeconfig)
	if opts.NetworkPolicy {
		cmd.Env = append(cmd.Env, testenv.EnvNetworkPolicy+"=1")
	}
	runErr := cmd.Run()
	t = time.Now()
	stopErr := c.Stop(context.Background())
	fmt.Fprintf(os.Stderr, "testenv: cluster down in %s\n", time.Since(t).Round(time.Millisecond))
	if runErr != nil {
		return fmt.Errorf("%s: %w", argv[0], runErr)
	}
	return stopErr
}
