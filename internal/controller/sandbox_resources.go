package controller

import (
	"bytes"
	"crypto/tls"
	"crypto/x509"
	"encoding/pem"
	"errors"
	"fmt"
	"maps"
	"net/url"
	"strconv"
	"time"

	coordinationv1 "k8s.io/api/coordination/v1"
	corev1 "k8s.io/api/core/v1"
	"k8s.io/apimachinery/pkg/api/resource"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/util/intstr"
	"k8s.io/utils/ptr"

	"github.com/agentbox/terraform-provider-agentbox/internal/api/v1alpha1"
	"github.com/agentbox/terraform-provider-agentbox/internal/pki"
)

// Names of a sandbox's children. They are derived from the sandbox's
// workload name alone (its own name, or that of the warm sandbox whose pod
// it adopted), so every component (controller, Compute API, tests) finds
// them without a lookup beyond the Sandbox itself.

// workloadName is the name the sandbox's pod, workspace claim, serving
// certificate and supervisor identity derive from; every child name in
// this package goes through it. The activity clock is the exception: it is
// the Sandbox's own, named after it, because the Compute API renews it by
// the Sandbox's name.
func workloadName(sbx *v1alpha1.Sandbox) string { return sbx.WorkloadName() }

// PodName is the name of a sandbox's pod.
func PodName(sandbox string) string { return sandbox }

// ActivityClockName is the name of a sandbox's activity clock, the Lease
// whose renewTime records its last activity; the Compute API renews it, so
// the rule lives with the API types (as v1alpha1.LeaseName).
func ActivityClockName(sandbox string) string { return v1alpha1.LeaseName(sandbox) }

// TLSSecretName is the name of the Secret holding a sandbox's serving
// certificate.
func TLSSecretName(sandbox string) string { return sandbox + "-tls" }

// WorkspaceClaimName is the name of a sandbox's workspace
// PersistentVolumeClaim.
func WorkspaceClaimName(sandbox string) string { return sandbox + "-workspace" }

const (
	// ContainerName is the sandbox pod's container, which runs the
	// supervisor in the template's image.
	ContainerName = "sandbox"
	// InstallContainerName is the sandbox pod's init container, which
	// installs the supervisor for the sandbox container to run.
	InstallContainerName = "install-supervisor"
	// DefaultSupervisorImage is the supervisor image when the reconciler
	// is given none.
	DefaultSupervisorImage = "agentbox/agentbox-supervisor:dev"
	// SupervisorPortName names the supervisor's container port.
	SupervisorPortName = "supervisor"
	// TLSMountPath is where the serving certificate Secret is mounted; the
	// supervisor's default -tls-dir.
	TLSMountPath = "/etc/agentbox/tls"

	// sandboxUID is the sandbox image's user. It is set on the pod rather
	// than trusted from the image so that runAsNonRoot holds for any image.
	sandboxUID int64 = 65532

	volumeWorkspace  = "workspace"
	volumeTmp        = "tmp"
	volumeTLS        = "tls"
	volumeSupervisor = "supervisor"
	volumeSealKey    = "env-seal-key"

	// sealKeyKey is the key of the TLS Secret that holds the sandbox's
	// environment seal key (see pyenv.Seal). Only the init container
	// mounts it; it hands it to the supervisor through a file in /tmp,
	// which the supervisor removes before anything else runs.
	sealKeyKey = "env-seal.key"
	// sealKeyMount is where the init container mounts the seal key.
	sealKeyMount = "/agentbox/seal"
	// sealKeyFile is the file in /tmp through which the supervisor gets
	// the seal key.
	sealKeyFile = "/tmp/.agentbox-env-seal.key"

	defaultWorkspaceMountPath = "/workspace"

	// supervisorHealthListen is the supervisor's plain-HTTP health
	// listener, on the sandbox's loopback only: the liveness probe, which
	// runs inside the pod, is all that calls it, and nothing outside the
	// pod can.
	supervisorHealthListen = "127.0.0.1:8444"
)

