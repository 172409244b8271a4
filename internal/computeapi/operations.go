package computeapi

import (
	"context"
	"encoding/json"
	"errors"
	"io"
	"io/fs"
	"net/http"
	"strconv"
	"time"

	"github.com/go-logr/logr"
	"k8s.io/apimachinery/pkg/api/meta"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"

	"github.com/agentbox/terraform-provider-agentbox/internal/api/v1alpha1"
	api "github.com/agentbox/terraform-provider-agentbox/internal/computeapi/client"
	"github.com/agentbox/terraform-provider-agentbox/internal/contentcoding"
	"github.com/agentbox/terraform-provider-agentbox/internal/supervisor/supervisorapi"
)

// The operations beyond run_command: status and
// deploy_or_resume, files, tool_request and execute. Files, tools and
// execute are forwarded to the supervisor as they are (bodies stream
// through; tool and execute JSON is the supervisor's, see supervisorapi),
// so the API adds authentication, scope, resume, activity and audit, and
// no second definition of what the supervisor does.

// fileCallTimeout bounds a file transfer; 100 MiB at a slow 10 MB/s
// takes ten seconds, so this is a hang guard, not a speed limit.
const fileCallTimeout = 10 * time.Minute

// supervisorFor does what every forwarded operation starts with: check
// scope, then reach the agent's supervisor.
func (s *Server) supervisorFor(r *http.Request, op string) (*supervisorapi.Client, logr.Logger, *api.Error) {
	agentID := r.PathValue("agent_id")
	log := s.callLog(r, op).WithValues("agent", agentID)
	if apiErr := s.authorize(r, agentID); apiErr != nil {
		return nil, log, apiErr
	}
	sup, _, log, apiErr := s.reach(r.Context(), agentID, log)
	return sup, log, apiErr
}

// supervisorAndSandboxFor is supervisorFor, also returning the sandbox.
func (s *Server) supervisorAndSandboxFor(r *http.Request, op string) (*supervisorapi.Client, *v1alpha1.Sandbox, logr.Logger, *api.Error) {
	agentID := r.PathValue("agent_id")
	log := s.callLog(r, op).WithValues("agent", agentID)
	if apiErr := s.authorize(r, agentID); apiErr != nil {
		return nil, nil, log, apiErr
	}
	return s.reach(r.Context(), agentID, log)
}

// status reports the agent's sandbox without waking it.
func (s *Server) status(w http.ResponseWriter, r *http.Request) {
	agentID := r.PathValue("agent_id")
	if apiErr := s.authorize(r, agentID); apiErr != nil {
		writeError(w, apiErr)
		return
	}
	sb, apiErr := s.agentSandbox(r.Context(), agentID)
	if apiErr != nil {
		writeError(w, apiErr)
		return
	}
	writeJSON(w, http.StatusOK, statusView(sb))
}

func statusView(sb *v1alpha1.Sandbox) api.SandboxStatus {
	v := api.SandboxStatus{AgentID: sb.Spec.AgentID, Namespace: sb.Namespace, Name: sb.Name, Phase: string(sb.Status.Phase)}
	if c := meta.FindStatusCondition(sb.Status.Conditions, v1alpha1.ConditionReady); c != nil {
		v.Ready, v.Reason, v.Message = c.Status == "True", c.Reason, c.Message
	}
	if snap := sb.Status.Snapshot; snap != nil {
		v.Snapshot = &api.SnapshotInfo{Name: snap.Name, SizeBytes: snap.SizeBytes, Driver: snap.Driver, Checkpoint: snap.Checkpoint}
		if snap.ReadyTime != nil {
			v.Snapshot.ReadyAt = snap.ReadyTime.UTC()
		}
	}
	if c := meta.FindStatusCondition(sb.Status.Conditions, v1alpha1.ConditionIdleStopBlocked); c != nil && c.Status == metav1.ConditionTrue {
		v.IdleStopBlocked = &api.IdleStopBlocked{Reason: c.Reason, Message: c.Message}
		if r := sb.Status.IdleStopRetry; r != nil {
			v.IdleStopBlocked.Failures = int(r.Failures)
			v.IdleStopBlocked.NextAttemptAt = r.NextAttemptTime.UTC()
		}
	}
	return v
}

