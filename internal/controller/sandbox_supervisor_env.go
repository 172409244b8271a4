package controller

import (
	"encoding/json"
	"strings"

	corev1 "k8s.io/api/core/v1"

	"github.com/agentbox/terraform-provider-agentbox/internal/api/v1alpha1"
	"github.com/agentbox/terraform-provider-agentbox/internal/supervisor/supervisorapi"
)

// supervisorAuditLog is where the supervisor appends its JSON-lines audit
// log inside the pod.
const supervisorAuditLog = "/tmp/agentbox-audit.jsonl"

// supervisorEnv carries the template's python policy and stdio MCP servers
// to the supervisor, as the variables its flags default from. Only what the
// template sets is passed, so that the supervisor's own defaults apply to
// the rest and a newer supervisor is not pinned to an older default.
func supervisorEnv(tpl *v1alpha1.SandboxTemplate) []corev1.EnvVar {
	py := tpl.Spec.Python
	var env []corev1.EnvVar
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
