"""Admission cannot leak: whatever fails after a request took its slots, the slots come back.

Through the real engine over real gRPC (a tiny 2-stage mesh): a request the wire cannot carry
(seed -1, top_k >= 2^31) once took its n slots and raised outside the code that gave them back,
so every later request waited for a 429; here each step after admission is made to fail in turn.
"""

from __future__ import annotations

import asyncio

import pytest
from mesh_helpers import start_mesh
from tiny_models import write_tiny_model

from inferencemesh.frontend.engine.api import GenerationRequest
from inferencemesh.frontend.engine.engine import EngineOptions, PipelineEngine
from inferencemesh.frontend.engine.pipeline import GrpcPipeline

SLOTS = 16
PROMPT = [72, 101, 108, 108, 111, 44, 32, 119, 111, 114, 108, 100]


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return write_tiny_model(tmp_path_factory.mktemp("tiny") / "llama", "llama", num_layers=2)


@pytest.fixture(scope="module")
def mesh(model):
    mesh = start_mesh(model, 2, max_sessions=SLOTS)
    yield mesh
    mesh.stop()


def new_engine(mesh, **options) -> PipelineEngine:
    return PipelineEngine(GrpcPipeline(mesh.addresses),
                          EngineOptions("t", max_context=256, max_sessions=SLOTS, queue_timeout_s=5.0, **options))


async def tokens_of(engine: PipelineEngine, request: GenerationRequest) -> list[int]:
    out: list[int] = []
    async for step in engine.generate(request):
        out.extend(step)
    return out


async def answers_at_once(engine: PipelineEngine) -> None:
    """A normal request right after: answered well within the queue timeout, every slot back."""
    tokens = await asyncio.wait_for(tokens_of(engine, GenerationRequest("normal", PROMPT, 4, temperature=0.0)), 3.0)
    assert len(tokens) == 4
    assert engine.free_slots == SLOTS and engine.running == 0


@pytest.mark.parametrize("fields", [{"seed": -1}, {"top_k": 2**31}, {"seed": 2**64}])
def test_parameters_the_wire_cannot_carry_leak_no_slot(mesh, fields) -> None:
    async def go() -> None:
        engine = new_engine(mesh)
        try:
            request = GenerationRequest("odd", PROMPT, 4, temperature=1.0, **fields)
            try:
                choices = await engine.generate_n(request, SLOTS)
            except Exception as err:  # refused: fine, as long as nothing leaked
                assert getattr(err, "status_code", 500) == 400, repr(err)
            else:
                for choice in choices:
                    async for _ in choice:
                        pass
            await answers_at_once(engine)
        finally:
            await engine.close()

    asyncio.run(go())


class Injected(RuntimeError):
    """The failure a test puts into one step after admission."""


def raising(*_args, **_kwargs):
    raise Injected("injected")


async def async_raising(*_args, **_kwargs):
    raise Injected("injected")


# Each step after admission, as (whose, which, replacement), patched on the instance; a
# session's close is patched on its class (after really closing, so that the stages do not keep it).
STEPS = {
    "open a session": ("pipeline", "open", raising),
    "prefill": ("frames", "prefill", async_raising),
    "share the prompt": ("frames", "share_prompt", async_raising),
    "make a proposer": ("engine", "proposer_for", raising),
    "decode": ("frames", "send_step", async_raising),
}


async def drive(engine: PipelineEngine, n: int) -> BaseException | None:
    """generate_n and every choice to its end; the first failure, if any."""
    failure = None
    try:
        choices = await engine.generate_n(GenerationRequest("r", PROMPT, 6, temperature=1.0, seed=7), n)
    except Exception as err:
        return err
    for choice in choices:
        try:
            async for _ in choice:
                pass
        except Exception as err:
            failure = failure or err
    return failure


