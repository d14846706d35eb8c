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

{{/* The optional keys of the auth Secret the release uses (a JSON list): each one whose value is
given (auth.metricsToken, auth.jobToken, auth.operatorToken), and those auth.optionalKeys names (held
by auth.existingSecret, or by the Secret an earlier release made). */}}
{{- define "tensorwire.optionalKeys" -}}
{{- $keys := list -}}
{{- $given := dict "metrics-token" .Values.auth.metricsToken "job-token" .Values.auth.jobToken "operator-token" .Values.auth.operatorToken -}}
{{- range $key, $value := $given -}}
{{- if or $value (has $key ($.Values.auth.optionalKeys | default list)) }}{{ $keys = append $keys $key }}{{ end -}}
{{- end -}}
{{ toJson $keys }}
{{- end }}

{{/* "true" when the release uses optional key KEY: pass (dict "root" $ "key" KEY). */}}
{{- define "tensorwire.uses" -}}
{{- if has .key (include "tensorwire.optionalKeys" .root | fromJsonArray) }}true{{ end -}}
{{- end }}

{{/* Every key of the auth Secret: the clients' token, the slots' peer token, the optional keys. */}}
{{- define "tensorwire.authKeys" -}}
{{- $keys := list -}}
{{- if .Values.auth.enabled }}{{ $keys = append $keys "token" }}{{ end -}}
{{- if gt (int .Values.ps.replicas) 0 }}{{ $keys = append $keys "peer-token" }}{{ end -}}
{{ toJson (concat $keys (include "tensorwire.optionalKeys" . | fromJsonArray)) }}
{{- end }}

{{/* The keys a server pod reads: pass (dict "root" $ "ps" bool). Every server the clients' token
and, with metrics, Prometheus's metrics token; a parameter server also the peer token (when its
slot has standbys) and the operator token; a per-node store nothing else (it never replicates and
holds no job). */}}
{{- define "tensorwire.serverAuthKeys" -}}
{{- $root := .root -}}
{{- $keys := list -}}
{{- if $root.Values.auth.enabled }}{{ $keys = append $keys "token" }}{{ end -}}
{{- if and .ps (gt (int $root.Values.ps.replicas) 0) }}{{ $keys = append $keys "peer-token" }}{{ end -}}
{{- if and $root.Values.metrics.enabled (include "tensorwire.uses" (dict "root" $root "key" "metrics-token")) }}{{ $keys = append $keys "metrics-token" }}{{ end -}}
{{- if and .ps (include "tensorwire.uses" (dict "root" $root "key" "operator-token")) }}{{ $keys = append $keys "operator-token" }}{{ end -}}
{{ toJson $keys }}
{{- end }}

{{/* The flags of the optional secrets a server reads: pass (dict "root" $ "ps" bool). */}}
{{- define "tensorwire.serverSecretArgs" -}}
{{- $keys := include "tensorwire.serverAuthKeys" . | fromJsonArray -}}
{{- if has "metrics-token" $keys }}
- --metrics-token-file
- {{ include "tensorwire.authDir" .root }}/metrics-token
{{- end }}
{{- if has "operator-token" $keys }}
- --operator-token-file
- {{ include "tensorwire.authDir" .root }}/operator-token
{{- end }}
{{- end }}

{{/* The data of the auth Secret the chart makes (JSON: key -> base64). Nothing here is random: a
token made at render time (randAlphaNum) would be another one at every `helm template`, GitOps
sync or upgrade without a cluster to look in, and the servers (which read their token once, at
start) and the workers (which get theirs at start) would stop agreeing. So each key comes from its
value (auth.token, auth.peerToken, auth.metricsToken, ...), else from the Secret an earlier release
of the chart made (lookup, on install and upgrade against the cluster), else the render fails
saying how to provide it. No two keys may hold the same secret. */}}
{{- define "tensorwire.authData" -}}
{{- $keys := include "tensorwire.authKeys" . | fromJsonArray -}}
{{- $name := include "tensorwire.authSecret" . -}}
{{- $old := (lookup "v1" "Secret" .Release.Namespace $name).data | default dict -}}
{{- $a := .Values.auth -}}
{{- $given := dict "token" $a.token "peer-token" $a.peerToken "metrics-token" $a.metricsToken "job-token" $a.jobToken "operator-token" $a.operatorToken -}}
{{- $data := dict -}}
{{- range $key := $keys -}}
{{- $value := index $given $key | default "" -}}
{{- if $value -}}
{{- $_ := set $data $key ($value | b64enc) -}}
{{- else if index $old $key -}}
{{- $_ := set $data $key (index $old $key) -}}
{{- else -}}
{{- fail (printf "auth: no %s to use. The chart makes no token of its own (one made at render time would change at every `helm template` or GitOps sync). Create a Secret with the keys %s and set auth.existingSecret (with auth.optionalKeys naming the optional ones it holds), e.g. kubectl -n %s create secret generic %s-tokens --from-literal=token=$(openssl rand -hex 24) --from-literal=peer-token=$(openssl rand -hex 24); or set auth.token and auth.peerToken (two different values), and the values of the optional keys" $key (join ", " $keys) $.Release.Namespace (include "tensorwire.fullname" $)) -}}
{{- end -}}
{{- end -}}
{{- range $i, $one := $keys -}}
{{- range $other := slice $keys (add1 $i) -}}
{{- if eq (index $data $one) (index $data $other) -}}
{{- fail (printf "auth: the %s and the %s are the same: each must be another secret (a client that knows the token must not be able to replicate, end others' jobs or read what Prometheus reads)" $one $other) -}}
{{- end -}}
{{- end -}}
{{- end -}}
{{ toJson $data }}
{{- end }}

