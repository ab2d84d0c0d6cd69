"""Print this machine's pip package sources as bash arrays, for a pip run inside a chroot.

`pip config list` (files and PIP_* environment) names where pip gets packages here: local wheel
directories (find-links), local simple indexes (file:// index URLs), a CA bundle, a constraints
file. A chroot sees none of them, so base_image.sh bind-mounts each local one read-only at the
same path and hands the chroot's pip the same settings as PIP_* variables. Nothing is hard-coded:
a machine with other mirrors or directories gets its own.

Output (eval'd by bash):
  PIP_MOUNTS=(paths to bind-mount read-only; directories or files)
  PIP_ENVS=(NAME=value ...)
"""

from __future__ import annotations

import shlex
import subprocess
import sys
from pathlib import Path
from urllib.parse import urlparse

# The settings that decide where packages come from and how they are checked.
KEYS = ("index-url", "extra-index-url", "find-links", "cert", "client-cert", "constraint", "trusted-host",
        "timeout", "default-timeout")
PATH_KEYS = {"cert", "client-cert", "constraint"}
URL_KEYS = {"index-url", "extra-index-url", "find-links"}
# Later wins: the global/user/site files' [global], then their [install], then PIP_* variables.
PRECEDENCE = ("global", "install", ":env:")


def pip_config() -> dict[str, str]:
    out = subprocess.run([sys.executable, "-m", "pip", "config", "list"], capture_output=True, text=True,
                         check=True).stdout
    found: dict[str, dict[str, str]] = {}
    for line in out.splitlines():
        key, _, value = line.partition("=")
        section, _, name = key.rpartition(".")
        found.setdefault(section, {})[name] = value.strip().strip("'\"")
    merged: dict[str, str] = {}
    for section in PRECEDENCE:
        merged.update({k: v for k, v in found.get(section, {}).items() if k in KEYS})
    return merged


def local_path(location: str) -> Path | None:
    """The local filesystem path of a find-links / index location, None for a remote URL."""
    parsed = urlparse(location)
    if parsed.scheme == "file":
        return Path(parsed.path)
    if parsed.scheme in ("", None) and location.startswith("/"):
        return Path(location)
    return None


def mount_for(key: str, path: Path) -> Path:
    # A PEP 503 index at DIR/simple usually links its files as ../../files/...: mount DIR.
    if key in ("index-url", "extra-index-url") and path.name == "simple":
        return path.parent
    return path


def main() -> None:
    config = pip_config()
    mounts: list[str] = []
    envs: list[str] = []
    for key, value in config.items():
        if key in URL_KEYS:
            for location in value.split():
                path = local_path(location)
                if path is not None and path.exists():
                    mounts.append(str(mount_for(key, path)))
        elif key in PATH_KEYS and Path(value).exists():
            mounts.append(value)
        envs.append(f"PIP_{key.upper().replace('-', '_')}={value}")
    unique = sorted(set(mounts))
    # Drop a mount that lies inside another one.
    unique = [m for m in unique if not any(m != o and m.startswith(o.rstrip("/") + "/") for o in unique)]
    print("PIP_MOUNTS=(" + " ".join(shlex.quote(m) for m in unique) + ")")
    print("PIP_ENVS=(" + " ".join(shlex.quote(e) for e in envs) + ")")


if __name__ == "__main__":
    main()