// Any Linux image can be a sandbox: the image need not hold the
// supervisor. The pod's init container runs the supervisor image's binary
// (supervisorImageBinary) with -install, which copies it into an emptyDir
// at supervisorDir, and the sandbox container runs the copy
// (supervisorBinary) as its command. The sandbox container mounts the
// directory read-only: the code the supervisor runs, as the same user,
// cannot replace the binary the liveness probe runs.
const (
	supervisorImageBinary = "/usr/local/bin/agentbox-supervisor"
	supervisorDir         = "/agentbox/bin"
	supervisorBinary      = supervisorDir + "/agentbox-supervisor"
)

// supervisorVolumeSize bounds the supervisor's emptyDir: the static binary
// is about 16 MiB.
var supervisorVolumeSize = resource.MustParse("64Mi")

// livenessProbe restarts a sandbox whose supervisor no longer serves: it
// runs the supervisor's own binary in probe mode inside the pod, which
// calls GET /livez on the loopback health listener. (Not /proc/1/exe:
// gVisor refuses to execute it.) That request goes through the supervisor's request
// handling, so a stopped or deadlocked supervisor fails it, where the
// readiness probe's TCP connect would still succeed. An exec probe, rather
// than an HTTP one: kubelet's HTTP probes come from the node to the pod's
// IP, which the sandbox's NetworkPolicy closes to all but the control plane
// (whether the node gets through depends on the network plugin), and a
// listener there that needs no certificate would be one more way into the
// sandbox. Under gVisor each run starts a process in the sandbox, so it
// runs every 20 s, and a sandbox is restarted only after three failures in
// a row (a minute) with 10 s for each: a busy sandbox on a loaded node is
// slow, not wedged.
var livenessProbe = corev1.Probe{
	ProbeHandler: corev1.ProbeHandler{
		Exec: &corev1.ExecAction{Command: []string{supervisorBinary, "-probe", "-probe-timeout", "8s"}},
	},
	PeriodSeconds:    20,
	TimeoutSeconds:   10,
	FailureThreshold: 3,
}

// supervisorGODEBUG is the Go runtime setting the supervisor runs with
// (the supervisor never passes GODEBUG on to what it starts). The
// supervisor links no memory profiler, so the runtime turns memory
// profiling off at start, but still records the one allocation it samples
// while doing so, and that sample allocates the profiler's 1.4 MiB hash
// table. Under gVisor the table, touched in scattered places, counts whole
// in the pod's RSS. With no profile stacks there is no sample to record
// (runtime.mProf_Malloc returns first) and no table. No profile is ever
// read from the supervisor, so nothing else changes. The runtime reads it
// only at start, so it has to be in the container's environment.
const supervisorGODEBUG = "profstackdepth=0"

// defaultWorkspaceSize applies when a template was stored without the CRD's
// default (clients that bypass the API server's defaulting, such as fakes).
var defaultWorkspaceSize = resource.MustParse("1Gi")

// sandboxLabels are put on every child so that they can be listed by
// sandbox or agent without reading the Sandbox.
func sandboxLabels(sbx *v1alpha1.Sandbox) map[string]string {
	return map[string]string{
		v1alpha1.LabelSandbox:     sbx.Name,
		v1alpha1.LabelAgentIDHash: v1alpha1.AgentIDHash(sbx.Spec.AgentID),
	}
}

func workspaceMountPath(tpl *v1alpha1.SandboxTemplate) string {
	if p := tpl.Spec.Workspace.MountPath; p != "" {
		return p
	}
	return defaultWorkspaceMountPath
}

