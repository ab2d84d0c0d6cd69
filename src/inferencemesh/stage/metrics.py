"""Prometheus metrics of a stage process (one registry per stage, so tests can run several).

Labelled `model_name` (vLLM's label) and `stage`. Where a stage's time goes: a frame waits in
the stage's queue (`queue_wait_seconds`), is computed in a pass (`compute_seconds`; the pass's
wall time also adds to `busy_seconds_total`), and its activations are sent downstream
(`send_seconds`). The stage's idle fraction, its share of the pipeline bubble, is
`1 - rate(inferencemesh_stage_busy_seconds_total[1m])` (docs/metrics.md).
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from inferencemesh.stage.metrics_http import MetricsEndpoint, Readiness

STATES = ("downloading", "loading", "ready", "failed")
_FORWARD_BUCKETS = (0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0, 5.0)
# Waiting and sending can take microseconds (an idle device, a loopback write).
_STEP_BUCKETS = (0.00005, 0.0001, 0.00025, *_FORWARD_BUCKETS)


class StageMetrics:
    def __init__(self, model: str, stage_index: int, host: str = "127.0.0.1") -> None:
        self.host = host  # where /metrics binds: where the stage's gRPC does
        self.endpoint: MetricsEndpoint | None = None
        self.readiness: Readiness | None = None  # what /ready answers: the gRPC endpoint's health (server.py)
        self.registry = CollectorRegistry()
        self._labels = {"model_name": model, "stage": str(stage_index)}
        self._declare_lifecycle()
        self._declare_sessions()
        self._declare_passes()
        self._declare_traffic()
        self._bind_children()

    def _gauge(self, name: str, doc: str, extra: tuple[str, ...] = ()) -> Gauge:
        return Gauge(f"inferencemesh_stage_{name}", doc, [*self._labels, *extra], registry=self.registry)

    def _counter(self, name: str, doc: str, extra: tuple[str, ...] = ()) -> Counter:
        return Counter(f"inferencemesh_stage_{name}", doc, [*self._labels, *extra], registry=self.registry)

    def _histogram(self, name: str, doc: str, buckets: tuple[float, ...], extra: tuple[str, ...] = ()) -> Histogram:
        return Histogram(f"inferencemesh_stage_{name}", doc, [*self._labels, *extra], buckets=buckets,
                         registry=self.registry)

    def _declare_lifecycle(self) -> None:
        self.state = self._gauge("state", "1 for the stage's current lifecycle state", ("state",))
        self.progress = self._gauge("load_progress_ratio", "download / load progress within the current state (0..1)")

    def _declare_sessions(self) -> None:
        self.active_sessions = self._gauge("active_sessions", "live sessions on this stage (their sampling state)")
        self.kv_blocks_used = self._gauge("kv_blocks_used",
                                          "KV pool blocks the stream the pool serves has written")
        self.cached_tokens = self._gauge("cached_tokens", "token positions those blocks hold (kv_blocks_used x "
                                                          "block size)")
        self.kv_bytes = self._gauge("kv_cache_bytes", "bytes of the stage's KV pool (allocated once; the OS "
                                                      "commits pages as they are written)")

    def _declare_passes(self) -> None:
        """Where a pass's time goes: the frame's wait for it, the layers, the compute thread's wall time."""
        self.forward_seconds = self._histogram(
            "forward_seconds",
            "time in the stage's layers per forward pass (a batched pass is labelled by its first frame's kind)",
            _FORWARD_BUCKETS, ("kind",))
        self.batch_frames_histogram = self._histogram(
            "batch_frames", "frames (sessions) computed together per forward pass", (1, 2, 4, 8, 16, 32, 64))
        self.queue_wait_seconds = self._histogram(
            "queue_wait_seconds", "time a frame waited in the stage's queue for its pass", _STEP_BUCKETS)
        self.compute_seconds = self._histogram(
            "compute_seconds", "wall time of one pass on the compute thread (layers + sampling)", _STEP_BUCKETS)
        self.busy_seconds = self._counter(
            "busy_seconds", "seconds the compute thread spent in passes (1 - rate: idle fraction)")

    def _declare_traffic(self) -> None:
        """What went through the stage: frames, their refusals, token positions and activations sent on."""
        self.frames = self._counter("frames_total", "frames processed", ("kind",))
        self.frame_errors = self._counter("frame_errors_total", "frames refused, by gRPC status", ("code",))
        self.activation_bytes_sent = self._counter("activation_bytes_sent_total",
                                                   "activation payload bytes sent downstream")
        self.tokens_processed = self._counter("tokens_total", "token positions computed")
        self.send_seconds = self._histogram(
            "send_seconds", "time to encode and send one frame's activations downstream", _STEP_BUCKETS)

    def _bind_children(self) -> None:
        """Children bound once: the per-frame path does no label lookups."""
        labels = self._labels
        self.bytes_sent = self.activation_bytes_sent.labels(**labels)
        self.batch_frames = self.batch_frames_histogram.labels(**labels)
        self.tokens = self.tokens_processed.labels(**labels)
        self.sessions_gauge = self.active_sessions.labels(**labels)
        self.blocks_gauge = self.kv_blocks_used.labels(**labels)
        self.cached_gauge = self.cached_tokens.labels(**labels)
        self.kv_gauge = self.kv_bytes.labels(**labels)
        self.progress_gauge = self.progress.labels(**labels)
        self.queue_wait = self.queue_wait_seconds.labels(**labels)
        self.send = self.send_seconds.labels(**labels)
        self._compute = self.compute_seconds.labels(**labels)
        self._busy = self.busy_seconds.labels(**labels)
        kinds = ("prefill", "decode", "verify", "release")
        self.forward_by_kind = {kind: self.forward_seconds.labels(**labels, kind=kind) for kind in kinds}
        self.frames_by_kind = {kind: self.frames.labels(**labels, kind=kind) for kind in kinds}

    def observe_pass(self, seconds: float) -> None:
        """One pass on the compute thread took `seconds`."""
        self._compute.observe(seconds)
        self._busy.inc(seconds)

    def set_state(self, state: str, progress: float) -> None:
        for name in STATES:
            self.state.labels(**self._labels, state=name).set(1.0 if name == state else 0.0)
        self.progress_gauge.set(progress)

    def error(self, code: str) -> None:
        self.frame_errors.labels(**self._labels, code=code).inc()

    def serve(self, port: int) -> tuple[str, int]:
        """Serve /metrics and the probes (/ready, /live) on `port` at the stage's host, on the
        running event loop; returns the bound address."""
        self.endpoint = MetricsEndpoint(self.registry, readiness=self.readiness)
        return self.endpoint.listen(self.host, port)
