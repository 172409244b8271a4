package provider

import (
	"context"
	"fmt"
	"regexp"
	"time"

	"github.com/hashicorp/terraform-plugin-framework/schema/validator"
	"github.com/hashicorp/terraform-plugin-framework/types/basetypes"
	"k8s.io/apimachinery/pkg/util/validation"
)

// objectAsOptions converts nested objects into their model structs; defaults
// make nested values known by the time a resource converts them.
var objectAsOptions = basetypes.ObjectAsOptions{}

// stringCheck is one validation rule: its description is what the docs and
// the error message say, so the two cannot drift apart.
type stringCheck struct {
	description string
	check       func(string) error
}

func (c stringCheck) Description(context.Context) string         { return c.description }
func (c stringCheck) MarkdownDescription(context.Context) string { return c.description }

func (c stringCheck) ValidateString(_ context.Context, req validator.StringRequest, resp *validator.StringResponse) {
	if req.ConfigValue.IsNull() || req.ConfigValue.IsUnknown() {
		return
	}
	if err := c.check(req.ConfigValue.ValueString()); err != nil {
		resp.Diagnostics.AddAttributeError(req.Path, "Invalid value",
			fmt.Sprintf("%q: %v (must be %s)", req.ConfigValue.ValueString(), err, c.description))
	}
}

var (
	durationCheck = stringCheck{
		description: "a positive Go duration such as `30s`, `15m` or `1h`",
		check: func(s string) error {
			d, err := time.ParseDuration(s)
			if err != nil {
				return err
			}
			if d <= 0 {
				return fmt.Errorf("not positive")
			}
			return nil
		},
	}
	dnsSubdomainCheck = stringCheck{
		description: "a Kubernetes object name: at most 253 lower-case letters, digits, `-` and `.`, starting and ending with a letter or digit",
		check: func(s string) error {
			if errs := validation.IsDNS1123Subdomain(s); len(errs) > 0 {
				return fmt.Errorf("%s", errs[0])
			}
			return nil
		},
	}
	agentIDPattern = regexp.MustCompile(`^[A-Za-z0-9][A-Za-z0-9._@:+-]*$`)
	agentIDCheck   = stringCheck{
		description: "1 to 253 letters, digits and `. _ @ : + -`, starting with a letter or digit",
		check: func(s string) error {
			if len(s) == 0 || len(s) > 253 || !agentIDPattern.MatchString(s) {
				return fmt.Errorf("not a valid agent id")
			}
			return nil
		},
	}
)