// platformEnv are the variables the controller gives every sandbox. They
// configure the supervisor (see internal/cmd/agentbox-supervisor) and tell
// code in the sandbox who it is.
//
// AGENTBOX_NAMESPACE is the platform namespace, as the supervisor defines
// it (it derives the control plane's identity from it when
// AGENTBOX_ALLOWED_CLIENT_IDS is unset); the sandbox's own namespace is
// AGENTBOX_SANDBOX_NAMESPACE. The allowed client IDs are also set
// explicitly, so that who may call a sandbox is decided here and not by a
// default in the image.
func (r *SandboxReconciler) platformEnv(sbx *v1alpha1.Sandbox, tpl *v1alpha1.SandboxTemplate) []corev1.EnvVar {
	cp := pki.ControlPlaneID(r.TrustDomain, r.Namespace).String()
	return append([]corev1.EnvVar{
		{Name: "AGENTBOX_SANDBOX", Value: workloadName(sbx)},
		{Name: "AGENTBOX_SANDBOX_NAMESPACE", Value: sbx.Namespace},
		{Name: "AGENTBOX_NAMESPACE", Value: r.Namespace},
		{Name: "AGENTBOX_AGENT_ID", Value: sbx.Spec.AgentID},
		{Name: "AGENTBOX_TRUST_DOMAIN", Value: r.trustDomain()},
		{Name: "AGENTBOX_CONTROLPLANE_ID", Value: cp},
		{Name: "AGENTBOX_ALLOWED_CLIENT_IDS", Value: cp},
		{Name: "AGENTBOX_LISTEN", Value: ":" + strconv.Itoa(v1alpha1.SupervisorPort)},
		{Name: "AGENTBOX_TLS_DIR", Value: TLSMountPath},
		// Where the supervisor answers the liveness probe, and where the
		// probe, which runs in the pod with this environment, calls it.
		{Name: "AGENTBOX_HEALTH_LISTEN", Value: supervisorHealthListen},
		{Name: "AGENTBOX_WORKDIR", Value: workspaceMountPath(tpl)},
		// Read and removed by the supervisor at its start (see
		// installContainer).
		{Name: "AGENTBOX_ENV_SEAL_KEY_FILE", Value: sealKeyFile},
		// Off, and reserved so that a template cannot turn it on: the
		// supervisor's record of each call leaves the sandbox with the
		// call's response and lands in the control plane's audit log,
		// where code in the sandbox cannot rewrite it, as it could a file
		// in the pod.
		{Name: "AGENTBOX_AUDIT_LOG", Value: ""},
		// Under gVisor the pod's memory limit bounds the sandbox as a
		// whole, so the supervisor stops the largest command before the
		// limit takes the sandbox down. Without a limit the kubelet gives
		// the node's allocatable memory, which leaves the guard idle.
		{Name: "AGENTBOX_MEMORY_LIMIT", ValueFrom: &corev1.EnvVarSource{ResourceFieldRef: &corev1.ResourceFieldSelector{
			ContainerName: ContainerName, Resource: "limits.memory"}}},
		{Name: "GODEBUG", Value: supervisorGODEBUG},
	}, supervisorEnv(tpl)...)
}

// podEnv is the template's environment with the platform's variables
// appended; the template's entries of the same name are dropped, so a
// template cannot redirect the supervisor (the SandboxTemplate API promises
// that the platform's variables win).
//
// HOME is the workspace unless the template sets it: the sandbox user
// (sandboxUID) has no entry in a foreign image's /etc/passwd, and an
// image's own HOME (/root, say) is not writable on the read-only root
// file system, where tools that keep caches and settings in HOME would
// fail. It is the container's, so the supervisor passes it on with the
// rest of its environment.
func (r *SandboxReconciler) podEnv(sbx *v1alpha1.Sandbox, tpl *v1alpha1.SandboxTemplate) []corev1.EnvVar {
	platform := r.platformEnv(sbx, tpl)
	reserved := make(map[string]bool, len(platform))
	for _, e := range platform {
		reserved[e.Name] = true
	}
	env := make([]corev1.EnvVar, 0, len(tpl.Spec.Env)+len(platform)+1)
	home := false
	for _, e := range tpl.Spec.Env {
		if !reserved[e.Name] {
			env = append(env, *e.DeepCopy())
			home = home || e.Name == "HOME"
		}
	}
	if !home {
		env = append(env, corev1.EnvVar{Name: "HOME", Value: workspaceMountPath(tpl)})
	}
	return append(env, platform...)
}

