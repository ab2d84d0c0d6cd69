"""The prefix cache: a finished request's session stays at every stage (RELEASE with retain), and
a later prompt that starts with its tokens FORKs it and computes only the rest. The answers are
the same with the cache on and off; the stages' token counters prove the reuse; the index may be
wrong (evicted entries, a restarted stage) at the cost of a full prefill, never of an answer."""

from __future__ import annotations

import asyncio
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
from inferencemesh.frontend.engine.prefix_cache import PrefixEntries, common_prefix
from inferencemesh.stage.sessions import SessionsFull, SessionTable

SESSIONS = 4  # per stage, live and kept together: eviction is exercised
SYSTEM = [(17 * i + 5) % 250 + 3 for i in range(40)]  # a shared "system prompt"


# ---- the index and the stage's table, alone ------------------------------------------------------


def test_the_index_finds_the_longest_shared_prefix_and_leaves_one_token_to_compute() -> None:
    index = PrefixEntries(capacity=100, min_reuse=4)
    index.add("a", SYSTEM[:20])
    index.add("b", SYSTEM[:30] + [1, 2, 3])
    match = index.match(SYSTEM[:30] + [1, 2, 9])
    assert match is not None and (match.session_id, match.tokens) == ("b", 32)
    assert index.match(SYSTEM[:30] + [1, 2, 3]).tokens == 32  # the whole prompt held: its last is computed
    assert index.match(SYSTEM[:3] + [0] * 10) is None  # below min_reuse
    assert common_prefix(SYSTEM * 3, SYSTEM * 2 + [0]) == 2 * len(SYSTEM)


def test_a_later_turn_replaces_its_earlier_one_and_capacity_drops_the_least_recently_used() -> None:
    index = PrefixEntries(capacity=50, min_reuse=4)  # token positions: turn-2 (30) and one of 20
    index.add("turn-1", SYSTEM[:20])
    index.add("turn-2", SYSTEM[:30])  # turn 1's tokens are a prefix of turn 2's
    assert len(index) == 1 and index.match(SYSTEM[:25] + [0]).session_id == "turn-2"
    index.add("other", [7] * 20)
    index.match(SYSTEM[:10])  # turn-2 used: "other" is now the least recent
    index.add("third", [9] * 20)
    assert index.match([7] * 21) is None and index.match(SYSTEM[:25] + [0]).session_id == "turn-2"
    index.drop("turn-2")
    assert index.match(SYSTEM[:25] + [0]) is None


class HeldKV:
    """A session's KV as the table sees it: what it holds room for."""

    def __init__(self, capacity: int) -> None:
        self.capacity = self.length = capacity

    def release(self) -> None:
        pass

    def nbytes(self) -> int:
        return self.capacity


def keep(table: SessionTable, session_id: str, positions: int) -> None:
    session = table.open(session_id)
    session.kv = HeldKV(positions)
    time.sleep(0.002)  # distinct last_used
    table.retain(session)


def test_entries_use_free_slots_and_make_room_for_live_sessions_least_recently_used_first() -> None:
    evicted = []
    table = SessionTable(max_sessions=2, ttl_seconds=60, max_context=100, on_evict=lambda: evicted.append(1))
    keep(table, "old", 100)
    keep(table, "new", 100)
    assert table.totals()[:2] == (0, 2) and table.cache_room() == 200
    table.open("live-1")  # one free slot left: the least recently used entry goes
    assert table.get("old") is None and table.get("new") is not None and len(evicted) == 1
    table.open("live-2")  # no free slot: no room for entries
    assert table.get("new") is None and len(evicted) == 2
    with pytest.raises(SessionsFull):  # live sessions are never dropped, and entries do not count as sessions
        table.open("live-3")
    assert table.totals()[:2] == (2, 0)
    finished = table.get("live-2")
    finished.kv = HeldKV(100)
    table.retain(finished)  # the slot it frees holds it
    assert table.get("live-2") is not None
    assert table.totals()[:2] == (1, 1)


def test_the_prefix_cache_tokens_keep_entries_while_every_slot_is_busy() -> None:
    table = SessionTable(max_sessions=2, ttl_seconds=60, max_context=100, cache_tokens=150)
    for session_id, positions in (("a", 100), ("b", 40), ("c", 60)):
        keep(table, session_id, positions)
    table.open("live-1")
    table.open("live-2")  # room: 150 positions; a (least recently used) goes, b + c = 100 stay
    assert table.get("a") is None and table.get("b") and table.get("c")
    assert table.cache_room() == 150
    assert table.totals()[:2] == (2, 2)


