// Command agentbox-bench prints the table of `make bench` from the figures
// its benchmarks recorded (internal/benchreport):
//
//	agentbox-bench table FILE
//
// It exits 1 if FILE holds no figures, so that a bench run that measured
// nothing does not look like a result.
package main

import (
	"fmt"
	"io"
	"os"

	"github.com/agentbox/terraform-provider-agentbox/internal/benchreport"
)

func main() {
	os.Exit(run(os.Args[1:], os.Stdout, os.Stderr))
}

func run(args []string, stdout, stderr io.Writer) int {
	if len(args) != 2 || args[0] != "table" {
		fmt.Fprintln(stderr, "usage: agentbox-bench table FILE")
		return 2
	}
	f, err := os.Open(args[1])
	if err != nil {
		fmt.Fprintf(stderr, "agentbox-bench: %v\n", err)
		return 1
	}
	defer f.Close()
	figures, err := benchreport.Read(f)
	if err != nil {
		fmt.Fprintf(stderr, "agentbox-bench: %s: %v\n", args[1], err)
		return 1
	}
	if err := benchreport.Table(stdout, figures); err != nil {
		fmt.Fprintf(stderr, "agentbox-bench: %v\n", err)
		return 1
	}
	return 0
}
