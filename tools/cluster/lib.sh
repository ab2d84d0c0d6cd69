# shellcheck shell=bash
# Shared settings and helpers of tools/cluster/*.sh (sourced, not run).
#
# Three places on disk, by lifetime:
#   $IMESH_CACHE  survives down.sh: Kubernetes binaries, the base image tarball, buildah's image
#                 store, containerd's image store, the pause binary. Keyed by content hashes.
#   $STATE        one cluster's data (etcd, certificates, kubeconfigs, kubelet, logs); down.sh
#                 deletes it, so every up.sh after a down.sh starts a fresh cluster.
#   $RUN          pid files and sockets (tmpfs-like, also deleted by down.sh).

IMESH_CACHE="${IMESH_CACHE:-/var/cache/inferencemesh}"
STATE="${IMESH_CLUSTER_STATE:-/var/lib/inferencemesh-cluster}"
RUN="${IMESH_CLUSTER_RUN:-/run/inferencemesh-cluster}"
K8S_BIN="$IMESH_CACHE/k8s/bin"
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
REPO="$(cd "$HERE/../.." && pwd)"

# Addresses. The node gets a bridge address (these VMs have no dummy interfaces): kubelet refuses
# a loopback node IP, and `kubectl logs/exec/port-forward` go from the API server to that address.
NODE_NAME=imesh-node
NODE_BRIDGE=imesh0
NODE_IP=10.250.0.1
POD_BRIDGE=imesh-cni0
POD_CIDR=10.244.0.0/24
SERVICE_CIDR=10.96.0.0/24
KUBERNETES_SVC_IP=10.96.0.1
CLUSTER_DOMAIN=cluster.local
DNS_IP="$NODE_IP"      # the CoreDNS stand-in (dnsmasq) listens on the node address
API_PORT=6443
# The cluster's address ranges, unreachable beyond this machine (up.sh adds the routes, down.sh
# removes them): traffic to an address of theirs that nothing here holds (a deleted Service's
# ClusterIP, a pod that is gone) fails here instead of leaving through the default route. The
# metric keeps the pod bridge's own route for POD_CIDR (metric 0) first while the bridge exists.
CLUSTER_CIDRS=("$SERVICE_CIDR" "$POD_CIDR")
UNREACHABLE_METRIC=4242
# What else up.sh (and tools/k8s/ensure_binaries.sh, which it runs) leaves outside $STATE and the caches.
APT_SOURCE=/etc/apt/sources.list.d/inferencemesh-bookworm-src.sources
CNI_LOCK=/etc/cni/net.d/cni.lock
LEGACY_TABLES_4=/proc/net/ip_tables_names
LEGACY_TABLES_6=/proc/net/ip6_tables_names
ETCD_PORT=12379        # not etcd's default 2379: tests/operator start their own etcd on loopback
ETCD_PEER_PORT=12380

CONTAINERD_SOCK="$RUN/containerd/containerd.sock"
# The containerd snapshotter. overlayfs creates a container in about a second; native (the one
# verified in BRIEF §5) copies the whole 1.6 GB image for every container, 30-100 s each on 2 busy
# cores. overlayfs where a probe mount works (a kernel or a nested container may not allow it),
# else native; IMESH_CLUSTER_SNAPSHOTTER overrides. Each snapshotter keeps its own image store.
overlay_mount_works() {
  local d ok=1
  d=$(mktemp -d /var/tmp/imesh-overlay-probe.XXXXXX) || return 1
  mkdir -p "$d/lower" "$d/upper" "$d/work" "$d/merged"
  if mount -t overlay overlay -o "lowerdir=$d/lower,upperdir=$d/upper,workdir=$d/work" "$d/merged" 2>/dev/null; then
    umount "$d/merged" && ok=0
  fi
  rm -rf "$d"
  return $ok
}
if [ -n "${IMESH_CLUSTER_SNAPSHOTTER:-}" ]; then
  SNAPSHOTTER=$IMESH_CLUSTER_SNAPSHOTTER
elif overlay_mount_works; then
  SNAPSHOTTER=overlayfs
else
  SNAPSHOTTER=native
fi
CONTAINERD_ROOT="$IMESH_CACHE/containerd-$SNAPSHOTTER"   # image store kept across down.sh
BUILDAH_ROOT="$IMESH_CACHE/buildah/storage"   # buildah's vfs image store, the build cache
BUILDAH_RUNROOT="$RUN/buildah"
KUBECONFIG_ADMIN="$STATE/kubeconfig/admin.kubeconfig"
LOGS="$STATE/logs"

say() { echo "[imesh-cluster] $*" >&2; }
die() { say "ERROR: $*"; exit 1; }

# buildah with our own store: vfs (no overlay here; the environment variable is ignored, so the
# flag goes on every call) and a root that down.sh never touches.
bah() { buildah --storage-driver vfs --root "$BUILDAH_ROOT" --runroot "$BUILDAH_RUNROOT" "$@"; }

# ctr against our containerd, in the namespace the CRI plugin uses, unpacking with the snapshotter
# the CRI plugin uses.
ctrk() { CONTAINERD_SNAPSHOTTER=$SNAPSHOTTER ctr --address "$CONTAINERD_SOCK" -n k8s.io "$@"; }

