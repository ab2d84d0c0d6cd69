"""The llama.cpp peer (`bench --peer llama-cpp`): llama.cpp, through llama-cpp-python, on the model
under test, measured in the latency bench's run beside our configurations.

The same model: the bench's checkpoint directory converted to GGUF by llama.cpp's own
convert_hf_to_gguf.py, at the dtype the bench computes in (float32: f32, bfloat16: bf16), cached
under ~/.cache/inferencemesh/bench/gguf. The converter is not in llama-cpp-python's wheel: it is
in its sdist (vendor/llama.cpp) and in any llama.cpp checkout, found offline (find_converter).
The same work: greedy decoding of the same prompt token ids (no text goes through llama.cpp's
tokenizer), --new-tokens tokens whatever they are (no stop at end-of-sequence), with a fresh KV
cache per request as our engine's prefix cache is off in this bench; timed as a streaming client
times our engine, so TPOT and TTFT mean the same on both sides.

Run as a module, it is the converter's process (convert_main): llama.cpp's converter refuses a
byte-level BPE vocabulary whose pre-tokenizer it does not know by hash (the bundled model's), a
name that only matters when llama.cpp tokenizes text; such a vocabulary gets llama.cpp's "default".
"""

from __future__ import annotations

import hashlib
import runpy
import subprocess
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from inferencemesh.flags import ConfigError
from inferencemesh.programs.bench.runners import Run

if TYPE_CHECKING:
    from inferencemesh.programs.bench.runners import EngineUnderTest

CONVERTER = "convert_hf_to_gguf.py"
GGUF_TYPES = {"float32": "f32", "bfloat16": "bf16", "float16": "f16"}  # the bench's dtype: the converter's --outtype
PEER_LABEL = "llama-cpp"
SDIST_RECIPE = (
    'pip download --no-deps --no-binary :all: "llama-cpp-python=={v}" -d /tmp/llama-cpp-sdist && '
    "mkdir -p ~/.cache/inferencemesh && tar xzf /tmp/llama-cpp-sdist/llama_cpp_python-{v}.tar.gz -C "
    "~/.cache/inferencemesh")


def peer_label(threads: int, bench_threads: int) -> str:
    """llama-cpp at the bench's threads, llama-cpp[threads=N] at a split's share, as in-process-1-stage's."""
    return PEER_LABEL if threads == bench_threads else f"{PEER_LABEL}[threads={threads}]"


def llama_cpp_version() -> str:
    """The installed llama-cpp-python's version; a ConfigError saying how to install it otherwise."""
    try:
        import llama_cpp
    except ImportError as err:
        raise ConfigError(f"--peer llama-cpp needs llama-cpp-python ({err}): pip install 'inferencemesh[llama-cpp]' "
                          "(it builds llama.cpp from source: a C compiler and CMake, minutes)") from None
    return str(llama_cpp.__version__)


def default_converter_home(version: str) -> Path:
    """Where the installed version's sdist is unpacked by README's recipe (SDIST_RECIPE)."""
    return Path.home() / ".cache" / "inferencemesh" / f"llama_cpp_python-{version}"


def find_converter(given: str | None, version: str) -> Path:
    """convert_hf_to_gguf.py: `given` (the script, a llama.cpp checkout, or an unpacked
    llama-cpp-python sdist), else the installed version's sdist under ~/.cache/inferencemesh."""
    home = Path(given).expanduser() if given else default_converter_home(version)
    for candidate in (home, home / CONVERTER, home / "vendor" / "llama.cpp" / CONVERTER):
        if candidate.is_file() and candidate.name == CONVERTER:
            return candidate.resolve()
    where = f"--llama-cpp-converter {given}" if given else f"{home} (the default for llama-cpp-python {version})"
    raise ConfigError(f"no llama.cpp {CONVERTER} at {where}; it comes with llama-cpp-python's sdist, not its "
                      f"wheel: {SDIST_RECIPE.format(v=version)} (or give --llama-cpp-converter a llama.cpp checkout)")


def gguf_type(dtype_name: str, quantization: str | None) -> str:
    """The GGUF type that computes as the bench's model does; refused where there is none."""
    if quantization:
        raise ConfigError(f"--peer llama-cpp compares the same weights: llama.cpp has no form of --quantization "
                          f"{quantization}'s, drop one of them")
    if dtype_name not in GGUF_TYPES:
        raise ConfigError(f"--peer llama-cpp: no GGUF type for dtype {dtype_name}")
    return GGUF_TYPES[dtype_name]


def gguf_path(model_dir: Path, outtype: str, converter: Path) -> Path:
    """The cached conversion of `model_dir`: keyed by its files (names, sizes, times) and the converter."""
    key = hashlib.sha256(str(converter).encode())
    for f in sorted(p for p in model_dir.resolve().iterdir() if p.is_file()):
        stat = f.stat()
        key.update(f"{f.name}:{stat.st_size}:{stat.st_mtime_ns}".encode())
    name = f"{model_dir.resolve().name}-{key.hexdigest()[:16]}-{outtype}.gguf"
    return Path.home() / ".cache" / "inferencemesh" / "bench" / "gguf" / name