// desiredPod is the sandbox's pod as the template describes it now. Pod
// specs are immutable, so it is used only when the pod is created: a
// template change reaches a sandbox the next time its pod is created (after
// an out-of-band deletion today, on resume once idle stop exists), never by
// restarting a running pod.
func (r *SandboxReconciler) desiredPod(sbx *v1alpha1.Sandbox, tpl *v1alpha1.SandboxTemplate) *corev1.Pod {
	runtimeClass := tpl.Spec.RuntimeClassName
	if runtimeClass == "" {
		runtimeClass = v1alpha1.DefaultRuntimeClassName
	}
	volumes, mounts := podVolumes(sbx, tpl)
	pod := &corev1.Pod{
		ObjectMeta: metav1.ObjectMeta{
			Name:      PodName(workloadName(sbx)),
			Namespace: sbx.Namespace,
			Labels:    podLabels(sbx),
		},
		Spec: corev1.PodSpec{
			RuntimeClassName: ptr.To(runtimeClass),
			// The sandbox runs untrusted code: it gets no API credentials and
			// no environment variables describing the cluster's Services.
			AutomountServiceAccountToken: ptr.To(false),
			EnableServiceLinks:           ptr.To(false),
			SecurityContext: &corev1.PodSecurityContext{
				RunAsNonRoot: ptr.To(true),
				RunAsUser:    ptr.To(sandboxUID),
				RunAsGroup:   ptr.To(sandboxUID),
				// Also with runAsImageUser: the image's user then gets the
				// group as a supplementary one, and with it the workspace,
				// the certificate and the installed supervisor.
				FSGroup: ptr.To(sandboxUID),
				// A restored workspace is already owned by fsGroup; walking it
				// on every start would slow resumes of large workspaces.
				FSGroupChangePolicy: ptr.To(corev1.FSGroupChangeOnRootMismatch),
				SeccompProfile:      &corev1.SeccompProfile{Type: corev1.SeccompProfileTypeRuntimeDefault},
			},
			NodeSelector:   maps.Clone(tpl.Spec.NodeSelector),
			Tolerations:    copyTolerations(tpl.Spec.Tolerations),
			Volumes:        volumes,
			InitContainers: []corev1.Container{r.installContainer(sbx, tpl)},
			Containers:     []corev1.Container{r.sandboxContainer(sbx, tpl, mounts)},
		},
	}
	if reset := sbx.Annotations[v1alpha1.AnnotationPoolReset]; reset != "" {
		// Which lease's reset this pod's init container ran.
		pod.Annotations = map[string]string{v1alpha1.AnnotationPoolReset: reset}
	}
	if tpl.Spec.RunAsImageUser {
		// The pod's user would apply to the sandbox container, which sets
		// none of its own; the init container sets its own.
		pod.Spec.SecurityContext.RunAsUser, pod.Spec.SecurityContext.RunAsGroup = nil, nil
	}
	return pod
}

// podLabels are the labels of the sandbox's pod.
func podLabels(sbx *v1alpha1.Sandbox) map[string]string {
	labels := sandboxLabels(sbx)
	labels[v1alpha1.LabelTemplate] = sbx.Spec.TemplateRef.Name
	// The pool's scale selector counts the pods of its unassigned
	// sandboxes; adoption takes the label off again.
	if pool := sbx.Labels[v1alpha1.LabelWarmPool]; pool != "" {
		labels[v1alpha1.LabelWarmPool] = pool
	}
	return labels
}

