package computeapi

import (
	"bytes"
	"encoding/json"
	"errors"
	"io"
	"mime"
	"net/http"
	"net/http/httptest"
	"slices"
	"sort"
	"strconv"
	"strings"
	"sync"
	"testing"

	sjsonschema "github.com/santhosh-tekuri/jsonschema/v6"
	"sigs.k8s.io/yaml"

	api "github.com/agentbox/terraform-provider-agentbox/internal/computeapi/client"
)

// The OpenAPI document is the contract: contractCheck wraps the test
// servers' handlers so that every request the tests send and every
// response they get back are validated against the document's schemas,
// and TestOpenAPIRoutes checks that the document and the router list the
// same operations.

const openAPIURL = "urn:agentbox:openapi"

type contract struct {
	doc      map[string]any
	mux      *http.ServeMux // doc paths as Go patterns, to find a request's operation
	compiler *sjsonschema.Compiler
	mu       sync.Mutex
	schemas  map[string]*sjsonschema.Schema
}

var (
	contractOnce sync.Once
	theContract  *contract
	contractErr  error
)

func loadContract(t *testing.T) *contract {
	t.Helper()
	contractOnce.Do(func() {
		raw, err := yaml.YAMLToJSON(OpenAPI())
		if err != nil {
			contractErr = err
			return
		}
		doc, err := sjsonschema.UnmarshalJSON(bytes.NewReader(raw))
		if err != nil {
			contractErr = err
			return
		}
		c := &contract{doc: doc.(map[string]any), mux: http.NewServeMux(), compiler: sjsonschema.NewCompiler(),
			schemas: map[string]*sjsonschema.Schema{}}
		c.compiler.DefaultDraft(sjsonschema.Draft2020)
		if contractErr = c.compiler.AddResource(openAPIURL, doc); contractErr != nil {
			return
		}
		for path, item := range c.doc["paths"].(map[string]any) {
			for method := range item.(map[string]any) {
				if method == "parameters" {
					continue
				}
				c.mux.Handle(strings.ToUpper(method)+" "+goPattern(path), http.NotFoundHandler())
			}
		}
		theContract = c
	})
	if contractErr != nil {
		t.Fatalf("load the OpenAPI document: %v", contractErr)
	}
	return theContract
}

// goPattern turns a document path into the router's pattern: the file
// path parameter spans segments.
func goPattern(p string) string { return strings.Replace(p, "{path}", "{path...}", 1) }

func docPath(pattern string) string { return strings.Replace(pattern, "{path...}", "{path}", 1) }

// pointer escapes a JSON pointer token.
func pointer(tokens ...string) string {
	var b strings.Builder
	for _, t := range tokens {
		b.WriteString("/" + strings.NewReplacer("~", "~0", "/", "~1").Replace(t))
	}
	return b.String()
}

func (c *contract) schema(ptr string) (*sjsonschema.Schema, error) {
	c.mu.Lock()
	defer c.mu.Unlock()
	if s, ok := c.schemas[ptr]; ok {
		return s, nil
	}
	s, err := c.compiler.Compile(openAPIURL + "#" + ptr)
	if err != nil {
		return nil, err
	}
	c.schemas[ptr] = s
	return s, nil
}

// check validates one exchange; it returns what is wrong, or "".
func (c *contract) check(method, pattern string, reqType string, reqBody []byte, status int, respType string, respBody []byte) string {
	path := docPath(strings.TrimPrefix(pattern, method+" "))
	op, ok := c.doc["paths"].(map[string]any)[path].(map[string]any)[strings.ToLower(method)].(map[string]any)
	if !ok {
		return "no operation in the document"
	}
	base := []string{"paths", path, strings.ToLower(method)}
	// Requests are checked only when the server accepted them: the tests
	// send malformed ones on purpose, and refusing those is the server's job.
	if rb, ok := op["requestBody"].(map[string]any); ok && status < 400 && isJSON(reqType) && len(reqBody) > 0 {
		if _, ok := rb["content"].(map[string]any)["application/json"].(map[string]any)["schema"]; ok {
			if msg := c.validate(pointer(append(base, "requestBody", "content", "application/json", "schema")...), reqBody); msg != "" {
				return "request: " + msg
			}
		}
	}
	responses := op["responses"].(map[string]any)
	key := strconv.Itoa(status)
	resp, ok := responses[key].(map[string]any)
	if !ok {
		if status < 400 {
			return "status " + key + " is not documented"
		}
		key, resp = "default", responses["default"].(map[string]any)
	}
	if ref, ok := resp["$ref"].(string); ok {
		name := strings.TrimPrefix(ref, "#/components/responses/")
		resp = c.doc["components"].(map[string]any)["responses"].(map[string]any)[name].(map[string]any)
		base = []string{"components", "responses", name}
	} else {
		base = append(base, "responses", key)
	}
	content, _ := resp["content"].(map[string]any)
	if len(content) == 0 {
		if len(bytes.TrimSpace(respBody)) > 0 {
			return "status " + key + " documents no body but one was sent"
		}
		return ""
	}
	if !isJSON(respType) {
		mt := mediaType(respType)
		media, ok := content[mt].(map[string]any)
		if !ok {
			return "response content type " + respType + " is not documented"
		}
		if _, ok := media["schema"]; ok && mt == api.ContentTypeEventStream {
			// Server-Sent Events: every event's data is one value of the
			// schema, and its id and type are the event's.
			n := 0
			var msg string
			err := api.ReadEventStream(bytes.NewReader(respBody), func(ev api.EventStreamEvent) error {
				n++
				if msg = c.validate(pointer(append(base, "content", mt, "schema")...), []byte(ev.Data)); msg != "" {
					return errors.New(msg)
				}
				var head struct {
					ID   int64  `json:"id"`
					Type string `json:"type"`
				}
				if err := json.Unmarshal([]byte(ev.Data), &head); err != nil || strconv.FormatInt(head.ID, 10) != ev.ID || head.Type != ev.Event {
					msg = "event id " + ev.ID + " type " + ev.Event + " differ from its data " + ev.Data
					return errors.New(msg)
				}
				return nil
			})
			if err != nil {
				return "response " + strconv.Itoa(status) + " event " + strconv.Itoa(n) + ": " + err.Error()
			}
			return ""
		}
		if _, ok := media["schema"]; ok && mt == "application/x-ndjson" {
			// A stream: every line is one value of the schema.
			for i, line := range bytes.Split(bytes.TrimSpace(respBody), []byte("\n")) {
				if msg := c.validate(pointer(append(base, "content", mt, "schema")...), line); msg != "" {
					return "response " + strconv.Itoa(status) + " line " + strconv.Itoa(i+1) + ": " + msg
				}
			}
		}
		return ""
	}
	if _, ok := content["application/json"].(map[string]any)["schema"]; !ok {
		return ""
	}
	if msg := c.validate(pointer(append(base, "content", "application/json", "schema")...), respBody); msg != "" {
		return "response " + strconv.Itoa(status) + ": " + msg
	}
	return ""
}

