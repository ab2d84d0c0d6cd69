"""Survey every causal-LM family of the installed transformers through the general stage path.

    python tools/survey_families.py [--only a,b] [--json docs/benchmarks/families-survey.json]
                                    [--timeout 120] [--jobs 2] [--fresh]
    python tools/survey_families.py --markdown docs/benchmarks/families-survey.json  # docs tables

For every model_type of CONFIG_MAPPING that AutoModelForCausalLM maps, one check in a child
process (a hang is killed at --timeout, a segfault is recorded; neither stops the survey), one
torch thread, src/ on the path:

1. a tiny config from the family's own config class: its defaults, with the size fields it has
   shrunk (SIZES below: one table of attribute names, no per-family branch), the scales its
   forward applies moved off 1.0 (SCALES) and soft caps made small (CAPS); per-layer lists
   (layer_types and the like) recomputed by the config for 4 layers, or cut to 4 keeping every
   kind they hold. A family whose tiny config does not build is "skipped" (or "refused" where
   families.refusal refuses its default config anyway).
2. families.refusal(config.to_dict()): "refused" with the reason.
3. otherwise a random checkpoint (save_pretrained, safetensors), transformers' greedy generate()
   (float32, the family's default attention, eager where that fails; 12-token prompt, 8 new
   tokens, min_new_tokens=8) and the same greedy decode through StageRuntime at 2 stages (layers
   [0, L/2), [L/2, L)) and at 1 stage: "exact" (tokens equal and every logprob within
   1e-4 + 1e-5 |lp|), "mismatch" (first differing step, largest logprob difference; "kind":
   "float32 noise" where the tokens are equal and the stages' logprobs are as near a float64
   forward as transformers' float32 ones, within 2x, else "wrong"), or "error" (our checkpoint
   reading, loader or runtime raised: type, first line, where). A reference that transformers
   itself cannot build or run is "skipped" too (with the phase).

By default each child is forked from a parent that has imported torch, transformers and the
stage runtime once (7 s saved per family); --fresh runs each check in a new interpreter instead.
"""

from __future__ import annotations

import argparse
import dataclasses
import inspect
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
SRC = ROOT / "src"
if str(SRC) not in sys.path:
    sys.path.insert(0, str(SRC))
os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (str(SRC), os.environ.get("PYTHONPATH", "")) if p)
os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")

LAYERS = 4
PROMPT, NEW = 12, 8
VOCAB = 320
ATOL, RTOL = 1e-4, 1e-5

# Size fields, by the names families give them: set wherever the family's config class has one.
SIZES: dict[str, Any] = {
    # widths
    **dict.fromkeys(("hidden_size", "d_model", "n_embd", "hidden_dim", "emb_dim", "dim_model"), 64),
    **dict.fromkeys(("intermediate_size", "ffn_dim", "ffn_hidden_size", "n_inner", "intermediate_size_mlp",
                     "dense_intermediate_size", "prefix_dense_intermediate_size", "dim_ff",
                     "decoder_ffn_dim", "encoder_ffn_dim"), 96),
    **dict.fromkeys(("moe_intermediate_size", "expert_ffn_hidden_size", "shared_expert_intermediate_size",
                     "shared_intermediate_size", "shared_experts_intermediate_size",
                     "moe_shared_expert_intermediate_size"), 48),
    # depth
    **dict.fromkeys(DEPTH := ("num_hidden_layers", "n_layer", "n_layers", "num_layers", "decoder_layers",
                              "encoder_layers"), LAYERS),
    # heads
    **dict.fromkeys(("num_attention_heads", "n_head", "n_heads", "num_heads", "decoder_attention_heads",
                     "encoder_attention_heads", "attention_heads"), 4),
    **dict.fromkeys(("num_key_value_heads", "num_kv_heads"), 2),
    **dict.fromkeys(("head_dim", "kv_channels", "attention_head_dim", "d_head", "dim_head"), 16),
    # multi-head latent attention (DeepSeek-style)
    "kv_lora_rank": 16, "q_lora_rank": 32, "qk_nope_head_dim": 16, "qk_rope_head_dim": 8,
    "v_head_dim": 16, "qk_head_dim": 24,
    # positions, vocabulary, initialisation
    **dict.fromkeys(("max_position_embeddings", "n_positions", "n_ctx", "max_target_positions"), 256),
    "vocab_size": VOCAB,
    **dict.fromkeys(("initializer_range", "init_std", "embedding_initializer_range"), 0.5),
    # experts: 4, top-2, one shared, one dense layer first where the family has them
    **dict.fromkeys(("num_experts", "num_local_experts", "n_routed_experts", "moe_num_experts"), 4),
    **dict.fromkeys(("num_experts_per_tok", "moe_topk", "moe_k", "top_k_experts"), 2),
    **dict.fromkeys(("n_group", "topk_group"), 1),
    **dict.fromkeys(("first_k_dense_replace", "num_dense_layers"), 1),
    # sliding windows and their patterns
    **dict.fromkeys(("sliding_window", "window_size", "sliding_window_size", "attention_window_size"), 8),
    **dict.fromkeys(("sliding_window_pattern", "global_attn_every_n_layers"), 2),
}
# Scales that a family's forward applies around the layers (modeling/families.py HOOKS) or inside
# them, moved off their neutral defaults so that a stage that forgets one is seen to differ.
SCALES: dict[str, float] = {"embedding_multiplier": 4.0, "logits_scaling": 2.0, "residual_multiplier": 0.5,
                            "attention_multiplier": 0.25, "logit_scale": 0.5}
