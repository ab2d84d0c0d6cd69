"""Validate our response bodies against OpenAI's official OpenAPI spec (tests/openai/openapi.yaml).

The spec is OpenAPI 3.1 (JSON Schema 2020-12) but still carries some 3.0-style `nullable: true`,
which 2020-12 ignores; it is rewritten to an explicit `anyOf [..., null]` so a legitimately null
field (a stream chunk's `finish_reason`) is not reported as invalid. Parsed once per process.
"""

from __future__ import annotations

import copy
import functools
from pathlib import Path
from typing import Any

import yaml
from jsonschema import Draft202012Validator, ValidationError
from referencing import Registry, Resource
from referencing.jsonschema import DRAFT202012

REPO_ROOT = Path(__file__).resolve().parents[1]
SPEC_BASE = "urn:openai-openapi"
# The only shape the wire format adds to the spec: completion stream chunks carry
# `finish_reason: null` until the last one (OpenAI's own API does this too), while
# CreateCompletionResponse, which the spec says chunks share, declares it non-null.
COMPLETION_STREAM_CHUNK = "CreateCompletionResponse.stream_chunk"
# The second: with echo, a completion's first prompt token has no logprob (nothing precedes it),
# and OpenAI's own API, vLLM and lm-eval's parsing all use null there, while the spec declares
# numbers. Only that entry may be null: _completion_logprobs_nulls() checks where the nulls are.


SPEC_PATH = Path(__file__).resolve().parent / "openai" / "openapi.yaml"  # MIT, see tests/openai/LICENSE


def spec_path() -> Path:
    """The copy of the spec inside the repository: a clone needs nothing beside it."""
    return SPEC_PATH


def _nullable_to_anyof(node: Any) -> Any:
    if isinstance(node, list):
        return [_nullable_to_anyof(x) for x in node]
    if not isinstance(node, dict):
        return node
    node = {k: _nullable_to_anyof(v) for k, v in node.items()}
    if node.pop("nullable", False) is True:
        return {"anyOf": [node, {"type": "null"}]}
    return node


@functools.lru_cache(maxsize=1)
def _registry() -> Registry:
    with spec_path().open("rb") as f:
        # 3 MB: libyaml's safe loader takes ~1.5 s where the pure-Python one takes ~20 s.
        spec = yaml.load(f, Loader=yaml.CSafeLoader) if hasattr(yaml, "CSafeLoader") else yaml.safe_load(f)
    spec = {"components": {"schemas": _nullable_to_anyof(spec["components"]["schemas"])}}
    chunk = copy.deepcopy(spec["components"]["schemas"]["CreateCompletionResponse"])
    finish = chunk["properties"]["choices"]["items"]["properties"]["finish_reason"]
    chunk["properties"]["choices"]["items"]["properties"]["finish_reason"] = {"anyOf": [finish, {"type": "null"}]}
    spec["components"]["schemas"][COMPLETION_STREAM_CHUNK] = chunk
    for schema in (spec["components"]["schemas"]["CreateCompletionResponse"], chunk):
        logprobs = _strip_anyof_null(schema["properties"]["choices"]["items"]["properties"]["logprobs"])
        for name in ("token_logprobs", "top_logprobs"):
            items = logprobs["properties"][name]["items"]
            logprobs["properties"][name]["items"] = {"anyOf": [items, {"type": "null"}]}
    return Registry().with_resource(SPEC_BASE, Resource.from_contents(spec, default_specification=DRAFT202012))


@functools.lru_cache(maxsize=64)
def validator(schema_name: str) -> Draft202012Validator:
    schema = {"$schema": "https://json-schema.org/draft/2020-12/schema",
              "$ref": f"{SPEC_BASE}#/components/schemas/{schema_name}"}
    return Draft202012Validator(schema, registry=_registry())


def _strip_anyof_null(node: dict) -> dict:
    """The non-null branch of a nullable schema (as _nullable_to_anyof wrote it), else node."""
    branches = [b for b in node.get("anyOf", []) if b != {"type": "null"}]
    return branches[0] if len(branches) == 1 else node


def _completion_logprobs_nulls(body: Any) -> list[str]:
    """Nulls in a completion's logprobs other than the echoed first token's."""
    found = []
    for i, choice in enumerate(body.get("choices") or [] if isinstance(body, dict) else []):
        logprobs = choice.get("logprobs") if isinstance(choice, dict) else None
        for name in ("token_logprobs", "top_logprobs"):
            values = (logprobs or {}).get(name) or []
            found += [f"choices/{i}/logprobs/{name}/{j}: null" for j, v in enumerate(values) if v is None and j]
    return found


def validate(body: Any, schema_name: str) -> None:
    """Raise jsonschema.ValidationError unless body matches components/schemas/<schema_name>."""
    validator(schema_name).validate(body)
    misplaced = _completion_logprobs_nulls(body)
    if misplaced:
        raise ValidationError(f"only an echoed first token may have a null logprob: {misplaced}")


def errors(body: Any, schema_name: str) -> list[str]:
    """All validation errors as readable strings (empty when valid)."""
    return [f"{'/'.join(map(str, e.absolute_path)) or '<root>'}: {e.message}"
            for e in validator(schema_name).iter_errors(body)] + _completion_logprobs_nulls(body)
