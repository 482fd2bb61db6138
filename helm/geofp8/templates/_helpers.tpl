{{- define "geofp8.labels" -}}
app.kubernetes.io/name: geofp8
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
{{- end -}}

{{- define "geofp8.selector" -}}
app.kubernetes.io/name: geofp8
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end -}}

{{- define "geofp8.image" -}}
{{ .Values.image.repository }}:{{ .Values.image.tag }}
{{- end -}}

{{- define "geofp8.coordinator" -}}
{{ .Release.Name }}-coordinator
{{- end -}}
