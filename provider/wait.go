package provider

import (
	"context"
	"fmt"
	"time"

	"github.com/hashicorp/terraform-plugin-log/tflog"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	apimeta "k8s.io/apimachinery/pkg/api/meta"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	k8stypes "k8s.io/apimachinery/pkg/types"
	"k8s.io/apimachinery/pkg/util/wait"
	"sigs.k8s.io/controller-runtime/pkg/client"
)

// waitObject polls obj until ready says it is done, logging each change of
// the reported progress so that `TF_LOG=info` shows it. On timeout the error
// carries the last progress seen, which usually names the cause (the
// controller's Ready condition, or no status at all when no control plane
// runs).
func waitObject[T any, PT crObject[T]](ctx context.Context, c client.Client, key k8stypes.NamespacedName, obj PT, timeout time.Duration,
	ready func() (done bool, progress string)) error {
	var last string
	var lastErr error
	err := wait.PollUntilContextTimeout(ctx, time.Second, timeout, true, func(ctx context.Context) (bool, error) {
		// Zeroed first: decoding into the previous poll's object would keep
		// fields that the server now omits, such as a count back at 0.
		*obj = *new(T)
		if err := c.Get(ctx, key, obj); err != nil {
			lastErr = err
			return false, ignoreTransient(err)
		}
		done, progress := ready()
		if progress != last {
			tflog.Info(ctx, "waiting for readiness", map[string]any{"object": key.String(), "progress": progress})
			last = progress
		}
		return done, nil
	})
	if err == nil {
		return nil
	}
	if last == "" {
		last = "no status yet: is the agentbox control plane (agentbox_platform) running?"
	}
	if lastErr != nil {
		last += fmt.Sprintf("; last error: %v", lastErr)
	}
	return fmt.Errorf("not ready after %s: %s: %w", timeout, last, err)
}

// readyConditionText describes a Ready condition for progress messages.
func readyConditionText(conds []metav1.Condition, conditionType string) string {
	c := apimeta.FindStatusCondition(conds, conditionType)
	if c == nil {
		return "no Ready condition yet"
	}
	return fmt.Sprintf("Ready=%s (%s: %s)", c.Status, c.Reason, c.Message)
}

// waitGone waits until the object no longer exists, so that a destroy
// followed by a create of the same name does not collide with finalizers.
func waitGone(ctx context.Context, c client.Client, key k8stypes.NamespacedName, obj client.Object, timeout time.Duration) error {
	return wait.PollUntilContextTimeout(ctx, 500*time.Millisecond, timeout, true, func(ctx context.Context) (bool, error) {
		err := c.Get(ctx, key, obj)
		if apierrors.IsNotFound(err) {
			return true, nil
		}
		return false, ignoreTransient(err)
	})
}
