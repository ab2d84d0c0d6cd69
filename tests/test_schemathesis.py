"""schemathesis against the served /openapi.json (issue 20): every documented operation, with the
model name pinned so that generation is reached, answers no 5xx, only documented status codes
and content types, and bodies that conform to the documented response schemas. Bounded: a few
examples per operation, against the fixture engine and a real 2-stage mesh."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import schemathesis
from fixture_engine import build_fixture_model, serve
from hypothesis import HealthCheck, settings
from mesh_helpers import start_mesh
from schemathesis.checks import not_a_server_error
from schemathesis.specs.openapi.checks import (
    content_type_conformance,
    response_schema_conformance,
    status_code_conformance,
)
from transformers import AutoTokenizer

from inferencemesh.bundled import DEFAULT_MODEL, bundled_path
from inferencemesh.frontend.engine.engine import EngineOptions, PipelineEngine
from inferencemesh.frontend.engine.pipeline import GrpcPipeline
from inferencemesh.frontend.openai.app import create_app

pytestmark = pytest.mark.filterwarnings("ignore")
CHECKS = [not_a_server_error, status_code_conformance, content_type_conformance, response_schema_conformance]
MAX_CONTEXT = 48  # a short context keeps every generation short
SERVED: dict[str, str] = {}  # the served model's name, for the pinned field


@pytest.fixture(scope="module", params=["fixture", "mesh"])
def served(request) -> Iterator[str]:
    if request.param == "fixture":
        fm = build_fixture_model()
        engine = type(fm.engine)(fm.engine.model, model_name=fm.name, max_context=MAX_CONTEXT)
        with serve(create_app(engine, fm.tokenizer, served_model_name=fm.name, max_body_bytes=64 * 1024)) as url:
            SERVED["model"] = fm.name
            yield url
        return
    mesh = start_mesh(bundled_path(DEFAULT_MODEL), 2, max_context=256, dtype="float32")
    try:
        engine = PipelineEngine(GrpcPipeline(mesh.addresses), EngineOptions(DEFAULT_MODEL, max_context=MAX_CONTEXT))
        tokenizer = AutoTokenizer.from_pretrained(bundled_path(DEFAULT_MODEL))
        with serve(create_app(engine, tokenizer, served_model_name=DEFAULT_MODEL, max_body_bytes=64 * 1024)) as url:
            SERVED["model"] = DEFAULT_MODEL
            yield url
    finally:
        mesh.stop()


@pytest.fixture
def api_schema(served: str):
    loaded = schemathesis.openapi.from_url(served + "/openapi.json")
    # the coverage phase sends hundreds of boundary bodies per operation: too slow for a test run
    loaded.config.phases.coverage.enabled = False
    return loaded


schema = schemathesis.pytest.from_fixture("api_schema")


@schema.parametrize()
@settings(max_examples=6, deadline=None, derandomize=True, database=None,
          suppress_health_check=list(HealthCheck))
def test_the_served_schema_holds(case, served: str) -> None:
    if isinstance(case.body, dict) and "model" in case.body:
        case.body["model"] = SERVED["model"]  # pinned: a random name would stop at the 404
    case.call_and_validate(base_url=served, checks=CHECKS, timeout=60)
