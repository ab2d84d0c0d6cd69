#!/usr/bin/env bash
# A real single-node Kubernetes 1.20 cluster on this machine, with the project's images in it.
#
#   eval "$(tools/cluster/up.sh | grep ^export)"    # then: python -m pytest e2e -v
#   tools/cluster/down.sh                           # stops and removes everything again
#
# Standard output: only `export` lines (KUBECONFIG and the IMESH_E2E_* settings of e2e/);
# progress goes to standard error. Idempotent: what runs keeps running, what is cached is reused
# (binaries, base image, images: see lib.sh for the three places on disk). Needs root.
#
# The pieces (BRIEF §5 is the recipe this follows):
#   etcd (Debian etcd-server) -> kube-apiserver -> kube-controller-manager, kube-scheduler
#   containerd 1.6 (CRI, overlayfs snapshotter where it mounts, our pause image) + runc behind runc-oom-clamp
#   + CNI bridge/host-local -> kubelet (node IP on bridge imesh0) -> kube-proxy (iptables)
#   dnsmasq fed from the API: the stand-in for CoreDNS (dns_standin.sh)
# Kubernetes binaries come from tools/k8s/ensure_binaries.sh (built once from Debian's source).
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/lib.sh"

PKI="$STATE/pki"
KCFG="$STATE/kubeconfig"
# (prometheus: its promtool checks the pods' /metrics in e2e.)
HOST_PACKAGES=(etcd-server containerd runc containernetworking-plugins iptables conntrack ipset
               dnsmasq-base buildah mmdebstrap openssl jq golang-go prometheus)

# ---- host preparation ---------------------------------------------------------------------

ensure_host() {
  [ "$(id -u)" = 0 ] || die "run as root (it starts containerd, kubelet, and changes iptables)"
  ensure_packages "${HOST_PACKAGES[@]}"
  bash "$REPO/tools/k8s/ensure_binaries.sh" >&2
  mkdir -p "$STATE" "$RUN/pids" "$LOGS" "$STATE/bin"
}

# The kernel settings this script and the components change, saved once before the first
# change so down.sh can put them back (kubelet sets vm/kernel tunables, kube-proxy route_localnet,
# pods need forwarding and bridged traffic through iptables).
SYSCTLS=(net.ipv4.ip_forward net.bridge.bridge-nf-call-iptables net.bridge.bridge-nf-call-ip6tables
         net.ipv4.conf.all.route_localnet vm.overcommit_memory vm.panic_on_oom kernel.panic
         kernel.panic_on_oops kernel.keys.root_maxkeys kernel.keys.root_maxbytes)
save_sysctls() {
  [ -f "$STATE/sysctl.saved" ] && return
  local key
  for key in "${SYSCTLS[@]}"; do
    sysctl -n "$key" >/dev/null 2>&1 && echo "$key=$(sysctl -n "$key")"
  done > "$STATE/sysctl.saved"
  say "saved kernel settings to restore on down: $STATE/sysctl.saved"
}

# Node address: a bridge (no dummy interfaces in these VMs) holding NODE_IP. Pods reach it via
# their gateway, the API server reaches the kubelet on it, dnsmasq listens on it.
setup_node_network() {
  if ! ip link show "$NODE_BRIDGE" >/dev/null 2>&1; then
    ip link add "$NODE_BRIDGE" type bridge
    ip addr add "$NODE_IP/32" dev "$NODE_BRIDGE"
    ip link set "$NODE_BRIDGE" up
    say "bridge $NODE_BRIDGE with node address $NODE_IP"
  fi
  sysctl -qw net.ipv4.ip_forward=1
  sysctl -qw net.bridge.bridge-nf-call-iptables=1   # Service NAT for pod-to-pod traffic on the bridge
  # Pods may talk to each other and to this node, nothing else: drop anything forwarded from the
  # pod bridge to another interface (the pods need no outside network; nor may tests reach one).
  if ! iptables -w -n -L IMESH-ISOLATE >/dev/null 2>&1; then
    iptables -w -N IMESH-ISOLATE
    iptables -w -A IMESH-ISOLATE -i "$POD_BRIDGE" ! -o "$POD_BRIDGE" -j REJECT
    iptables -w -I FORWARD 1 -j IMESH-ISOLATE
  fi
  # Nor may anything send the cluster's addresses elsewhere: unreachable routes for its ranges (lib.sh).
  add_unreachable_routes
  say "unreachable beyond this machine: ${CLUSTER_CIDRS[*]}"
}

