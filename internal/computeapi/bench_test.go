package computeapi_test

import (
	"context"
	"path/filepath"
	"testing"

	"github.com/agentbox/terraform-provider-agentbox/internal/computeapi/apitest"
	api "github.com/agentbox/terraform-provider-agentbox/internal/computeapi/client"
	"github.com/agentbox/terraform-provider-agentbox/internal/store"
	"github.com/agentbox/terraform-provider-agentbox/internal/supervisor/supervisorapi"
)

// BenchmarkRunCommandTrue prices what the API adds to a command on the
// host, where nothing else (gVisor, the pod network) blurs it: `true`
// through the API, with an agent token from the store and the audit,
// against the same supervisor called directly. Run the two sub-benchmarks
// in one run and compare their ns/op.
func BenchmarkRunCommandTrue(b *testing.B) {
	st, err := store.Open(context.Background(), filepath.Join(b.TempDir(), "agentbox.db"), store.Options{})
	if err != nil {
		b.Fatal(err)
	}
	s, err := apitest.NewServer(apitest.Options{Store: st})
	if err != nil {
		b.Fatal(err)
	}
	defer func() { s.Close(); st.Close() }()
	ctx := context.Background()
	admin, err := s.Client(s.AdminToken)
	if err != nil {
		b.Fatal(err)
	}
	tok, err := admin.CreateToken(ctx, api.CreateTokenRequest{Kind: api.TokenKindAgent, AgentID: s.AgentID})
	if err != nil {
		b.Fatal(err)
	}
	agent, err := s.Client(tok.Token)
	if err != nil {
		b.Fatal(err)
	}
	direct, err := s.SupervisorClient()
	if err != nil {
		b.Fatal(err)
	}
	req := api.RunCommandRequest{Command: []string{"true"}}
	b.Run("api", func(b *testing.B) {
		for b.Loop() {
			if res, err := agent.RunCommand(ctx, s.AgentID, req); err != nil || res.ExitCode != 0 {
				b.Fatalf("%+v, %v", res, err)
			}
		}
	})
	b.Run("supervisor", func(b *testing.B) {
		for b.Loop() {
			if res, err := direct.RunCommand(ctx, supervisorapi.CommandRequest{Command: req.Command}); err != nil || res.ExitCode != 0 {
				b.Fatalf("%+v, %v", res, err)
			}
		}
	})
}
