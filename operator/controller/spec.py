"""The InferenceMesh spec as typed values, with the CRD's defaults and its cross-field rules.

The API server applies the CRD's defaults and (from Kubernetes 1.25) its CEL rules; older servers
drop CEL silently, so `validate` repeats every rule here with the very same messages. Tests keep
the defaults (test_spec.py walks the CRD schema) and the rules (evaluated with cel-python) in step.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

MAX_STAGES = 64
MAX_LAYERS = 256

# Messages are copied verbatim from the CRD's x-kubernetes-validations.
MSG_COUNT = "stages.count must be a number or 'auto'"
MSG_AUTO_MEMORY = "stages.count auto needs exactly one stages.memory value (the memory of each stage)"
MSG_MEMORY_COUNT = "stages.memory needs one value for all stages or one per stage"
MSG_RANGES_COUNT = "stages.ranges needs one range per stage (stages.count must equal the number of ranges)"
MSG_RANGES_OVERLAP = "stages.ranges must not overlap"
MSG_RANGE_ORDER = "a layer range's start must be below its end"
MSG_PVC_LAYOUT = "model.pvc needs model.layout: the operator does not mount the claim to read the checkpoint"
MSG_DRAFT_NODRAFT = "speculative.draft and speculative.noDraft cannot both be set"
MSG_DRAFT_STRATEGY = "speculative.draft is only used with strategy draft or auto"
MSG_WINDOW = "speculative.window needs min <= initial <= max"


@dataclass(frozen=True)
class Layout:
    num_layers: int
    layer_bytes: int
    embed_bytes: int = 0
    head_bytes: int = 0
    kv_bytes_per_token: int = 0


@dataclass(frozen=True)
class ModelSpec:
    name: str
    revision: str | None = None
    dtype: str = "auto"
    served_model_name: str | None = None
    pvc_claim: str | None = None
    pvc_sub_path: str = ""
    layout: Layout | None = None


@dataclass(frozen=True)
class StagesSpec:
    count: int | str = 2  # a number or "auto"
    memory: tuple[str, ...] = ()
    ranges: tuple[tuple[int, int], ...] | None = None  # None: absent (an empty list is present, and wrong)
    gpus: int = 1
    device: str = "auto"
    max_batch_tokens: int = 256
    resources: dict = field(default_factory=dict)
    node_selector: dict = field(default_factory=dict)
    tolerations: tuple[dict, ...] = ()
    affinity: dict = field(default_factory=dict)


@dataclass(frozen=True)
class FrontendSpec:
    replicas: int = 1
    service_type: str = "ClusterIP"
    service_port: int = 8000
    api_key_secret: str | None = None
    api_key_key: str = "api-key"
    resources: dict = field(default_factory=dict)
    node_selector: dict = field(default_factory=dict)
    tolerations: tuple[dict, ...] = ()


@dataclass(frozen=True)
class WindowSpec:
    policy: str = "adaptive"
    size: int = 4
    initial: int = 4
    min: int = 1
    max: int = 8

    def flag(self) -> str:
        """The frontend's --window value."""
        if self.policy == "fixed":
            return str(self.size)
        return f"adaptive:{self.initial}:{self.min}:{self.max}"


@dataclass(frozen=True)
class SpeculativeSpec:
    strategy: str = "auto"
    draft: str | None = None
    no_draft: bool = False
    window: WindowSpec = field(default_factory=WindowSpec)


@dataclass(frozen=True)
class ImagesSpec:
    stage: str | None = None
    frontend: str | None = None
    pull_policy: str = "IfNotPresent"
    pull_secrets: tuple[str, ...] = ()


@dataclass(frozen=True)
class MeshSpec:
    model: ModelSpec
    stages: StagesSpec = field(default_factory=StagesSpec)
    frontend: FrontendSpec = field(default_factory=FrontendSpec)
    speculative: SpeculativeSpec = field(default_factory=SpeculativeSpec)
    wire_dtype: str | None = None
    context_length: int = 2048
    max_sessions: int = 16
    metrics: bool = True
    debug_tracing: bool = False
    images: ImagesSpec = field(default_factory=ImagesSpec)
    mtls_secret: str | None = None  # Secret with tls.crt, tls.key, ca.crt: mutual TLS on every gRPC hop


def _obj(value: Any) -> dict:
    return value if isinstance(value, dict) else {}


