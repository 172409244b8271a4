package wire

import (
	"bufio"
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"net/url"
	"strings"
	"time"

	"github.com/coder/websocket"
)

// DefaultMaxResponseBytes bounds how much of a response a client reads.
// JSON escaping can make a capped 1 MiB of output several times larger, so
// the bound is generous; it exists so a broken peer cannot exhaust memory.
const DefaultMaxResponseBytes = 64 << 20

// maxErrorBody bounds what is read of an error response or of a refused
// stream: error bodies are small JSON, and the bound only guards against a
// broken peer.
const maxErrorBody = 1 << 20

// Transport makes one client's calls to one peer. The clients build one
// for each call from their own settings; it holds nothing between calls.
type Transport[P Peer] struct {
	// BaseURL is prefixed to every path as it is.
	BaseURL string
	// HTTPClient makes the calls; nil means http.DefaultClient.
	HTTPClient *http.Client
	// MaxResponseBytes defaults to DefaultMaxResponseBytes.
	MaxResponseBytes int64
	// Authorize, if set, adds what a request to path (escaped, with its
	// query when the caller put one in it) carries: the API's bearer
	// token and the hold the client presents.
	Authorize func(h http.Header, path string)
	// Observe, if set, sees every response the peer sends, before it is
	// read: how a client learns what the peer accepts (a content coding,
	// say) from answers to calls it makes anyway.
	Observe func(resp *http.Response)
}

func (t *Transport[P]) client() *http.Client {
	if t.HTTPClient == nil {
		return http.DefaultClient
	}
	return t.HTTPClient
}

// newRequest builds a request for path and query, authorized.
func (t *Transport[P]) newRequest(ctx context.Context, method, path string, query url.Values, body io.Reader) (*http.Request, error) {
	u := t.BaseURL + path
	if len(query) > 0 {
		u += "?" + query.Encode()
	}
	req, err := http.NewRequestWithContext(ctx, method, u, body)
	if err != nil {
		return nil, fmt.Errorf("%s: %w", peerOf[P]().build, err)
	}
	if t.Authorize != nil {
		t.Authorize(req.Header, path)
	}
	return req, nil
}

// send sends req; a failure to get a response names the call as method
// and path.
func (t *Transport[P]) send(req *http.Request, method, path string) (*http.Response, error) {
	resp, err := t.client().Do(req)
	if err != nil {
		return nil, fmt.Errorf("%s%s %s: %w", peerOf[P]().call, method, path, err)
	}
	if t.Observe != nil {
		t.Observe(resp)
	}
	return resp, nil
}

// Do makes a JSON call: body (nil for none) is sent as JSON, and a 2xx
// answer is decoded into out (nil to ignore it). Any other status is
// returned as *Error[P].
func (t *Transport[P]) Do(ctx context.Context, method, path string, body []byte, out any) error {
	var rd io.Reader
	if body != nil {
		rd = bytes.NewReader(body)
	}
	req, err := t.newRequest(ctx, method, path, nil, rd)
	if err != nil {
		return err
	}
	req.Header.Set("Accept", "application/json")
	if body != nil {
		req.Header.Set("Content-Type", "application/json")
	}
	resp, err := t.send(req, method, path)
	if err != nil {
		return err
	}
	defer resp.Body.Close()
	// Calls without a result (a 204) read the body too, so that the
	// connection can be reused.
	data, err := t.readBounded(resp.Body, method, path)
	if err != nil {
		return err
	}
	if resp.StatusCode/100 != 2 {
		return DecodeError[P](resp, data)
	}
	if out == nil {
		return nil
	}
	if err := json.Unmarshal(data, out); err != nil {
		return fmt.Errorf("%s%s %s: decode response: %w", peerOf[P]().call, method, path, err)
	}
	return nil
}

// readBounded reads a whole response body of at most MaxResponseBytes.
func (t *Transport[P]) readBounded(body io.Reader, method, path string) ([]byte, error) {
	limit := t.MaxResponseBytes
	if limit <= 0 {
		limit = DefaultMaxResponseBytes
	}
	data, err := io.ReadAll(io.LimitReader(body, limit+1))
	if err != nil {
		return nil, fmt.Errorf("%s%s %s: read response: %w", peerOf[P]().call, method, path, err)
	}
	if int64(len(data)) > limit {
		return nil, fmt.Errorf("%s%s %s: response larger than %d bytes", peerOf[P]().call, method, path, limit)
	}
	return data, nil
}

