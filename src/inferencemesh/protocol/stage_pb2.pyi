from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

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
    __slots__ = ("temperature", "top_p", "top_k", "seed", "presence_penalty", "frequency_penalty", "repetition_penalty", "logit_bias", "min_tokens", "stop_token_ids", "prompt_tokens", "logprobs", "top_logprobs")
    class LogitBiasEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: int
        value: float
        def __init__(self, key: _Optional[int] = ..., value: _Optional[float] = ...) -> None: ...
    TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    TOP_P_FIELD_NUMBER: _ClassVar[int]
    TOP_K_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    PRESENCE_PENALTY_FIELD_NUMBER: _ClassVar[int]
    FREQUENCY_PENALTY_FIELD_NUMBER: _ClassVar[int]
    REPETITION_PENALTY_FIELD_NUMBER: _ClassVar[int]
    LOGIT_BIAS_FIELD_NUMBER: _ClassVar[int]
    MIN_TOKENS_FIELD_NUMBER: _ClassVar[int]
    STOP_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    TOP_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    temperature: float
    top_p: float
    top_k: int
    seed: int
    presence_penalty: float
    frequency_penalty: float
    repetition_penalty: float
    logit_bias: _containers.ScalarMap[int, float]
    min_tokens: int
    stop_token_ids: _containers.RepeatedScalarFieldContainer[int]
    prompt_tokens: int
    logprobs: bool
    top_logprobs: int
    def __init__(self, temperature: _Optional[float] = ..., top_p: _Optional[float] = ..., top_k: _Optional[int] = ..., seed: _Optional[int] = ..., presence_penalty: _Optional[float] = ..., frequency_penalty: _Optional[float] = ..., repetition_penalty: _Optional[float] = ..., logit_bias: _Optional[_Mapping[int, float]] = ..., min_tokens: _Optional[int] = ..., stop_token_ids: _Optional[_Iterable[int]] = ..., prompt_tokens: _Optional[int] = ..., logprobs: _Optional[bool] = ..., top_logprobs: _Optional[int] = ...) -> None: ...

class Frame(_message.Message):
    __slots__ = ("session_id", "request_id", "kind", "pos_start", "token_count", "token_ids", "want_prediction", "sampling", "seq", "sent_ns", "prompt_logprobs", "token_masks", "kv_blocks", "draft_q")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    KIND_FIELD_NUMBER: _ClassVar[int]
    POS_START_FIELD_NUMBER: _ClassVar[int]
    TOKEN_COUNT_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    WANT_PREDICTION_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    SEQ_FIELD_NUMBER: _ClassVar[int]
    SENT_NS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    TOKEN_MASKS_FIELD_NUMBER: _ClassVar[int]
    KV_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    DRAFT_Q_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    request_id: str
    kind: FrameKind
    pos_start: int
    token_count: int
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    want_prediction: bool
    sampling: Sampling
    seq: int
    sent_ns: int
    prompt_logprobs: bool
    token_masks: bytes
    kv_blocks: _containers.RepeatedScalarFieldContainer[int]
    draft_q: DraftDistributions
    def __init__(self, session_id: _Optional[str] = ..., request_id: _Optional[str] = ..., kind: _Optional[_Union[FrameKind, str]] = ..., pos_start: _Optional[int] = ..., token_count: _Optional[int] = ..., token_ids: _Optional[_Iterable[int]] = ..., want_prediction: _Optional[bool] = ..., sampling: _Optional[_Union[Sampling, _Mapping]] = ..., seq: _Optional[int] = ..., sent_ns: _Optional[int] = ..., prompt_logprobs: _Optional[bool] = ..., token_masks: _Optional[bytes] = ..., kv_blocks: _Optional[_Iterable[int]] = ..., draft_q: _Optional[_Union[DraftDistributions, _Mapping]] = ...) -> None: ...

class DraftDistributions(_message.Message):
    __slots__ = ("sizes", "token_ids", "probs", "remainders")
    SIZES_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    PROBS_FIELD_NUMBER: _ClassVar[int]
    REMAINDERS_FIELD_NUMBER: _ClassVar[int]
    sizes: _containers.RepeatedScalarFieldContainer[int]
    token_ids: bytes
    probs: bytes
    remainders: _containers.RepeatedScalarFieldContainer[float]
    def __init__(self, sizes: _Optional[_Iterable[int]] = ..., token_ids: _Optional[bytes] = ..., probs: _Optional[bytes] = ..., remainders: _Optional[_Iterable[float]] = ...) -> None: ...

class Batch(_message.Message):
    __slots__ = ("seq", "frames", "dtype", "hidden_size", "activations", "failures")
    SEQ_FIELD_NUMBER: _ClassVar[int]
    FRAMES_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    HIDDEN_SIZE_FIELD_NUMBER: _ClassVar[int]
    ACTIVATIONS_FIELD_NUMBER: _ClassVar[int]
    FAILURES_FIELD_NUMBER: _ClassVar[int]
    seq: int
    frames: _containers.RepeatedCompositeFieldContainer[Frame]
    dtype: DType
    hidden_size: int
    activations: bytes
    failures: _containers.RepeatedCompositeFieldContainer[Failure]
    def __init__(self, seq: _Optional[int] = ..., frames: _Optional[_Iterable[_Union[Frame, _Mapping]]] = ..., dtype: _Optional[_Union[DType, str]] = ..., hidden_size: _Optional[int] = ..., activations: _Optional[bytes] = ..., failures: _Optional[_Iterable[_Union[Failure, _Mapping]]] = ...) -> None: ...

