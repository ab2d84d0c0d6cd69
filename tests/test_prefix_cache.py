"""The prefix cache over KV blocks (frontend/engine/kv_blocks.py): a prompt reuses the computed
full blocks of every earlier prompt by reference, as soon as every stage has computed them. The
answers are the same with the cache on and off; the stages' token counters and the engine's
counters prove the reuse; a pool smaller than the conversations preempts, never fails; a stage
that restarted holds nothing and costs a full prefill, never an answer."""

from __future__ import annotations

import asyncio
import contextlib
import re
import time
import urllib.request
from pathlib import Path

import pytest
from mesh_helpers import embedded_pipeline, hf_greedy, start_mesh
from tiny_models import write_tiny_model

from inferencemesh.frontend.engine.api import GenerationRequest
from inferencemesh.frontend.engine.engine import EngineOptions, PipelineEngine
from inferencemesh.frontend.engine.metrics import FrontendMetrics
from inferencemesh.frontend.engine.pipeline import GrpcPipeline
from inferencemesh.protocol.transport import KV_BLOCK_TOKENS as BT

CONTEXT = 256
SYSTEM = [(17 * i + 5) % 250 + 3 for i in range(40)]  # a shared "system prompt": 2 full blocks and 8


def full_blocks(prompt: list[int]) -> int:
    """The positions a prompt can reuse at most: the full blocks of all but its last token."""
    return (len(prompt) - 1) // BT * BT


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> Path:
    return write_tiny_model(tmp_path_factory.mktemp("prefix") / "m", "llama", num_layers=4, shards=1)


@pytest.fixture(scope="module")
def mesh(model: Path):
    mesh = start_mesh(model, 2, max_context=CONTEXT)
    yield mesh
    mesh.stop()


def stage_tokens(mesh) -> list[float]:
    """Token positions each stage has computed so far."""
    out = []
    for port in mesh.metrics_ports:
        text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
        out.append(float(re.search(r"^inferencemesh_stage_tokens_total\{.*\} (\S+)$", text, re.M)[1]))
    return out


class Session:
    """One engine (one frontend) over the mesh, kept across requests, as a served frontend is."""

    def __init__(self, mesh, prefix_cache: bool = True, pipeline=None, **options) -> None:
        self.loop = asyncio.new_event_loop()
        self.metrics = FrontendMetrics("t")
        self.engine = PipelineEngine(pipeline or GrpcPipeline(mesh.addresses),
                                     EngineOptions("t", max_context=CONTEXT, prefix_cache=prefix_cache, **options),
                                     metrics=self.metrics)
        self.free_at_start = self.engine.blocks.available

    async def drain(self, request: GenerationRequest, n: int = 1, stop_after: int | None = None
                    ) -> list[tuple[list[int], list]]:
        """Per choice: its tokens and logprobs; stop_after: the client leaves after that many steps."""
        async def one(choice) -> tuple[list[int], list]:
            tokens: list[int] = []
            logprobs: list = []
            try:
                async for step in choice:
                    tokens.extend(step)
                    logprobs.extend(step.logprobs or [])
                    if stop_after is not None and len(tokens) >= stop_after:
                        break
            finally:
                await choice.aclose()
            return tokens, logprobs

        return list(await asyncio.gather(*(one(c) for c in await self.engine.generate_n(request, n))))

    def steps(self, prompt: list[int], new_tokens: int, n: int = 1, **sampling) -> list[tuple[list[int], list]]:
        request = GenerationRequest(f"r-{time.monotonic_ns()}", prompt, new_tokens, **sampling)
        return self.loop.run_until_complete(self.drain(request, n))

    def run(self, prompt: list[int], new_tokens: int, n: int = 1, **sampling) -> list[list[int]]:
        return [tokens for tokens, _ in self.steps(prompt, new_tokens, n, **sampling)]

    def together(self, prompts: list[list[int]], new_tokens: int, **sampling) -> list[list[int]]:
        """Every prompt at once, one choice each."""
        async def go() -> list[list[int]]:
            runs = [self.drain(GenerationRequest(f"r{i}-{time.monotonic_ns()}", p, new_tokens, **sampling))
                    for i, p in enumerate(prompts)]
            return [choices[0][0] for choices in await asyncio.gather(*runs)]

        return self.loop.run_until_complete(go())

    def counted(self, name: str) -> float:
        value = self.metrics.registry.get_sample_value(f"inferencemesh_{name}_total", {"model_name": "t"})
        return value or 0.0

    def assert_every_block_free(self) -> None:
        """Nothing holds a block once every request ended (cached ones count as free)."""
        assert self.engine.blocks.available == self.free_at_start == self.engine.blocks.num_blocks
        assert sum(self.engine.blocks.refs) == 0

    def close(self) -> None:
        self.loop.run_until_complete(self.engine.close())
        self.loop.close()


