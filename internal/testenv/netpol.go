package testenv

import (
	"context"
	"errors"
	"fmt"
	"os/exec"
	"regexp"
	"strings"
	"time"

	"github.com/agentbox/terraform-provider-agentbox/internal/testenv/toolchain"
)

// The node's NetworkPolicy enforcer is kube-router with only its firewall
// on: no routing (the bridge CNI routes), no service proxy (kube-proxy
// does), and no listener at all (health and metrics off), since security
// reports are filed against the pinned release. It enforces with iptables
// chains and ipsets in the host's network namespace; a gVisor pod's packets
// leave its netstack through the pod's veth onto the bridge, where
// bridge-nf-call-iptables hands them to those chains like any other pod's.

// netpolFenceChain repeats the pod egress fence in the mangle table.
// kube-router puts its FORWARD jump first in the filter table and ACCEPTs
// there what the policies allow, so the filter table's fence would never see
// that traffic; mangle FORWARD runs before any filter rule.
const netpolFenceChain = "AGENTBOX-FENCE"

// startNetworkPolicy fences pod egress ahead of kube-router, starts it, and
// returns once its chains hang off FORWARD.
func (c *Cluster) startNetworkPolicy(ctx context.Context) error {
	st := c.st
	for _, args := range [][]string{
		{"-t", "mangle", "-N", netpolFenceChain},
		{"-t", "mangle", "-A", netpolFenceChain, "-s", PodCIDR, "!", "-d", TestRange, "-j", "DROP"},
		{"-t", "mangle", "-I", "FORWARD", "1", "-j", netpolFenceChain},
	} {
		if err := run(ctx, "iptables", append([]string{"-w"}, args...)...); err != nil {
			return fmt.Errorf("fence pod egress ahead of the NetworkPolicy enforcer: %w", err)
		}
	}
	if _, err := exec.LookPath("ipset"); err != nil {
		return fmt.Errorf("the NetworkPolicy enforcer needs the ipset tool (run `make testenv`, which installs it): %w", err)
	}
	if err := startProcess(st, toolchain.KubeRouter, c.bin(toolchain.KubeRouter), []string{
		"--kubeconfig=" + st.Kubeconfig,
		"--hostname-override=" + NodeName,
		"--run-firewall=true", "--run-router=false", "--run-service-proxy=false",
		"--service-cluster-ip-range=" + ServiceCIDR,
		"--health-port=0", "--metrics-port=0",
		"--v=1",
	}, nil); err != nil {
		return err
	}
	return waitFor(ctx, st, toolchain.KubeRouter, 60*time.Second, func(ctx context.Context) error {
		out, err := exec.CommandContext(ctx, "iptables", "-w", "-S", "FORWARD").Output()
		if err != nil {
			return err
		}
		if !strings.Contains(string(out), "-j KUBE-ROUTER-FORWARD") {
			return fmt.Errorf("no jump to KUBE-ROUTER-FORWARD in FORWARD yet: %w", errNotReady)
		}
		return nil
	})
}

// kubeRouterSet matches the ipsets kube-router's firewall makes: the
// policies' source and destination sets, and the temporary sets of its
// atomic swaps, which a killed kube-router can leave behind. IPv6 sets
// carry an "inet6:" prefix.
var kubeRouterSet = regexp.MustCompile(`^(inet6:)?(KUBE-SRC-|KUBE-DST-|kube-router-|TMP-[A-Z2-7=]{16}$)`)

// removeIPSets destroys kube-router's ipsets. It runs after the iptables
// chains are gone, since a set still matched by a rule cannot be destroyed.
func removeIPSets(ctx context.Context) (int, error) {
	if _, err := exec.LookPath("ipset"); err != nil {
		return 0, nil
	}
	out, err := exec.CommandContext(ctx, "ipset", "list", "-n").Output()
	if err != nil {
		return 0, fmt.Errorf("ipset list -n: %w", err)
	}
	removed := 0
	var errs []error
	for _, name := range strings.Fields(string(out)) {
		if !kubeRouterSet.MatchString(name) {
			continue
		}
		if err := run(ctx, "ipset", "destroy", name); err != nil {
			errs = append(errs, err)
			continue
		}
		removed++
	}
	return removed, errors.Join(errs...)
}
