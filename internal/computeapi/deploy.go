package computeapi

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"io"
	"net/http"
	"strings"
	"time"

	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/apimachinery/pkg/util/validation"

	"github.com/agentbox/terraform-provider-agentbox/internal/api/v1alpha1"
	api "github.com/agentbox/terraform-provider-agentbox/internal/computeapi/client"
	"github.com/agentbox/terraform-provider-agentbox/internal/computeapi/holds"
	"github.com/agentbox/terraform-provider-agentbox/internal/computeapi/sandboxstate"
)

// deploy_or_resume: running, return it; stopped, resume it; none, create
// it from a template and return it once it serves. The sandbox it creates
// goes by a name derived from the agent ID (agentSandboxName), so calls
// that race, or repeat after a lost answer, all create the same object and
// the API server lets exactly one of them: the others find it and wait for
// it too. Who may create is who may address the agent: its own token and
// an admin's. Which template (and so which namespace, image and limits)
// is the platform's choice for an agent token, which may use the default
// template only; an admin may name any.

// maxNamePrefix bounds the readable part of agentSandboxName, so that the
// name and its children's names (<name>-workspace) stay well inside the 63
// characters a label value (agentbox.dev/sandbox) allows.
const maxNamePrefix = 30

// agentSandboxName is the name of the sandbox deploy_or_resume creates for
// agentID: its letters and digits, lower-cased, for people, then 64 bits
// of its hash, for uniqueness (agent IDs are case-sensitive and may differ
// only in punctuation).
func agentSandboxName(agentID string) string {
	var b strings.Builder
	for _, c := range strings.ToLower(agentID) {
		if b.Len() >= maxNamePrefix {
			break
		}
		switch {
		case c >= 'a' && c <= 'z', c >= '0' && c <= '9':
			b.WriteRune(c)
		case b.Len() > 0 && !strings.HasSuffix(b.String(), "-"):
			b.WriteByte('-')
		}
	}
	prefix := strings.TrimSuffix(b.String(), "-")
	if prefix == "" {
		prefix = "agent"
	}
	return prefix + "-" + v1alpha1.AgentIDHash(agentID)[:16]
}

func (s *Server) deployOrResume(w http.ResponseWriter, r *http.Request) {
	start := time.Now()
	agentID := r.PathValue("agent_id")
	log := s.callLog(r, "deploy_or_resume").WithValues("agent", agentID)
	fail := func(apiErr *api.Error) {
		s.logFailure(log, apiErr, nil)
		writeError(w, apiErr)
	}
	if apiErr := s.authorize(r, agentID); apiErr != nil {
		fail(apiErr)
		return
	}
	var req api.DeployRequest
	if apiErr := s.decodeOptional(w, r, &req); apiErr != nil {
		fail(apiErr)
		return
	}
	if req.RequestID == "" {
		req.RequestID = requestID(r.Context())
	}
	if apiErr := holds.ValidateFields(map[string]string{"request_id": req.RequestID}); apiErr != nil {
		fail(apiErr)
		return
	}
	tpl, apiErr := s.deployTemplate(r, req.Template)
	if apiErr != nil {
		fail(apiErr)
		return
	}

	var sb *v1alpha1.Sandbox
	sb, apiErr = s.agentSandbox(r.Context(), agentID)
	switch {
	case apiErr == nil:
		sb, apiErr = s.readySandbox(r.Context(), agentID)
	case apiErr.Code == api.CodeSandboxNotFound && tpl == (types.NamespacedName{}):
		apiErr.Message += "; deploy_or_resume creates it from a template: name one in template, or have the platform's " +
			"default template configured (computeApi.defaultTemplate)"
	case apiErr.Code == api.CodeSandboxNotFound:
		if apiErr = s.createAgentSandbox(r.Context(), agentID, tpl, req.RequestID); apiErr == nil {
			log.V(1).Info("sandbox created", "template", tpl.String(), "request_id", req.RequestID)
			sb, apiErr = s.awaitCreated(r.Context(), agentID, start)
		}
	}
	if apiErr != nil {
		fail(apiErr)
		return
	}
	s.recordActivity(r.Context(), sb)
	view := statusView(sb)
	view.Created = sb.Annotations[v1alpha1.AnnotationCreatedByRequest] == req.RequestID
	writeJSON(w, http.StatusOK, view)
}

