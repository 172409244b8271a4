package supervisorapi

import (
	"context"
	"crypto/tls"
	"encoding/json"
	"errors"
	"fmt"
	"net"
	"net/http"
	"strconv"
	"strings"
	"sync/atomic"
	"syscall"
	"time"

	"github.com/agentbox/terraform-provider-agentbox/internal/contentcoding"
	"github.com/agentbox/terraform-provider-agentbox/internal/wire"
)

// DefaultMaxResponseBytes bounds how much of a response the client reads;
// see wire.DefaultMaxResponseBytes.
const DefaultMaxResponseBytes = wire.DefaultMaxResponseBytes

// Client calls one supervisor.
type Client struct {
	// BaseURL is the supervisor's address, e.g. "https://10.0.0.7:8443";
	// see PodURL.
	BaseURL string
	// HTTPClient carries the mTLS configuration (see NewHTTPClient). Leave
	// its Timeout at zero: a command may legitimately run for minutes, so
	// bound calls with the context instead.
	HTTPClient *http.Client
	// MaxResponseBytes defaults to DefaultMaxResponseBytes.
	MaxResponseBytes int64

	// accepted is what the supervisor's latest answer said of coded
	// uploads (its Accept-Encoding), or nil before any answer (see
	// AcceptsCoding).
	accepted atomic.Pointer[http.Header]
}

// AcceptsCoding reports whether the supervisor said, on its latest answer
// to this client, that it takes uploads in coding (contentcoding.S2 or
// Zstd; see PutFileCoded). Before any answer it asks, with a health call
// bounded by ctx; a supervisor of a version before the codings never names
// one, and one that stopped naming it is believed at once.
func (c *Client) AcceptsCoding(ctx context.Context, coding string) bool {
	if c.accepted.Load() == nil {
		_, _ = c.Health(ctx)
	}
	h := c.accepted.Load()
	return h != nil && contentcoding.Lists(*h, coding)
}

func (c *Client) observe(resp *http.Response) {
	h := http.Header{"Accept-Encoding": resp.Header.Values("Accept-Encoding")}
	c.accepted.Store(&h)
}

// NewClient returns a client for the supervisor at baseURL.
func NewClient(baseURL string, httpClient *http.Client) *Client {
	return &Client{BaseURL: baseURL, HTTPClient: httpClient}
}

// PodURL returns the base URL of the supervisor in the pod with IP podIP.
func PodURL(podIP string) string {
	return "https://" + net.JoinHostPort(podIP, strconv.Itoa(DefaultPort))
}

// NewHTTPClient returns an HTTP client that dials with tlsConfig (for the
// control plane: pki.ClientTLS with the sandbox's expected identity). Its
// dial and handshake are bounded; the request as a whole is bounded only by
// the caller's context. It speaks HTTP/1.1: over HTTP/2 a refused client
// certificate surfaces only as "client conn could not be established",
// while HTTP/1.1 reports the TLS alert, and a sandbox sees too few
// concurrent calls for multiplexing to matter.
func NewHTTPClient(tlsConfig *tls.Config) *http.Client {
	return &http.Client{Transport: &http.Transport{
		DialContext:           retryRefused((&net.Dialer{Timeout: 10 * time.Second, KeepAlive: 30 * time.Second}).DialContext, RefusedRetryWindow),
		TLSClientConfig:       tlsConfig,
		TLSHandshakeTimeout:   10 * time.Second,
		MaxIdleConnsPerHost:   4,
		IdleConnTimeout:       90 * time.Second,
		ExpectContinueTimeout: time.Second,
	}}
}

// RefusedRetryWindow is how long a dial that the supervisor's address
// refuses is tried again. A sandbox reported ready can refuse for a moment
// (its supervisor restarting in the same pod, a pod address that the
// network has not finished wiring), and a refused connect carried nothing,
// so trying again is always safe; the window keeps a supervisor that is
// really down from holding a call up for long.
const RefusedRetryWindow = 3 * time.Second

// dialFunc is the shape of net.Dialer.DialContext.
type dialFunc func(ctx context.Context, network, addr string) (net.Conn, error)

// retryRefused dials with dial and, while the connect is refused and
// window has not passed, dials again after a short, growing pause. The
// context bounds it as it bounds one dial.
func retryRefused(dial dialFunc, window time.Duration) dialFunc {
	return func(ctx context.Context, network, addr string) (net.Conn, error) {
		deadline := time.Now().Add(window)
		pause := 50 * time.Millisecond
		for {
			conn, err := dial(ctx, network, addr)
			if err == nil || !errors.Is(err, syscall.ECONNREFUSED) || time.Now().Add(pause).After(deadline) {
				return conn, err
			}
			t := time.NewTimer(pause)
			select {
			case <-ctx.Done():
				t.Stop()
				return nil, err
			case <-t.C:
			}
			pause = min(2*pause, 500*time.Millisecond)
		}
	}
}

// RunCommand runs a command and returns its result. A command that exits
// non-zero, is killed or times out is a result, not an error; errors are
// *Error for requests the supervisor refused or failed.
func (c *Client) RunCommand(ctx context.Context, req CommandRequest) (*CommandResult, error) {
	body, err := json.Marshal(req)
	if err != nil {
		return nil, fmt.Errorf("encode command request: %w", err)
	}
	var res CommandResult
	if err := c.do(ctx, http.MethodPost, PathCommands, body, &res); err != nil {
		return nil, err
	}
	return &res, nil
}

// RunPython runs a Python snippet (python_exec). As with RunCommand, an
// exception, a non-zero exit or a timeout is a result, not an error.
func (c *Client) RunPython(ctx context.Context, req PythonRequest) (*CommandResult, error) {
	body, err := json.Marshal(req)
	if err != nil {
		return nil, fmt.Errorf("encode python request: %w", err)
	}
	var res CommandResult
	if err := c.do(ctx, http.MethodPost, PathPython, body, &res); err != nil {
		return nil, err
	}
	return &res, nil
}

// Flush makes the workspace durable on its volume; the controller calls it
// before snapshotting the volume at idle stop.
func (c *Client) Flush(ctx context.Context) error {
	return c.do(ctx, http.MethodPost, PathFlush, nil, nil)
}

// Health reports whether the supervisor is serving, and its version.
func (c *Client) Health(ctx context.Context) (*Health, error) {
	var h Health
	if err := c.do(ctx, http.MethodGet, PathHealth, nil, &h); err != nil {
		return nil, err
	}
	return &h, nil
}

// transport is the client's wire transport for one call.
func (c *Client) transport() *wire.Transport[wire.Supervisor] {
	return &wire.Transport[wire.Supervisor]{
		BaseURL:          strings.TrimSuffix(c.BaseURL, "/"),
		HTTPClient:       c.HTTPClient,
		MaxResponseBytes: c.MaxResponseBytes,
		Observe:          c.observe,
	}
}

func (c *Client) do(ctx context.Context, method, path string, body []byte, out any) error {
	return c.transport().Do(ctx, method, path, body, out)
}
