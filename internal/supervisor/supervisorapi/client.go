package supervisorapi

import (
	"bytes"
	"context"
	"crypto/tls"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"strconv"
	"strings"
	"time"
)

// DefaultMaxResponseBytes bounds how much of a response the client reads.
// JSON escaping can make a capped 1 MiB of output several times larger, so
// the bound is generous; it exists so a broken peer cannot exhaust memory.
const DefaultMaxResponseBytes = 64 << 20

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
		DialContext:           (&net.Dialer{Timeout: 10 * time.Second, KeepAlive: 30 * time.Second}).DialContext,
		TLSClientConfig:       tlsConfig,
		TLSHandshakeTimeout:   10 * time.Second,
		MaxIdleConnsPerHost:   4,
		IdleConnTimeout:       90 * time.Second,
		ExpectContinueTimeout: time.Second,
	}}
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

func (c *Client) do(ctx context.Context, method, path string, body []byte, out any) error {
	var rd io.Reader
	if body != nil {
		rd = bytes.NewReader(body)
	}
	req, err := http.NewRequestWithContext(ctx, method, strings.TrimSuffix(c.BaseURL, "/")+path, rd)
	if err != nil {
		return fmt.Errorf("supervisor request: %w", err)
	}
	req.Header.Set("Accept", "application/json")
	if body != nil {
		req.Header.Set("Content-Type", "application/json")
	}
	resp, err := c.httpClient().Do(req)
	if err != nil {
		return fmt.Errorf("supervisor %s %s: %w", method, path, err)
	}
	defer resp.Body.Close()
	limit := c.MaxResponseBytes
	if limit <= 0 {
		limit = DefaultMaxResponseBytes
	}
	data, err := io.ReadAll(io.LimitReader(resp.Body, limit+1))
	if err != nil {
		return fmt.Errorf("supervisor %s %s: read response: %w", method, path, err)
	}
	if int64(len(data)) > limit {
		return fmt.Errorf("supervisor %s %s: response larger than %d bytes", method, path, limit)
	}
	if resp.StatusCode/100 != 2 {
		return decodeError(resp.StatusCode, data)
	}
	if out == nil {
		return nil
	}
	if err := json.Unmarshal(data, out); err != nil {
		return fmt.Errorf("supervisor %s %s: decode response: %w", method, path, err)
	}
	return nil
}

func decodeError(status int, data []byte) *Error {
	var body ErrorBody
	if err := json.Unmarshal(data, &body); err == nil && body.Error != nil && body.Error.Code != "" {
		body.Error.HTTPStatus = status
		return body.Error
	}
	msg := strings.TrimSpace(string(data))
	if len(msg) > 512 {
		msg = strings.ToValidUTF8(msg[:512], "") + "..."
	}
	if msg == "" {
		msg = http.StatusText(status)
	}
	return &Error{Code: CodeUnknown, Message: msg, HTTPStatus: status}
}

// CodeOf returns the code of the *Error in err's chain, or "" if there is
// none (a transport failure, for example).
func CodeOf(err error) Code {
	var e *Error
	if errors.As(err, &e) {
		return e.Code
	}
	return ""
}
