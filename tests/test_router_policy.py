"""The router's policy as pure functions (inferencemesh.router.policy): routing keys, chained block
hashes, the prefix affinity index's TTL and LRU bound, and the order `choose` gives."""

from __future__ import annotations

import json

import pytest

from inferencemesh.config import RouterConfig
from inferencemesh.flags import ConfigError, from_args, to_argv
from inferencemesh.programs.cli import build_parser
from inferencemesh.router.policy import (
    PrefixAffinity,
    block_hashes,
    choose,
    key_seed,
    retryable,
    routing_key,
)
from inferencemesh.router.replicas import endpoints_of, parse_frontends, replica_name, waiting_of

BALANCE = {"balance_abs": 8.0, "balance_rel": 1.5}


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def index(ttl: float = 60.0, max_entries: int = 1000) -> tuple[PrefixAffinity, Clock]:
    clock = Clock()
    return PrefixAffinity(ttl=ttl, max_entries=max_entries, clock=clock), clock


# ---- routing keys ---------------------------------------------------------------------------


def test_chat_key_is_canonical_and_a_next_turn_extends_it() -> None:
    one = {"messages": [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}],
           "temperature": 0.3}
    reordered = json.dumps({"temperature": 0.9, "messages": [{"content": "be brief", "role": "system"},
                                                              {"content": "hi", "role": "user", "name": None}]})
    key = routing_key("/v1/chat/completions", json.dumps(one).encode())
    assert key is not None and "be brief" in key and "temperature" not in key
    assert routing_key("/v1/chat/completions", reordered.encode()) == key  # sampling and key order do not count
    longer = {"messages": [*one["messages"], {"role": "assistant", "content": "hello"},
                           {"role": "user", "content": "more"}]}
    assert routing_key("/v1/chat/completions", json.dumps(longer).encode()).startswith(key)
    tools = {**one, "tools": [{"type": "function", "function": {"name": "f"}}]}
    with_tools = routing_key("/v1/chat/completions", json.dumps(tools).encode())
    assert with_tools != key and '"name":"f"' in with_tools


def test_completion_and_responses_keys() -> None:
    assert routing_key("/v1/completions", b'{"prompt": "def f():", "max_tokens": 3}') == "def f():"
    assert routing_key("/v1/completions", b'{"prompt": [1, 2, 3]}') == "[1,2,3]"
    responses = routing_key("/v1/responses", b'{"instructions": "be terse", "input": "hello"}')
    assert responses == "be terse\nhello"
    items = routing_key("/v1/responses", json.dumps({"input": [{"role": "user", "content": "x"}]}).encode())
    assert items is not None and '"content":"x"' in items
    assert routing_key("/v1/models", b"") is None
    assert routing_key("/v1/completions", b"not json") is None
    assert routing_key("/v1/chat/completions", b"[1, 2]") is None


def test_block_hashes_are_chained() -> None:
    a = block_hashes("x" * 10 + "y" * 10 + "z" * 5, 10)
    b = block_hashes("x" * 10 + "y" * 10 + "w" * 5, 10)
    assert len(a) == 3 and a[:2] == b[:2] and a[2] != b[2]
    # block 1 is the same text after a different block 0: a different hash (it covers blocks 0..1)
    c = block_hashes("q" * 10 + "y" * 10, 10)
    assert c[1] != a[1]
    assert block_hashes("", 10) == [] and block_hashes(None, 10) == []


# ---- the prefix affinity index (PrefixAffinity) ------------------------------------------------


def test_longest_prefix_per_replica() -> None:
    idx, _ = index()
    shared = block_hashes("s" * 40 + "a" * 40, 10)
    assert idx.match(shared) == {}
    idx.record(shared[:4], "r1")  # r1 saw the 4-block prefix
    idx.record(shared, "r2")  # r2 saw all 8
    assert idx.match(shared) == {"r1": 4, "r2": 8}  # both hold the shared 4: each its own longest prefix
    other = block_hashes("s" * 40 + "b" * 40, 10)
    idx.record(other, "r3")
    assert idx.match(other) == {"r1": 4, "r2": 4, "r3": 8}
    assert idx.match(block_hashes("t" * 80, 10)) == {}