# Soft caps, made small enough to bite where the family has them on.
CAPS: dict[str, float] = {"final_logit_softcapping": 3.0, "attn_logit_softcapping": 5.0}
# Set only where the family's default is a positive number (0 / None switch the feature off).
ONLY_IF_ON = {"q_lora_rank", "sliding_window", "window_size", "sliding_window_size", "attention_window_size",
              "first_k_dense_replace", "num_dense_layers", "sliding_window_pattern", "global_attn_every_n_layers",
              "n_group", "topk_group"}
# Shared-expert counts: 1 (also where the default leaves it None), 0 kept; max_window_layers capped.
AT_MOST = {"n_shared_experts": 1, "num_shared_experts": 1, "moe_num_shared_experts": 1, "max_window_layers": LAYERS}
TOKENS = {"bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 0}


# --------------------------------------------------------------------------- the tiny config


def _fields(cls: type) -> dict[str, Any]:
    """The config class's field names with their declared defaults."""
    out: dict[str, Any] = {}
    try:
        for f in dataclasses.fields(cls):
            if f.default is not dataclasses.MISSING:
                out[f.name] = f.default
            elif f.default_factory is not dataclasses.MISSING:  # type: ignore[misc]
                try:
                    out[f.name] = f.default_factory()  # type: ignore[misc]
                except Exception:
                    out[f.name] = None
            else:
                out[f.name] = None
    except TypeError:
        for name, p in inspect.signature(cls).parameters.items():
            if name not in ("self", "kwargs") and p.kind not in (p.VAR_KEYWORD, p.VAR_POSITIONAL):
                out[name] = None if p.default is inspect.Parameter.empty else p.default
    return out


def _cover(values: list, n: int) -> list:
    """values cut to n entries, keeping every distinct kind it holds (where n allows)."""
    out = list(values[:n])
    kinds: list = []
    for v in values:
        if v not in kinds:
            kinds.append(v)
    missing = [k for k in kinds if k not in out]
    for i, k in enumerate(missing[:n - 1]):
        out[n - 1 - i] = k
    return out


def _positive(v: Any) -> bool:
    return isinstance(v, int | float) and not isinstance(v, bool) and v > 0


def tiny_config(model_type: str, layers: int = LAYERS) -> Any:
    from transformers import AutoConfig
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    cls = CONFIG_MAPPING[model_type]
    declared = _fields(cls)
    try:
        default: dict = cls().to_dict()
    except Exception:
        default = {}
    current = {**declared, **default}
    names = set(declared) | set(default) | set(getattr(cls, "attribute_map", {}) or {})
    default_layers = next((current[n] for n in ("num_hidden_layers", "n_layer", "n_layers", "num_layers")
                           if isinstance(current.get(n), int)), None)
    kw: dict[str, Any] = {}
    for name, value in SIZES.items():
        if name not in names:
            continue
        if name in ONLY_IF_ON and not _positive(current.get(name)) and name in current:
            continue
        kw[name] = layers if name in DEPTH else value
    if "qk_rope_head_dim" in names and "head_dim" in names:  # latent attention: rotary part = head_dim
        kw["head_dim"] = SIZES["qk_rope_head_dim"]
    if "kv_lora_rank" in names and "num_key_value_heads" in kw:  # latent attention: a k/v per query head
        kw["num_key_value_heads"] = SIZES["num_attention_heads"]
    for name, cap in AT_MOST.items():
        if name in names and current.get(name) is None and "shared" in name:
            kw[name] = cap
        elif name in names and _positive(current.get(name)):
            kw[name] = min(int(current[name]), cap)
    for name, value in SCALES.items():
        if name in names and isinstance(current.get(name), int | float):
            kw[name] = value
    for name, value in CAPS.items():
        if name in names and _positive(current.get(name)):
            kw[name] = value
    for name, value in TOKENS.items():
        if name in names:
            kw[name] = value
    # Per-layer lists (layer_types, mlp_layer_types, ...): first let the config recompute them;
    # retried below with the defaults cut to the new depth.
    per_layer = {n: v for n, v in current.items()
                 if isinstance(v, list | tuple) and default_layers and len(v) == default_layers and n not in kw}
    # Layer-index lists (mlp_only_layers, moe_layers, ...): the indices that still exist.
    for n, v in current.items():
        if (n not in per_layer and n not in kw and isinstance(v, list | tuple) and v
                and all(isinstance(i, int) and not isinstance(i, bool) for i in v)
                and ("layers" in n or "idxs" in n or "layer_ids" in n)):
            kw[n] = [i for i in v if i < layers]
    attempts = [{**kw, **dict.fromkeys(per_layer)}]
    if per_layer:
        cut = {n: _cover(list(v), layers) for n, v in per_layer.items()}
        for n in cut:
            if "heads" in n:  # per-layer head counts
                cut[n] = [SIZES["num_attention_heads"]] * layers
        attempts.append({**kw, **cut})
    errors = []
    for attempt in attempts:
        try:
            config = AutoConfig.for_model(model_type, **attempt)
        except Exception as err:
            errors.append(f"{type(err).__name__}: {_first_line(err)}")
            continue
        bad = [n for n in per_layer if isinstance(getattr(config, n, None), list | tuple)
               and len(getattr(config, n)) != layers]
        if bad:
            errors.append(f"per-layer lists {bad} not {layers} long")
            continue
        return config
    raise RuntimeError(" / ".join(errors))


# --------------------------------------------------------------------------- one family


def _first_line(err: BaseException) -> str:
    lines = [ln.strip() for ln in str(err).strip().splitlines() if ln.strip()]
    text = lines[0] if lines else ""
    if text.endswith(":") and len(lines) > 1:  # a heading (strict dataclass validation): add the reason
        text = f"{text} {lines[1]}"
    return text[:300]


def _where(tb: Any) -> str:
    """The innermost frames in our code and in transformers, as file:line function."""
    frames = traceback.extract_tb(tb)
    out = []
    for key in ("inferencemesh", "transformers"):
        for fr in reversed(frames):
            if f"/{key}/" in fr.filename:
                rel = fr.filename.split(f"/{key}/", 1)[1]
                out.append(f"{rel if key == 'transformers' else 'src/inferencemesh/' + rel}:{fr.lineno} {fr.name}")
                break
    if frames:
        last = frames[-1]
        tail = f"{Path(last.filename).name}:{last.lineno} {last.name}"
        if not any(tail.split(":")[0] in o for o in out):
            out.append(tail)
    return " <- ".join(out)


class Phase(Exception):
    def __init__(self, status: str, phase: str, err: BaseException) -> None:
        super().__init__(str(err))
        self.status, self.phase, self.err = status, phase, err


def check(model_type: str, workdir: Path) -> dict:
    import torch
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    from inferencemesh.modeling import families
    from inferencemesh.modeling.runtime import StageRuntime

    hf_logging.set_verbosity_error()
    torch.set_num_threads(1)

    def step(status: str, phase: str, fn: Any) -> Any:
        try:
            return fn()
        except Exception as err:
            raise Phase(status, phase, err).with_traceback(err.__traceback__) from err

    try:
        try:
            config = tiny_config(model_type)
        except Exception as err:
            # The family may be refused whatever its size: ask with its default config.
            try:
                from transformers import AutoConfig
                why = families.refusal(AutoConfig.for_model(model_type).to_dict())
            except Exception:
                why = None
            if why is not None and "does not build" not in why and "cannot build" not in why:
                return {"status": "refused", "detail": f"{why} (its default config; no tiny config: "
                                                       f"{type(err).__name__}: {_first_line(err)[:150]})"}
            raise Phase("skipped", "tiny config", err) from err
        why = step("error", "refusal", lambda: families.refusal(config.to_dict()))
        if why is not None and "cannot build" in why:  # the tiny config's doing? its default's reason
            try:
                from transformers import AutoConfig
                default_why = families.refusal(AutoConfig.for_model(model_type).to_dict())
            except Exception:
                default_why = None
            if default_why and "cannot build" not in default_why and "does not build" not in default_why:
                why = f"{default_why} (its default config; the tiny one: {why})"
        if why is not None:
            return {"status": "refused", "detail": why}
        layers = int(config.num_hidden_layers)

        path = workdir / model_type

        def write() -> None:
            torch.manual_seed(0)
            model = AutoModelForCausalLM.from_config(config, dtype=torch.float32, attn_implementation="eager")
            model.eval().save_pretrained(path, safe_serialization=True)

        step("skipped", "transformers from_config/save_pretrained", write)
        from inferencemesh.checkpoint.errors import CheckpointError
        from inferencemesh.checkpoint.read import read_local

        try:  # what `plan` and `serve` read first: the checkpoint's facts
            read_local(path)
        except CheckpointError as err:
            return {"status": "refused", "detail": str(err).split("cannot be served: ", 1)[-1]}
        prompt = torch.randint(3, VOCAB, (PROMPT,), generator=torch.Generator().manual_seed(5))

        def reference(attn: str | None, cache: bool) -> tuple[list[int], torch.Tensor, float]:
            impl = {"attn_implementation": attn} if attn else {}
            model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, **impl).eval()
            with torch.no_grad():
                out = model.generate(prompt[None], attention_mask=torch.ones(1, PROMPT, dtype=torch.long),
                                     max_new_tokens=NEW, min_new_tokens=NEW, do_sample=False, use_cache=cache,
                                     output_logits=True, return_dict_in_generate=True)
                # transformers' own float32 noise: one forward over the same tokens
                whole = torch.log_softmax(model(out.sequences[:, :-1]).logits[0, PROMPT - 1:].float(), -1)
            tokens = out.sequences[0, PROMPT:].tolist()
            lps = torch.stack([torch.log_softmax(x[0].float(), -1) for x in out.logits])
            sequence.append(out.sequences[:, :-1])
            return tokens, lps, float((whole - lps).abs().max())

        def float64() -> torch.Tensor | None:
            """Logprobs of the reference's sequence in float64: the arbiter between two float32 results."""
            for extra in ({"experts_implementation": "eager"}, {}):  # grouped_mm has no float64
                try:
                    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float64, **extra).eval()
                    with torch.no_grad():
                        return torch.log_softmax(model(sequence[0]).logits[0, PROMPT - 1:].double(), -1)
                except Exception:
                    continue
            return None

        def reference_any() -> tuple[list[int], torch.Tensor, float]:
            # The family's default attention (sdpa where it has it: what the stages run), eager
            # where that refuses (softcaps), and without a cache where the family's cached
            # generate() is broken.
            errors: list[BaseException] = []
            for attn, cache in ((None, True), ("eager", True), (None, False)):
                try:
                    out = reference(attn, cache)
                except Exception as err:
                    errors.append(err)
                    continue
                used.append(f"{attn or 'default'} attention{'' if cache else ', no cache'}")
                return out
            raise errors[0]

        used: list[str] = []
        sequence: list[torch.Tensor] = []
        expected, expected_lp, noise = step("skipped", "transformers generate()", reference_any)
        if len(expected) != NEW:
            raise Phase("skipped", "transformers generate()", RuntimeError(f"generate() gave {len(expected)} tokens"))
        eos_ids = getattr(config, "eos_token_id", None)
        eos_ids = [eos_ids] if isinstance(eos_ids, int) else list(eos_ids or [])
        eos = torch.tensor([i for i in eos_ids if 0 <= i < VOCAB], dtype=torch.long)
        half = layers // 2
        results = {}
        for name, bounds in (("2 stages", [0, half, layers]), ("1 stage", [0, layers])):
            stages = step("error", f"load ({name})", lambda b=bounds: [
                StageRuntime(path, a, z, dtype="float32", device="cpu", max_context=64)
                for a, z in zip(b, b[1:], strict=False)])

            def decode(stages: list = stages) -> tuple[list[int], list[torch.Tensor]]:
                sessions = [s.new_session() for s in stages]

                def chain(pos: int, ids: torch.Tensor) -> torch.Tensor:
                    out = ids
                    for stage, kv in zip(stages, sessions, strict=True):
                        feed = {"token_ids": out} if stage.is_first else {"hidden": out}
                        out = stage.forward(kv, pos, **feed)
                    return out

                logits = chain(0, prompt)
                got, lps, pos = [], [], PROMPT
                for _ in range(NEW):
                    lps.append(torch.log_softmax(logits[-1].float(), -1))
                    # generate()'s min_new_tokens: end-of-sequence ids are never picked
                    token = int(logits[-1].float().index_fill(0, eos, float("-inf")).argmax())
                    got.append(token)
                    logits = chain(pos, torch.tensor([token]))
                    pos += 1
                return got, lps

            got, lps = step("error", f"forward ({name})", decode)
            first = next((i for i, (a, b) in enumerate(zip(got, expected, strict=True)) if a != b), None)
            upto = NEW if first is None else first + 1
            diff = (torch.stack(lps[:upto]) - expected_lp[:upto]).abs()
            worst = float(diff.max())
            within = bool((diff <= ATOL + RTOL * expected_lp[:upto].abs()).all())
            # the test's tolerance (tests/test_families.py): twice transformers' own noise
            loose = first is None and bool((diff <= max(ATOL, 2 * noise) + RTOL * expected_lp.abs()).all())
            results[name] = (first, worst, within, loose, torch.stack(lps))
        bad = {n: r for n, r in results.items() if r[0] is not None or not r[2]}
        worst = max(r[1] for r in results.values())
        if not bad:
            return {"status": "exact", "detail": f"{layers} layers; max |logprob diff| {worst:.2e} "
                                                 f"(transformers' own noise {noise:.1e}; reference: {used[0]})"}
        parts = []
        exact64 = float64() if all(r[0] is None for r in results.values()) else None
        if exact64 is not None:  # tokens equal: which float32 result is nearer the float64 one?
            ref_err = float((expected_lp.double() - exact64).abs().max())
            ours_err = max(float((r[4].double() - exact64).abs().max()) for r in results.values())
            noise_only = ours_err <= max(ATOL, 2 * ref_err)
            parts.append(f"against float64: transformers' float32 off by {ref_err:.2g}, the stages' by {ours_err:.2g}")
        else:
            noise_only = all(r[3] for r in results.values())
        for n, (first, w, _, _, _) in results.items():
            if first is None:
                where = "tokens equal"
            else:
                top2 = expected_lp[first].topk(2).values
                where = (f"first differing token at step {first} (reference top-2 margin "
                         f"{float(top2[0] - top2[1]):.2g})")
            parts.append(f"{n}: {where}, max |logprob diff| {w:.3g}")
        parts.append(f"transformers' own noise (generate vs one forward) {noise:.2g}; reference: {used[0]}")
        return {"status": "mismatch", "kind": "float32 noise" if noise_only else "wrong",
                "detail": ("float32 noise (tokens equal; as near float64 as transformers' float32, within 2x): "
                           if noise_only else "") + "; ".join(parts)}
    except Phase as p:
        cause = p.err
        return {"status": p.status, "phase": p.phase,
                "detail": f"{p.phase}: {type(cause).__name__}: {_first_line(cause)}",
                "where": _where(cause.__traceback__)}


