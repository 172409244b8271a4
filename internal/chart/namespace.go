package chart

import (
	"context"
	"encoding/json"
	"fmt"
	"maps"
	"slices"

	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/client-go/kubernetes"
	psapi "k8s.io/pod-security-admission/api"
)

// The release namespace. When Install finds it missing it creates it, in
// place of Helm's --create-namespace (which labels nothing), enforcing the
// restricted Pod Security Standard: the control plane runs there, and so
// do the sandboxes of templates that name no namespace of their own (the
// provider's default namespace is the platform's), and every pod the
// platform makes meets restricted. The runsc installer, the chart's one
// exception, runs in a namespace of its own (runscInstaller.namespace).
//
// A namespace created that way carries LabelManagedBy=ManagedByValue, and
// Install and Upgrade put the labels back on it if they were changed. A
// namespace that existed before the platform is its owner's: its labels
// are left alone, and the sandbox controller reports, on each Sandbox,
// whether its namespace enforces restricted.

// LabelManagedBy and ManagedByValue mark a namespace the platform created
// and therefore keeps labelled.
const (
	LabelManagedBy = "app.kubernetes.io/managed-by"
	ManagedByValue = "agentbox"
)

// RestrictedNamespaceLabels are the Pod Security labels of a namespace the
// platform creates: restricted is enforced, warned about and audited, at
// the API server's own (latest) version of the standard, which the
// platform's pods are checked against.
func RestrictedNamespaceLabels() map[string]string {
	level, version := string(psapi.LevelRestricted), psapi.VersionLatest
	return map[string]string{
		psapi.EnforceLevelLabel:   level,
		psapi.EnforceVersionLabel: version,
		psapi.WarnLevelLabel:      level,
		psapi.WarnVersionLabel:    version,
		psapi.AuditLevelLabel:     level,
		psapi.AuditVersionLabel:   version,
	}
}

// ensureNamespace creates namespace, labelled restricted and marked as the
// platform's, if it does not exist, and restores the labels of one the
// platform created. It leaves any other namespace alone.
func (c *Client) ensureNamespace(ctx context.Context, name string) error {
	cs, err := kubernetes.NewForConfig(c.cfg)
	if err != nil {
		return fmt.Errorf("kubernetes client: %w", err)
	}
	want := RestrictedNamespaceLabels()
	want[LabelManagedBy] = ManagedByValue
	ns, err := cs.CoreV1().Namespaces().Get(ctx, name, metav1.GetOptions{})
	if apierrors.IsNotFound(err) {
		ns = &corev1.Namespace{ObjectMeta: metav1.ObjectMeta{Name: name, Labels: want}}
		if _, err = cs.CoreV1().Namespaces().Create(ctx, ns, metav1.CreateOptions{}); err == nil {
			c.log("created namespace %s, enforcing the restricted Pod Security Standard", name)
			return nil
		}
		if !apierrors.IsAlreadyExists(err) {
			return fmt.Errorf("create namespace %s: %w", name, err)
		}
		ns, err = cs.CoreV1().Namespaces().Get(ctx, name, metav1.GetOptions{})
	}
	if err != nil {
		return fmt.Errorf("get namespace %s: %w", name, err)
	}
	if ns.Labels[LabelManagedBy] != ManagedByValue {
		if ns.Labels[psapi.EnforceLevelLabel] != string(psapi.LevelRestricted) {
			c.log("namespace %s was not created by agentbox, so its Pod Security labels are left as they are; it does not enforce restricted (%s=%q)",
				name, psapi.EnforceLevelLabel, ns.Labels[psapi.EnforceLevelLabel])
		}
		return nil
	}
	changed := map[string]string{}
	for k, v := range want {
		if ns.Labels[k] != v {
			changed[k] = v
		}
	}
	if len(changed) == 0 {
		return nil
	}
	// A merge patch of the labels alone, so that others' labels stay.
	patch, err := json.Marshal(map[string]any{"metadata": map[string]any{"labels": changed}})
	if err != nil {
		return fmt.Errorf("encode namespace patch: %w", err)
	}
	if _, err := cs.CoreV1().Namespaces().Patch(ctx, name, types.MergePatchType, patch, metav1.PatchOptions{}); err != nil {
		return fmt.Errorf("restore the Pod Security labels of namespace %s: %w", name, err)
	}
	c.log("restored the labels %v of namespace %s, which agentbox created", slices.Sorted(maps.Keys(changed)), name)
	return nil
}