def test_a_holder_expires_alone() -> None:
    idx, clock = index(ttl=60.0)
    blocks = block_hashes("p" * 100, 10)
    idx.record(blocks, "r1")
    clock.now += 30
    idx.record(blocks[:5], "r2")
    clock.now += 31  # r1's hold expired, r2's not
    assert idx.match(blocks) == {"r2": 5}


def test_entries_expire_after_the_ttl() -> None:
    idx, clock = index(ttl=60.0)
    blocks = block_hashes("p" * 100, 10)
    idx.record(blocks, "r1")
    clock.now += 59
    assert idx.match(blocks) == {"r1": 10}
    clock.now += 2
    assert idx.match(blocks) == {} and len(idx) == 0


def test_the_index_is_bounded_least_recently_used_first() -> None:
    idx, clock = index(max_entries=6)
    old, new = block_hashes("o" * 30, 10), block_hashes("n" * 30, 10)
    idx.record(old, "r1")
    clock.now += 1
    idx.record(new, "r2")
    clock.now += 1
    idx.record(old, "r1")  # used again: now the newest
    idx.record(block_hashes("m" * 30, 10), "r3")  # 9 entries > 6: the least recently used (new's) go
    assert len(idx) == 6 and idx.match(new) == {} and idx.match(old) == {"r1": 3}


def test_forget_drops_a_replica() -> None:
    idx, _ = index()
    idx.record(block_hashes("a" * 30, 10), "r1")
    idx.record(block_hashes("b" * 30, 10), "r2")
    idx.forget("r1")
    assert idx.match(block_hashes("a" * 30, 10)) == {} and idx.match(block_hashes("b" * 30, 10)) == {"r2": 3}


# ---- choose ---------------------------------------------------------------------------------


def test_the_longest_match_wins_then_the_rest_by_load() -> None:
    loads = {"a": 2.0, "b": 0.0, "c": 1.0}
    choice = choose(loads, {"a": 5, "c": 2}, seed=1, **BALANCE)
    assert choice.order == ["a", "b", "c"] and choice.matched_blocks == 5
    choice = choose(loads, {"a": 2, "c": 5}, seed=1, **BALANCE)
    assert choice.order == ["c", "b", "a"] and choice.matched_blocks == 5


def test_a_far_busier_replica_is_skipped_a_slightly_busier_one_is_not() -> None:
    # far busier: load > min + 8 and load > min * 1.5
    assert choose({"a": 9.0, "b": 0.0}, {"a": 3}, seed=1, **BALANCE).order == ["b", "a"]
    assert choose({"a": 8.0, "b": 0.0}, {"a": 3}, seed=1, **BALANCE).order == ["a", "b"]  # not > 0 + 8
    assert choose({"a": 29.0, "b": 20.0}, {"a": 3}, seed=1, **BALANCE).order == ["a", "b"]  # not > 20 * 1.5
    assert choose({"a": 31.0, "b": 20.0}, {"a": 3}, seed=1, **BALANCE).order == ["b", "a"]
    # the far busier one's match is passed over for the next longest among the rest
    choice = choose({"a": 20.0, "b": 0.0, "c": 1.0}, {"a": 9, "c": 4}, seed=1, **BALANCE)
    assert choice.order == ["c", "b", "a"] and choice.matched_blocks == 4