// DecodeJSON reads a 2xx response of Send, bounded as Do's are, into out,
// and closes it.
func (t *Transport[P]) DecodeJSON(resp *http.Response, out any) error {
	defer resp.Body.Close()
	method, path := resp.Request.Method, resp.Request.URL.Path
	data, err := t.readBounded(resp.Body, method, path)
	if err != nil {
		return err
	}
	if err := json.Unmarshal(data, out); err != nil {
		return fmt.Errorf("%s%s %s: decode response: %w", peerOf[P]().call, method, path, err)
	}
	return nil
}

// Request is a call whose body, if any, is streamed, for Send.
type Request struct {
	Method string
	// Path is escaped; Query, if any, is added to it.
	Path  string
	Query url.Values
	// Body is sent as it is read; see Sized for one whose length is known.
	Body io.Reader
	// ContentType labels Body; Accept, if set, is sent.
	ContentType, Accept string
	// Header holds further headers to send (a content coding, say).
	Header http.Header
}

// Send sends r and returns the response of a 2xx status with its body
// unread, for the caller to stream and close; any other status is returned
// as *Error[P].
func (t *Transport[P]) Send(ctx context.Context, r Request) (*http.Response, error) {
	body := r.Body
	var length int64 = -1
	if sb, ok := body.(sizedBody); ok {
		body, length = sb.r, sb.n
	}
	req, err := t.newRequest(ctx, r.Method, r.Path, r.Query, body)
	if err != nil {
		return nil, err
	}
	if length >= 0 {
		req.ContentLength = length
		if length == 0 {
			req.Body = http.NoBody
		}
	}
	if body != nil && r.ContentType != "" {
		req.Header.Set("Content-Type", r.ContentType)
	}
	if r.Accept != "" {
		req.Header.Set("Accept", r.Accept)
	}
	for k, v := range r.Header {
		req.Header[k] = v
	}
	resp, err := t.send(req, r.Method, r.Path)
	if err != nil {
		return nil, err
	}
	if resp.StatusCode/100 != 2 {
		defer resp.Body.Close()
		data, err := io.ReadAll(io.LimitReader(resp.Body, maxErrorBody))
		if err != nil {
			return nil, fmt.Errorf("%s%s %s: status %d: read response: %w", peerOf[P]().call, r.Method, r.Path, resp.StatusCode, err)
		}
		return nil, DecodeError[P](resp, data)
	}
	return resp, nil
}

// Sized declares that body holds exactly n bytes, for a streamed body
// whose length http cannot see (a request body being forwarded). The
// supervisor then refuses a write that cannot fit before reading it, and
// one that delivers a different number of bytes changes nothing.
func Sized(body io.Reader, n int64) io.Reader { return sizedBody{body, n} }

type sizedBody struct {
	r io.Reader
	n int64
}

func (b sizedBody) Read(p []byte) (int, error) { return b.r.Read(p) }

// LengthOf returns how many bytes body holds when that can be known
// without reading it (Sized, or a reader of bytes or a string that
// reports its Len), and -1 otherwise.
func LengthOf(body io.Reader) int64 {
	switch b := body.(type) {
	case sizedBody:
		return b.n
	case interface{ Len() int }:
		return int64(b.Len())
	}
	return -1
}

// DecodeError turns an error response into the peer's *Error. A body that
// is not an error body (from something between the client and the peer)
// becomes CodeUnknown with the body's start as its message.
func DecodeError[P Peer](resp *http.Response, data []byte) *Error[P] {
	status := resp.StatusCode
	requestID := ""
	if peerOf[P]().requestID {
		requestID = resp.Header.Get("X-Request-Id")
	}
	var body ErrorBody[P]
	if err := json.Unmarshal(data, &body); err == nil && body.Error != nil && body.Error.Code != "" {
		body.Error.Status = status
		body.Error.RequestID = requestID
		return body.Error
	}
	msg := strings.TrimSpace(string(data))
	if len(msg) > 512 {
		msg = strings.ToValidUTF8(msg[:512], "") + "..."
	}
	if msg == "" {
		msg = http.StatusText(status)
	}
	return &Error[P]{Code: CodeUnknown, Message: msg, Status: status, RequestID: requestID}
}