// podVolumes are the pod's volumes and the sandbox container's mounts of
// them: the workspace, a writable /tmp, the serving certificate, the
// installed supervisor and the template's secret files.
func podVolumes(sbx *v1alpha1.Sandbox, tpl *v1alpha1.SandboxTemplate) ([]corev1.Volume, []corev1.VolumeMount) {
	volumes := []corev1.Volume{
		{Name: volumeWorkspace, VolumeSource: corev1.VolumeSource{
			PersistentVolumeClaim: &corev1.PersistentVolumeClaimVolumeSource{ClaimName: WorkspaceClaimName(workloadName(sbx))},
		}},
		// The root filesystem is read-only; tools expect a writable /tmp.
		{Name: volumeTmp, VolumeSource: corev1.VolumeSource{EmptyDir: &corev1.EmptyDirVolumeSource{}}},
		{Name: volumeTLS, VolumeSource: corev1.VolumeSource{Secret: &corev1.SecretVolumeSource{
			SecretName: TLSSecretName(workloadName(sbx)),
			// Group-readable only: the files belong to root with group
			// fsGroup (65532), the supervisor's group.
			DefaultMode: ptr.To[int32](0o440),
			// Not the seal key: the sandbox's commands can read what the
			// supervisor can.
			Items: []corev1.KeyToPath{
				{Key: corev1.TLSCertKey, Path: corev1.TLSCertKey},
				{Key: corev1.TLSPrivateKeyKey, Path: corev1.TLSPrivateKeyKey},
				{Key: caCertKey, Path: caCertKey},
			},
		}}},
		{Name: volumeSealKey, VolumeSource: corev1.VolumeSource{Secret: &corev1.SecretVolumeSource{
			SecretName:  TLSSecretName(workloadName(sbx)),
			DefaultMode: ptr.To[int32](0o440),
			Items:       []corev1.KeyToPath{{Key: sealKeyKey, Path: sealKeyKey}},
			// A Secret from before the key existed gets it on the next
			// reconcile; the pod starts without it meanwhile (nothing
			// sealed, so nothing kept on reuse).
			Optional: ptr.To(true),
		}}},
		{Name: volumeSupervisor, VolumeSource: corev1.VolumeSource{EmptyDir: &corev1.EmptyDirVolumeSource{SizeLimit: &supervisorVolumeSize}}},
	}
	mounts := []corev1.VolumeMount{
		{Name: volumeWorkspace, MountPath: workspaceMountPath(tpl)},
		{Name: volumeTmp, MountPath: "/tmp"},
		{Name: volumeTLS, MountPath: TLSMountPath, ReadOnly: true},
		{Name: volumeSupervisor, MountPath: supervisorDir, ReadOnly: true},
	}
	for i, sf := range tpl.Spec.SecretFiles {
		name := "secret-files-" + strconv.Itoa(i)
		volumes = append(volumes, corev1.Volume{Name: name, VolumeSource: corev1.VolumeSource{Secret: &corev1.SecretVolumeSource{
			SecretName:  sf.SecretName,
			DefaultMode: ptr.To[int32](0o440),
		}}})
		mounts = append(mounts, corev1.VolumeMount{Name: name, MountPath: sf.MountPath, ReadOnly: true})
	}
	return volumes, mounts
}

// installContainer is the pod's init container: from the supervisor
// image, it installs the supervisor into the volume the sandbox container
// runs it from. It runs as confined as the sandbox container, and asks
// for the same resources: a namespace's LimitRange and ResourceQuota then
// admit it whenever they admit the sandbox container, the pod's QoS class
// stays the template's, and the pod's effective requests (the larger of
// the init container's and the sandbox container's) do not grow.
//
// It also hands the sandbox's environment seal key to the supervisor
// (through a file in /tmp), and on a reused warm sandbox's new pod
// (v1alpha1.AnnotationPoolReset) resets the workspace before the sandbox
// container, and with it anything a holder could run, starts: if the reset
// fails, the pod never serves, and the controller deletes the sandbox.
func (r *SandboxReconciler) installContainer(sbx *v1alpha1.Sandbox, tpl *v1alpha1.SandboxTemplate) corev1.Container {
	image := r.SupervisorImage
	if image == "" {
		image = DefaultSupervisorImage
	}
	pullPolicy := r.SupervisorImagePullPolicy
	if pullPolicy == "" {
		pullPolicy = corev1.PullIfNotPresent
	}
	res := tpl.Spec.Resources.DeepCopy()
	// Claims name the pod's resource claims; the install needs none.
	res.Claims = nil
	command := []string{supervisorImageBinary, "-install", supervisorDir,
		"-seal-key-from", sealKeyMount + "/" + sealKeyKey, "-seal-key-to", sealKeyFile}
	mounts := []corev1.VolumeMount{
		{Name: volumeSupervisor, MountPath: supervisorDir},
		{Name: volumeSealKey, MountPath: sealKeyMount, ReadOnly: true},
		{Name: volumeTmp, MountPath: "/tmp"},
	}
	if sbx.Annotations[v1alpha1.AnnotationPoolReset] != "" {
		command = append(command, "-reset-workspace", workspaceMountPath(tpl))
		mounts = append(mounts, corev1.VolumeMount{Name: volumeWorkspace, MountPath: workspaceMountPath(tpl)})
	}
	return corev1.Container{
		Name:                     InstallContainerName,
		Image:                    image,
		ImagePullPolicy:          pullPolicy,
		Command:                  command,
		Resources:                *res,
		VolumeMounts:             mounts,
		SecurityContext:          restrictedSecurityContext(),
		TerminationMessagePolicy: corev1.TerminationMessageFallbackToLogsOnError,
	}
}