@pytest.fixture
def cached(mesh):
    session = Session(mesh)
    yield session
    session.assert_every_block_free()
    session.close()


def uncached(mesh, work):
    """`work` on an engine without the cache, which is closed after it: a stage's pool serves one
    stream (one frontend) at a time, so the cached engine's stream opens after this one ends."""
    session = Session(mesh, prefix_cache=False)
    try:
        return work(session)
    finally:
        session.assert_every_block_free()
        session.close()


def test_an_identical_request_reuses_its_full_blocks_and_answers_the_same(mesh, model, cached) -> None:
    prompt = SYSTEM + [11, 12, 13]  # 43 tokens: 2 full blocks of the first 42 are reused
    first = cached.run(prompt, 8, temperature=0.0)
    before = stage_tokens(mesh)
    second = cached.run(prompt, 8, temperature=0.0)
    computed = [a - b for a, b in zip(stage_tokens(mesh), before, strict=True)]
    assert first == second == [hf_greedy(model, prompt, 8)]
    reused = full_blocks(prompt)
    assert cached.counted("prefix_cache_hits") == reused and cached.counted("prefix_cache_queries") == 2 * len(prompt)
    assert computed == [len(prompt) - reused + 7] * 2  # the rest of the prompt, then 7 decode steps: every stage