func (c *contract) validate(ptr string, body []byte) string {
	s, err := c.schema(ptr)
	if err != nil {
		return "compile schema " + ptr + ": " + err.Error()
	}
	v, err := sjsonschema.UnmarshalJSON(bytes.NewReader(body))
	if err != nil {
		return "not JSON: " + err.Error()
	}
	if err := s.Validate(v); err != nil {
		return err.Error() + " in " + string(body[:min(len(body), 300)])
	}
	return ""
}

func mediaType(ct string) string {
	mt, _, _ := mime.ParseMediaType(ct)
	return mt
}

func isJSON(ct string) bool { return mediaType(ct) == "application/json" }

// contractCheck wraps h so that every exchange is checked against the
// document; a mismatch fails the test that provoked it.
func contractCheck(t *testing.T, h http.Handler) http.Handler {
	c := loadContract(t)
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if r.Header.Get("Upgrade") != "" {
			// A WebSocket: the recorder below cannot be hijacked, and its
			// frames are the PTY protocol's, not JSON of this document.
			h.ServeHTTP(w, r)
			return
		}
		_, pattern := c.mux.Handler(r)
		var reqBody []byte
		if r.Body != nil && isJSON(r.Header.Get("Content-Type")) {
			reqBody, _ = io.ReadAll(r.Body)
			r.Body = io.NopCloser(bytes.NewReader(reqBody))
		}
		rec := httptest.NewRecorder()
		h.ServeHTTP(rec, r)
		for k, vs := range rec.Header() {
			w.Header()[k] = vs
		}
		w.WriteHeader(rec.Code)
		_, _ = w.Write(rec.Body.Bytes())
		if pattern == "" {
			// Not a documented path: the router must have refused it.
			if rec.Code != http.StatusNotFound && rec.Code != http.StatusUnauthorized && rec.Code != http.StatusMethodNotAllowed &&
				rec.Code != http.StatusBadRequest {
				t.Errorf("contract: %s %s is not in the OpenAPI document but answered %d", r.Method, r.URL.Path, rec.Code)
			}
			return
		}
		if msg := c.check(r.Method, pattern, r.Header.Get("Content-Type"), reqBody, rec.Code, rec.Header().Get("Content-Type"), rec.Body.Bytes()); msg != "" {
			t.Errorf("contract: %s %s (%s): %s", r.Method, r.URL.Path, pattern, msg)
		}
	})
}

// TestOpenAPIRoutes checks that the document and the router agree on the
// operations, and that the API serves the document.
func TestOpenAPIRoutes(t *testing.T) {
	c := loadContract(t)
	var documented []string
	for path, item := range c.doc["paths"].(map[string]any) {
		for method := range item.(map[string]any) {
			if method != "parameters" {
				documented = append(documented, strings.ToUpper(method)+" "+goPattern(path))
			}
		}
	}
	f := newFixture(t, "")
	served := slices.Clone(f.services.routes)
	sort.Strings(documented)
	sort.Strings(served)
	if !slices.Equal(documented, served) {
		t.Errorf("the OpenAPI document lists\n  %s\nthe router serves\n  %s", strings.Join(documented, "\n  "), strings.Join(served, "\n  "))
	}
	ops := map[string]bool{}
	for _, item := range c.doc["paths"].(map[string]any) {
		for method, op := range item.(map[string]any) {
			if method == "parameters" {
				continue
			}
			id, _ := op.(map[string]any)["operationId"].(string)
			if id == "" || ops[id] {
				t.Errorf("operationId %q missing or repeated", id)
			}
			ops[id] = true
		}
	}

	req, _ := http.NewRequest(http.MethodGet, f.api.URL+"/v1/openapi.yaml", nil)
	req.Header.Set("Authorization", "Bearer "+adminToken)
	resp, err := f.api.Client().Do(req)
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	body, _ := io.ReadAll(resp.Body)
	if resp.StatusCode != http.StatusOK || !bytes.Equal(body, OpenAPI()) {
		t.Errorf("GET /v1/openapi.yaml: %d, %d bytes", resp.StatusCode, len(body))
	}
	var probe map[string]any
	if err := json.Unmarshal(must1(yaml.YAMLToJSON(body)), &probe); err != nil || probe["openapi"] != "3.1.0" {
		t.Errorf("served document: %v", err)
	}
}

func must1[T any](v T, err error) T {
	if err != nil {
		panic(err)
	}
	return v
}
