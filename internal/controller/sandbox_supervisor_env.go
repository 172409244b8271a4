package controller

import (
	"encoding/json"
	"path"
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
	add("AGENTBOX_PYTHON_TRUSTED_HOSTS", strings.Join(py.TrustedHosts, ","))
	add("AGENTBOX_PYTHON_ALLOWED_PACKAGES", strings.Join(py.AllowedPackages, ","))
	env = append(env, pythonEnvironmentsEnv(tpl, size)...)
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

// pythonEnvironmentsEnv places the cached Python environments on the
// workspace volume, in its platform directory, so that an idle stop's
// snapshot carries them and a resumed sandbox finds them at the same
// absolute path (a venv embeds it), and bounds them by the template or the
// defaults. They are always passed, because the supervisor's own defaults
// are for its temporary directory: its size default could fill a small
// workspace volume, where the environments count like every other file.
func pythonEnvironmentsEnv(tpl *v1alpha1.SandboxTemplate, workspace resource.Quantity) []corev1.EnvVar {
	count := int32(v1alpha1.DefaultPythonEnvironmentsMaxCount)
	// Half the volume by default: the agent's files keep the other half.
	maxSize := workspace.Value() / 2
	ttl := v1alpha1.DefaultPythonEnvironmentsTTL
	if e := tpl.Spec.Python.Environments; e != nil {
		if e.MaxCount > 0 {
			count = e.MaxCount
		}
		if e.MaxSize != nil && !e.MaxSize.IsZero() {
			maxSize = e.MaxSize.Value()
		}
		if e.TTL != nil && e.TTL.Duration > 0 {
			ttl = e.TTL.Duration
		}
	}
	return []corev1.EnvVar{
		{Name: "AGENTBOX_ENV_DIR", Value: path.Join(workspaceMountPath(tpl), supervisorapi.EnvsDir)},
		{Name: "AGENTBOX_ENV_MAX_COUNT", Value: strconv.Itoa(int(count))},
		{Name: "AGENTBOX_ENV_MAX_SIZE", Value: strconv.FormatInt(maxSize, 10)},
		{Name: "AGENTBOX_ENV_TTL", Value: ttl.String()},
	}
}

// workspaceSize is the size of the template's workspace volume.
func workspaceSize(tpl *v1alpha1.SandboxTemplate) resource.Quantity {
	if size := tpl.Spec.Workspace.Size; !size.IsZero() {
		return size
	}
	return defaultWorkspaceSize
}