# CNI: one bridge, host-local addresses from POD_CIDR, state in $STATE (not /var/lib/cni).
# No ipMasq: pods never need to leave the node.
write_cni_config() {
  mkdir -p "$STATE/cni/net.d" "$STATE/cni/ipam"
  cat > "$STATE/cni/net.d/10-imesh.conflist" <<EOF
{
  "cniVersion": "0.4.0",
  "name": "imesh",
  "plugins": [
    {"type": "bridge", "bridge": "$POD_BRIDGE", "isGateway": true, "ipMasq": false, "hairpinMode": true,
     "ipam": {"type": "host-local", "ranges": [[{"subnet": "$POD_CIDR"}]], "routes": [{"dst": "0.0.0.0/0"}],
              "dataDir": "$STATE/cni/ipam"}}
  ]
}
EOF
}

# ---- identities ---------------------------------------------------------------------------

# A CA; the API server's serving certificate (for every name pods and this host use for it); the
# API server's client certificate towards kubelets (logs/exec/port-forward); the kubelet's serving
# certificate; the service-account signing key; static tokens for the other components.
make_pki() {
  [ -f "$PKI/tokens.csv" ] && return
  mkdir -p "$PKI" && chmod 700 "$PKI"
  local o=(-days 3650 -sha256)
  openssl req -x509 -newkey rsa:2048 -nodes -keyout "$PKI/ca.key" -out "$PKI/ca.crt" "${o[@]}" \
    -subj "/CN=inferencemesh-test-ca" 2>/dev/null
  sign_cert apiserver "/CN=kube-apiserver" \
    "subjectAltName=IP:$NODE_IP,IP:$KUBERNETES_SVC_IP,IP:127.0.0.1,DNS:localhost,DNS:kubernetes,DNS:kubernetes.default,DNS:kubernetes.default.svc,DNS:kubernetes.default.svc.$CLUSTER_DOMAIN"
  sign_cert apiserver-kubelet-client "/O=system:masters/CN=kube-apiserver-kubelet-client" "extendedKeyUsage=clientAuth"
  sign_cert kubelet "/CN=$NODE_NAME" "subjectAltName=IP:$NODE_IP,DNS:$NODE_NAME"
  openssl genrsa -out "$PKI/sa.key" 2048 2>/dev/null
  openssl rsa -in "$PKI/sa.key" -pubout -out "$PKI/sa.pub" 2>/dev/null
  # token,user,uid,"groups". The controller-manager runs all controllers under one identity
  # (--use-service-account-credentials=false), so it gets system:masters; the others use the
  # identities Kubernetes' default RBAC (and the Node authorizer) already grant what they need.
  {
    echo "$(token),admin,admin,\"system:masters\""
    echo "$(token),system:kube-controller-manager,kcm,\"system:masters\""
    echo "$(token),system:kube-scheduler,scheduler,"
    echo "$(token),system:kube-proxy,kube-proxy,"
    echo "$(token),system:node:$NODE_NAME,kubelet,\"system:nodes\""
  } > "$PKI/tokens.csv"
  say "made certificates and tokens in $PKI"
}

token() { openssl rand -hex 16; }

sign_cert() {  # NAME SUBJECT EXTENSION
  openssl req -newkey rsa:2048 -nodes -keyout "$PKI/$1.key" -out "$PKI/$1.csr" -subj "$2" 2>/dev/null
  openssl x509 -req -in "$PKI/$1.csr" -CA "$PKI/ca.crt" -CAkey "$PKI/ca.key" -CAcreateserial \
    -out "$PKI/$1.crt" -days 3650 -sha256 -extfile <(echo "$3") 2>/dev/null
  rm -f "$PKI/$1.csr"
}

write_kubeconfig() {  # FILE USER
  local tok
  tok=$(awk -F, -v u="$2" '$2 == u { print $1 }' "$PKI/tokens.csv")
  mkdir -p "$KCFG"
  cat > "$1" <<EOF
apiVersion: v1
kind: Config
clusters:
- name: imesh
  cluster: {server: "https://$NODE_IP:$API_PORT", certificate-authority: "$PKI/ca.crt"}
users:
- name: $2
  user: {token: "$tok"}
contexts:
- name: imesh
  context: {cluster: imesh, user: "$2"}
current-context: imesh
EOF
  chmod 600 "$1"
}

