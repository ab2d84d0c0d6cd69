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
from jsonschema import Draft202012Validator
from referencing import Registry, Resource
from referencing.jsonschema import DRAFT202012

REPO_ROOT = Path(__file__).resolve().parents[1]
SPEC_BASE = "urn:openai-openapi"
# The only shape the wire format adds to the spec: completion stream chunks carry
# `finish_reason: null` until the last one (OpenAI's own API does this too), while
# CreateCompletionResponse, which the spec says chunks share, declares it non-null.
COMPLETION_STREAM_CHUNK = "CreateCompletionResponse.stream_chunk"


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
    return Registry().with_resource(SPEC_BASE, Resource.from_contents(spec, default_specification=DRAFT202012))


@functools.lru_cache(maxsize=64)
def validator(schema_name: str) -> Draft202012Validator:
    schema = {"$schema": "https://json-schema.org/draft/2020-12/schema",
              "$ref": f"{SPEC_BASE}#/components/schemas/{schema_name}"}
    return Draft202012Validator(schema, registry=_registry())


def validate(body: Any, schema_name: str) -> None:
    """Raise jsonschema.ValidationError unless body matches components/schemas/<schema_name>."""
    validator(schema_name).validate(body)


def errors(body: Any, schema_name: str) -> list[str]:
    """All validation errors as readable strings (empty when valid)."""
    return [f"{'/'.join(map(str, e.absolute_path)) or '<root>'}: {e.message}"
            for e in validator(schema_name).iter_errors(body)]
