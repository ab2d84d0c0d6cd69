#!/usr/bin/env bash
# Tear down what tools/cluster/up.sh started, and leave nothing running: processes, containers,
# mounts, network namespaces, iptables rules, bridges, kernel settings, cgroups and the cluster's
# state directory. Safe to run twice, and after a half-finished up.sh.
#
# Kept (the caches, see lib.sh): Kubernetes binaries, the base image, buildah's and containerd's
# image stores under /var/cache/inferencemesh, so the next up.sh starts fast.
set -uo pipefail
source "$(dirname "$0")/lib.sh"

stop_daemon() {  # NAME: TERM, up to 20 s, then KILL - only the pid up.sh recorded
  local f="$RUN/pids/$1.pid" pid i
  [ -f "$f" ] || return 0
  pid=$(cat "$f")
  if kill -0 "$pid" 2>/dev/null; then
    say "stopping $1 (pid $pid)"
    kill -TERM "$pid" 2>/dev/null
    for i in $(seq 1 40); do kill -0 "$pid" 2>/dev/null || break; sleep 0.5; done
    kill -0 "$pid" 2>/dev/null && kill -KILL "$pid" 2>/dev/null
  fi
  rm -f "$f"
}

containerd_alive() { [ -S "$CONTAINERD_SOCK" ] && ctr --address "$CONTAINERD_SOCK" version >/dev/null 2>&1; }

# Every pod container and sandbox (lib.sh): kubelet is already stopped, so nothing restarts them.
# This is what CRI's StopPodSandbox/RemovePodSandbox would do, minus CNI DEL, whose only state -
# the bridge and the address files - goes below anyway.
remove_pod_containers() {
  containerd_alive || return 0
  remove_all_containers
  say "removed pod containers (${#NETNS_PATHS[@]} network namespaces)"
}

# Whatever still runs in the pods' cgroups (e.g. containerd died before its tasks): SIGKILL by pid.
kill_pod_processes() {
  local procs pid
  for procs in $(find /sys/fs/cgroup/*/kubepods -name cgroup.procs 2>/dev/null); do
    for pid in $(cat "$procs" 2>/dev/null); do kill -KILL "$pid" 2>/dev/null; done
  done
}

# containerd-shim processes of our containerd (their command line names our socket).
kill_leftover_shims() {
  local dir pid
  for dir in /proc/[0-9]*; do
    pid=${dir#/proc/}
    if tr '\0' ' ' < "$dir/cmdline" 2>/dev/null | grep -q -- "-address $CONTAINERD_SOCK"; then
      say "killing leftover shim $pid"; kill -KILL "$pid" 2>/dev/null
    fi
  done
}

# Mounts under the cluster's directories (kubelet's volumes, container rootfs, snapshots),
# deepest first.
unmount_all() {
  local mp
  for mp in $(awk '{print $5}' /proc/self/mountinfo | grep -E "^($STATE|$RUN|$CONTAINERD_ROOT)(/|$)" | sort -r); do
    umount "$mp" 2>/dev/null || umount -l "$mp" 2>/dev/null || say "could not unmount $mp"
  done
}

remove_cgroups() {
  local top
  for top in /sys/fs/cgroup/*/kubepods; do
    [ -d "$top" ] || continue
    find "$top" -depth -type d -exec rmdir {} + 2>/dev/null
    [ -d "$top" ] && say "could not remove cgroup $top"
  done
}

# iptables chains of kubelet and kube-proxy (KUBE-*), CNI (CNI-*) and up.sh (IMESH-*), in every
# table of both families: first the jumps from the built-in chains, then the chains themselves.
clean_iptables() {
  local cmd table rule chain
  [ -f "$K8S_BIN/kube-proxy" ] && "$K8S_BIN/kube-proxy" --cleanup >/dev/null 2>&1
  for cmd in iptables ip6tables; do
    for table in filter nat mangle raw; do
      "$cmd" -w -t "$table" -S >/dev/null 2>&1 || continue
      "$cmd" -w -t "$table" -S | grep -E -- '^-A [A-Z]+ .*-j (KUBE-|CNI-|IMESH-)' \
        | grep -Ev '^-A (KUBE-|CNI-|IMESH-)' | while read -r rule; do
        # shellcheck disable=SC2086
        eval "$cmd -w -t $table -D ${rule#-A }"
      done
      for chain in $("$cmd" -w -t "$table" -S | awk '/^-N (KUBE-|CNI-|IMESH-)/ {print $2}'); do
        "$cmd" -w -t "$table" -F "$chain"
      done
      for chain in $("$cmd" -w -t "$table" -S | awk '/^-N (KUBE-|CNI-|IMESH-)/ {print $2}'); do
        "$cmd" -w -t "$table" -X "$chain"
      done
    done
  done
}

remove_links() {
  local link
  for link in "$POD_BRIDGE" "$NODE_BRIDGE"; do
    ip link show "$link" >/dev/null 2>&1 && ip link del "$link"
  done
}

restore_sysctls() {
  [ -f "$STATE/sysctl.saved" ] || return 0
  sysctl -q -p "$STATE/sysctl.saved" >/dev/null 2>&1 || say "some kernel settings could not be restored"
  say "restored kernel settings from $STATE/sysctl.saved"
}

remove_files() {
  local d
  if [ -f "$STATE/made-dirs" ]; then
    while read -r d; do rm -rf --one-file-system "$d"; done < "$STATE/made-dirs"
  fi
  rm -rf "$STATE" "$RUN"
}

main() {
  [ "$(id -u)" = 0 ] || die "run as root"
  stop_daemon dns-standin
  stop_daemon dnsmasq
  stop_daemon kube-proxy
  stop_daemon kubelet
  remove_pod_containers
  stop_daemon containerd
  kill_leftover_shims
  kill_pod_processes
  stop_daemon kube-scheduler
  stop_daemon kube-controller-manager
  stop_daemon kube-apiserver
  stop_daemon etcd
  remove_netns
  unmount_all
  remove_cgroups
  clean_iptables
  remove_links
  restore_sysctls
  remove_files
  say "cluster down (caches kept in $IMESH_CACHE)"
}

main "$@"
