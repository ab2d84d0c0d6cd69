"""The multi-turn bench (--multi-turn): chat and agent workloads that send their prefix again.

Per stage count and --first-stage form, over stage processes as `inferencemesh serve` starts them,
one engine with the prefix cache and one without, taking turns (greedy, no speculation):
- a conversation: a ~1,500-token system prompt and --turns user turns, each prompt the whole
  conversation so far; TTFT per turn, cache on ÷ off;
- an identical request sent twice (a prompt neither engine has seen): the repeat's TTFT ÷ the
  first's;
- --concurrency conversations (default 8) sharing the system prompt (warmed by one request
  before), started together, 3 turns each: the prompt tokens the stages computed, counted at the last stage's /metrics
  (every stage computes the same positions), on ÷ off;
- decode tok/s of the conversation's answers, on ÷ off: the cache's bookkeeping must not cost
  the hot path.
Both engines must give the same answers (greedy); the report says whether they did.
"""

from __future__ import annotations

import asyncio
import re
import time
import urllib.request

import torch

from inferencemesh.programs.bench.config import BenchConfig
from inferencemesh.programs.bench.mesh import BenchMesh, meshes, start_mesh
from inferencemesh.programs.bench.models import PROMPTS, BenchModel
from inferencemesh.programs.bench.report import header
from inferencemesh.programs.bench.runners import EngineUnderTest, Run

SYSTEM_TOKENS = 1500
TURN_TOKENS = 24  # each user turn
CONVERSATIONS = 8  # sharing the system prompt, unless --concurrency says how many
CONVERSATION_TURNS = 3
CONTEXT = 4096  # the longest conversation: the system prompt, the turns and their answers


def encode(model: BenchModel, text: str, special: bool = True) -> list[int]:
    """Token ids of `text` within the model's vocabulary (a random-weight shape may have fewer ids
    than the tokenizer it borrows)."""
    return [t % model.facts.vocab_size for t in model.tokenizer(text, add_special_tokens=special).input_ids]


def system_prompt(model: BenchModel) -> list[int]:
    """SYSTEM_TOKENS tokens of code text: what a system prompt with tool definitions looks like."""
    text, ids = "", list[int]()
    while len(ids) < SYSTEM_TOKENS:
        text += "".join(PROMPTS["code"])
        ids = encode(model, text)
    return ids[:SYSTEM_TOKENS]


def user_turn(model: BenchModel, conversation: int, turn: int) -> list[int]:
    """A user turn of TURN_TOKENS tokens, different for every conversation and turn."""
    text = f"\nUser {conversation}.{turn}: " + PROMPTS["prose"][(conversation + turn) % len(PROMPTS["prose"])]
    return encode(model, text, special=False)[:TURN_TOKENS]


def last_stage_metric(mesh: BenchMesh, pattern: str) -> float:
    """A value of the mesh's last stage process's /metrics: the first sample line `pattern` matches."""
    port = mesh.stages.metrics_ports[-1]
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    found = re.search(pattern, text, re.M)
    if found is None:
        raise RuntimeError(f"stage metrics on :{port} have no line matching {pattern}")
    return float(found[1])


def stage_tokens(mesh: BenchMesh) -> float:
    """Token positions the last stage has computed so far."""
    return last_stage_metric(mesh, r"^inferencemesh_stage_tokens_total\{.*\} (\S+)$")


class Pair:
    """The same mesh behind two engines: the prefix cache on and off."""

    def __init__(self, mesh: BenchMesh, new_tokens: int) -> None:
        self.mesh = mesh
        self.engines = {cache: EngineUnderTest(mesh.pipeline, new_tokens, CONTEXT, prefix_cache=cache)
                        for cache in (False, True)}

    async def answer(self, cache: bool, prompt: list[int]) -> tuple[Run, list[int]]:
        """One greedy request: its timings and its tokens."""
        engine = self.engines[cache]
        started = time.perf_counter()
        arrivals, tokens = [], []
        async for step in engine.steps(prompt):
            arrivals.append(time.perf_counter())
            tokens.extend(step)
        return Run(arrivals[0] - started, arrivals[-1] - started, len(tokens)), tokens


async def conversation(pair: Pair, system: list[int], model: BenchModel, turns: int) -> dict:
    """One conversation, each turn asked of both engines (alternating which goes first)."""
    history, rows, same = list(system), [], True
    decode = {False: [0, 0.0], True: [0, 0.0]}  # tokens after the first, and their seconds
    for turn in range(turns):
        history += user_turn(model, 0, turn)
        answers = {}
        runs: dict[bool, Run] = {}
        for cache in ((False, True) if turn % 2 == 0 else (True, False)):
            runs[cache], answers[cache] = await pair.answer(cache, history)
            decode[cache][0] += runs[cache].tokens - 1
            decode[cache][1] += runs[cache].total_s - runs[cache].ttft_s
        same &= answers[False] == answers[True]
        rows.append({"turn": turn + 1, "prompt_tokens": len(history), "ttft_s_off": round(runs[False].ttft_s, 4),
                     "ttft_s_on": round(runs[True].ttft_s, 4),
                     "ttft_on_over_off": round(runs[True].ttft_s / runs[False].ttft_s, 4)})
        history += answers[True]
    tps = {cache: tokens / seconds if seconds else 0.0 for cache, (tokens, seconds) in decode.items()}
    return {"turns": rows, "same_answers": same, "decode_tokens_per_s_off": round(tps[False], 2),
            "decode_tokens_per_s_on": round(tps[True], 2),
            "decode_on_over_off": round(tps[True] / tps[False], 4) if tps[False] else None}