// deployTemplate resolves the template a missing sandbox would be created
// from, and checks that the caller may create from it: it is checked
// before the sandbox is looked up, so that a refused call is refused
// whether or not the agent has a sandbox.
func (s *Server) deployTemplate(r *http.Request, name string) (types.NamespacedName, *api.Error) {
	if name == "" {
		return s.defaultTemplate, nil
	}
	ns, n, ok := strings.Cut(name, "/")
	if !ok || len(validation.IsDNS1123Label(ns)) > 0 || len(validation.IsDNS1123Subdomain(n)) > 0 {
		return types.NamespacedName{}, api.Errorf(api.CodeInvalidArgument,
			"template must be <namespace>/<name> of a SandboxTemplate, got %q", name)
	}
	tpl := types.NamespacedName{Namespace: ns, Name: n}
	if p := PrincipalFrom(r.Context()); tpl != s.defaultTemplate && (p == nil || !p.AllAgents) {
		// The template decides the namespace, image, limits and egress an
		// agent runs with: the platform's choice, not the agent's.
		return types.NamespacedName{}, api.Errorf(api.CodePermissionDenied,
			"an agent token may create its sandbox only from the platform's default template, not %s; ask an admin", tpl)
	}
	return tpl, nil
}

// templateExists refuses a sandbox of a template that does not exist
// before it is created: the controller would only report it on the
// Sandbox, after the caller's wait.
func (s *Server) templateExists(ctx context.Context, tpl types.NamespacedName) *api.Error {
	var t v1alpha1.SandboxTemplate
	if err := s.sandboxes.Get(ctx, tpl, &t); apierrors.IsNotFound(err) {
		return api.Errorf(api.CodeInvalidArgument, "SandboxTemplate %s does not exist", tpl)
	} else if err != nil {
		s.log.Error(err, "get sandbox template", "template", tpl.String())
		return api.Errorf(api.CodeInternal, "could not look up SandboxTemplate %s", tpl)
	}
	return nil
}

// createAgentSandbox creates agentID's sandbox from tpl, unless the same
// call (or another for the agent) got there first.
func (s *Server) createAgentSandbox(ctx context.Context, agentID string, tpl types.NamespacedName, requestID string) *api.Error {
	if apiErr := s.templateExists(ctx, tpl); apiErr != nil {
		return apiErr
	}
	sb := &v1alpha1.Sandbox{
		ObjectMeta: metav1.ObjectMeta{
			Namespace: tpl.Namespace,
			Name:      agentSandboxName(agentID),
			// The controller would put the label on too; set now, the
			// API's own lookups find the sandbox as soon as the cache has
			// it.
			Labels:      map[string]string{v1alpha1.LabelAgentIDHash: v1alpha1.AgentIDHash(agentID)},
			Annotations: map[string]string{v1alpha1.AnnotationCreatedByRequest: requestID},
		},
		Spec: v1alpha1.SandboxSpec{AgentID: agentID, TemplateRef: v1alpha1.LocalObjectReference{Name: tpl.Name}},
	}
	ctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), holds.WriteTimeout)
	defer cancel()
	err := s.kube.Create(ctx, sb)
	if err == nil {
		return nil
	}
	if !apierrors.IsAlreadyExists(err) {
		s.log.Error(err, "create sandbox", "agent", agentID, "sandbox", sb.Namespace+"/"+sb.Name)
		return api.Errorf(api.CodeInternal, "could not create the sandbox of agent %q", agentID)
	}
	var got v1alpha1.Sandbox
	if err := s.kubeDirect.Get(ctx, types.NamespacedName{Namespace: sb.Namespace, Name: sb.Name}, &got); err != nil {
		if apierrors.IsNotFound(err) {
			// Deleted between the two calls: a retry creates it again.
			return deletingError(agentID, "")
		}
		s.log.Error(err, "get sandbox", "sandbox", sb.Namespace+"/"+sb.Name)
		return api.Errorf(api.CodeInternal, "could not look up the sandbox of agent %q", agentID)
	}
	switch {
	case got.Spec.AgentID != agentID:
		// 64 bits of hash make this a name someone chose by hand.
		return api.Errorf(api.CodeInternal, "the sandbox name %s/%s for agent %q is taken by another agent's sandbox",
			sb.Namespace, sb.Name, agentID)
	case !got.DeletionTimestamp.IsZero():
		return deletingError(agentID, string(got.Status.Phase))
	}
	return nil
}