@pytest.mark.parametrize("step", list(STEPS))
def test_every_step_after_admission_gives_the_slots_back_when_it_raises(mesh, step) -> None:
    owner, name, replacement = STEPS[step]

    async def go() -> None:
        engine = new_engine(mesh)
        target = engine if owner == "engine" else getattr(engine, owner)
        original = getattr(target, name)
        try:
            setattr(target, name, replacement)
            failure = await drive(engine, 4)
            assert isinstance(failure, Injected), repr(failure)
            assert engine.free_slots == SLOTS
            assert engine.blocks.available == engine.blocks.num_blocks  # and every KV block
            setattr(target, name, original)
            await answers_at_once(engine)
        finally:
            await engine.close()

    asyncio.run(go())


def test_a_session_close_that_raises_gives_the_slot_back(mesh, monkeypatch) -> None:
    from inferencemesh.frontend.engine.session import Connection

    close = Connection.close

    async def close_then_raise(self) -> bool:
        await close(self)
        raise Injected("injected")

    async def go() -> None:
        engine = new_engine(mesh)
        try:
            monkeypatch.setattr(Connection, "close", close_then_raise)
            failure = await drive(engine, 3)
            assert isinstance(failure, Injected), repr(failure)
            assert engine.free_slots == SLOTS
            monkeypatch.undo()
            await answers_at_once(engine)
        finally:
            await engine.close()

    asyncio.run(go())


def test_a_request_cancelled_during_its_prefill_gives_its_slots_back(mesh) -> None:
    async def go() -> None:
        engine = new_engine(mesh)
        entered = asyncio.Event()
        prefill = engine.frames.prefill

        async def slow_prefill(*args, **kwargs):
            entered.set()
            await asyncio.sleep(30)
            return await prefill(*args, **kwargs)

        try:
            engine.frames.prefill = slow_prefill
            task = asyncio.create_task(drive(engine, 5))
            await asyncio.wait_for(entered.wait(), 10)
            assert engine.free_slots == SLOTS - 5
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
            assert engine.free_slots == SLOTS
            del engine.frames.prefill
            await answers_at_once(engine)
        finally:
            await engine.close()

    asyncio.run(go())


@pytest.mark.parametrize("prompts", [1, 2])
def test_a_request_cancelled_as_its_choices_are_handed_over_gives_its_slots_back(mesh, prompts: int) -> None:
    """A cancel in the loop iteration after the engine handed every choice its slot, before its
    caller had them (1 prompt), or after one prompt's choices while another still starts (2):
    the gather's results were dropped with the cancel, and with them the only hold on those
    choices, whose slots never came back."""
    async def go() -> None:
        engine = new_engine(mesh)
        started = engine._started
        request: asyncio.Task | None = None

        async def started_then_cancelled(*args, **kwargs):
            choices = await started(*args, **kwargs)
            assert request is not None
            asyncio.get_running_loop().call_soon(request.cancel)  # the client leaves now
            return choices

        try:
            engine._started = started_then_cancelled
            batch = [GenerationRequest(f"r{i}", PROMPT, 6, temperature=1.0, seed=7) for i in range(prompts)]
            request = asyncio.create_task(engine.generate_batch(batch, 2))
            with pytest.raises(asyncio.CancelledError):
                await request
            assert engine.free_slots == SLOTS
            del engine._started
            await answers_at_once(engine)
        finally:
            await engine.close()

    asyncio.run(go())


def test_over_http_the_server_answers_and_reports_free_slots_after_an_odd_request(mesh, model) -> None:
    """The reported case, end to end: {n: 16, seed: -1} once took the whole server away while /ready
    said 200 and num_requests_running said 0; now those, and the engine's free slots, are the truth."""
    import httpx
    from fixture_engine import serve
    from transformers import AutoTokenizer

    from inferencemesh.frontend.openai.app import create_app

    tokenizer = AutoTokenizer.from_pretrained(model)
    engine = new_engine(mesh)
    with serve(create_app(engine, tokenizer, served_model_name="t")) as base, httpx.Client(base_url=base) as http:
        odd = http.post("/v1/completions", json={"model": "t", "prompt": "def f():", "n": SLOTS, "seed": -1,
                                                 "max_tokens": 4}, timeout=60)
        assert odd.status_code in (200, 400), odd.text
        normal = http.post("/v1/completions", json={"model": "t", "prompt": "hello", "max_tokens": 4}, timeout=3)
        assert normal.status_code == 200, normal.text
        assert http.get("/ready", timeout=5).status_code == 200
        metrics = http.get("/metrics", timeout=5).text
        assert 'inferencemesh_num_requests_running{model_name="t"} 0.0' in metrics
        assert engine.free_slots == SLOTS




