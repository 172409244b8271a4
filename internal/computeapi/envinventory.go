package computeapi

import (
	"context"
	"encoding/json"
	"fmt"
	"strings"
	"time"

	apierrors "k8s.io/apimachinery/pkg/api/errors"
	"k8s.io/apimachinery/pkg/types"
	"sigs.k8s.io/controller-runtime/pkg/client"

	"github.com/agentbox/terraform-provider-agentbox/internal/api/v1alpha1"
	api "github.com/agentbox/terraform-provider-agentbox/internal/computeapi/client"
	"github.com/agentbox/terraform-provider-agentbox/internal/computeapi/holds"
	"github.com/agentbox/terraform-provider-agentbox/internal/supervisor/pyenv"
	"github.com/agentbox/terraform-provider-agentbox/internal/supervisor/supervisorapi"
)

// The sandbox's Python environment inventory (v1alpha1.PythonEnvState) is
// written here, by the calls that learn of a change: an environment
// built or used (envs create, an execute's answer), deleted, or found
// missing (envs list). A call whose answer matches what the inventory
// says writes nothing, so routing costs no API-server write per call. One
// annotation per environment, merge-patched key by key, so that calls
// changing different environments of one sandbox cannot undo each other.

// noteEnvRouting counts a pool lease's routing and puts it in the call's
// audit record.
func noteEnvRouting(ctx context.Context, r *api.PoolLeaseRouting) {
	if r == nil {
		return
	}
	metricPoolLeaseEnvRouting.WithLabelValues(r.Result).Inc()
	noteAudit(ctx, "routing", r)
}

// envInventoryPatch sets the inventory states in set (a state of "" removes
// the environment) that differ from what sb records. PythonEnvBuilding is
// written as a mark of now (v1alpha1.PythonEnvBuildingAt), unless sb
// records a build under way already. A patch that writes anything also
// drops the building marks of sb that have expired: their writer never
// saw the build end.
func (s *Server) envInventoryPatch(ctx context.Context, sb *v1alpha1.Sandbox, set map[string]string) error {
	changes := envInventoryChanges(sb, set, time.Now())
	if len(changes) == 0 {
		return nil
	}
	body, err := json.Marshal(map[string]any{"metadata": map[string]any{"annotations": changes}})
	if err != nil {
		return fmt.Errorf("encode environment inventory: %w", err)
	}
	ctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), holds.WriteTimeout)
	defer cancel()
	target := &v1alpha1.Sandbox{}
	target.Namespace, target.Name = sb.Namespace, sb.Name
	if err := s.kube.Patch(ctx, target, client.RawPatch(types.MergePatchType, body)); err != nil && !apierrors.IsNotFound(err) {
		return fmt.Errorf("record the environments of sandbox %s/%s: %w", sb.Namespace, sb.Name, err)
	}
	return nil
}

// envInventoryChanges is the merge patch of sb's annotations that
// envInventoryPatch sends at now; empty when nothing changes.
func envInventoryChanges(sb *v1alpha1.Sandbox, set map[string]string, now time.Time) map[string]any {
	changes := map[string]any{}
	for name, state := range set {
		key := v1alpha1.PythonEnvAnnotation(name)
		if key == "" {
			continue
		}
		have := sb.Annotations[key]
		switch {
		case state == v1alpha1.PythonEnvBuilding:
			if v1alpha1.PythonEnvValueState(have, now) != v1alpha1.PythonEnvBuilding {
				changes[key] = v1alpha1.PythonEnvBuildingAt(now)
			}
		case have == state:
		case state == "":
			changes[key] = nil
		default:
			changes[key] = state
		}
	}
	if len(changes) == 0 {
		return changes
	}
	for k, v := range sb.Annotations {
		if _, ok := strings.CutPrefix(k, v1alpha1.AnnotationPythonEnvPrefix); ok && v != v1alpha1.PythonEnvBuilt {
			if _, changing := changes[k]; !changing && v1alpha1.PythonEnvValueState(v, now) == "" {
				changes[k] = nil
			}
		}
	}
	return changes
}

// noteEnvs records in sb's inventory what a call learned: set as for
// envInventoryPatch. A failure is logged: the inventory is a hint, and
// the next call that learns of the environment writes it again.
func (s *Server) noteEnvs(ctx context.Context, sb *v1alpha1.Sandbox, set map[string]string) {
	if sb == nil || len(set) == 0 {
		return
	}
	if err := s.envInventoryPatch(ctx, sb, set); err != nil {
		s.log.Error(err, "record environment inventory", "sandbox", sb.Namespace+"/"+sb.Name)
	}
}

// envListed makes sb's inventory the list's: environments it records
// built that the supervisor no longer has (evicted, expired) go. Those
// recorded building stay: a list does not show builds under way, and the
// call building one records how it ended.
func (s *Server) envListed(ctx context.Context, sb *v1alpha1.Sandbox, list *supervisorapi.EnvList) {
	set := map[string]string{}
	for k, v := range sb.Annotations {
		if name, ok := strings.CutPrefix(k, v1alpha1.AnnotationPythonEnvPrefix); ok && v == v1alpha1.PythonEnvBuilt {
			set[name] = ""
		}
	}
	for _, e := range list.Environments {
		set[e.Name] = v1alpha1.PythonEnvBuilt
	}
	s.noteEnvs(ctx, sb, set)
}

// envHealth makes the inventory of a free warm sandbox what its
// supervisor's health answer lists (as envListed does a list's): the
// keep-alive calls of warm connections (supervisors.Conns.OnHealth) bring
// evictions to the inventory that routes pool leases, pool runs and
// adoptions, within a keep-alive period and without a call of their own.
// The sandbox is read again from the cache first: the keeper's copy may
// predate a write of the inventory.
func (s *Server) envHealth(sb *v1alpha1.Sandbox, h *supervisorapi.Health) {
	if h == nil || h.Environments == nil {
		// A supervisor that keeps no environments.
		return
	}
	ctx, cancel := context.WithTimeout(context.Background(), holds.WriteTimeout)
	defer cancel()
	fresh := &v1alpha1.Sandbox{}
	if err := s.sandboxes.Get(ctx, client.ObjectKeyFromObject(sb), fresh); err != nil || fresh.UID != sb.UID {
		return
	}
	s.envListed(ctx, fresh, &supervisorapi.EnvList{Environments: h.Environments})
}

// executeEnvKey is the environment an execute will use, as its sandbox's
// inventory names it: its env_name, or the key of its requirement set
// under the sandbox template's package indexes. "" for a run of the
// sandbox's own python3, or when the key cannot be worked out here (a
// python_index of the request's own; the answer names the environment
// all the same).
func (s *Server) executeEnvKey(ctx context.Context, sb *v1alpha1.Sandbox, req supervisorapi.ExecuteRequest) string {
	if req.EnvName != "" || len(req.Requirements) == 0 || req.PythonIndex != "" {
		return req.EnvName
	}
	var tpl v1alpha1.SandboxTemplate
	if err := s.sandboxes.Get(ctx, types.NamespacedName{Namespace: sb.Namespace, Name: sb.Spec.TemplateRef.Name}, &tpl); err != nil {
		return ""
	}
	key, err := pyenv.RequirementsKey(req.Requirements, tpl.Spec.Python.IndexURL, tpl.Spec.Python.ExtraIndexURLs)
	if err != nil {
		return ""
	}
	return key
}
