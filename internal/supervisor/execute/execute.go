// Package execute runs Python for the supervisor's callers: /v1/execute's
// runs, each in a fresh directory with its inline files, optionally in a
// cached Python environment (pyenv, managed through /v1/envs), and the
// snippets of python_exec, which /v1/execute checks its code by.
package execute

import (
	"log/slog"

	"github.com/agentbox/terraform-provider-agentbox/internal/supervisor/httpcall"
	"github.com/agentbox/terraform-provider-agentbox/internal/supervisor/runner"

	"context"
	"errors"
	"io"
	"io/fs"
	"net/http"
	"os"
	"path"
	"path/filepath"
	"slices"
	"strings"
	"syscall"
	"time"

	"github.com/agentbox/terraform-provider-agentbox/internal/supervisor/procenv"
	"github.com/agentbox/terraform-provider-agentbox/internal/supervisor/pyenv"
	api "github.com/agentbox/terraform-provider-agentbox/internal/supervisor/supervisorapi"
)

// Where a run's files live. Every /v1/execute run gets a fresh private
// directory under ExecuteConfig.RunDir (by default $TMPDIR/agentbox-runs,
// /tmp being the pod's emptyDir), holding the request's inline files; it
// is the code's working directory and is removed when the response has
// been built. Not a directory in the workspace, because:
//   - /v1/execute is stateless: files go in with the request and
//     come back in the response, so nothing needs to outlive the run;
//   - in the workspace they would count against its 1 GB cap, be written
//     to its volume and snapshotted at idle stop, and could overwrite the
//     agent's own files;
//   - "files produced" must be exactly what this run created or changed,
//     and the workspace is shared with other commands and background
//     processes writing at the same time; a directory nobody else knows is
//     not.
//
// The workspace stays reachable by its absolute path (and as HOME).

// Defaults for Config's zero values.
const (
	// DefaultMaxFileBytes bounds one produced file returned.
	DefaultMaxFileBytes = 10 << 20
	// DefaultMaxFilesBytes bounds all produced files returned by one
	// run; base64 makes them a third larger in the response, which stays
	// under the client's DefaultMaxResponseBytes.
	DefaultMaxFilesBytes = 32 << 20
	// maxOmittedListed bounds the files_omitted list itself.
	maxOmittedListed = 100
	// maxRunWalk bounds the entries looked at when collecting a run's
	// files, so a run that creates a million files cannot stall the
	// response.
	maxRunWalk     = 100_000
	maxFilePathLen = 1024
)

// Config configures /v1/execute and /v1/envs.
type Config struct {
	// Envs, when set, enables the cached Python environments. Its Run,
	// Python, Env and Logger are filled in by New (Python is
	// Options.Python, looked up in the commands' PATH). Without it, runs that name
	// requirements or an environment are refused as unavailable.
	Envs *pyenv.Config
	// UV is uv's name (looked up in the commands' PATH) or path. When it
	// is found, environments are built with uv, else with venv and pip.
	// Empty means pip always.
	UV string
	// RunDir holds the runs' directories. Empty means
	// $TMPDIR/agentbox-runs.
	RunDir string
	// MaxFileBytes and MaxFilesBytes bound one produced file and all of a
	// run's produced files that are returned; the others are listed as
	// omitted. Zero means the defaults.
	MaxFileBytes  int64
	MaxFilesBytes int64
}

// Options is what the runs need of the supervisor.
type Options struct {
	// Runner starts the runs and the environments' build steps.
	Runner *runner.Runner
	// Acquire takes one of the supervisor's concurrent-command slots,
	// waiting its turn.
	Acquire func(context.Context) (release func(), _ *api.Error)
	// Python is the interpreter python_exec and environment-less runs use.
	Python string
	// DefaultTimeout and MaxTimeout bound a Python run.
	DefaultTimeout, MaxTimeout time.Duration
	// MaxRequestBytes bounds a request body.
	MaxRequestBytes int64
	Log             *slog.Logger
}

// Service serves /v1/execute and /v1/envs.
type Service struct {
	cfg  Config
	opts Options
	envs *pyenv.Manager
	// envsOff says why envs is nil.
	envsOff string
	// uv is the uv environments are built with, "" if pip builds them.
	uv     string
	runDir string
}

