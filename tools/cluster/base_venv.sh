#!/usr/bin/env bash
# mmdebstrap customize hook of base_image.sh: create /opt/venv in the rootfs $1 and install
# $IMESH_REQUIREMENTS into it with this machine's pip sources ($IMESH_PIP_SOURCES, from
# pip_sources.py), which are bind-mounted read-only at the same paths for this step only.
set -euo pipefail
ROOT=$1
eval "$IMESH_PIP_SOURCES"   # PIP_MOUNTS=(...) PIP_ENVS=(...)

mounted=() created=()
cleanup() {
  local i
  for (( i=${#mounted[@]}-1; i>=0; i-- )); do umount "${mounted[i]}" || true; done
  for (( i=${#created[@]}-1; i>=0; i-- )); do rm -rf --one-file-system "${created[i]}" || true; done
}
trap cleanup EXIT

# Create a mount point (and remember what we created, so the image keeps no empty trace of it).
make_target() {
  local path=$1 kind=$2 missing=$1
  while [ ! -e "$(dirname "$missing")" ]; do missing=$(dirname "$missing"); done
  [ -e "$path" ] || created+=("$missing")
  if [ "$kind" = dir ]; then mkdir -p "$path"; else mkdir -p "$(dirname "$path")"; touch "$path"; fi
}

for src in "${PIP_MOUNTS[@]}"; do
  dst="$ROOT$src"
  if [ -d "$src" ]; then make_target "$dst" dir; else make_target "$dst" file; fi
  mount --bind "$src" "$dst"
  mounted+=("$dst")
  mount -o remount,bind,ro "$dst"
done

# (A local simple index lacking a project makes pip warn "Location ... is ignored": expected, hidden.)
cp "$IMESH_REQUIREMENTS" "$ROOT/tmp/requirements.txt"
chroot "$ROOT" python3 -m venv /opt/venv
chroot "$ROOT" /usr/bin/env -i PATH=/opt/venv/bin:/usr/bin:/bin HOME=/root LANG=C.UTF-8 "${PIP_ENVS[@]}" \
  /opt/venv/bin/pip install --no-cache-dir --disable-pip-version-check --progress-bar off -q \
  -r /tmp/requirements.txt 2> >(grep -v 'is ignored: it is neither a file nor a directory' >&2)
chroot "$ROOT" /opt/venv/bin/pip list --format=freeze > "$ROOT/opt/venv/requirements.lock"
rm -f "$ROOT/tmp/requirements.txt"
echo "[base_venv] /opt/venv: $(wc -l < "$ROOT/opt/venv/requirements.lock") packages, $(du -sh "$ROOT/opt/venv" | cut -f1)" >&2
