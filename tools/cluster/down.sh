#!/usr/bin/env bash
# Tear down what tools/cluster/up.sh started, and leave nothing running: processes, containers,
# mounts, network namespaces, iptables rules, bridges, kernel settings, cgroups and the cluster's
# state directory. Safe to run twice, and after a half-finished up.sh.
#
# Kept (the caches, see lib.sh): Kubernetes binaries, the base image, buildah's and containerd's
# image stores under /var/cache/inferencemesh, so the next up.sh starts fast.
set -uo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/lib.sh"

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

# The tables to clean with CMD: every one, except that a legacy (x_tables) command only gets the
# tables already loaded (asking it for another would load it, and so create it).
tables_of() {  # CMD
  case $1 in
    iptables-legacy) cat "$LEGACY_TABLES_4" 2>/dev/null ;;
    ip6tables-legacy) cat "$LEGACY_TABLES_6" 2>/dev/null ;;
    *) echo filter nat mangle raw ;;
  esac
}

# iptables chains of kubelet and kube-proxy (KUBE-*), CNI (CNI-*) and up.sh (IMESH-*), in every
# table of both families, nftables and legacy: first the jumps from the built-in chains, then the
# chains themselves.
clean_iptables() {
  local cmd table rule chain
  [ -f "$K8S_BIN/kube-proxy" ] && "$K8S_BIN/kube-proxy" --cleanup >/dev/null 2>&1
  for cmd in iptables ip6tables iptables-legacy ip6tables-legacy; do
    command -v "$cmd" >/dev/null 2>&1 || continue
    for table in $(tables_of "$cmd"); do
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

# Legacy (x_tables) tables left empty: while one exists, iptables-nft warns on every listing
# ("iptables-legacy tables present"). Unloading an empty table's module removes it (its next user
# loads it again); a table with a rule, a chain of its own or a policy other than ACCEPT is kept.
unload_empty_legacy_tables() {
  local family cmd names module table
  for family in 4 6; do
    if [ "$family" = 4 ]; then cmd=iptables-legacy names=$LEGACY_TABLES_4 module=iptable_
    else cmd=ip6tables-legacy names=$LEGACY_TABLES_6 module=ip6table_; fi
    [ -r "$names" ] && command -v "$cmd" >/dev/null 2>&1 || continue
    for table in $(cat "$names"); do
      legacy_table_empty "$cmd" "$table" || continue
      modprobe -r "$module$table" 2>/dev/null || rmmod "$module$table" 2>/dev/null \
        || say "could not unload the empty legacy table $table (IPv$family): iptables will warn about it"
    done
  done
}

legacy_table_empty() {  # CMD TABLE: its built-in chains only, each with policy ACCEPT and no rule
  local rules
  rules=$("$1" -w -t "$2" -S 2>/dev/null) || return 1
  ! grep -qvE '^-P [A-Z]+ ACCEPT$' <<<"$rules"
}

# The deb-src entry tools/k8s/ensure_binaries.sh adds to build Kubernetes (the binaries are cached;
# a rebuild adds it again), and containerd's CNI lock (its directory, where up.sh made it, goes
# with the made directories).
remove_host_files() {
  local f
  for f in "$APT_SOURCE" "$CNI_LOCK"; do
    [ -e "$f" ] || continue
    rm -f "$f" && say "removed $f"
  done
}

# What down.sh removes that is still there, one a line (nothing: all gone).
leftovers() {
  local link cidr f
  for cidr in "${CLUSTER_CIDRS[@]}"; do
    ip route show type unreachable "$cidr" 2>/dev/null | grep -qw "metric $UNREACHABLE_METRIC" \
      && echo "route: unreachable $cidr"
  done
  for link in "$POD_BRIDGE" "$NODE_BRIDGE"; do
    ip link show "$link" >/dev/null 2>&1 && echo "link: $link"
  done
  for f in "$APT_SOURCE" "$CNI_LOCK" "$STATE" "$RUN"; do
    [ -e "$f" ] && echo "file: $f"
  done
  return 0
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
  unload_empty_legacy_tables
  remove_unreachable_routes
  remove_links
  restore_sysctls
  remove_files
  remove_host_files
  local left
  left=$(leftovers)
  if [ -n "$left" ]; then
    say "WARNING: still there after the teardown:"; say "$left"; return 1
  fi
  say "cluster down (caches kept in $IMESH_CACHE)"
}

# Run, not sourced (tests/test_cluster_tools.py sources the functions).
if [ "${BASH_SOURCE[0]}" = "$0" ]; then main "$@"; fi