// New sets up the run directory and the environment cache. A cache that
// cannot start (its directory is held by another supervisor, say) is
// logged and left off rather than failing the supervisor: every other
// endpoint still works.
func New(c Config, opts Options) *Service {
	if c.MaxFileBytes <= 0 {
		c.MaxFileBytes = DefaultMaxFileBytes
	}
	if c.MaxFilesBytes <= 0 {
		c.MaxFilesBytes = DefaultMaxFilesBytes
	}
	x := &Service{cfg: c, opts: opts, runDir: c.RunDir}
	if x.runDir == "" {
		x.runDir = filepath.Join(os.TempDir(), "agentbox-runs")
	}
	if c.Envs == nil {
		x.envsOff = "this supervisor keeps no Python environments"
		return x
	}
	rn := opts.Runner
	pc := *c.Envs
	pc.Run = x.runBuildStep
	pc.Python = opts.Python
	pc.Env = procenv.List(rn.BaseEnv())
	if pc.Logger == nil {
		pc.Logger = opts.Log
	}
	if c.UV != "" {
		if p, err := procenv.LookPath(c.UV, rn.BaseEnv()["PATH"], rn.DefaultCwd()); err == nil {
			pc.UV, x.uv = p, p
		} else {
			opts.Log.Info("uv not found; Python environments are built with venv and pip", "uv", c.UV)
		}
	}
	m, err := pyenv.New(pc)
	if err != nil {
		opts.Log.Warn("Python environments are off", "error", err.Error())
		x.envsOff = "the Python environment cache is off: " + err.Error()
		return x
	}
	x.envs = m
	return x
}

// RunDir is where the runs' directories are made.
func (x *Service) RunDir() string { return x.runDir }

// Close stops the environment cache's builds.
func (x *Service) Close() error {
	if x.envs == nil {
		return nil
	}
	return x.envs.Close()
}

// runBuildStep is the pyenv Runner: build steps go through the same Run
// path as commands, so they get their own process group, are tracked for
// Terminate and registered with the reaper, and are killed whole when the
// build is cancelled or times out.
func (x *Service) runBuildStep(ctx context.Context, argv, env []string, dir string, stdout, stderr io.Writer) (int, error) {
	pathEnv := ""
	for _, kv := range env {
		if v, ok := strings.CutPrefix(kv, "PATH="); ok {
			pathEnv = v
		}
	}
	exe, apiErr := runner.LookPath(argv[0], pathEnv, dir)
	if apiErr != nil {
		return -1, apiErr
	}
	timeout := 24 * time.Hour
	if dl, ok := ctx.Deadline(); ok {
		timeout = time.Until(dl)
	}
	if timeout <= 0 {
		return -1, context.DeadlineExceeded
	}
	res, apiErr := x.opts.Runner.Run(ctx, &runner.Spec{Path: exe, Argv: argv, Dir: dir, Env: env, Timeout: timeout}, stdout, stderr)
	if apiErr != nil {
		return -1, apiErr
	}
	return res.ExitCode, nil
}

// ServeExecute serves POST /v1/execute.
func (x *Service) ServeExecute(w http.ResponseWriter, r *http.Request, info *httpcall.Info) {
	var req api.ExecuteRequest
	if !info.Decode(w, r, x.opts.MaxRequestBytes, &req) {
		return
	}
	info.Program = x.opts.Python
	// Everything about the request is checked before an environment is
	// built for it.
	if e := x.checkExecute(&req); e != nil {
		info.Fail(w, e)
		return
	}
	res := &api.ExecuteResult{FilesProduced: map[string][]byte{}}
	python, env, pin, e := x.pythonFor(r.Context(), &req, res)
	if pin != nil {
		defer pin.Release()
	}
	if e != nil {
		info.Fail(w, e)
		return
	}
	dir, root, e := x.newRun(req.Files)
	if dir != "" {
		defer os.RemoveAll(dir)
	}
	if root != nil {
		defer root.Close()
	}
	if e != nil {
		info.Fail(w, e)
		return
	}
	cres, e := x.runCode(r.Context(), &req, python, dir, env)
	if e != nil {
		info.Fail(w, e)
		return
	}
	info.Result = cres
	fillResult(res, cres)
	if err := x.collectFiles(root, req.Files, res); err != nil {
		info.Fail(w, api.Errorf(api.CodeInternal, "collecting the run's files: %v", err))
		return
	}
	httpcall.WriteJSON(w, http.StatusOK, res)
}