def parse_spec(spec: dict) -> MeshSpec:
    """Typed view of a (possibly un-defaulted) spec. Shapes the schema guarantees are trusted."""
    model = _obj(spec.get("model"))
    layout = _obj(model.get("layout"))
    pvc = _obj(model.get("pvc"))
    stages = _obj(spec.get("stages"))
    frontend = _obj(spec.get("frontend"))
    service = _obj(frontend.get("service"))
    api_key = _obj(frontend.get("apiKeySecret"))
    spec_ = _obj(spec.get("speculative"))
    window = _obj(spec_.get("window"))
    telemetry = _obj(spec.get("telemetry"))
    images = _obj(spec.get("images"))
    security = _obj(spec.get("security"))
    return MeshSpec(
        mtls_secret=security.get("mtlsSecretName"),
        model=ModelSpec(
            name=str(model.get("name", "")),
            revision=model.get("revision"),
            dtype=model.get("dtype", "auto"),
            served_model_name=model.get("servedModelName"),
            pvc_claim=pvc.get("claimName"),
            pvc_sub_path=pvc.get("subPath", ""),
            layout=Layout(
                num_layers=int(layout["numLayers"]),
                layer_bytes=int(layout["layerBytes"]),
                embed_bytes=int(layout.get("embedBytes", 0)),
                head_bytes=int(layout.get("headBytes", 0)),
                kv_bytes_per_token=int(layout.get("kvBytesPerToken", 0)),
            ) if layout else None,
        ),
        stages=StagesSpec(
            count=stages.get("count", 2),
            memory=tuple(stages.get("memory") or ()),
            ranges=None if stages.get("ranges") is None else tuple(
                (int(r.get("start", 0)), int(r.get("end", 0))) for r in stages["ranges"]),
            gpus=int(stages.get("gpus", 1)),
            device=stages.get("device", "auto"),
            max_batch_tokens=int(stages.get("maxBatchTokens", 256)),
            resources=_obj(stages.get("resources")),
            node_selector=_obj(stages.get("nodeSelector")),
            tolerations=tuple(stages.get("tolerations") or ()),
            affinity=_obj(stages.get("affinity")),
        ),
        frontend=FrontendSpec(
            replicas=int(frontend.get("replicas", 1)),
            service_type=service.get("type", "ClusterIP"),
            service_port=int(service.get("port", 8000)),
            api_key_secret=api_key.get("name"),
            api_key_key=api_key.get("key", "api-key"),
            resources=_obj(frontend.get("resources")),
            node_selector=_obj(frontend.get("nodeSelector")),
            tolerations=tuple(frontend.get("tolerations") or ()),
        ),
        speculative=SpeculativeSpec(
            strategy=spec_.get("strategy", "auto"),
            draft=spec_.get("draft"),
            no_draft=bool(spec_.get("noDraft", False)),
            window=WindowSpec(
                policy=window.get("policy", "adaptive"),
                size=int(window.get("size", 4)),
                initial=int(window.get("initial", 4)),
                min=int(window.get("min", 1)),
                max=int(window.get("max", 8)),
            ),
        ),
        wire_dtype=spec.get("wireDtype"),
        context_length=int(spec.get("contextLength", 2048)),
        max_sessions=int(spec.get("maxSessions", 16)),
        metrics=bool(telemetry.get("metrics", True)),
        debug_tracing=bool(telemetry.get("debugTracing", False)),
        images=ImagesSpec(
            stage=images.get("stage"),
            frontend=images.get("frontend"),
            pull_policy=images.get("pullPolicy", "IfNotPresent"),
            pull_secrets=tuple(images.get("pullSecrets") or ()),
        ),
    )


def validate(spec: MeshSpec) -> list[str]:
    """The CRD's CEL rules, evaluated in Python: the messages of every rule the spec breaks."""
    errors: list[str] = []
    if spec.model.pvc_claim and spec.model.layout is None:
        errors.append(MSG_PVC_LAYOUT)
    st = spec.stages
    count_is_int = isinstance(st.count, int) and not isinstance(st.count, bool)
    if not (count_is_int or st.count == "auto"):
        errors.append(MSG_COUNT)
    if not count_is_int and len(st.memory) != 1:
        errors.append(MSG_AUTO_MEMORY)
    if len(st.memory) > 1 and count_is_int and len(st.memory) != st.count:
        errors.append(MSG_MEMORY_COUNT)
    if st.ranges is not None and not (count_is_int and len(st.ranges) == st.count):
        errors.append(MSG_RANGES_COUNT)
    if any(start >= end for start, end in st.ranges or ()):
        errors.append(MSG_RANGE_ORDER)
    if st.ranges and not all(
        sum(1 for b in st.ranges if b[0] < a[1] and a[0] < b[1]) == 1 for a in st.ranges
    ):
        errors.append(MSG_RANGES_OVERLAP)
    sp = spec.speculative
    if sp.no_draft and sp.draft is not None:
        errors.append(MSG_DRAFT_NODRAFT)
    if sp.draft is not None and sp.strategy not in ("draft", "auto"):
        errors.append(MSG_DRAFT_STRATEGY)
    w = sp.window
    if w.policy == "adaptive" and not (w.min <= w.initial <= w.max):
        errors.append(MSG_WINDOW)
    return errors