async def repeat(pair: Pair, system: list[int], model: BenchModel) -> dict:
    prompt = list(reversed(system)) + user_turn(model, 99, 0)  # a prompt no engine has seen
    cold, first = await pair.answer(True, prompt)
    computed = stage_tokens(pair.mesh)
    warm, second = await pair.answer(True, prompt)
    computed = stage_tokens(pair.mesh) - computed  # the repeat's positions at the last stage: no copy, only these
    return {"prompt_tokens": len(prompt), "ttft_s_cold": round(cold.ttft_s, 4), "ttft_s_repeat": round(warm.ttft_s, 4),
            "repeat_over_cold": round(warm.ttft_s / cold.ttft_s, 4), "repeat_positions_computed": int(computed),
            "same_answers": first == second}


async def _decode_steps_of_one(pair: Pair, cache: bool, system: list[int], model: BenchModel,
                               c: int) -> int:
    """Conversation c's CONVERSATION_TURNS turns: how many decode steps (one position each) it took."""
    history, steps = list(system), 0
    for turn in range(CONVERSATION_TURNS):
        history += user_turn(model, c, turn)
        run, answer = await pair.answer(cache, history)
        steps += run.tokens - 1
        history += answer
    return steps


async def shared_system_prompt(pair: Pair, system: list[int], model: BenchModel, conversations: int) -> dict:
    """`conversations` conversations started together, per engine: prompt tokens the stages computed."""
    out = {}
    for cache in (False, True):
        await pair.answer(cache, system + user_turn(model, 1000, 0))  # the system prompt, seen once
        before = stage_tokens(pair.mesh)
        decoded = sum(await asyncio.gather(*(_decode_steps_of_one(pair, cache, system, model, c)
                                             for c in range(conversations))))
        out[cache] = stage_tokens(pair.mesh) - before - decoded
    return {"conversations": conversations, "turns": CONVERSATION_TURNS, "prompt_tokens_computed_off": out[False],
            "prompt_tokens_computed_on": out[True], "on_over_off": round(out[True] / out[False], 4)}


async def measure(pair: Pair, stages: int, system: list[int], model: BenchModel, turns: int,
                  conversations: tuple[int, ...]) -> dict:
    return {"label": pair.mesh.label, "stages": stages,
            "conversation": await conversation(pair, system, model, turns),
            "repeat": await repeat(pair, system, model),
            "shared_system_prompt": [await shared_system_prompt(pair, system, model, count)
                                     for count in conversations]}


def run_multi_turn(config: BenchConfig, model: BenchModel) -> dict:
    system = system_prompt(model)
    threads = torch.get_num_threads()
    results = []
    with meshes() as started:
        for count, form in [(c, f) for c in config.stages for f in config.first_stage]:
            mesh = start_mesh(model.model_dir, model.dtype_name, count, CONTEXT, first_stage=form,
                              quantization=model.quantization)
            started.append(mesh)
            torch.set_num_threads(mesh.threads)
            entry = asyncio.run(measure(Pair(mesh, config.new_tokens), count, system, model, config.turns,
                                        config.concurrency or (CONVERSATIONS,)))
            print(f"  {mesh.label}: {entry}", flush=True)
            results.append(entry)
            torch.set_num_threads(threads)
    report = {**header(config, model, threads), "system_prompt_tokens": SYSTEM_TOKENS, "results": results}
    for entry in results:
        n = entry["stages"] if entry["label"].startswith("embedded") else f"{entry['stages']}_{entry['label']}"
        last = entry["conversation"]["turns"][-1]
        report[f"turn_{last['turn']}_ttft_on_over_off_stages_{n}"] = last["ttft_on_over_off"]
        report[f"repeat_ttft_over_cold_stages_{n}"] = entry["repeat"]["repeat_over_cold"]
        for shared in entry["shared_system_prompt"]:
            key = f"shared_prompt_tokens_on_over_off_{shared['conversations']}_conversations_stages_{n}"
            report[key] = shared["on_over_off"]
        report[f"decode_on_over_off_stages_{n}"] = entry["conversation"]["decode_on_over_off"]
        report[f"same_answers_stages_{n}"] = entry["conversation"]["same_answers"] and entry["repeat"]["same_answers"]
    return report
