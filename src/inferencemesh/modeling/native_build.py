"""Compiling the native CPU kernels (the C sources in native/) into a shared library, with nothing
beyond Python's standard library, so an image's build stage runs it as a script:
    python3 native_build.py --prebuild DIR

At first use (native_kernels.library) the sources are compiled once per machine with its C
compiler (`cc`, or $CC) into a cache directory ($INFERENCEMESH_NATIVE_CACHE, else $XDG_CACHE_HOME
or ~/.cache, then inferencemesh/native), under a name that hashes the sources, the compiler (its
file) and the flags, so every process after the first loads it in milliseconds and an edited
source builds anew. The build writes a temporary file and renames it into place, so processes
starting together never load a half-written library.

Images have no compiler: their build compiles the library ahead of time (--prebuild) into a
directory named by $INFERENCEMESH_NATIVE_PREBUILT at run time, under a name that hashes the sources
and flags alone. A prebuilt library for these very sources is loaded first; any other is ignored.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

SOURCES = tuple(Path(__file__).with_name("native") / name
                for name in ("woq_gemm.c", "quantize.c", "host_ops.c", "paged_attention.c"))
FLAGS = ("-O3", "-fopenmp", "-shared", "-fPIC", "-lm")
CACHE_ENV = "INFERENCEMESH_NATIVE_CACHE"
PREBUILT_ENV = "INFERENCEMESH_NATIVE_PREBUILT"
BUILD_TIMEOUT_S = 300


def cache_dir() -> Path:
    if os.environ.get(CACHE_ENV):
        return Path(os.environ[CACHE_ENV])
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "inferencemesh" / "native"


def _compiler() -> list[str]:
    return (os.environ.get("CC") or "cc").split()


def _compiler_identity(compiler: list[str]) -> str:
    """The compiler's resolved file, size and time: a changed compiler builds anew, and a cached
    library is found without starting a process."""
    found = shutil.which(compiler[0])
    if found is None:
        raise FileNotFoundError(f"no C compiler {compiler[0]!r} on PATH (set CC to one)")
    real = os.path.realpath(found)
    stat = os.stat(real)
    return f"{real} {stat.st_size} {stat.st_mtime_ns}"


def _key(*parts: str) -> str:
    """A hash of the sources, the flags and `parts`."""
    text = "\0".join([*(source.read_text() for source in SOURCES), *FLAGS, *parts])
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def _compile(compiler: list[str], target: Path) -> Path:
    """Compile into target through a temporary file renamed into place."""
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, partial = tempfile.mkstemp(prefix=".inferencemesh-native-", suffix=".so", dir=target.parent)
    os.close(fd)
    try:
        subprocess.run([*compiler, "-o", partial, *map(str, SOURCES), *FLAGS], capture_output=True, text=True,
                       check=True, timeout=BUILD_TIMEOUT_S)
        # mkstemp made it owner-only; an image's library is built by root and loaded by its user
        os.chmod(partial, 0o755)
        os.replace(partial, target)
    finally:
        if os.path.exists(partial):
            os.unlink(partial)
    return target


def prebuilt_name() -> str:
    return f"inferencemesh-native-prebuilt-{_key()}.so"


def prebuilt() -> Path | None:
    """The library built ahead of time for these sources, where $INFERENCEMESH_NATIVE_PREBUILT has one."""
    directory = os.environ.get(PREBUILT_ENV)
    path = Path(directory) / prebuilt_name() if directory else None
    return path if path is not None and path.exists() else None


def build(directory: Path | None = None) -> Path:
    """The compiled library's path, compiling it first unless the cache has it. Raises OSError,
    subprocess.CalledProcessError or TimeoutExpired where it cannot be built."""
    compiler = _compiler()
    target = (directory or cache_dir()) / f"inferencemesh-native-{_key(_compiler_identity(compiler), *compiler)}.so"
    return target if target.exists() else _compile(compiler, target)


def prebuild(directory: Path) -> Path:
    """Compile ahead of time into directory, under the name prebuilt() looks for."""
    compiler = _compiler()
    _compiler_identity(compiler)  # a missing compiler, said plainly
    return _compile(compiler, directory / prebuilt_name())


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Compile InferenceMesh's native CPU kernels ahead of time.")
    parser.add_argument("--prebuild", type=Path, required=True, metavar="DIR",
                        help=f"the directory the images name in ${PREBUILT_ENV}")
    args = parser.parse_args(argv)
    try:
        path = prebuild(args.prebuild)
    except (OSError, subprocess.SubprocessError) as error:
        detail = getattr(error, "stderr", None) or error
        print(f"native_build: {str(detail).strip()}", file=sys.stderr)
        return 1
    print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
