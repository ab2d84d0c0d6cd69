"""Structured output's metrics through a real engine over a 2-stage mesh of the bundled model: the
requests by kind, compile times only for constraints not already compiled, one mask time per frame
that decides tokens; /metrics parsed by Prometheus' own parser and checked by promtool."""

from __future__ import annotations

import httpx
import pytest
from fixture_engine import serve
from mesh_helpers import start_mesh
from test_frontend_metrics import promtool_check, scrape, value
from transformers import AutoTokenizer

from inferencemesh.bundled import DEFAULT_MODEL, bundled_path
from inferencemesh.frontend.engine.engine import EngineOptions, PipelineEngine
from inferencemesh.frontend.engine.metrics import CONSTRAINT_KINDS, FrontendMetrics
from inferencemesh.frontend.engine.pipeline import GrpcPipeline
from inferencemesh.frontend.openai.app import create_app

pytestmark = pytest.mark.slow

TARGET = bundled_path(DEFAULT_MODEL)
SCHEMA = {"type": "object", "properties": {"port": {"type": "integer", "minimum": 1, "maximum": 65535},
                                           "debug": {"type": "boolean"}},
          "required": ["port", "debug"], "additionalProperties": False}


def test_constrained_requests_move_the_structured_output_metrics() -> None:
    mesh = start_mesh(TARGET, 2, max_context=256, dtype="float32", max_sessions=4)
    try:
        metrics = FrontendMetrics(DEFAULT_MODEL)
        engine = PipelineEngine(GrpcPipeline(mesh.addresses), EngineOptions(DEFAULT_MODEL, max_context=256),
                                metrics=metrics)
        app = create_app(engine, AutoTokenizer.from_pretrained(TARGET), served_model_name=DEFAULT_MODEL,
                         metrics=metrics)
        with serve(app) as url, httpx.Client(base_url=url, timeout=120) as http:
            text, samples, types = scrape(http)
            assert types["inferencemesh_grammar_mask_seconds"] == "histogram"
            assert types["inferencemesh_grammar_compile_seconds"] == "histogram"
            assert types["inferencemesh_structured_output_requests"] == "counter"
            for kind in CONSTRAINT_KINDS:  # every kind exported from the first scrape
                assert value(samples, "structured_output_requests_total", model_name=DEFAULT_MODEL, kind=kind) == 0

            def complete(**extra: object) -> dict:
                r = http.post("/v1/completions", json={"model": DEFAULT_MODEL, "prompt": "config = ",
                                                       "max_tokens": 40, "temperature": 0, **extra})
                assert r.status_code == 200, r.text
                return r.json()

            schema_format = {"type": "json_schema", "json_schema": {"name": "c", "strict": True, "schema": SCHEMA}}
            answers = [complete(response_format=schema_format) for _ in range(2)]  # the second: from the cache
            choice = complete(guided_choice=["yes", "no"])
            complete()  # free text: no constraint, no mask

            text, samples, _ = scrape(http)
            promtool_check(text)
            m = {"model_name": DEFAULT_MODEL}
            assert value(samples, "structured_output_requests_total", kind="json_schema", **m) == 2
            assert value(samples, "structured_output_requests_total", kind="choice", **m) == 1
            assert value(samples, "structured_output_requests_total", kind="regex", **m) == 0
            compiles = value(samples, "grammar_compile_seconds_count", **m)
            assert compiles == 2  # the schema once, the choice once
            assert 0 < value(samples, "grammar_compile_seconds_sum", **m) < 10
            # One mask per frame that decides tokens: the prompt's last chunk, then one per step. No
            # speculation here, so each step decides one token: one per token generated, plus the
            # EOS of each output the grammar ended (decided under a mask, not counted as a token).
            done = [*answers, choice]
            tokens = sum(a["usage"]["completion_tokens"] + (a["choices"][0]["finish_reason"] == "stop") for a in done)
            assert value(samples, "grammar_mask_seconds_count", **m) == tokens
            assert value(samples, "grammar_mask_seconds_bucket", le="+Inf", **m) == tokens
            assert 0 < value(samples, "grammar_mask_seconds_sum", **m) < tokens  # under a second each
    finally:
        mesh.stop()
