package chart

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"time"

	"helm.sh/helm/v3/pkg/action"
	"helm.sh/helm/v3/pkg/chart"
	"helm.sh/helm/v3/pkg/chartutil"
	"helm.sh/helm/v3/pkg/kube"
	"helm.sh/helm/v3/pkg/release"
	"helm.sh/helm/v3/pkg/storage/driver"
	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/rest"
)

// ErrNotFound means the release does not exist.
var ErrNotFound = errors.New("release not found")

// Options say what to install or upgrade to.
type Options struct {
	Namespace   string
	ReleaseName string
	Values      Values
	// Wait makes Install and Upgrade wait until the control plane Deployment
	// is ready, and count it as a failure when it is not ready within
	// Timeout. Without it they return once Kubernetes has accepted the
	// objects. Either way a failure is undone: a failed install is
	// uninstalled, a failed upgrade rolled back to the revision before.
	Wait bool
	// Timeout bounds the wait; 0 means 5 minutes.
	Timeout time.Duration
}

const (
	defaultTimeout = 5 * time.Minute
	// maxHistory keeps a few revisions to roll back to without letting
	// release Secrets (each holding the whole chart) pile up.
	maxHistory = 10
	// rollbackTimeout is what a rollback gets after the wait used up the
	// caller's budget: undoing must not be cut short by the failure it undoes.
	rollbackTimeout = 2 * time.Minute
)

func (o Options) timeout() time.Duration {
	if o.Timeout > 0 {
		return o.Timeout
	}
	return defaultTimeout
}

// Release is what the cluster records about an installation.
type Release struct {
	Name      string
	Namespace string
	Revision  int
	// Status is Helm's: deployed, failed, pending-install, ...
	Status       string
	Description  string
	ChartVersion string
	AppVersion   string
	// Manifest is every object the release's templates rendered, as YAML.
	Manifest string
	// Notes is the rendered NOTES.txt.
	Notes string
	// Config holds the values the release was installed with (not the
	// chart's defaults).
	Config map[string]any
	// CRDs names the CustomResourceDefinitions of the release's chart. They
	// are not in Manifest: Helm handles crds/ apart from templates.
	CRDs []string

	// values are the chart defaults with Config merged in: what the
	// templates saw.
	values map[string]any
}

// CASecret is the name of the Secret holding the platform CA.
func (r *Release) CASecret() string {
	return r.stringValue(DefaultCASecret, "ca", "existingSecret")
}

// AdminTokenSecret is the name of the Secret holding the admin token under
// AdminTokenKey.
func (r *Release) AdminTokenSecret() string {
	return r.stringValue(DefaultAdminTokenSecret, "adminToken", "existingSecret")
}

func (r *Release) stringValue(def string, keys ...string) string {
	v, err := chartutil.Values(r.values).PathValue(strings.Join(keys, "."))
	if s, ok := v.(string); err == nil && ok && s != "" {
		return s
	}
	return def
}

func fromHelm(r *release.Release) *Release {
	out := &Release{
		Name: r.Name, Namespace: r.Namespace, Revision: r.Version,
		Manifest: r.Manifest, Config: r.Config,
	}
	if out.Config == nil {
		out.Config = map[string]any{}
	}
	if r.Info != nil {
		out.Status = r.Info.Status.String()
		out.Description = r.Info.Description
		out.Notes = r.Info.Notes
	}
	if r.Chart != nil {
		if r.Chart.Metadata != nil {
			out.ChartVersion = r.Chart.Metadata.Version
			out.AppVersion = r.Chart.Metadata.AppVersion
		}
		if objs, err := crdObjects(r.Chart); err == nil {
			for _, o := range objs {
				out.CRDs = append(out.CRDs, o.GetName())
			}
		}
		if vals, err := chartutil.CoalesceValues(r.Chart, r.Config); err == nil {
			out.values = vals
		}
	}
	return out
}

// Client installs and manages releases of the embedded chart.
type Client struct {
	cfg *rest.Config
	// Log receives Helm's progress messages; nil discards them.
	Log func(format string, args ...any)
}

// New returns a Client for the cluster cfg points at.
func New(cfg *rest.Config) *Client { return &Client{cfg: cfg} }

func (c *Client) log(format string, args ...any) {
	if c.Log != nil {
		c.Log(format, args...)
	}
}

// actionConfig builds a Helm configuration whose release records (Secrets)
// live in namespace, as `helm --namespace` would.
func (c *Client) actionConfig(namespace string) (*action.Configuration, *restClientGetter, error) {
	getter := newRESTClientGetter(c.cfg, namespace)
	ac := new(action.Configuration)
	if err := ac.Init(getter, namespace, "secret", c.log); err != nil {
		return nil, nil, fmt.Errorf("configuring Helm: %w", err)
	}
	if kc, ok := ac.KubeClient.(*kube.Client); ok {
		kc.Namespace = namespace
	}
	return ac, getter, nil
}

