{{/*
agentbox.snapshotEmbedded is "true" when the archive driver keeps its
archives in the embedded store (no S3 endpoint), else empty.
*/}}
{{- define "agentbox.snapshotEmbedded" -}}
{{- if and (eq .Values.snapshot.driver "archive") (not .Values.snapshot.archive.endpoint) }}true{{ end }}
{{- end }}

{{- define "agentbox.snapshotClaimName" -}}
{{- .Values.snapshot.archive.embedded.existingClaim | default "agentbox-snapshots" }}
{{- end }}

{{/*
agentbox.validateSnapshot fails the render for snapshot settings that
cannot work, with a message that names the fix.
*/}}
{{- define "agentbox.validateSnapshot" -}}
{{- if and (include "agentbox.snapshotEmbedded" .) (gt (int .Values.replicaCount) 1) }}
{{- fail "replicaCount > 1 cannot use the embedded snapshot store (snapshot.driver \"archive\" without snapshot.archive.endpoint): it is a ReadWriteOnce volume that only one control plane pod can mount. Configure an S3-compatible store (snapshot.archive.endpoint, bucket and credentialsSecret) or snapshot.driver \"volumesnapshot\", or run one replica" }}
{{- end }}
{{- if and (eq .Values.snapshot.driver "archive") .Values.snapshot.archive.endpoint }}
{{- if not .Values.snapshot.archive.bucket }}
{{- fail "snapshot.archive.endpoint needs snapshot.archive.bucket" }}
{{- end }}
{{- if not .Values.snapshot.archive.credentialsSecret }}
{{- fail "snapshot.archive.endpoint needs snapshot.archive.credentialsSecret (a Secret with AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY)" }}
{{- end }}
{{- end }}
{{- end }}
