// Command localpath is the test node's volume provisioner, in the manner of
// k3s's local-path provisioner: each claim of its StorageClass gets a folder
// on the node, made writable by anyone.
//
// kube-controller-manager's hostPath provisioner makes root-owned 0750
// folders, and kubelet applies no fsGroup to hostPath volumes, so a sandbox
// running as a non-root user could not even enter its workspace.
package main

import (
	"context"
	"flag"
	"fmt"
	"log/slog"
	"os"
	"os/signal"
	"path/filepath"
	"strings"
	"syscall"
	"time"

	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/tools/clientcmd"
)

// annotation marks the volumes this provisioner made, the way the
// provisioning controllers of Kubernetes do.
const annotation = "pv.kubernetes.io/provisioned-by"

func main() {
	kubeconfig := flag.String("kubeconfig", "", "kubeconfig of the cluster")
	dir := flag.String("dir", "", "folder that holds the volumes")
	name := flag.String("provisioner", "agentbox.test/local-path", "provisioner name of the StorageClasses served")
	node := flag.String("node", "", "node the volumes live on")
	flag.Parse()
	log := slog.New(slog.NewTextHandler(os.Stderr, nil))
	if *kubeconfig == "" || *dir == "" || *node == "" {
		log.Error("-kubeconfig, -dir and -node are required")
		os.Exit(2)
	}
	cfg, err := clientcmd.BuildConfigFromFlags("", *kubeconfig)
	if err != nil {
		log.Error("kubeconfig", "err", err)
		os.Exit(1)
	}
	cs := kubernetes.NewForConfigOrDie(cfg)
	ctx, stop := signal.NotifyContext(context.Background(), syscall.SIGTERM, os.Interrupt)
	defer stop()
	p := &provisioner{cs: cs, dir: *dir, name: *name, node: *node, log: log}
	// Polling keeps this small; a test cluster has a handful of claims.
	for ctx.Err() == nil {
		if err := p.sync(ctx); err != nil && ctx.Err() == nil {
			log.Warn("sync", "err", err)
		}
		select {
		case <-ctx.Done():
		case <-time.After(250 * time.Millisecond):
		}
	}
}

type provisioner struct {
	cs              kubernetes.Interface
	dir, name, node string
	log             *slog.Logger
}

func (p *provisioner) sync(ctx context.Context) error {
	classes, err := p.cs.StorageV1().StorageClasses().List(ctx, metav1.ListOptions{})
	if err != nil {
		return err
	}
	ours := map[string]bool{}
	for _, sc := range classes.Items {
		if sc.Provisioner == p.name {
			ours[sc.Name] = true
		}
	}
	pvcs, err := p.cs.CoreV1().PersistentVolumeClaims("").List(ctx, metav1.ListOptions{})
	if err != nil {
		return err
	}
	for i := range pvcs.Items {
		pvc := &pvcs.Items[i]
		if pvc.Status.Phase == corev1.ClaimPending && pvc.Spec.VolumeName == "" && pvc.DeletionTimestamp == nil &&
			pvc.Spec.StorageClassName != nil && ours[*pvc.Spec.StorageClassName] {
			if err := p.provision(ctx, pvc); err != nil {
				p.log.Warn("provision", "claim", pvc.Namespace+"/"+pvc.Name, "err", err)
			}
		}
	}
	pvs, err := p.cs.CoreV1().PersistentVolumes().List(ctx, metav1.ListOptions{})
	if err != nil {
		return err
	}
	for i := range pvs.Items {
		pv := &pvs.Items[i]
		if pv.Annotations[annotation] == p.name && pv.Status.Phase == corev1.VolumeReleased &&
			pv.Spec.PersistentVolumeReclaimPolicy == corev1.PersistentVolumeReclaimDelete {
			p.remove(ctx, pv)
		}
	}
	return nil
}

func (p *provisioner) provision(ctx context.Context, pvc *corev1.PersistentVolumeClaim) error {
	name := "pvc-" + string(pvc.UID)
	path := filepath.Join(p.dir, name)
	if err := os.MkdirAll(path, 0o777); err != nil {
		return err
	}
	// MkdirAll applies the umask; the point is a folder any user may write.
	if err := os.Chmod(path, 0o777); err != nil {
		return err
	}
	hostPathType := corev1.HostPathDirectory
	pv := &corev1.PersistentVolume{
		ObjectMeta: metav1.ObjectMeta{Name: name, Annotations: map[string]string{annotation: p.name}},
		Spec: corev1.PersistentVolumeSpec{
			Capacity:                      corev1.ResourceList{corev1.ResourceStorage: pvc.Spec.Resources.Requests[corev1.ResourceStorage]},
			AccessModes:                   pvc.Spec.AccessModes,
			PersistentVolumeReclaimPolicy: corev1.PersistentVolumeReclaimDelete,
			StorageClassName:              *pvc.Spec.StorageClassName,
			VolumeMode:                    pvc.Spec.VolumeMode,
			ClaimRef: &corev1.ObjectReference{
				Kind: "PersistentVolumeClaim", APIVersion: "v1",
				Namespace: pvc.Namespace, Name: pvc.Name, UID: pvc.UID,
			},
			PersistentVolumeSource: corev1.PersistentVolumeSource{HostPath: &corev1.HostPathVolumeSource{Path: path, Type: &hostPathType}},
			NodeAffinity: &corev1.VolumeNodeAffinity{Required: &corev1.NodeSelector{NodeSelectorTerms: []corev1.NodeSelectorTerm{{
				MatchExpressions: []corev1.NodeSelectorRequirement{{Key: corev1.LabelHostname, Operator: corev1.NodeSelectorOpIn, Values: []string{p.node}}},
			}}}},
		},
	}
	if _, err := p.cs.CoreV1().PersistentVolumes().Create(ctx, pv, metav1.CreateOptions{}); err != nil && !apierrors.IsAlreadyExists(err) {
		return fmt.Errorf("create %s: %w", name, err)
	}
	p.log.Info("provisioned", "claim", pvc.Namespace+"/"+pvc.Name, "volume", name, "path", path)
	return nil
}

func (p *provisioner) remove(ctx context.Context, pv *corev1.PersistentVolume) {
	if hp := pv.Spec.HostPath; hp != nil && strings.HasPrefix(hp.Path, p.dir+string(os.PathSeparator)) {
		if err := os.RemoveAll(hp.Path); err != nil {
			p.log.Warn("remove folder", "volume", pv.Name, "err", err)
			return
		}
	}
	if err := p.cs.CoreV1().PersistentVolumes().Delete(ctx, pv.Name, metav1.DeleteOptions{}); err != nil && !apierrors.IsNotFound(err) {
		p.log.Warn("delete volume", "volume", pv.Name, "err", err)
		return
	}
	p.log.Info("deleted", "volume", pv.Name)
}
