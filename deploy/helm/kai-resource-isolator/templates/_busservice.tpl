{{/* A Deployment of a bus service with its ServiceAccount and ClusterRole:
     (dict "ctx" $ "component" "watcher" "values" .Values.watcher "rules" (list ...)) */}}
{{- define "kri.busService" -}}
{{- $ctx := .ctx -}}
{{- $fullname := include "kri.fullname" $ctx -}}
{{- $ns := include "kri.namespace" $ctx -}}
{{- $sel := dict "ctx" $ctx "component" .component -}}
apiVersion: v1
kind: ServiceAccount
metadata:
  name: {{ $fullname }}-{{ .component }}
  namespace: {{ $ns }}
  labels:
    {{- include "kri.componentLabels" $sel | nindent 4 }}
{{- if $ctx.Values.rbac.create }}
---
apiVersion: rbac.authorization.k8s.io/v1
kind: ClusterRole
metadata:
  name: {{ $fullname }}-{{ .component }}
  labels:
    {{- include "kri.componentLabels" $sel | nindent 4 }}
rules:
  {{- toYaml .rules | nindent 2 }}
---
apiVersion: rbac.authorization.k8s.io/v1
kind: ClusterRoleBinding
metadata:
  name: {{ $fullname }}-{{ .component }}
  labels:
    {{- include "kri.componentLabels" $sel | nindent 4 }}
roleRef:
  apiGroup: rbac.authorization.k8s.io
  kind: ClusterRole
  name: {{ $fullname }}-{{ .component }}
subjects:
  - kind: ServiceAccount
    name: {{ $fullname }}-{{ .component }}
    namespace: {{ $ns }}
{{- end }}
---
apiVersion: apps/v1
kind: Deployment
metadata:
  name: {{ $fullname }}-{{ .component }}
  namespace: {{ $ns }}
  labels:
    {{- include "kri.componentLabels" $sel | nindent 4 }}
spec:
  replicas: {{ include "kri.serviceReplicas" (dict "ctx" $ctx "values" .values) }}
  selector:
    matchLabels:
      {{- include "kri.selector" $sel | nindent 6 }}
  template:
    metadata:
      labels:
        {{- include "kri.selector" $sel | nindent 8 }}
    spec:
      serviceAccountName: {{ $fullname }}-{{ .component }}
      {{- include "kri.imagePullSecrets" $ctx | nindent 6 }}
      {{- include "kri.podSecurity" $ctx | nindent 6 }}
      {{- with .values.nodeSelector }}
      nodeSelector:
        {{- toYaml . | nindent 8 }}
      {{- end }}
      {{- with .values.tolerations }}
      tolerations:
        {{- toYaml . | nindent 8 }}
      {{- end }}
      containers:
        - name: {{ .component }}
          image: {{ include "kri.image" (dict "ctx" $ctx "image" $ctx.Values.image) }}
          imagePullPolicy: {{ $ctx.Values.image.pullPolicy }}
          args:
            {{- toYaml .args | nindent 12 }}
          {{- include "kri.busEnv" (dict "ctx" $ctx "probes" true) | nindent 10 }}
          ports:
            - name: probes
              containerPort: 8081
              protocol: TCP
          readinessProbe:
            httpGet:
              path: /readyz
              port: probes
            periodSeconds: 5
          livenessProbe:
            httpGet:
              path: /healthz
              port: probes
            initialDelaySeconds: 10
            periodSeconds: 10
          resources:
            {{- toYaml .values.resources | nindent 12 }}
          {{- include "kri.containerSecurity" $ctx | nindent 10 }}
          volumeMounts:
            - name: tmp
              mountPath: /tmp
            {{- include "kri.busMounts" $ctx | nindent 12 }}
      volumes:
        - name: tmp
          emptyDir:
            sizeLimit: 16Mi
        {{- include "kri.busVolumes" $ctx | nindent 8 }}
{{- end -}}
