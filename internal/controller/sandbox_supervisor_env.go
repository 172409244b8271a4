package controller

import (
	"encoding/json"
	"strconv"
	"strings"

	corev1 "k8s.io/api/core/v1"
	"k8s.io/apimachinery/pkg/api/resource"

	"github.com/agentbox/terraform-provider-agentbox/internal/api/v1alpha1"
	"github.com/agentbox/terraform-provider-agentbox/internal/supervisor/supervisorapi"
)

// supervisorEnv carries the template's workspace size, environment, python
// policy and MCP servers to the supervisor, as the variables its
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
		// The supervisor passes its whole environment to the processes
		// it starts, but for its own configuration (AGENTBOX_*, GODEBUG)
		// and the API server's address kubelet injects: the image's ENV
		// (a PATH with its tools, JAVA_HOME, NODE_VERSION), the
		// template's env (literal or from Secrets and ConfigMaps, which
		// only the pod resolves), the proxy's variables and HOME.
		{Name: "AGENTBOX_PASS_ENV", Value: supervisorapi.PassAllEnv},
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
			servers[i] = supervisorapi.MCPServerConfig{Name: m.Name, Command: m.Command, Args: m.Args, Env: m.Env, URL: m.URL}
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
