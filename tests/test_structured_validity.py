"""The structured-output validity matrix: a broad set of JSON schemas, each asked for greedy and
sampled, on both endpoints, through `inferencemesh serve` with one stage and no speculation and
with two stages and each speculation strategy (n-grams, the bundled draft model, auto).

Every output must end by the grammar (finish_reason "stop", never max_tokens), parse without
duplicate keys, validate against its schema (formats checked too) and write its properties in the
schema's order; the speculative configurations must have proposed drafts; a greedy output is the
same text in every configuration as in the plainest one (neither the split nor speculation may
change a greedy answer).
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import httpx
import jsonschema
import pytest
from mesh_helpers import serving
from openai import OpenAI

pytestmark = pytest.mark.slow


def closed(properties: dict[str, Any], required: list[str] | None = None, **more: Any) -> dict[str, Any]:
    """An object schema with exactly these properties (all required unless told otherwise)."""
    return {"type": "object", "properties": properties,
            "required": list(properties) if required is None else required, "additionalProperties": False, **more}


def text(max_length: int, **more: Any) -> dict[str, Any]:
    return {"type": "string", "maxLength": max_length, **more}


def integer(minimum: int, maximum: int) -> dict[str, Any]:
    return {"type": "integer", "minimum": minimum, "maximum": maximum}


# Every value is bounded in length (strings by maxLength or a pattern, integers by their range,
# numbers by a range and multipleOf, arrays and open objects by their size): sampling from a
# small model then ends within MAX_TOKENS, and "stop" is what the grammar owes us.
SCHEMAS: dict[str, dict[str, Any]] = {
    "flat": closed({"name": text(12), "replicas": integer(1, 9), "enabled": {"type": "boolean"}}),
    "nested": closed({"service": closed({"name": text(10), "limits": closed({
        "cpu": integer(1, 16), "memory": integer(64, 4096)})})}),
    "array of strings": closed({"tags": {"type": "array", "items": text(8), "minItems": 1, "maxItems": 3}}),
    "array of objects": closed({"ports": {"type": "array", "minItems": 1, "maxItems": 2, "items": closed({
        "port": integer(1, 65535), "proto": {"enum": ["tcp", "udp"]}})}}),
    "fixed-length array": closed({"rgb": {"type": "array", "items": integer(0, 255), "minItems": 3, "maxItems": 3}}),
    "enums": closed({"level": {"enum": ["debug", "info", "warn", "error"]}, "retries": {"enum": [0, 1, 3]},
                     "color": {"type": "string", "enum": ["red", "green"]}}),
    "const": closed({"version": {"const": 2}, "kind": {"const": "Deployment"}, "name": text(10)}),
    "integer bounds": closed({"port": integer(1024, 65535), "offset": integer(-50, -10)}),
    "exclusive bounds": closed({
        "workers": {"type": "integer", "exclusiveMinimum": 0, "exclusiveMaximum": 8},
        "percent": {"type": "number", "exclusiveMinimum": 0, "maximum": 100, "multipleOf": 0.5}}),
    # multipleOf a power of two: jsonschema checks it in floats, where 1.4 is no multiple of 0.1
    "numbers": closed({"ratio": {"type": "number", "minimum": 0, "maximum": 1, "multipleOf": 0.25},
                       "scale": {"type": "number", "minimum": -10, "maximum": 10, "multipleOf": 0.125}}),
    "string lengths": closed({"code": text(4, minLength=2), "note": text(20)}),
    "pattern": closed({"version": {"type": "string", "pattern": r"^v[0-9]{1,2}\.[0-9]{1,2}$"},
                       "sha": {"type": "string", "pattern": "^[0-9a-f]{7}$"}}),
    "format": closed({"day": {"type": "string", "format": "date"}, "id": {"type": "string", "format": "uuid"},
                      "addr": {"type": "string", "format": "ipv4"}}),
    "booleans": closed({"debug": {"type": "boolean"}, "verbose": {"type": "boolean"}, "dry_run": {"type": "boolean"}}),
    "null by type list": closed({"owner": {"type": ["string", "null"], "maxLength": 10},
                                 "limit": {"type": ["integer", "null"], "minimum": 0, "maximum": 99}}),
    "null by anyOf": closed({"timeout": {"anyOf": [integer(0, 600), {"type": "null"}]},
                             "label": {"anyOf": [text(8), {"type": "null"}]}}),
    "anyOf shapes": closed({"source": {"anyOf": [closed({"git": text(16), "ref": text(8)}), closed({"path": text(16)}),
                                                 closed({"image": text(12), "tag": {"enum": ["latest", "stable"]}})]}}),
    "refs": {**closed({"primary": {"$ref": "#/$defs/endpoint"},
                       "fallbacks": {"type": "array", "items": {"$ref": "#/$defs/endpoint"}, "maxItems": 2}}),
             "$defs": {"endpoint": closed({"host": text(12), "port": integer(1, 9999)})}},
    "nested refs": {**closed({"root": {"$ref": "#/$defs/node"}}), "$defs": {
        "leaf": closed({"value": integer(0, 9)}),
        "node": closed({"name": text(6), "children": {"type": "array", "items": {"$ref": "#/$defs/leaf"},
                                                       "maxItems": 3}})}},
    "non-required": closed({"name": text(10), "port": integer(1, 9999), "debug": {"type": "boolean"}},
                           required=["name"]),
    "nothing required": closed({"a": integer(0, 9), "b": {"enum": ["x", "y"]}}, required=[]),
    # Open objects: llguidance cannot bound a key (propertyNames is unimplemented), and a sampled
    # free key ran on to max_tokens; the extra keys are bounded by maxProperties or patternProperties.
    "open object": {"type": "object", "properties": {"name": text(10), "port": integer(1, 99)},
                    "required": ["name", "port"], "maxProperties": 2},
    "open with typed extras": {"type": "object", "properties": {"name": text(10)}, "required": ["name"],
                               "additionalProperties": integer(0, 99), "maxProperties": 1},
    "pattern-keyed map": closed({"labels": {"type": "object", "maxProperties": 2, "additionalProperties": False,
                                            "patternProperties": {"^[a-z]{1,6}$": text(6)}},
                                 "count": integer(0, 9)}),
    "mixed": closed({"name": {"type": "string", "pattern": "^[a-z][a-z0-9-]{0,11}$"},
                     "env": {"type": "array", "maxItems": 2, "items": closed({
                         "key": {"type": "string", "pattern": "^[A-Z_]{1,8}$"},
                         "value": {"type": ["string", "null"], "maxLength": 8}})},
                     "mode": {"anyOf": [{"const": "auto"}, integer(1, 4)]}}),
    # "flat" in another order (required too lists the same): the output follows each schema's own
    # order, and the server's cache of compiled grammars must not hand one the other's (last:
    # "flat" has long been compiled here)
    "flat reordered": closed({"enabled": {"type": "boolean"}, "replicas": integer(1, 9), "name": text(12)},
                             required=["name", "replicas", "enabled"]),
}
MAX_TOKENS = 200
PROMPT = "# config for the service\nconfig = "
MESSAGES = [{"role": "user", "content": "Write the service's config as JSON."}]
# --speculative-disable-by-batch-size 0: speculate however many requests run (by default it stops
# at 3, and this file sends 4 at a time: the speculative configurations would rarely speculate).
CONFIGS: dict[str, tuple[str, ...]] = {
    "1 stage, none": ("--stages", "1", "--speculative", "none"),
    "2 stages, ngram": ("--stages", "2", "--speculative", "ngram"),
    "2 stages, draft": ("--stages", "2", "--speculative", "draft"),
    "2 stages, auto": ("--stages", "2", "--speculative", "auto"),
}
ALWAYS_SPECULATE = ("--speculative-disable-by-batch-size", "0")
REFERENCE = "1 stage, none"  # the configuration whose greedy answers every other one must give
# Each schema is asked greedy on one endpoint and sampled on the other, alternating by schema:
# both endpoints see both.
GREEDY_ENDPOINT = {name: ("chat", "completions")[index % 2] for index, name in enumerate(SCHEMAS)}
SAMPLED_ENDPOINT = {name: ("completions", "chat")[index % 2] for index, name in enumerate(SCHEMAS)}


# object keywords OpenAI's strict mode does not take
NOT_STRICT_KEYWORDS = {"patternProperties", "propertyNames", "minProperties", "maxProperties"}


def is_strict(schema: dict[str, Any]) -> bool:
    """OpenAI's strict rules: the root is an object, every object lists all its properties in
    required and closes itself with additionalProperties: false (refs reach only $defs, checked
    there), without the object keywords strict mode refuses. String lengths pass, as in
    test_structured_output.py: the server enforces them under strict."""
    def objects(node: Any) -> Iterator[dict[str, Any]]:
        if isinstance(node, dict):
            if node.get("type") == "object" or "properties" in node:
                yield node
            for value in node.values():
                yield from objects(value)
        elif isinstance(node, list):
            for value in node:
                yield from objects(value)

    return schema.get("type") == "object" and all(
        sub.get("additionalProperties") is False and set(sub.get("required", [])) == set(sub.get("properties", {}))
        and not NOT_STRICT_KEYWORDS & set(sub) for sub in objects(schema))


def test_the_matrix_covers_strict_and_non_strict_schemas() -> None:
    assert len(SCHEMAS) >= 20
    for schema in SCHEMAS.values():
        jsonschema.Draft202012Validator.check_schema(schema)
    strict = [name for name, schema in SCHEMAS.items() if is_strict(schema)]
    assert 0 < len(strict) < len(SCHEMAS)
    assert not is_strict(SCHEMAS["non-required"]) and not is_strict(SCHEMAS["open object"])
    assert is_strict(SCHEMAS["refs"]) and not is_strict(SCHEMAS["pattern-keyed map"])


@contextlib.contextmanager
def serving_config(config: str) -> Iterator[tuple[str, str, OpenAI, str]]:
    """`inferencemesh serve` in one of CONFIGS: (config, base URL, a client, the model's name)."""
    with serving(*CONFIGS[config], *ALWAYS_SPECULATE) as (base, _, _):
        client = OpenAI(base_url=f"{base}/v1", api_key="unused", max_retries=0, timeout=120)
        yield config, base, client, client.models.list().data[0].id


@pytest.fixture(scope="module", params=list(CONFIGS))
def served(request) -> Iterator[tuple[str, str, OpenAI, str]]:
    with serving_config(request.param) as server:
        yield server


@pytest.fixture(scope="module")
def reference_greedy() -> dict[str, str]:
    """The reference configuration's greedy answers, from a server of its own (so that a test
    comparing against them needs no other test to have run first)."""
    with serving_config(REFERENCE) as (_, _, client, model):
        return greedy_answers(client, model)


def greedy_answers(client: OpenAI, model: str) -> dict[str, str]:
    """Schema -> its greedy answer's text on its greedy endpoint."""
    with ThreadPoolExecutor(4) as pool:
        replies = pool.map(lambda name: ask(client, model, name, GREEDY_ENDPOINT[name], temperature=0), SCHEMAS)
        return {name: choices[0][1] for name, choices in zip(SCHEMAS, replies, strict=True)}


def draft_tokens(base: str) -> float:
    """Draft tokens the server has proposed for verification (its Prometheus counter)."""
    return sum(float(line.rsplit(" ", 1)[1]) for line in httpx.get(f"{base}/metrics").text.splitlines()
               if line.startswith("inferencemesh_spec_decode_num_draft_tokens_total"))


def ask(client: OpenAI, model: str, name: str, endpoint: str, **sampling: Any) -> list[tuple[str | None, str]]:
    """(finish_reason, text) of each choice for SCHEMAS[name] on endpoint: response_format on chat,
    guided_json on completions."""
    schema = SCHEMAS[name]
    if endpoint == "chat":
        response_format = {"type": "json_schema", "json_schema": {
            "name": name.replace(" ", "_").replace("-", "_"), "schema": schema, "strict": is_strict(schema)}}
        reply = client.chat.completions.create(model=model, messages=MESSAGES, max_completion_tokens=MAX_TOKENS,
                                               response_format=response_format, **sampling)
        return [(choice.finish_reason, choice.message.content or "") for choice in reply.choices]
    reply = client.completions.create(model=model, prompt=PROMPT, max_tokens=MAX_TOKENS,
                                      extra_body={"guided_json": schema}, **sampling)
    return [(choice.finish_reason, choice.text) for choice in reply.choices]


# Maps whose keys are free (within a pattern): llguidance does not make an object's keys unique,
# and the bundled model, greedy, writes {"a":"a","a":" + "} here. JSON parsers keep the last value.
DUPLICATE_KEYS_POSSIBLE = {"pattern-keyed map"}


def no_duplicate_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    keys = [key for key, _ in pairs]
    if len(set(keys)) != len(keys):
        raise ValueError(f"duplicate keys {keys}")
    return dict(pairs)


def problem(name: str, finish_reason: str | None, output: str) -> str | None:
    """Why output is not a valid answer to SCHEMAS[name], or None."""
    if finish_reason != "stop":
        return f"finish_reason {finish_reason!r}"
    try:
        value = json.loads(output, object_pairs_hook=None if name in DUPLICATE_KEYS_POSSIBLE else no_duplicate_keys)
    except ValueError as exc:
        return f"not JSON ({exc})"
    try:
        jsonschema.validate(value, SCHEMAS[name], format_checker=jsonschema.FormatChecker())
    except jsonschema.ValidationError as exc:
        return f"invalid: {exc.message}"
    # an object writes its properties in its schema's order (OpenAI's rule)
    declared = [key for key in SCHEMAS[name]["properties"] if key in value]
    if [key for key in value if key in SCHEMAS[name]["properties"]] != declared:
        return f"properties out of the schema's order {list(SCHEMAS[name]['properties'])}"
    return None


def test_every_schema_is_followed_greedy_and_sampled(served) -> None:
    config, base, client, model = served
    requests = []
    for index, name in enumerate(SCHEMAS):
        requests.append((name, GREEDY_ENDPOINT[name], {"temperature": 0}))
        requests.append((name, SAMPLED_ENDPOINT[name], {"temperature": 1.0, "seed": 100 + index, "n": 2}))
    with ThreadPoolExecutor(4) as pool:
        replies = list(pool.map(lambda asked: ask(client, model, asked[0], asked[1], **asked[2]), requests))
    failures = []
    for (name, endpoint, sampling), choices in zip(requests, replies, strict=True):
        assert len(choices) == sampling.get("n", 1)
        for finish_reason, output in choices:
            why = problem(name, finish_reason, output)
            if why:
                failures.append(f"{name} / {endpoint} / {sampling}: {why}: {output!r}")
    # the speculative configurations speculated under the grammars (drafts were verified)
    assert (draft_tokens(base) > 0) == (CONFIGS[config][-1] != "none"), draft_tokens(base)
    assert not failures, f"{config}: {len(failures)} of {sum(len(c) for c in replies)} outputs:\n" + "\n".join(
        failures)


@pytest.mark.parametrize("served", [config for config in CONFIGS if config != REFERENCE], indirect=True)
def test_greedy_output_is_the_same_in_every_configuration(served, reference_greedy: dict[str, str]) -> None:
    config, base, client, model = served
    drafts = draft_tokens(base)
    answers = greedy_answers(client, model)
    assert draft_tokens(base) > drafts, f"{config} proposed no drafts for these answers"
    differ = {name: {REFERENCE: reference_greedy[name], config: answer} for name, answer in answers.items()
              if answer != reference_greedy[name]}
    assert not differ, "\n".join(f"{name} / {GREEDY_ENDPOINT[name]}: {json.dumps(by_config, indent=1)}"
                                 for name, by_config in differ.items())
