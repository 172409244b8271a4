package holds

import (
	"context"

	apierrors "k8s.io/apimachinery/pkg/api/errors"
	"k8s.io/apimachinery/pkg/types"

	"github.com/agentbox/terraform-provider-agentbox/internal/api/v1alpha1"
	api "github.com/agentbox/terraform-provider-agentbox/internal/computeapi/client"
	"github.com/agentbox/terraform-provider-agentbox/internal/supervisor/pyenv"
)

// A pool lease may name the Python environment its runs will use. The
// sandboxes' environment inventories (v1alpha1.PythonEnvState, kept by the
// Compute API as it learns of builds and evictions) are in the cache with
// the sandboxes, so routing costs no call per lease: the free sandboxes
// are tried holders first, then those building it, then the rest, the
// longest-warmed first within each class.

// ValidatePoolEnv checks the environment a pool lease names, if any.
func ValidatePoolEnv(req api.AcquireLeaseRequest) *api.Error {
	switch {
	case req.EnvName != "" && len(req.Requirements) > 0:
		return api.Errorf(api.CodeInvalidArgument, "a pool lease names its environment by requirements or by env_name, not both")
	case req.EnvName != "":
		if err := pyenv.ValidName(req.EnvName); err != nil {
			return api.Errorf(api.CodeInvalidArgument, "env_name: %s", err)
		}
	case len(req.Requirements) > 0:
		if _, err := pyenv.ParseRequirements(req.Requirements); err != nil {
			return api.Errorf(api.CodeInvalidArgument, "requirements: %s", err)
		}
	}
	return nil
}

// poolEnvKey is the environment req routes by: its env_name, or the key
// its requirement set has in the pool's sandboxes (which depends on the
// package indexes of the pool's template). "" when req names none, or
// when the template cannot be read (the lease then goes unrouted rather
// than failing).
func (k *Keeper) poolEnvKey(ctx context.Context, ns, pool string, req api.AcquireLeaseRequest) string {
	if req.EnvName != "" {
		return req.EnvName
	}
	if len(req.Requirements) == 0 {
		return ""
	}
	var p v1alpha1.SandboxWarmPool
	if err := k.sandboxes.Get(ctx, types.NamespacedName{Namespace: ns, Name: pool}, &p); err != nil {
		if !apierrors.IsNotFound(err) {
			k.log.Error(err, "get warm pool", "namespace", ns, "pool", pool)
		}
		return ""
	}
	var tpl v1alpha1.SandboxTemplate
	if err := k.sandboxes.Get(ctx, types.NamespacedName{Namespace: ns, Name: p.Spec.TemplateRef.Name}, &tpl); err != nil {
		if !apierrors.IsNotFound(err) {
			k.log.Error(err, "get sandbox template", "namespace", ns, "template", p.Spec.TemplateRef.Name)
		}
		return ""
	}
	key, err := pyenv.RequirementsKey(req.Requirements, tpl.Spec.Python.IndexURL, tpl.Spec.Python.ExtraIndexURLs)
	if err != nil {
		// ValidatePoolEnv has refused what cannot be parsed.
		return ""
	}
	return key
}

// EnvRouting is the result of routing to sb by the environment key: hit
// when its inventory records the environment built, building when it
// records it being built, miss otherwise.
func EnvRouting(sb *v1alpha1.Sandbox, key string) string {
	switch v1alpha1.PythonEnvState(sb, key) {
	case v1alpha1.PythonEnvBuilt:
		return api.RoutingHit
	case v1alpha1.PythonEnvBuilding:
		return api.RoutingBuilding
	}
	return api.RoutingMiss
}

// RouteByEnv orders the free sandboxes (given longest-warmed first) for a
// lease asking for the environment key: those holding it, then those
// building it, then the rest, each class in the order given. An empty key
// leaves the order as it is.
func RouteByEnv(free []*v1alpha1.Sandbox, key string) []*v1alpha1.Sandbox {
	if key == "" {
		return free
	}
	out := make([]*v1alpha1.Sandbox, 0, len(free))
	for _, class := range []string{api.RoutingHit, api.RoutingBuilding, api.RoutingMiss} {
		for _, sb := range free {
			if EnvRouting(sb, key) == class {
				out = append(out, sb)
			}
		}
	}
	return out
}