kc() { kubectl --kubeconfig "$KUBECONFIG_ADMIN" "$@"; }

# apt-get install of whatever in "$@" is missing (one `apt-get update` per run at most).
_apt_updated=0
ensure_packages() {
  local missing=() p
  for p in "$@"; do
    dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q 'install ok installed' || missing+=("$p")
  done
  [ ${#missing[@]} -eq 0 ] && return 0
  if [ "$_apt_updated" = 0 ]; then say "apt-get update"; apt-get update -qq >&2; _apt_updated=1; fi
  say "apt-get install ${missing[*]}"
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${missing[@]}" >&2
}

# sha256 of the named files and of every file under the named directories (path + content),
# without Python byte code; stable across machines and checkouts.
tree_hash() {
  (cd "$REPO" && find "$@" -type f ! -name '*.pyc' ! -path '*/__pycache__/*' ! -path '*.egg-info/*' -print0 \
     | LC_ALL=C sort -z | xargs -0 sha256sum) | sha256sum | cut -c1-16
}

# Start a daemon in its own session, output to $LOGS/NAME.log, pid in $RUN/pids/NAME.pid.
# down.sh stops exactly these pids.
start_daemon() {
  local name=$1; shift
  mkdir -p "$LOGS" "$RUN/pids"
  setsid "$@" >>"$LOGS/$name.log" 2>&1 < /dev/null &
  echo $! > "$RUN/pids/$name.pid"
  say "started $name (pid $!, log $LOGS/$name.log)"
}

daemon_alive() {
  local f="$RUN/pids/$1.pid"
  [ -f "$f" ] && kill -0 "$(cat "$f")" 2>/dev/null
}

# wait_until SECONDS WHAT COMMAND...: poll COMMAND every second.
wait_until() {
  local limit=$1 what=$2; shift 2
  local deadline=$(( $(date +%s) + limit ))
  until "$@" >/dev/null 2>&1; do
    if [ "$(date +%s)" -ge "$deadline" ]; then die "timed out after ${limit}s waiting for $what"; fi
    sleep 1
  done
}

# Remove every container of the CRI namespace, application containers before their sandboxes,
# remembering the sandboxes' network namespaces in NETNS_PATHS. Images stay. Used by down.sh (and
# by up.sh before a kubelet starts: kubelet 1.20 refuses to start when containerd still holds a
# container whose sandbox is gone, "no PodsandBox found with Id").
NETNS_PATHS=()
remove_all_containers() {
  local attempt id info ns ids
  for attempt in 1 2 3; do
    ids=$(ctrk containers ls -q 2>/dev/null) || return 0
    [ -n "$ids" ] || return 0
    for id in $ids; do
      info=$(ctrk containers info "$id" 2>/dev/null) || continue
      ns=$(jq -r '.Spec.linux.namespaces[]? | select(.type == "network") | .path // empty' <<<"$info")
      [ -n "$ns" ] && NETNS_PATHS+=("$ns")
      ctrk tasks kill -s SIGKILL "$id" >/dev/null 2>&1
    done
    sleep 1
    # Application containers first (their label says "container"), then the sandboxes.
    for id in $(for id in $ids; do
                  kind=$(ctrk containers info "$id" 2>/dev/null | jq -r '.Labels["io.cri-containerd.kind"] // ""')
                  [ "$kind" = sandbox ] && echo "1 $id" || echo "0 $id"
                done | sort | cut -d' ' -f2); do
      ctrk tasks delete -f "$id" >/dev/null 2>&1
      ctrk containers delete "$id" >/dev/null 2>&1 || ctrk containers delete --keep-snapshot "$id" >/dev/null 2>&1
    done
  done
  ids=$(ctrk containers ls -q 2>/dev/null)
  [ -z "$ids" ] || say "WARNING: containers left in containerd: $ids"
}

# The network namespaces (bind mounts under /run/netns) of the sandboxes removed above.
remove_netns() {
  local ns
  for ns in "${NETNS_PATHS[@]}"; do
    [ -e "$ns" ] || continue
    umount "$ns" 2>/dev/null; rm -f "$ns"
  done
}

# ---- the cluster's ranges: unreachable beyond this machine ----------------------------------
# Pods reach a live ClusterIP as before (kube-proxy's DNAT happens before their packets are
# routed); this machine's own connections are routed before that DNAT, so it reaches the cluster
# through port-forward, the API server's proxy or pod IPs, never a ClusterIP.

add_unreachable_routes() {
  local cidr
  for cidr in "${CLUSTER_CIDRS[@]}"; do
    ip route replace unreachable "$cidr" metric "$UNREACHABLE_METRIC"
  done
}

remove_unreachable_routes() {
  local cidr
  for cidr in "${CLUSTER_CIDRS[@]}"; do
    while ip route del unreachable "$cidr" metric "$UNREACHABLE_METRIC" 2>/dev/null; do :; done
  done
}

# The ranges whose unreachable route is missing, one a line (nothing: all there).
missing_unreachable_routes() {
  local cidr
  for cidr in "${CLUSTER_CIDRS[@]}"; do
    ip route show type unreachable "$cidr" 2>/dev/null | grep -qw "metric $UNREACHABLE_METRIC" || echo "$cidr"
  done
}
