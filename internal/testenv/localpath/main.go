// Command localpath is the test node's volume provisioner, in the manner of
// k3s's local-path provisioner: each claim of its StorageClass gets a folder
// on the node, made writable by anyone.
//
// kube-controller-manager's hostPath provisioner makes root-owned 0750
// folders, and kubelet applies no fsGroup to hostPath volumes, so a sandbox
// running as a non-root user could not even enter its workspace.
//
// The folder is the mount point of an ext4 filesystem of the claim's size
// (package loopvol; at least loopvol.MinSize), in a sparse image file beside
// it, so that the claim's size is a real limit: a write past it fails with
// ENOSPC, as on a cloud disk, and a sandbox cannot fill the node's disk.
// The volume is mounted before its PersistentVolume is made: the
// provisioner, kubelet and containerd share the host's mount namespace,
// whose root mount may be private (it is on the machines the tests run on),
// so a pod sees only the mounts that existed when its sandbox started. When the claim is deleted, the volume is
// unmounted, its loop device detached and its image removed; the test
// cluster's teardown does the same for whatever is left.
package main

import (
	"context"
	"errors"
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
	storagev1 "k8s.io/api/storage/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	"k8s.io/apimachinery/pkg/api/resource"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/fields"
	"k8s.io/apimachinery/pkg/runtime"
	"k8s.io/client-go/kubernetes"
	toolscache "k8s.io/client-go/tools/cache"
	"k8s.io/client-go/tools/clientcmd"

	"github.com/agentbox/terraform-provider-agentbox/internal/testenv/loopvol"
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
	// Informers, not polling: the kube-apiserver of a busy test cluster
	// should not answer three LISTs a few times a second for a handful of
	// claims. Every change of a claim, volume or class kicks a sync from
	// the informers' caches; the tick retries what failed (a volume still
	// mounted somewhere). Informers of their own rather than client-go's
	// informer factory, which would compile its informers of every API
	// group into this binary.
	watch := func(c toolscache.Getter, resource string, obj runtime.Object) toolscache.SharedIndexInformer {
		lw := toolscache.NewListWatchFromClient(c, resource, metav1.NamespaceAll, fields.Everything())
		return toolscache.NewSharedIndexInformer(lw, obj, 10*time.Minute, toolscache.Indexers{})
	}
	classes := watch(cs.StorageV1().RESTClient(), "storageclasses", &storagev1.StorageClass{})
	claims := watch(cs.CoreV1().RESTClient(), "persistentvolumeclaims", &corev1.PersistentVolumeClaim{})
	volumes := watch(cs.CoreV1().RESTClient(), "persistentvolumes", &corev1.PersistentVolume{})
	p := &provisioner{cs: cs, dir: *dir, name: *name, node: *node, log: log, classes: classes.GetStore(), claims: claims.GetStore(), volumes: volumes.GetStore()}
	kick := make(chan struct{}, 1)
	handler := toolscache.ResourceEventHandlerFuncs{
		AddFunc:    func(any) { notify(kick) },
		UpdateFunc: func(any, any) { notify(kick) },
		DeleteFunc: func(any) { notify(kick) },
	}
	for _, inf := range []toolscache.SharedIndexInformer{classes, claims, volumes} {
		if _, err := inf.AddEventHandler(handler); err != nil {
			log.Error("informer", "err", err)
			os.Exit(1)
		}
		go inf.Run(ctx.Done())
	}
	toolscache.WaitForCacheSync(ctx.Done(), classes.HasSynced, claims.HasSynced, volumes.HasSynced)
	tick := time.NewTicker(2 * time.Second)
	defer tick.Stop()
	for ctx.Err() == nil {
		p.sync(ctx)
		select {
		case <-ctx.Done():
		case <-kick:
		case <-tick.C:
		}
	}
}

// notify kicks a sync without blocking: one pending kick covers any
// number of changes, since a sync reads everything.
func notify(kick chan<- struct{}) {
	select {
	case kick <- struct{}{}:
	default:
	}
}

type provisioner struct {
	cs              kubernetes.Interface
	dir, name, node string
	log             *slog.Logger
	// The informers' stores: their objects are shared, read only.
	classes, claims, volumes toolscache.Store
}

