"""The InferenceMesh spec as a typed, frozen pydantic model, with the CRD's cross-field rules.

The CRD (crds/inferencemesh.io_inferencemeshes.yaml) is the one source of truth, and this model
mirrors its `spec` schema: one field per CRD property (attribute in snake_case, alias the CRD's
camelCase name), the CRD's defaults as field defaults, its enums as Literals. test_spec.py walks
the schema and fails on any drift. A few read-only properties (model.pvc_claim,
frontend.service_port, metrics, ...) give the renderer short names for nested fields.

The API server applies the CRD's defaults and (from Kubernetes 1.25) its CEL rules; older servers
drop CEL silently, so `validate` repeats every rule here with the very same messages.
"""

from __future__ import annotations

import datetime
from typing import Any, Literal, NamedTuple

from pydantic import BaseModel, ConfigDict, Field, ValidationError
from pydantic.alias_generators import to_camel

from inferencemesh.config import DEFAULT_MAX_BATCH_TOKENS, kv_pool_tokens

MAX_STAGES = 64

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
MSG_EMBED_NODE_SELECTOR = ("frontend.embedFirstStage puts stage 0 in the frontend pod, which then needs both "
                           "nodeSelectors: frontend.nodeSelector and stages.nodeSelector must not give one key "
                           "different values")


class SpecError(ValueError):
    """The spec does not fit the model: only possible for an object the API server did not check
    against the current CRD (e.g. one stored before the CRD changed)."""


class _Spec(BaseModel):
    """Shared config: CRD names in, snake_case attributes out, immutable."""

    model_config = ConfigDict(alias_generator=to_camel, validate_by_alias=True, validate_by_name=True, frozen=True)


class Layout(_Spec):
    num_layers: int
    layer_bytes: int
    embed_bytes: int = 0
    head_bytes: int = 0
    kv_bytes_per_token: int = 0


class PvcSource(_Spec):
    claim_name: str
    sub_path: str = ""  # the claim's root


class ModelSpec(_Spec):
    name: str
    revision: str | None = None
    dtype: Literal["auto", "float32", "float16", "bfloat16"] = "auto"
    quantization: Literal["int8", "int4", "fp8"] | None = None
    served_model_name: str | None = None
    pvc: PvcSource | None = None
    layout: Layout | None = None

    @property
    def pvc_claim(self) -> str | None:
        return self.pvc.claim_name if self.pvc else None

    @property
    def pvc_sub_path(self) -> str:
        return self.pvc.sub_path if self.pvc else ""


class LayerRange(NamedTuple):
    """[start, end): a tuple, so the planner takes it as it is."""

    start: int
    end: int


class StagesSpec(_Spec):
    count: int | str = 2  # a number or "auto"
    memory: tuple[str, ...] = ()
    ranges: tuple[LayerRange, ...] | None = None  # None: absent (an empty list is present, and wrong)
    gpus: int = 1
    device: Literal["auto", "cpu", "cuda"] = "auto"
    resources: dict[str, Any] = {}
    node_selector: dict[str, str] = {}
    tolerations: tuple[dict[str, Any], ...] = ()
    affinity: dict[str, Any] = {}

    @property
    def on_cpu(self) -> bool:
        """Whether the stage pods compute on their CPU (asked to, or given no GPU)."""
        return self.device == "cpu" or not self.gpus


class ServiceSpec(_Spec):
    type: Literal["ClusterIP", "NodePort", "LoadBalancer"] = "ClusterIP"
    port: int = 8000


class SecretKeyRef(_Spec):
    name: str
    key: str = "api-key"


class FrontendSpec(_Spec):
    max_batch_tokens: int | None = None  # unset: the frontend's default (MeshSpec.max_batch_tokens)
    embed_first_stage: bool = False  # stage 0 runs in the frontend pod, which takes stage 0's place
    drain_timeout_seconds: int = Field(default=30, ge=0, le=3600)  # in-flight requests finish within this after SIGTERM
    pre_stop_seconds: int = Field(default=5, ge=0, le=300)  # first the pod stays up this long: endpoints forget it
    service: ServiceSpec = ServiceSpec()
    api_key: SecretKeyRef | None = Field(default=None, alias="apiKeySecret")
    resources: dict[str, Any] = {}
    node_selector: dict[str, str] = {}
    tolerations: tuple[dict[str, Any], ...] = ()

    @property
    def service_type(self) -> str:
        return self.service.type

    @property
    def service_port(self) -> int:
        return self.service.port

    @property
    def api_key_secret(self) -> str | None:
        return self.api_key.name if self.api_key else None

    @property
    def api_key_key(self) -> str | None:
        return self.api_key.key if self.api_key else None


class WindowSpec(_Spec):
    policy: Literal["fixed", "adaptive"] = "adaptive"
    size: int = 4
    initial: int = 4
    min: int = 1
    max: int = 8

    def flag(self) -> str:
        """The frontend's --window value."""
        if self.policy == "fixed":
            return str(self.size)
        return f"adaptive:{self.initial}:{self.min}:{self.max}"


class SpeculativeSpec(_Spec):
    # None (unset): the model package's declared strategy, else auto. Only an explicit value is passed on.
    strategy: Literal["auto", "draft", "ngram", "none"] | None = None
    draft: str | None = None
    no_draft: bool = False
    disable_by_batch_size: int | None = Field(default=None, ge=0, le=4096)
    window: WindowSpec | None = None  # unset: the package's declared window, else the frontend's default


class RouterSpec(_Spec):
    replicas: int = Field(default=2, ge=1, le=16)
    resources: dict[str, Any] = {}
    node_selector: dict[str, str] = {}
    tolerations: tuple[dict[str, Any], ...] = ()