// pythonFor is the interpreter and environment the run's code gets: the
// sandbox's python3, or that of the environment the request names or
// describes, which is built if need be and pinned until the run is done.
func (x *Service) pythonFor(ctx context.Context, req *api.ExecuteRequest, res *api.ExecuteResult) (string, map[string]string, *pyenv.Pin, *api.Error) {
	env := map[string]string{"PYTHONDONTWRITEBYTECODE": "1"}
	for k, v := range req.Env {
		env[k] = v
	}
	// python_index only matters to a build: without requirements or a
	// name there is none, and the sandbox's python3 runs the code.
	if len(req.Requirements) == 0 && req.EnvName == "" {
		return x.opts.Python, env, nil, nil
	}
	if x.envs == nil {
		return "", nil, nil, api.Errorf(api.CodeUnavailable, "%s; run without requirements and env_name", x.envsOff)
	}
	start := time.Now()
	pin, created, err := x.envs.Ensure(ctx, pyenv.Request{Name: req.EnvName, Requirements: req.Requirements, IndexURL: req.PythonIndex})
	res.EnvSetupMS = time.Since(start).Milliseconds()
	if err != nil {
		return "", nil, nil, envError(err)
	}
	ei := pin.Info()
	res.Env = &api.ExecuteEnv{Name: ei.Name, Created: created, Packages: nonNil(ei.Packages), PythonVersion: ei.PythonVersion}
	// As activating the environment would: what the code starts
	// (python, pip-installed scripts) is the environment's too.
	pathEnv := x.opts.Runner.BaseEnv()["PATH"]
	if p, ok := req.Env["PATH"]; ok {
		pathEnv = p
	}
	env["VIRTUAL_ENV"] = pin.Dir()
	env["PATH"] = filepath.Join(pin.Dir(), "bin") + string(filepath.ListSeparator) + pathEnv
	return pin.Python(), env, pin, nil
}

// runCode runs the request's code with python in dir, in one of the
// concurrent-command slots, and kills whatever it left running.
func (x *Service) runCode(ctx context.Context, req *api.ExecuteRequest, python, dir string, env map[string]string) (*api.CommandResult, *api.Error) {
	rn := x.opts.Runner
	spec, apiErr := rn.Prepare(&api.CommandRequest{
		Command:        []string{python, "-u", "-c", req.Code},
		Cwd:            dir,
		Env:            env,
		Stdin:          req.Stdin,
		TimeoutSeconds: req.TimeoutSeconds,
		MaxOutputBytes: req.MaxOutputBytes,
	}, x.opts.DefaultTimeout, x.opts.MaxTimeout)
	if apiErr != nil {
		return nil, apiErr
	}
	release, apiErr := x.opts.Acquire(ctx)
	if apiErr != nil {
		return nil, apiErr
	}
	defer release()

	out := runner.NewOutput(spec.MaxOutput)
	ctx, cancel := runner.WithTimeout(ctx, spec.Timeout)
	defer cancel()
	p, apiErr := rn.Spawn(ctx, spec, out.Stdout(), out.Stderr())
	if apiErr != nil {
		return nil, apiErr
	}
	pgid := p.Pid()
	cres, apiErr := rn.Wait(ctx, p)
	// Unlike a command, a run leaves nothing behind: its directory is about
	// to go, and its files are read only once nothing can still be writing
	// them.
	_ = syscall.Kill(-pgid, syscall.SIGKILL)
	if apiErr != nil {
		return nil, apiErr
	}
	cres.Stdout, cres.Stderr, cres.Truncated = out.Result()
	return cres, nil
}

// fillResult puts how the code ended into res.
func fillResult(res *api.ExecuteResult, cres *api.CommandResult) {
	res.Output, res.Stderr, res.ExitCode = cres.Stdout, cres.Stderr, cres.ExitCode
	res.Signal, res.TimedOut, res.Truncated = cres.Signal, cres.TimedOut, cres.Truncated
	res.ExecutionTimeMS = cres.DurationMS
	switch {
	case cres.TimedOut:
		res.Status = api.ExecuteTimeout
	case cres.ExitCode == 0:
		res.Status = api.ExecuteSuccess
	default:
		res.Status = api.ExecuteError
	}
}