{{/* A digest of the tokens a server pod reads (KEYS), for its `checksum/auth` annotation: a changed
token changes the pod, so a GitOps sync restarts it (servers read their token files at start), and
a token it does not read restarts nothing. From the chart's own Secret; with auth.existingSecret,
from that Secret when `lookup` can read it (helm install/upgrade against a cluster), else empty (no
annotation: restart the servers yourself). The release's name is hashed with the data (the digest
of a weak token is still a guess to check: use random tokens). Pass (dict "root" $ "keys" KEYS). */}}
{{- define "tensorwire.authChecksum" -}}
{{- $root := .root -}}
{{- if .keys -}}
{{- $all := dict -}}
{{- if $root.Values.auth.existingSecret -}}
{{- $all = (lookup "v1" "Secret" $root.Release.Namespace $root.Values.auth.existingSecret).data | default dict -}}
{{- else -}}
{{- $all = include "tensorwire.authData" $root | fromJson -}}
{{- end -}}
{{- $data := dict -}}
{{- range $key := .keys }}{{ if hasKey $all $key }}{{ $_ := set $data $key (index $all $key) }}{{ end }}{{ end -}}
{{- if $data -}}
{{ toJson (dict "release" $root.Release.Name "namespace" $root.Release.Namespace "data" $data) | sha256sum }}
{{- end -}}
{{- end -}}
{{- end }}

{{/* The pod annotations of a server: its own (ANNOTATIONS) and `checksum/auth` over the KEYS it
reads: pass (dict "root" $ "annotations" ANNOTATIONS "keys" KEYS). */}}
{{- define "tensorwire.podAnnotations" -}}
{{- $annotations := deepCopy (.annotations | default dict) -}}
{{- with include "tensorwire.authChecksum" (dict "root" .root "keys" .keys) }}{{ $_ := set $annotations "checksum/auth" . }}{{ end -}}
{{- with $annotations }}
annotations:
  {{- toYaml . | nindent 2 }}
{{- end }}
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

{{/* The etcd coordinator (coordinator.endpoints set): "true" when it is on. */}}
{{- define "tensorwire.coordinated" -}}
{{- if .Values.coordinator.endpoints }}true{{ end -}}
{{- end }}

{{/* --coordinator: etcd://HOST:PORT[,HOST:PORT...]/PREFIX (etcds:// with coordinator.tls). */}}
{{- define "tensorwire.coordinatorUrl" -}}
{{ ternary "etcds" "etcd" .Values.coordinator.tls }}://{{ join "," .Values.coordinator.endpoints }}{{ .Values.coordinator.prefix }}
{{- end }}

{{/* Where coordinator.existingSecret is mounted (all its keys: each one is optional). */}}
{{- define "tensorwire.coordinatorDir" -}}/etc/tensorwire/coordinator{{- end }}

{{/* The lines of a server's entrypoint script that add the etcd credentials its Secret holds. The
Secret's keys are optional, so the pod looks at what is mounted when it starts: a user name
(--coordinator-user, not a secret), a password only as a file (--coordinator-password-file, never on
the command line or in the environment), and with coordinator.tls the CA (required) and a client
certificate and key (both or neither). A Secret that does not fit stops the pod with a message. */}}
{{- define "tensorwire.coordinatorScript" -}}
{{- $dir := include "tensorwire.coordinatorDir" . -}}
{{- if and .Values.coordinator.endpoints .Values.coordinator.existingSecret -}}
etcd={{ $dir }}
has() { [ -f "$etcd/$1" ]; }
refuse() { echo "tensorwire: coordinator.existingSecret {{ .Values.coordinator.existingSecret }}: $*" >&2; exit 64; }
if has username && has password; then
  set -- "$@" --coordinator-user "$(cat "$etcd/username")" --coordinator-password-file "$etcd/password"
elif has username || has password; then
  refuse "keys username and password go together"
fi
{{- if .Values.coordinator.tls }}
has ca.crt || refuse "key ca.crt (the CA of etcd's certificate) is missing; coordinator.tls needs it"
set -- "$@" --coordinator-tls-ca "$etcd/ca.crt"
if has tls.crt && has tls.key; then
  set -- "$@" --coordinator-tls-cert "$etcd/tls.crt" --coordinator-tls-key "$etcd/tls.key"
elif has tls.crt || has tls.key; then
  refuse "keys tls.crt and tls.key go together"
fi
{{- else }}
if has ca.crt || has tls.crt || has tls.key; then
  refuse "holds TLS files but coordinator.tls is false: set it (etcds://), or remove them"
fi
{{- end }}
{{- end }}
{{- end }}
