package provider

import (
	"context"
	"testing"

	"github.com/hashicorp/terraform-plugin-framework/diag"
	"github.com/hashicorp/terraform-plugin-framework/types"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"

	agentboxv1alpha1 "github.com/agentbox/terraform-provider-agentbox/internal/api/v1alpha1"
)

// credentialsValue reads a credential whose value is the resource's own
// Secret's key as value_wo's, keeping its version only while the key
// holds a value; any other reference is secret_ref. Rewrites follow the
// versions: new, changed or forgotten ones are written, others kept.
func TestEgressCredentialsValue(t *testing.T) {
	ctx := context.Background()
	var diags diag.Diagnostics
	ep := &agentboxv1alpha1.EgressProxy{
		ObjectMeta: metav1.ObjectMeta{Name: "p", Namespace: "ns"},
		Spec: agentboxv1alpha1.EgressProxySpec{Credentials: []agentboxv1alpha1.EgressCredential{
			{Name: "api", Hosts: []agentboxv1alpha1.Domain{"api.example.com"}, SecretRef: injectedSecretRef("p", "api"),
				Header: &agentboxv1alpha1.EgressCredentialHeader{Name: "Authorization"}},
			{Name: "other", Hosts: []agentboxv1alpha1.Domain{"b.example.com"}, SecretRef: injectedSecretRef("p", "elsewhere"),
				BasicAuth: &agentboxv1alpha1.EgressCredentialBasicAuth{}},
		}},
	}
	null := types.ListNull(types.ObjectType{AttrTypes: egressCredentialAttrTypes})

	// Imported: no prior state, so no version, whatever the Secret holds.
	imported := credentialsValue(ctx, null, ep, map[string]bool{"api": true}, &diags)
	var creds []egressCredentialModel
	diags.Append(imported.ElementsAs(ctx, &creds, false)...)
	if diags.HasError() || len(creds) != 2 {
		t.Fatalf("%v, %d credentials", diags, len(creds))
	}
	if !creds[0].ValueWOVersion.IsNull() || !creds[0].SecretRef.IsNull() || !creds[0].ValueWO.IsNull() {
		t.Errorf("imported value_wo credential: %+v", creds[0])
	}
	// The key of another name in the owned Secret is not value_wo's.
	var ref secretKeyModel
	diags.Append(creds[1].SecretRef.As(ctx, &ref, objectAsOptions)...)
	if ref.Name.ValueString() != "p-egress-injected" || ref.Key.ValueString() != "elsewhere" || !creds[1].ValueWOVersion.IsNull() {
		t.Errorf("secret_ref credential: %+v", creds[1])
	}

	// With a prior version: kept while the key is there, forgotten when not.
	creds[0].ValueWOVersion = types.Int64Value(3)
	prior, d := types.ListValueFrom(ctx, types.ObjectType{AttrTypes: egressCredentialAttrTypes}, creds)
	diags.Append(d...)
	for present, want := range map[bool]types.Int64{true: types.Int64Value(3), false: types.Int64Null()} {
		got := credentialVersions(ctx, credentialsValue(ctx, prior, ep, map[string]bool{"api": present}, &diags), &diags)
		if v, ok := got["api"]; ok != present || (ok && !v.Equal(want)) {
			t.Errorf("key present %v: versions %v, want %v", present, got, want)
		}
	}

	// No credentials: an empty list stays empty, otherwise null.
	empty, d := types.ListValueFrom(ctx, types.ObjectType{AttrTypes: egressCredentialAttrTypes}, []egressCredentialModel{})
	diags.Append(d...)
	none := &agentboxv1alpha1.EgressProxy{ObjectMeta: ep.ObjectMeta}
	if v := credentialsValue(ctx, empty, none, nil, &diags); v.IsNull() || len(v.Elements()) != 0 {
		t.Errorf("empty list read back as %v", v)
	}
	if v := credentialsValue(ctx, prior, none, nil, &diags); !v.IsNull() {
		t.Errorf("credentials removed out of band read back as %v", v)
	}
	if diags.HasError() {
		t.Fatal(diags)
	}
	if usesInjectedSecret(none) || !usesInjectedSecret(ep) {
		t.Error("usesInjectedSecret")
	}
}
