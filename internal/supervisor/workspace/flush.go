package workspace

import (
	"golang.org/x/sys/unix"

	api "github.com/agentbox/terraform-provider-agentbox/internal/supervisor/supervisorapi"
)

// Flush writes the workspace file system's dirty data to its volume. Under
// gVisor, writes sit in the sentry's page cache until synced, and a CSI
// snapshot of the volume sees only what reached the host; syncfs on the
// workspace asks for exactly that file system, not every mount.
func (ws *Workspace) Flush() *api.Error {
	dir, err := ws.root.Open(".")
	if err != nil {
		return api.Errorf(api.CodeInternal, "open workspace: %v", err)
	}
	defer dir.Close()
	if err := unix.Syncfs(int(dir.Fd())); err != nil {
		return api.Errorf(api.CodeInternal, "sync workspace: %v", err)
	}
	return nil
}
