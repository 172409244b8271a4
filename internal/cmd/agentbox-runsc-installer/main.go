// Command agentbox-runsc-installer is the runsc installer DaemonSet's
// program (charts/agentbox/templates/runsc-installer.yaml):
//
//	agentbox-runsc-installer install -from /opt/agentbox/runsc -to /host/bin
//	agentbox-runsc-installer wait
//
// install copies runsc and containerd-shim-runsc-v1 from the image into a
// folder of the node and checks that the copied runsc runs; it is the init
// container, the only part with write access to the host. wait blocks until
// SIGTERM or SIGINT, so that the DaemonSet's pod stays Running as the sign
// that the node is done.
package main

import (
	"context"
	"flag"
	"fmt"
	"io"
	"os"
	"os/signal"
	"syscall"
	"time"
)

var version = "dev"

// Binaries are the files install copies, in order: the shim first, so that
// by the time the new runsc is in place the shim that starts it is too.
var Binaries = []string{"containerd-shim-runsc-v1", "runsc"}

func main() {
	os.Exit(run(os.Args[1:], os.Stdout, os.Stderr))
}

func run(args []string, stdout, stderr io.Writer) int {
	usage := func() int {
		fmt.Fprintln(stderr, "usage: agentbox-runsc-installer install -from DIR -to DIR | wait | version")
		return 2
	}
	if len(args) == 0 {
		return usage()
	}
	switch args[0] {
	case "install":
		fs := flag.NewFlagSet("install", flag.ContinueOnError)
		fs.SetOutput(stderr)
		from := fs.String("from", "/opt/agentbox/runsc", "folder holding runsc and containerd-shim-runsc-v1")
		to := fs.String("to", "", "folder on the host to install them into (required)")
		timeout := fs.Duration("check-timeout", 30*time.Second, "how long the installed runsc --version may take")
		if err := fs.Parse(args[1:]); err != nil {
			return 2
		}
		if *to == "" || fs.NArg() > 0 {
			return usage()
		}
		ctx, stop := signal.NotifyContext(context.Background(), syscall.SIGTERM, syscall.SIGINT)
		defer stop()
		ctx, cancel := context.WithTimeout(ctx, *timeout)
		defer cancel()
		if err := Install(ctx, *from, *to, stdout); err != nil {
			fmt.Fprintln(stderr, "agentbox-runsc-installer:", err)
			return 1
		}
		return 0
	case "wait":
		ctx, stop := signal.NotifyContext(context.Background(), syscall.SIGTERM, syscall.SIGINT)
		defer stop()
		fmt.Fprintln(stdout, "runsc installed; waiting for SIGTERM")
		<-ctx.Done()
		return 0
	case "version":
		fmt.Fprintln(stdout, version)
		return 0
	default:
		return usage()
	}
}