func (c *Client) clientset() (kubernetes.Interface, error) {
	cs, err := kubernetes.NewForConfig(c.cfg)
	if err != nil {
		return nil, fmt.Errorf("creating Kubernetes client: %w", err)
	}
	return cs, nil
}

// Status returns the latest revision of the release, or ErrNotFound.
func (c *Client) Status(_ context.Context, namespace, name string) (*Release, error) {
	ac, _, err := c.actionConfig(namespace)
	if err != nil {
		return nil, err
	}
	r, err := action.NewGet(ac).Run(name)
	if errors.Is(err, driver.ErrReleaseNotFound) {
		return nil, fmt.Errorf("%s/%s: %w", namespace, name, ErrNotFound)
	}
	if err != nil {
		return nil, fmt.Errorf("reading release %s/%s: %w", namespace, name, err)
	}
	return fromHelm(r), nil
}

// Install installs the chart as a new release, creating the namespace,
// labelled to enforce the restricted Pod Security Standard, if needed. An
// existing release of that name is an error, never adopted.
func (c *Client) Install(ctx context.Context, o Options) (*Release, error) {
	if _, err := c.Status(ctx, o.Namespace, o.ReleaseName); err == nil {
		return nil, fmt.Errorf("release %s/%s already exists; import it instead of installing it again", o.Namespace, o.ReleaseName)
	} else if !errors.Is(err, ErrNotFound) {
		return nil, err
	}
	ch, vals, ac, err := c.prepareRelease(ctx, o)
	if err != nil {
		return nil, err
	}

	inst := action.NewInstall(ac)
	inst.Namespace = o.Namespace
	inst.ReleaseName = o.ReleaseName
	// applyCRDs did it, and unlike Helm it also upgrades them.
	inst.SkipCRDs = true
	inst.Timeout = o.timeout()
	inst.Description = "Install by agentbox"

	waitCtx, cancel := context.WithTimeout(ctx, o.timeout())
	defer cancel()
	rel, err := inst.RunWithContext(waitCtx, ch, vals)
	if err != nil {
		err = fmt.Errorf("installing release %s/%s: %w", o.Namespace, o.ReleaseName, err)
		if rel != nil {
			// Helm may have recorded the release and created some objects.
			return nil, errors.Join(err, c.uninstallAfterFailure(o))
		}
		return nil, err
	}
	if o.Wait {
		if err := c.waitReady(waitCtx, o); err != nil {
			return nil, errors.Join(err, c.uninstallAfterFailure(o))
		}
	}
	return c.Status(ctx, o.Namespace, o.ReleaseName)
}

// prepareRelease readies what an install or an upgrade needs before Helm
// runs: the chart and values, Helm's configuration, the CRDs (applied
// here, and unlike Helm also upgraded) and the namespace (instead of
// Helm's CreateNamespace: see ensureNamespace).
func (c *Client) prepareRelease(ctx context.Context, o Options) (*chart.Chart, map[string]any, *action.Configuration, error) {
	ch, vals, err := prepare(o)
	if err != nil {
		return nil, nil, nil, err
	}
	ac, getter, err := c.actionConfig(o.Namespace)
	if err != nil {
		return nil, nil, nil, err
	}
	if err := c.applyCRDs(ctx, ch); err != nil {
		return nil, nil, nil, err
	}
	getter.resetMapper()
	if err := c.ensureNamespace(ctx, o.Namespace); err != nil {
		return nil, nil, nil, err
	}
	return ch, vals, ac, nil
}

func (c *Client) uninstallAfterFailure(o Options) error {
	c.log("install of %s/%s failed: uninstalling it", o.Namespace, o.ReleaseName)
	ctx, cancel := context.WithTimeout(context.Background(), rollbackTimeout)
	defer cancel()
	if err := c.Uninstall(ctx, o.Namespace, o.ReleaseName, rollbackTimeout, true); err != nil {
		return fmt.Errorf("uninstalling the failed release: %w", err)
	}
	return nil
}