def test_over_http_prompt_lists_beyond_the_free_slots_queue_or_are_refused_and_never_block_others(mesh, model) -> None:
    """The reported deadlock, end to end: a prompt list whose sessions (prompts x n) exceed the free
    slots once held every slot for the queue timeout while a normal request waited behind it. Now a
    list larger than the server is refused at once (400 naming the limit); one that fits the server
    but not the free slots waits without holding any, and both lists and a normal request sent
    meanwhile all answer."""
    import concurrent.futures

    import httpx
    from fixture_engine import serve
    from transformers import AutoTokenizer

    from inferencemesh.frontend.openai.app import create_app

    tokenizer = AutoTokenizer.from_pretrained(model)
    engine = new_engine(mesh)
    with serve(create_app(engine, tokenizer, served_model_name="t")) as base, httpx.Client(base_url=base) as http:
        too_big = http.post("/v1/completions", json={"model": "t", "prompt": ["a"] * 64, "n": 2, "max_tokens": 2},
                            timeout=10)
        assert too_big.status_code == 400 and "at most 16" in too_big.json()["error"]["message"], too_big.text
        assert engine.free_slots == SLOTS

        def post(body: dict) -> httpx.Response:
            return http.post("/v1/completions", json={"model": "t", "max_tokens": 8, **body}, timeout=60)

        with concurrent.futures.ThreadPoolExecutor(3) as pool:
            first = pool.submit(post, {"prompt": ["x"] * 9, "n": 1})  # 9 of 16 slots
            second = pool.submit(post, {"prompt": ["y"] * 5, "n": 2})  # 10 more: waits for the first
            normal = http.post("/v1/completions", json={"model": "t", "prompt": "hello", "max_tokens": 2}, timeout=10)
            assert normal.status_code == 200, normal.text
            assert [len(f.result().json()["choices"]) for f in (first, second)] == [9, 10]
        assert engine.free_slots == SLOTS and engine.running == 0


# --- batches that fit or queue ---------------------------------------------------------------


async def drain_all(choices) -> list[list[int]]:
    async def one(choice) -> list[int]:
        out: list[int] = []
        async for step in choice:
            out.extend(step)
        return out

    return list(await asyncio.gather(*(one(c) for c in choices)))


def test_a_batch_larger_than_the_server_is_refused_at_once_and_holds_nothing(mesh) -> None:
    async def go() -> None:
        engine = new_engine(mesh)
        try:
            requests = [GenerationRequest(f"p{i}", PROMPT, 4, temperature=0.0) for i in range(64)]
            started = asyncio.get_running_loop().time()
            with pytest.raises(Exception) as refused:
                await engine.generate_batch(requests, 2)
            assert asyncio.get_running_loop().time() - started < 1.0
            assert refused.value.status_code == 400 and f"at most {SLOTS}" in str(refused.value)
            await answers_at_once(engine)
        finally:
            await engine.close()

    asyncio.run(go())