func deletingError(agentID, phase string) *api.Error {
	e := api.Errorf(api.CodeSandboxNotReady, "the sandbox of agent %q is being deleted; retry once it is gone to create a new one", agentID)
	e.Details = map[string]string{"phase": phase, "reason": "Deleting"}
	return e
}

// awaitCreated waits for the agent's sandbox, just created by this call or
// a concurrent one, to serve, up to the resume timeout from start. Until
// the cache shows it, the agent has none as far as the lookup can tell;
// that is waited out too.
func (s *Server) awaitCreated(ctx context.Context, agentID string, start time.Time) (*v1alpha1.Sandbox, *api.Error) {
	timeout := time.NewTimer(max(s.resumeTimeout-time.Since(start), 0))
	defer timeout.Stop()
	tick := time.NewTicker(sandboxstate.PollInterval)
	defer tick.Stop()
	var last *v1alpha1.Sandbox
	for {
		sb, apiErr := s.agentSandbox(ctx, agentID)
		switch {
		case apiErr != nil && apiErr.Code != api.CodeSandboxNotFound:
			return nil, apiErr
		case apiErr == nil && sandboxstate.Serving(sb):
			return sb, nil
		case apiErr == nil && !sandboxstate.Starting(sb):
			return nil, sandboxstate.NotReady(agentID, sb)
		case apiErr == nil:
			last = sb
		}
		select {
		case <-ctx.Done():
			return nil, api.Errorf(api.CodeSandboxNotReady, "the sandbox of agent %q is being created", agentID)
		case <-timeout.C:
			e := api.Errorf(api.CodeSandboxNotReady, "the sandbox of agent %q is being created", agentID)
			e.Details = map[string]string{"phase": string(v1alpha1.SandboxPhasePending), "reason": v1alpha1.ReasonCreating}
			if last != nil {
				e = sandboxstate.NotReady(agentID, last)
			}
			e.Message += fmt.Sprintf(" (waited %s; the sandbox is still starting, retry the call)", s.resumeTimeout)
			return nil, e
		case <-tick.C:
		}
	}
}

// decodeOptional decodes a JSON body into into, if there is one: an empty
// body leaves into as it is.
func (s *Server) decodeOptional(w http.ResponseWriter, r *http.Request, into any) *api.Error {
	body, err := io.ReadAll(http.MaxBytesReader(w, r.Body, s.maxRequestBytes))
	var tooLarge *http.MaxBytesError
	switch {
	case errors.As(err, &tooLarge):
		return api.Errorf(api.CodePayloadTooLarge, "request body exceeds %d bytes", tooLarge.Limit)
	case err != nil:
		return api.Errorf(api.CodeInvalidArgument, "could not read the request body: %v", err)
	case len(bytes.TrimSpace(body)) == 0:
		return nil
	}
	r.Body = io.NopCloser(bytes.NewReader(body))
	return s.decode(w, r, into)
}