func (s *Server) putFile(w http.ResponseWriter, r *http.Request) {
	var mode fs.FileMode
	if m := r.URL.Query().Get("mode"); m != "" {
		n, err := strconv.ParseUint(m, 8, 32)
		if err != nil || n > 0o777 {
			writeError(w, api.Errorf(api.CodeInvalidArgument, "mode must be octal permission bits such as 0644, got %q", m))
			return
		}
		mode = fs.FileMode(n)
	}
	coding, err := contentcoding.Of(r.Header)
	if err != nil {
		drainRefusedBody(w, r)
		writeError(w, api.Errorf(api.CodeInvalidArgument, "%v", err))
		return
	}
	decodedLen, err := contentcoding.DecodedLength(r.Header)
	if err != nil {
		drainRefusedBody(w, r)
		writeError(w, api.Errorf(api.CodeInvalidArgument, "%v", err))
		return
	}
	sup, log, apiErr := s.supervisorFor(r, "put_file")
	if apiErr != nil {
		writeError(w, apiErr)
		return
	}
	ctx, cancel := context.WithTimeout(r.Context(), fileCallTimeout)
	defer cancel()
	var fi *supervisorapi.FileInfo
	switch {
	case coding != "" && sup.AcceptsCoding(ctx, coding):
		// Passed on coded: the bytes stay few across the sandbox's
		// network stack, which is what the coding is for.
		fi, err = sup.PutFileCoded(ctx, r.PathValue("path"), r.Body, coding, decodedLen, mode)
	case coding != "":
		// A supervisor that has not named the coding gets the file
		// decoded here.
		var dec io.ReadCloser
		if dec, err = contentcoding.NewReader(coding, r.Body); err == nil {
			body := io.Reader(dec)
			if decodedLen >= 0 {
				body = supervisorapi.Sized(dec, decodedLen)
			}
			fi, err = sup.PutFile(ctx, r.PathValue("path"), body, mode)
			dec.Close()
		}
	default:
		body := io.Reader(r.Body)
		if r.ContentLength >= 0 {
			// Forwarded with its length rather than chunked, so that the
			// supervisor checks the count and refuses a file that cannot
			// fit before any of it moves.
			body = supervisorapi.Sized(r.Body, r.ContentLength)
		}
		fi, err = sup.PutFile(ctx, r.PathValue("path"), body, mode)
	}
	if err != nil {
		apiErr := fileError(ctx, err)
		s.logFailure(log, apiErr, err)
		drainRefusedBody(w, r)
		writeError(w, apiErr)
		return
	}
	writeJSON(w, http.StatusOK, api.FileInfo{Path: fi.Path, Size: fi.Size, Mode: fi.Mode})
}

// Bounds of drainRefusedBody.
const (
	maxRefusedDrain     = 256 << 20
	refusedDrainTimeout = 10 * time.Second
)

// drainRefusedBody reads what is left of a refused upload, within bounds,
// before the refusal is written: the HTTP server closes a connection whose
// request body is left unread, and a caller still sending the file then
// sees its connection reset instead of the answer (workspace_full, say).
// Past the bounds the connection is closed all the same.
func drainRefusedBody(w http.ResponseWriter, r *http.Request) {
	_ = http.NewResponseController(w).SetReadDeadline(time.Now().Add(refusedDrainTimeout))
	_, _ = io.Copy(io.Discard, io.LimitReader(r.Body, maxRefusedDrain))
}

// getFile streams a file. A caller that accepts a content coding gets
// the supervisor's coding passed on as it is (the supervisor codes only
// what compresses); any other caller gets the file as it is, as before the
// codings.
func (s *Server) getFile(w http.ResponseWriter, r *http.Request) {
	sup, log, apiErr := s.supervisorFor(r, "get_file")
	if apiErr != nil {
		writeError(w, apiErr)
		return
	}
	ctx, cancel := context.WithTimeout(r.Context(), fileCallTimeout)
	defer cancel()
	var f *supervisorapi.CodedFile
	var err error
	if coding := contentcoding.Preferred(r.Header); coding != "" {
		f, err = sup.GetFileCoded(ctx, r.PathValue("path"), coding)
	} else {
		f = &supervisorapi.CodedFile{DecodedLength: -1}
		f.Body, err = sup.GetFile(ctx, r.PathValue("path"))
	}
	if err != nil {
		apiErr := fileError(ctx, err)
		s.logFailure(log, apiErr, err)
		writeError(w, apiErr)
		return
	}
	defer f.Body.Close()
	w.Header().Set("Content-Type", "application/octet-stream")
	w.Header().Set("Cache-Control", "no-store")
	w.Header().Set("Vary", "Accept-Encoding")
	if f.Coding != "" {
		contentcoding.SetCoded(w.Header(), f.Coding, f.DecodedLength)
	}
	w.WriteHeader(http.StatusOK)
	if _, err := io.Copy(w, f.Body); err != nil {
		// The status is sent; the client sees a short body.
		log.V(1).Info("file transfer cut short", "err", err.Error())
	}
}

