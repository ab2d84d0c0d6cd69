#!/usr/bin/env bash
# Build the cluster's images with buildah from the repository's own Dockerfiles and import them
# into the cluster's containerd (pods use them with imagePullPolicy: Never):
#   pause     tools/cluster/pause/pause.go, a static binary in an image of its own (sandbox_image)
#   operator  Dockerfile --target operator on the base image of base_image.sh
#   stage     Dockerfile --target stage    on the same base
#   frontend  Dockerfile --target frontend on the same base
# (the Dockerfile's three base arguments all name that one base; its NATIVE_BASE_IMAGE, where the
# native CPU kernels are compiled, is base_image.sh native-build's).
# The build context is a snapshot of what the Dockerfiles copy, taken once, so a tree being
# edited meanwhile cannot mix two versions into one image; each tag is a hash of that snapshot
# (plus the base and the role), so an unchanged tree rebuilds nothing.
#   bash tools/cluster/images.sh build          build what is missing; prints ROLE=IMAGE lines
#   bash tools/cluster/images.sh import REF...  put those images into the cluster's containerd
set -euo pipefail
source "$(dirname "$0")/lib.sh"

# What the Dockerfile copies (keep in step with .dockerignore), and the Dockerfile.
CONTEXT_INPUTS=(pyproject.toml README.md src Dockerfile .dockerignore)

# Copy the build inputs into a fresh directory (without byte code), print its path.
snapshot_context() {
  local ctx
  mkdir -p "$IMESH_CACHE/tmp"
  ctx=$(mktemp -d "$IMESH_CACHE/tmp/context-XXXXXX")
  (cd "$REPO" && tar --exclude=__pycache__ --exclude='*.pyc' --exclude='*.egg-info' -cf - "${CONTEXT_INPUTS[@]}") \
    | tar -C "$ctx" -xf -
  echo "$ctx"
}

pause_ref() { echo "localhost/inferencemesh/pause:$(tree_hash tools/cluster/pause)"; }

role_ref() {  # ROLE "BASE NATIVE_BUILD" CONTEXT -> localhost/inferencemesh/ROLE:<hash>
  local hash
  hash=$( { echo "$1 $2"; cd "$3" && find . -type f -print0 | LC_ALL=C sort -z \
            | xargs -0 sha256sum; } | sha256sum | cut -c1-16)
  echo "localhost/inferencemesh/$1:$hash"
}

in_buildah() { bah inspect --type image "$1" >/dev/null 2>&1; }

build_pause() {
  local ref=$1 dir ctr
  in_buildah "$ref" && { say "cached: $ref"; return; }
  ensure_packages golang-go
  dir=$(mktemp -d)
  CGO_ENABLED=0 GO111MODULE=off GOCACHE="$IMESH_CACHE/gocache" \
    go build -trimpath -ldflags '-s -w' -o "$dir/pause" "$HERE/pause/pause.go"
  ctr=$(bah from scratch)
  bah copy --chmod 0755 "$ctr" "$dir/pause" /pause >/dev/null
  bah config --entrypoint '["/pause"]' --user 65535:65535 "$ctr"
  bah commit --quiet --rm "$ctr" "$ref" >/dev/null
  rm -rf "$dir"
  say "built $ref"
}

# buildah bud of one role. --isolation chroot: the default (crun) fails on these hybrid-cgroup
# VMs. chroot isolation runs RUN steps in buildah's own network namespace, so buildah runs in a
# fresh one with no interface but lo (unshare --net): proof that the Dockerfile builds offline on
# the prepared base. --pull=false: the base exists only in the local store.
build_role() {
  local role=$1 base=$2 native=$3 ref=$4 ctx=$5 t0
  in_buildah "$ref" && { say "cached: $ref"; return; }
  t0=$(date +%s)
  say "building $ref (Dockerfile --target $role)"
  (cd "$ctx" && unshare --net -- buildah --storage-driver vfs --root "$BUILDAH_ROOT" --runroot "$BUILDAH_RUNROOT" \
     bud --quiet --isolation chroot --pull=false \
     --build-arg BASE_IMAGE="$base" --build-arg OPERATOR_BASE_IMAGE="$base" --build-arg WHEEL_BASE_IMAGE="$base" \
     --build-arg NATIVE_BASE_IMAGE="$native" \
     --target "$role" -f Dockerfile -t "$ref" . >&2)
  say "built $ref in $(( $(date +%s) - t0 ))s"
}