// checkExecute validates what can be checked before anything is built or
// written, with the same rules as python_exec for the code and limits.
func (x *Service) checkExecute(req *api.ExecuteRequest) *api.Error {
	if req.ToolName != "" && req.ToolName != api.ToolPythonExecute {
		return api.Errorf(api.CodeInvalidArgument, "tool_name %q: %s runs only %q", req.ToolName, api.PathExecute, api.ToolPythonExecute)
	}
	if len(req.Files) > api.MaxExecuteFiles {
		return api.Errorf(api.CodeInvalidArgument, "%d files, more than the %d a run takes; put larger sets in the workspace", len(req.Files), api.MaxExecuteFiles)
	}
	for name := range req.Files {
		if e := checkRunPath(name); e != nil {
			return e
		}
	}
	if req.EnvName != "" {
		if err := pyenv.ValidName(req.EnvName); err != nil {
			return api.Errorf(api.CodeInvalidArgument, "env_name: %v", err)
		}
	}
	if _, err := pyenv.ParseRequirements(req.Requirements); err != nil {
		return api.Errorf(api.CodeInvalidArgument, "requirements: %v", err)
	}
	if e := checkCode(req.Code); e != nil {
		return e
	}
	// An environment is built from the base interpreter too, unless uv
	// builds it, which can find or fetch a Python of its own.
	if (len(req.Requirements) == 0 && req.EnvName == "") || x.uv == "" {
		if e := x.needPython(api.ToolPythonExecute, req.Env); e != nil {
			return e
		}
	}
	// The timeout, output cap and environment, as python_exec takes them;
	// the interpreter is resolved again for the real run.
	_, e := x.preparePython(x.opts.Python, &api.PythonRequest{
		Code: req.Code, Stdin: req.Stdin, Env: req.Env, TimeoutSeconds: req.TimeoutSeconds, MaxOutputBytes: req.MaxOutputBytes,
	})
	if e != nil && e.Code == api.CodeNotFound {
		// The interpreter, whose absence needPython has ruled on: a run
		// in an environment built by uv does not need it.
		return nil
	}
	return e
}

// checkRunPath accepts a relative, clean path that stays in the run's
// directory, in slash form as sent.
func checkRunPath(name string) *api.Error {
	switch {
	case strings.IndexByte(name, 0) >= 0:
		return api.Errorf(api.CodeInvalidArgument, "file name %q contains a NUL byte", name)
	case len(name) > maxFilePathLen:
		return api.Errorf(api.CodeInvalidArgument, "file name %.40q... is longer than %d bytes", name, maxFilePathLen)
	case name == "" || name == ".":
		return api.Errorf(api.CodeInvalidArgument, "file name must not be empty")
	case path.IsAbs(name) || !filepath.IsLocal(name):
		return api.Errorf(api.CodePathEscapesWorkspace, "file name %q must be a relative path inside the run's directory", name)
	case path.Clean(name) != name:
		return api.Errorf(api.CodeInvalidArgument, "file name %q is not clean; send %q", name, path.Clean(name))
	}
	return nil
}

// newRun makes the run's directory and writes the inline files into it.
// The directory is returned whenever it was made, for the caller to
// remove.
func (x *Service) newRun(files map[string][]byte) (string, *os.Root, *api.Error) {
	if err := os.MkdirAll(x.runDir, 0o700); err != nil {
		return "", nil, api.Errorf(api.CodeInternal, "run directory: %v", err)
	}
	dir, err := os.MkdirTemp(x.runDir, "run-")
	if err != nil {
		return "", nil, api.Errorf(api.CodeInternal, "run directory: %v", err)
	}
	root, err := os.OpenRoot(dir)
	if err != nil {
		return dir, nil, api.Errorf(api.CodeInternal, "run directory: %v", err)
	}
	names := make([]string, 0, len(files))
	for n := range files {
		names = append(names, n)
	}
	slices.Sort(names)
	for _, n := range names {
		if d := path.Dir(n); d != "." {
			if err := root.MkdirAll(d, 0o755); err != nil {
				return dir, root, runFileError(n, err)
			}
		}
		if err := root.WriteFile(n, files[n], 0o644); err != nil {
			return dir, root, runFileError(n, err)
		}
	}
	return dir, root, nil
}

