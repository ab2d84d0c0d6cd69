"""KV events from the frontend's block manager to the router's view of each replica
(frontend/engine/kv_events.py, protocol/kv_events.py, router/kv_view.py): the event log's numbers
and snapshots, eviction and a new stream published, the page's JSON both ways, and the router's
view scoring the digests the frontend itself computed."""

from __future__ import annotations

import asyncio
import json
import time

import httpx
import pytest

from inferencemesh.frontend.engine.kv_blocks import BlockManager, BlockTable
from inferencemesh.frontend.engine.kv_events import KvEventLog
from inferencemesh.protocol.kv_events import CLEARED, REMOVED, STORED, KvEventPage, prompt_digests
from inferencemesh.router.kv_view import BlockScorer, KvViews, PromptTokens, ReplicaBlocks, digests_of

BT = 4
SALT = b"model"


def computed(m: BlockManager, tokens: list[int]) -> BlockTable:
    table = BlockTable()
    m.grow(table, len(tokens))
    m.confirm(table, tokens, len(tokens))
    return table


def page_json(m: BlockManager, after: int | None = None, epoch: str | None = None) -> KvEventPage:
    """A page as the route sends it and the router reads it (through its JSON)."""
    return KvEventPage.from_json(m.event_page(after, epoch, tokenizer="/models/x").to_json())


def test_the_log_numbers_events_and_answers_a_number_it_cannot_with_a_snapshot() -> None:
    log = KvEventLog(capacity=3)
    held = [b"a" * 16]
    first = log.page(None, None, lambda: held, block_tokens=BT, salt=SALT)
    assert first.snapshot and first.blocks == held and first.seq == 0
    log.stored(b"b" * 16, b"a" * 16)
    log.removed(b"a" * 16)
    page = log.page(0, log.epoch, lambda: held, block_tokens=BT, salt=SALT)
    assert not page.snapshot and page.seq == 2
    assert page.events == [(STORED, b"b" * 16, b"a" * 16), (REMOVED, b"a" * 16, b"")]
    assert log.page(1, log.epoch, lambda: held, block_tokens=BT, salt=SALT).events == [(REMOVED, b"a" * 16, b"")]
    assert log.page(2, log.epoch, lambda: held, block_tokens=BT, salt=SALT).events == []
    for after, epoch in ((3, log.epoch), (1, "another"), (-1, log.epoch)):  # ahead, another epoch, before any
        assert log.page(after, epoch, lambda: held, block_tokens=BT, salt=SALT).snapshot, (after, epoch)
    log.cleared()
    log.stored(b"c" * 16, b"")
    assert log.page(0, log.epoch, lambda: held, block_tokens=BT, salt=SALT).snapshot  # event 1 was dropped
    assert [e[0] for e in log.page(1, log.epoch, lambda: held, block_tokens=BT, salt=SALT).events] == [
        REMOVED, CLEARED, STORED]
    assert KvEventLog().epoch != log.epoch  # a restarted frontend is another epoch


def test_the_block_manager_publishes_computed_evicted_and_cleared_blocks() -> None:
    m = BlockManager(4, BT, salt=SALT)
    epoch = m.index.events.epoch
    prompt = list(range(9))  # two full blocks and one position
    table = computed(m, prompt)
    page = page_json(m, 0, epoch)
    digests = prompt_digests(prompt + [0], SALT, BT, 10)  # the frontend's own digests, as the router computes them
    assert page.events == [(STORED, digests[0], b""), (STORED, digests[1], digests[0])]
    assert page.salt == SALT and page.block_tokens == BT and page.tokenizer == "/models/x"
    snapshot = page_json(m)
    assert snapshot.snapshot and sorted(snapshot.blocks) == sorted(digests[:2])
    m.free(table)  # cached, still held: nothing published
    assert page_json(m, page.seq, epoch).events == []
    other = BlockTable()
    m.grow(other, 4 * BT)  # the whole pool: both cached blocks are reclaimed
    assert sorted(page_json(m, page.seq, epoch).events) == sorted((REMOVED, d, b"") for d in digests[:2])
    m.free(other)
    computed(m, prompt)
    seq = m.index.events.seq
    m.forget_all()  # a new stream: every stage's pool is empty
    assert page_json(m, seq, epoch).events == [(CLEARED, b"", b"")]
    assert page_json(m).blocks == []


def test_a_pending_block_is_published_when_its_computation_succeeds_only() -> None:
    async def run() -> None:
        m = BlockManager(8, BT, salt=SALT)
        ok, failed = BlockTable(), BlockTable()
        m.grow(ok, 8)
        m.grow(failed, 8)
        good = m.begin(ok, list(range(8)), 8)
        bad = m.begin(failed, list(range(100, 108)), 8)
        assert page_json(m).blocks == []  # pending: not held yet
        m.settle(bad, computed=False)
        m.settle(good, computed=True)
        page = page_json(m, 0, m.index.events.epoch)
        assert [e[0] for e in page.events] == [STORED, STORED]
        assert page.events[1][2] == page.events[0][1]  # the parent digest is the block before it
    asyncio.run(run())


