"""Every Prometheus metric the frontend exports, in one place.

Names follow vLLM's (`time_to_first_token_seconds`, `num_requests_running`, …) under an
`inferencemesh_` prefix, labelled `model_name` as vLLM's are, so an existing vLLM dashboard needs
only the prefix changed (docs/metrics.md maps every name). Each
FrontendMetrics owns its CollectorRegistry: several apps in one process (tests) never collide,
and /metrics shows exactly one frontend's series.

The HTTP layer updates the request metrics; the engine updates the speculative-decoding ones
through the same object (programs/frontend.py hands one instance to both).
"""

from __future__ import annotations

import time
from collections.abc import Callable

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from inferencemesh.frontend.engine.constraints import ConstraintKind

PREFIX = "inferencemesh_"

# vLLM's buckets, extended downwards: a small model on CPU decodes in milliseconds.
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5,
               5.0, 7.5, 10.0, 20.0, 40.0, 80.0)
# One engine step's parts: a proposal (n-gram lookup, draft forward passes) can take microseconds.
STEP_BUCKETS = (0.0001, 0.00025, 0.0005, *ITL_BUCKETS)
E2E_BUCKETS = (0.01, 0.05, 0.1, 0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0,
               120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)

MODEL_LABEL = "model_name"  # vLLM's label name
FINISHED_REASONS = ("stop", "length", "abort")  # abort: the client went away
# States of automatic (n-gram) speculation: watch the prompt and the first tokens,
# speculate while it pays, back off after poor acceptance; "off" when auto is not in use.
AUTO_STATES = ("off", "observing", "active", "cooldown")
STEP_KINDS = ("decode", "verify")  # a plain step DECODEs the last token; a speculative one VERIFYs drafts
CONSTRAINT_KINDS = tuple(kind.value for kind in ConstraintKind)  # structured output's label values
# A schema compiles in milliseconds; a large grammar can take a second or more.
COMPILE_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)
# One frame's masks: tens of microseconds (a row at a 4k vocabulary) to milliseconds (a window at 150k).
MASK_BUCKETS = (0.00001, 0.000025, 0.00005, 0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1)


