{{/* The bundled NATS cluster's server configuration (nats.conf): one place for the ConfigMap and its checksum. */}}
{{- define "kri.natsClusterConfig" -}}
{{- $ns := include "kri.namespace" . -}}
{{- $members := int .Values.nats.cluster.replicas -}}
server_name: $POD_NAME
port: 4222
http_port: 8222
pid_file: /var/run/nats/nats.pid
# On a rolling restart clients move to the other servers before this one stops.
lame_duck_duration: 30s
lame_duck_grace_period: 10s
jetstream {
  store_dir: /data
}
cluster {
  name: {{ .Values.nats.cluster.name }}
  port: 6222
  routes: [
    {{- range $i := until $members }}
    nats://nats-{{ $i }}.nats-cluster.{{ $ns }}.svc:6222
    {{- end }}
  ]
  # Peers come up in any order (podManagementPolicy Parallel); keep dialling until they do.
  connect_retries: 120
}
{{- end -}}
