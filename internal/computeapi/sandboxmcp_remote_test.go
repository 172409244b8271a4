package computeapi

import (
	"crypto/sha256"
	"encoding/hex"
	"testing"

	"github.com/agentbox/terraform-provider-agentbox/internal/api/v1alpha1"
)

// TestSandboxMCPConfigHashRemote: a remote server's catalog is keyed by its
// url, so a template pointed at another endpoint discovers its tools anew,
// and adding the field left the stdio servers' keys as they were.
func TestSandboxMCPConfigHashRemote(t *testing.T) {
	tpl := &v1alpha1.SandboxTemplate{Spec: v1alpha1.SandboxTemplateSpec{Image: "img"}}
	a := sandboxMCPConfigHash(tpl, v1alpha1.MCPServer{Name: "r", URL: "https://a.example.test/mcp"})
	b := sandboxMCPConfigHash(tpl, v1alpha1.MCPServer{Name: "r", URL: "https://b.example.test/mcp"})
	if a == b {
		t.Error("two remote servers' urls give the same catalog key")
	}
	// A stdio server's key is what it was before url existed: the hash of
	// the same JSON, without a url member.
	sum := sha256.Sum256([]byte(`{"image":"img","server":{"name":"calc","command":"calc"}}`))
	if got := sandboxMCPConfigHash(tpl, v1alpha1.MCPServer{Name: "calc", Command: "calc"}); got != hex.EncodeToString(sum[:]) {
		t.Errorf("a stdio server's catalog key changed: %s", got)
	}
}

// TestMCPServerAudienceRemote: a remote server's tokens are for its url
// unless the template names an audience.
func TestMCPServerAudienceRemote(t *testing.T) {
	if got := mcpServerAudience(v1alpha1.MCPServer{Name: "r", URL: "https://a.example.test/mcp"}); got != "https://a.example.test/mcp" {
		t.Errorf("a remote server's default audience %q, want its url", got)
	}
	if got := mcpServerAudience(v1alpha1.MCPServer{Name: "r", URL: "https://a.example.test/mcp", Audience: "api://a"}); got != "api://a" {
		t.Errorf("a remote server's audience %q, want api://a", got)
	}
}