write_kubeconfigs() {
  write_kubeconfig "$KUBECONFIG_ADMIN" admin
  write_kubeconfig "$KCFG/controller-manager.kubeconfig" system:kube-controller-manager
  write_kubeconfig "$KCFG/scheduler.kubeconfig" system:kube-scheduler
  write_kubeconfig "$KCFG/kube-proxy.kubeconfig" system:kube-proxy
  write_kubeconfig "$KCFG/kubelet.kubeconfig" "system:node:$NODE_NAME"
}

# Create directories that components insist on outside $STATE, listing those that did not
# exist before in $STATE/made-dirs (down.sh removes exactly those).
note_made_dirs() {
  local d
  for d in "$@"; do
    [ -d "$d" ] && continue
    mkdir -p "$d" && echo "$d" >> "$STATE/made-dirs"
  done
}

# ---- control plane ------------------------------------------------------------------------

start_etcd() {
  daemon_alive etcd && return
  start_daemon etcd etcd --name imesh --data-dir "$STATE/etcd" \
    --listen-client-urls "http://127.0.0.1:$ETCD_PORT" --advertise-client-urls "http://127.0.0.1:$ETCD_PORT" \
    --listen-peer-urls "http://127.0.0.1:$ETCD_PEER_PORT" \
    --initial-advertise-peer-urls "http://127.0.0.1:$ETCD_PEER_PORT" \
    --initial-cluster "imesh=http://127.0.0.1:$ETCD_PEER_PORT" --quota-backend-bytes $((2 * 1024 ** 3))
}

start_apiserver() {
  daemon_alive kube-apiserver && return
  start_daemon kube-apiserver "$K8S_BIN/kube-apiserver" \
    --etcd-servers="http://127.0.0.1:$ETCD_PORT" \
    --bind-address="$NODE_IP" --advertise-address="$NODE_IP" --secure-port="$API_PORT" --insecure-port=0 \
    --tls-cert-file="$PKI/apiserver.crt" --tls-private-key-file="$PKI/apiserver.key" \
    --client-ca-file="$PKI/ca.crt" --token-auth-file="$PKI/tokens.csv" \
    --authorization-mode=Node,RBAC --enable-admission-plugins=NodeRestriction --allow-privileged=true \
    --service-cluster-ip-range="$SERVICE_CIDR" \
    --service-account-key-file="$PKI/sa.pub" --service-account-signing-key-file="$PKI/sa.key" \
    --service-account-issuer="https://kubernetes.default.svc.$CLUSTER_DOMAIN" \
    --kubelet-client-certificate="$PKI/apiserver-kubelet-client.crt" \
    --kubelet-client-key="$PKI/apiserver-kubelet-client.key" \
    --kubelet-preferred-address-types=InternalIP
  wait_until 120 "kube-apiserver /readyz" kc get --raw /readyz
}

start_controller_manager() {
  daemon_alive kube-controller-manager && return
  start_daemon kube-controller-manager "$K8S_BIN/kube-controller-manager" \
    --kubeconfig="$KCFG/controller-manager.kubeconfig" --leader-elect=false --port=0 --secure-port=0 \
    --service-account-private-key-file="$PKI/sa.key" --root-ca-file="$PKI/ca.crt" \
    --use-service-account-credentials=false --allocate-node-cidrs=false
}

start_scheduler() {
  daemon_alive kube-scheduler && return
  start_daemon kube-scheduler "$K8S_BIN/kube-scheduler" \
    --kubeconfig="$KCFG/scheduler.kubeconfig" --leader-elect=false --port=0 --secure-port=0
}

# ---- node ---------------------------------------------------------------------------------

