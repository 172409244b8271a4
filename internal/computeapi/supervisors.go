package computeapi

import (
	toolscache "k8s.io/client-go/tools/cache"

	"github.com/agentbox/terraform-provider-agentbox/internal/computeapi/holds"
	"github.com/agentbox/terraform-provider-agentbox/internal/computeapi/supervisors"
)

// The connection pool to the sandboxes' supervisors is package
// supervisors'; these names keep the control plane's and the tests' way of
// making one.
type (
	// SupervisorDialer is supervisors.Dialer.
	SupervisorDialer = supervisors.Dialer
	// SupervisorPool is supervisors.Pool.
	SupervisorPool = supervisors.Pool
)

var (
	// NewSupervisorPool is supervisors.NewPool.
	NewSupervisorPool = supervisors.NewPool
	// StaticCertificate is supervisors.StaticCertificate.
	StaticCertificate = supervisors.StaticCertificate
)

// WarmPoolEvents returns the handler the control plane adds to its Sandbox
// informer, through which the API learns of the warm sandboxes to keep a
// connection open to (supervisors.Conns.PoolEvents). The first call starts
// the keeper; Close stops it.
func (s *Server) WarmPoolEvents() toolscache.ResourceEventHandler {
	return s.conns.PoolEvents(holds.Takeable)
}