def test_a_page_that_is_not_one_is_refused() -> None:
    bodies: list[object] = [[], {"epoch": "e"},
                            {"epoch": "e", "seq": 1, "block_tokens": 16, "salt": "zz", "snapshot": True, "blocks": []},
                            {"epoch": "e", "seq": 1, "block_tokens": 16, "salt": "", "snapshot": False,
                             "events": [["moved"]]}]
    for body in bodies:
        with pytest.raises(ValueError, match="not a KV event page"):
            KvEventPage.from_json(body)


def test_the_view_applies_events_and_starts_again_on_a_snapshot_or_a_new_epoch() -> None:
    m = BlockManager(8, BT, salt=SALT)
    view = ReplicaBlocks()
    assert not view.known
    view.apply(page_json(m))
    computed(m, list(range(13)))
    view.apply(page_json(m, view.seq, view.epoch))
    assert len(view.blocks) == 3 and view.seq == m.index.events.seq
    restarted = BlockManager(8, BT, salt=SALT)  # a restarted frontend: another epoch, an empty cache
    computed(restarted, list(range(50, 55)))
    page = restarted.event_page(view.seq, view.epoch)
    assert page.snapshot  # it cannot answer another epoch's number
    view.apply(page)
    assert view.blocks == set(prompt_digests(list(range(50, 56)), SALT, BT, 10))
    view.apply(KvEventPage(view.epoch, view.seq + 1, BT, SALT, events=[(CLEARED, b"", b"")]))
    assert view.blocks == set()


def test_views_score_the_longest_run_of_leading_blocks_each_replica_holds() -> None:
    views = KvViews()
    managers = {"a": BlockManager(16, BT, salt=SALT), "b": BlockManager(16, BT, salt=SALT)}
    prompt = list(range(20))
    computed(managers["a"], prompt[:13])  # three leading blocks
    computed(managers["b"], prompt[:5] + [99] * 8)  # the first block only, then another conversation
    for name, m in managers.items():
        views.views[name] = ReplicaBlocks()
        views.views[name].apply(page_json(m))
    assert views.params() == [(SALT, BT)] and views.tokenizer() == "/models/x" and views.holding()
    assert views.match(digests_of(prompt, views.params())) == {"a": 3, "b": 1}
    assert views.match(digests_of(prompt[:9], views.params())) == {"a": 2, "b": 1}  # its last token is computed
    assert views.match(digests_of([7] * 20, views.params())) == {}
    other_model = digests_of(prompt, [(b"another model", BT)])
    assert views.match(other_model) == {}  # another salt: another model's blocks never match
    views.forget("a")
    assert views.held("a") == 0 and views.match(digests_of(prompt, views.params())) == {"b": 1}


def test_blocks_sent_to_a_replica_count_as_held_until_its_events_say_so_or_for_a_while() -> None:
    views, m = KvViews(), BlockManager(16, BT, salt=SALT)
    views.views["a"] = view = ReplicaBlocks()
    view.apply(page_json(m))
    prompt = list(range(13))
    digests = digests_of(prompt, views.params())
    assert views.match(digests) == {}
    views.expect("a", digests)  # the router sent it there: its events will say so within a poll
    assert views.match(digests) == {"a": 3} and views.holding()
    computed(m, prompt)
    view.apply(page_json(m, view.seq, view.epoch))
    assert view.expected == {} and views.match(digests) == {"a": 3}  # now held by its events
    other = digests_of(list(range(50, 60)), views.params())
    views.expect("a", other)
    for digest in view.expected:  # long past: a request that failed never computed them
        view.expected[digest] = time.monotonic() - 1
    assert views.match(other) == {}
    view.apply(page_json(m, view.seq, view.epoch))
    assert view.expected == {}


def test_the_scorer_loads_the_tokenizer_the_replicas_name_once_and_falls_back_where_it_cannot() -> None:
    async def run() -> None:
        views = KvViews()
        views.views["a"] = ReplicaBlocks()
        views.views["a"].apply(page_json(BlockManager(8, BT, salt=SALT)))  # names /models/x
        asked: list[str] = []

        def unreadable(source: str) -> PromptTokens:
            asked.append(source)
            raise OSError(f"{source}: no such directory")

        scorer = BlockScorer(views, unreadable)
        scorer.check()
        assert scorer.loading is not None
        await scorer.loading
        scorer.check()  # the same source: not tried again
        assert asked == ["/models/x"] and scorer.scorer == "characters"
        assert await scorer.digests("/v1/completions", b"{}") is None
        scorer = BlockScorer(views, lambda source: lambda path, body: list(range(13)))
        scorer.check()
        assert scorer.loading is not None
        await scorer.loading
        assert scorer.scorer == "blocks"
        assert await scorer.digests("/v1/completions", b"{}") == digests_of(list(range(13)), [(SALT, BT)])
    asyncio.run(run())