class RolloutSpec(_Spec):
    max_surge: int = Field(default=1, ge=0, le=1)  # pipelines beyond spec.replicas while replacing them
    max_unavailable: int = Field(default=0, ge=0, le=16)  # serving pipelines below spec.replicas while replacing


class RestartBudgetSpec(_Spec):
    restarts: int = Field(default=5, ge=1, le=1000)  # container restarts of one pipeline's pods within the window
    window_seconds: int = Field(default=600, ge=60, le=86400)


class TelemetrySpec(_Spec):
    metrics: bool = True
    debug_tracing: bool = False


# A certificate lifetime: a whole number of seconds (at least 60), minutes or hours. The pattern
# itself refuses less than a minute, so every API server enforces it (CEL needs 1.25).
LIFETIME_PATTERN = r"^(([6-9][0-9]|[1-9][0-9]{2,7})s|[1-9][0-9]{0,6}m|[1-9][0-9]{0,5}h)$"
_LIFETIME_UNITS = {"s": 1, "m": 60, "h": 3600}


class SecuritySpec(_Spec):
    mtls_secret_name: str | None = None  # bring your own Secret (tls.crt, tls.key, ca.crt): it wins
    mtls: bool = True  # without a Secret of one's own: the operator issues the mesh's certificates
    certificate_lifetime: str = Field(default="2160h", pattern=LIFETIME_PATTERN)  # renewed at 2/3 of it

    @property
    def lifetime(self) -> datetime.timedelta:
        return datetime.timedelta(seconds=int(self.certificate_lifetime[:-1])
                                  * _LIFETIME_UNITS[self.certificate_lifetime[-1]])


class ImagesSpec(_Spec):
    stage: str | None = None
    frontend: str | None = None
    pull_policy: Literal["Always", "IfNotPresent", "Never"] = "IfNotPresent"
    pull_secrets: tuple[str, ...] = ()


class MeshSpec(_Spec):
    model: ModelSpec
    replicas: int = Field(default=1, ge=0, le=64)  # pipelines: each a frontend and its own stages (/scale)
    stages: StagesSpec = StagesSpec()
    frontend: FrontendSpec = FrontendSpec()
    router: RouterSpec = RouterSpec()
    restart_budget: RestartBudgetSpec = RestartBudgetSpec()
    rollout: RolloutSpec = RolloutSpec()
    speculative: SpeculativeSpec = SpeculativeSpec()
    wire_dtype: Literal["float32", "float16", "bfloat16"] | None = None
    context_length: int = 2048
    max_sessions: int = 256
    kv_cache_tokens: int = Field(default=0, ge=0, le=2**30)  # a stage's KV pool in positions (0: config.kv_pool_tokens)
    prefix_cache: bool = True
    telemetry: TelemetrySpec = TelemetrySpec()
    security: SecuritySpec = SecuritySpec()
    images: ImagesSpec = ImagesSpec()

    @property
    def metrics(self) -> bool:
        return self.telemetry.metrics

    @property
    def kv_pool_tokens(self) -> int:
        """A stage's KV pool in positions, decided as every program decides it."""
        return kv_pool_tokens(self.kv_cache_tokens, self.context_length)

    @property
    def debug_tracing(self) -> bool:
        return self.telemetry.debug_tracing

    @property
    def max_batch_tokens(self) -> int:
        """The frontend's microbatch budget: frontend.maxBatchTokens, else the frontend's own default."""
        given = self.frontend.max_batch_tokens
        return DEFAULT_MAX_BATCH_TOKENS if given is None else given

    @property
    def mtls_secret(self) -> str | None:
        return self.security.mtls_secret_name

    @property
    def issues_certificates(self) -> bool:
        """The operator makes the mesh's CA and certificates: mutual TLS on, no Secret of the user's."""
        return self.security.mtls and not self.security.mtls_secret_name

    @property
    def tls(self) -> bool:
        """Every gRPC hop (frontend to stage, stage to stage) is mutual TLS."""
        return self.security.mtls or bool(self.security.mtls_secret_name)


def parse_spec(spec: dict) -> MeshSpec:
    """Typed view of a (possibly un-defaulted) spec. Raises SpecError naming each bad field by its CRD path."""
    try:
        return MeshSpec.model_validate(spec)
    except ValidationError as exc:
        problems = (f"spec.{'.'.join(str(part) for part in e['loc'])}: {e['msg']}" for e in exc.errors())
        raise SpecError("; ".join(dict.fromkeys(problems))) from None


def validate(spec: MeshSpec) -> list[str]:
    """The CRD's CEL rules, evaluated in Python: the messages of every rule the spec breaks."""
    errors: list[str] = []
    if spec.model.pvc is not None and spec.model.layout is None:
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
    if any(r.start >= r.end for r in st.ranges or ()):
        errors.append(MSG_RANGE_ORDER)
    if st.ranges and not all(
        sum(1 for b in st.ranges if b.start < a.end and a.start < b.end) == 1 for a in st.ranges
    ):
        errors.append(MSG_RANGES_OVERLAP)
    sp = spec.speculative
    if sp.no_draft and sp.draft is not None:
        errors.append(MSG_DRAFT_NODRAFT)
    if sp.draft is not None and sp.strategy not in (None, "draft", "auto"):
        errors.append(MSG_DRAFT_STRATEGY)
    w = sp.window
    if w is not None and w.policy == "adaptive" and not (w.min <= w.initial <= w.max):
        errors.append(MSG_WINDOW)
    front = spec.frontend
    if front.embed_first_stage and any(st.node_selector.get(k, v) != v for k, v in front.node_selector.items()):
        errors.append(MSG_EMBED_NODE_SELECTOR)
    return errors