func (s *Server) deleteFile(w http.ResponseWriter, r *http.Request) {
	recursive := false
	if v := r.URL.Query().Get("recursive"); v != "" {
		var err error
		if recursive, err = strconv.ParseBool(v); err != nil {
			writeError(w, api.Errorf(api.CodeInvalidArgument, "recursive must be true or false, got %q", v))
			return
		}
	}
	sup, log, apiErr := s.supervisorFor(r, "delete_file")
	if apiErr != nil {
		writeError(w, apiErr)
		return
	}
	if err := sup.Delete(r.Context(), r.PathValue("path"), recursive); err != nil {
		apiErr := fileError(r.Context(), err)
		s.logFailure(log, apiErr, err)
		writeError(w, apiErr)
		return
	}
	w.WriteHeader(http.StatusNoContent)
}

// toolRequest invokes one of the supervisor's sandboxed tools
// (create_file, python_exec, ...) with the request body as its input.
func (s *Server) toolRequest(w http.ResponseWriter, r *http.Request) {
	var input json.RawMessage
	if apiErr := s.decode(w, r, &input); apiErr != nil {
		writeError(w, apiErr)
		return
	}
	sup, log, apiErr := s.supervisorFor(r, "tool_request")
	if apiErr != nil {
		writeError(w, apiErr)
		return
	}
	ctx, cancel := context.WithTimeout(r.Context(), supervisorapi.MaxPythonTimeoutSeconds*time.Second+supervisorGrace)
	defer cancel()
	out, err := sup.CallTool(ctx, r.PathValue("tool"), input)
	if err != nil {
		apiErr := supervisorError(ctx, err)
		s.logFailure(log, apiErr, err)
		writeError(w, apiErr)
		return
	}
	writeRawJSON(w, out)
}

// execute runs the supervisor's /v1/execute in the sandbox: code, requirements and
// inline files in, output and produced files out.
func (s *Server) execute(w http.ResponseWriter, r *http.Request) {
	var req supervisorapi.ExecuteRequest
	if apiErr := s.decode(w, r, &req); apiErr != nil {
		writeError(w, apiErr)
		return
	}
	sup, sb, log, apiErr := s.supervisorAndSandboxFor(r, "execute")
	if apiErr != nil {
		writeError(w, apiErr)
		return
	}
	// Environment builds can take minutes; the supervisor bounds them.
	ctx, cancel := context.WithTimeout(r.Context(), DefaultResumeTimeout+supervisorapi.MaxPythonTimeoutSeconds*time.Second)
	defer cancel()
	// A run that may build an environment the inventory does not record
	// says so first, so that pool leases meanwhile can prefer this sandbox
	// to one that would build it all over.
	key := s.executeEnvKey(ctx, sb, req)
	if key != "" && len(req.Requirements) > 0 && v1alpha1.PythonEnvState(sb, key) != v1alpha1.PythonEnvBuilt {
		s.noteEnvs(ctx, sb, map[string]string{key: v1alpha1.PythonEnvBuilding})
	}
	res, err := sup.Execute(ctx, req)
	if err != nil {
		apiErr := supervisorError(ctx, err)
		s.logFailure(log, apiErr, err)
		writeError(w, apiErr)
		if key != "" && len(req.Requirements) > 0 && v1alpha1.PythonEnvState(sb, key) != v1alpha1.PythonEnvBuilt {
			s.noteEnvs(ctx, sb, map[string]string{key: ""})
		}
		return
	}
	switch {
	case res.Env != nil:
		s.noteEnvs(ctx, sb, map[string]string{res.Env.Name: v1alpha1.PythonEnvBuilt})
	case key != "":
		// The environment could not be had (evicted, or its build failed).
		s.noteEnvs(ctx, sb, map[string]string{key: ""})
	}
	writeJSON(w, http.StatusOK, res)
}

// fileError maps the supervisor's file errors to the API's: a missing file
// is file_not_found, a full workspace workspace_full, a path the
// supervisor refuses invalid_argument; the rest as for any call.
func fileError(ctx context.Context, err error) *api.Error {
	var se *supervisorapi.Error
	if errors.As(err, &se) {
		switch se.Code {
		case supervisorapi.CodeNotFound:
			return api.Errorf(api.CodeFileNotFound, "%s", se.Message)
		case supervisorapi.CodeWorkspaceFull:
			return api.Errorf(api.CodeWorkspaceFull, "%s", se.Message)
		case supervisorapi.CodePathEscapesWorkspace, supervisorapi.CodeIsADirectory, supervisorapi.CodeNotADirectory:
			return api.Errorf(api.CodeInvalidArgument, "%s", se.Message)
		}
	}
	return supervisorError(ctx, err)
}

func writeRawJSON(w http.ResponseWriter, body json.RawMessage) {
	w.Header().Set("Content-Type", "application/json")
	w.Header().Set("Cache-Control", "no-store")
	w.WriteHeader(http.StatusOK)
	_, _ = w.Write(append(body, '\n'))
}