def convert(model_dir: Path, outtype: str, converter: Path) -> Path:
    """`model_dir` as GGUF, converted by llama.cpp's converter in a process of its own (it imports
    its own gguf package and takes minutes on a big model), or the cached file."""
    out = gguf_path(model_dir, outtype, converter)
    if out.exists():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    partial = out.with_suffix(".partial")
    print(f"  llama.cpp peer: converting {model_dir} to {outtype} GGUF with {converter}", flush=True)
    done = subprocess.run([sys.executable, "-m", __name__, str(converter), str(model_dir), "--outtype", outtype,
                           "--outfile", str(partial)], capture_output=True, text=True)
    if done.returncode != 0 or not partial.exists():
        print(done.stdout + done.stderr, file=sys.stderr, flush=True)
        last = (done.stderr or done.stdout).strip().splitlines()[-1:] or ["no output"]
        raise ConfigError(f"llama.cpp's converter could not convert {model_dir} (exit {done.returncode}): {last[0]}")
    partial.rename(out)
    return out


class LlamaCppPeer:
    """llama.cpp on the GGUF file at `threads` threads: the latency bench's runner interface."""

    def __init__(self, gguf: Path, new_tokens: int, threads: int, max_context: int) -> None:
        from llama_cpp import Llama

        self.llm = Llama(model_path=str(gguf), n_ctx=max_context, n_batch=max_context, n_threads=threads,
                         n_threads_batch=threads, seed=0, verbose=False)
        self.new_tokens, self.threads = new_tokens, threads
        self.vocab = self.llm.n_vocab()
        self.outputs: dict[tuple[int, ...], list[int]] = {}  # each prompt's latest tokens (agreement())

    def _next(self) -> int:
        """Greedy: the argmax of the last position's logits (what llama.cpp's greedy sampler takes),
        read in place: Llama.eval keeps no logits unless every position's are asked for."""
        import llama_cpp
        import numpy as np

        logits = llama_cpp.llama_get_logits_ith(self.llm.ctx, -1)
        return int(np.ctypeslib.as_array(logits, shape=(self.vocab,)).argmax())

    async def run(self, ids: list[int]) -> Run:
        self.llm.reset()  # no prefix reuse: the prompt is prefilled every time
        started = time.perf_counter()
        self.llm.eval(ids)
        tokens = [self._next()]
        ttft = time.perf_counter() - started
        while len(tokens) < self.new_tokens:
            self.llm.eval(tokens[-1:])
            tokens.append(self._next())
        total = time.perf_counter() - started
        self.outputs[tuple(ids)] = tokens
        return Run(ttft, total, len(tokens))


async def agreement(peer: LlamaCppPeer, engine: EngineUnderTest, prompts: list[list[int]]) -> dict[str, Any]:
    """How far llama.cpp's greedy tokens equal our engine's, prompt by prompt: the length of the
    common prefix (after the first difference the two continue different texts)."""
    prefixes = []
    for ids in prompts:
        theirs = peer.outputs.get(tuple(ids)) or []
        if not theirs:
            await peer.run(ids)
            theirs = peer.outputs[tuple(ids)]
        ours = [t async for step in engine.steps(ids) for t in step]
        prefixes.append(next((i for i, (a, b) in enumerate(zip(ours, theirs, strict=False)) if a != b),
                             min(len(ours), len(theirs))))
    return {"new_tokens": peer.new_tokens, "common_prefix_tokens": prefixes,
            "all_equal": all(p == peer.new_tokens for p in prefixes)}


def convert_main(argv: list[str]) -> None:
    """The converter's process: llama.cpp's convert_hf_to_gguf.py with argv[1:], its own gguf-py
    and conversion packages, an unknown BPE pre-tokenizer named llama.cpp's "default"."""
    converter = Path(argv[0]).resolve()
    sys.path[:0] = [str(converter.parent), str(converter.parent / "gguf-py")]
    from conversion import base  # llama.cpp's, beside the script

    known = base.TextModel.get_vocab_base_pre

    def pre_tokenizer(self: Any, tokenizer: Any) -> str:
        try:
            return str(known(self, tokenizer))
        except NotImplementedError:  # a vocabulary llama.cpp's table does not list; ids are what count here
            print("llama.cpp peer: unknown BPE pre-tokenizer, named 'default'", file=sys.stderr)
            return "default"

    base.TextModel.get_vocab_base_pre = pre_tokenizer
    sys.argv = [str(converter), *argv[1:]]
    runpy.run_path(str(converter), run_name="__main__")


if __name__ == "__main__":
    convert_main(sys.argv[1:])
