package execute

import (
	"github.com/agentbox/terraform-provider-agentbox/internal/supervisor/runner"

	"strings"

	api "github.com/agentbox/terraform-provider-agentbox/internal/supervisor/supervisorapi"
)

// PreparePython checks a python_exec snippet and prepares it as a
// command, through the same preparation, process group, output cap and
// result as /v1/commands, so the two cannot drift apart in how they
// confine what they run.
func (x *Service) PreparePython(req *api.PythonRequest) (*runner.Spec, *api.Error) {
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
	return x.opts.Runner.Prepare(&api.CommandRequest{
		Command:        []string{x.opts.Python, "-u", "-c", req.Code},
		Cwd:            req.Cwd,
		Env:            req.Env,
		Stdin:          req.Stdin,
		TimeoutSeconds: req.TimeoutSeconds,
		MaxOutputBytes: req.MaxOutputBytes,
	}, x.opts.DefaultTimeout, x.opts.MaxTimeout)
}