// StreamCommand posts body (a command request, as JSON) to path, calls fn
// with each output event as it arrives, and returns the command's result
// from the final event. An error from fn stops reading and is returned;
// leaving closes the connection rather than draining it, which is what
// tells the peer to kill the command. How the command ended is a result,
// not an error.
func StreamCommand[Result any, P Peer](ctx context.Context, t *Transport[P], path string, body []byte, fn func(CommandEvent[Result, P]) error) (*Result, error) {
	p := peerOf[P]()
	ctx, cancel := context.WithCancel(ctx)
	defer cancel()
	req, err := t.newRequest(ctx, http.MethodPost, path, nil, bytes.NewReader(body))
	if err != nil {
		return nil, err
	}
	req.Header.Set("Accept", ContentTypeNDJSON)
	req.Header.Set("Content-Type", "application/json")
	resp, err := t.send(req, http.MethodPost, path)
	if err != nil {
		return nil, err
	}
	defer resp.Body.Close()
	if resp.StatusCode/100 != 2 {
		data, _ := io.ReadAll(io.LimitReader(resp.Body, maxErrorBody))
		return nil, DecodeError[P](resp, data)
	}
	sc := bufio.NewScanner(resp.Body)
	// An event holds at most one read of the command's pipe (32 KiB),
	// which JSON escaping can grow up to six times.
	sc.Buffer(make([]byte, 64<<10), 1<<20)
	for sc.Scan() {
		var ev CommandEvent[Result, P]
		if err := json.Unmarshal(sc.Bytes(), &ev); err != nil {
			return nil, fmt.Errorf("%sPOST %s: decode event: %w", p.call, path, err)
		}
		switch {
		case ev.Exit != nil:
			p.readTail(resp.Body)
			return ev.Exit, nil
		case ev.Error != nil:
			p.readTail(resp.Body)
			ev.Error.Status = resp.StatusCode
			if p.requestID {
				ev.Error.RequestID = resp.Header.Get("X-Request-Id")
			}
			return nil, ev.Error
		}
		if err := fn(ev); err != nil {
			return nil, err
		}
	}
	if err := sc.Err(); err != nil {
		return nil, fmt.Errorf("%w: %w", p.incomplete, err)
	}
	return nil, p.incomplete
}

// readTail reads what follows a supervisor stream's last event: the end of
// the chunked body and its trailer, the supervisor's record of the call,
// which is known only once the body has been read to its end. The
// supervisor sends nothing more, so this takes no time; the bounds only
// guard against a broken peer.
func (p *peer) readTail(body io.ReadCloser) {
	if !p.drainTail {
		return
	}
	t := time.AfterFunc(5*time.Second, func() { body.Close() })
	defer t.Stop()
	_, _ = io.Copy(io.Discard, io.LimitReader(body, 64<<10))
}

// DialWebSocket opens a WebSocket to path (with query) that must speak
// subprotocol, for a PTY session. ctx bounds the handshake only. A refusal
// is the peer's *Error, as for every other call.
func DialWebSocket[P Peer](ctx context.Context, t *Transport[P], path string, query url.Values, subprotocol string) (*websocket.Conn, error) {
	p := peerOf[P]()
	u := t.BaseURL + path
	if len(query) > 0 {
		u += "?" + query.Encode()
	}
	header := http.Header{}
	if t.Authorize != nil {
		t.Authorize(header, path)
	}
	conn, resp, err := websocket.Dial(ctx, u, &websocket.DialOptions{
		HTTPClient:   t.client(),
		HTTPHeader:   header,
		Subprotocols: []string{subprotocol},
	})
	if err != nil {
		if resp != nil && resp.StatusCode != http.StatusSwitchingProtocols {
			// Dial has read up to 1 KiB of the body; error bodies are
			// smaller than that.
			data, _ := io.ReadAll(resp.Body)
			return nil, DecodeError[P](resp, data)
		}
		return nil, fmt.Errorf("%sGET %s: %w", p.call, path, err)
	}
	if conn.Subprotocol() != subprotocol {
		conn.Close(websocket.StatusProtocolError, "subprotocol not negotiated")
		return nil, fmt.Errorf("%sGET %s: %s did not accept subprotocol %s", p.call, path, p.server, subprotocol)
	}
	// Output frames are at most the supervisor's read size (32 KiB); the
	// limit only guards against a broken peer.
	conn.SetReadLimit(1 << 20)
	return conn, nil
}
