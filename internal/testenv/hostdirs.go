package testenv

import "path/filepath"

// StateDir is the folder of the running cluster whose admin kubeconfig is at
// kubeconfig. Test helpers that run host processes for the cluster (a CSI
// driver and its sidecars) keep their files below it and name it on those
// processes' command lines, so that the cluster's teardown, also after a
// test crashed, stops them, unmounts what they mounted and removes their
// files.
func StateDir(kubeconfig string) string { return filepath.Dir(kubeconfig) }

// KubeletDir is the kubelet's root folder (--root-dir) on the node of the
// cluster whose admin kubeconfig is at kubeconfig. Plugins register with
// kubelet through sockets in its plugins_registry subfolder.
func KubeletDir(kubeconfig string) string { return kubeletRoot(StateDir(kubeconfig)) }

func kubeletRoot(stateDir string) string { return filepath.Join(stateDir, "kubelet") }
