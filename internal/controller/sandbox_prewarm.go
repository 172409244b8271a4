package controller

import (
	"context"
	"crypto/sha256"
	"encoding/hex"
	"encoding/json"
	"fmt"
	"strings"
	"sync"
	"time"

	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	"k8s.io/apimachinery/pkg/api/meta"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"
	"sigs.k8s.io/controller-runtime/pkg/client"
	logf "sigs.k8s.io/controller-runtime/pkg/log"

	"github.com/agentbox/terraform-provider-agentbox/internal/api/v1alpha1"
	"github.com/agentbox/terraform-provider-agentbox/internal/supervisor/pyenv"
	"github.com/agentbox/terraform-provider-agentbox/internal/supervisor/supervisorapi"
)

// A warm pool's pythonEnvironments are built in each of its ready,
// unassigned sandboxes by this controller, through the sandbox's
// supervisor (POST /v1/envs, as the Compute API's envs create does), in the
// background: a build takes minutes, which a reconcile must not. What
// was built goes into the sandbox's environment inventory (the
// annotations the Compute API routes pool leases by), a failure into
// AnnotationPrewarmFailed; either change of metadata brings the sandbox
// back here, and its PythonEnvironmentsReady condition is set from them.

// Event reasons of a warm sandbox's pre-warm.
const (
	EventPrewarmingEnvironments = "PrewarmingEnvironments"
)

// prewarmBuildTimeout bounds one environment's build call: the supervisor
// bounds the build itself (its env-create-timeout) and answers timeout;
// this guards against one that never answers.
const prewarmBuildTimeout = pyenv.DefaultCreateTimeout + time.Minute

// prewarmRecheck is how soon a sandbox whose build is under way is looked
// at again, should its end bring no change of metadata.
const prewarmRecheck = 30 * time.Second

// prewarms are the builds under way, by sandbox UID, with the hash of the
// environments they build.
type prewarms struct {
	mu      sync.Mutex
	running map[types.UID]string
}

func (p *prewarms) start(uid types.UID, hash string) bool {
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.running == nil {
		p.running = map[types.UID]string{}
	}
	if _, busy := p.running[uid]; busy {
		return false
	}
	p.running[uid] = hash
	return true
}

func (p *prewarms) done(uid types.UID) {
	p.mu.Lock()
	defer p.mu.Unlock()
	delete(p.running, uid)
}

// prewarmHash names one value of AnnotationPrewarmEnvs in
// AnnotationPrewarmFailed.
func prewarmHash(v string) string {
	h := sha256.Sum256([]byte(v))
	return hex.EncodeToString(h[:6])
}

// prewarmName is the inventory name of a pre-warmed environment: its name,
// or the key of its requirements under the template's package indexes.
func prewarmName(e v1alpha1.WarmPythonEnvironment, tpl *v1alpha1.SandboxTemplate) (string, error) {
	if e.Name != "" {
		return e.Name, nil
	}
	return pyenv.RequirementsKey(e.Requirements, tpl.Spec.Python.IndexURL, tpl.Spec.Python.ExtraIndexURLs)
}

// prewarmLabel names a pre-warmed environment to a person: by its name,
// or by its requirements.
func prewarmLabel(e v1alpha1.WarmPythonEnvironment) string {
	if e.Name != "" {
		return fmt.Sprintf("%q", e.Name)
	}
	return "of requirements " + strings.Join(e.Requirements, " ")
}

