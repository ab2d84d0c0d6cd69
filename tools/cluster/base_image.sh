#!/usr/bin/env bash
# The base image all three Dockerfiles build on here (their BASE_IMAGE), made without a registry:
#   Debian (the release this machine runs) from this machine's apt mirrors via mmdebstrap, with
#   python3, python3-venv, python-is-python3, ca-certificates, passwd (useradd), and a venv
#   /opt/venv (first on PATH) holding the project's dependencies, the CPU torch wheel, a
#   setuptools new enough to build the project without an index, and the operator's pins.
# Packages come from this machine's pip configuration (local wheel directories and simple indexes,
# bind-mounted read-only into the chroot at the same paths; see pip_sources.py).
#
# With `native-build`, the Dockerfiles' NATIVE_BASE_IMAGE instead: the same Debian with a C compiler
# and Python (no venv), where the images' native CPU kernels are compiled ahead of time.
#
# Cached twice, keyed by a hash of what goes in: the rootfs tarball under $IMESH_CACHE/base/ and the
# image localhost/inferencemesh/base:<hash> (native-build:<hash>) in buildah's store. Prints the
# image name on stdout.
#   bash tools/cluster/base_image.sh                -> localhost/inferencemesh/base:0123abcd...
#   bash tools/cluster/base_image.sh native-build   -> localhost/inferencemesh/native-build:4567cdef...
set -euo pipefail
source "$(dirname "$0")/lib.sh"

FLAVOR="${1:-base}"
TORCH_SPEC="${IMESH_TORCH_SPEC:-torch==2.13.0}"   # the CPU wheel on these machines (BRIEF §4)
RELEASE="$(. /etc/os-release && echo "$VERSION_CODENAME")"
case "$FLAVOR" in
  base) DEB_PACKAGES=python3,python3-venv,python-is-python3,ca-certificates,passwd ;;
  native-build) DEB_PACKAGES=gcc,libc6-dev,python3 ;;
  *) die "usage: base_image.sh [native-build]" ;;
esac
RECIPE=2   # bump when the way the rootfs is made changes in a way the inputs below do not show

# The venv's requirements: the project's dependencies (torch replaced by the CPU pin), the
# operator image's pins (so its Dockerfile finds them satisfied) and the build backend.
requirements() {
  python3 - "$REPO/pyproject.toml" "$TORCH_SPEC" <<'EOF'
import re, sys, tomllib
deps = tomllib.load(open(sys.argv[1], "rb"))["project"]["dependencies"]
print("\n".join(sys.argv[2] if re.match(r"torch\b", d) else d for d in deps))
EOF
  # The Dockerfile keeps the operator's pins in one ARG line; read them from there (one source of truth).
  sed -n 's/^ARG OPERATOR_REQUIREMENTS="\(.*\)"$/\1/p' "$REPO/Dockerfile" | tr ' ' '\n'
  # PEP 639 `license = "..."` in pyproject.toml needs setuptools >= 77 (the Dockerfiles build the
  # project with --no-build-isolation, i.e. with this setuptools, so no index is needed).
  echo "setuptools>=77"
  echo "wheel"
}

base_key() {
  if [ "$FLAVOR" = base ]; then
    { echo "$RECIPE $RELEASE $DEB_PACKAGES"; requirements | LC_ALL=C sort; } | sha256sum | cut -c1-16
  else
    echo "$FLAVOR $RECIPE $RELEASE $DEB_PACKAGES" | sha256sum | cut -c1-16
  fi
}

# mmdebstrap of the Debian release, then the venv in a customize hook (mmdebstrap mounts /proc,
# /dev and /sys for hooks); the pip sources are bind-mounted read-only only for that step.
make_rootfs_tar() {
  local out=$1 reqs mirrors
  ensure_packages mmdebstrap
  mapfile -t mirrors < <(python3 "$HERE/apt_sources.py" "$RELEASE")
  if [ "$FLAVOR" = native-build ]; then
    say "mmdebstrap $RELEASE ($DEB_PACKAGES) from: ${mirrors[*]}"
    mmdebstrap --quiet --variant=minbase --include="$DEB_PACKAGES" \
      "$RELEASE" "${out%.tar}.partial.tar" "${mirrors[@]}" >&2
    mv "${out%.tar}.partial.tar" "$out"
    return
  fi
  reqs=$(mktemp); requirements > "$reqs"
  say "mmdebstrap $RELEASE (+ venv: $(tr '\n' ' ' < "$reqs")) from: ${mirrors[*]}"
  # The hook runs base_venv.sh with the rootfs as $1; it reads these from the environment.
  # (mmdebstrap picks the output format from the name: keep .tar at the end of the partial file.)
  IMESH_PIP_SOURCES="$(python3 "$HERE/pip_sources.py")" IMESH_REQUIREMENTS="$reqs" \
    mmdebstrap --quiet --variant=minbase --include="$DEB_PACKAGES" \
      --customize-hook="bash '$HERE/base_venv.sh' \"\$1\"" \
      "$RELEASE" "${out%.tar}.partial.tar" "${mirrors[@]}" >&2
  mv "${out%.tar}.partial.tar" "$out"
  rm -f "$reqs"
}

# buildah: from scratch + the tarball + the environment the Dockerfiles expect (venv first on PATH).
import_into_buildah() {
  local tar=$1 image=$2 ctr
  ctr=$(bah from scratch)
  bah add "$ctr" "$tar" / >/dev/null
  bah config --env PATH=/opt/venv/bin:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin \
    --env VIRTUAL_ENV=/opt/venv --env LANG=C.UTF-8 --cmd python3 \
    --label org.opencontainers.image.description="InferenceMesh build $FLAVOR: Debian $RELEASE ($DEB_PACKAGES)" \
    "$ctr"
  bah commit --quiet --rm "$ctr" "$image" >/dev/null
}

main() {
  ensure_packages buildah
  local key tar image t0
  key=$(base_key)
  tar="$IMESH_CACHE/base/$FLAVOR-$key.tar"
  image="localhost/inferencemesh/$FLAVOR:$key"
  mkdir -p "$IMESH_CACHE/base"
  if [ -f "$tar" ]; then
    say "base rootfs cached: $tar"
  else
    t0=$(date +%s)
    make_rootfs_tar "$tar"
    say "base rootfs built in $(( $(date +%s) - t0 ))s: $tar ($(du -h "$tar" | cut -f1))"
    find "$IMESH_CACHE/base" -name "$FLAVOR-*.tar" ! -name "$FLAVOR-$key.tar" -delete   # older recipes
  fi
  if bah inspect --type image "$image" >/dev/null 2>&1; then
    say "base image cached: $image"
  else
    t0=$(date +%s)
    import_into_buildah "$tar" "$image"
    say "base image imported into buildah in $(( $(date +%s) - t0 ))s: $image"
  fi
  echo "$image"
}

main "$@"