in_containerd() { local all; all=$(ctrk images ls -q 2>/dev/null) && grep -qxF "$1" <<<"$all"; }

# buildah -> OCI archive -> containerd (unpacked with the snapshotter the CRI plugin uses).
import_ref() {
  local ref=$1 tar t0
  in_containerd "$ref" && { say "already in containerd: $ref"; return; }
  t0=$(date +%s)
  tar=$(mktemp -u "$IMESH_CACHE/import-XXXXXX.tar")
  bah push --quiet "$ref" "oci-archive:$tar:$ref" >&2
  ctrk images import "$tar" >&2
  rm -f "$tar"
  in_containerd "$ref" || die "ctr import did not register $ref"
  say "imported $ref into containerd in $(( $(date +%s) - t0 ))s"
}

# Drop older tags of our images (each content change makes a new one; vfs layers are big).
prune_buildah() {
  local keep=" $* " name
  for name in $(bah images --format '{{.Name}}:{{.Tag}}' 2>/dev/null | grep '^localhost/inferencemesh/' || true); do
    [[ "$keep" == *" $name "* ]] || { say "removing old $name from buildah"; bah rmi "$name" >/dev/null || true; }
  done
}

# Old tags, and the image-ID references (sha256:...) the CRI plugin keeps beside each name, whose
# image has no kept name any more; then containerd's garbage collector drops their content.
prune_containerd() {
  local keep=" $* " name digest kept_digests
  for name in $(ctrk images ls -q 2>/dev/null | grep '^localhost/inferencemesh/' || true); do
    [[ "$keep" == *" $name "* ]] || { say "removing old $name from containerd"; ctrk images rm "$name" >/dev/null || true; }
  done
  kept_digests=$(ctrk images ls 2>/dev/null | awk '$1 !~ /^sha256:/ {print $3}')
  ctrk images ls 2>/dev/null | awk '$1 ~ /^sha256:/ {print $1, $3}' | while read -r name digest; do
    grep -qxF "$digest" <<<"$kept_digests" || ctrk images rm "$name" >/dev/null || true
  done
}

build_all() {
  local base native ctx refs=() role
  base=$(bash "$HERE/base_image.sh")
  native=$(bash "$HERE/base_image.sh" native-build)
  ctx=$(snapshot_context)
  refs+=("$(pause_ref)")
  for role in operator stage frontend; do refs+=("$(role_ref "$role" "$base $native" "$ctx")"); done
  build_pause "${refs[0]}"
  build_role operator "$base" "$native" "${refs[1]}" "$ctx"
  build_role stage "$base" "$native" "${refs[2]}" "$ctx"
  build_role frontend "$base" "$native" "${refs[3]}" "$ctx"
  rm -rf "$ctx"
  prune_buildah "$base" "$native" "${refs[@]}"
  printf 'BASE=%s\nPAUSE=%s\nOPERATOR=%s\nSTAGE=%s\nFRONTEND=%s\n' "$base" "${refs[@]}"
}

import_all() {
  local ref
  for ref in "$@"; do import_ref "$ref"; done
  prune_containerd "$@"
}

main() {
  ensure_packages buildah
  case "${1:-}" in
    build) build_all ;;
    import) shift; import_all "$@" ;;
    *) die "usage: images.sh build | images.sh import REF..." ;;
  esac
}

main "$@"
