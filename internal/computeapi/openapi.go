package computeapi

import (
	_ "embed"
	"net/http"
)

// openAPI documents every endpoint; the tests check each route against it
// and every response the test suite provokes against its schemas, so the
// document cannot drift from the server.
//
//go:embed openapi.yaml
var openAPI []byte

// OpenAPI returns the API's OpenAPI 3.1 document (YAML).
func OpenAPI() []byte { return openAPI }

func (s *Server) serveOpenAPI(w http.ResponseWriter, _ *http.Request) {
	w.Header().Set("Content-Type", "application/yaml")
	w.WriteHeader(http.StatusOK)
	_, _ = w.Write(openAPI)
}