class _Families:
    """Declares metric families in one registry, each labelled by MODEL_LABEL and then `labels`."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self.registry = registry

    def counter(self, name: str, documentation: str, labels: tuple[str, ...] = ()) -> Counter:
        return Counter(PREFIX + name, documentation, [MODEL_LABEL, *labels], registry=self.registry)

    def gauge(self, name: str, documentation: str, labels: tuple[str, ...] = ()) -> Gauge:
        return Gauge(PREFIX + name, documentation, [MODEL_LABEL, *labels], registry=self.registry)

    def histogram(self, name: str, documentation: str, buckets: tuple[float, ...],
                  labels: tuple[str, ...] = ()) -> Histogram:
        return Histogram(PREFIX + name, documentation, [MODEL_LABEL, *labels], buckets=buckets,
                         registry=self.registry)


class FrontendMetrics:
    """One frontend's metrics, declared in groups by what updates them, every series exported
    (at 0) from the first scrape."""

    def __init__(self, model: str, *, max_spec_positions: int = 16) -> None:
        self.model = model
        self.registry = CollectorRegistry(auto_describe=True)
        self._included: list[CollectorRegistry] = []
        families = _Families(self.registry)
        self._declare_request_flow(families)
        self._declare_prefix_cache(families)
        self._declare_speculation(families)
        self._declare_steps(families)
        self._declare_structured_output(families)
        self._export_every_series(max_spec_positions)

    def _declare_request_flow(self, f: _Families) -> None:
        """Request flow (updated by the HTTP layer)."""
        self.time_to_first_token = f.histogram(
            "time_to_first_token_seconds", "Time from request arrival to its first generated token.", TTFT_BUCKETS)
        self.inter_token_latency = f.histogram(
            "inter_token_latency_seconds",
            "Time between successive engine steps of one request (a step may carry several accepted tokens).",
            ITL_BUCKETS)
        self.e2e_request_latency = f.histogram(
            "e2e_request_latency_seconds", "Time from request arrival to its last token.", E2E_BUCKETS)
        self.num_requests_running = f.gauge("num_requests_running", "Requests that are producing tokens.")
        self.num_requests_waiting = f.gauge(
            "num_requests_waiting", "Admitted requests that have not produced their first token yet.")
        self.prompt_tokens = f.counter("prompt_tokens_total", "Prompt tokens of admitted requests.")
        self.generation_tokens = f.counter("generation_tokens_total", "Tokens generated.")
        self.request_success = f.counter(
            "request_success_total", "Finished requests by finish reason.", ("finished_reason",))
        self.request_errors = f.counter(
            "request_errors_total", "Requests answered with an error, by HTTP status code.", ("status",))
        self.draining = f.gauge(
            "draining", "1 while this frontend drains (stopping: new requests get 503, those in flight finish).")

    def _declare_prefix_cache(self, f: _Families) -> None:
        """The KV pool and its prefix cache (updated by the engine's block manager), in tokens and
        blocks as vLLM counts them."""
        self.prefix_cache_queries = f.counter(
            "prefix_cache_queries_total", "Prompt tokens looked up in the prefix cache.")
        self.prefix_cache_hits = f.counter(
            "prefix_cache_hits_total", "Prompt tokens found in the prefix cache (reused by reference, not computed).")
        self.kv_cache_usage = f.gauge(
            "kv_cache_usage_perc", "Fraction of the KV pool's blocks in use (1 = full); cached blocks nobody "
            "references count as free.")
        self.num_preemptions = f.counter(
            "num_preemptions_total", "Requests preempted for KV blocks (they recompute their tokens later).")
        self.kv_cache_evictions = f.counter(
            "kv_cache_evictions_total", "Cached KV blocks reclaimed for another use, least recently used first.")
        self._kv_counted = (0, 0)  # preemptions and evictions already exported

    def _declare_speculation(self, f: _Families) -> None:
        """Speculative decoding (updated by the engine)."""
        self.spec_decode_num_drafts = f.counter(
            "spec_decode_num_drafts_total", "Verify rounds that carried draft tokens.")
        self.spec_decode_num_draft_tokens = f.counter(
            "spec_decode_num_draft_tokens_total", "Draft tokens proposed for verification.")
        self.spec_decode_num_accepted_tokens = f.counter(
            "spec_decode_num_accepted_tokens_total", "Draft tokens accepted by the target.")
        self.spec_decode_num_accepted_tokens_per_pos = f.counter(
            "spec_decode_num_accepted_tokens_per_pos_total",
            "Accepted draft tokens by position in the verify window (0 = first draft token).", ("position",))
        self.spec_decode_window_size = f.gauge(
            "spec_decode_window_size", "Current number of draft tokens per verify round.")
        self.spec_decode_auto_state = f.gauge(
            "spec_decode_auto_state", "State of automatic n-gram speculation (1 on the current state).", ("state",))
        self.speculative_strategy_info = f.gauge(
            "speculative_strategy_info", "The speculative strategy in use (value 1) and why it was chosen.",
            ("strategy", "reason"))

    def _declare_steps(self, f: _Families) -> None:
        """Where a step's time goes (updated by the engine): proposing here vs the pipeline's round
        trip; and the step scheduler's microbatches and how full they are."""
        self.step_proposal_seconds = f.histogram(
            "step_proposal_seconds", "Time proposing draft tokens per engine step (steps with a proposer).",
            STEP_BUCKETS)
        self.step_pipeline_seconds = f.histogram(
            "step_pipeline_seconds",
            "Time from sending a step's frame into the stages until its prediction came back, by frame kind.",
            STEP_BUCKETS, ("kind",))
        self.microbatch_frames = f.histogram(
            "microbatch_frames", "Frames (sessions) per microbatch sent into the stages.",
            (1, 2, 4, 8, 16, 32, 64, 128))
        self.microbatches_in_flight = f.gauge(
            "microbatches_in_flight", "Microbatches sent into the stages and not yet answered (at most one per stage).")

    def _declare_structured_output(self, f: _Families) -> None:
        """Structured output (requests and compiles by the job builder, masks by each session)."""
        self.structured_output_requests = f.counter(
            "structured_output_requests_total",
            "Requests (prompts of a completions batch each) with a structured-output constraint, by kind.", ("kind",))
        self.grammar_compile_seconds = f.histogram(
            "grammar_compile_seconds",
            "Time checking and compiling a request's constraint (not counted when served from the compiled cache).",
            COMPILE_BUCKETS)
        self.grammar_mask_seconds = f.histogram(
            "grammar_mask_seconds",
            "Time computing one frame's token masks (every draft position and the bonus one) of a constrained "
            "request.", MASK_BUCKETS)

    def _export_every_series(self, max_spec_positions: int) -> None:
        """Create the labelled children now so every series is exported (at 0) from the first scrape."""
        model = self.model
        for metric in (self.time_to_first_token, self.inter_token_latency, self.e2e_request_latency,
                       self.num_requests_running, self.num_requests_waiting, self.prompt_tokens,
                       self.generation_tokens, self.spec_decode_num_drafts, self.spec_decode_num_draft_tokens,
                       self.spec_decode_num_accepted_tokens, self.spec_decode_window_size,
                       self.step_proposal_seconds, self.microbatch_frames, self.microbatches_in_flight,
                       self.prefix_cache_queries, self.prefix_cache_hits, self.kv_cache_usage,
                       self.num_preemptions, self.kv_cache_evictions, self.grammar_compile_seconds,
                       self.grammar_mask_seconds, self.draining):
            metric.labels(model)
        for constraint_kind in CONSTRAINT_KINDS:
            self.structured_output_requests.labels(model, constraint_kind)
        for kind in STEP_KINDS:
            self.step_pipeline_seconds.labels(model, kind)
        for reason in FINISHED_REASONS:
            self.request_success.labels(model, reason)
        for pos in range(max_spec_positions):
            self.spec_decode_num_accepted_tokens_per_pos.labels(model, str(pos))
        self.set_auto_state("off")
        self.set_speculative_strategy("none", "not configured")

    # --- helpers for the HTTP layer ---------------------------------------------------------

    def track_request(self, arrival: float, prompt_tokens: int) -> RequestTracker:
        """Start tracking an admitted request that arrived at `arrival` (time.perf_counter())."""
        return RequestTracker(self, arrival, prompt_tokens)

    def set_draining(self, draining: bool) -> None:
        self.draining.labels(self.model).set(1 if draining else 0)

    # --- helpers for the engine -------------------------------------------------------------

    def set_speculative_strategy(self, strategy: str, reason: str) -> None:
        """Replace the info series: exactly one (strategy, reason) pair is exported at a time."""
        self.speculative_strategy_info.clear()
        self.speculative_strategy_info.labels(self.model, strategy, reason).set(1)

    def record_prefix_cache(self, prompt_tokens: int, reused: int) -> None:
        """One prompt looked up: `reused` of its `prompt_tokens` came from the prefix cache."""
        self.prefix_cache_queries.labels(self.model).inc(prompt_tokens)
        self.prefix_cache_hits.labels(self.model).inc(reused)

    def watch_kv_usage(self, usage: Callable[[], float]) -> None:
        """The pool's usage is read when /metrics is scraped: current between requests too (a
        long decode grows its table), at no cost per step."""
        self.kv_cache_usage.labels(self.model).set_function(usage)

    def record_kv_pool(self, preemptions: int, evictions: int) -> None:
        """The block manager's running totals of preemptions and evictions (the counters take
        what they have not counted yet)."""
        counted_preemptions, counted_evictions = self._kv_counted
        self.num_preemptions.labels(self.model).inc(max(0, preemptions - counted_preemptions))
        self.kv_cache_evictions.labels(self.model).inc(max(0, evictions - counted_evictions))
        self._kv_counted = (max(preemptions, counted_preemptions), max(evictions, counted_evictions))

    def record_held_back(self, count: int) -> None:
        """`count` running requests preempted for KV blocks wait again (negative: they resume)."""
        self.num_requests_waiting.labels(self.model).inc(count)
        self.num_requests_running.labels(self.model).dec(count)

    def record_verify_round(self, draft_tokens: int, accepted: int) -> None:
        """One verify round of `draft_tokens` proposals of which the first `accepted` were kept."""
        if draft_tokens <= 0:
            return
        self.spec_decode_num_drafts.labels(self.model).inc()
        self.spec_decode_num_draft_tokens.labels(self.model).inc(draft_tokens)
        self.spec_decode_num_accepted_tokens.labels(self.model).inc(accepted)
        for pos in range(accepted):
            self.spec_decode_num_accepted_tokens_per_pos.labels(self.model, str(pos)).inc()

    def record_step(self, kind: str, proposal_s: float | None, pipeline_s: float) -> None:
        """One engine step: `proposal_s` spent proposing (None: no proposer), then `pipeline_s` in
        the stages. kind: one of STEP_KINDS."""
        if proposal_s is not None:
            self.step_proposal_seconds.labels(self.model).observe(proposal_s)
        self.step_pipeline_seconds.labels(self.model, kind).observe(pipeline_s)

    def set_auto_state(self, state: str) -> None:
        """One-hot over AUTO_STATES, like a Prometheus StateSet."""
        if state not in AUTO_STATES:
            raise ValueError(f"unknown auto speculation state {state!r}; known: {AUTO_STATES}")
        for s in AUTO_STATES:
            self.spec_decode_auto_state.labels(self.model, s).set(1 if s == state else 0)

    def record_constraint(self, kind: str, compile_s: float | None) -> None:
        """A request with a `kind` constraint; compile_s: its compile time (None: it came from the cache)."""
        self.structured_output_requests.labels(self.model, kind).inc()
        if compile_s is not None:
            self.grammar_compile_seconds.labels(self.model).observe(compile_s)

    def mask_timer(self) -> Callable[[float], None]:
        """What a session's grammar reports each frame's mask time to (a bound observe: no lookup per frame)."""
        return self.grammar_mask_seconds.labels(self.model).observe

    def set_window_size(self, k: int) -> None:
        self.spec_decode_window_size.labels(self.model).set(k)

    # --- exposition -------------------------------------------------------------------------

    def include(self, registry: CollectorRegistry) -> None:
        """Serve another registry's series on this endpoint too (an embedded first stage's)."""
        self._included.append(registry)

    def render(self) -> tuple[bytes, str]:
        """The Prometheus text exposition of this registry (and those included) and its content type."""
        return b"".join(generate_latest(r) for r in [self.registry, *self._included]), CONTENT_TYPE_LATEST


class RequestTracker:
    """One request's path through the metrics: waiting -> running -> finished, exactly once."""

    def __init__(self, metrics: FrontendMetrics, arrival: float, prompt_tokens: int) -> None:
        self._m = metrics
        self._model = metrics.model
        self._arrival = arrival
        self._last: float | None = None
        self._finished = False
        metrics.prompt_tokens.labels(self._model).inc(prompt_tokens)
        metrics.num_requests_waiting.labels(self._model).inc()

    def on_tokens(self, count: int) -> None:
        """An engine step delivered `count` new tokens."""
        now = time.perf_counter()
        m, model = self._m, self._model
        if self._last is None:
            m.time_to_first_token.labels(model).observe(now - self._arrival)
            m.num_requests_waiting.labels(model).dec()
            m.num_requests_running.labels(model).inc()
        else:
            m.inter_token_latency.labels(model).observe(now - self._last)
        self._last = now
        m.generation_tokens.labels(model).inc(count)

    def finish(self, reason: str) -> None:
        """reason: one of FINISHED_REASONS, or "error". Errors are counted in request_errors_total
        by the HTTP layer, once per request (a request of n choices has n trackers)."""
        if self._finished:
            return
        self._finished = True
        m, model = self._m, self._model
        (m.num_requests_waiting if self._last is None else m.num_requests_running).labels(model).dec()
        m.e2e_request_latency.labels(model).observe(time.perf_counter() - self._arrival)
        if reason in FINISHED_REASONS:
            m.request_success.labels(model, reason).inc()
