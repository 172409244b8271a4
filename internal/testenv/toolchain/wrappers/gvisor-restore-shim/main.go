//go:build ignore

// This file is the main package of the toolchain's gvisor-restore-shim
// component, not of this repository: the toolchain writes it, without the
// build constraint above, next to the component's go.mod and builds it
// against the vendored (and patched) gVisor module. The constraint keeps
// this repository's own builds and `go mod tidy` off it.

// Command containerd-shim-agentbox-runsc-v1 is gVisor's containerd shim
// (containerd-shim-runsc-v1) with one addition, the restore from memory: a
// container whose OCI spec carries the annotation RestoreAnnotation, naming
// a checkpoint directory (a `runsc checkpoint` image of a whole sandbox), is
// started with `runsc restore --image-path DIR` instead of `runsc start`.
// The pod's sandbox (pause) container restores the sandbox's kernel; each
// app container, created as usual, then restores its processes into it,
// matched by container name. Everything else, exec processes included, is
// the stock shim.
package main

import (
	"context"
	"encoding/json"
	"fmt"
	"os"
	"path/filepath"
	"strings"

	task "github.com/containerd/containerd/api/runtime/task/v2"
	"gvisor.dev/gvisor/pkg/shim/v1/extension"
	"gvisor.dev/gvisor/shim/v1/cli"
)

// RestoreAnnotation is the pod annotation naming the checkpoint directory on
// the node. containerd's CRI copies it into every container's OCI spec of
// the pod (the sandbox's included) when the runtime handler lists it in
// pod_annotations.
const RestoreAnnotation = "agentbox.dev/restore-from"

// RestoreRootEnv names the only directory (in the shim's environment, which
// it inherits from containerd) under which checkpoint directories are
// restored. Unset, the shim restores nothing: a pod annotation is set by
// whoever writes the pod, and a checkpoint holds another sandbox's memory.
const RestoreRootEnv = "AGENTBOX_RESTORE_ROOT"

func main() {
	extension.NewExtension = newRestorer
	cli.Main()
}

// restorer turns the start of a container's init process into a restore
// from image.
type restorer struct {
	extension.TaskServiceExt
	image string
}

// newRestorer is called on every task Create, with the container's bundle.
// It returns nil (the stock shim) unless the spec asks for a restore.
func newRestorer(ctx context.Context, next extension.TaskServiceExt, r *task.CreateTaskRequest) (extension.TaskServiceExt, error) {
	b, err := os.ReadFile(filepath.Join(r.Bundle, "config.json"))
	if err != nil {
		return nil, fmt.Errorf("restore: read the OCI spec: %w", err)
	}
	var spec struct {
		Annotations map[string]string `json:"annotations"`
	}
	if err := json.Unmarshal(b, &spec); err != nil {
		return nil, fmt.Errorf("restore: parse the OCI spec: %w", err)
	}
	dir, ok := spec.Annotations[RestoreAnnotation]
	if !ok {
		return nil, nil
	}
	image, err := checkImage(dir, os.Getenv(RestoreRootEnv))
	if err != nil {
		return nil, fmt.Errorf("restore: annotation %s: %w", RestoreAnnotation, err)
	}
	return &restorer{TaskServiceExt: next, image: image}, nil
}

// checkImage accepts dir when it is a directory below root holding a
// checkpoint image.
func checkImage(dir, root string) (string, error) {
	if root == "" {
		return "", fmt.Errorf("this node restores no checkpoint (%s is not set for containerd)", RestoreRootEnv)
	}
	if !filepath.IsAbs(dir) || filepath.Clean(dir) != dir {
		return "", fmt.Errorf("%q is not a clean absolute path", dir)
	}
	real, err := filepath.EvalSymlinks(dir)
	if err != nil {
		return "", fmt.Errorf("checkpoint directory: %w", err)
	}
	realRoot, err := filepath.EvalSymlinks(root)
	if err != nil {
		return "", fmt.Errorf("%s: %w", RestoreRootEnv, err)
	}
	if !strings.HasPrefix(real, realRoot+string(filepath.Separator)) {
		return "", fmt.Errorf("%q is not below %s", dir, root)
	}
	if _, err := os.Stat(filepath.Join(real, "checkpoint.img")); err != nil {
		return "", fmt.Errorf("no checkpoint image in %q: %w", dir, err)
	}
	return real, nil
}

// Start restores the container's init process; exec processes start as
// usual.
func (s *restorer) Start(ctx context.Context, r *task.StartRequest) (*task.StartResponse, error) {
	if r.ExecID != "" {
		return s.TaskServiceExt.Start(ctx, r)
	}
	resp, err := s.TaskServiceExt.Restore(ctx, &extension.RestoreRequest{
		Start: r,
		Conf:  extension.RestoreConfig{ImagePath: s.image},
	})
	if err != nil {
		return nil, fmt.Errorf("restore %s from %s: %w", r.ID, s.image, err)
	}
	return resp, nil
}
