package provider

import (
	"context"
	"testing"

	"k8s.io/apimachinery/pkg/types"
	"sigs.k8s.io/controller-runtime/pkg/client"
)

// getObject reads a live object for a test's checks and out-of-band edits.
func getObject[T any, PT interface {
	*T
	client.Object
}](t *testing.T, c client.Client, key types.NamespacedName) PT {
	t.Helper()
	obj := PT(new(T))
	if err := c.Get(context.Background(), key, obj); err != nil {
		t.Fatal(err)
	}
	return obj
}