// restrictedSecurityContext is the sandbox pod's containers' security
// context: the restricted Pod Security Standard, whatever the image says.
func restrictedSecurityContext() *corev1.SecurityContext {
	return &corev1.SecurityContext{
		RunAsNonRoot:             ptr.To(true),
		RunAsUser:                ptr.To(sandboxUID),
		RunAsGroup:               ptr.To(sandboxUID),
		AllowPrivilegeEscalation: ptr.To(false),
		ReadOnlyRootFilesystem:   ptr.To(true),
		Capabilities:             &corev1.Capabilities{Drop: []corev1.Capability{"ALL"}},
		SeccompProfile:           &corev1.SeccompProfile{Type: corev1.SeccompProfileTypeRuntimeDefault},
	}
}

// sandboxContainer is the pod's container: the template's image running
// the installed supervisor. The command replaces the image's entrypoint
// and, with no args, its command too, so neither runs; the image's
// environment and working directory stay.
func (r *SandboxReconciler) sandboxContainer(sbx *v1alpha1.Sandbox, tpl *v1alpha1.SandboxTemplate, mounts []corev1.VolumeMount) corev1.Container {
	image := tpl.Spec.Image
	if image == "" {
		image = r.DefaultImage
	}
	pullPolicy := tpl.Spec.ImagePullPolicy
	if pullPolicy == "" && tpl.Spec.Image == "" {
		pullPolicy = r.DefaultImagePullPolicy
	}
	if pullPolicy == "" {
		pullPolicy = corev1.PullIfNotPresent
	}
	return corev1.Container{
		Name:            ContainerName,
		Image:           image,
		ImagePullPolicy: pullPolicy,
		Command:         []string{supervisorBinary},
		Env:             r.podEnv(sbx, tpl),
		Ports: []corev1.ContainerPort{{
			Name:          SupervisorPortName,
			ContainerPort: v1alpha1.SupervisorPort,
			Protocol:      corev1.ProtocolTCP,
		}},
		// The supervisor requires a client certificate on its only
		// port, and kubelet cannot present one, so an HTTP probe
		// would always fail. A TCP connect is the next best signal:
		// the supervisor opens its listener only after it has loaded
		// and checked its certificate, so an open port means it can
		// serve. (Its plain-HTTP health listener is on loopback,
		// which kubelet's probes cannot reach; the liveness probe
		// runs inside the pod.)
		ReadinessProbe: &corev1.Probe{
			ProbeHandler: corev1.ProbeHandler{
				TCPSocket: &corev1.TCPSocketAction{Port: intstr.FromString(SupervisorPortName)},
			},
			// Cold starts wait on this probe; a connect is cheap.
			PeriodSeconds:    2,
			TimeoutSeconds:   1,
			FailureThreshold: 3,
		},
		LivenessProbe:            livenessProbe.DeepCopy(),
		Resources:                *tpl.Spec.Resources.DeepCopy(),
		VolumeMounts:             mounts,
		SecurityContext:          sandboxSecurityContext(tpl),
		TerminationMessagePolicy: corev1.TerminationMessageFallbackToLogsOnError,
	}
}

// sandboxSecurityContext is the sandbox container's security context: the
// restricted one, and with runAsImageUser, no user or group of its own, so
// that the image's user applies. runAsNonRoot stays: kubelet refuses to
// start an image whose user is root or cannot be checked.
func sandboxSecurityContext(tpl *v1alpha1.SandboxTemplate) *corev1.SecurityContext {
	sc := restrictedSecurityContext()
	if tpl.Spec.RunAsImageUser {
		sc.RunAsUser, sc.RunAsGroup = nil, nil
	}
	return sc
}

