package controller

import (
	"reflect"
	"testing"
	"time"

	corev1 "k8s.io/api/core/v1"
	"k8s.io/apimachinery/pkg/api/resource"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/utils/ptr"

	"github.com/agentbox/terraform-provider-agentbox/internal/api/v1alpha1"
	"github.com/agentbox/terraform-provider-agentbox/internal/supervisor/mcpbridge"
)

// TestUnitSupervisorEnv checks that the template's python policy and MCP
// servers reach the supervisor in the form its own parser reads, and that
// a template cannot override them through its env.
func TestUnitSupervisorEnv(t *testing.T) {
	r := &SandboxReconciler{Namespace: "platform", TrustDomain: "td.example"}
	tpl := unitTemplate("t")
	tpl.Spec.Env = []corev1.EnvVar{
		{Name: "AGENTBOX_AUDIT_LOG", Value: "/workspace/hide-here"},
		{Name: "AGENTBOX_WORKSPACE_CAP", Value: "100GiB"},
		{Name: "AGENTBOX_PASS_ENV", Value: "AGENTBOX_TLS_DIR"},
	}
	tpl.Spec.Workspace.Size = resource.MustParse("2Gi")
	tpl.Spec.Python = v1alpha1.PythonPolicy{
		DefaultTimeout:  metav1.Duration{Duration: 20 * time.Second},
		MaxTimeout:      metav1.Duration{Duration: 90 * time.Second},
		IndexURL:        "https://pypi.internal.test/simple",
		ExtraIndexURLs:  []string{"https://a.test/simple", "https://b.test/simple"},
		TrustedHosts:    []string{"a.test", "b.test:8080"},
		AllowedPackages: []string{"numpy", "pandas"},
		Environments:    &v1alpha1.PythonEnvironments{MaxCount: 3, MaxSize: ptr.To(resource.MustParse("300Mi")), TTL: &metav1.Duration{Duration: 90 * time.Minute}},
	}
	tpl.Spec.Workspace.MountPath = "/home/agent"
	tpl.Spec.MCPServers = []v1alpha1.MCPServer{{Name: "fs", Command: "mcp-fs", Args: []string{"/workspace"}, Env: map[string]string{"K": "v"}},
		{Name: "remote", URL: "https://mcp.example.test/mcp"}}
	env := map[string]string{}
	for _, e := range r.podEnv(unitSandbox("s", "t"), tpl) {
		if _, dup := env[e.Name]; dup {
			t.Errorf("%s set twice", e.Name)
		}
		env[e.Name] = e.Value
	}
	want := map[string]string{
		"AGENTBOX_AUDIT_LOG":               "",
		"AGENTBOX_WORKSPACE_CAP":           "2147483648",
		"AGENTBOX_PYTHON_DEFAULT_TIMEOUT":  "20s",
		"AGENTBOX_PYTHON_MAX_TIMEOUT":      "1m30s",
		"AGENTBOX_PYTHON_INDEX":            "https://pypi.internal.test/simple",
		"AGENTBOX_PYTHON_EXTRA_INDEXES":    "https://a.test/simple,https://b.test/simple",
		"AGENTBOX_PYTHON_TRUSTED_HOSTS":    "a.test,b.test:8080",
		"AGENTBOX_PYTHON_ALLOWED_PACKAGES": "numpy,pandas",
		"AGENTBOX_ENV_DIR":                 "/home/agent/.agentbox/envs",
		"AGENTBOX_ENV_MAX_COUNT":           "3",
		"AGENTBOX_ENV_MAX_SIZE":            "314572800",
		"AGENTBOX_ENV_TTL":                 "1h30m0s",
	}
	for k, v := range want {
		if env[k] != v {
			t.Errorf("%s = %q, want %q", k, env[k], v)
		}
	}
	servers, err := mcpbridge.ParseServers([]byte(env["AGENTBOX_MCP_SERVERS_JSON"]))
	if err != nil {
		t.Fatalf("the supervisor cannot read the MCP servers the controller wrote: %v", err)
	}
	if wantS := []mcpbridge.ServerConfig{{Name: "fs", Command: "mcp-fs", Args: []string{"/workspace"}, Env: map[string]string{"K": "v"}},
		{Name: "remote", URL: "https://mcp.example.test/mcp"}}; !reflect.DeepEqual(servers, wantS) {
		t.Errorf("MCP servers %+v, want %+v", servers, wantS)
	}

	// A template that sets nothing passes nothing optional, so the
	// supervisor's defaults apply; the workspace's cap is always its size,
	// and the environments always live on the workspace volume, bounded to
	// half of it.
	envDefaults := map[string]string{
		"AGENTBOX_ENV_DIR":       "/workspace/.agentbox/envs",
		"AGENTBOX_ENV_MAX_COUNT": "8",
		"AGENTBOX_ENV_MAX_SIZE":  "536870912",
		"AGENTBOX_ENV_TTL":       "168h0m0s",
	}
	for _, e := range r.podEnv(unitSandbox("s", "t"), unitTemplate("t")) {
		if v, ok := envDefaults[e.Name]; ok {
			if e.Value != v {
				t.Errorf("a template without environments: %s = %q, want %q", e.Name, e.Value, v)
			}
			delete(envDefaults, e.Name)
			continue
		}
		if e.Name == "AGENTBOX_WORKSPACE_CAP" {
			if e.Value != "1073741824" {
				t.Errorf("a template without a size: cap %q, want the default 1Gi", e.Value)
			}
			continue
		}
		if _, ok := want[e.Name]; ok && e.Name != "AGENTBOX_AUDIT_LOG" {
			t.Errorf("empty template sets %s=%q", e.Name, e.Value)
		}
		if e.Name == "AGENTBOX_MCP_SERVERS_JSON" {
			t.Errorf("empty template sets MCP servers %q", e.Value)
		}
	}
	if len(envDefaults) > 0 {
		t.Errorf("a template without environments does not set %v", envDefaults)
	}
}
