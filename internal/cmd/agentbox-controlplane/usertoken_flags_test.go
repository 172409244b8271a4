package main

import (
	"context"
	"io"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/agentbox/terraform-provider-agentbox/internal/store"
)

// The user token flags: defaults, the issuer URL derived from the API's
// Service, and refusals that name the flag.
func TestParseOptionsUserTokens(t *testing.T) {
	none := func(string) string { return "" }
	o, err := parseOptions(nil, none, io.Discard)
	if err != nil || o.userTokens.rotationPeriod != 24*time.Hour || o.userTokens.maxLifetime != time.Hour {
		t.Fatalf("defaults: %+v, %v", o.userTokens, err)
	}
	if is, err := o.userTokens.issuer(nil, o); err != nil || is != nil {
		t.Errorf("without a store: %v, %v, want no issuer", is, err)
	}
	st, err := store.OpenSQLite(context.Background(), filepath.Join(t.TempDir(), "s.db"), store.Options{})
	if err != nil {
		t.Fatal(err)
	}
	defer st.Close()
	is, err := o.userTokens.issuer(st, o)
	if err != nil || is.IssuerURL() != "https://agentbox-api.agentbox-system.svc" {
		t.Fatalf("default issuer: %v, %v", is, err)
	}
	env := map[string]string{"AGENTBOX_USER_TOKEN_ISSUER": "https://agentbox.example"}
	o, err = parseOptions([]string{"--user-token-key-rotation=6h", "--user-token-max-lifetime=15m"}, func(k string) string { return env[k] }, io.Discard)
	if err != nil || o.userTokens.issuerURL != "https://agentbox.example" || o.userTokens.rotationPeriod != 6*time.Hour ||
		o.userTokens.maxLifetime != 15*time.Minute {
		t.Fatalf("set: %+v, %v", o.userTokens, err)
	}
	for _, args := range [][]string{{"--user-token-issuer=http://plain"}, {"--user-token-key-rotation=1s"},
		{"--user-token-max-lifetime=48h"}, {"--user-token-max-lifetime=0s"}} {
		if _, err := parseOptions(args, none, io.Discard); err == nil || !strings.Contains(err.Error(), strings.SplitN(args[0], "=", 2)[0]) {
			t.Errorf("%q: %v, want a refusal naming the flag", args, err)
		}
	}
}
