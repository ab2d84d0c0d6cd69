"""`inferencemesh bench --structured`: what a json_schema constraint costs decoding.

Per stage count and --speculative strategy, two configurations over the same prompts, one stream,
greedy: free text (to --new-tokens) and json_schema-constrained (until the grammar ends the
output, or --new-tokens). They take turns prompt by prompt and round by round (latency.measure),
so a noisy machine's drift falls on both alike. Reported per pair: decode tokens/s (tokens after
the first over the time after the first: what a grammar's masks can slow), the ratio
constrained / free (target >= 0.9), the draft acceptance rate under the schema beside the free
one, and the mask time per frame. The schema is strict and bounded (integer ranges, string
maxLength, enums, array maxItems): an unbounded number or string lets a small model run to the
token limit, measuring the model rather than the grammar.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from inferencemesh.flags import ConfigError
from inferencemesh.programs.bench.config import BenchConfig
from inferencemesh.programs.bench.latency import Measured, measure
from inferencemesh.programs.bench.mesh import in_process_pipeline, meshes, start_mesh
from inferencemesh.programs.bench.models import MAX_CONTEXT, BenchModel
from inferencemesh.programs.bench.report import header, percentile
from inferencemesh.programs.bench.runners import EngineUnderTest, Run, SpecCounter, proposer

if TYPE_CHECKING:
    from inferencemesh.frontend.engine.constraints import Constraint
    from inferencemesh.frontend.engine.grammar import GrammarTokenizer

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 16},
        "port": {"type": "integer", "minimum": 1, "maximum": 65535},
        "workers": {"type": "integer", "minimum": 1, "maximum": 64},
        "mode": {"enum": ["fast", "safe", "debug"]},
        "hosts": {"type": "array", "items": {"type": "string", "maxLength": 12}, "minItems": 1, "maxItems": 3},
        "owner": {"type": "object", "properties": {"id": {"type": "integer", "minimum": 0, "maximum": 999},
                                                   "team": {"enum": ["infra", "ml", "web"]}},
                  "required": ["id", "team"], "additionalProperties": False},
    },
    "required": ["name", "port", "workers", "mode", "hosts", "owner"],
    "additionalProperties": False,
}
RESPONSE_FORMAT = {"type": "json_schema", "json_schema": {"name": "service", "strict": True, "schema": SCHEMA}}
# Code prompts that a JSON value would continue: free text and the schema start from the same place.
PROMPTS = [
    "# config for the service\nconfig = ",
    "import json\n\n# the deployment, as the API returns it\ndeployment = ",
    "def default_settings():\n    \"\"\"The settings a new service starts with.\"\"\"\n    return ",
    "# test fixture: one service record\nSERVICE = ",
]


@dataclass
class Masks:
    """Each frame's mask time, as the engine's grammar reports it (FrontendMetrics.mask_timer's shape)."""

    seconds: list[float] = field(default_factory=list)

    def __call__(self, elapsed: float) -> None:
        self.seconds.append(elapsed)


def decode_tokens_per_s(runs: list[Run]) -> float | None:
    """Tokens after the first over the time after the first token, over all runs."""
    tokens, seconds = sum(r.tokens - 1 for r in runs), sum(r.total_s - r.ttft_s for r in runs)
    return round(tokens / seconds, 2) if tokens > 0 and seconds > 0 else None


@dataclass(frozen=True)
class ConstrainedDecoding:
    """What every constrained configuration shares: the schema's constraint, the grammar's view of
    the tokenizer, and the tokens a constrained output ends on."""

    constraint: Constraint
    grammar_tokenizer: GrammarTokenizer
    stops: frozenset[int]


def constrained_decoding(model: BenchModel) -> ConstrainedDecoding:
    """RESPONSE_FORMAT's constraint over `model`'s tokenizer (ConfigError: its logits do not cover it)."""
    from inferencemesh.frontend.engine.grammar import grammar_tokenizer
    from inferencemesh.frontend.openai.jobs import END_OF_TURN_TOKENS
    from inferencemesh.frontend.openai.structured_outputs import constraint_from_request

    tokenizer, vocab_size = model.tokenizer, model.facts.vocab_size
    if len(tokenizer) > vocab_size:  # a random-weight shape narrower than the tokenizer it borrows
        raise ConfigError(f"--structured needs a model whose {vocab_size} logits cover its tokenizer's "
                          f"{len(tokenizer)} tokens (the bundled model does)")
    # What the frontend ends a constrained output on (JobBuilder): EOS and end-of-turn markers.
    vocab = tokenizer.get_vocab()
    stops = {vocab[t] for t in END_OF_TURN_TOKENS if t in vocab} | {tokenizer.eos_token_id} - {None}
    constraint = constraint_from_request(response_format=RESPONSE_FORMAT)
    assert constraint is not None
    return ConstrainedDecoding(constraint, grammar_tokenizer(tokenizer, vocab_size, sorted(stops)), frozenset(stops))


def run_structured(config: BenchConfig, model: BenchModel, speculation: dict) -> dict:
    constrained = constrained_decoding(model)
    prompts = [model.tokenizer(p).input_ids for p in PROMPTS]
    threads = torch.get_num_threads()
    with meshes() as started:
        pipelines = []
        for count in config.stages:
            if count == 1:
                pipelines.append(("in-process-1-stage", 1, in_process_pipeline(model, MAX_CONTEXT), threads))
                continue
            for form in config.first_stage:
                mesh = start_mesh(model.model_dir, model.dtype_name, count, MAX_CONTEXT, first_stage=form,
                              quantization=model.quantization)
                started.append(mesh)
                pipelines.append((mesh.label, count, mesh.pipeline, mesh.threads))
        configs, masks = configurations(config, pipelines, speculation, constrained, prompts)
        print(f"  {len(configs)} configurations, {config.repeats} interleaved rounds", flush=True)
        asyncio.run(measure(configs, config.repeats))
        torch.set_num_threads(threads)
        results = [result(c, masks.get(index)) for index, c in enumerate(configs)]
    report = {**header(config, model, threads), "schema": SCHEMA, "prompts": PROMPTS, "results": results,
              "structured": pairs(results)}
    for pair in report["structured"]:
        print(f"  {pair['label']:<34} decode {pair['free_decode_tokens_per_s']} -> "
              f"{pair['json_schema_decode_tokens_per_s']} tok/s (x{pair['json_schema_vs_free']}), acceptance "
              f"{pair.get('acceptance_rate_free')} -> {pair.get('acceptance_rate_json_schema')}", flush=True)
    return report


def configurations(config: BenchConfig, pipelines: list[tuple[str, int, Any, int]], speculation: dict,
                   constrained: ConstrainedDecoding,
                   prompts: list[list[int]]) -> tuple[list[Measured], dict[int, Masks]]:
    """Per pipeline (label, stage count, pipeline, threads) and strategy, the free and the
    json_schema configuration; and each constrained one's mask timer, by index in the list."""
    from inferencemesh.frontend.engine.grammar import ConstrainedOutput

    configs: list[Measured] = []
    masks: dict[int, Masks] = {}
    for label, count, pipeline, config_threads in pipelines:
        for strategy in config.speculative:
            for output in ("free", "json_schema"):
                counter = SpecCounter() if strategy != "none" else None
                grammar = None
                if output == "json_schema":
                    masks[len(configs)] = timer = Masks()
                    grammar = ConstrainedOutput(constrained.constraint, constrained.grammar_tokenizer,
                                                mask_timer=timer)
                runner = EngineUnderTest(pipeline, config.new_tokens, MAX_CONTEXT,
                                         proposer(speculation, strategy, counter),
                                         config.speculative_disable_by_batch_size, constrained=grammar,
                                         stop_token_ids=constrained.stops if grammar else frozenset())
                name = f"{label}+{strategy}" if strategy != "none" else label
                extra = {"stages": count, "speculative": strategy, "output": output}
                configs.append(Measured(f"{name} {output}", extra, prompts, runner, config_threads, counter))
    return configs, masks


def result(measured: Measured, masks: Masks | None) -> dict:
    """One configuration's entry: decode tok/s, mean tokens, and a constrained one's mask times."""
    entry = measured.entry()
    entry["decode_tokens_per_s"] = decode_tokens_per_s(measured.runs)
    entry["mean_tokens"] = round(sum(r.tokens for r in measured.runs) / len(measured.runs), 1)
    if masks is not None:  # the warm-up's frames too: mask time does not drift with the machine
        entry["mask_ms_p50"] = round(1000 * (percentile(masks.seconds, 50) or 0), 4)
        entry["mask_ms_p99"] = round(1000 * (percentile(masks.seconds, 99) or 0), 4)
    return entry


def pairs(results: list[dict]) -> list[dict]:
    """Each configuration's free and constrained entries side by side, with their ratio."""
    out = []
    for free in (r for r in results if r["output"] == "free"):
        label = free["label"].removesuffix(" free")
        schema = next(r for r in results if r["label"] == f"{label} json_schema")
        pair = {"label": label, "stages": free["stages"], "speculative": free["speculative"],
                "free_decode_tokens_per_s": free["decode_tokens_per_s"],
                "json_schema_decode_tokens_per_s": schema["decode_tokens_per_s"],
                "json_schema_vs_free": (round(schema["decode_tokens_per_s"] / free["decode_tokens_per_s"], 3)
                                        if schema["decode_tokens_per_s"] and free["decode_tokens_per_s"] else None),
                "json_schema_mean_tokens": schema["mean_tokens"], "mask_ms_p99": schema.get("mask_ms_p99")}
        if "acceptance_rate" in free:
            pair["acceptance_rate_free"] = free["acceptance_rate"]
            pair["acceptance_rate_json_schema"] = schema["acceptance_rate"]
        out.append(pair)
    return out
