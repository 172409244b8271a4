package controller

import (
	"encoding/json"
	"slices"
	"strconv"
	"strings"

	corev1 "k8s.io/api/core/v1"
	"k8s.io/apimachinery/pkg/api/resource"

	"github.com/agentbox/terraform-provider-agentbox/internal/api/v1alpha1"
	"github.com/agentbox/terraform-provider-agentbox/internal/supervisor/supervisorapi"
)

// supervisorEnv carries the template's workspace size, environment, python
// policy and stdio MCP servers to the supervisor, as the variables its
// flags default from. Of the optional settings only what the template sets
// is passed, so that the supervisor's own defaults apply to the rest and a
// newer supervisor is not pinned to an older default.
func supervisorEnv(tpl *v1alpha1.SandboxTemplate) []corev1.EnvVar {
	py := tpl.Spec.Python
	size := workspaceSize(tpl)
	env := []corev1.EnvVar{
		// The supervisor refuses writes that would take the workspace's
		// files past this, and the filespace syncs (the idle stop's among
		// them) take it as the workspace's cap: the volume's size.
		{Name: "AGENTBOX_WORKSPACE_CAP", Value: strconv.FormatInt(size.Value(), 10)},
		// The supervisor passes only the variables named here from its
		// own environment to the processes it starts; the rest of it
		// (its AGENTBOX_ configuration) stays its own.
		{Name: "AGENTBOX_PASS_ENV", Value: passEnvNames(tpl)},
	}
	add := func(name, value string) {
		if value != "" {
			env = append(env, corev1.EnvVar{Name: name, Value: value})
		}
	}
	if py.DefaultTimeout.Duration > 0 {
		add("AGENTBOX_PYTHON_DEFAULT_TIMEOUT", py.DefaultTimeout.Duration.String())
	}
	if py.MaxTimeout.Duration > 0 {
		add("AGENTBOX_PYTHON_MAX_TIMEOUT", py.MaxTimeout.Duration.String())
	}
	add("AGENTBOX_PYTHON_INDEX", py.IndexURL)
	add("AGENTBOX_PYTHON_EXTRA_INDEXES", strings.Join(py.ExtraIndexURLs, ","))
	add("AGENTBOX_PYTHON_ALLOWED_PACKAGES", strings.Join(py.AllowedPackages, ","))
	if len(tpl.Spec.MCPServers) > 0 {
		servers := make([]supervisorapi.MCPServerConfig, len(tpl.Spec.MCPServers))
		for i, m := range tpl.Spec.MCPServers {
			servers[i] = supervisorapi.MCPServerConfig{Name: m.Name, Command: m.Command, Args: m.Args, Env: m.Env}
		}
		// Plain data: a marshal error cannot happen.
		b, _ := json.Marshal(servers)
		add("AGENTBOX_MCP_SERVERS_JSON", string(b))
	}
	return env
}

// workspaceSize is the size of the template's workspace volume.
func workspaceSize(tpl *v1alpha1.SandboxTemplate) resource.Quantity {
	if size := tpl.Spec.Workspace.Size; !size.IsZero() {
		return size
	}
	return defaultWorkspaceSize
}

// passEnvNames is the supervisor's AGENTBOX_PASS_ENV: the egress proxy's
// variables and the names of the template's env, whose values the pod has
// (literal or from Secrets and ConfigMaps), so that every process the agent
// starts sees the template's environment. Names starting with AGENTBOX_ are
// left out: they configure the supervisor (a template may set the knobs it
// does not reserve), and the supervisor refuses to pass them. The list is
// JSON, since a variable name may hold a comma.
func passEnvNames(tpl *v1alpha1.SandboxTemplate) string {
	names := slices.Clone(egressEnvNames)
	for _, e := range tpl.Spec.Env {
		if !strings.HasPrefix(e.Name, supervisorapi.ReservedEnvPrefix) && !slices.Contains(names, e.Name) {
			names = append(names, e.Name)
		}
	}
	// Plain strings: a marshal error cannot happen.
	b, _ := json.Marshal(names)
	return string(b)
}
