"""Grammar bombs against `inferencemesh serve` (issue 33, findings 1, 3 and 6), one serve for the
module. Every case ends with assert_unharmed; the ones that make the grammar engine work hard
also measure an innocent request sent while they run against its idle latency (at most 2x).

- Grammars that overflowed llguidance's compiler stack (SIGSEGV: the frontend, then the mesh)
  are refused with a 400 naming guided_grammar, by the shape limits; one the limits let through
  crashes only the grammar worker's process.
- A schema that compiles super-linearly (patternProperties) is refused at the compile budget
  without stalling anyone; one within the budget is built once, off the event loop, and shared
  by every choice of every request.
- An ambiguous grammar whose masks grow with every token ends its own request with a clear
  error, at the per-step limit.
- Constraints that used to pass validation and fail at the first token (counted repetition) or
  in a recursive check (deep schemas) are a 400 naming their parameter.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any, TypeVar

import httpx
import pytest
from hostile import INNOCENT_DEADLINE_S, MODEL, assert_unharmed, idle_latency, innocent_request
from mesh_helpers import serving

pytestmark = pytest.mark.slow

MAX_SESSIONS = 4  # mesh_helpers.serving's
SPACES_31 = 3895  # the bundled tokenizer's token of 31 spaces
R = TypeVar("R")


@pytest.fixture(scope="module")
def served() -> Iterator[tuple[str, Any]]:
    with serving() as (base, proc, lines):
        yield base, proc
        assert proc.poll() is None, "".join(lines[-40:])


def completion(base: str, timeout: float = 120, **fields: Any) -> httpx.Response:
    body = {"model": MODEL, "prompt": "data = ", "max_tokens": 8, "temperature": 0, **fields}
    return httpx.post(f"{base}/v1/completions", json=body, timeout=timeout)


def assert_refused(response: httpx.Response, param: str) -> str:
    """A 400 in OpenAI's error format naming param; its message."""
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == param and error["type"] == "invalid_request_error", error
    return str(error["message"])


def while_attacked(base: str, attack: Callable[[], R]) -> tuple[R, list[float], float]:
    """Run attack on a thread; meanwhile send innocent requests one after another (at least one).
    Returns the attack's response, the innocent requests' latencies, and the innocent request's
    idle latency, measured just before and just after: the larger (CI's load drifts as other
    jobs share its cores)."""
    before = idle_latency(base)
    answer: list[R] = []
    thread = threading.Thread(target=lambda: answer.append(attack()))
    thread.start()
    time.sleep(0.05)  # the attack is in the server before the first innocent request
    latencies = [innocent_request(base)]
    while thread.is_alive():
        latencies.append(innocent_request(base))
    thread.join()
    return answer[0], latencies, max(before, idle_latency(base))


