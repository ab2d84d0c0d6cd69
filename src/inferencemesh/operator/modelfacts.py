"""What the operator knows about a mesh's model: the planner's inputs and where it read the model
(whose model-package.json the shared rule in inferencemesh.speculation reads, as the frontend does).

Sources, in order (documented in the CRD's model description):
  1. spec.model.layout        numbers carried in the spec (required for PVC models): no I/O at all
  2. bundled://NAME           a model shipped in the package (inferencemesh/bundled/NAME, or
                              $INFERENCEMESH_BUNDLED_DIR/NAME when that exists)
  3. an absolute path         a directory the operator can read (and the images, at the same path)
  4. anything else            a Hugging Face hub id: config.json + safetensors headers only
Hub answers are cached for a while, so reconciles do not hit the network each time.
"""

from __future__ import annotations

import re
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from inferencemesh.bundled import SCHEME, resolve_model
from inferencemesh.checkpoint.errors import CheckpointError
from inferencemesh.checkpoint.facts import CheckpointFacts
from inferencemesh.checkpoint.hub import hub_errors
from inferencemesh.checkpoint.quantization import quant_method
from inferencemesh.checkpoint.read import read_hub, read_local
from inferencemesh.operator.spec import Layout, MeshSpec
from inferencemesh.planner import DEFAULT_OVERHEAD_BYTES, PlanError, PlanInputs

HUB_CACHE_SECONDS = 600.0
HUB_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,95}(/[A-Za-z0-9][A-Za-z0-9._-]{0,95})?")


class ModelUnavailable(RuntimeError):
    """The model could not be read right now (network, hub outage): worth retrying later."""


@dataclass(frozen=True)
class ModelInfo:
    inputs: PlanInputs
    source: str  # "layout" | "bundled" | "local" | "hub"
    # Where the operator read a bundled or local model: its model-package.json, and a package's relative draft.
    model_dir: Path | None = None
    facts: CheckpointFacts | None = None  # None: known only by spec.model.layout


def check_quantization(facts: CheckpointFacts, method: str | None, where: str) -> None:
    """Refuse quantizing at load (`method`: spec.model.quantization, and `plan`'s and `serve`'s
    --quantization, which call this) a checkpoint that is quantized already, in one line, at plan
    time: the plan would count its layers as if they were 16-bit, and the stages' loader refuses it
    (modeling/quantized_load.quantizer)."""
    if method is not None and (quant_method(facts.config) or facts.quantized_modules()):
        raise CheckpointError(f"{where}: the checkpoint is quantized already ({quant_method(facts.config)}), so it "
                              f"cannot be quantized again as {method} at load: serve it as it is, without "
                              "--quantization (spec.model.quantization)")


def layout_of(facts: CheckpointFacts, *, dtype: str | None, on_cpu: bool, quantization: str | None = None) -> Layout:
    """spec.model.layout for a checkpoint the operator cannot read (spec.model.pvc), in the
    planner's own terms (inputs_from_layout reads it back): its sizes in the compute dtype (its
    layers quantized at load with `quantization`), the KV bytes per token and layer, and one size
    for every layer, the largest (an uneven MoE is then planned as if every layer were its
    heaviest: never short of memory)."""
    inputs = PlanInputs.from_checkpoint(facts, dtype=dtype, kv_tokens=1, on_cpu=on_cpu, quantization=quantization)
    return Layout(num_layers=facts.num_layers, layer_bytes=max(inputs.layer_bytes), embed_bytes=inputs.embed_bytes,
                  head_bytes=inputs.tail_bytes, kv_bytes_per_token=inputs.kv_bytes_per_layer)


def inputs_from_layout(spec: MeshSpec) -> PlanInputs:
    layout = spec.model.layout
    assert layout is not None
    return PlanInputs(
        layer_bytes=(layout.layer_bytes,) * layout.num_layers,
        embed_bytes=layout.embed_bytes,
        tail_bytes=layout.head_bytes,
        kv_bytes_per_layer=layout.kv_bytes_per_token * spec.kv_pool_tokens,
        overhead_bytes=DEFAULT_OVERHEAD_BYTES,
    )


