package supervisor

import (
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

// Defaults for ExecuteConfig's zero values.
const (
	// DefaultExecuteMaxFileBytes bounds one produced file returned.
	DefaultExecuteMaxFileBytes = 10 << 20
	// DefaultExecuteMaxFilesBytes bounds all produced files returned by one
	// run; base64 makes them a third larger in the response, which stays
	// under the client's DefaultMaxResponseBytes.
	DefaultExecuteMaxFilesBytes = 32 << 20
	// maxOmittedListed bounds the files_omitted list itself.
	maxOmittedListed = 100
	// maxRunWalk bounds the entries looked at when collecting a run's
	// files, so a run that creates a million files cannot stall the
	// response.
	maxRunWalk     = 100_000
	maxFilePathLen = 1024
)

// ExecuteConfig configures /v1/execute and /v1/envs.
type ExecuteConfig struct {
	// Envs, when set, enables the cached Python environments. Its Run,
	// Python, Env and Logger are filled in by New (Python is Config.Python,
	// looked up in the commands' PATH). Without it, runs that name
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

// executeState is the Server's part for /v1/execute and /v1/envs.
type executeState struct {
	envs *pyenv.Manager
	// envsOff says why envs is nil.
	envsOff string
	runDir  string
	started time.Time
}

// initExecute sets up the run directory and the environment cache. A
// cache that cannot start (its directory is held by another supervisor,
// say) is logged and left off rather than failing the supervisor: every
// other endpoint still works.
func (s *Server) initExecute() {
	c := &s.cfg.Execute
	s.px.started = time.Now()
	if c.MaxFileBytes <= 0 {
		c.MaxFileBytes = DefaultExecuteMaxFileBytes
	}
	if c.MaxFilesBytes <= 0 {
		c.MaxFilesBytes = DefaultExecuteMaxFilesBytes
	}
	s.px.runDir = c.RunDir
	if s.px.runDir == "" {
		s.px.runDir = filepath.Join(os.TempDir(), "agentbox-runs")
	}
	if c.Envs == nil {
		s.px.envsOff = "this supervisor keeps no Python environments"
		return
	}
	pc := *c.Envs
	pc.Run = s.runBuildStep
	pc.Python = s.cfg.Python
	pc.Env = procenv.List(s.baseEnv)
	if pc.Logger == nil {
		pc.Logger = s.log
	}
	if c.UV != "" {
		if p, err := procenv.LookPath(c.UV, s.baseEnv["PATH"], s.defaultCwd); err == nil {
			pc.UV = p
		} else {
			s.log.Info("uv not found; Python environments are built with venv and pip", "uv", c.UV)
		}
	}
	m, err := pyenv.New(pc)
	if err != nil {
		s.log.Warn("Python environments are off", "error", err.Error())
		s.px.envsOff = "the Python environment cache is off: " + err.Error()
		return
	}
	s.px.envs = m
}

func (s *Server) closeExecute() error {
	if s.px.envs == nil {
		return nil
	}
	return s.px.envs.Close()
}

// runBuildStep is the pyenv Runner: build steps go through the same spawn
// path as commands, so they get their own process group, are tracked for
// Terminate and registered with the reaper, and are killed whole when the
// build is cancelled or times out.
func (s *Server) runBuildStep(ctx context.Context, argv, env []string, dir string, stdout, stderr io.Writer) (int, error) {
	pathEnv := ""
	for _, kv := range env {
		if v, ok := strings.CutPrefix(kv, "PATH="); ok {
			pathEnv = v
		}
	}
	exe, apiErr := lookPath(argv[0], pathEnv, dir)
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
	res, apiErr := s.run(ctx, &commandSpec{path: exe, argv: argv, dir: dir, env: env, timeout: timeout}, stdout, stderr)
	if apiErr != nil {
		return -1, apiErr
	}
	return res.ExitCode, nil
}

// handleExecute serves /v1/execute.
func (s *Server) handleExecute(w http.ResponseWriter, r *http.Request, info *requestInfo) {
	var req api.ExecuteRequest
	if !s.decodeRequest(w, r, info, &req) {
		return
	}
	info.program = s.cfg.Python
	// Everything about the request is checked before an environment is
	// built for it.
	if e := s.checkExecute(&req); e != nil {
		info.fail(w, e)
		return
	}
	res := &api.ExecuteResult{FilesProduced: map[string][]byte{}}
	python := s.cfg.Python
	env := map[string]string{"PYTHONDONTWRITEBYTECODE": "1"}
	for k, v := range req.Env {
		env[k] = v
	}
	// python_index only matters to a build: without requirements or a
	// name there is none, and the sandbox's python3 runs the code.
	if len(req.Requirements) > 0 || req.EnvName != "" {
		if s.px.envs == nil {
			info.fail(w, api.Errorf(api.CodeUnavailable, "%s; run without requirements and env_name", s.px.envsOff))
			return
		}
		start := time.Now()
		lease, created, err := s.px.envs.Ensure(r.Context(), pyenv.Request{Name: req.EnvName, Requirements: req.Requirements, IndexURL: req.PythonIndex})
		res.EnvSetupMS = time.Since(start).Milliseconds()
		if err != nil {
			info.fail(w, envError(err))
			return
		}
		defer lease.Release()
		python = lease.Python()
		ei := lease.Info()
		res.Env = &api.ExecuteEnv{Name: ei.Name, Created: created, Packages: nonNil(ei.Packages), PythonVersion: ei.PythonVersion}
		// As activating the environment would: what the code starts
		// (python, pip-installed scripts) is the environment's too.
		pathEnv := s.baseEnv["PATH"]
		if p, ok := req.Env["PATH"]; ok {
			pathEnv = p
		}
		env["VIRTUAL_ENV"] = lease.Dir()
		env["PATH"] = filepath.Join(lease.Dir(), "bin") + string(filepath.ListSeparator) + pathEnv
	}

	dir, root, e := s.newRun(req.Files)
	if dir != "" {
		defer os.RemoveAll(dir)
	}
	if root != nil {
		defer root.Close()
	}
	if e != nil {
		info.fail(w, e)
		return
	}
	spec, apiErr := s.prepare(&api.CommandRequest{
		Command:        []string{python, "-u", "-c", req.Code},
		Cwd:            dir,
		Env:            env,
		Stdin:          req.Stdin,
		TimeoutSeconds: req.TimeoutSeconds,
		MaxOutputBytes: req.MaxOutputBytes,
	}, s.cfg.PythonDefaultTimeout, s.cfg.PythonMaxTimeout)
	release, ok := s.admit(r.Context(), w, info, apiErr)
	if !ok {
		return
	}
	defer release()

	out := newOutput(spec.maxOutput)
	ctx, cancel := context.WithTimeoutCause(r.Context(), spec.timeout, errCommandTimeout)
	defer cancel()
	p, apiErr := s.spawn(ctx, spec, out.stdout, out.stderr)
	if apiErr != nil {
		info.fail(w, apiErr)
		return
	}
	pgid := p.cmd.Process.Pid
	cres, apiErr := s.wait(ctx, p)
	// Unlike a command, a run leaves nothing behind: its directory is about
	// to go, and its files are read only once nothing can still be writing
	// them.
	_ = syscall.Kill(-pgid, syscall.SIGKILL)
	if apiErr != nil {
		info.fail(w, apiErr)
		return
	}
	cres.Stdout, cres.Stderr, cres.Truncated = out.result()
	info.result = cres

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
	if err := s.collectFiles(root, req.Files, res); err != nil {
		info.fail(w, api.Errorf(api.CodeInternal, "collecting the run's files: %v", err))
		return
	}
	writeJSON(w, http.StatusOK, res)
}

// checkExecute validates what can be checked before anything is built or
// written, with the same rules as python_exec for the code and limits.
func (s *Server) checkExecute(req *api.ExecuteRequest) *api.Error {
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
	// The code, timeout, output cap and environment, as python_exec takes
	// them; the interpreter is resolved again for the real run.
	_, e := s.preparePython(&api.PythonRequest{
		Code: req.Code, Stdin: req.Stdin, Env: req.Env, TimeoutSeconds: req.TimeoutSeconds, MaxOutputBytes: req.MaxOutputBytes,
	})
	if e != nil && e.Code == api.CodeNotFound && strings.HasPrefix(e.Message, "executable ") {
		// A missing base interpreter matters only without an environment,
		// and then the run itself says so.
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
func (s *Server) newRun(files map[string][]byte) (string, *os.Root, *api.Error) {
	if err := os.MkdirAll(s.px.runDir, 0o700); err != nil {
		return "", nil, api.Errorf(api.CodeInternal, "run directory: %v", err)
	}
	dir, err := os.MkdirTemp(s.px.runDir, "run-")
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
func (s *Server) collectFiles(root *os.Root, inputs map[string][]byte, res *api.ExecuteResult) error {
	maxFile, budget := s.cfg.Execute.MaxFileBytes, s.cfg.Execute.MaxFilesBytes
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