class Failure(_message.Message):
    __slots__ = ("session_id", "seq", "kind", "code", "message", "stage_index")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    SEQ_FIELD_NUMBER: _ClassVar[int]
    KIND_FIELD_NUMBER: _ClassVar[int]
    CODE_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    STAGE_INDEX_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    seq: int
    kind: FrameKind
    code: int
    message: str
    stage_index: int
    def __init__(self, session_id: _Optional[str] = ..., seq: _Optional[int] = ..., kind: _Optional[_Union[FrameKind, str]] = ..., code: _Optional[int] = ..., message: _Optional[str] = ..., stage_index: _Optional[int] = ...) -> None: ...

class BatchResult(_message.Message):
    __slots__ = ("seq", "predictions", "acks", "failures")
    SEQ_FIELD_NUMBER: _ClassVar[int]
    PREDICTIONS_FIELD_NUMBER: _ClassVar[int]
    ACKS_FIELD_NUMBER: _ClassVar[int]
    FAILURES_FIELD_NUMBER: _ClassVar[int]
    seq: int
    predictions: _containers.RepeatedCompositeFieldContainer[Prediction]
    acks: _containers.RepeatedCompositeFieldContainer[Ack]
    failures: _containers.RepeatedCompositeFieldContainer[Failure]
    def __init__(self, seq: _Optional[int] = ..., predictions: _Optional[_Iterable[_Union[Prediction, _Mapping]]] = ..., acks: _Optional[_Iterable[_Union[Ack, _Mapping]]] = ..., failures: _Optional[_Iterable[_Union[Failure, _Mapping]]] = ...) -> None: ...

class Ack(_message.Message):
    __slots__ = ("seq", "session_id", "kind")
    SEQ_FIELD_NUMBER: _ClassVar[int]
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    KIND_FIELD_NUMBER: _ClassVar[int]
    seq: int
    session_id: str
    kind: FrameKind
    def __init__(self, seq: _Optional[int] = ..., session_id: _Optional[str] = ..., kind: _Optional[_Union[FrameKind, str]] = ...) -> None: ...

class Prediction(_message.Message):
    __slots__ = ("session_id", "seq", "pos_start", "tokens", "accepted", "logprobs", "prompt_logprobs")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    SEQ_FIELD_NUMBER: _ClassVar[int]
    POS_START_FIELD_NUMBER: _ClassVar[int]
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    ACCEPTED_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    seq: int
    pos_start: int
    tokens: _containers.RepeatedScalarFieldContainer[int]
    accepted: int
    logprobs: _containers.RepeatedCompositeFieldContainer[TokenLogprobs]
    prompt_logprobs: _containers.RepeatedCompositeFieldContainer[TokenLogprobs]
    def __init__(self, session_id: _Optional[str] = ..., seq: _Optional[int] = ..., pos_start: _Optional[int] = ..., tokens: _Optional[_Iterable[int]] = ..., accepted: _Optional[int] = ..., logprobs: _Optional[_Iterable[_Union[TokenLogprobs, _Mapping]]] = ..., prompt_logprobs: _Optional[_Iterable[_Union[TokenLogprobs, _Mapping]]] = ...) -> None: ...

class TokenLogprobs(_message.Message):
    __slots__ = ("token", "logprob", "top_tokens", "top_logprobs")
    TOKEN_FIELD_NUMBER: _ClassVar[int]
    LOGPROB_FIELD_NUMBER: _ClassVar[int]
    TOP_TOKENS_FIELD_NUMBER: _ClassVar[int]
    TOP_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    token: int
    logprob: float
    top_tokens: _containers.RepeatedScalarFieldContainer[int]
    top_logprobs: _containers.RepeatedScalarFieldContainer[float]
    def __init__(self, token: _Optional[int] = ..., logprob: _Optional[float] = ..., top_tokens: _Optional[_Iterable[int]] = ..., top_logprobs: _Optional[_Iterable[float]] = ...) -> None: ...

class InfoRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class StageInfo(_message.Message):
    __slots__ = ("model", "stage_index", "num_stages", "layer_start", "layer_end", "num_layers", "is_first", "is_last", "state", "state_reason", "progress", "hidden_size", "vocab_size", "wire_dtype", "active_sessions", "max_sessions", "max_context", "device", "kv_block_tokens", "kv_blocks")
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
    KV_BLOCK_TOKENS_FIELD_NUMBER: _ClassVar[int]
    KV_BLOCKS_FIELD_NUMBER: _ClassVar[int]
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
    kv_block_tokens: int
    kv_blocks: int
    def __init__(self, model: _Optional[str] = ..., stage_index: _Optional[int] = ..., num_stages: _Optional[int] = ..., layer_start: _Optional[int] = ..., layer_end: _Optional[int] = ..., num_layers: _Optional[int] = ..., is_first: _Optional[bool] = ..., is_last: _Optional[bool] = ..., state: _Optional[str] = ..., state_reason: _Optional[str] = ..., progress: _Optional[float] = ..., hidden_size: _Optional[int] = ..., vocab_size: _Optional[int] = ..., wire_dtype: _Optional[_Union[DType, str]] = ..., active_sessions: _Optional[int] = ..., max_sessions: _Optional[int] = ..., max_context: _Optional[int] = ..., device: _Optional[str] = ..., kv_block_tokens: _Optional[int] = ..., kv_blocks: _Optional[int] = ...) -> None: ...
