{{/*
Object names are fixed, not derived from the release name: the control
plane's SPIFFE ID names its ServiceAccount, the provider and the docs name
the Service and the Secrets, and the Compute API's certificate names the
Service. So there is one release per namespace.
*/}}

{{- define "agentbox.name" -}}
agentbox
{{- end }}

{{- define "agentbox.chart" -}}
{{- printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/*
Cluster-scoped objects carry the namespace in their name, so that
installations in two namespaces of one cluster do not fight over them.
*/}}
{{- define "agentbox.clusterRoleName" -}}
{{- printf "agentbox-controlplane-%s" .Release.Namespace }}
{{- end }}

{{/*
agentbox.reservedLabels are the label keys the chart sets itself, on objects
(agentbox.labels plus app.kubernetes.io/component) or in selectors. A user's
label with one of these keys would be a duplicate YAML key, which a YAML
parser either refuses or resolves by silently dropping one of the two, and
in a selector it would stop the Deployment from finding its pods. Keep the
list in step with values.schema.json (global.commonLabels).
*/}}
{{- define "agentbox.reservedLabels" -}}
{{- list "helm.sh/chart" "app.kubernetes.io/name" "app.kubernetes.io/instance" "app.kubernetes.io/version" "app.kubernetes.io/managed-by" "app.kubernetes.io/part-of" "app.kubernetes.io/component" | toJson }}
{{- end }}

{{/*
agentbox.commonLabels renders global.commonLabels, and fails on a key the
chart sets itself. values.schema.json refuses those keys too; this check is
for renders that skip schema validation.
*/}}
{{- define "agentbox.commonLabels" -}}
{{- $reserved := include "agentbox.reservedLabels" . | fromJsonArray }}
{{- range $key, $_ := .Values.global.commonLabels }}
{{- if has $key $reserved }}
{{- fail (printf "global.commonLabels may not set %q: the chart sets it itself. Reserved keys: %s" $key (join ", " $reserved)) }}
{{- end }}
{{- end }}
{{- with .Values.global.commonLabels }}
{{- toYaml . }}
{{- end }}
{{- end }}