start_containerd() {
  daemon_alive containerd && return
  install -m 0755 "$HERE/runc-oom-clamp" "$STATE/bin/runc-oom-clamp"
  # Fixed paths of containerd 1.6 outside its root/state: shim sockets (/run/containerd/s),
  # pod network namespaces (/run/netns), CNI result cache (/var/lib/cni).
  # (and containerd's CNI lock, /etc/cni/net.d/cni.lock, whatever conf_dir says).
  note_made_dirs /run/containerd /run/netns /var/lib/cni /etc/cni /etc/cni/net.d
  mkdir -p "$RUN/containerd" "$CONTAINERD_ROOT"
  # The CRI plugin: $SNAPSHOTTER (see lib.sh), our pause image as sandbox, runc through the
  # OOM-score clamp, CNI config and plugins from the places above.
  cat > "$STATE/containerd.toml" <<EOF
version = 2
root = "$CONTAINERD_ROOT"
state = "$RUN/containerd/state"
disabled_plugins = ["io.containerd.snapshotter.v1.aufs", "io.containerd.snapshotter.v1.btrfs",
                    "io.containerd.snapshotter.v1.zfs", "io.containerd.snapshotter.v1.devmapper"]
[grpc]
  address = "$CONTAINERD_SOCK"
[ttrpc]
  address = "$CONTAINERD_SOCK.ttrpc"
[plugins."io.containerd.internal.v1.opt"]
  path = "$STATE/containerd-opt"
[plugins."io.containerd.grpc.v1.cri"]
  sandbox_image = "$PAUSE_IMAGE"
  [plugins."io.containerd.grpc.v1.cri".containerd]
    snapshotter = "$SNAPSHOTTER"
    default_runtime_name = "runc"
    [plugins."io.containerd.grpc.v1.cri".containerd.runtimes.runc]
      runtime_type = "io.containerd.runc.v2"
      [plugins."io.containerd.grpc.v1.cri".containerd.runtimes.runc.options]
        BinaryName = "$STATE/bin/runc-oom-clamp"
        SystemdCgroup = false
  [plugins."io.containerd.grpc.v1.cri".cni]
    bin_dir = "/usr/lib/cni"
    conf_dir = "$STATE/cni/net.d"
EOF
  start_daemon containerd containerd --config "$STATE/containerd.toml"
  wait_until 60 "containerd" ctr --address "$CONTAINERD_SOCK" version
}

start_kubelet() {
  daemon_alive kubelet && return
  clear_stale_containers
  mkdir -p "$STATE/kubelet"
  : > "$STATE/kubelet/resolv.conf"   # pods get only the cluster DNS, none of the host's resolvers
  # kubelet 1.20 keeps container logs in /var/log/pods (+ links in /var/log/containers), whatever
  # its root dir: note which of them this cluster makes, so down.sh removes only those.
  note_made_dirs /var/log/pods /var/log/containers /var/lib/kubelet   # (+ its device-plugin socket)
  cat > "$STATE/kubelet/config.yaml" <<EOF
apiVersion: kubelet.config.k8s.io/v1beta1
kind: KubeletConfiguration
address: "$NODE_IP"
readOnlyPort: 0
healthzBindAddress: 127.0.0.1
tlsCertFile: "$PKI/kubelet.crt"
tlsPrivateKeyFile: "$PKI/kubelet.key"
authentication:
  anonymous: {enabled: false}
  webhook: {enabled: true}
  x509: {clientCAFile: "$PKI/ca.crt"}
authorization: {mode: Webhook}
cgroupDriver: cgroupfs
failSwapOn: false
clusterDNS: ["$DNS_IP"]
clusterDomain: "$CLUSTER_DOMAIN"
resolvConf: "$STATE/kubelet/resolv.conf"
serializeImagePulls: false
# Images exist only locally (imagePullPolicy: Never): never garbage-collect them for disk space.
imageGCHighThresholdPercent: 100
imageGCLowThresholdPercent: 99
evictionHard: {memory.available: "200Mi", nodefs.available: "2%", imagefs.available: "2%"}
EOF
  start_daemon kubelet "$K8S_BIN/kubelet" \
    --config="$STATE/kubelet/config.yaml" --kubeconfig="$KCFG/kubelet.kubeconfig" \
    --root-dir="$STATE/kubelet" --cert-dir="$STATE/kubelet/pki" \
    --container-runtime=remote --container-runtime-endpoint="unix://$CONTAINERD_SOCK" \
    --node-ip="$NODE_IP" --hostname-override="$NODE_NAME" --oom-score-adj=0
  wait_until 180 "node $NODE_NAME to be Ready" node_ready
}

# Containers left in containerd by a teardown that did not finish (kubelet 1.20 refuses to start
# when one's sandbox is gone: "no PodsandBox found with Id"). Removing them through ctr does not
# reach the CRI plugin's in-memory view, so containerd restarts afterwards.
clear_stale_containers() {
  [ -n "$(ctrk containers ls -q 2>/dev/null)" ] || return 0
  say "removing containers left by an unfinished teardown, then restarting containerd"
  remove_all_containers
  remove_netns
  kill -TERM "$(cat "$RUN/pids/containerd.pid")"
  wait_until 30 "containerd to stop" sh -c "! kill -0 $(cat "$RUN/pids/containerd.pid") 2>/dev/null"
  start_daemon containerd containerd --config "$STATE/containerd.toml"
  wait_until 60 "containerd" ctr --address "$CONTAINERD_SOCK" version
}

