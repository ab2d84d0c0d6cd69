from collections.abc import Iterable as _Iterable
from collections.abc import Mapping as _Mapping
from typing import ClassVar as _ClassVar

from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper

DESCRIPTOR: _descriptor.FileDescriptor

class FrameKind(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    FRAME_KIND_UNSPECIFIED: _ClassVar[FrameKind]
    PREFILL: _ClassVar[FrameKind]
    DECODE: _ClassVar[FrameKind]
    VERIFY: _ClassVar[FrameKind]
    RELEASE: _ClassVar[FrameKind]

class DType(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    DTYPE_UNSPECIFIED: _ClassVar[DType]
    F32: _ClassVar[DType]
    F16: _ClassVar[DType]
    BF16: _ClassVar[DType]
FRAME_KIND_UNSPECIFIED: FrameKind
PREFILL: FrameKind
DECODE: FrameKind
VERIFY: FrameKind
RELEASE: FrameKind
DTYPE_UNSPECIFIED: DType
F32: DType
F16: DType
BF16: DType

class Sampling(_message.Message):
    __slots__ = ("temperature", "top_p", "top_k", "seed")
    TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    TOP_P_FIELD_NUMBER: _ClassVar[int]
    TOP_K_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    temperature: float
    top_p: float
    top_k: int
    seed: int
    def __init__(self, temperature: float | None = ..., top_p: float | None = ..., top_k: int | None = ..., seed: int | None = ...) -> None: ...

class Frame(_message.Message):
    __slots__ = ("session_id", "request_id", "kind", "pos_start", "token_count", "token_ids", "dtype", "shape", "activations", "want_prediction", "sampling", "draft_probs", "seq", "sent_ns")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    KIND_FIELD_NUMBER: _ClassVar[int]
    POS_START_FIELD_NUMBER: _ClassVar[int]
    TOKEN_COUNT_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    SHAPE_FIELD_NUMBER: _ClassVar[int]
    ACTIVATIONS_FIELD_NUMBER: _ClassVar[int]
    WANT_PREDICTION_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    DRAFT_PROBS_FIELD_NUMBER: _ClassVar[int]
    SEQ_FIELD_NUMBER: _ClassVar[int]
    SENT_NS_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    request_id: str
    kind: FrameKind
    pos_start: int
    token_count: int
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    dtype: DType
    shape: _containers.RepeatedScalarFieldContainer[int]
    activations: bytes
    want_prediction: bool
    sampling: Sampling
    draft_probs: bytes
    seq: int
    sent_ns: int
    def __init__(self, session_id: str | None = ..., request_id: str | None = ..., kind: FrameKind | str | None = ..., pos_start: int | None = ..., token_count: int | None = ..., token_ids: _Iterable[int] | None = ..., dtype: DType | str | None = ..., shape: _Iterable[int] | None = ..., activations: bytes | None = ..., want_prediction: bool | None = ..., sampling: Sampling | _Mapping | None = ..., draft_probs: bytes | None = ..., seq: int | None = ..., sent_ns: int | None = ...) -> None: ...

class Ack(_message.Message):
    __slots__ = ("seq", "session_id")
    SEQ_FIELD_NUMBER: _ClassVar[int]
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    seq: int
    session_id: str
    def __init__(self, seq: int | None = ..., session_id: str | None = ...) -> None: ...

class ResultsRequest(_message.Message):
    __slots__ = ("session_id",)
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    def __init__(self, session_id: str | None = ...) -> None: ...

class Prediction(_message.Message):
    __slots__ = ("session_id", "seq", "pos_start", "tokens", "accepted")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    SEQ_FIELD_NUMBER: _ClassVar[int]
    POS_START_FIELD_NUMBER: _ClassVar[int]
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    ACCEPTED_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    seq: int
    pos_start: int
    tokens: _containers.RepeatedScalarFieldContainer[int]
    accepted: int
    def __init__(self, session_id: str | None = ..., seq: int | None = ..., pos_start: int | None = ..., tokens: _Iterable[int] | None = ..., accepted: int | None = ...) -> None: ...

class InfoRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class StageInfo(_message.Message):
    __slots__ = ("model", "stage_index", "num_stages", "layer_start", "layer_end", "num_layers", "is_first", "is_last", "state", "state_reason", "progress", "hidden_size", "vocab_size", "wire_dtype", "active_sessions", "max_sessions", "max_context", "device")
    MODEL_FIELD_NUMBER: _ClassVar[int]
    STAGE_INDEX_FIELD_NUMBER: _ClassVar[int]
    NUM_STAGES_FIELD_NUMBER: _ClassVar[int]
    LAYER_START_FIELD_NUMBER: _ClassVar[int]
    LAYER_END_FIELD_NUMBER: _ClassVar[int]
    NUM_LAYERS_FIELD_NUMBER: _ClassVar[int]
    IS_FIRST_FIELD_NUMBER: _ClassVar[int]
    IS_LAST_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    STATE_REASON_FIELD_NUMBER: _ClassVar[int]
    PROGRESS_FIELD_NUMBER: _ClassVar[int]
    HIDDEN_SIZE_FIELD_NUMBER: _ClassVar[int]
    VOCAB_SIZE_FIELD_NUMBER: _ClassVar[int]
    WIRE_DTYPE_FIELD_NUMBER: _ClassVar[int]
    ACTIVE_SESSIONS_FIELD_NUMBER: _ClassVar[int]
    MAX_SESSIONS_FIELD_NUMBER: _ClassVar[int]
    MAX_CONTEXT_FIELD_NUMBER: _ClassVar[int]
    DEVICE_FIELD_NUMBER: _ClassVar[int]
    model: str
    stage_index: int
    num_stages: int
    layer_start: int
    layer_end: int
    num_layers: int
    is_first: bool
    is_last: bool
    state: str
    state_reason: str
    progress: float
    hidden_size: int
    vocab_size: int
    wire_dtype: DType
    active_sessions: int
    max_sessions: int
    max_context: int
    device: str
    def __init__(self, model: str | None = ..., stage_index: int | None = ..., num_stages: int | None = ..., layer_start: int | None = ..., layer_end: int | None = ..., num_layers: int | None = ..., is_first: bool | None = ..., is_last: bool | None = ..., state: str | None = ..., state_reason: str | None = ..., progress: float | None = ..., hidden_size: int | None = ..., vocab_size: int | None = ..., wire_dtype: DType | str | None = ..., active_sessions: int | None = ..., max_sessions: int | None = ..., max_context: int | None = ..., device: str | None = ...) -> None: ...
