package supervisor

import (
	"net/http"
	"strings"

	api "github.com/agentbox/terraform-provider-agentbox/internal/supervisor/supervisorapi"
)

// handlePython serves python_exec. A snippet is run as a command, through
// the same preparation, process group, output cap and result as
// /v1/commands, so the two cannot drift apart in how they confine what
// they run.
func (s *Server) handlePython(w http.ResponseWriter, r *http.Request, info *requestInfo) {
	var req api.PythonRequest
	if !s.decodeRequest(w, r, info, &req) {
		return
	}
	info.program = s.cfg.Python
	spec, apiErr := s.preparePython(&req)
	s.execute(w, r, info, spec, apiErr)
}

func (s *Server) preparePython(req *api.PythonRequest) (*commandSpec, *api.Error) {
	switch {
	case strings.TrimSpace(req.Code) == "":
		return nil, api.Errorf(api.CodeInvalidArgument, "code must not be empty")
	case len(req.Code) > api.MaxPythonCodeBytes:
		return nil, api.Errorf(api.CodeInvalidArgument, "code is %d bytes, more than the %d python_exec accepts; write it to a file and run that as a command",
			len(req.Code), api.MaxPythonCodeBytes)
	case strings.IndexByte(req.Code, 0) >= 0:
		return nil, api.Errorf(api.CodeInvalidArgument, "code contains a NUL byte")
	}
	// The code travels as an argument rather than through a temporary file
	// or an inherited descriptor: nothing is left on disk to clean up, no
	// extra descriptor leaks into what the code starts, and tracebacks
	// name <string> rather than a host path. -u keeps output unbuffered,
	// so whatever a snippet printed before a timeout killed it is returned.
	return s.prepare(&api.CommandRequest{
		Command:        []string{s.cfg.Python, "-u", "-c", req.Code},
		Cwd:            req.Cwd,
		Env:            req.Env,
		Stdin:          req.Stdin,
		TimeoutSeconds: req.TimeoutSeconds,
		MaxOutputBytes: req.MaxOutputBytes,
	}, s.cfg.PythonDefaultTimeout, s.cfg.PythonMaxTimeout)
}