// sync provisions the pending claims of its classes and removes the
// released volumes it made. The informers' objects are shared: read only.
func (p *provisioner) sync(ctx context.Context) {
	ours := map[string]bool{}
	for _, o := range p.classes.List() {
		if sc := o.(*storagev1.StorageClass); sc.Provisioner == p.name {
			ours[sc.Name] = true
		}
	}
	for _, o := range p.claims.List() {
		pvc := o.(*corev1.PersistentVolumeClaim)
		if pvc.Status.Phase == corev1.ClaimPending && pvc.Spec.VolumeName == "" && pvc.DeletionTimestamp == nil &&
			pvc.Spec.StorageClassName != nil && ours[*pvc.Spec.StorageClassName] {
			if err := p.provision(ctx, pvc); err != nil {
				p.log.Warn("provision", "claim", pvc.Namespace+"/"+pvc.Name, "err", err)
			}
		}
	}
	for _, o := range p.volumes.List() {
		pv := o.(*corev1.PersistentVolume)
		if pv.Annotations[annotation] == p.name && pv.Status.Phase == corev1.VolumeReleased &&
			pv.Spec.PersistentVolumeReclaimPolicy == corev1.PersistentVolumeReclaimDelete {
			p.remove(ctx, pv)
		}
	}
}

func (p *provisioner) provision(ctx context.Context, pvc *corev1.PersistentVolumeClaim) error {
	name := "pvc-" + string(pvc.UID)
	path := filepath.Join(p.dir, name)
	image := imagePath(path)
	requested := pvc.Spec.Resources.Requests[corev1.ResourceStorage]
	size := loopvol.Size(requested.Value())
	capacity := requested
	if size != requested.Value() {
		capacity = *resource.NewQuantity(size, resource.BinarySI)
	}
	if _, err := os.Stat(image); errors.Is(err, os.ErrNotExist) {
		// The image takes its name only once formatted, so a crash halfway
		// leaves nothing a retry could mistake for a volume.
		start := time.Now()
		if err := os.MkdirAll(p.dir, 0o755); err != nil {
			return err
		}
		tmp := image + ".tmp"
		// The root is writable by anyone; see the top of this file.
		if err := loopvol.Format(ctx, tmp, size, 0o777); err != nil {
			return err
		}
		if err := os.Rename(tmp, image); err != nil {
			return err
		}
		p.log.Info("formatted", "volume", name, "size", capacity.String(), "took", time.Since(start).Round(time.Millisecond))
	} else if err != nil {
		return err
	}
	if err := loopvol.Mount(ctx, image, path); err != nil {
		return err
	}
	hostPathType := corev1.HostPathDirectory
	pv := &corev1.PersistentVolume{
		ObjectMeta: metav1.ObjectMeta{Name: name, Annotations: map[string]string{annotation: p.name}},
		Spec: corev1.PersistentVolumeSpec{
			Capacity:                      corev1.ResourceList{corev1.ResourceStorage: capacity},
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
		if err := release(ctx, hp.Path); err != nil {
			p.log.Warn("remove volume", "volume", pv.Name, "err", err)
			return
		}
	}
	if err := p.cs.CoreV1().PersistentVolumes().Delete(ctx, pv.Name, metav1.DeleteOptions{}); err != nil && !apierrors.IsNotFound(err) {
		p.log.Warn("delete volume", "volume", pv.Name, "err", err)
		return
	}
	p.log.Info("deleted", "volume", pv.Name)
}

// imagePath is the filesystem image of the volume mounted at path.
func imagePath(path string) string { return path + ".img" }

// release unmounts the volume at path, detaches its loop device and removes
// its image and folder. A loop device that stays attached (its filesystem
// still mounted somewhere) is an error, so that the next sync tries again
// and the PersistentVolume goes only with everything behind it.
func release(ctx context.Context, path string) error {
	if err := loopvol.Unmount(ctx, path); err != nil {
		return err
	}
	image := imagePath(path)
	if err := loopvol.Detach(image); err != nil {
		return err
	}
	for _, f := range []string{image, image + ".tmp"} {
		if err := os.Remove(f); err != nil && !errors.Is(err, os.ErrNotExist) {
			return err
		}
	}
	return os.RemoveAll(path)
}
