// Command mcpremote is a remote (Streamable HTTP) MCP server built with the
// official Go SDK, for the cluster test of remote MCP servers. Its tool
// whoami says who the call's bearer token names: it verifies the token
// against the Compute API's JWKS (a file) as a server that trusts the
// platform's user tokens would, and reports the address the request came
// from, so that the test sees it came through the egress proxy. It serves
// plain HTTP, and HTTPS too when given a certificate.
//
// Every HTTP request is logged to stdout with the port it came in on, its
// method, JSON-RPC method, source address and whether it had an
// Authorization header, never the header itself.
package main

import (
	"bytes"
	"context"
	"crypto/sha256"
	"encoding/hex"
	"encoding/json"
	"flag"
	"fmt"
	"io"
	"log"
	"net"
	"net/http"
	"os"
	"strings"
	"time"

	jose "github.com/go-jose/go-jose/v4"
	"github.com/modelcontextprotocol/go-sdk/mcp"

	"github.com/agentbox/terraform-provider-agentbox/internal/usertoken"
)

// remoteAddrHeader and urlHeader hand the request's source address and
// the URL it was sent to to the tool; the wrapper sets them on every
// request, over anything a client sent.
const (
	remoteAddrHeader = "X-Mcpremote-Remote-Addr"
	urlHeader        = "X-Mcpremote-Url"
)

type whoamiOut struct {
	// Authorization is "bearer" or "none".
	Authorization string   `json:"authorization"`
	Subject       string   `json:"subject,omitempty"`
	Actor         string   `json:"actor,omitempty"`
	Audience      []string `json:"audience,omitempty"`
	// Error is why the token was refused.
	Error string `json:"error,omitempty"`
	// MetaToken says whether params._meta had a user token key: a remote
	// server gets the token as its bearer token only.
	MetaToken bool `json:"meta_token"`
	// APIKeySHA256 is the hex SHA-256 of the X-Api-Key header, which the
	// egress proxy adds as a configured credential; the server keeps no
	// secret.
	APIKeySHA256 string `json:"api_key_sha256,omitempty"`
	RemoteAddr   string `json:"remote_addr"`
}

func main() {
	listen := flag.String("listen", ":8080", "address to serve on")
	jwksFile := flag.String("jwks", "/jwks/jwks.json", "the Compute API's JWKS")
	issuer := flag.String("issuer", "", "the user tokens' issuer")
	audience := flag.String("audience", "", "the audience the tokens must be for; empty means the URL each request was sent to")
	tlsListen := flag.String("tls-listen", "", "address to serve HTTPS on too, with -tls-cert and -tls-key")
	tlsCert := flag.String("tls-cert", "", "the HTTPS certificate")
	tlsKey := flag.String("tls-key", "", "the HTTPS certificate's key")
	flag.Parse()

	b, err := os.ReadFile(*jwksFile)
	if err != nil {
		log.Fatal(err)
	}
	var keys jose.JSONWebKeySet
	if err := json.Unmarshal(b, &keys); err != nil {
		log.Fatalf("%s: %v", *jwksFile, err)
	}

	s := mcp.NewServer(&mcp.Implementation{Name: "mcpremote", Version: "1.0.0"}, nil)
	mcp.AddTool(s, &mcp.Tool{Name: "whoami", Description: "says whom the call's user token names"},
		func(_ context.Context, req *mcp.CallToolRequest, _ struct{}) (*mcp.CallToolResult, whoamiOut, error) {
			out := whoamiOut{Authorization: "none", RemoteAddr: req.Extra.Header.Get(remoteAddrHeader)}
			_, out.MetaToken = req.Params.GetMeta()["agentbox.dev/user-token"]
			if key := req.Extra.Header.Get("X-Api-Key"); key != "" {
				sum := sha256.Sum256([]byte(key))
				out.APIKeySHA256 = hex.EncodeToString(sum[:])
			}
			auth := req.Extra.Header.Get("Authorization")
			if auth == "" {
				return nil, out, nil
			}
			out.Authorization = "bearer"
			token, ok := strings.CutPrefix(auth, "Bearer ")
			if !ok {
				out.Error = "not a bearer token"
				return nil, out, nil
			}
			aud := *audience
			if aud == "" {
				aud = req.Extra.Header.Get(urlHeader)
			}
			c, err := usertoken.VerifyWithKeys(keys, token, *issuer, usertoken.Expectation{Audience: aud}, time.Now())
			if err != nil {
				out.Error = err.Error()
				return nil, out, nil
			}
			out.Subject, out.Actor, out.Audience = c.Subject, c.Actor.Subject, c.Audience
			return nil, out, nil
		})
	mcpHandler := mcp.NewStreamableHTTPHandler(func(*http.Request) *mcp.Server { return s }, nil)
	http.Handle("/mcp", http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		rpc := ""
		if r.Method == http.MethodPost {
			body, err := io.ReadAll(io.LimitReader(r.Body, 1<<20))
			if err != nil {
				http.Error(w, err.Error(), http.StatusBadRequest)
				return
			}
			var m struct {
				Method string `json:"method"`
			}
			_ = json.Unmarshal(body, &m)
			rpc = m.Method
			r.Body = io.NopCloser(bytes.NewReader(body))
		}
		auth := "none"
		if r.Header.Get("Authorization") != "" {
			auth = "bearer"
		}
		local, _ := r.Context().Value(http.LocalAddrContextKey).(net.Addr)
		port := ""
		if local != nil {
			_, port, _ = net.SplitHostPort(local.String())
		}
		fmt.Printf("request port=%s method=%s rpc=%s remote=%s authorization=%s\n", port, r.Method, rpc, r.RemoteAddr, auth)
		r.Header.Set(remoteAddrHeader, r.RemoteAddr)
		scheme := "http"
		if r.TLS != nil {
			scheme = "https"
		}
		r.Header.Set(urlHeader, scheme+"://"+r.Host+r.URL.Path)
		mcpHandler.ServeHTTP(w, r)
	}))
	if *tlsListen != "" {
		tlsSrv := &http.Server{Addr: *tlsListen, ReadHeaderTimeout: 10 * time.Second}
		go func() { log.Fatal(tlsSrv.ListenAndServeTLS(*tlsCert, *tlsKey)) }()
	}
	srv := &http.Server{Addr: *listen, ReadHeaderTimeout: 10 * time.Second}
	log.Fatal(srv.ListenAndServe())
}