// Upgrade upgrades the release to the embedded chart and o.Values, which
// replace (not extend) the values of the previous revision. Objects of the
// release that were deleted from the cluster are created again.
func (c *Client) Upgrade(ctx context.Context, o Options) (*Release, error) {
	current, err := c.Status(ctx, o.Namespace, o.ReleaseName)
	if err != nil {
		return nil, err
	}
	if strings.HasPrefix(current.Status, "pending-") {
		return nil, fmt.Errorf("release %s/%s is %s: another operation is in progress or was interrupted; "+
			"if none is running, roll it back with `helm rollback -n %s %s`",
			o.Namespace, o.ReleaseName, current.Status, o.Namespace, o.ReleaseName)
	}
	ch, vals, ac, err := c.prepareRelease(ctx, o)
	if err != nil {
		return nil, err
	}

	up := action.NewUpgrade(ac)
	up.Namespace = o.Namespace
	up.SkipCRDs = true
	// Terraform's configuration is the whole truth: values set by an
	// earlier revision, or by hand, do not linger.
	up.ResetValues = true
	up.MaxHistory = maxHistory
	// Objects new in this revision are deleted again if it fails.
	up.CleanupOnFail = true
	up.Timeout = o.timeout()
	up.Description = "Upgrade by agentbox"

	waitCtx, cancel := context.WithTimeout(ctx, o.timeout())
	defer cancel()
	rel, err := up.RunWithContext(waitCtx, o.ReleaseName, ch, vals)
	if err != nil {
		err = fmt.Errorf("upgrading release %s/%s: %w", o.Namespace, o.ReleaseName, err)
		if rel != nil && current.Status == release.StatusDeployed.String() {
			return nil, errors.Join(err, c.rollback(ac, o, current.Revision))
		}
		return nil, err
	}
	if o.Wait {
		if err := c.waitReady(waitCtx, o); err != nil {
			if current.Status == release.StatusDeployed.String() {
				err = errors.Join(err, c.rollback(ac, o, current.Revision))
			}
			return nil, err
		}
	}
	return c.Status(ctx, o.Namespace, o.ReleaseName)
}

// rollback returns to revision without waiting: that revision was ready
// before, and the caller's time is spent.
func (c *Client) rollback(ac *action.Configuration, o Options, revision int) error {
	c.log("upgrade of %s/%s failed: rolling back to revision %d", o.Namespace, o.ReleaseName, revision)
	rb := action.NewRollback(ac)
	rb.Version = revision
	rb.Timeout = rollbackTimeout
	rb.MaxHistory = maxHistory
	rb.CleanupOnFail = true
	if err := rb.Run(o.ReleaseName); err != nil {
		return fmt.Errorf("rolling back to revision %d: %w", revision, err)
	}
	return nil
}

// Uninstall deletes the release and its objects and, with wait, waits
// until they are gone. A release that does not exist is not an error. The
// agentbox.dev CRDs, and with them every Sandbox, stay: deleting a CRD
// deletes all its objects. So does the generated CA Secret (see
// values.yaml).
func (c *Client) Uninstall(_ context.Context, namespace, name string, timeout time.Duration, wait bool) error {
	ac, _, err := c.actionConfig(namespace)
	if err != nil {
		return err
	}
	un := action.NewUninstall(ac)
	un.IgnoreNotFound = true
	un.Wait = wait
	// Foreground: the Deployment is gone only once its pods are, so the
	// store volume is free when the platform is installed again right away.
	// Without waiting, background: foreground deletion leaves the objects
	// behind until the garbage collector has removed their dependents.
	un.DeletionPropagation = "background"
	if wait {
		un.DeletionPropagation = "foreground"
	}
	un.Timeout = timeout
	if un.Timeout <= 0 {
		un.Timeout = defaultTimeout
	}
	if _, err := un.Run(name); err != nil {
		return fmt.Errorf("uninstalling release %s/%s: %w", namespace, name, err)
	}
	return nil
}

// Template renders the chart as `helm template` would, without a cluster:
// nothing is looked up, so the chart refuses to generate the CA and the
// admin token (values must name existing Secrets for both, see
// templates/secrets.yaml). RenderInstall renders as an install would.
func Template(namespace, releaseName string, v Values) (*Release, error) {
	ch, vals, err := prepare(Options{Namespace: namespace, ReleaseName: releaseName, Values: v})
	if err != nil {
		return nil, err
	}
	inst := action.NewInstall(&action.Configuration{Log: func(string, ...any) {}})
	inst.DryRun = true
	inst.ClientOnly = true
	inst.Replace = true
	inst.Namespace = namespace
	inst.ReleaseName = releaseName
	kv := renderKubeVersion
	inst.KubeVersion = &kv
	rel, err := inst.Run(ch, vals)
	if err != nil {
		return nil, fmt.Errorf("rendering the chart: %w", err)
	}
	return fromHelm(rel), nil
}

func prepare(o Options) (*chart.Chart, map[string]any, error) {
	if o.Namespace == "" || o.ReleaseName == "" {
		return nil, nil, errors.New("namespace and release name must be set")
	}
	ch, err := Load()
	if err != nil {
		return nil, nil, err
	}
	vals, err := o.Values.Map()
	if err != nil {
		return nil, nil, err
	}
	return ch, vals, nil
}
