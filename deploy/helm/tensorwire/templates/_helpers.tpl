{{/* Names, labels and the values every template derives from the release. */}}

{{- define "tensorwire.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/* The prefix of every object; short, so that pod names (FULLNAME-ps-SLOT-ORDINAL) fit 63 characters. */}}
{{- define "tensorwire.fullname" -}}
{{- if .Values.fullnameOverride }}
{{- .Values.fullnameOverride | trunc 40 | trimSuffix "-" }}
{{- else if contains (include "tensorwire.name" .) .Release.Name }}
{{- .Release.Name | trunc 40 | trimSuffix "-" }}
{{- else }}
{{- printf "%s-%s" .Release.Name (include "tensorwire.name" .) | trunc 40 | trimSuffix "-" }}
{{- end }}
{{- end }}

{{- define "tensorwire.selectorLabels" -}}
app.kubernetes.io/name: {{ include "tensorwire.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end }}

{{- define "tensorwire.labels" -}}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
{{ include "tensorwire.selectorLabels" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
{{- end }}

{{- define "tensorwire.image" -}}
{{ .Values.image.repository }}:{{ .Values.image.tag | default .Chart.AppVersion }}
{{- end }}

{{/* The headless Service that gives every parameter-server pod its DNS name. */}}
{{- define "tensorwire.psService" -}}
{{ include "tensorwire.fullname" . }}-ps
{{- end }}

{{/* The StatefulSet of slot N: pass (dict "root" $ "slot" N). */}}
{{- define "tensorwire.slotName" -}}
{{ include "tensorwire.fullname" .root }}-ps-{{ .slot }}
{{- end }}

{{- define "tensorwire.authSecret" -}}
{{ .Values.auth.existingSecret | default (printf "%s-auth" (include "tensorwire.fullname" .)) }}
{{- end }}

{{- define "tensorwire.tlsSecret" -}}
{{ .Values.tls.existingSecret | default (printf "%s-tls" (include "tensorwire.fullname" .)) }}
{{- end }}

{{/* tls when TLS is on, else tcp: the scheme of every URL the chart writes. */}}
{{- define "tensorwire.scheme" -}}
{{ ternary "tls" "tcp" .Values.tls.enabled }}
{{- end }}

{{/* The URL of replica R of slot N, by its stable DNS name: pass (dict "root" $ "slot" N "replica" R). */}}
{{- define "tensorwire.replicaUrl" -}}
{{- $root := .root -}}
{{ include "tensorwire.scheme" $root }}://{{ include "tensorwire.slotName" . }}-{{ .replica }}.{{ include "tensorwire.psService" $root }}.{{ $root.Release.Namespace }}.svc.{{ $root.Values.clusterDomain }}:{{ $root.Values.ps.port }}
{{- end }}

{{/* The replicas of slot N, primary first, as a list (JSON, for fromJsonArray). */}}
{{- define "tensorwire.slotUrls" -}}
{{- $urls := list -}}
{{- range $replica := until (int (add .root.Values.ps.replicas 1)) -}}
{{- $urls = append $urls (include "tensorwire.replicaUrl" (dict "root" $.root "slot" $.slot "replica" $replica)) -}}
{{- end -}}
{{ toJson $urls }}
{{- end }}

{{/* TENSORWIRE_SERVERS: slots joined by ",", the replicas of a slot by "|", primary first (as `ps launch`). */}}
{{- define "tensorwire.servers" -}}
{{- $slots := list -}}
{{- range $slot := until (int .Values.ps.slots) -}}
{{- $slots = append $slots (include "tensorwire.slotUrls" (dict "root" $ "slot" $slot) | fromJsonArray | join "|") -}}
{{- end -}}
{{ join "," $slots }}
{{- end }}

{{/* Where the Secrets are mounted, and the files the flags name. */}}
{{- define "tensorwire.authDir" -}}/etc/tensorwire/auth{{- end }}
{{- define "tensorwire.tlsDir" -}}/etc/tensorwire/tls{{- end }}

{{/* The flags of the client token and TLS, shared by servers and probes: pass (dict "root" $ "server" bool). */}}
{{- define "tensorwire.securityArgs" -}}
{{- $root := .root -}}
{{- if $root.Values.auth.enabled }}
- --token-file
- {{ include "tensorwire.authDir" $root }}/token
{{- end }}
{{- if and $root.Values.tls.enabled .server }}
- --tls-cert
- {{ include "tensorwire.tlsDir" $root }}/tls.crt
- --tls-key
- {{ include "tensorwire.tlsDir" $root }}/tls.key
{{- else if $root.Values.tls.enabled }}
- --tls-ca
- {{ include "tensorwire.tlsDir" $root }}/ca.crt
{{- end }}
{{- end }}

{{/* The probe of a server listening on PORT: pass (dict "root" $ "port" P "probe" (.Values.probes.readiness)). */}}
{{- define "tensorwire.probe" -}}
{{- $root := .root -}}
exec:
  command:
    - tensorwire
    - --log-level
    - error
    - probe
    - {{ include "tensorwire.scheme" $root }}://{{ $root.Values.probes.host }}:{{ .port }}
    - --timeout
    - {{ $root.Values.probes.timeout | quote }}
    {{- with include "tensorwire.securityArgs" (dict "root" $root "server" false) | trim }}{{ . | nindent 4 }}{{ end }}
{{ toYaml .probe }}
{{- end }}

{{/* Whether the release needs the auth Secret: the clients' token, or the slots' peer token. */}}
{{- define "tensorwire.authKeys" -}}
{{- $keys := list -}}
{{- if .Values.auth.enabled }}{{ $keys = append $keys "token" }}{{ end -}}
{{- if gt (int .Values.ps.replicas) 0 }}{{ $keys = append $keys "peer-token" }}{{ end -}}
{{ toJson $keys }}
{{- end }}

{{/* The Secret volumes of one pod, each projecting only the keys that pod reads (a store pod never
holds the peer token, a worker never the servers' private key): pass (dict "root" $ "auth" KEYS
"tls" KEYS), lists of keys; an empty list: no volume. */}}
{{- define "tensorwire.secretVolumes" -}}
{{- $root := .root -}}
{{- if .auth }}
- name: auth
  secret:
    secretName: {{ include "tensorwire.authSecret" $root }}
    defaultMode: 0440
    items:
      {{- range .auth }}
      - {key: {{ . }}, path: {{ . }}}
      {{- end }}
{{- end }}
{{- if and $root.Values.tls.enabled .tls }}
- name: tls
  secret:
    secretName: {{ include "tensorwire.tlsSecret" $root }}
    defaultMode: 0440
    items:
      {{- range .tls }}
      - {key: {{ . }}, path: {{ . }}}
      {{- end }}
{{- end }}
{{- end }}

{{- define "tensorwire.secretMounts" -}}
{{- $root := .root -}}
{{- if .auth }}
- name: auth
  mountPath: {{ include "tensorwire.authDir" $root }}
  readOnly: true
{{- end }}
{{- if and $root.Values.tls.enabled .tls }}
- name: tls
  mountPath: {{ include "tensorwire.tlsDir" $root }}
  readOnly: true
{{- end }}
{{- end }}

{{/* The TLS files a server reads: its certificate and key, and the CA its probe (and a primary,
its standbys) verify against. */}}
{{- define "tensorwire.serverTlsKeys" -}}
{{ toJson (list "tls.crt" "tls.key" "ca.crt") }}
{{- end }}

{{/* The topology every server and worker reads: the node, and its zone as the rack. */}}
{{- define "tensorwire.topologyEnv" -}}
- name: TENSORWIRE_HOST
  valueFrom:
    fieldRef:
      fieldPath: spec.nodeName
{{- if .Values.topology.rackFromZone }}
- name: TENSORWIRE_RACK
  valueFrom:
    fieldRef:
      fieldPath: metadata.labels['topology.kubernetes.io/zone']
{{- end }}
{{- end }}

{{/* A slot's replicas on different nodes (required or preferred), and preferably in different
zones/racks: pass (dict "root" $ "slot" N). The selector is exactly that slot's pods. */}}
{{- define "tensorwire.slotAntiAffinity" -}}
{{- $root := .root -}}
{{- $anti := $root.Values.ps.antiAffinity -}}
{{- $selector := dict "labelSelector" (dict "matchLabels" (dict "app.kubernetes.io/instance" $root.Release.Name "app.kubernetes.io/component" "ps" "tensorwire.io/slot" (toString .slot))) -}}
{{- $byNode := merge (dict "topologyKey" "kubernetes.io/hostname") (deepCopy $selector) -}}
podAntiAffinity:
  {{- if eq $anti.hostname "required" }}
  requiredDuringSchedulingIgnoredDuringExecution:
    - {{ toYaml $byNode | indent 6 | trim }}
  {{- end }}
  {{- if or (eq $anti.hostname "preferred") $anti.topologyKey }}
  preferredDuringSchedulingIgnoredDuringExecution:
    {{- if eq $anti.hostname "preferred" }}
    - weight: {{ $anti.weight }}
      podAffinityTerm:
        {{- toYaml $byNode | nindent 8 }}
    {{- end }}
    {{- if $anti.topologyKey }}
    - weight: {{ $anti.weight }}
      podAffinityTerm:
        {{- toYaml (merge (dict "topologyKey" $anti.topologyKey) (deepCopy $selector)) | nindent 8 }}
    {{- end }}
  {{- end }}
{{- end }}
