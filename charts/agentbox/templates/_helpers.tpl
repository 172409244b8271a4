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

{{- define "agentbox.labels" -}}
helm.sh/chart: {{ include "agentbox.chart" . }}
app.kubernetes.io/name: {{ include "agentbox.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
app.kubernetes.io/part-of: agentbox
{{- with .Values.global.commonLabels }}
{{ toYaml . }}
{{- end }}
{{- end }}

{{/*
Selector labels must never change across upgrades: a Deployment's selector
is immutable.
*/}}
{{- define "agentbox.selectorLabels" -}}
app.kubernetes.io/name: {{ include "agentbox.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/component: controlplane
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
{{- if eq .Values.snapshot.driver "archive" }}
{{- if not .Values.snapshot.archive.endpoint }}
{{- fail "snapshot.driver \"archive\" needs snapshot.archive.endpoint (the S3-compatible endpoint URL)" }}
{{- end }}
{{- if not .Values.snapshot.archive.bucket }}
{{- fail "snapshot.driver \"archive\" needs snapshot.archive.bucket" }}
{{- end }}
{{- if not .Values.snapshot.archive.credentialsSecret }}
{{- fail "snapshot.driver \"archive\" needs snapshot.archive.credentialsSecret (a Secret with AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY)" }}
{{- end }}
{{- end }}
{{- end }}

{{/*
The runsc installer's namespace: its own, because its install container
breaks the restricted Pod Security Standard that the release namespace
enforces.
*/}}
{{- define "agentbox.runscInstallerNamespace" -}}
{{- .Values.runscInstaller.namespace | default (printf "%s-runsc-installer" .Release.Namespace | trunc 63 | trimSuffix "-") }}
{{- end }}
