package client

import (
	"context"
	"encoding/json"
	"fmt"
	"net/http"
	"net/url"

	"github.com/agentbox/terraform-provider-agentbox/internal/supervisor/supervisorapi"
)

// An agent's cached Python environments, as its sandbox's supervisor
// describes them: the API passes them on as they are.
type (
	// EnvRequest builds an environment ahead of the runs that need it:
	// Requirements alone for the environment of that requirement set
	// (named "reqs-" and its key), or a Name with or without them.
	EnvRequest = supervisorapi.EnvRequest
	// EnvInfo describes one environment: its name (the key of a
	// requirement set's), requirements, installed packages, size, last use
	// and state.
	EnvInfo = supervisorapi.EnvInfo
	// EnvResult is the environment POST /v1/agents/{id}/envs built or
	// found, with Created set when this call built it.
	EnvResult = supervisorapi.EnvResult
	// EnvList is every environment, with the cache's totals and limits.
	EnvList = supervisorapi.EnvList
)

// PathEnvs is the path of an agent's environments.
func PathEnvs(agentID string) string { return PathAgent(agentID, "envs") }

// PathEnv is the path of one of an agent's environments.
func PathEnv(agentID, name string) string { return PathEnvs(agentID) + "/" + url.PathEscape(name) }

// ListEnvs lists the agent's cached Python environments, waking its
// sandbox if it is stopped.
func (c *Client) ListEnvs(ctx context.Context, agentID string) (*EnvList, error) {
	var out EnvList
	if err := c.do(ctx, http.MethodGet, PathEnvs(agentID), nil, &out); err != nil {
		return nil, err
	}
	return &out, nil
}

// CreateEnv builds the environment req asks for, or finds it cached, and
// answers when it is ready. A build that fails is CodeEnvBuildFailed, one
// that runs out of time CodeTimeout.
func (c *Client) CreateEnv(ctx context.Context, agentID string, req EnvRequest) (*EnvResult, error) {
	body, err := json.Marshal(req)
	if err != nil {
		return nil, fmt.Errorf("encode request: %w", err)
	}
	var out EnvResult
	if err := c.do(ctx, http.MethodPost, PathEnvs(agentID), body, &out); err != nil {
		return nil, err
	}
	return &out, nil
}

// DeleteEnv removes the environment of that name (or requirement set's
// key) and returns what it was; one a run is using goes when the run
// ends. A name that does not exist is CodeEnvNotFound.
func (c *Client) DeleteEnv(ctx context.Context, agentID, name string) (*EnvInfo, error) {
	var out EnvInfo
	if err := c.do(ctx, http.MethodDelete, PathEnv(agentID, name), nil, &out); err != nil {
		return nil, err
	}
	return &out, nil
}