def test_a_batch_waits_for_all_its_slots_without_holding_any_and_runs_in_order(mesh) -> None:
    async def go() -> None:
        engine = new_engine(mesh)
        try:
            # One request holds a slot until this test reads it (a choice generates as it is read,
            # so no timing decides when it ends); a batch of all the slots then waits, holding none.
            held = await engine.generate_n(GenerationRequest("long", PROMPT, 60, temperature=0.0), 1)
            batch = asyncio.create_task(engine.generate_batch(
                [GenerationRequest(f"p{i}", PROMPT, 4, temperature=0.0) for i in range(SLOTS // 2)], 2))
            await asyncio.sleep(0.2)
            assert not batch.done() and engine.free_slots == SLOTS - 1 and engine.waiting == 1
            # A normal request right after the batch queues behind it (first come, first served)
            # and is answered as soon as the batch's choices end: no deadlock, no queue timeout.
            normal = asyncio.create_task(asyncio.wait_for(
                tokens_of(engine, GenerationRequest("normal", PROMPT, 4, temperature=0.0)), 10.0))
            await asyncio.sleep(0.2)
            assert not batch.done() and not normal.done() and engine.waiting == 2
            assert len((await drain_all(held))[0]) == 60
            outputs = await drain_all(await batch)
            assert len(outputs) == SLOTS and len({tuple(o) for o in outputs}) == 1
            assert len(await normal) == 4
            assert engine.free_slots == SLOTS
        finally:
            await engine.close()

    asyncio.run(go())


# --- the admission rule alone ----------------------------------------------------------------


def test_admission_is_first_come_first_served_and_all_or_nothing() -> None:
    from inferencemesh.frontend.engine.admission import Admission
    from inferencemesh.frontend.engine.errors import EngineOverloaded, InvalidRequest

    async def go() -> None:
        admission = Admission(4, max_waiting=8, timeout_s=0.3)
        order: list[str] = []

        async def hold(name: str, count: int, seconds: float) -> None:
            async with admission.lease(count):
                order.append(name)
                await asyncio.sleep(seconds)

        first = asyncio.create_task(hold("a", 3, 0.1))
        await asyncio.sleep(0)
        big = asyncio.create_task(hold("big", 4, 0))
        await asyncio.sleep(0)
        small = asyncio.create_task(hold("small", 1, 0))  # one slot is free, but it may not barge
        await asyncio.sleep(0.01)
        assert admission.free == 1 and admission.waiting == 2
        await asyncio.gather(first, big, small)
        assert order == ["a", "big", "small"] and admission.free == 4
        with pytest.raises(InvalidRequest):
            async with admission.lease(5):
                pass
        blocker = asyncio.create_task(hold("blocker", 4, 1.0))
        await asyncio.sleep(0)
        with pytest.raises(EngineOverloaded):  # timed out in the queue: it leaves, holding nothing
            async with admission.lease(2):
                pass
        assert admission.waiting == 0 and admission.free == 0
        await blocker
        assert admission.free == 4

    asyncio.run(go())


@pytest.mark.parametrize("order", ["grant, then cancel", "cancel, then grant"])
def test_a_waiter_cancelled_in_the_loop_iteration_it_is_granted_is_cancelled_and_holds_nothing(order: str) -> None:
    """asyncio.wait_for (Python 3.11) admitted it anyway and dropped the cancel."""
    from inferencemesh.frontend.engine.admission import Admission

    async def go() -> None:
        admission = Admission(2, max_waiting=8, timeout_s=30)
        async with admission.lease(2) as lease:  # two choices' slots, handed over as the engine does
            slots = [lease.hand_over(), lease.hand_over()]
        entered = False

        async def wait_for_both() -> None:
            nonlocal entered
            async with admission.lease(2):
                entered = True

        waiter = asyncio.create_task(wait_for_both())
        while not admission.waiting:
            await asyncio.sleep(0)
        # In one loop iteration, with no await between: the choices end (their slots go to the
        # waiter) and the waiter's client goes away.
        if order == "grant, then cancel":
            for slot in slots:
                slot.give_back()
            waiter.cancel()
        else:
            waiter.cancel()
            for slot in slots:
                slot.give_back()
        with pytest.raises(asyncio.CancelledError):
            await waiter
        assert not entered and admission.free == 2 and admission.waiting == 0

    for _ in range(20):  # deterministic: every time, not most times
        asyncio.run(go())
