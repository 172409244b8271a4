package execute

import (
	"os"
	"strings"
	"syscall"

	"github.com/agentbox/terraform-provider-agentbox/internal/supervisor/procenv"
	"github.com/agentbox/terraform-provider-agentbox/internal/supervisor/runner"
	api "github.com/agentbox/terraform-provider-agentbox/internal/supervisor/supervisorapi"
)

// PreparePython checks a python_exec snippet and prepares it as a
// command, through the same preparation, process group, output cap and
// result as /v1/commands, so the two cannot drift apart in how they
// confine what they run.
func (x *Service) PreparePython(req *api.PythonRequest) (*runner.Spec, *api.Error) {
	if e := checkCode(req.Code); e != nil {
		return nil, e
	}
	if e := x.needPython(api.ToolPythonExec, req.Env); e != nil {
		return nil, e
	}
	return x.preparePython(x.opts.Python, req)
}

// checkCode checks a snippet's code, as python_exec and /v1/execute take
// it.
func checkCode(code string) *api.Error {
	switch {
	case strings.TrimSpace(code) == "":
		return api.Errorf(api.CodeInvalidArgument, "code must not be empty")
	case len(code) > api.MaxPythonCodeBytes:
		return api.Errorf(api.CodeInvalidArgument, "code is %d bytes, more than the %d python_exec accepts; write it to a file and run that as a command",
			len(code), api.MaxPythonCodeBytes)
	case strings.IndexByte(code, 0) >= 0:
		return api.Errorf(api.CodeInvalidArgument, "code contains a NUL byte")
	}
	return nil
}

// preparePython prepares req's code as a command run by python.
func (x *Service) preparePython(python string, req *api.PythonRequest) (*runner.Spec, *api.Error) {
	// The code travels as an argument rather than through a temporary file
	// or an inherited descriptor: nothing is left on disk to clean up, no
	// extra descriptor leaks into what the code starts, and tracebacks
	// name <string> rather than a host path. -u keeps output unbuffered,
	// so whatever a snippet printed before a timeout killed it is returned.
	return x.opts.Runner.Prepare(&api.CommandRequest{
		Command:        []string{python, "-u", "-c", req.Code},
		Cwd:            req.Cwd,
		Env:            req.Env,
		Stdin:          req.Stdin,
		TimeoutSeconds: req.TimeoutSeconds,
		MaxOutputBytes: req.MaxOutputBytes,
	}, x.opts.DefaultTimeout, x.opts.MaxTimeout)
}

// needPython is the answer to a call by tool when the interpreter is not
// where the call's commands would find it (the commands' PATH, or the
// call's own), as in a sandbox whose image has no Python (node, busybox,
// a distroless base): nil when it is there. Any image can be a sandbox,
// so this is a property of the template's image, not a fault: the
// message names the interpreter and the PATH searched, and what to do.
//
// The code is not_found, the supervisor's code for any missing program
// (a command naming one gets it too): no code says "the sandbox lacks
// what this call needs" more exactly. It is 404, never retried as a
// transient failure, and the Compute API passes it on as
// invalid_argument with this message.
func (x *Service) needPython(tool string, env map[string]string) *api.Error {
	pathEnv := x.opts.Runner.BaseEnv()["PATH"]
	if p, ok := env["PATH"]; ok {
		pathEnv = p
	}
	python := x.opts.Python
	if strings.Contains(python, "/") {
		if st, err := os.Stat(python); err == nil && st.Mode().IsRegular() && syscall.Access(python, 0x1 /* X_OK */) == nil {
			return nil
		}
		return api.Errorf(api.CodeNotFound, "%s needs the Python interpreter %s, and the sandbox image has none there; use an image with Python 3, or run code with run_command",
			tool, python)
	}
	if _, err := procenv.LookPath(python, pathEnv, x.opts.Runner.DefaultCwd()); err == nil {
		return nil
	}
	return api.Errorf(api.CodeNotFound, "%s needs %s on the sandbox image's PATH (%s), and the image has none; use an image with Python 3, or run code with run_command",
		tool, python, pathEnv)
}
