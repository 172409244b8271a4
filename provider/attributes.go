package provider

import (
	"context"
	"fmt"
	"time"

	"github.com/hashicorp/terraform-plugin-framework-timeouts/resource/timeouts"
	"github.com/hashicorp/terraform-plugin-framework/resource/schema"
	"github.com/hashicorp/terraform-plugin-framework/resource/schema/planmodifier"
	"github.com/hashicorp/terraform-plugin-framework/resource/schema/stringplanmodifier"
	"github.com/hashicorp/terraform-plugin-framework/schema/validator"

	agentboxv1alpha1 "github.com/agentbox/terraform-provider-agentbox/internal/api/v1alpha1"
)

// Schema attributes that several resources declare alike, so that an
// attribute reads and behaves the same wherever it appears.

// defaultRuntimeClass is the CRDs' default RuntimeClass, which node pools
// and templates plan when the configuration names none.
const defaultRuntimeClass = agentboxv1alpha1.DefaultRuntimeClassName

func idAttribute(kind string) schema.StringAttribute {
	return schema.StringAttribute{
		Computed:            true,
		MarkdownDescription: "`<namespace>/<name>` of the " + kind + ".",
		PlanModifiers:       []planmodifier.String{stringplanmodifier.UseStateForUnknown()},
	}
}

func nameAttribute(kind string) schema.StringAttribute {
	return schema.StringAttribute{
		Required:            true,
		MarkdownDescription: "Name of the " + kind + " object. Changing it replaces the object.",
		PlanModifiers:       []planmodifier.String{stringplanmodifier.RequiresReplace()},
		Validators:          []validator.String{dnsSubdomainCheck},
	}
}

func namespaceAttribute(kind string) schema.StringAttribute {
	return schema.StringAttribute{
		Optional: true, Computed: true,
		MarkdownDescription: "Namespace of the " + kind + ". Defaults to the provider's `namespace`. Changing it replaces the object.",
		PlanModifiers:       []planmodifier.String{stringplanmodifier.RequiresReplaceIfConfigured(), stringplanmodifier.UseStateForUnknown()},
	}
}

// timeoutDoc says what one operation's timeout bounds and its default.
type timeoutDoc struct {
	bounds string
	def    time.Duration
}

// timeoutsAttribute is the `timeouts` attribute with a MarkdownDescription
// on it and on each operation, which the timeouts library leaves empty,
// built from the same defaults the resource applies.
func timeoutsAttribute(ctx context.Context, create, update, del *timeoutDoc) schema.Attribute {
	a := timeouts.Attributes(ctx, timeouts.Opts{Create: create != nil, Update: update != nil, Delete: del != nil}).(schema.SingleNestedAttribute)
	a.MarkdownDescription = "How long operations may take before they fail; each value is " + durationCheck.description + "."
	for name, doc := range map[string]*timeoutDoc{"create": create, "update": update, "delete": del} {
		if doc == nil {
			continue
		}
		s := a.Attributes[name].(schema.StringAttribute)
		s.MarkdownDescription = fmt.Sprintf("Bounds %s. Defaults to `%s`.", doc.bounds, formatDuration(doc.def))
		a.Attributes[name] = s
	}
	return a
}