{{- define "agentbox.labels" -}}
helm.sh/chart: {{ include "agentbox.chart" . }}
app.kubernetes.io/name: {{ include "agentbox.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
app.kubernetes.io/part-of: agentbox
{{- with include "agentbox.commonLabels" . }}
{{ . }}
{{- end }}
{{- end }}

{{/*
Selector labels must never change across upgrades: a Deployment's selector
is immutable. So global.commonLabels, which users change, never go into a
selector, only onto the pods.
*/}}
{{- define "agentbox.selectorLabels" -}}
app.kubernetes.io/name: {{ include "agentbox.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/component: controlplane
{{- end }}

{{- define "agentbox.runscInstallerSelectorLabels" -}}
app.kubernetes.io/name: {{ include "agentbox.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/component: runsc-installer
{{- end }}

{{/*
agentbox.podLabels are the labels of a workload's pod template: its
selector labels, then global.commonLabels, then the workload's own extra pod
labels, which win over a common label of the same key. Extra labels may not
set a selector key: the selector would no longer match the pods (or, as a
duplicate key, the chart would not render). Built as one map, so that no key
appears twice.
Usage: include "agentbox.podLabels" (dict "selector" (include "agentbox.selectorLabels" .) "extra" .Values.podLabels "extraName" "podLabels" "root" .)
*/}}
{{- define "agentbox.podLabels" -}}
{{- $selector := .selector | fromYaml }}
{{- $common := include "agentbox.commonLabels" .root | fromYaml }}
{{- range $key, $_ := .extra }}
{{- if hasKey $selector $key }}
{{- fail (printf "%s may not set %q: the chart's selector uses it to find the pods" $.extraName $key) }}
{{- end }}
{{- end }}
{{- toYaml (merge (dict) $selector (.extra | default dict) $common) }}
{{- end }}

{{/*
agentbox.image renders "<imageRegistry>/<repository>:<tag>".
Usage: include "agentbox.image" (dict "image" .Values.image.controlPlane "root" $)
*/}}
{{- define "agentbox.image" -}}
{{- $registry := .root.Values.imageRegistry | trimSuffix "/" -}}
{{- $tag := .image.tag | default .root.Chart.AppVersion -}}
{{- if $registry }}{{ $registry }}/{{ end }}{{ .image.repository }}:{{ $tag }}
{{- end }}

{{/*
agentbox.clusterReachable is "true" when lookup reaches a cluster, else
empty. lookup answers an empty map both for an object that does not exist
and when there is no cluster at all (helm template, --dry-run=client, helm
lint), so a missing agentbox-ca alone cannot tell a first install from an
offline render. kube-system can: every cluster has it (the API server creates
it and refuses to delete it). The release namespace cannot: on a first
install with --create-namespace (as the Terraform provider installs) Helm
renders before it creates the namespace. The lookup needs the right to get
namespaces, which whoever installs the chart's cluster-scoped objects (CRDs,
a ClusterRole) normally has; a refused lookup fails the render with the API
server's message rather than passing for an offline render.
*/}}
{{- define "agentbox.clusterReachable" -}}
{{- if lookup "v1" "Namespace" "" "kube-system" }}true{{ end }}
{{- end }}

{{- define "agentbox.caSecretName" -}}
{{- .Values.ca.existingSecret | default "agentbox-ca" }}
{{- end }}

{{- define "agentbox.adminTokenSecretName" -}}
{{- .Values.adminToken.existingSecret | default "agentbox-admin-token" }}
{{- end }}

{{/* agentbox.postgres is "true" when the store is PostgreSQL, else empty. */}}
{{- define "agentbox.postgres" -}}
{{- if or .Values.store.dsn .Values.store.existingSecret }}true{{ end }}
{{- end }}

{{- define "agentbox.storeSecretName" -}}
{{- .Values.store.existingSecret | default "agentbox-store" }}
{{- end }}

{{- define "agentbox.leaderElect" -}}
{{- if or .Values.leaderElection.enabled (gt (int .Values.replicaCount) 1) }}true{{ else }}false{{ end }}
{{- end }}

{{/*
agentbox.validate fails the render for combinations the schema cannot
express with a message a person can act on.
*/}}
{{- define "agentbox.validate" -}}
{{- if and (gt (int .Values.replicaCount) 1) (not (include "agentbox.postgres" .)) }}
{{- fail "replicaCount > 1 needs a PostgreSQL store (store.dsn or store.existingSecret): the SQLite store is a single-writer file on a ReadWriteOnce volume" }}
{{- end }}
{{- include "agentbox.validateSnapshot" . }}
{{- end }}

{{/*
The runsc installer's namespace: its own, because its install container
breaks the restricted Pod Security Standard that the release namespace
enforces.
*/}}
{{- define "agentbox.runscInstallerNamespace" -}}
{{- .Values.runscInstaller.namespace | default (printf "%s-runsc-installer" .Release.Namespace | trunc 63 | trimSuffix "-") }}
{{- end }}

{{/*
agentbox.claimSize is the storage request of a claim the chart makes: size,
unless the claim exists already on a StorageClass that cannot expand it.
Kubernetes grows a claim only where its StorageClass allows volume expansion,
so another size there would fail the upgrade (as a larger default would, on
every platform installed before it); such a claim keeps the size it has. An
offline render sees no claim and renders size.
Usage: include "agentbox.claimSize" (dict "name" "agentbox-store" "size" .Values.store.persistence.size "root" $)
*/}}
{{- define "agentbox.claimSize" -}}
{{- $size := .size -}}
{{- $claim := lookup "v1" "PersistentVolumeClaim" .root.Release.Namespace .name -}}
{{- if and $claim $claim.spec -}}
{{- $class := dict -}}
{{- with $claim.spec.storageClassName }}{{ $class = lookup "storage.k8s.io/v1" "StorageClass" "" . }}{{ end -}}
{{- if not (and $class $class.allowVolumeExpansion) -}}
{{- $size = $claim.spec.resources.requests.storage -}}
{{- end -}}
{{- end -}}
{{- $size -}}
{{- end }}

{{/*
agentbox.affinity is the control plane pods' affinity: the user's, plus a
pod anti-affinity on the node (podAntiAffinityPreset) when there is more
than one replica and the user's affinity has none, so that one node's loss
does not take every replica with it. Empty when there is nothing to set.
*/}}
{{- define "agentbox.affinity" -}}
{{- $affinity := deepCopy (.Values.affinity | default dict) }}
{{- $preset := .Values.podAntiAffinityPreset }}
{{- if and (gt (int .Values.replicaCount) 1) (ne $preset "none") (not $affinity.podAntiAffinity) }}
{{- $term := dict "topologyKey" "kubernetes.io/hostname" "labelSelector" (dict "matchLabels" (include "agentbox.selectorLabels" . | fromYaml)) }}
{{- if eq $preset "hard" }}
{{- $_ := set $affinity "podAntiAffinity" (dict "requiredDuringSchedulingIgnoredDuringExecution" (list $term)) }}
{{- else }}
{{- $_ := set $affinity "podAntiAffinity" (dict "preferredDuringSchedulingIgnoredDuringExecution" (list (dict "weight" 100 "podAffinityTerm" $term))) }}
{{- end }}
{{- end }}
{{- with $affinity }}
{{- toYaml . }}
{{- end }}
{{- end }}

{{/*
agentbox.servedNamespaces is the namespaces the platform runs sandboxes,
warm pools and egress proxies in, comma-separated, sorted and without
duplicates: the release namespace, always, and sandboxNamespaces. The control
plane's namespaced rights (the Role agentbox.sandboxRoleName in each) and its
cache (AGENTBOX_SANDBOX_NAMESPACES) reach only these.
*/}}
{{- define "agentbox.servedNamespaces" -}}
{{- append (.Values.sandboxNamespaces | default list) .Release.Namespace | uniq | sortAlpha | join "," }}
{{- end }}

{{/*
agentbox.sandboxRoleName names the Role, in each served namespace, that holds
the control plane's rights over sandboxes' children there. The release
namespace is in the name so that two platforms serving one namespace do not
share (and overwrite) one Role.
*/}}
{{- define "agentbox.sandboxRoleName" -}}
{{- printf "agentbox-controlplane-%s" .Release.Namespace }}
{{- end }}