def test_an_entry_being_forked_is_kept_for_the_copy_then_fitted() -> None:
    table = SessionTable(max_sessions=1, ttl_seconds=60, max_context=100)
    keep(table, "parent", 100)
    child = table.open("child", keep=table.get("parent"))  # no room left, but the copy needs the parent
    assert table.get("parent") is not None and child.session_id == "child"
    table.fit_cache()  # after the copy
    assert table.get("parent") is None


# ---- the engine over a real 2-stage mesh ------------------------------------------------------------


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> Path:
    return write_tiny_model(tmp_path_factory.mktemp("prefix") / "m", "llama", num_layers=4, shards=1)


@pytest.fixture(scope="module")
def mesh(model: Path):
    mesh = start_mesh(model, 2, max_context=256, max_sessions=SESSIONS)
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

    def __init__(self, mesh, prefix_cache: bool = True, pipeline=None, max_sessions: int = SESSIONS,
                 prefix_cache_tokens: int = 0) -> None:
        self.loop = asyncio.new_event_loop()
        self.metrics = FrontendMetrics("t")
        self.engine = PipelineEngine(pipeline or GrpcPipeline(mesh.addresses),
                                     EngineOptions("t", max_context=256, max_sessions=max_sessions,
                                                   prefix_cache=prefix_cache, prefix_cache_tokens=prefix_cache_tokens),
                                     metrics=self.metrics)

    def run(self, prompt: list[int], new_tokens: int, n: int = 1, **sampling) -> list[list[int]]:
        return [tokens for tokens, _ in self.steps(prompt, new_tokens, n, **sampling)]

    def steps(self, prompt: list[int], new_tokens: int, n: int = 1, **sampling) -> list[tuple[list[int], list]]:
        """Per choice: its tokens, and their logprobs when the request asks for them."""
        async def go() -> list[tuple[list[int], list]]:
            request = GenerationRequest(f"r-{time.monotonic_ns()}", prompt, new_tokens, **sampling)

            async def drain(choice) -> tuple[list[int], list]:
                tokens: list[int] = []
                logprobs: list = []
                try:
                    async for step in choice:
                        tokens.extend(step)
                        logprobs.extend(step.logprobs or [])
                finally:
                    await choice.aclose()
                return tokens, logprobs

            return list(await asyncio.gather(*(drain(c) for c in await self.engine.generate_n(request, n))))

        return self.loop.run_until_complete(go())

    def counted(self, name: str) -> float:
        value = self.metrics.registry.get_sample_value(f"inferencemesh_prefix_cache_{name}_total", {"model_name": "t"})
        return value or 0.0

    def close(self) -> None:
        self.loop.run_until_complete(self.engine.close())
        self.loop.close()


@pytest.fixture
def cached(mesh):
    session = Session(mesh)
    yield session
    session.close()


@pytest.fixture
def uncached(mesh):
    session = Session(mesh, prefix_cache=False)
    yield session
    session.close()


def test_an_identical_request_reuses_all_but_one_token_and_answers_the_same(mesh, model, cached) -> None:
    prompt = SYSTEM + [11, 12, 13]
    first = cached.run(prompt, 8, temperature=0.0)
    before = stage_tokens(mesh)
    second = cached.run(prompt, 8, temperature=0.0)
    computed = [a - b for a, b in zip(stage_tokens(mesh), before, strict=True)]
    assert first == second == [hf_greedy(model, prompt, 8)]
    assert cached.counted("hits") == len(prompt) - 1 and cached.counted("queries") == 2 * len(prompt)
    assert computed == [1 + 7, 1 + 7]  # the prompt's last token, then 7 decode steps: at every stage


def test_a_multi_turn_conversation_computes_only_each_new_turn(mesh, model, cached, uncached) -> None:
    turns = [[21, 22, 23, 24], [31, 32], [41, 42, 43]]
    conversation, answers_on, answers_off, computed = list(SYSTEM), [], [], []
    for turn in turns:
        conversation += turn
        before = stage_tokens(mesh)[0]
        [on] = cached.run(conversation, 6, temperature=0.0)
        computed.append(stage_tokens(mesh)[0] - before)
        [off] = uncached.run(conversation, 6, temperature=0.0)
        answers_on.append(on)
        answers_off.append(off)
        conversation += on
    assert answers_on == answers_off
    # turn 2 onwards: the turn's own tokens, and the last answer token no frame had fed, then 5 decodes
    assert computed[1:] == [len(turns[1]) + 1 + 5, len(turns[2]) + 1 + 5]


def test_seeded_sampling_penalties_and_n_choices_are_the_same_with_the_cache(cached, uncached) -> None:
    prompt = SYSTEM + [5, 6, 7]
    sampling = {"temperature": 0.9, "top_p": 0.9, "seed": 1234, "repetition_penalty": 1.3, "frequency_penalty": 0.5}
    off = uncached.run(prompt, 10, n=3, **sampling)
    cached.run(prompt, 10, **sampling)  # an entry holding the prompt
    on = cached.run(prompt, 10, n=3, **sampling)
    assert cached.counted("hits") >= len(prompt) - 1
    assert on == off


