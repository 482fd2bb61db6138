{{/* Only the template subset tests/deploy/helm_render.py implements may be used in this chart. */}}
{{- define "geofp8.labels" -}}
app.kubernetes.io/name: geofp8
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
{{- end -}}

{{- define "geofp8.selector" -}}
app.kubernetes.io/name: geofp8
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end -}}

{{/* Each component's image: its own image.repository / image.tag where set, else the global
repository with the component's suffix (geofp8-coordinator, geofp8-worker, and for
worker.device cuda geofp8-worker-cuda: the images deploy/docker/Dockerfile builds) and the
global tag. */}}
{{- define "geofp8.coordinatorImage" -}}
{{- if .Values.coordinator.image.repository -}}
{{ .Values.coordinator.image.repository }}
{{- else -}}
{{ .Values.image.repository }}-coordinator
{{- end -}}
:{{ .Values.coordinator.image.tag | default .Values.image.tag }}
{{- end -}}

{{- define "geofp8.workerImage" -}}
{{- if .Values.worker.image.repository -}}
{{ .Values.worker.image.repository }}
{{- else if eq .Values.worker.device "cuda" -}}
{{ .Values.image.repository }}-worker-cuda
{{- else -}}
{{ .Values.image.repository }}-worker
{{- end -}}
:{{ .Values.worker.image.tag | default .Values.image.tag }}
{{- end -}}

{{/* The CPU worker image's repository (its geofp8 is the CPU build: has_cuda False). */}}
{{- define "geofp8.cpuWorkerRepository" -}}
{{ .Values.image.repository }}-worker
{{- end -}}

{{/* Fails the install on GPU workers given the CPU image, whose geofp8 cannot use the GPU
(values.schema.json refuses the default repository's name too). */}}
{{- define "geofp8.checkDevice" -}}
{{- if and (eq .Values.worker.device "cuda") (eq .Values.worker.image.repository (include "geofp8.cpuWorkerRepository" .)) -}}
{{- fail "worker.device=cuda needs the GPU worker image, but worker.image.repository is the CPU one (image.repository + \"-worker\", whose geofp8 has has_cuda False): leave worker.image.repository empty for image.repository + \"-worker-cuda\" (scripts/image.sh --only worker-cuda builds it), or name a GPU image" -}}
{{- end -}}
{{- end -}}

{{- define "geofp8.coordinator" -}}
{{ .Release.Name }}-coordinator
{{- end -}}

{{- define "geofp8.serviceAccountName" -}}
{{ .Values.serviceAccount.name | default (include "geofp8.default-sa" .) }}
{{- end -}}

{{- define "geofp8.default-sa" -}}
{{ .Release.Name }}-geofp8
{{- end -}}

{{/* Fails the install on TLS settings the daemons cannot run with. */}}
{{- define "geofp8.checkTls" -}}
{{- if and .Values.tls.serverSecret (not .Values.tls.caSecret) -}}
{{- fail "tls.caSecret is required when tls.serverSecret is set: workers need the CA (--tls-ca) to connect over TLS" -}}
{{- end -}}
{{- if and .Values.tls.caSecret (not .Values.tls.serverSecret) -}}
{{- fail "tls.caSecret is set but tls.serverSecret is empty: the coordinator would serve plaintext that TLS workers cannot reach" -}}
{{- end -}}
{{- if and .Values.tls.mutual (not .Values.tls.serverSecret) -}}
{{- fail "tls.mutual needs tls.serverSecret and tls.caSecret" -}}
{{- end -}}
{{- if and .Values.tls.mutual (not .Values.tls.workerSecret) -}}
{{- fail "tls.workerSecret (the workers' client certificate) is required when tls.mutual is true" -}}
{{- end -}}
{{- if and .Values.tls.workerSecret (not .Values.tls.mutual) -}}
{{- fail "tls.workerSecret is set but tls.mutual is false: set tls.mutual=true to use client certificates" -}}
{{- end -}}
{{- end -}}

{{/* Pod spec fields both daemons share: account, pull secrets, security context. */}}
{{- define "geofp8.podCommon" -}}
serviceAccountName: {{ include "geofp8.serviceAccountName" . }}
automountServiceAccountToken: false
{{- with .Values.imagePullSecrets }}
imagePullSecrets:
  {{- toYaml . | nindent 2 }}
{{- end }}
securityContext:
  {{- toYaml .Values.podSecurityContext | nindent 2 }}
{{- end -}}
