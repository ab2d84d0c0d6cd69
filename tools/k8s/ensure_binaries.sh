#!/usr/bin/env bash
# Make a real Kubernetes control plane available for the operator tests (BRIEF §5 steps 1-2):
#   etcd            <- Debian package etcd-server (3.4)
#   kube-apiserver, kube-controller-manager 1.20.2
#                   <- built from Debian bookworm's `kubernetes` source package (ships vendor/),
#                      with the vendored modern-go/reflect2 v1.0.1 (segfaults on Go >= 1.18)
#                      replaced by Debian's golang-github-modern-go-reflect2-dev 1.0.2.
# Binaries are cached under $IMESH_K8S_CACHE (default /var/cache/inferencemesh/k8s); a second run
# with the cache present does nothing. Non-interactive, idempotent, prints every step.
set -euo pipefail

CACHE="${IMESH_K8S_CACHE:-/var/cache/inferencemesh/k8s}"
BIN="$CACHE/bin"
WORK="$CACHE/build"
WANT=(kube-apiserver kube-controller-manager kube-scheduler kubelet kube-proxy)
export DEBIAN_FRONTEND=noninteractive

say() { echo "[ensure_binaries] $*"; }
SUDO=""
if [ "$(id -u)" != 0 ]; then SUDO="sudo -n"; fi

apt_updated=0
apt_install() {
  if [ "$apt_updated" = 0 ]; then say "apt-get update"; $SUDO apt-get update -qq; apt_updated=1; fi
  say "apt-get install $*"
  $SUDO apt-get install -y -qq --no-install-recommends "$@" >/dev/null
}

# 1. etcd
if ! command -v etcd >/dev/null 2>&1; then
  apt_install etcd-server
  # Debian starts an etcd service on install where systemd runs; the tests start their own.
fi
say "etcd: $(command -v etcd)"

# kubectl is needed by the tests too; Debian's kubernetes-client if the machine has none.
if ! command -v kubectl >/dev/null 2>&1; then apt_install kubernetes-client; fi
say "kubectl: $(command -v kubectl)"

have_all=1
for b in "${WANT[@]}"; do [ -x "$BIN/$b" ] || have_all=0; done
if [ "$have_all" = 1 ]; then
  say "cached: $BIN/{${WANT[*]// /,}} ($("$BIN/kube-apiserver" --version 2>/dev/null))"
  exit 0
fi

# 2. kube-apiserver + kube-controller-manager from source.
start=$(date +%s)
$SUDO mkdir -p "$CACHE"
$SUDO chown "$(id -u):$(id -g)" "$CACHE"
mkdir -p "$BIN" "$WORK"

SRCLIST=/etc/apt/sources.list.d/inferencemesh-bookworm-src.sources
if ! grep -rqs '^Types:.*deb-src' /etc/apt/sources.list.d/ && ! grep -qs '^deb-src .*bookworm' /etc/apt/sources.list; then
  # The mirror is the one this machine's apt configuration already uses for bookworm main
  # (a user behind a mirror has another): never a hard-coded URL.
  say "adding deb-src for bookworm main: $SRCLIST"
  python3 "$(dirname "$0")/../cluster/apt_sources.py" --deb-src bookworm | $SUDO tee "$SRCLIST" >/dev/null
  apt_updated=0
fi
apt_install golang-go rsync make dpkg-dev golang-github-modern-go-reflect2-dev

SRC=$(find "$WORK" -maxdepth 1 -type d -name 'kubernetes-1.20*' | head -n1)
if [ -z "$SRC" ]; then
  if [ "$apt_updated" = 0 ]; then say "apt-get update"; $SUDO apt-get update -qq; apt_updated=1; fi
  say "apt-get source kubernetes (into $WORK)"
  (cd "$WORK" && apt-get source -qq kubernetes >/dev/null)
  SRC=$(find "$WORK" -maxdepth 1 -type d -name 'kubernetes-1.20*' | head -n1)
fi
[ -n "$SRC" ] || { say "ERROR: no kubernetes-1.20* source tree under $WORK"; exit 1; }
say "source tree: $SRC"

R2=/usr/share/gocode/src/github.com/modern-go/reflect2
say "replacing vendor/github.com/modern-go/reflect2 with $R2 (Debian 1.0.2)"
rsync -a --delete --exclude '*_test.go' "$R2/" "$SRC/vendor/github.com/modern-go/reflect2/"

mkdir -p "$SRC/.go/src/k8s.io"
ln -sfn "$SRC" "$SRC/.go/src/k8s.io/kubernetes"
say "go version: $(go version)"
say "make WHAT=\"${WANT[*]/#/cmd/}\" (several minutes)"
(
  cd "$SRC/.go/src/k8s.io/kubernetes"
  export GOPATH="$SRC/.go" CGO_ENABLED=0 GO111MODULE=off GOFLAGS=-mod=vendor GOCACHE="$WORK/gocache"
  # KUBE_GIT_VERSION keeps hack/lib/version.sh from asking git (the source package has no .git).
  export KUBE_GIT_VERSION="v1.20.2" KUBE_GIT_TREE_STATE=clean
  make WHAT="${WANT[*]/#/cmd/}"
)
for b in "${WANT[@]}"; do
  found=$(find "$SRC/_output" -type f -name "$b" -perm -u+x | head -n1)
  [ -n "$found" ] || { say "ERROR: build produced no $b"; exit 1; }
  install -m 0755 "$found" "$BIN/$b"
done
say "built in $(( $(date +%s) - start ))s: $("$BIN/kube-apiserver" --version)"
# The source tree and Go cache are large; keep only the binaries.
if [ "${IMESH_K8S_KEEP_BUILD:-0}" != 1 ]; then rm -rf "$WORK"; fi
say "cached under $BIN"
