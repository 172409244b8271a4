package controller

import (
	"context"
	"errors"
	"fmt"
	"strconv"
	"sync"
	"time"

	"github.com/go-logr/logr"
	appsv1 "k8s.io/api/apps/v1"
	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/client-go/tools/events"
	"k8s.io/utils/clock"
	"sigs.k8s.io/controller-runtime/pkg/client"
	"sigs.k8s.io/controller-runtime/pkg/controller/controllerutil"

	"github.com/agentbox/terraform-provider-agentbox/internal/api/v1alpha1"
	"github.com/agentbox/terraform-provider-agentbox/internal/snapshot"
)

// Defaults of SnapshotCheck.
const (
	DefaultSnapshotCheckInterval = time.Minute
	defaultSnapshotCheckTimeout  = 30 * time.Second
	// snapshotCheckRepublish bounds how old the published checkedAt gets
	// while the result stays the same.
	snapshotCheckRepublish = 10 * time.Minute
)

// Events of the snapshot check, on the control plane's Deployment.
const (
	EventSnapshotCheckFailed = "SnapshotCheckFailed"
	EventSnapshotCheckPassed = "SnapshotCheckPassed"
)

// SnapshotCheck finds out, at start and every Interval, whether the
// snapshot driver can work in this cluster (snapshot.Checker), and tells:
//
//   - the sandbox controller, which begins no idle stop while the driver
//     cannot work (SnapshotHealth), so that sandboxes keep serving and say
//     why in their IdleStopBlocked condition;
//   - the Terraform provider and people, through the ConfigMap
//     v1alpha1.ControlPlaneStatusConfigMap in the platform namespace;
//   - `kubectl describe` of the control plane Deployment, through a Warning
//     event when the check starts failing or fails differently, and a
//     Normal one when it passes.
//
// Like the controllers it runs on the leader only.
type SnapshotCheck struct {
	// Driver is checked when it implements snapshot.Checker; other drivers
	// are taken to work.
	Driver snapshot.Driver
	// Client writes the ConfigMap; Reader reads it and the Deployment
	// straight from the API server (the manager's cache watches neither).
	Client client.Client
	Reader client.Reader
	// Recorder receives the events; nil records none.
	Recorder events.EventRecorder
	// Namespace is the platform namespace; Deployment the control plane's
	// Deployment in it, which owns the ConfigMap and carries the events
	// (neither happens when it does not exist); PodName the pod this runs
	// in, for the ConfigMap's reportedBy.
	Namespace  string
	Deployment string
	PodName    string
	// Hint returns how to fix a problem, in the terms the platform is
	// configured in (the chart's values); nil adds nothing.
	Hint func(*snapshot.Problem) string
	// Interval defaults to DefaultSnapshotCheckInterval.
	Interval time.Duration
	Log      logr.Logger
	// Clock defaults to the real clock.
	Clock clock.PassiveClock

	mu        sync.Mutex
	problem   *snapshot.Problem
	last      checkResult
	published time.Time
}

var _ SnapshotHealth = (*SnapshotCheck)(nil)

// checkResult is one outcome of the check, as published.
type checkResult struct {
	ready           bool
	reason, message string
}

// Problem implements SnapshotHealth: the problem the last check found, or
// nil when it found none, has not run yet, or could not find out.
func (c *SnapshotCheck) Problem() *snapshot.Problem {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.problem
}

// Start runs the check until ctx ends; it implements manager.Runnable.
func (c *SnapshotCheck) Start(ctx context.Context) error {
	interval := c.Interval
	if interval <= 0 {
		interval = DefaultSnapshotCheckInterval
	}
	tick := time.NewTicker(interval)
	defer tick.Stop()
	for {
		c.RunOnce(ctx)
		select {
		case <-ctx.Done():
			return nil
		case <-tick.C:
		}
	}
}

// RunOnce checks once and publishes the result.
func (c *SnapshotCheck) RunOnce(ctx context.Context) {
	cctx, cancel := context.WithTimeout(ctx, defaultSnapshotCheckTimeout)
	res, problem := c.check(cctx)
	cancel()
	if ctx.Err() != nil {
		return
	}
	now := nowOf(c.Clock)
	c.mu.Lock()
	c.problem = problem
	changed := res != c.last
	stale := now.Sub(c.published) >= snapshotCheckRepublish
	c.last = res
	c.mu.Unlock()
	if !changed && !stale {
		return
	}
	if changed {
		if res.ready {
			c.Log.Info("snapshot check passed", "driver", snapshot.ID(c.Driver), "message", res.message)
		} else {
			c.Log.Info("snapshot check failed: idle stops are held back", "driver", snapshot.ID(c.Driver), "reason", res.reason, "message", res.message)
		}
	}
	if err := c.publish(ctx, res, now, changed); err != nil {
		// The next round tries again.
		c.Log.Error(err, "publish the snapshot check")
		return
	}
	c.mu.Lock()
	c.published = now
	c.mu.Unlock()
}

