#!/usr/bin/env bash
# Cluster DNS for the test cluster: a STAND-IN FOR CoreDNS, which Debian does not package.
# Test infrastructure, not product: dnsmasq answers A queries for Service names from a hosts
# file, and this loop regenerates that file from the API (`kubectl get svc -A`) and tells
# dnsmasq to re-read it (SIGHUP). Pods get it as their nameserver through kubelet's clusterDNS.
#   NAME.NAMESPACE.svc.cluster.local and NAME.NAMESPACE.svc -> the Service's ClusterIP
# Headless Services, SRV records and pod names are not served (nothing here needs them).
# dnsmasq forwards nothing (--no-resolv): other names get no answer, so pods reach no other
# network through it.
#   dns_standin.sh KUBECONFIG HOSTS_FILE DNSMASQ_PIDFILE
set -uo pipefail
kubeconfig=$1 hosts=$2 pidfile=$3
domain=${CLUSTER_DOMAIN:-cluster.local}

render() {
  kubectl --kubeconfig "$kubeconfig" get svc -A --request-timeout=5s \
    -o jsonpath='{range .items[*]}{.spec.clusterIP} {.metadata.name}.{.metadata.namespace}{"\n"}{end}' \
  | awk -v d="$domain" '$1 != "" && $1 != "None" { print $1, $2 ".svc." d, $2 ".svc" }' | LC_ALL=C sort
}

while true; do
  if render > "$hosts.new" 2>/dev/null; then
    if ! cmp -s "$hosts.new" "$hosts"; then
      mv "$hosts.new" "$hosts"
      kill -HUP "$(cat "$pidfile")" 2>/dev/null || true
    fi
  fi
  sleep 2
done