class ModelFacts:
    """Reads and caches model facts; one instance per operator process."""

    def __init__(self, hub_ttl: float = HUB_CACHE_SECONDS) -> None:
        self._hub_ttl = hub_ttl
        self._hub: dict[tuple[str, str | None], tuple[float, CheckpointFacts]] = {}
        self._lock = threading.Lock()

    def info(self, spec: MeshSpec) -> ModelInfo:
        """Planner inputs for the spec. Raises CheckpointError/PlanError (permanent) or ModelUnavailable."""
        model = spec.model
        if model.layout is not None:
            return ModelInfo(inputs_from_layout(spec), "layout")
        if model.name.startswith(SCHEME):
            path = Path(resolve_model(model.name))
            facts = read_local(path)
            return ModelInfo(self._inputs(facts, spec), "bundled", path, facts)
        if model.name.startswith("/"):
            path = Path(model.name)
            if not path.is_dir():
                raise CheckpointError(f"{model.name}: not a directory the operator can read; "
                                      "give model.layout, or use a hub id or bundled://NAME")
            facts = read_local(path)
            return ModelInfo(self._inputs(facts, spec), "local", path, facts)
        if not HUB_ID.fullmatch(model.name):
            raise CheckpointError(f"{model.name!r} is not a hub id (org/name), bundled://NAME or an absolute path")
        facts = self._hub_facts(model.name, model.revision)
        return ModelInfo(self._inputs(facts, spec), "hub", facts=facts)

    def draft_facts(self, draft: str, info: ModelInfo) -> CheckpointFacts:
        """The checkpoint facts of a draft model the frontend will load: bundled://NAME, an absolute
        path, a path relative to the model package (as model-package.json names it), or a hub id.
        Raises CheckpointError (the operator cannot read it) or ModelUnavailable (retry)."""
        if draft.startswith(SCHEME):
            return read_local(Path(resolve_model(draft)))
        if draft.startswith("/"):
            return read_local(draft)
        if info.model_dir is not None and (draft.startswith(".") or (info.model_dir / draft).exists()):
            return read_local((info.model_dir / draft).resolve())
        if not HUB_ID.fullmatch(draft):
            raise CheckpointError(f"{draft!r} is not a hub id (org/name), bundled://NAME or a path the operator reads")
        return self._hub_facts(draft, None)

    @staticmethod
    def _inputs(facts: CheckpointFacts, spec: MeshSpec) -> PlanInputs:
        if facts.num_layers < 1:
            raise PlanError(f"the model declares {facts.num_layers} layers: at least one is needed")
        check_quantization(facts, spec.model.quantization, spec.model.name)
        # The stage chooses auto's dtype on its node, whose CPU the operator cannot see: CPU stages
        # are planned for float32 (the larger; a stage with native bf16 units holds less). With
        # spec.model.quantization the stages quantize their layers as they load them: planned so.
        return PlanInputs.from_checkpoint(
            facts, dtype=spec.model.dtype, kv_tokens=spec.kv_pool_tokens, on_cpu=spec.stages.on_cpu,
            cpu_flags=frozenset(), quantization=spec.model.quantization)

    def _hub_facts(self, repo_id: str, revision: str | None) -> CheckpointFacts:
        key = (repo_id, revision)
        with self._lock:
            hit = self._hub.get(key)
            if hit and time.monotonic() - hit[0] < self._hub_ttl:
                return hit[1]
        try:
            with hub_errors(repo_id):  # the same one-line wording as the CLI's
                facts = read_hub(repo_id, revision=revision)
        except CheckpointError as exc:
            if exc.__cause__ is None:
                raise  # the checkpoint itself is unusable: permanent
            raise ModelUnavailable(str(exc)) from exc  # unreachable or not cached: retried later
        except Exception as exc:  # noqa: BLE001 - auth, missing repo: retried later too
            first_line = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
            raise ModelUnavailable(f"cannot read {repo_id!r} from the hub: {type(exc).__name__}: {first_line}") from exc
        with self._lock:
            self._hub[key] = (time.monotonic(), facts)
        return facts
