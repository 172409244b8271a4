package controller

import (
	"context"
	"encoding/json"
	"fmt"
	"strings"
	"time"

	corev1 "k8s.io/api/core/v1"
	"k8s.io/apimachinery/pkg/types"
	"sigs.k8s.io/controller-runtime/pkg/client"

	"github.com/agentbox/terraform-provider-agentbox/internal/api/v1alpha1"
	"github.com/agentbox/terraform-provider-agentbox/internal/computeapi/holds"
	"github.com/agentbox/terraform-provider-agentbox/internal/supervisor/pyenv"
)

// Adoption by environment. A new Sandbox that names the Python environment
// its agent will use (v1alpha1.AnnotationPythonEnvName or
// AnnotationPythonRequirements) adopts, of the warm sandboxes of its
// template, one whose inventory holds that environment, else one
// building it, else any, each class oldest first: the order of a pool
// lease naming one (holds.RouteByEnv). How it went is written into the
// adopter's AnnotationPythonEnvRouting, its AdoptedFromWarmPool event and
// the agentbox_warm_pool_adoption_env_routing_total metric. Either way the
// adopter takes over the warm sandbox's inventory with its workspace, so
// that its own calls (and a later pool lease, were it one) know what its
// cache holds.

// EventPythonEnvIgnored is recorded on a new Sandbox whose environment
// annotations cannot be used; it adopts as if it named none.
const EventPythonEnvIgnored = "PythonEnvironmentIgnored"

// adoptEnvKey is the environment key sbx asks to adopt by: its env name,
// or the key of its requirement set under tpl's package indexes. "" with
// a reason when the annotations cannot be used, "" alone when it names
// none.
func adoptEnvKey(sbx *v1alpha1.Sandbox, tpl *v1alpha1.SandboxTemplate) (string, string) {
	name := strings.TrimSpace(sbx.Annotations[v1alpha1.AnnotationPythonEnvName])
	reqs := strings.Fields(sbx.Annotations[v1alpha1.AnnotationPythonRequirements])
	switch {
	case name != "" && len(reqs) > 0:
		return "", fmt.Sprintf("%s and %s name the environment twice; set one", v1alpha1.AnnotationPythonEnvName, v1alpha1.AnnotationPythonRequirements)
	case name != "":
		if err := pyenv.ValidName(name); err != nil {
			return "", fmt.Sprintf("%s: %v", v1alpha1.AnnotationPythonEnvName, err)
		}
		return name, ""
	case len(reqs) > 0:
		key, err := pyenv.RequirementsKey(reqs, tpl.Spec.Python.IndexURL, tpl.Spec.Python.ExtraIndexURLs)
		if err != nil {
			return "", fmt.Sprintf("%s: %v", v1alpha1.AnnotationPythonRequirements, err)
		}
		return key, ""
	}
	return "", ""
}

// routeWarm orders the warm sandboxes (oldest first) for an adopter asking
// for the environment key.
func routeWarm(warm []v1alpha1.Sandbox, key string) []v1alpha1.Sandbox {
	if key == "" {
		return warm
	}
	ptrs := make([]*v1alpha1.Sandbox, len(warm))
	for i := range warm {
		ptrs[i] = &warm[i]
	}
	out := make([]v1alpha1.Sandbox, 0, len(warm))
	for _, w := range holds.RouteByEnv(ptrs, key) {
		out = append(out, *w)
	}
	return out
}

// adoptionEnvRouting is the routing of sbx's adoption of w, as a pool
// lease's: "" when sbx named no environment.
func adoptionEnvRouting(w *v1alpha1.Sandbox, key string) string {
	if key == "" {
		return ""
	}
	return holds.EnvRouting(w, key)
}

// noteAdoptedEnvs writes onto sbx what it adopts of w's environments: the
// routing (when it named one) and w's inventory, whose environments are in
// the workspace it takes over. A merge patch of these keys alone, written
// before the adoption is recorded in the status, so that a pass resuming
// after a crash writes it again.
func (r *SandboxReconciler) noteAdoptedEnvs(ctx context.Context, sbx, w *v1alpha1.Sandbox, routing string) error {
	set := map[string]any{}
	now := time.Now()
	for k, v := range w.Annotations {
		if _, ok := strings.CutPrefix(k, v1alpha1.AnnotationPythonEnvPrefix); ok && v1alpha1.PythonEnvValueState(v, now) != "" && sbx.Annotations[k] != v {
			set[k] = v
		}
	}
	if routing != "" && sbx.Annotations[v1alpha1.AnnotationPythonEnvRouting] != routing {
		set[v1alpha1.AnnotationPythonEnvRouting] = routing
	}
	if len(set) == 0 {
		return nil
	}
	body, err := json.Marshal(map[string]any{"metadata": map[string]any{"annotations": set}})
	if err != nil {
		return fmt.Errorf("encode the environments adopted from %s: %w", w.Name, err)
	}
	target := &v1alpha1.Sandbox{}
	target.Namespace, target.Name = sbx.Namespace, sbx.Name
	if err := r.Patch(ctx, target, client.RawPatch(types.MergePatchType, body)); err != nil {
		return fmt.Errorf("record the environments adopted from warm sandbox %s: %w", w.Name, err)
	}
	return nil
}

// warnPythonEnvIgnored tells the owner of sbx that its environment
// annotations are not used, and why.
func (r *SandboxReconciler) warnPythonEnvIgnored(sbx *v1alpha1.Sandbox, why string) {
	r.event(sbx, nil, corev1.EventTypeWarning, EventPythonEnvIgnored, "Adopt",
		"adopting a warm sandbox without routing by python environment: "+why)
}