def test_the_router_fetches_the_tokenizer_from_a_replica_and_computes_its_digests(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A router that cannot read the source the replicas name (a pod's model folder) fetches the
    tokenizer's files from one over HTTP (GET /kv/tokenizer, with the frontends' API key; again
    later when no replica could answer) and tokenizes completions and chats as that frontend does:
    the same digests."""
    from fixture_engine import build_fixture_model, serve

    from inferencemesh.config import API_KEY_ENV, RouterConfig
    from inferencemesh.frontend.openai.app import create_app
    from inferencemesh.frontend.openai.prompt_ids import prompt_ids
    from inferencemesh.programs.router import prompt_tokenizer
    from inferencemesh.router.app import RouterApp

    fm = build_fixture_model()
    source = str(fm.tokenizer.name_or_path)
    bodies = {"/v1/completions": {"model": fm.name, "prompt": "def fibonacci(n):\n    " * 12},
              "/v1/chat/completions": {"model": fm.name, "messages": [
                  {"role": "system", "content": "You write Python. " * 10}, {"role": "user", "content": "Sort it."}]}}

    async def run(url: str) -> None:
        monkeypatch.setenv(API_KEY_ENV, "fetch-key")
        router = RouterApp(RouterConfig(frontends=(f"a={url}",), load_poll_interval=60).check(),
                           prompt_tokenizer=prompt_tokenizer)
        router.blocks.local = lambda where: False  # the replicas' folder is not readable here
        await router.startup()
        try:
            router.kv.views["a"] = view = ReplicaBlocks()
            view.apply(KvEventPage.from_json(BlockManager(8, BT, salt=SALT).event_page(
                None, None, tokenizer=source).to_json()))
            replica = router.replicas.get("a")
            assert replica is not None
            replica.mark_down("not ready yet")  # no replica to fetch from: characters, for now
            router.blocks.check()
            assert router.blocks.loading is not None
            await router.blocks.loading
            assert router.blocks.scorer == "characters" and router.blocks.retry_at > 0
            replica.mark_up()
            router.blocks.retry_at = time.monotonic() - 1  # FETCH_RETRY_S later
            router.blocks.check()
            await router.blocks.loading
            assert router.blocks.scorer == "blocks"
            [folder] = router.tokenizer_folders.folders
            assert sorted(p.name for p in folder.iterdir()) == ["chat_template.jinja", "tokenizer.json",
                                                               "tokenizer_config.json"]  # no weights, no config
            for path, body in bodies.items():
                raw = json.dumps(body).encode()
                ids = prompt_ids(fm.tokenizer, path, raw)  # the frontend's own, from its own folder
                assert ids is not None and len(ids) > 4 * BT
                assert await router.blocks.digests(path, raw) == digests_of(ids, [(SALT, BT)]), path
        finally:
            await router.shutdown()
        assert not folder.exists()  # removed when the router stops

    with serve(create_app(fm.engine, fm.tokenizer, served_model_name=fm.name, api_key="fetch-key")) as url:
        for path in ("/kv/events", "/kv/tokenizer", "/kv/tokenizer/tokenizer.json"):
            assert httpx.get(url + path).status_code == 401, path  # authenticated, as the API is
        assert httpx.get(url + "/kv/tokenizer/config.json", headers={"Authorization": "Bearer fetch-key"}
                         ).status_code == 404  # only the tokenizer's files
        asyncio.run(run(url))


@pytest.mark.parametrize("prompt", [[10**23, 1, 2], [-5, 1], [1, 10**6]], ids=["huge", "negative", "beyond-vocab"])
def test_token_ids_the_frontend_refuses_are_not_scored(prompt) -> None:
    """A completion's token ids out of the vocabulary get no digests (the frontend answers them
    400; a 10**23 id would overflow the hash's 64-bit packing): the router routes by characters."""
    from transformers import AutoTokenizer

    from inferencemesh.bundled import DEFAULT_MODEL, bundled_path
    from inferencemesh.frontend.openai.prompt_ids import prompt_ids

    tokenizer = AutoTokenizer.from_pretrained(bundled_path(DEFAULT_MODEL))
    body = json.dumps({"model": "m", "prompt": prompt}).encode()
    assert prompt_ids(tokenizer, "/v1/completions", body) is None
    assert prompt_ids(tokenizer, "/v1/completions", json.dumps({"model": "m", "prompt": [1, 2]}).encode()) == [1, 2]