// prewarm sets the PythonEnvironmentsReady condition of a ready warm
// sandbox whose pool declares environments, and starts their build when
// some are missing. It returns when to look again (0: no need).
func (r *SandboxReconciler) prewarm(sbx *v1alpha1.Sandbox, tpl *v1alpha1.SandboxTemplate, pod *corev1.Pod) time.Duration {
	envs := v1alpha1.PrewarmEnvs(sbx)
	if !isWarm(sbx) || len(envs) == 0 || tpl == nil {
		meta.RemoveStatusCondition(&sbx.Status.Conditions, v1alpha1.ConditionPythonEnvironmentsReady)
		return 0
	}
	if v1alpha1.PoolLeased(sbx) || sbx.Annotations[v1alpha1.AnnotationAdoptedBy] != "" || !sandboxReady(sbx) {
		return 0
	}
	prev := meta.FindStatusCondition(sbx.Status.Conditions, v1alpha1.ConditionPythonEnvironmentsReady)
	set := func(status metav1.ConditionStatus, reason, msg string) {
		setCondition(&sbx.Status.Conditions, v1alpha1.ConditionPythonEnvironmentsReady, sbx.Generation, r.now(), status, reason, msg)
		if prev != nil && prev.Reason == reason {
			return
		}
		switch reason {
		case v1alpha1.ReasonPrewarmFailed:
			r.event(sbx, nil, corev1.EventTypeWarning, EventPrewarmFailed, "Prewarm", msg)
		case v1alpha1.ReasonPrewarmed:
			r.event(sbx, nil, corev1.EventTypeNormal, EventPrewarmed, "Prewarm", msg)
		default:
			r.event(sbx, nil, corev1.EventTypeNormal, EventPrewarmingEnvironments, "Prewarm", msg)
		}
	}
	hash := prewarmHash(sbx.Annotations[v1alpha1.AnnotationPrewarmEnvs])
	if failed, ok := strings.CutPrefix(sbx.Annotations[v1alpha1.AnnotationPrewarmFailed], hash+": "); ok {
		set(metav1.ConditionFalse, v1alpha1.ReasonPrewarmFailed, "building the warm pool's python environments failed; the sandbox is leased without them: "+failed)
		return 0
	}
	var missing []v1alpha1.WarmPythonEnvironment
	var missingNames []string
	for _, e := range envs {
		name, err := prewarmName(e, tpl)
		if err != nil {
			set(metav1.ConditionFalse, v1alpha1.ReasonPrewarmFailed, fmt.Sprintf("the warm pool's python environment %v is invalid: %v", e.Requirements, err))
			return 0
		}
		if v1alpha1.PythonEnvState(sbx, name) != v1alpha1.PythonEnvBuilt {
			missing = append(missing, e)
			missingNames = append(missingNames, name)
		}
	}
	if len(missing) == 0 {
		set(metav1.ConditionTrue, v1alpha1.ReasonPrewarmed, fmt.Sprintf("the warm pool's %d python environments are built", len(envs)))
		return 0
	}
	set(metav1.ConditionFalse, v1alpha1.ReasonPrewarming, fmt.Sprintf("building the warm pool's python environments %s", strings.Join(missingNames, ", ")))
	if r.prewarming.start(sbx.UID, hash) {
		key, podCopy := client.ObjectKeyFromObject(sbx), pod.DeepCopy()
		sb := sbx.DeepCopy()
		go func() {
			defer r.prewarming.done(sb.UID)
			r.buildPrewarm(key, sb, podCopy, hash, missing)
		}()
	}
	return prewarmRecheck
}

// buildPrewarm builds envs in the sandbox and records the outcome in its
// metadata: each environment built in its inventory, the first failure in
// AnnotationPrewarmFailed.
func (r *SandboxReconciler) buildPrewarm(key client.ObjectKey, sbx *v1alpha1.Sandbox, pod *corev1.Pod, hash string, envs []v1alpha1.WarmPythonEnvironment) {
	log := logf.Log.WithName("prewarm").WithValues("sandbox", key.String())
	sup, err := r.supervisor(sbx, pod)
	if err != nil {
		// Not a failure of the build: the next pass tries again.
		log.Error(err, "reach the supervisor to build the warm pool's python environments")
		return
	}
	for _, e := range envs {
		ctx, cancel := context.WithTimeout(context.Background(), prewarmBuildTimeout)
		res, err := sup.EnsureEnv(ctx, supervisorapi.EnvRequest{Name: e.Name, Requirements: e.Requirements})
		cancel()
		set := map[string]any{}
		if err != nil {
			log.Info("building a warm pool python environment failed", "requirements", e.Requirements, "error", err.Error())
			// Named, so that the pool's condition (and an apply waiting
			// for the pool) says which environment is broken.
			set[v1alpha1.AnnotationPrewarmFailed] = hash + ": " + truncateMessage(fmt.Sprintf("environment %s: %v", prewarmLabel(e), err))
		} else if k := v1alpha1.PythonEnvAnnotation(res.Name); k != "" {
			set[k] = v1alpha1.PythonEnvBuilt
		}
		if perr := r.patchAnnotations(key, set); perr != nil {
			log.Error(perr, "record a warm pool python environment")
			return
		}
		if err != nil {
			return
		}
	}
}

// patchAnnotations merge-patches the annotations in set onto the sandbox.
func (r *SandboxReconciler) patchAnnotations(key client.ObjectKey, set map[string]any) error {
	if len(set) == 0 {
		return nil
	}
	body, err := json.Marshal(map[string]any{"metadata": map[string]any{"annotations": set}})
	if err != nil {
		return fmt.Errorf("encode annotations: %w", err)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	target := &v1alpha1.Sandbox{}
	target.Namespace, target.Name = key.Namespace, key.Name
	if err := r.Patch(ctx, target, client.RawPatch(types.MergePatchType, body)); err != nil && !apierrors.IsNotFound(err) {
		return fmt.Errorf("annotate sandbox %s: %w", key, err)
	}
	return nil
}