func runFileError(name string, err error) *api.Error {
	var errno syscall.Errno
	if errors.As(err, &errno) && (errno == syscall.ENOSPC || errno == syscall.EDQUOT) {
		return api.Errorf(api.CodeWorkspaceFull, "writing %q: %v", name, err)
	}
	if errors.Is(err, fs.ErrExist) || errors.As(err, &errno) && (errno == syscall.ENOTDIR || errno == syscall.EISDIR) {
		return api.Errorf(api.CodeInvalidArgument, "file %q collides with another file's directory", name)
	}
	return api.Errorf(api.CodeInternal, "writing %q: %v", name, err)
}

// collectFiles puts the regular files the run created or changed into
// res, in path order, within the caps; the rest are listed as omitted.
func (x *Service) collectFiles(root *os.Root, inputs map[string][]byte, res *api.ExecuteResult) error {
	maxFile, budget := x.cfg.MaxFileBytes, x.cfg.MaxFilesBytes
	omit := func(p string, size int64, reason string) {
		if len(res.FilesOmitted) < maxOmittedListed {
			res.FilesOmitted = append(res.FilesOmitted, api.OmittedFile{Path: p, SizeBytes: size, Reason: reason})
		}
	}
	seen := 0
	return fs.WalkDir(root.FS(), ".", func(p string, d fs.DirEntry, err error) error {
		if err != nil {
			// A directory the code made unreadable is skipped, not fatal.
			if p != "." {
				return nil
			}
			return err
		}
		if seen++; seen > maxRunWalk {
			omit(p, 0, "too_many_files")
			return fs.SkipAll
		}
		if d.IsDir() {
			return nil
		}
		if !d.Type().IsRegular() {
			omit(p, 0, "not_regular")
			return nil
		}
		data, size, err := readRunFile(root, p, maxFile)
		if err != nil {
			return nil // gone or unreadable: nothing to return
		}
		if in, ok := inputs[p]; ok && data != nil && string(in) == string(data) {
			return nil
		}
		switch {
		case data == nil:
			omit(p, size, "file_too_large")
		case len(res.FilesProduced) >= api.MaxExecuteFiles:
			omit(p, size, "too_many_files")
		case size > budget:
			omit(p, size, "total_too_large")
		default:
			res.FilesProduced[p] = data
			budget -= size
		}
		return nil
	})
}

// readRunFile reads a regular file of at most limit bytes; a larger one
// gives nil data and its size. It opens without blocking and checks the
// type on the open file, so a file swapped for a FIFO or device after the
// walk is not read.
func readRunFile(root *os.Root, p string, limit int64) ([]byte, int64, error) {
	f, err := root.OpenFile(p, os.O_RDONLY|syscall.O_NONBLOCK, 0)
	if err != nil {
		return nil, 0, err
	}
	defer f.Close()
	fi, err := f.Stat()
	if err != nil {
		return nil, 0, err
	}
	if !fi.Mode().IsRegular() {
		return nil, 0, errors.New("not a regular file")
	}
	if fi.Size() > limit {
		return nil, fi.Size(), nil
	}
	data, err := io.ReadAll(io.LimitReader(f, limit+1))
	if err != nil {
		return nil, 0, err
	}
	if int64(len(data)) > limit {
		return nil, int64(len(data)), nil
	}
	return data, int64(len(data)), nil
}

func nonNil(s []string) []string {
	if s == nil {
		return []string{}
	}
	return s
}

// envError turns an error of the environment cache into the API's.
func envError(err error) *api.Error {
	var pe *pyenv.Error
	if !errors.As(err, &pe) {
		if errors.Is(err, context.Canceled) || errors.Is(err, context.DeadlineExceeded) {
			return api.Errorf(api.CodeUnavailable, "%v", err)
		}
		return api.Errorf(api.CodeInternal, "%v", err)
	}
	code := api.CodeInternal
	switch pe.Kind {
	case pyenv.KindInvalid:
		code = api.CodeInvalidArgument
	case pyenv.KindNotAllowed:
		code = api.CodePermissionDenied
	case pyenv.KindNotFound:
		code = api.CodeNotFound
	case pyenv.KindBuildFailed:
		code = api.CodeEnvBuildFailed
	case pyenv.KindTimeout:
		code = api.CodeTimeout
	case pyenv.KindTooLarge, pyenv.KindBusy:
		code = api.CodeResourceExhausted
	case pyenv.KindUnavailable:
		code = api.CodeUnavailable
	}
	return api.Errorf(code, "%s", pe.Msg)
}