# --------------------------------------------------------------------------- the survey


def families_to_survey() -> list[str]:
    from transformers import AutoModelForCausalLM
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    names = AutoModelForCausalLM._model_mapping._model_mapping  # type: ignore[attr-defined]
    return sorted(m for m in CONFIG_MAPPING.keys() if m in names)


def _child(model_type: str, result: Path, log: Path, workdir: Path) -> None:
    """In the child: stdout/stderr to the family's log, the result as JSON to result."""
    fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    try:
        out = check(model_type, workdir)
    except BaseException as err:  # anything check() did not classify
        out = {"status": "error", "detail": f"survey: {type(err).__name__}: {_first_line(err)}",
               "where": _where(err.__traceback__)}
    result.write_text(json.dumps(out))


def _tail(log: Path) -> str:
    try:
        lines = [ln for ln in log.read_text(errors="replace").splitlines() if ln.strip()]
    except OSError:
        return ""
    return lines[-1][:300] if lines else ""


def run(only: list[str] | None, timeout: float, jobs: int, fresh: bool) -> dict:
    import torch
    import transformers

    todo = families_to_survey()
    if only:
        unknown = sorted(set(only) - set(todo))
        if unknown:
            print(f"not causal-LM model_types here: {', '.join(unknown)}", file=sys.stderr)
        todo = [m for m in todo if m in only]
    if not fresh:  # imported once, inherited by every forked child
        import transformers.generation  # noqa: F401
        from transformers import AutoModelForCausalLM  # noqa: F401

        import inferencemesh.modeling.runtime  # noqa: F401
        torch.set_num_threads(1)
    tmp = Path(tempfile.mkdtemp(prefix="imesh-survey-"))
    results: dict[str, dict] = {}
    running: dict[str, tuple[Any, float]] = {}
    queue = list(todo)
    total = len(todo)

    def start(mt: str) -> None:
        work = tmp / "ckpt"
        work.mkdir(exist_ok=True)
        res, log = tmp / f"{mt}.json", tmp / f"{mt}.log"
        if fresh:
            proc: Any = subprocess.Popen(
                [sys.executable, __file__, "--child", mt, "--child-dir", str(tmp)],
                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
        else:
            pid = os.fork()
            if pid == 0:  # the child
                code = 0
                try:
                    os.setsid()
                    _child(mt, res, log, work)
                except BaseException:
                    code = 1
                finally:
                    os._exit(code)
            proc = pid
        running[mt] = (proc, time.monotonic())

    def finished(mt: str, proc: Any) -> int | None:
        """The exit status when the child ended (negative: killed by that signal), else None."""
        if fresh:
            return proc.poll()
        pid, status = os.waitpid(proc, os.WNOHANG)
        if pid == 0:
            return None
        return -os.WTERMSIG(status) if os.WIFSIGNALED(status) else os.WEXITSTATUS(status)

    def kill(proc: Any) -> None:
        pid = proc.pid if fresh else proc
        try:
            os.killpg(pid, signal.SIGKILL)  # the check and anything it started
        except ProcessLookupError:  # not yet its own group leader
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        if fresh:
            proc.wait()
        else:
            os.waitpid(pid, 0)

    while queue or running:
        while queue and len(running) < jobs:
            start(queue.pop(0))
        time.sleep(0.05)
        for mt, (proc, t0) in list(running.items()):
            code = finished(mt, proc)
            seconds = time.monotonic() - t0
            res, log = tmp / f"{mt}.json", tmp / f"{mt}.log"
            out: dict[str, Any]
            if code is None:
                if seconds <= timeout:
                    continue
                kill(proc)
                out = {"status": "error", "detail": f"timed out after {timeout:g} s (last output: {_tail(log)!r})"}
            elif res.exists():
                out = json.loads(res.read_text())
            else:
                what = f"killed by signal {-code}" if code < 0 else f"exited with status {code}"
                out = {"status": "error", "detail": f"the check's process {what} (last output: {_tail(log)!r})"}
            out["detail"] = out["detail"].replace(f"{tmp / 'ckpt'}/", "")  # no temporary paths in the report
            out["seconds"] = round(seconds, 1)
            results[mt] = out
            del running[mt]
            print(f"[{len(results):3d}/{total}] {mt:28s} {out['status']:9s} {out['seconds']:6.1f}s  "
                  f"{out['detail'][:150]}", flush=True)
    shutil.rmtree(tmp, ignore_errors=True)
    return {"transformers": transformers.__version__, "torch": torch.__version__,
            "command": "python tools/survey_families.py --json docs/benchmarks/families-survey.json",
            "families": dict(sorted(results.items()))}


def markdown(report: dict) -> str:
    """The survey section of docs/families.md, from a report (--markdown)."""
    import re

    fams = report["families"]
    by: dict[str, list[str]] = {}
    for mt, r in fams.items():
        by.setdefault(r["status"], []).append(mt)
    counts = ", ".join(f"{len(by.get(st, []))} {st}" for st in ("exact", "refused", "mismatch", "error", "skipped"))
    out = [f"{len(fams)} model_types with an `AutoModelForCausalLM` class (transformers {report['transformers']}, "
           f"torch {report['torch']}): {counts}.", ""]
    out += ["**exact** (greedy tokens equal to `generate()` at 2 and 1 stages, logprobs within 1e-4 + 1e-5·|lp|): "
            + ", ".join(f"`{m}`" for m in by.get("exact", [])), ""]
    for status, title in (("mismatch", "mismatch"), ("error", "error"), ("skipped", "skipped")):
        if not by.get(status):
            continue
        out += [f"**{title}**:", "", "| family | detail |", "|---|---|"]
        for mt in by[status]:
            r = fams[mt]
            kind = f" ({r['kind']})" if r.get("kind") else ""
            where = f" — at `{r['where']}`" if r.get("where") else ""
            out.append(f"| `{mt}`{kind} | {r['detail'].replace('|', '/')}{where} |")
        out.append("")
    groups: dict[str, list[str]] = {}
    for mt in by.get("refused", []):
        reason = re.sub(r" \(its default config.*$", "", fams[mt]["detail"])
        reason = re.sub(r"its decoder is model\.\w+, not model\.model", "its decoder is not model.model", reason)
        reason = re.sub(r"\(\w+Error: .*\)$", "(each one's error in the JSON)", reason)
        reason = re.sub(r"its layers include .*? \(", "its layers include non-attention kinds (", reason)
        reason = re.sub(r": it lacks .*$", "", reason)
        reason = re.sub(r"weights outside embed/layers/norm \(.*?\)", "weights outside embed/layers/norm", reason)
        reason = re.sub(r"holds \d+ layers for num_hidden_layers=\d+", "holds a different number of layers "
                        "than num_hidden_layers", reason)
        groups.setdefault(reason, []).append(mt)
    out += ["**refused** (`families.refusal`), by reason:", "", "| reason | families |", "|---|---|"]
    for reason, mts in sorted(groups.items(), key=lambda kv: -len(kv[1])):
        out.append(f"| {reason} | {', '.join(f'`{m}`' for m in mts)} |")
    return "\n".join(out) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--only", help="comma-separated model_types (default: every causal-LM family)")
    ap.add_argument("--json", help="write the results here")
    ap.add_argument("--timeout", type=float, default=120.0, help="seconds per family (default 120)")
    ap.add_argument("--jobs", type=int, default=2, help="checks at a time (default 2)")
    ap.add_argument("--fresh", action="store_true", help="a new interpreter per family instead of a fork")
    ap.add_argument("--markdown", metavar="JSON", help="print docs/families.md's survey tables from a report")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    ap.add_argument("--child-dir", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.markdown:
        print(markdown(json.loads(Path(args.markdown).read_text())), end="")
        return
    if args.child:  # --fresh: one family in this interpreter
        tmp = Path(args.child_dir)
        (tmp / "ckpt").mkdir(exist_ok=True)
        _child(args.child, tmp / f"{args.child}.json", tmp / f"{args.child}.log", tmp / "ckpt")
        return
    t0 = time.monotonic()
    only = [m.strip() for m in args.only.split(",") if m.strip()] if args.only else None
    report = run(only, args.timeout, max(1, args.jobs), args.fresh)
    counts: dict[str, int] = {}
    for r in report["families"].values():
        counts[r["status"]] = counts.get(r["status"], 0) + 1
    report["counts"] = dict(sorted(counts.items()))
    report["seconds"] = round(time.monotonic() - t0, 1)
    print(f"\n{len(report['families'])} families in {report['seconds']:.0f} s (transformers "
          f"{report['transformers']}, torch {report['torch']}):")
    for status in ("exact", "refused", "mismatch", "error", "skipped"):
        print(f"  {status:9s} {counts.get(status, 0)}")
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(report, indent=1) + "\n")
        print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