def median(values: list[float]) -> float:
    return sorted(values)[len(values) // 2]


def assert_undisturbed(latencies: list[float], idle: float, plain: list[float] | None = None) -> None:
    """The innocent requests sent during an attack: the typical one within 2x the idle latency,
    none past the unharmed deadline (the slowest of several is the machine's noise as much as
    the attack's: CI shares two cores among every process of the mesh).

    plain: the innocent's latencies beside the same requests without their constraint, for an
    attack that also generates tokens: sharing the pipeline alone costs an innocent request about
    2x its idle latency on two shared cores, so the grammar's own harm is measured against that."""
    reference = max(idle, median(plain)) if plain else idle
    assert median(latencies) <= 2 * reference, (
        f"innocent latencies {latencies} during the attack; idle {idle:.3f}s, beside plain requests {plain}")
    assert max(latencies) < INNOCENT_DEADLINE_S, f"innocent latencies {latencies}; idle {idle:.3f}s"


# ---- finding 1: grammars that overflowed the compiler's stack -----------------------------------

def lark_rule_chain(n: int) -> str:
    return "start: r0\n" + "".join(f"r{i}: r{i + 1}\n" for i in range(n)) + f'r{n}: "a"\n'


def lark_terminal_chain(n: int) -> str:
    return "start: T0\n" + "".join(f'T{i}:"a" T{i + 1}\n' for i in range(n)) + f'T{n}:"a"\n'


def gbnf_rule_chain(n: int) -> str:
    return "root ::= r0\n" + "".join(f"r{i} ::= r{i + 1}\n" for i in range(n)) + f'r{n} ::= "a"\n'


@pytest.mark.parametrize("grammar", [lark_rule_chain(3000), lark_terminal_chain(4000), gbnf_rule_chain(4000)],
                         ids=["lark-3000-rules", "lark-4000-terminals", "gbnf-4000-rules"])
def test_compiler_stack_bombs_are_refused(served: tuple[str, Any], grammar: str) -> None:
    base, proc = served
    assert len(grammar.encode()) < 64 * 1024  # under the size limit: shape is the attack
    message = assert_refused(completion(base, guided_grammar=grammar), "guided_grammar")
    assert "the limit is" in message, message
    assert proc.poll() is None
    assert_unharmed(base, MAX_SESSIONS)


def ref_chain_schema(n: int) -> dict[str, Any]:
    """An object whose one property is a chain of n $refs: shallow JSON, under every shape limit,
    yet the compiler recurses once per link."""
    defs: dict[str, Any] = {f"d{i}": {"$ref": f"#/$defs/d{i + 1}"} for i in range(n)}
    defs[f"d{n}"] = {"type": "string"}
    return {"type": "object", "properties": {"a": {"$ref": "#/$defs/d0"}}, "$defs": defs}


def test_a_compiler_crash_the_limits_let_through_costs_only_the_grammar_worker(served: tuple[str, Any]) -> None:
    """The grammar worker compiles on a quarter of a serving thread's stack: a $ref chain that
    overflows it is refused there (the worker dies, not the frontend), and a later grammar is
    compiled by a new worker."""
    base, proc = served
    message = assert_refused(completion(base, guided_json=ref_chain_schema(1500)), "guided_json")
    assert "SIGSEGV" in message, message
    assert proc.poll() is None
    fine = completion(base, guided_json={"type": "object", "properties": {"x": {"type": "integer"}}})
    assert fine.status_code == 200, fine.text
    json.loads(fine.json()["choices"][0]["text"] or "{}")  # complete or cut, but the grammar's
    assert_unharmed(base, MAX_SESSIONS)


# ---- finding 3: grammar work that froze the event loop ------------------------------------------

def pattern_schema(patterns: int, tag: str) -> dict[str, Any]:
    """patternProperties whose patterns overlap: llguidance's compile grows super-linearly in them.
    tag makes a schema of its own (nothing cached from another test)."""
    return {"type": "object", "additionalProperties": False,
            "patternProperties": {f"^{tag}[a-z]*{i}[a-z]*$": {"type": "string"} for i in range(patterns)}}


def test_a_schema_past_the_compile_budget_is_refused_without_stalling_anyone(served: tuple[str, Any]) -> None:
    base, _ = served
    bomb = pattern_schema(300, "bomb")  # 12.6 s to compile, 25 s of event loop with n: 4, before
    started = time.perf_counter()
    response, latencies, idle = while_attacked(base, lambda: completion(base, guided_json=bomb, n=4))
    message = assert_refused(response, "guided_json")
    assert "to compile" in message, message
    assert_undisturbed(latencies, idle)
    # refused again from the verdict's cache, at once
    again = time.perf_counter()
    assert_refused(completion(base, guided_json=bomb, n=4), "guided_json")
    assert time.perf_counter() - again < (again - started) / 2
    assert_unharmed(base, MAX_SESSIONS)


def test_a_costly_schema_within_budget_is_built_once_off_the_event_loop(served: tuple[str, Any]) -> None:
    """Its four choices' matchers cost a second each, on the event loop, before: now one build,
    on a low-priority thread, and copies. Two tokens each: the grammar's cost, not generation's."""
    base, _ = served
    costly = pattern_schema(150, "costly")  # about a second to compile, as much again per choice before
    _, plain, _ = while_attacked(base, lambda: completion(base, n=4, max_tokens=2))
    for _ in range(2):  # built, then shared: each time, n: 4 choices from one matcher
        response, latencies, idle = while_attacked(
            base, lambda: completion(base, guided_json=costly, n=4, max_tokens=2))
        assert response.status_code == 200, response.text
        assert len(response.json()["choices"]) == 4
        assert_undisturbed(latencies, idle, plain)
    assert_unharmed(base, MAX_SESSIONS)


def test_an_ambiguous_grammar_ends_its_own_request_at_the_step_limit(served: tuple[str, Any]) -> None:
    """Each 31-space token makes the next mask costlier (seconds by the tenth, with the GIL held
    while consuming): the request ends with an error naming its grammar, the others never wait."""
    base, _ = served
    ambiguous = {"guided_grammar": 'start: s\ns: s s | s s s | " "', "logit_bias": {str(SPACES_31): 100},
                 "max_tokens": 40}

    def attacks(**fields: Any) -> list[httpx.Response]:  # a few in a row: an innocent latency or two each
        return [completion(base, stream=stream, **fields) for stream in (False, True) * 3]

    _, plain, _ = while_attacked(base, lambda: attacks(**{**ambiguous, "guided_grammar": None, "max_tokens": 2}))
    responses, latencies, idle = while_attacked(base, lambda: attacks(**ambiguous))
    for response in responses:
        if response.request.content and json.loads(response.request.content)["stream"]:
            assert response.status_code == 200, response.text  # the error comes as the stream's last event
            events = [json.loads(line[6:]) for line in response.text.splitlines()
                      if line.startswith("data: ") and line != "data: [DONE]"]
            assert events[-1]["error"]["param"] == "guided_grammar", events[-1]
            message = events[-1]["error"]["message"]
        else:
            message = assert_refused(response, "guided_grammar")
        assert "could not be enforced" in message or "ms of CPU" in message, message
    assert_undisturbed(latencies, idle, plain)
    assert_unharmed(base, MAX_SESSIONS)


# ---- finding 6: constraints that passed validation and failed later ------------------------------

def nested_schema(levels: int) -> dict[str, Any]:
    schema: dict[str, Any] = {"type": "string"}
    for _ in range(levels):
        schema = {"type": "object", "properties": {"a": schema}}
    return schema


DEEP = nested_schema(110)


@pytest.mark.parametrize(("fields", "param"), [
    ({"guided_regex": "(a{1000}){1000}"}, "guided_regex"),
    ({"guided_regex": "(x?){5000}x{5000}"}, "guided_regex"),
    ({"guided_regex": "(x?){1000}x{1000}"}, "guided_regex"),  # within the limits: the build's probe finds it
    ({"guided_json": DEEP}, "guided_json"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "deep", "schema": DEEP}}},
     "response_format.json_schema.schema"),
], ids=["nested-repeat", "chained-repeat", "probed-repeat", "deep-guided-json", "deep-response-format"])
def test_constraints_that_failed_later_are_refused_up_front(served: tuple[str, Any], fields: dict[str, Any],
                                                            param: str) -> None:
    base, _ = served
    assert_refused(completion(base, **fields), param)
    assert_unharmed(base, MAX_SESSIONS)


def test_a_deep_tool_schema_is_refused_naming_the_tool(served: tuple[str, Any]) -> None:
    base, _ = served
    tools = [{"type": "function", "function": {"name": "deep", "parameters": DEEP}}]
    response = httpx.post(f"{base}/v1/chat/completions", timeout=60, json={
        "model": MODEL, "messages": [{"role": "user", "content": "hi"}], "tools": tools, "max_tokens": 8})
    assert_refused(response, "tools.0.function.parameters")
    assert_unharmed(base, MAX_SESSIONS)
