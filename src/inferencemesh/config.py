"""The configuration of the programs the project runs: one frozen type per program, and the field
groups they share. `bench`'s own type, which no other program reads, is beside the bench
(programs/bench/config.py).

Each field is declared once, with its command-line flag, default, choices and help (flags.option),
and flags.py derives everything else from those declarations: the CLI parser, `serve`'s child
processes and the operator's pod arguments agree by construction, and tests/test_config.py
round-trips every field. Library code takes these types, never an argparse.Namespace.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from inferencemesh.checkpoint.quantization import LOAD_METHODS
from inferencemesh.flags import LAYER_RANGE, NAMES, ConfigError, derive, flag_name, option, switch

DTYPES = ("auto", "float32", "float16", "bfloat16")
WIRE_DTYPES = ("float32", "float16", "bfloat16")
DEVICES = ("auto", "cpu", "cuda")
SPECULATIVE_STRATEGIES = ("auto", "draft", "ngram", "none")

DEFAULT_MAX_CONTEXT = 2048
# Sessions the frontend runs at once: a scheduling limit (vLLM's max_num_seqs), not a reservation:
# KV memory is the pool's (kv_cache_tokens), given to the tokens that exist, in blocks.
DEFAULT_MAX_SESSIONS = 256
# The KV pool a stage gets unless told (--kv-cache-tokens 0): this many full contexts, the memory
# the plan reserved before KV blocks (16 sessions at --max-context each).
DEFAULT_KV_CONTEXTS = 16
# Most prompt tokens one microbatch (one forward pass at every stage) carries.
DEFAULT_MAX_BATCH_TOKENS = 256
# The frontend's torch threads (its only tensor work is the draft model). One: a small draft's
# ops gain nothing from a second thread, and an OpenMP team's idle workers spin on a core that
# a CPU stage next to the frontend needs (measured on 2 cores, bundled models, 2 stages: the
# first stage's VERIFY frames took 12.5 ms with 2 frontend threads, 4.7 ms with 1).
DEFAULT_DRAFT_THREADS = 1
DEFAULT_RECOVERY_TIMEOUT = 180.0
DEFAULT_DRAIN_TIMEOUT = 30.0  # Kubernetes' default terminationGracePeriodSeconds is 30 s
# Speculation is off while this many requests run (vLLM's speculative_disable_by_batch_size): a
# busy pipeline batches its sessions' decode steps and has no spare compute for drafts it will
# reject. Measured on 2 cores, bundled models, 2 stages, draft ÷ none at 1/2/4/8 concurrent
# streams: 1.11, 1.05, 0.75, 0.75 (docs/benchmarks/speculation-under-load.json).
DEFAULT_SPECULATIVE_DISABLE_BY_BATCH_SIZE = 3
STAGE_GRPC_PORT = 50051
STAGE_METRICS_PORT = 9090
FRONTEND_PORT = 8000
# `serve`'s stage i exports /metrics on --port + this + i (8100, 8101, ... beside the default 8000):
# fixed ports, so a static Prometheus configuration survives restarts.
SERVE_STAGE_METRICS_OFFSET = 100
API_KEY_ENV = "INFERENCEMESH_API_KEY"
# The HTTP servers' (frontend's, router's) total deadlines for a request's head and its body: a
# client that trickles them in is answered 408 and cut off (http_server, frontend.guard, router.app).
HTTP_HEADER_TIMEOUT_S = 10.0
HTTP_BODY_TIMEOUT_S = 30.0


# ---- field groups shared by several programs ----------------------------------------------------


@dataclass(frozen=True, kw_only=True)
class ModelOptions:
    model: str | None = option(None, "local model directory, hub id or bundled://NAME "
                                     "(default: the bundled code model)")
    revision: str | None = option(None, "hub revision (branch, tag or commit)")
    dtype: str = option("auto", "compute dtype (auto: the checkpoint's; on a CPU without native units for "
                                "a 16-bit checkpoint, float32)", choices=DTYPES)
    cache_dir: str | None = option(None, "where hub downloads go (HF_HUB_CACHE by default)")
    # One flag for every program that loads or plans the layers: the stages quantize as they read
    # (modeling/quantized_load.py), the plan counts the bytes they then hold (checkpoint/facts.py).
    quantization: str | None = option(None, "quantize a 16-bit checkpoint's layers as the stages load them, "
                                            "weight-only (activations stay in the compute dtype): int8 per "
                                            "channel, int4 in groups of 128 (or 64, 32), fp8 e4m3 per channel; "
                                            "the embedding and LM head too, tied or not (the draft model stays as "
                                            "it is); the plan counts the quantized bytes. A checkpoint quantized "
                                            "already is refused: serve it as it is, without this flag",
                                   choices=LOAD_METHODS)
    served_model_name: str | None = option(None, "the model name clients use and metrics carry (default: "
                                                 "a hub id as given, a bundled or local model's folder name)")


@dataclass(frozen=True, kw_only=True)
class RuntimeOptions:
    max_context: int = option(DEFAULT_MAX_CONTEXT, "longest session (prompt + output) in tokens", parse=int)
    max_sessions: int = option(DEFAULT_MAX_SESSIONS, "requests generating at once (a scheduling limit: their KV "
                                                     "comes from the pool, --kv-cache-tokens)", parse=int)
    kv_cache_tokens: int = option(0, "KV positions in each stage's pool, given out in blocks of 16 to the tokens "
                                     f"that exist and shared between prompts that start the same (0: "
                                     f"{DEFAULT_KV_CONTEXTS} x --max-context); the plan sizes each stage's memory "
                                     "by it", parse=int)
    wire_dtype: str | None = option(None, "dtype of activations between stages (default: the compute dtype)",
                                    choices=WIRE_DTYPES)
    debug_telemetry: bool = switch("per-token timings and debug attributes")
    tls_dir: str | None = option(None, "mutual TLS between frontend and stages: a directory with tls.crt, "
                                       "tls.key, ca.crt")


@dataclass(frozen=True, kw_only=True)
class SpeculativeOptions:
    speculative: str | None = option(None, "speculation strategy (default: the model package's, else auto)",
                                     choices=SPECULATIVE_STRATEGIES)
    draft: str | None = option(None, "draft model directory or hub id (implies --speculative draft)")
    no_draft: bool = switch("ignore a draft declared by the model package")
    window: str | None = option(None, "speculation window: a number (fixed) or adaptive:INITIAL:MIN:MAX")
    draft_threads: int = option(DEFAULT_DRAFT_THREADS, "CPU threads of the frontend process, which runs the draft",
                                parse=int)
    speculative_disable_by_batch_size: int = option(
        DEFAULT_SPECULATIVE_DISABLE_BY_BATCH_SIZE, "no speculation while at least this many requests run "
        "(a saturated pipeline has no compute to spare for rejected drafts; 0: always speculate)", parse=int)


@dataclass(frozen=True, kw_only=True)
class BatchingOptions:
    # The frontend's step scheduler cuts microbatches with it; every stage computes a microbatch in one pass.
    max_batch_tokens: int = option(DEFAULT_MAX_BATCH_TOKENS, "prompt tokens one microbatch carries through the "
                                   "stages (every session's decode and verify frames ride along; a batch's first "
                                   "prompt chunk always goes)", parse=int)


@dataclass(frozen=True, kw_only=True)
class HTTPTimeoutOptions:
    header_timeout: float = option(HTTP_HEADER_TIMEOUT_S, "seconds a request's head (request line and headers) "
                                   "may take to arrive, whole, however it trickles in (then 408, connection closed)",
                                   parse=float)
    body_timeout: float = option(HTTP_BODY_TIMEOUT_S, "seconds a request's body may take to arrive, whole, after "
                                 "its head (then 408, connection closed)", parse=float)

    def _check_timeouts(self) -> None:
        for name in ("header_timeout", "body_timeout"):
            if getattr(self, name) <= 0:
                raise ConfigError(f"{flag_name(name)} must be more than 0, not {getattr(self, name)}")


@dataclass(frozen=True, kw_only=True)
class PrefixCacheOptions:
    prefix_cache: bool = option(True, "share the KV blocks of prompts that start the same: a request reuses "
                                      "every block another request computed (running, finished or cancelled) "
                                      "while the pool keeps it, least recently used reclaimed first; "
                                      "--no-prefix-cache computes every prompt in full", switch=True)


@dataclass(frozen=True, kw_only=True)
class StreamOptions:
    # Both ends of a stage stream (the stages and the frontend) take the same limit: the programs
    # that plan a mesh (serve, bench, the operator) give them transport.message_limit of the plan.
    max_message_bytes: int | None = option(None, "largest gRPC message of a stage stream, either way (default: "
                                                 "256 MiB; serve, bench and the operator give the plan's)", parse=int)


@dataclass(frozen=True, kw_only=True)
class LocalMeshOptions:
    # `serve` runs the mesh that `plan` plans with the same flags: one declaration of each.
    stage_memory: str | None = option(None, "per-stage memory budgets, e.g. 16GiB,24GiB (one for all)")
    device: str = option("auto", "where stages and draft run (auto: a GPU if there is one); on a CPU, --dtype "
                                 "auto computes a 16-bit checkpoint in float32 unless the CPU has native units "
                                 "for it, and the KV cache is float32", choices=DEVICES)
    # The faster shape: 2 stages gave 40.6 tok/s with stage 0 in the frontend, 37.8 as a process of
    # its own (docs/benchmarks/embedded-first-stage.json).
    embed_first_stage: bool = option(True, "run the first stage's layers in the frontend process (one process "
                                     "and one hop fewer per token; its memory then holds the draft model "
                                     "too); --no-embed-first-stage runs it as a stage process of its own",
                                     switch=True)


# ---- the programs --------------------------------------------------------------------------------


@dataclass(frozen=True, kw_only=True)
class StageConfig(ModelOptions, RuntimeOptions, StreamOptions):
    """`inferencemesh stage`: one layer range behind gRPC (what a stage pod runs)."""

    model: str = option(help="local model directory, hub id or bundled://NAME")
    layers: tuple[int, int] = option(help="START:END, end exclusive (e.g. 0:16)", **LAYER_RANGE)
    stage_index: int = option(help="this stage's position in the pipeline, from 0", parse=int)
    num_stages: int = option(help="how many stages the pipeline has", parse=int)
    host: str = option("0.0.0.0", "address to listen on")  # noqa: S104 - a pod serves its Service
    port: int = option(STAGE_GRPC_PORT, "gRPC port (stage service + grpc.health.v1)", parse=int)
    metrics_port: int = option(STAGE_METRICS_PORT, "Prometheus /metrics port (0: off)", parse=int)
    downstream: str | None = option(None, "HOST:PORT of the next stage (absent on the last stage)")
    session_ttl: float = option(300.0, "seconds before an idle session is dropped", parse=float)
    device: str = option("auto", "where the layers run", choices=DEVICES)
    threads: int = option(0, "compute threads (0: OMP_NUM_THREADS if set, else the CPUs this process may "
                             "use, a container's CPU limit included)", parse=int)
    peers: tuple[str, ...] = option((), "with --tls-dir: the certificate names (common names) that may call "
                                        "Pipeline and Info, comma-separated: the mesh's frontend and the stage "
                                        "before this one (empty: any certificate the CA signed)", **NAMES)

    @property
    def layer_start(self) -> int:
        return self.layers[0]

    @property
    def layer_end(self) -> int:
        return self.layers[1]

    def check(self) -> StageConfig:
        _check_layer_range("layers", self.layers)
        if not 0 <= self.stage_index < self.num_stages:
            raise ConfigError(f"--stage-index {self.stage_index} is outside 0..{self.num_stages - 1} "
                              f"(--num-stages {self.num_stages})")
        if self.downstream is None and self.stage_index + 1 < self.num_stages:
            raise ConfigError(f"stage {self.stage_index} of {self.num_stages} needs --downstream HOST:PORT")
        if self.peers and not self.tls_dir:
            raise ConfigError("--peers names certificates: it needs --tls-dir (mutual TLS)")
        check_counts(self)
        return self

    def ports(self) -> list[tuple[str, str, int]]:
        """(what, host, port) of every port this program listens on (0: none or any)."""
        # The stage's /metrics binds every interface (prometheus_client's default).
        return [("stage gRPC (--port)", self.host, self.port),
                ("stage metrics (--metrics-port)", "", self.metrics_port)]


@dataclass(frozen=True, kw_only=True)
class FrontendConfig(ModelOptions, RuntimeOptions, SpeculativeOptions, BatchingOptions, StreamOptions,
                     PrefixCacheOptions, HTTPTimeoutOptions):
    """`inferencemesh frontend`: the OpenAI endpoint in front of the stages (the frontend pod)."""

    model: str = option(help="local model directory, hub id or bundled://NAME")
    stage_addresses: tuple[str, ...] = option(help="comma-separated HOST:PORT of every stage process, in "
                                              "pipeline order (empty: the embedded first stage is the whole model)",
                                              **NAMES)
    # The embedded first stage (stage 0 in the frontend's process): no process and no hop of its own.
    first_stage_layers: tuple[int, int] | None = option(
        None, "START:END: run the first stage's layers in this process (the embedded first stage); "
        "--stage-addresses then names the stages after it", **LAYER_RANGE)
    threads: int = option(0, "compute threads of the embedded first stage, which the draft shares (0: "
                             "OMP_NUM_THREADS if set, else the CPUs this process may use); without an embedded "
                             "stage the process has --draft-threads", parse=int)
    host: str = option("0.0.0.0", "address to listen on")  # noqa: S104
    port: int = option(FRONTEND_PORT, "HTTP port of the OpenAI endpoint", parse=int)
    api_key_env: str = option(API_KEY_ENV, "environment variable holding the API key (unset or empty: no auth)")
    max_body_bytes: int = option(1024 * 1024, "largest request body", parse=int)
    device: str = option("auto", "where the draft model runs", choices=DEVICES)
    # A lost stage comes back when its process (serve) or pod (a Deployment) restarts and reloads
    # its layers: seconds on a warm machine, over a minute for a rescheduled pod on a busy node.
    recovery_timeout: float = option(DEFAULT_RECOVERY_TIMEOUT, "seconds an in-flight request waits for a "
                                     "lost stage to return before it fails", parse=float)
    # SIGTERM (a pod's deletion, a rollout, a scale-down) drains: /ready and new requests answer
    # 503 while the requests in flight finish (frontend.drain). A pod's terminationGracePeriodSeconds
    # must cover its preStop sleep plus this.
    drain_timeout: float = option(DEFAULT_DRAIN_TIMEOUT, "seconds a stopping frontend lets its requests in "
                                  "flight finish (new ones get 503) before it stops (0: stop at once)",
                                  parse=float)

    def check(self) -> FrontendConfig:
        if not self.stage_addresses and self.first_stage_layers is None:
            raise ConfigError("--stage-addresses names no stage (and no --first-stage-layers runs one here)")
        if self.threads and self.first_stage_layers is None:
            raise ConfigError("--threads sizes the embedded first stage: it needs --first-stage-layers "
                              "(without one, the frontend computes only the draft: --draft-threads)")
        if self.first_stage_layers is not None:
            _check_layer_range("first_stage_layers", self.first_stage_layers)
        check_counts(self)
        self._check_timeouts()
        return self

    @property
    def num_stages(self) -> int:
        return len(self.stage_addresses) + (self.first_stage_layers is not None)

    def ports(self) -> list[tuple[str, str, int]]:
        """(what, host, port) of every port this program listens on."""
        return [("OpenAI endpoint (--port)", self.host, self.port)]

    def first_stage(self) -> StageConfig | None:
        """The embedded first stage's own config: this frontend's model and runtime settings, stage
        0 of num_stages, sending to the first stage process; no port of its own (no process)."""
        if self.first_stage_layers is None:
            return None
        return derive(StageConfig, self, layers=self.first_stage_layers, stage_index=0, num_stages=self.num_stages,
                      downstream=self.stage_addresses[0] if self.stage_addresses else None, host="",
                      port=0, metrics_port=0).check()


@dataclass(frozen=True, kw_only=True)
class ServeConfig(ModelOptions, RuntimeOptions, SpeculativeOptions, BatchingOptions, LocalMeshOptions,
                  PrefixCacheOptions):
    """`inferencemesh serve`: stages and frontend as local processes on loopback."""

    stages: int = option(2, "number of stage processes", parse=int)
    host: str = option("127.0.0.1", "address of the OpenAI endpoint")
    port: int = option(FRONTEND_PORT, "the OpenAI endpoint's port", parse=int)
    base_stage_port: int = option(0, "first stage gRPC port (0: pick free ports)", parse=int)
    stage_metrics_port: int = option(0, "first stage's Prometheus /metrics port; stage i uses it + i "
                                     f"(0: --port + {SERVE_STAGE_METRICS_OFFSET} + i)", parse=int)
    stage_threads: int = option(0, "compute threads of each stage process (0: the machine's CPUs divided "
                                   "among the stages, so they do not preempt each other)", parse=int)
    replicas: int = option(1, "complete pipelines (each its stages and frontend on a free port) behind a router "
                              "on --port that sends each request to the replica most likely to hold its prefix "
                              "(1: no router, the frontend itself on --port)", parse=int)
    api_key_env: str = option(API_KEY_ENV, "name of the environment variable holding the API key: with it set "
                              "(in serve's environment, which the frontends inherit), every request must send "
                              "'Authorization: Bearer KEY' (but /health, /ready and /metrics); unset or empty: no "
                              "authentication")

    def check(self) -> ServeConfig:
        check_counts(self)
        return self

    def stage_metrics_ports(self, count: int, replica: int = 0) -> list[int]:
        """The /metrics ports of `count` stages of pipeline `replica` (pipeline r's follow r's
        predecessors': r * count + i): derived, never random."""
        first = (self.stage_metrics_port or self.port + SERVE_STAGE_METRICS_OFFSET) + replica * count
        return [first + i for i in range(count)]

    def base_stage_port_of(self, replica: int) -> int:
        """Pipeline `replica`'s first stage gRPC port under --base-stage-port (0: free ports)."""
        processes = self.stages - int(self.embed_first_stage)
        return self.base_stage_port + replica * processes if self.base_stage_port else 0

    def ports(self) -> list[tuple[str, str, int]]:
        """(what, host, port) of every fixed port the mesh listens on (stage gRPC ports are picked
        free unless --base-stage-port); stage processes are 1.. with the first stage embedded; with
        --replicas N, each pipeline's (the frontends' ports are picked free, the router is on --port)."""
        first = int(self.embed_first_stage)
        own = [("OpenAI endpoint (--port)", self.host, self.port)]
        for r in range(self.replicas):
            which = f"pipeline {r} " if self.replicas > 1 else ""
            if self.base_stage_port:
                base = self.base_stage_port_of(r)
                own += [(f"{which}stage {i} gRPC (--base-stage-port)", "127.0.0.1", base + i - first)
                        for i in range(first, self.stages)]
            metrics = self.stage_metrics_ports(self.stages, r)
            own += [(f"{which}stage {i} metrics (--stage-metrics-port)", "", metrics[i])
                    for i in range(first, self.stages)]
        return own


# The router's defaults. A block of 128 characters is about 32 tokens of English or code: short
# enough that a shared system prompt spans several blocks, long enough that hashing a 100 kB
# prompt is a few hundred blake2b calls. The load bound follows SGLang's cache-aware policy (a
# cached replica is skipped only when it is both 8 requests and 1.5x busier than the least
# loaded): with the frontend's 16 sessions, 8 requests more is half a replica's batch, which
# costs more than recomputing a prefix.
ROUTER_BLOCK_CHARS = 128
ROUTER_AFFINITY_TTL_S = 600.0
ROUTER_AFFINITY_ENTRIES = 200_000
ROUTER_BALANCE_ABS = 8.0
ROUTER_BALANCE_REL = 1.5


@dataclass(frozen=True, kw_only=True)
class RouterConfig(HTTPTimeoutOptions):
    """`inferencemesh router`: one endpoint in front of N replicas' frontends, each request sent to
    the replica most likely to hold its prompt's prefix in its prefix cache (router/)."""

    host: str = option("0.0.0.0", "address to listen on")  # noqa: S104 - a pod serves its Service
    port: int = option(FRONTEND_PORT, "HTTP port of the routed OpenAI endpoint", parse=int)
    frontends: tuple[str, ...] = option((), "the replicas' frontends, comma-separated base URLs "
                                        "(http://10.0.0.5:8000), each optionally NAME=URL", **NAMES)
    frontends_service: str | None = option(None, "a Kubernetes Service whose EndpointSlices (its ready endpoints) "
                                                 "are the replicas' frontends, watched")
    namespace: str | None = option(None, "the Service's namespace (default: this pod's)")
    frontend_port: int = option(FRONTEND_PORT, "the frontends' port where an EndpointSlice names no port "
                                               "called http", parse=int)
    block_chars: int = option(ROUTER_BLOCK_CHARS, "characters of a prompt per prefix block (the unit of "
                                                  "prefix affinity)", parse=int)
    affinity_ttl: float = option(ROUTER_AFFINITY_TTL_S, "seconds a prefix block stays associated with the "
                                                        "replica it was last sent to", parse=float)
    affinity_entries: int = option(ROUTER_AFFINITY_ENTRIES, "prefix blocks remembered (least recently used "
                                                            "dropped first)", parse=int)
    balance_abs: float = option(ROUTER_BALANCE_ABS, "a replica holding the prefix is skipped when its load "
                                                    "(requests in flight + waiting) exceeds the least loaded's by "
                                                    "more than this ...", parse=float)
    balance_rel: float = option(ROUTER_BALANCE_REL, "... and is more than this many times the least loaded's",
                                parse=float)
    max_body_bytes: int = option(4 * 1024 * 1024, "largest request body (413 beyond)", parse=int)
    load_poll_interval: float = option(1.0, "seconds between reads of each frontend's /metrics "
                                            "(inferencemesh_num_requests_waiting)", parse=float)

    def check(self) -> RouterConfig:
        if bool(self.frontends) == bool(self.frontends_service):
            raise ConfigError("give the replicas either as --frontends URL,... or as --frontends-service NAME "
                              "(a Kubernetes Service), " + ("not both" if self.frontends else "one of them"))
        if self.namespace and not self.frontends_service:
            raise ConfigError("--namespace is the namespace of --frontends-service: it needs one")
        for name in ("block_chars", "affinity_entries", "max_body_bytes", "frontend_port"):
            if getattr(self, name) < 1:
                raise ConfigError(f"{flag_name(name)} must be at least 1, not {getattr(self, name)}")
        for name in ("affinity_ttl", "load_poll_interval"):
            if getattr(self, name) <= 0:
                raise ConfigError(f"{flag_name(name)} must be more than 0, not {getattr(self, name)}")
        if self.balance_abs < 0 or self.balance_rel < 1:
            raise ConfigError("--balance-abs must be 0 or more and --balance-rel at least 1")
        self._check_timeouts()
        return self

    def ports(self) -> list[tuple[str, str, int]]:
        """(what, host, port) of every port this program listens on."""
        return [("router endpoint (--port)", self.host, self.port)]


@dataclass(frozen=True, kw_only=True)
class PlanConfig(ModelOptions, RuntimeOptions, SpeculativeOptions, LocalMeshOptions):
    """`inferencemesh plan`: the memory-planned layer ranges (the speculative options say which
    draft the frontend loads, for --embed-first-stage)."""

    stages: str = option("2", "a number, or auto (needs --stage-memory)")
    json: bool = switch("print the plan as JSON")
    layout: bool = switch("print spec.model.layout for an InferenceMesh whose model the operator cannot read "
                          "(spec.model.pvc): the checkpoint's sizes in --dtype on --device")

    def check(self) -> PlanConfig:
        check_counts(self)
        return self


@dataclass(frozen=True, kw_only=True)
class OperatorConfig:
    """`inferencemesh operator`: the kopf operator (what the chart's Deployment runs)."""

    namespace: tuple[str, ...] = option((), "watch only this namespace (repeat for several; none: all)",
                                        repeat=True)
    standalone: bool = switch("no peering (a single replica)")
    liveness: str = option("http://0.0.0.0:8080/healthz", "kopf's liveness endpoint (empty: off)")
    metrics_port: int = option(9090, "Prometheus /metrics port (0: off)", parse=int)

    def ports(self) -> list[tuple[str, str, int]]:
        """(what, host, port) of the ports this program listens on (kopf's liveness: its own URL)."""
        return [("operator metrics (--metrics-port)", "", self.metrics_port)]


def kv_pool_tokens(kv_cache_tokens: int, max_context: int) -> int:
    """The positions of a stage's KV pool: --kv-cache-tokens, or by default DEFAULT_KV_CONTEXTS full
    contexts. The stages allocate it, the frontend gives it out and the planner sizes memory by it:
    all three call this."""
    return kv_cache_tokens or DEFAULT_KV_CONTEXTS * max_context


def check_counts(config: Any) -> None:
    """The counts every program shares; a field of another type under the same name (plan's
    `--stages auto`, bench's comma-separated lists) is its own type's to check."""
    for name in ("max_context", "max_sessions", "max_batch_tokens", "draft_threads", "stages", "num_stages",
                 "max_message_bytes", "replicas"):
        value = getattr(config, name, 1)
        if isinstance(value, int) and value < 1:
            raise ConfigError(f"{flag_name(name)} must be at least 1, not {value}")
    for name in ("threads", "stage_threads", "speculative_disable_by_batch_size",  # 0: automatic / off
                 "kv_cache_tokens", "drain_timeout"):
        value = getattr(config, name, 0)
        if isinstance(value, int | float) and value < 0:
            raise ConfigError(f"{flag_name(name)} must be 0 or more, not {value}")


def _check_layer_range(name: str, layers: tuple[int, int]) -> None:
    start, end = layers
    if not 0 <= start < end:
        raise ConfigError(f"{flag_name(name)} {start}:{end}: need 0 <= START < END")