def test_without_a_match_the_least_loaded_and_ties_by_the_key() -> None:
    assert choose({"a": 3.0, "b": 1.0, "c": 2.0}, {}, seed=7, **BALANCE).order == ["b", "c", "a"]
    equal = {"a": 0.0, "b": 0.0, "c": 0.0}
    firsts = {choose(equal, {}, seed=key_seed(f"prompt {i}"), **BALANCE).order[0] for i in range(30)}
    assert firsts == {"a", "b", "c"}  # different prompts spread
    same = {tuple(choose(dict(reversed(equal.items())), {}, seed=key_seed("same"), **BALANCE).order)
            for _ in range(5)} | {tuple(choose(equal, {}, seed=key_seed("same"), **BALANCE).order)}
    assert len(same) == 1  # the same prompt, the same order, whatever the dict's order
    # equal matches: the lower load, then the key
    assert choose({"a": 1.0, "b": 0.0}, {"a": 3, "b": 3}, seed=1, **BALANCE).order == ["b", "a"]
    assert choose({}, {"a": 1}, seed=1, **BALANCE).order == []


def test_retry_order_covers_every_replica_once() -> None:
    choice = choose({f"r{i}": float(i % 3) for i in range(7)}, {"r5": 2}, seed=3, **BALANCE)
    assert sorted(choice.order) == [f"r{i}" for i in range(7)] and choice.order[0] == "r5"
    loads = [i % 3 for i in (int(name[1:]) for name in choice.order[1:])]
    assert loads == sorted(loads)


def test_retryable_statuses() -> None:
    assert all(retryable(s) for s in (429, 502, 503))
    assert not any(retryable(s) for s in (200, 400, 401, 404, 413, 500, 504))


# ---- replicas and config --------------------------------------------------------------------------


def test_frontends_parse_and_pod_names() -> None:
    assert parse_frontends(["http://127.0.0.1:8001/", "p1=http://10.0.0.5:8000"]) == {
        "127.0.0.1:8001": "http://127.0.0.1:8001", "p1": "http://10.0.0.5:8000"}
    with pytest.raises(ConfigError, match="--frontends"):
        parse_frontends(["10.0.0.5:8000"])
    pod = {"targetRef": {"kind": "Pod", "name": "mesh-p1-frontend-7d9f8c6b5-x2x9z"}}
    assert replica_name(pod, "10.0.0.5") == "mesh-p1-frontend"
    assert replica_name({"targetRef": {"kind": "Pod", "name": "plain"}}, "10.0.0.5") == "plain"
    assert replica_name({}, "10.0.0.5") == "10.0.0.5"
    slices = [{"ports": [{"name": "http", "port": 8080}], "endpoints": [
        {"addresses": ["10.0.0.5"], "conditions": {"ready": True}, "targetRef": pod["targetRef"]},
        {"addresses": ["10.0.0.6"], "conditions": {"ready": False}},
        {"addresses": ["10.0.0.7"]}]}, {"ports": None, "endpoints": [{"addresses": ["fd00::1"]}]}]
    assert endpoints_of(slices, 8000) == {"mesh-p1-frontend": "http://10.0.0.5:8080", "10.0.0.7": "http://10.0.0.7:8080",
                                          "fd00::1": "http://[fd00::1]:8000"}


def test_waiting_is_read_from_a_metrics_page() -> None:
    page = ("# TYPE inferencemesh_num_requests_waiting gauge\n"
            'inferencemesh_num_requests_waiting{model_name="m"} 4.0\n')
    assert waiting_of(page) == 4.0
    with pytest.raises(ValueError):
        waiting_of("# TYPE other gauge\nother 1\n")


def test_router_config_needs_one_source_and_renders_its_flags() -> None:
    with pytest.raises(ConfigError, match="--frontends .*--frontends-service"):
        RouterConfig().check()
    with pytest.raises(ConfigError, match="not both"):
        RouterConfig(frontends=("http://a:1",), frontends_service="svc").check()
    config = RouterConfig(frontends_service="mesh-frontends", namespace="ns", block_chars=64, balance_rel=2.0)
    argv = to_argv(config)
    assert "--frontends-service" in argv and "--block-chars" in argv
    args = build_parser().parse_args(["router", *argv])
    assert from_args(RouterConfig, args) == config
