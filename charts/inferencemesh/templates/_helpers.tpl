{{/* Names and labels shared by the templates. */}}
{{- define "inferencemesh.fullname" -}}
{{- printf "%s-inferencemesh-operator" .Release.Name | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{- define "inferencemesh.serviceAccountName" -}}
{{- if .Values.serviceAccount.create -}}
{{- default (include "inferencemesh.fullname" .) .Values.serviceAccount.name -}}
{{- else -}}
{{- default "default" .Values.serviceAccount.name -}}
{{- end -}}
{{- end -}}

{{- define "inferencemesh.selectorLabels" -}}
app.kubernetes.io/name: inferencemesh
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/component: operator
{{- end -}}

{{- define "inferencemesh.labels" -}}
{{ include "inferencemesh.selectorLabels" . }}
app.kubernetes.io/part-of: inferencemesh
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" }}
{{- end -}}

{{/* What the operator does inside a watched namespace (or cluster-wide): least privilege, no "*". */}}
{{- define "inferencemesh.namespacedRules" -}}
- apiGroups: ["inferencemesh.io"]
  resources: ["inferencemeshes"]
  verbs: ["get", "list", "watch"]
- apiGroups: ["inferencemesh.io"]
  resources: ["inferencemeshes/status"]
  verbs: ["get", "patch", "update"]
# Owner references with blockOwnerDeletion need this where OwnerReferencesPermissionEnforcement is on.
- apiGroups: ["inferencemesh.io"]
  resources: ["inferencemeshes/finalizers"]
  verbs: ["update"]
- apiGroups: [""]
  resources: ["configmaps", "services"]
  verbs: ["get", "list", "watch", "create", "update", "patch", "delete"]
# Each mesh's CA and certificates (spec.security.mtls): the operator issues, renews and reads them back.
- apiGroups: [""]
  resources: ["secrets"]
  verbs: ["get", "list", "create", "update", "delete"]
- apiGroups: ["apps"]
  resources: ["deployments"]
  verbs: ["get", "list", "watch", "create", "update", "patch", "delete"]
- apiGroups: ["networking.k8s.io"]
  resources: ["networkpolicies"]
  verbs: ["get", "list", "watch", "create", "update", "patch", "delete"]
# Each mesh's disruption budgets (its router; its pipelines' pods): written and read back, never watched.
- apiGroups: ["policy"]
  resources: ["poddisruptionbudgets"]
  verbs: ["get", "list", "create", "update", "delete"]
- apiGroups: [""]
  resources: ["pods"]
  verbs: ["get", "list", "watch"]
# Each mesh's router runs as its own ServiceAccount, bound to a Role that may only read EndpointSlices.
# Granting that Role needs the operator to hold the same permission (RBAC refuses escalation).
- apiGroups: [""]
  resources: ["serviceaccounts"]
  verbs: ["get", "list", "watch", "create", "update", "patch", "delete"]
- apiGroups: ["rbac.authorization.k8s.io"]
  resources: ["roles", "rolebindings"]
  verbs: ["get", "list", "watch", "create", "update", "patch", "delete"]
- apiGroups: ["discovery.k8s.io"]
  resources: ["endpointslices"]
  verbs: ["get", "list", "watch"]
- apiGroups: [""]
  resources: ["events"]
  verbs: ["create", "patch", "list"]  # list: the kubelet's probe failures a not-ready pod reports
{{- if .Values.peering.enabled }}
- apiGroups: ["kopf.dev"]
  resources: ["kopfpeerings"]
  verbs: ["get", "list", "watch", "patch"]
{{- end }}
{{- end -}}
