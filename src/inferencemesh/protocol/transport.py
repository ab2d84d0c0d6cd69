"""Facts both ends of a stage connection must agree on: service name, channel options, and
which frames are answered with a Prediction or an Ack."""

from __future__ import annotations

from inferencemesh.protocol import stage_pb2 as pb

SERVICE_NAME = "inferencemesh.v1.Stage"
# The message limit of a stage stream whose model nobody told it (a stage or frontend started by
# hand without --max-message-bytes): the programs that plan a mesh (serve, bench, the operator)
# give both ends message_limit(...) instead, the largest Batch the plan can make.
FALLBACK_MESSAGE_BYTES = 256 * 1024 * 1024

# Positions per KV block, at every stage and in the frontend's block manager (docs/design/kv-blocks.md).
KV_BLOCK_TOKENS = 16

# What bounds a Batch. The frontend keeps to these (its step scheduler and sessions), and
# message_limit adds them up.
PREFILL_CHUNK_TOKENS = 256  # prompt tokens per PREFILL frame; a batch's first chunk always goes
MAX_WINDOW = 64  # draft tokens one VERIFY frame may carry
# Rows of draft distributions in one Batch: sixteen sessions at the default adaptive window's
# maximum (8). More wait for the next microbatch; one full window always fits.
MAX_DRAFT_ROWS_PER_BATCH = 128
# Tokens a draft distribution's row lists (Frame.draft_q); its remainder covers the rest. 1024 keep
# the bundled draft's acceptance within 0.2 points of its whole distribution's (docs/benchmarks/
# draft-wire-bytes.json) at 8 bytes a token: 8 KiB a row, where a dense row of a 151,936-token
# vocabulary took 594 KiB.
MAX_DRAFT_TOKENS = 1024
DRAFT_TOKEN_BYTES = 4 + 4  # a listed token: its int32 id and its float32 probability
MAX_LOGIT_BIAS_ENTRIES = 1024  # per request: a Sampling message stays small
# A frame's ids, positions and Sampling (logit_bias, 64 stop ids), as protobuf bytes, generously
# (its block table is counted by message_limit, by the context).
FRAME_BYTES = 1024 + MAX_LOGIT_BIAS_ENTRIES * 16
# A decided token in a Prediction: its id and logprob, and up to 20 alternatives with theirs.
PREDICTED_TOKEN_BYTES = 21 * 16
WIDEST_WIRE_DTYPE_BYTES = 4  # float32 activations


def message_limit(*, hidden_size: int, vocab_size: int, max_batch_tokens: int, max_sessions: int,
                  max_context: int) -> int:
    """The largest message either direction of a stage stream can carry for this plan, the gRPC
    limit of both ends: a Batch of every session's frame (one each), prompt chunks up to the token
    budget, verify windows up to MAX_DRAFT_ROWS_PER_BATCH draft rows with their distributions and
    token masks (constrained decoding: a row for each draft and each session's next token), and
    float32 activations for all of it (the widest wire dtype), and every frame's block table up to the
    full context; its BatchResult is smaller. gRPC
    refuses a larger message with RESOURCE_EXHAUSTED instead of handing it to the stage."""
    tokens = max(max_batch_tokens, PREFILL_CHUNK_TOKENS) + max_sessions + MAX_DRAFT_ROWS_PER_BATCH
    activations = tokens * hidden_size * WIDEST_WIRE_DTYPE_BYTES
    draft_q = MAX_DRAFT_ROWS_PER_BATCH * (min(vocab_size, MAX_DRAFT_TOKENS) * DRAFT_TOKEN_BYTES + 16)  # + its remainder
    # a bit per token, each row, and the row's header in a compact frame (token_masks.py)
    token_masks = (MAX_DRAFT_ROWS_PER_BATCH + max_sessions) * (vocab_size // 8 + 8)
    block_table = 5 * -(-max_context // KV_BLOCK_TOKENS)  # a uint32 varint is at most 5 bytes
    frames = max_sessions * (FRAME_BYTES + block_table) + tokens * PREDICTED_TOKEN_BYTES
    return activations + draft_q + token_masks + frames + 64 * 1024  # the Batch's own fields and framing
# Keepalive, agreed by both ends of every stage stream. The channel pings a stream every
# KEEPALIVE_MS, quiet or not (so a dead peer is found while a stream idles); the server must then
# accept pings that often, or it answers them with GOAWAY ENHANCE_YOUR_CALM "too_many_pings" (its
# default minimum is 5 minutes), breaking the idle stream: the next request would pay a replay.
KEEPALIVE_MS = 30_000
KEEPALIVE_TIMEOUT_MS = 20_000  # a ping unanswered this long: the peer is gone


def _message_options(max_message_bytes: int | None) -> list[tuple[str, int]]:
    limit = max_message_bytes or FALLBACK_MESSAGE_BYTES
    return [("grpc.max_send_message_length", limit), ("grpc.max_receive_message_length", limit)]


def channel_options(max_message_bytes: int | None = None) -> list[tuple[str, int]]:
    """The options of every channel into a stage (the frontend's and a stage's to the next);
    max_message_bytes: the plan's message_limit (None: the fallback)."""
    return _message_options(max_message_bytes) + [
        ("grpc.keepalive_time_ms", KEEPALIVE_MS),
        ("grpc.keepalive_timeout_ms", KEEPALIVE_TIMEOUT_MS),
        ("grpc.http2.max_pings_without_data", 0),  # keep pinging a quiet stream
    ]


def server_options(max_message_bytes: int | None = None) -> list[tuple[str, int]]:
    """The options of a stage's gRPC server: the plan's message limit, as its channels have it,
    and it accepts the channels' pings (at half their interval, for timers' slack), with or
    without a call open."""
    return _message_options(max_message_bytes) + [
        ("grpc.http2.min_recv_ping_interval_without_data_ms", KEEPALIVE_MS // 2),
        ("grpc.http2.min_ping_interval_without_data_ms", KEEPALIVE_MS // 2),
        ("grpc.keepalive_permit_without_calls", 1),
    ]


# The last stage acknowledges RELEASE once every stage has freed the session; the frontend
# waits this long for it (a stage that is gone frees its sessions itself when its stream
# breaks). The acknowledgement is what lets the frontend hand a freed slot to the next request
# without the stages refusing it.
RELEASE_ACK_TIMEOUT_S = 5.0
KIND_NAMES = {pb.PREFILL: "prefill", pb.DECODE: "decode", pb.VERIFY: "verify", pb.RELEASE: "release"}
# Frames with tokens to compute, in a forward pass; RELEASE a stage carries out itself, between passes.
COMPUTE_KINDS = (pb.PREFILL, pb.DECODE, pb.VERIFY)


def expects_prediction(frame: pb.Frame) -> bool:
    return frame.kind in (pb.DECODE, pb.VERIFY) or (frame.kind == pb.PREFILL and frame.want_prediction)


def expects_ack(frame: pb.Frame) -> bool:
    """Whether the last stage acknowledges the frame (in its BatchResult): a RELEASE once every stage
    carried it out, a PREFILL chunk that wants no prediction once every stage computed it."""
    return frame.kind == pb.RELEASE or (frame.kind == pb.PREFILL and not frame.want_prediction)