func (c *SnapshotCheck) check(ctx context.Context) (checkResult, *snapshot.Problem) {
	id := snapshot.ID(c.Driver)
	checker, ok := c.Driver.(snapshot.Checker)
	if !ok {
		return checkResult{ready: true, reason: v1alpha1.ReasonSnapshotDriverReady,
			message: fmt.Sprintf("the %s snapshot driver has no check of its own", id)}, nil
	}
	err := checker.Check(ctx)
	var p *snapshot.Problem
	switch {
	case errors.As(err, &p):
		msg := fmt.Sprintf("the %s snapshot driver cannot work: %s", id, p.Message)
		if c.Hint != nil {
			if h := c.Hint(p); h != "" {
				msg += "; to fix it, " + h
			}
		}
		return checkResult{reason: p.Reason, message: msg}, &snapshot.Problem{Reason: p.Reason, Message: msg}
	case err != nil:
		// Not known to be broken: stops go on, and fail on their own if
		// it is.
		return checkResult{reason: v1alpha1.ReasonSnapshotCheckFailed,
			message: fmt.Sprintf("the check of the %s snapshot driver could not run (it is tried again): %v", id, err)}, nil
	}
	return checkResult{ready: true, reason: v1alpha1.ReasonSnapshotDriverReady,
		message: fmt.Sprintf("the %s snapshot driver can take and restore snapshots", id)}, nil
}

// publish writes the ConfigMap, and an event when the result changed.
func (c *SnapshotCheck) publish(ctx context.Context, res checkResult, now time.Time, changed bool) error {
	var deploy *appsv1.Deployment
	if c.Deployment != "" {
		var d appsv1.Deployment
		err := c.Reader.Get(ctx, types.NamespacedName{Namespace: c.Namespace, Name: c.Deployment}, &d)
		switch {
		case err == nil:
			deploy = &d
		case !apierrors.IsNotFound(err):
			return fmt.Errorf("get Deployment %s/%s: %w", c.Namespace, c.Deployment, err)
		}
	}
	if changed && deploy != nil && c.Recorder != nil {
		if res.ready {
			c.Recorder.Eventf(deploy, nil, corev1.EventTypeNormal, EventSnapshotCheckPassed, "Check", "%s", truncateEventNote(res.message))
		} else {
			c.Recorder.Eventf(deploy, nil, corev1.EventTypeWarning, EventSnapshotCheckFailed, "Check", "%s", truncateEventNote(res.message+" ("+res.reason+")"))
		}
	}
	data := map[string]string{
		v1alpha1.StatusKeySnapshotDriver:    snapshot.ID(c.Driver),
		v1alpha1.StatusKeySnapshotReady:     strconv.FormatBool(res.ready),
		v1alpha1.StatusKeySnapshotReason:    res.reason,
		v1alpha1.StatusKeySnapshotMessage:   res.message,
		v1alpha1.StatusKeySnapshotCheckedAt: now.UTC().Format(time.RFC3339),
		v1alpha1.StatusKeyReportedBy:        c.PodName,
	}
	key := types.NamespacedName{Namespace: c.Namespace, Name: v1alpha1.ControlPlaneStatusConfigMap}
	var cm corev1.ConfigMap
	err := c.Reader.Get(ctx, key, &cm)
	if apierrors.IsNotFound(err) {
		cm = corev1.ConfigMap{ObjectMeta: metav1.ObjectMeta{Name: key.Name, Namespace: key.Namespace,
			Labels: map[string]string{"app.kubernetes.io/part-of": "agentbox", "app.kubernetes.io/component": "controlplane"}}}
		if err := c.own(deploy, &cm); err != nil {
			return err
		}
		cm.Data = data
		if err := c.Client.Create(ctx, &cm); err != nil {
			return fmt.Errorf("create ConfigMap %s: %w", key, err)
		}
		return nil
	}
	if err != nil {
		return fmt.Errorf("get ConfigMap %s: %w", key, err)
	}
	if err := c.own(deploy, &cm); err != nil {
		return err
	}
	cm.Data = data
	if err := c.Client.Update(ctx, &cm); err != nil {
		return fmt.Errorf("update ConfigMap %s: %w", key, err)
	}
	return nil
}

// own makes the Deployment an owner of the ConfigMap, so that it goes when
// the platform is uninstalled.
func (c *SnapshotCheck) own(deploy *appsv1.Deployment, cm *corev1.ConfigMap) error {
	if deploy == nil {
		return nil
	}
	if err := controllerutil.SetOwnerReference(deploy, cm, c.Client.Scheme()); err != nil {
		return fmt.Errorf("own ConfigMap %s: %w", cm.Name, err)
	}
	return nil
}
