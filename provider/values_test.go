package provider

import (
	"testing"
	"time"

	"github.com/hashicorp/terraform-plugin-framework/types"
	"k8s.io/apimachinery/pkg/api/resource"
)

func TestKeepDuration(t *testing.T) {
	for _, tc := range []struct {
		prior types.String
		live  time.Duration
		want  string
	}{
		{types.StringValue("90m"), 90 * time.Minute, "90m"},  // equal: the user's spelling stays
		{types.StringValue("120s"), 2 * time.Minute, "120s"}, // equal
		{types.StringValue("1h"), 2 * time.Hour, "2h"},       // changed out of band: shows as drift
		{types.StringNull(), 90 * time.Minute, "1h30m"},      // imported: no zero units
		{types.StringNull(), time.Hour, "1h"},                //
		{types.StringNull(), 30 * time.Second, "30s"},        //
		{types.StringValue("bogus"), time.Minute, "1m"},      // unparsable prior: live wins
	} {
		if got := keepDuration(tc.prior, tc.live).ValueString(); got != tc.want {
			t.Errorf("keepDuration(%v, %v) = %q, want %q", tc.prior, tc.live, got, tc.want)
		}
	}
}

func TestKeepQuantity(t *testing.T) {
	for _, tc := range []struct {
		prior types.String
		live  string
		want  string
	}{
		{types.StringValue("1024Mi"), "1Gi", "1024Mi"},
		{types.StringValue("0.5"), "500m", "0.5"},
		{types.StringValue("1Gi"), "2Gi", "2Gi"},
		{types.StringNull(), "1Gi", "1Gi"},
	} {
		if got := keepQuantity(tc.prior, resource.MustParse(tc.live)).ValueString(); got != tc.want {
			t.Errorf("keepQuantity(%v, %s) = %q, want %q", tc.prior, tc.live, got, tc.want)
		}
	}
}