node_ready() {
  [ "$(kc get node "$NODE_NAME" -o jsonpath='{.status.conditions[?(@.type=="Ready")].status}' 2>/dev/null)" = True ]
}

# iptables mode, bound to the node address. Zero conntrack settings: leave the host's alone.
start_kube_proxy() {
  daemon_alive kube-proxy && return
  start_daemon kube-proxy "$K8S_BIN/kube-proxy" \
    --kubeconfig="$KCFG/kube-proxy.kubeconfig" --hostname-override="$NODE_NAME" \
    --bind-address="$NODE_IP" --healthz-bind-address="$NODE_IP:10256" --metrics-bind-address=127.0.0.1:10249 \
    --proxy-mode=iptables --cluster-cidr="$POD_CIDR" --oom-score-adj=0 \
    --conntrack-max-per-core=0 --conntrack-tcp-timeout-established=0 --conntrack-tcp-timeout-close-wait=0
  wait_until 60 "kube-proxy's rules for the kubernetes Service" \
    sh -c "iptables -w -t nat -S KUBE-SERVICES | grep -q '$KUBERNETES_SVC_IP/32'"
}

# The stand-in for CoreDNS (see dns_standin.sh).
start_dns() {
  mkdir -p "$STATE/dns"
  touch "$STATE/dns/hosts"
  if ! daemon_alive dnsmasq; then
    start_daemon dnsmasq dnsmasq --keep-in-foreground --conf-file=/dev/null --user=root \
      --listen-address="$DNS_IP" --bind-interfaces --port=53 --no-resolv --no-hosts \
      --addn-hosts="$STATE/dns/hosts" --local="/$CLUSTER_DOMAIN/" --local=/svc/ \
      --log-queries --log-facility="$LOGS/dnsmasq-queries.log"
  fi
  if ! daemon_alive dns-standin; then
    CLUSTER_DOMAIN=$CLUSTER_DOMAIN start_daemon dns-standin bash "$HERE/dns_standin.sh" \
      "$KUBECONFIG_ADMIN" "$STATE/dns/hosts" "$RUN/pids/dnsmasq.pid"
  fi
  wait_until 60 "the DNS stand-in to know kubernetes.default.svc" \
    grep -q "kubernetes.default.svc.$CLUSTER_DOMAIN" "$STATE/dns/hosts"
}

# ---- the rest -----------------------------------------------------------------------------

wait_for_cluster() {
  wait_until 120 "the default ServiceAccount (controller-manager working)" kc get serviceaccount default
}

print_exports() {
  cat <<EOF
export KUBECONFIG=$KUBECONFIG_ADMIN
export IMESH_E2E_OPERATOR_IMAGE=$OPERATOR_IMAGE
export IMESH_E2E_STAGE_IMAGE=$STAGE_IMAGE
export IMESH_E2E_FRONTEND_IMAGE=$FRONTEND_IMAGE
export IMESH_E2E_PULL_POLICY=Never
export IMESH_E2E_SERVER_SIDE=false
export IMESH_E2E_CONTAINERD_ADDRESS=$CONTAINERD_SOCK
EOF
}

main() {
  local t0 refs
  t0=$(date +%s)
  ensure_host
  refs=$(bash "$HERE/images.sh" build)        # before anything runs: the slow, cached part
  PAUSE_IMAGE=$(sed -n 's/^PAUSE=//p' <<<"$refs")
  OPERATOR_IMAGE=$(sed -n 's/^OPERATOR=//p' <<<"$refs")
  STAGE_IMAGE=$(sed -n 's/^STAGE=//p' <<<"$refs")
  FRONTEND_IMAGE=$(sed -n 's/^FRONTEND=//p' <<<"$refs")
  save_sysctls
  setup_node_network
  write_cni_config
  make_pki
  write_kubeconfigs
  start_etcd
  start_apiserver
  start_controller_manager
  start_scheduler
  start_containerd
  bash "$HERE/images.sh" import "$PAUSE_IMAGE" "$OPERATOR_IMAGE" "$STAGE_IMAGE" "$FRONTEND_IMAGE"
  start_kubelet
  start_kube_proxy
  start_dns
  wait_for_cluster
  say "cluster up in $(( $(date +%s) - t0 ))s: kubectl --kubeconfig $KUBECONFIG_ADMIN get nodes"
  print_exports
}

# Run, not sourced (tests/test_cluster_tools.py sources the functions).
if [ "${BASH_SOURCE[0]}" = "$0" ]; then main "$@"; fi