def test_logprobs_are_the_same_with_the_cache(cached, uncached) -> None:
    """The forked KV is the KV a full prefill computes: each token's logprob and its alternatives
    agree (within float32 summation order: a prefill chunk and a decode step group their sums
    differently), and the tokens are the same."""
    prompt = SYSTEM + [8, 9, 10]
    [(off_tokens, off)] = uncached.steps(prompt, 8, temperature=0.0, logprobs=3)
    cached.run(prompt + [1], 4, temperature=0.0)  # an entry holding the prompt
    [(on_tokens, on)] = cached.steps(prompt, 8, temperature=0.0, logprobs=3)
    assert cached.counted("hits") >= len(prompt) - 1
    assert on_tokens == off_tokens and len(on) == len(off) == 8
    for a, b in zip(on, off, strict=True):
        assert a.token == b.token and [t for t, _ in a.top] == [t for t, _ in b.top]
        assert a.logprob == pytest.approx(b.logprob, abs=1e-4)
        assert [lp for _, lp in a.top] == pytest.approx([lp for _, lp in b.top], abs=1e-4)


def test_eviction_under_a_small_budget_keeps_every_answer_exact(model, cached) -> None:
    """More conversations than the stages have session slots: entries are evicted (least recently
    used), stale index entries cost a full prefill, nothing is refused."""
    prompts = [[100 + k] * 3 + SYSTEM[k:] for k in range(2 * SESSIONS)]
    want = [hf_greedy(model, p, 5) for p in prompts]
    for _ in range(2):
        assert [cached.run(p, 5, temperature=0.0)[0] for p in prompts] == want


@pytest.mark.parametrize("room", [0, 512])
def test_the_prefix_caches_own_room_keeps_entries_while_every_slot_is_busy(model, room: int) -> None:
    """Two session slots per stage. An entry lives in a free slot; two live sessions at once (n=2)
    take both, so without room of its own (--prefix-cache-tokens) the entry is evicted, and with
    it the entry stays and the next turn computes only what is new. Exact either way."""
    mesh = start_mesh(model, 2, max_context=256, max_sessions=2, prefix_cache_tokens=room)
    session = Session(mesh, max_sessions=2, prefix_cache_tokens=room)
    try:
        prompt = SYSTEM + [61, 62]
        assert session.run(prompt, 6, temperature=0.0) == [hf_greedy(model, prompt, 6)]
        other = [7, 8, 9] + SYSTEM[::-1]
        assert session.run(other, 4, n=2, temperature=0.0) == [hf_greedy(model, other, 4)] * 2
        before = stage_tokens(mesh)
        assert session.run(prompt, 6, temperature=0.0) == [hf_greedy(model, prompt, 6)]
        computed = [a - b for a, b in zip(stage_tokens(mesh), before, strict=True)]
        assert computed == ([1 + 5] * 2 if room else [len(prompt) + 5] * 2)
        text = urllib.request.urlopen(f"http://127.0.0.1:{mesh.metrics_ports[0]}/metrics", timeout=5).read().decode()
        evictions = float(re.search(r"^inferencemesh_stage_prefix_cache_evictions_total\{.*\} (\S+)$", text, re.M)[1])
        assert (evictions > 0) is (room == 0)
    finally:
        session.close()
        mesh.stop()


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
        hits = session.counted("hits")
        assert session.run(turn, 6, temperature=0.0) == [hf_greedy(model, turn, 6)]
        assert session.counted("hits") == hits  # the entry went with the stage: computed in full
        assert session.run(turn, 6, temperature=0.0) == [hf_greedy(model, turn, 6)]
        assert session.counted("hits") == hits + len(turn) - 1  # and kept again
    finally:
        session.close()


def test_four_stages_with_the_first_embedded_serve_a_conversation_exactly(model) -> None:
    """Stage 0 in the frontend's process (a LocalStage), three stage processes after it."""
    mesh = start_mesh(model, 4, max_context=256, max_sessions=SESSIONS, embed_first=True)
    session = Session(mesh, pipeline=embedded_pipeline(model, mesh, max_context=256, max_sessions=SESSIONS))
    try:
        conversation = SYSTEM + [81, 82]
        for turn in ([91, 92, 93], [101, 102]):
            [answer] = session.run(conversation, 5, temperature=0.0)
            assert answer == hf_greedy(model, conversation, 5)
            conversation += answer + turn
        assert session.run(conversation, 5, temperature=0.0) == [hf_greedy(model, conversation, 5)]
        assert session.counted("hits") > 2 * len(SYSTEM)  # turns 2 and 3 forked the conversation so far
    finally:
        session.close()
        mesh.stop()
