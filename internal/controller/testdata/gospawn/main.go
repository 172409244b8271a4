// Command gospawn times os/exec of /bin/true the way the supervisor starts
// commands (own process group, output captured through pipes), with none
// of the supervisor around it, and prints one duration in nanoseconds a
// line. TestSupervisorGVisorBench runs it in the pod beside the raw
// posix_spawn, to tell what Go's exec costs under gVisor from what the
// supervisor adds.
package main

import (
	"bytes"
	"fmt"
	"os"
	"os/exec"
	"strconv"
	"syscall"
	"time"
)

func main() {
	n, err := strconv.Atoi(os.Args[1])
	if err != nil {
		fmt.Fprintln(os.Stderr, "usage: gospawn COUNT")
		os.Exit(2)
	}
	for range n {
		start := time.Now()
		cmd := exec.Command("/bin/true")
		var stdout, stderr bytes.Buffer
		cmd.Stdout, cmd.Stderr = &stdout, &stderr
		cmd.SysProcAttr = &syscall.SysProcAttr{Setpgid: true}
		if err := cmd.Run(); err != nil {
			fmt.Fprintln(os.Stderr, err)
			os.Exit(1)
		}
		fmt.Println(time.Since(start).Nanoseconds())
	}
}
