"""Facts both ends of a stage connection must agree on: service name, channel options, and
which frames are answered with a Prediction or an Ack."""

from __future__ import annotations

from inferencemesh.protocol import stage_pb2 as pb

SERVICE_NAME = "inferencemesh.v1.Stage"
# A prefill chunk of a large model's activations exceeds gRPC's default 4 MiB on both ends.
MAX_MESSAGE_BYTES = 256 * 1024 * 1024
# Keepalive, agreed by both ends of every stage stream. The channel pings a stream every
# KEEPALIVE_MS, quiet or not (so a dead peer is found while a stream idles); the server must then
# accept pings that often, or it answers them with GOAWAY ENHANCE_YOUR_CALM "too_many_pings" (its
# default minimum is 5 minutes), breaking the idle stream: the next request would pay a replay.
KEEPALIVE_MS = 30_000
KEEPALIVE_TIMEOUT_MS = 20_000  # a ping unanswered this long: the peer is gone
GRPC_OPTIONS = [
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
]


def channel_options() -> list[tuple[str, int]]:
    """The options of every channel into a stage (the frontend's and a stage's to the next)."""
    return GRPC_OPTIONS + [
        ("grpc.keepalive_time_ms", KEEPALIVE_MS),
        ("grpc.keepalive_timeout_ms", KEEPALIVE_TIMEOUT_MS),
        ("grpc.http2.max_pings_without_data", 0),  # keep pinging a quiet stream
    ]


def server_options() -> list[tuple[str, int]]:
    """The options of a stage's gRPC server: it accepts the channels' pings (at half their
    interval, for timers' slack), with or without a call open."""
    return GRPC_OPTIONS + [
        ("grpc.http2.min_recv_ping_interval_without_data_ms", KEEPALIVE_MS // 2),
        ("grpc.http2.min_ping_interval_without_data_ms", KEEPALIVE_MS // 2),
        ("grpc.keepalive_permit_without_calls", 1),
    ]


# The last stage acknowledges RELEASE once every stage has freed the session; the frontend
# waits this long for it (a stage that is gone frees its sessions itself when its stream
# breaks). The acknowledgement is what lets the frontend hand a freed slot to the next request
# without the stages refusing it.
RELEASE_ACK_TIMEOUT_S = 5.0
KIND_NAMES = {pb.PREFILL: "prefill", pb.DECODE: "decode", pb.VERIFY: "verify", pb.RELEASE: "release",
              pb.FORK: "fork"}
# Frames with tokens to compute, in a forward pass; the others (RELEASE, FORK) a stage carries
# out itself, between passes.
COMPUTE_KINDS = (pb.PREFILL, pb.DECODE, pb.VERIFY)


def expects_prediction(frame: pb.Frame) -> bool:
    return frame.kind in (pb.DECODE, pb.VERIFY) or (frame.kind == pb.PREFILL and frame.want_prediction)


def expects_ack(frame: pb.Frame) -> bool:
    """Whether the last stage acknowledges the frame (in its BatchResult)."""
    return frame.kind in (pb.RELEASE, pb.FORK)