def test_a_multi_turn_conversation_computes_only_what_its_blocks_do_not_hold(mesh, model) -> None:
    turns = [[21, 22, 23, 24], [31, 32], [41, 42, 43]]
    conversation, asked, answers_on, computed, reused = list(SYSTEM), [], [], [], []
    cached = Session(mesh)
    try:
        for turn in turns:
            conversation += turn
            asked.append(list(conversation))
            before, hits = stage_tokens(mesh)[0], cached.counted("prefix_cache_hits")
            [on] = cached.run(conversation, 6, temperature=0.0)
            computed.append(stage_tokens(mesh)[0] - before)
            reused.append(cached.counted("prefix_cache_hits") - hits)
            answers_on.append(on)
            conversation += on
        cached.assert_every_block_free()
    finally:
        cached.close()
    assert answers_on == uncached(mesh, lambda off: [off.run(p, 6, temperature=0.0)[0] for p in asked])
    prompts = [len(SYSTEM) + 4, len(SYSTEM) + 4 + 6 + 2, len(SYSTEM) + 4 + 6 + 2 + 6 + 3]
    # turn 2 onwards: every full block the last turn's prompt and answer (but its last token) filled
    assert reused[1:] == [(prompts[0] + 5) // BT * BT, (prompts[1] + 5) // BT * BT]
    assert computed[1:] == [p - r + 5 for p, r in zip(prompts[1:], reused[1:], strict=True)]


def test_seeded_sampling_penalties_and_n_choices_are_the_same_with_the_cache(mesh, cached) -> None:
    prompt = SYSTEM + [5, 6, 7]
    sampling = {"temperature": 0.9, "top_p": 0.9, "seed": 1234, "repetition_penalty": 1.3, "frequency_penalty": 0.5}
    off = uncached(mesh, lambda session: session.run(prompt, 10, n=3, **sampling))
    cached.run(prompt, 10, **sampling)  # the prompt's blocks computed
    on = cached.run(prompt, 10, n=3, **sampling)
    assert cached.counted("prefix_cache_hits") >= full_blocks(prompt)
    assert on == off
    assert len(set(map(tuple, on))) > 1  # the choices sample with seeds of their own


def test_logprobs_are_the_same_with_the_cache(mesh, cached) -> None:
    """Reused blocks hold the KV a full prefill computes: each token's logprob and its
    alternatives agree (within float32 summation order), and the tokens are the same."""
    prompt = SYSTEM + [8, 9, 10]
    [(off_tokens, off)] = uncached(mesh, lambda session: session.steps(prompt, 8, temperature=0.0, logprobs=3))
    cached.run(prompt + [1], 4, temperature=0.0)
    [(on_tokens, on)] = cached.steps(prompt, 8, temperature=0.0, logprobs=3)
    assert cached.counted("prefix_cache_hits") >= full_blocks(prompt)
    assert on_tokens == off_tokens and len(on) == len(off) == 8
    for a, b in zip(on, off, strict=True):
        assert a.token == b.token and [t for t, _ in a.top] == [t for t, _ in b.top]
        assert a.logprob == pytest.approx(b.logprob, abs=1e-4)
        assert [lp for _, lp in a.top] == pytest.approx([lp for _, lp in b.top], abs=1e-4)


def test_a_burst_sharing_a_prefix_computes_it_about_once(mesh, model, cached) -> None:
    """Requests that arrive together wait for the blocks the first of them is computing."""
    shared = [(7 * i + 3) % 240 + 5 for i in range(6 * BT)]
    prompts = [shared + [200 + k, 201 + k] for k in range(8)]
    before = stage_tokens(mesh)[0]
    answers = cached.together(prompts, 3, temperature=0.0)
    computed = stage_tokens(mesh)[0] - before
    assert answers == [hf_greedy(model, p, 3) for p in prompts]
    assert cached.counted("prefix_cache_hits") >= 6 * len(shared) // 2
    assert computed <= 2 * len(shared) + 8 * (2 + 2 + BT)


def test_a_cancelled_requests_computed_blocks_are_hit_by_the_next_identical_one(mesh, model, cached) -> None:
    prompt = [(11 * i + 1) % 240 + 5 for i in range(5 * BT + 3)]
    request = GenerationRequest("cancelled", prompt, 50, temperature=0.0)
    cached.loop.run_until_complete(cached.drain(request, stop_after=1))  # the client leaves after a token
    hits = cached.counted("prefix_cache_hits")
    assert cached.run(prompt, 4, temperature=0.0) == [hf_greedy(model, prompt, 4)]
    assert cached.counted("prefix_cache_hits") - hits == full_blocks(prompt)


def test_chunked_prompts_share_blocks_as_each_chunk_is_acknowledged_and_a_cancel_leaks_none(mesh, model) -> None:
    """Prompt chunks of one block each go out without waiting for their Acks; a request arriving
    meanwhile waits for the blocks being computed. A request cancelled during its prefill leaves
    the blocks its acknowledged chunks computed cached, and nothing held."""
    session = Session(mesh, prefill_chunk=BT)
    try:
        shared = [(5 * i + 2) % 240 + 5 for i in range(8 * BT)]
        prompts = [shared + [210 + k] for k in range(4)]
        before = stage_tokens(mesh)[0]
        assert session.together(prompts, 2, temperature=0.0) == [hf_greedy(model, p, 2) for p in prompts]
        assert stage_tokens(mesh)[0] - before <= 2 * len(shared) + 4 * (1 + BT + 1)
        assert session.counted("prefix_cache_hits") >= 2 * len(shared)

        async def cancelled() -> None:
            request = GenerationRequest("gone", [9] * (10 * BT) + [7], 20, temperature=0.0)
            task = asyncio.ensure_future(session.drain(request))
            await asyncio.sleep(0.05)
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task

        session.loop.run_until_complete(cancelled())
        prompt = [9] * (10 * BT) + [7]
        assert session.run(prompt, 3, temperature=0.0) == [hf_greedy(model, prompt, 3)]
        session.assert_every_block_free()
    finally:
        session.close()


def test_more_conversations_than_the_pool_holds_all_finish_exactly_with_preemptions(mesh, model) -> None:
    """A pool of 24 blocks (384 positions) for 8 conversations of up to 104 positions at once:
    sessions that cannot grow preempt the most recently admitted, which recompute later."""
    session = Session(mesh, kv_blocks=24)
    try:
        prompts = [[100 + k] * 3 + SYSTEM[k:] for k in range(8)]
        sampled = {"temperature": 0.8, "seed": 7}
        alone = [session.run(p, 60, **sampled)[0] for p in prompts[:3]]
        answers = session.together(prompts, 60, temperature=0.0)
        assert answers == [hf_greedy(model, p, 60) for p in prompts]
        assert session.together(prompts[:3] * 2, 60, **sampled) == alone * 2
        assert session.counted("num_preemptions") > 0 and session.engine.waiting == 0
        session.assert_every_block_free()
    finally:
        session.close()


def test_the_engine_gives_out_no_more_blocks_than_the_stages_pools_hold(mesh, model) -> None:
    session = Session(mesh, kv_blocks=100_000)
    try:
        assert session.loop.run_until_complete(session.engine.is_ready())
        assert session.engine.blocks.num_blocks == 16 * CONTEXT // BT  # the stages' default pool
        assert session.run(SYSTEM, 3, temperature=0.0) == [hf_greedy(model, SYSTEM, 3)]
    finally:
        session.close()


def test_a_prompt_larger_than_the_pool_is_refused_naming_its_length(mesh) -> None:
    from inferencemesh.frontend.engine.errors import InvalidRequest

    session = Session(mesh, kv_blocks=4)
    try:
        with pytest.raises(InvalidRequest, match="64 tokens"):
            session.run(list(range(3, 67)), 4, temperature=0.0)
    finally:
        session.close()


def test_a_stage_restarted_between_turns_costs_a_full_prefill_not_an_answer(mesh, model) -> None:
    session = Session(mesh)
    try:
        prompt = SYSTEM + [61, 62]
        assert session.run(prompt, 6, temperature=0.0) == [hf_greedy(model, prompt, 6)]
        stage = mesh.processes[-1]
        stage.stop()
        stage.start()
        mesh.wait_ready(120)
        turn = prompt + [71, 72, 73]
        assert session.run(turn, 6, temperature=0.0) == [hf_greedy(model, turn, 6)]
        hits = session.counted("prefix_cache_hits")
        assert session.run(turn, 6, temperature=0.0) == [hf_greedy(model, turn, 6)]
        assert session.counted("prefix_cache_hits") == hits + full_blocks(turn)  # cached again
        session.assert_every_block_free()
    finally:
        session.close()


def test_four_stages_with_the_first_embedded_serve_a_conversation_exactly(model) -> None:
    """Stage 0 in the frontend's process (a LocalStage), three stage processes after it."""
    mesh = start_mesh(model, 4, max_context=CONTEXT, embed_first=True)
    session = Session(mesh, pipeline=embedded_pipeline(model, mesh, max_context=CONTEXT))
    try:
        conversation = SYSTEM + [81, 82]
        for turn in ([91, 92, 93], [101, 102]):
            [answer] = session.run(conversation, 5, temperature=0.0)
            assert answer == hf_greedy(model, conversation, 5)
            conversation += answer + turn
        assert session.run(conversation, 5, temperature=0.0) == [hf_greedy(model, conversation, 5)]
        # turns 2 and 3 reused the full blocks of what the turn before computed (42 + 4, 50 + 4 positions)
        assert session.counted("prefix_cache_hits") == 2 * BT + 3 * BT
    finally:
        session.close()
        mesh.stop()
