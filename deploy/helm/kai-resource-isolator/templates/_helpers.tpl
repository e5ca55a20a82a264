{{/* Names, labels, images and the security settings every template shares. */}}

{{- define "kri.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{- define "kri.fullname" -}}
{{- if .Values.fullnameOverride -}}
{{- .Values.fullnameOverride | trunc 50 | trimSuffix "-" -}}
{{- else -}}
{{- $name := default .Chart.Name .Values.nameOverride -}}
{{- if contains $name .Release.Name -}}
{{- .Release.Name | trunc 50 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name $name | trunc 50 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}
{{- end -}}

{{- define "kri.namespace" -}}
{{- default .Release.Namespace .Values.namespaceOverride -}}
{{- end -}}

{{- define "kri.labels" -}}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
app.kubernetes.io/part-of: kai-resource-isolator
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
{{- end -}}

{{/* Selector labels of one component: (dict "ctx" $ "component" "webhook") */}}
{{- define "kri.selector" -}}
app.kubernetes.io/name: {{ include "kri.name" .ctx }}
app.kubernetes.io/instance: {{ .ctx.Release.Name }}
app.kubernetes.io/component: {{ .component }}
{{- end -}}

{{- define "kri.componentLabels" -}}
{{ include "kri.labels" .ctx }}
{{ include "kri.selector" . }}
{{- end -}}

{{/* An image reference: (dict "ctx" $ "image" .Values.image), and "suffix" "-nodeagent" for an image whose
     default tag is the appVersion with a suffix. A digest pins it: <registry>/<repository>:<tag>@<digest>, the tag
     kept so a reader sees which release it is; the runtime pulls by the digest. */}}
{{- define "kri.image" -}}
{{- $registry := default .image.registry .ctx.Values.global.imageRegistry -}}
{{- $tag := default (printf "%s%s" .ctx.Chart.AppVersion (get . "suffix")) .image.tag -}}
{{- $name := .image.repository -}}
{{- if $registry -}}
{{- $name = printf "%s/%s" $registry .image.repository -}}
{{- end -}}
{{- if .image.digest -}}
{{- if not (regexMatch "^sha256:[0-9a-f]{64}$" .image.digest) -}}
{{- fail (printf "an image digest must be sha256:<64 hex digits>, got %q" .image.digest) -}}
{{- end -}}
{{- printf "%s:%s@%s" $name $tag .image.digest -}}
{{- else -}}
{{- printf "%s:%s" $name $tag -}}
{{- end -}}
{{- end -}}

{{- define "kri.imagePullSecrets" -}}
{{- with .Values.global.imagePullSecrets }}
imagePullSecrets:
{{- range . }}
  - name: {{ if kindIs "map" . }}{{ .name }}{{ else }}{{ . }}{{ end }}
{{- end }}
{{- end }}
{{- end -}}

{{/* The certs Jobs' ServiceAccount and RBAC are hooks of both phases: they exist before each Job runs
     (release resources are not there yet at pre-install) and are removed once the phase's hooks succeeded. */}}
{{- define "kri.certsRbacHook" -}}
helm.sh/hook: pre-install,pre-upgrade,post-install,post-upgrade
helm.sh/hook-weight: "-10"
helm.sh/hook-delete-policy: before-hook-creation,hook-succeeded
{{- end -}}

{{/* The node agent's state directory on every node (fixed by the agent; per-container state is in <it>/containers). */}}
{{- define "kri.stateDir" -}}
/var/lib/kai-isolator
{{- end -}}

{{/* Where the node agent writes grants and the webhook mounts them from: absolute, apart from the state dir. */}}
{{- define "kri.grantDir" -}}
{{- $dir := .Values.paths.grantDir | trimSuffix "/" -}}
{{- $state := printf "%s/containers" (include "kri.stateDir" .) -}}
{{- if not (hasPrefix "/" $dir) -}}
{{- fail (printf "paths.grantDir must be an absolute path, got %q" .Values.paths.grantDir) -}}
{{- end -}}
{{- if or (eq $dir $state) (hasPrefix (printf "%s/" $state) $dir) (hasPrefix (printf "%s/" $dir) $state) -}}
{{- fail (printf "paths.grantDir %s must not contain or be inside the tenant-writable state dir %s" $dir $state) -}}
{{- end -}}
{{- $dir -}}
{{- end -}}

{{/* The NRI plugin's name: its --name, and what the webhook's required-plugins annotation names (NRI matches by name). */}}
{{- define "kri.nriPlugin" -}}
kai-isolator
{{- end -}}

{{/* Where the agent answers its plugin: a socket in an emptyDir the two containers of its pod share, nothing on the host. */}}
{{- define "kri.nriAgentSocket" -}}
/run/kai-isolator/nri.sock
{{- end -}}

{{/* The plugin's index as NRI wants it, two digits: a string is taken as written, a number (--set index=5) padded. */}}
{{- define "kri.nriIndex" -}}
{{- $index := .Values.nodeAgent.nri.index -}}
{{- if kindIs "string" $index -}}
{{- $index -}}
{{- else -}}
{{- printf "%02d" (int $index) -}}
{{- end -}}
{{- end -}}

{{/* The host directory of containerd's NRI socket, mounted into the plugin's container: refused where it would hand
     the plugin more than that socket (the runtime's own sockets live in /run/containerd, everything in /run). */}}
{{- define "kri.nriSocketDir" -}}
{{- $path := .Values.nodeAgent.nri.socketPath -}}
{{- $dir := dir $path -}}
{{- if or (not (hasPrefix "/" $path)) (ne (clean $path) $path) -}}
{{- fail (printf "nodeAgent.nri.socketPath must be a clean absolute path, got %q" $path) -}}
{{- end -}}
{{- if has $dir (list "/" "/run" "/var/run" "/var" "/tmp" "/etc" "/run/containerd" "/var/run/containerd" "/run/crio" "/var/run/crio") -}}
{{- fail (printf "nodeAgent.nri.socketPath %s: its directory %s is mounted into the NRI plugin's container; keep the socket in a directory of its own (containerd's default: /var/run/nri/nri.sock)" $path $dir) -}}
{{- end -}}
{{- $dir -}}
{{- end -}}

{{- define "kri.natsUrl" -}}
{{- default (printf "nats://nats.%s.svc:4222" (include "kri.namespace" .)) .Values.bus.url -}}
{{- end -}}

{{/* Pod-level security of every non-root service (Pod Security Standard `restricted`). */}}
{{- define "kri.podSecurity" -}}
securityContext:
  runAsNonRoot: true
  runAsUser: 65532
  runAsGroup: 65532
  seccompProfile:
    type: RuntimeDefault
{{- end -}}

{{- define "kri.containerSecurity" -}}
securityContext:
  allowPrivilegeEscalation: false
  readOnlyRootFilesystem: true
  runAsNonRoot: true
  capabilities:
    drop: [ALL]
{{- end -}}

{{/* envFrom + env of a service on the bus; (dict "ctx" $ "probes" true) adds the probe listener. */}}
{{- define "kri.busEnv" -}}
{{- $v := .ctx.Values -}}
{{- $env := list -}}
{{- if .probes }}{{ $env = append $env (dict "name" "KAI_ISOLATOR_PROBE_LISTEN" "value" "0.0.0.0:8081") }}{{ end -}}
{{- if $v.bus.credsSecret }}{{ $env = append $env (dict "name" "KAI_ISOLATOR_NATS_CREDS_FILE" "value" "/etc/nats-creds/nats.creds") }}{{ end -}}
{{- if $v.bus.tlsSecret -}}
{{- $env = append $env (dict "name" "KAI_ISOLATOR_NATS_TLS_CA_FILE" "value" "/etc/nats-tls/ca.crt") -}}
{{- if $v.bus.tlsClientCert -}}
{{- $env = append $env (dict "name" "KAI_ISOLATOR_NATS_TLS_CERT_FILE" "value" "/etc/nats-tls/tls.crt") -}}
{{- $env = append $env (dict "name" "KAI_ISOLATOR_NATS_TLS_KEY_FILE" "value" "/etc/nats-tls/tls.key") -}}
{{- end -}}
{{- end -}}
{{- $env = concat $env (.extra | default list) -}}
envFrom:
  - configMapRef:
      name: {{ include "kri.fullname" .ctx }}-config
{{- with $v.bus.envSecret }}
  - secretRef:
      name: {{ . }}
{{- end }}
{{- with $env }}
env:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- end -}}

{{- define "kri.busMounts" -}}
{{- if .Values.bus.credsSecret }}
- name: nats-creds
  mountPath: /etc/nats-creds
  readOnly: true
{{- end }}
{{- if .Values.bus.tlsSecret }}
- name: nats-tls
  mountPath: /etc/nats-tls
  readOnly: true
{{- end }}
{{- end -}}

{{- define "kri.busVolumes" -}}
{{- with .Values.bus.credsSecret }}
- name: nats-creds
  secret:
    secretName: {{ . }}
{{- end }}
{{- with .Values.bus.tlsSecret }}
- name: nats-tls
  secret:
    secretName: {{ . }}
{{- end }}
{{- end -}}

{{/* PDB availability, upstream's precedence: a valid maxUnavailable, else a valid minAvailable, else minAvailable 1. */}}
{{- define "kri.pdbAvailability" -}}
{{- $pdb := .Values.webhook.podDisruptionBudget -}}
{{- if not (kindIs "map" $pdb) }}{{ $pdb = dict }}{{ end -}}
{{- $valid := "^([0-9]{1,9}|[0-9]{1,2}%|100%)$" -}}
{{- $max := toString (index $pdb "maxUnavailable") -}}
{{- $min := toString (index $pdb "minAvailable") -}}
{{- if and (hasKey $pdb "maxUnavailable") (regexMatch $valid $max) -}}
maxUnavailable: {{ if hasSuffix "%" $max }}{{ $max | quote }}{{ else }}{{ $max | atoi }}{{ end }}
{{- else if and (hasKey $pdb "minAvailable") (regexMatch $valid $min) -}}
minAvailable: {{ if hasSuffix "%" $min }}{{ $min | quote }}{{ else }}{{ $min | atoi }}{{ end }}
{{- else -}}
minAvailable: 1
{{- end -}}
{{- end -}}

{{/* Replicas of the stream and every KV bucket (KAI_ISOLATOR_NATS_REPLICAS): bus.replicas, else 3 on
     the bundled NATS cluster, else 1 (one server cannot hold more). */}}
{{- define "kri.natsReplicas" -}}
{{- $members := int .Values.nats.cluster.replicas -}}
{{- if and .Values.nats.cluster.enabled (or (lt $members 3) (eq (mod $members 2) 0)) -}}
{{- fail (printf "nats.cluster.replicas must be odd and at least 3 (a JetStream quorum survives losing a minority), got %v" .Values.nats.cluster.replicas) -}}
{{- end -}}
{{- $replicas := 1 -}}
{{- if not (kindIs "invalid" .Values.bus.replicas) -}}
{{- $replicas = int .Values.bus.replicas -}}
{{- else if .Values.nats.cluster.enabled -}}
{{- $replicas = 3 -}}
{{- end -}}
{{- if or (lt $replicas 1) (gt $replicas 5) -}}
{{- fail (printf "bus.replicas must be 1 to 5 (JetStream's limit), got %v" .Values.bus.replicas) -}}
{{- end -}}
{{- if and .Values.nats.cluster.enabled (gt $replicas (int .Values.nats.cluster.replicas)) -}}
{{- fail (printf "bus.replicas %d exceeds the bundled cluster's %v servers (nats.cluster.replicas)" $replicas .Values.nats.cluster.replicas) -}}
{{- end -}}
{{- if and .Values.nats.enabled (not .Values.nats.cluster.enabled) (gt $replicas 1) -}}
{{- fail (printf "bus.replicas %d needs a NATS cluster: the bundled single server holds one replica (set nats.cluster.enabled)" $replicas) -}}
{{- end -}}
{{- $replicas -}}
{{- end -}}

{{/* Replicas of a bus service Deployment: (dict "ctx" $ "values" .Values.watcher). Its replicaCount,
     else 2 when the bus is replicated (a standby that takes over, a second verifier sharing the
     work), else 1. */}}
{{- define "kri.serviceReplicas" -}}
{{- if not (kindIs "invalid" .values.replicaCount) -}}
{{- int .values.replicaCount -}}
{{- else if gt (int (include "kri.natsReplicas" .ctx)) 1 -}}
2
{{- else -}}
1
{{- end -}}
{{- end -}}
