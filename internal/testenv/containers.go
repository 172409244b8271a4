package testenv

import (
	"context"
	"fmt"
	"os/exec"
	"path/filepath"
	"strings"
)

// SignalContainer sends sig (a name such as "SIGSTOP") to the main process
// of a container on the node of the cluster whose admin kubeconfig is at
// kubeconfig, through the node's containerd, as the node's runtime does
// when it stops a container. containerID is the pod status's, with or
// without its "containerd://" prefix. It is for tests that need to do to a
// container's process what the container's own processes cannot (the
// kernel shields a PID namespace's init from signals sent inside it).
func SignalContainer(ctx context.Context, kubeconfig, containerID, sig string) error {
	st, err := loadState(StateDir(kubeconfig))
	if err != nil {
		return fmt.Errorf("the cluster's state: %w", err)
	}
	id := strings.TrimPrefix(containerID, "containerd://")
	sock := filepath.Join(st.Dir, "containerd", "containerd.sock")
	out, err := exec.CommandContext(ctx, filepath.Join(st.BinDir, "ctr"), "-a", sock, "-n", "k8s.io", "tasks", "kill", "-s", sig, id).CombinedOutput()
	if err != nil {
		return fmt.Errorf("ctr tasks kill -s %s %s: %w: %s", sig, id, err, strings.TrimSpace(string(out)))
	}
	return nil
}
