{{/*
Naming, labels and the one shared implementation of a k3 service (ConfigMap, Service, Deployment, PDB, HPA).
Each templates/<component>.yaml builds the component's generated config and calls "k3.component".
*/}}

{{- define "k3.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" }}
{{- end }}

{{- define "k3.fullname" -}}
{{- if .Values.fullnameOverride }}
{{- .Values.fullnameOverride | trunc 63 | trimSuffix "-" }}
{{- else }}
{{- $name := default .Chart.Name .Values.nameOverride }}
{{- if contains $name .Release.Name }}
{{- .Release.Name | trunc 63 | trimSuffix "-" }}
{{- else }}
{{- printf "%s-%s" .Release.Name $name | trunc 63 | trimSuffix "-" }}
{{- end }}
{{- end }}
{{- end }}

{{/* Labels on every object. */}}
{{- define "k3.labels" -}}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
{{ include "k3.releaseLabels" . }}
{{- end }}

{{/* The labels that mark a pod as one of this release's k3 pods (NetworkPolicies trust these). */}}
{{- define "k3.releaseLabels" -}}
app.kubernetes.io/name: {{ include "k3.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/part-of: k3
{{- end }}

{{/* Selector labels of one component; args: root, component. */}}
{{- define "k3.selectorLabels" -}}
app.kubernetes.io/name: {{ include "k3.name" .root }}
app.kubernetes.io/instance: {{ .root.Release.Name }}
app.kubernetes.io/component: {{ .component }}
{{- end }}

{{- define "k3.serviceAccountName" -}}
{{- if .Values.serviceAccount.create }}
{{- default (include "k3.fullname" .) .Values.serviceAccount.name }}
{{- else }}
{{- default "default" .Values.serviceAccount.name }}
{{- end }}
{{- end }}

{{- define "k3.authSecretName" -}}
{{- default (printf "%s-auth" (include "k3.fullname" .)) .Values.auth.existingSecret }}
{{- end }}

{{/* image reference; args: root, image (component override, may be empty). */}}
{{- define "k3.image" -}}
{{- $image := merge (deepCopy (default (dict) .image)) .root.Values.image }}
{{- printf "%s:%s" $image.repository (default .root.Chart.AppVersion $image.tag) }}
{{- end }}

{{- define "k3.imagePullPolicy" -}}
{{- $image := merge (deepCopy (default (dict) .image)) .root.Values.image }}
{{- $image.pullPolicy }}
{{- end }}

{{/*
Deep merge as JSON; args: base, over. Maps merge key by key; an empty list in "over" keeps the value in
"base" (values.yaml lists `tolerations: []` per component to document it, which must not wipe
componentDefaults); anything else in "over" replaces it, so replicas: 0 or pdb.enabled: false override a
default (sprig's merge would skip those as empty).
*/}}
{{- define "k3.merge" -}}
{{- $out := deepCopy .base }}
{{- range $key, $value := .over }}
{{- $current := get $out $key }}
{{- if and (kindIs "slice" $value) (empty $value) (hasKey $out $key) }}
{{- else if and (kindIs "map" $value) (kindIs "map" $current) }}
{{- $_ := set $out $key (include "k3.merge" (dict "base" $current "over" $value) | fromJson) }}
{{- else }}
{{- $_ := set $out $key $value }}
{{- end }}
{{- end }}
{{- toJson $out }}
{{- end }}

{{/* The "server" section every service's config.yaml starts with; args: root, port. */}}
{{- define "k3.serverConfig" -}}
{{- $v := .root.Values }}
{{- $server := dict "host" "0.0.0.0" "port" (int .port) "grace_seconds" $v.server.graceSeconds "max_message_bytes" (int64 $v.server.maxMessageBytes) "max_workers" (int $v.server.maxWorkers) }}
{{- if $v.telemetry.otlpEndpoint }}
{{- $_ := set $server "otlp_endpoint" $v.telemetry.otlpEndpoint }}
{{- end }}
{{- if $v.telemetry.metricsPort }}
{{- $_ := set $server "metrics_port" (int $v.telemetry.metricsPort) }}
{{- end }}
{{- toJson $server }}
{{- end }}

{{/* host:port of a component's Service; args: root, component, port. */}}
{{- define "k3.address" -}}
{{- printf "%s-%s:%d" (include "k3.fullname" .root) .component (int .port) }}
{{- end }}

{{/* host:port of every expert pool's Service, as a JSON list (prefill and decode send MoE layers there). */}}
{{- define "k3.expertPoolAddresses" -}}
{{- $addresses := list }}
{{- range .Values.expertPools }}
{{- $port := default $.Values.expertPoolDefaults.port .port }}
{{- $addresses = append $addresses (include "k3.address" (dict "root" $ "component" (printf "expert-%s" .name) "port" $port)) }}
{{- end }}
{{- toJson $addresses }}
{{- end }}

{{/*
A minReplicas <= maxReplicas check with a message naming the field; args: field, autoscaling.
*/}}
{{- define "k3.checkAutoscaling" -}}
{{- if and .autoscaling.enabled (gt (int .autoscaling.minReplicas) (int .autoscaling.maxReplicas)) }}
{{- fail (printf "%s: minReplicas (%d) must not exceed maxReplicas (%d)" .field (int .autoscaling.minReplicas) (int .autoscaling.maxReplicas)) }}
{{- end }}
{{- end }}

{{/*
One k3 service: ConfigMap, Service, Deployment, PodDisruptionBudget and, when .autoscaling.enabled, a
HorizontalPodAutoscaler. Args:
  root        the chart root context
  component   component label and object-name suffix (router, expert-<pool>, ...)
  service     name given to `k3 serve`
  values      componentDefaults merged with the component's block
  port        gRPC port
  config      generated config (map); values.config is merged over it
  autoscaling HPA settings (map) or empty
  podLabels   extra pod and object labels (map) or empty
  env         extra EnvVars computed by the component template (list) or empty
*/}}
{{- define "k3.component" -}}
{{- $root := .root }}
{{- $v := .values }}
{{- $name := printf "%s-%s" (include "k3.fullname" $root) .component }}
{{- $selector := include "k3.selectorLabels" (dict "root" $root "component" .component) }}
{{- $extraLabels := default (dict) .podLabels }}
{{- $config := include "k3.merge" (dict "base" .config "over" (default (dict) $v.config)) | fromJson }}
{{- $configYaml := toYaml $config }}
{{- $autoscaling := default (dict) .autoscaling }}
{{- $port := int .port }}
apiVersion: v1
kind: ConfigMap
metadata:
  name: {{ $name }}
  labels:
    {{- include "k3.labels" $root | nindent 4 }}
    app.kubernetes.io/component: {{ .component }}
    {{- with $extraLabels }}
    {{- toYaml . | nindent 4 }}
    {{- end }}
data:
  config.yaml: |
    {{- $configYaml | nindent 4 }}
---
apiVersion: v1
kind: Service
metadata:
  name: {{ $name }}
  labels:
    {{- include "k3.labels" $root | nindent 4 }}
    app.kubernetes.io/component: {{ .component }}
    {{- with $extraLabels }}
    {{- toYaml . | nindent 4 }}
    {{- end }}
  {{- with $v.service.annotations }}
  annotations:
    {{- toYaml . | nindent 4 }}
  {{- end }}
spec:
  type: {{ $v.service.type }}
  selector:
    {{- $selector | nindent 4 }}
  ports:
    - name: grpc
      port: {{ $port }}
      targetPort: grpc
      protocol: TCP
      appProtocol: kubernetes.io/h2c
---
apiVersion: apps/v1
kind: Deployment
metadata:
  name: {{ $name }}
  labels:
    {{- include "k3.labels" $root | nindent 4 }}
    app.kubernetes.io/component: {{ .component }}
    {{- with $extraLabels }}
    {{- toYaml . | nindent 4 }}
    {{- end }}
spec:
  {{- /* An HPA owns the replica count; rendering it here too would reset it on every upgrade. */}}
  {{- if not $autoscaling.enabled }}
  replicas: {{ int $v.replicas }}
  {{- end }}
  selector:
    matchLabels:
      {{- $selector | nindent 6 }}
  template:
    metadata:
      labels:
        {{- include "k3.releaseLabels" $root | nindent 8 }}
        app.kubernetes.io/component: {{ .component }}
        {{- with $extraLabels }}
        {{- toYaml . | nindent 8 }}
        {{- end }}
        {{- with $v.podLabels }}
        {{- toYaml . | nindent 8 }}
        {{- end }}
      annotations:
        {{- /* A changed config rolls the pods: the services read config.yaml once, at start. */}}
        checksum/config: {{ $configYaml | sha256sum }}
        {{- with $v.podAnnotations }}
        {{- toYaml . | nindent 8 }}
        {{- end }}
    spec:
      serviceAccountName: {{ .serviceAccountName | default (include "k3.serviceAccountName" $root) }}
      {{- with $root.Values.imagePullSecrets }}
      imagePullSecrets:
        {{- toYaml . | nindent 8 }}
      {{- end }}
      {{- with $root.Values.podSecurityContext }}
      securityContext:
        {{- toYaml . | nindent 8 }}
      {{- end }}
      {{- /* Longer than the server's own drain so that Kubernetes never kills a draining server early. */}}
      terminationGracePeriodSeconds: {{ add (ceil $root.Values.server.graceSeconds | int) 5 }}
      containers:
        - name: {{ .service }}
          image: {{ include "k3.image" (dict "root" $root "image" $v.image) | quote }}
          imagePullPolicy: {{ include "k3.imagePullPolicy" (dict "root" $root "image" $v.image) }}
          command: ["k3", "serve", {{ .service | quote }}, "--config", "/etc/k3/config.yaml"]
          ports:
            - name: grpc
              containerPort: {{ $port }}
              protocol: TCP
            {{- with $root.Values.telemetry.metricsPort }}
            {{- /* Prometheus finds the pods to scrape by this port's name (ops/prometheus/prometheus.yml). */}}
            - name: metrics
              containerPort: {{ int . }}
              protocol: TCP
            {{- end }}
          {{- $env := concat (include "k3.env" $root | fromYamlArray) (default (list) .env) (default (list) $v.env) }}
          {{- with $env }}
          env:
            {{- toYaml . | nindent 12 }}
          {{- end }}
          {{- /* Native gRPC probes ask grpc.health.v1 for the server's overall status (""), which turns
                 SERVING once the model is loaded and NOT_SERVING when a drain starts. */}}
          startupProbe:
            grpc:
              port: {{ $port }}
            periodSeconds: {{ int $v.probes.startup.periodSeconds }}
            failureThreshold: {{ int $v.probes.startup.failureThreshold }}
          readinessProbe:
            grpc:
              port: {{ $port }}
            periodSeconds: {{ int $v.probes.readiness.periodSeconds }}
            failureThreshold: {{ int $v.probes.readiness.failureThreshold }}
          livenessProbe:
            grpc:
              port: {{ $port }}
            periodSeconds: {{ int $v.probes.liveness.periodSeconds }}
            failureThreshold: {{ int $v.probes.liveness.failureThreshold }}
            timeoutSeconds: {{ int $v.probes.liveness.timeoutSeconds }}
          {{- with $v.resources }}
          resources:
            {{- toYaml . | nindent 12 }}
          {{- end }}
          {{- with $root.Values.securityContext }}
          securityContext:
            {{- toYaml . | nindent 12 }}
          {{- end }}
          volumeMounts:
            - name: config
              mountPath: /etc/k3
              readOnly: true
            {{- with $v.extraVolumeMounts }}
            {{- toYaml . | nindent 12 }}
            {{- end }}
      volumes:
        - name: config
          configMap:
            name: {{ $name }}
        {{- with $v.extraVolumes }}
        {{- toYaml . | nindent 8 }}
        {{- end }}
      {{- with $v.nodeSelector }}
      nodeSelector:
        {{- toYaml . | nindent 8 }}
      {{- end }}
      {{- with $v.tolerations }}
      tolerations:
        {{- toYaml . | nindent 8 }}
      {{- end }}
      {{- with $v.affinity }}
      affinity:
        {{- toYaml . | nindent 8 }}
      {{- end }}
{{- if $v.pdb.enabled }}
---
apiVersion: policy/v1
kind: PodDisruptionBudget
metadata:
  name: {{ $name }}
  labels:
    {{- include "k3.labels" $root | nindent 4 }}
    app.kubernetes.io/component: {{ .component }}
    {{- with $extraLabels }}
    {{- toYaml . | nindent 4 }}
    {{- end }}
spec:
  maxUnavailable: {{ $v.pdb.maxUnavailable }}
  selector:
    matchLabels:
      {{- $selector | nindent 6 }}
{{- end }}
{{- if $autoscaling.enabled }}
---
apiVersion: autoscaling/v2
kind: HorizontalPodAutoscaler
metadata:
  name: {{ $name }}
  labels:
    {{- include "k3.labels" $root | nindent 4 }}
    app.kubernetes.io/component: {{ .component }}
    {{- with $extraLabels }}
    {{- toYaml . | nindent 4 }}
    {{- end }}
spec:
  scaleTargetRef:
    apiVersion: apps/v1
    kind: Deployment
    name: {{ $name }}
  minReplicas: {{ int $autoscaling.minReplicas }}
  maxReplicas: {{ int $autoscaling.maxReplicas }}
  metrics:
    {{- /* A Pods metric is averaged over the target's pods; a custom-metrics adapter serves it (README). */}}
    - type: Pods
      pods:
        metric:
          name: {{ $autoscaling.metric }}
        target:
          type: AverageValue
          averageValue: {{ $autoscaling.targetAverageValue | quote }}
  {{- with $autoscaling.behavior }}
  behavior:
    {{- toYaml . | nindent 4 }}
  {{- end }}
{{- end }}
{{- end }}

{{/* EnvVars every k3 container gets: the bearer token and the external Kafka and Redis. */}}
{{- define "k3.env" -}}
{{- if .Values.auth.enabled }}
- name: K3_AUTH_TOKEN
  valueFrom:
    secretKeyRef:
      name: {{ include "k3.authSecretName" . }}
      key: {{ .Values.auth.secretKey }}
{{- end }}
{{- if .Values.kafka.bootstrap }}
- name: K3_KAFKA_BOOTSTRAP
  value: {{ .Values.kafka.bootstrap | quote }}
{{- end }}
{{- if .Values.redis.url }}
- name: K3_REDIS_URL
  value: {{ .Values.redis.url | quote }}
{{- end }}
{{- end }}

{{/* The component values: componentDefaults merged with the component block; args: root, values. */}}
{{- define "k3.componentValues" -}}
{{- include "k3.merge" (dict "base" .root.Values.componentDefaults "over" .values) }}
{{- end }}