// desiredWorkspaceClaim is the sandbox's workspace volume claim.
func desiredWorkspaceClaim(sbx *v1alpha1.Sandbox, tpl *v1alpha1.SandboxTemplate) *corev1.PersistentVolumeClaim {
	size := workspaceSize(tpl)
	return &corev1.PersistentVolumeClaim{
		ObjectMeta: metav1.ObjectMeta{
			Name:      WorkspaceClaimName(workloadName(sbx)),
			Namespace: sbx.Namespace,
			Labels:    sandboxLabels(sbx),
		},
		Spec: corev1.PersistentVolumeClaimSpec{
			AccessModes:      []corev1.PersistentVolumeAccessMode{corev1.ReadWriteOnce},
			StorageClassName: tpl.Spec.Workspace.StorageClassName,
			Resources: corev1.VolumeResourceRequirements{
				Requests: corev1.ResourceList{corev1.ResourceStorage: size},
			},
		},
	}
}

// desiredActivityClock is the sandbox's activity clock as first created:
// renewed now, so that a new sandbox counts as active, and held by nobody.
func desiredActivityClock(sbx *v1alpha1.Sandbox, now time.Time) *coordinationv1.Lease {
	return &coordinationv1.Lease{
		ObjectMeta: metav1.ObjectMeta{
			Name:      ActivityClockName(sbx.Name),
			Namespace: sbx.Namespace,
			Labels:    sandboxLabels(sbx),
		},
		Spec: coordinationv1.LeaseSpec{
			RenewTime: ptr.To(metav1.NewMicroTime(now)),
		},
	}
}

// tlsSecretData issues a serving certificate for id and returns the
// Secret's data.
func tlsSecretData(ca *pki.CA, id *url.URL) (map[string][]byte, error) {
	leaf, err := ca.Issue(pki.LeafOptions{ID: id, Usage: pki.UsageServer})
	if err != nil {
		return nil, fmt.Errorf("issue serving certificate: %w", err)
	}
	return map[string][]byte{
		corev1.TLSCertKey:       leaf.CertPEM,
		corev1.TLSPrivateKeyKey: leaf.KeyPEM,
		caCertKey:               ca.CertPEM,
	}, nil
}

// caCertKey is the Secret key of the CA certificate that signed tls.crt,
// the key cert-manager and the supervisor use.
const caCertKey = "ca.crt"

// certRenewTime says when the serving certificate in data must be
// replaced: once two thirds of its lifetime have passed, the usual point
// for rotation (cert-manager's default). It returns an error, meaning
// "replace now", when the Secret does not hold a usable certificate for id
// from ca: missing or corrupt keys, a key that does not match, a different
// trust domain or name, or a CA that has been replaced.
func certRenewTime(data map[string][]byte, ca *pki.CA, id *url.URL, now time.Time) (time.Time, error) {
	caPEM, _ := pem.Decode(data[caCertKey])
	if caPEM == nil || !bytes.Equal(caPEM.Bytes, ca.Cert.Raw) {
		return time.Time{}, errors.New("ca.crt is not the platform CA")
	}
	pair, err := tls.X509KeyPair(data[corev1.TLSCertKey], data[corev1.TLSPrivateKeyKey])
	if err != nil {
		return time.Time{}, fmt.Errorf("key pair: %w", err)
	}
	leaf := pair.Leaf
	if leaf == nil {
		if leaf, err = x509.ParseCertificate(pair.Certificate[0]); err != nil {
			return time.Time{}, fmt.Errorf("parse tls.crt: %w", err)
		}
	}
	if _, err := leaf.Verify(x509.VerifyOptions{
		Roots:       ca.Pool(),
		CurrentTime: now,
		KeyUsages:   []x509.ExtKeyUsage{x509.ExtKeyUsageServerAuth},
	}); err != nil {
		return time.Time{}, fmt.Errorf("verify tls.crt: %w", err)
	}
	got, err := pki.IDFromCert(leaf)
	if err != nil {
		return time.Time{}, err
	}
	if got.String() != id.String() {
		return time.Time{}, fmt.Errorf("tls.crt is for %s, want %s", got, id)
	}
	lifetime := leaf.NotAfter.Sub(leaf.NotBefore)
	return leaf.NotBefore.Add(lifetime * 2 / 3), nil
}

func copyTolerations(ts []corev1.Toleration) []corev1.Toleration {
	if ts == nil {
		return nil
	}
	out := make([]corev1.Toleration, len(ts))
	for i := range ts {
		ts[i].DeepCopyInto(&out[i])
	}
	return out
}
