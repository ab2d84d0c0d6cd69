"""The frontend's /metrics: vLLM-shaped names, right numbers, valid exposition (parser + promtool)."""

from __future__ import annotations

import json
import shutil
import subprocess
import threading
from collections.abc import Iterator

import httpx
import openai
import pytest
from fixture_engine import FixtureModel, TransformersEngine, build_fixture_model, serve
from prometheus_client.parser import text_string_to_metric_families

from inferencemesh.frontend.engine.metrics import FrontendMetrics
from inferencemesh.frontend.openai.app import create_app

P = "inferencemesh_"
REQUIRED = {  # family name (the parser drops a counter's _total) -> type
    "time_to_first_token_seconds": "histogram", "inter_token_latency_seconds": "histogram",
    "e2e_request_latency_seconds": "histogram", "num_requests_running": "gauge", "num_requests_waiting": "gauge",
    "prompt_tokens": "counter", "generation_tokens": "counter", "request_success": "counter",
    "spec_decode_num_drafts": "counter", "spec_decode_num_draft_tokens": "counter",
    "spec_decode_num_accepted_tokens": "counter", "spec_decode_num_accepted_tokens_per_pos": "counter",
    "spec_decode_window_size": "gauge", "spec_decode_auto_state": "gauge", "speculative_strategy_info": "gauge",
}


def scrape(http: httpx.Client) -> tuple[str, dict[tuple[str, frozenset], float], dict[str, str]]:
    r = http.get("/metrics")
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain")
    samples, types = {}, {}
    for family in text_string_to_metric_families(r.text):
        types[family.name] = family.type
        for s in family.samples:
            samples[(s.name, frozenset(s.labels.items()))] = s.value
    return r.text, samples, types


def value(samples: dict, name: str, **labels: str) -> float:
    return samples[(P + name, frozenset(labels.items()))]


def promtool_check(text: str) -> None:
    promtool = shutil.which("promtool")
    if promtool is None:
        pytest.fail("promtool not found: install Debian's `prometheus` package (apt-get install -y prometheus)")
    done = subprocess.run([promtool, "check", "metrics"], input=text, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stdout + done.stderr


@pytest.fixture(scope="module")
def fm() -> FixtureModel:
    return build_fixture_model()


@pytest.fixture(scope="module")
def served(fm: FixtureModel) -> Iterator[tuple[str, FrontendMetrics, TransformersEngine]]:
    metrics = FrontendMetrics(fm.name)
    engine = TransformersEngine(fm.engine.model, model_name=fm.name, max_context=fm.engine.max_context,
                                step_delay_s=0.02)
    with serve(create_app(engine, fm.tokenizer, served_model_name=fm.name, metrics=metrics)) as url:
        yield url, metrics, engine


def test_request_metrics_count_what_was_served(served, fm: FixtureModel) -> None:
    url, _, _ = served
    client = openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0)
    with httpx.Client(base_url=url, timeout=60) as http:
        text, before, types = scrape(http)
        for name, kind in REQUIRED.items():
            assert types.get(P + name) == kind, (name, types.get(P + name))
        for (name, labels), _ in before.items():
            if name.startswith(P):
                assert ("model_name", fm.name) in labels, name
        promtool_check(text)
        assert value(before, "prompt_tokens_total", model_name=fm.name) == 0

        usages = [client.completions.create(model=fm.name, prompt="def f(x):", max_tokens=5, temperature=0).usage,
                  client.completions.create(model=fm.name, prompt="import os\n", max_tokens=3, temperature=0).usage]
        stream = client.chat.completions.create(model=fm.name, messages=[{"role": "user", "content": "hi"}],
                                                max_tokens=4, temperature=0, stream=True,
                                                stream_options={"include_usage": True})
        usages += [c.usage for c in stream if c.usage is not None]
        with pytest.raises(openai.BadRequestError):
            client.completions.create(model=fm.name, prompt="x", best_of=2)

        text, after, _ = scrape(http)
        promtool_check(text)
    m = fm.name
    assert value(after, "prompt_tokens_total", model_name=m) == sum(u.prompt_tokens for u in usages)
    generated = sum(u.completion_tokens for u in usages)
    assert value(after, "generation_tokens_total", model_name=m) == generated
    finished = sum(value(after, "request_success_total", model_name=m, finished_reason=r) for r in ("stop", "length"))
    assert finished == 3
    assert value(after, "request_errors_total", model_name=m, status="400") == 1
    assert value(after, "time_to_first_token_seconds_count", model_name=m) == 3
    assert value(after, "e2e_request_latency_seconds_count", model_name=m) == 3
    # The fixture engine yields one token per step: one inter-token gap per token after the first.
    assert value(after, "inter_token_latency_seconds_count", model_name=m) == generated - 3
    assert value(after, "num_requests_running", model_name=m) == 0
    assert value(after, "num_requests_waiting", model_name=m) == 0
    ttft_sum = value(after, "time_to_first_token_seconds_sum", model_name=m)
    e2e_sum = value(after, "e2e_request_latency_seconds_sum", model_name=m)
    assert 0 < ttft_sum < e2e_sum


def test_gauges_follow_a_request_in_flight_and_an_abort(served, fm: FixtureModel) -> None:
    url, _, engine = served
    m = fm.name
    with httpx.Client(base_url=url, timeout=60) as http:
        _, before, _ = scrape(http)
        body = {"model": m, "prompt": "x = ", "max_tokens": 200, "temperature": 0, "stream": True}
        with http.stream("POST", "/v1/completions", json=body) as r:
            lines = r.iter_lines()
            next(line for line in lines if line)
            _, during, _ = scrape(http)
            assert value(during, "num_requests_running", model_name=m) == 1
            assert value(during, "num_requests_waiting", model_name=m) == 0
        # Closed mid-stream: the request is counted as aborted and leaves the running gauge.
        for _ in range(200):
            _, after, _ = scrape(http)
            if value(after, "num_requests_running", model_name=m) == 0:
                break
            threading.Event().wait(0.05)
    assert value(after, "num_requests_running", model_name=m) == 0
    aborted = value(after, "request_success_total", model_name=m, finished_reason="abort")
    assert aborted == value(before, "request_success_total", model_name=m, finished_reason="abort") + 1
    assert engine.open_sessions == 0


def test_speculative_metrics_and_separate_registries() -> None:
    a, b = FrontendMetrics("model-a"), FrontendMetrics("model-b")  # no duplicate-registration clash
    a.record_verify_round(draft_tokens=4, accepted=2)
    a.record_verify_round(draft_tokens=4, accepted=4)
    a.set_window_size(6)
    a.set_auto_state("active")
    a.set_speculative_strategy("draft", "declared by model-package.json")
    a.set_speculative_strategy("ngram", "auto: code fence in prompt")
    with pytest.raises(ValueError):
        a.set_auto_state("sideways")
    text = a.render()[0].decode()
    promtool_check(text)
    samples = {(s.name, frozenset(s.labels.items())): s.value
               for f in text_string_to_metric_families(text) for s in f.samples}
    assert value(samples, "spec_decode_num_drafts_total", model_name="model-a") == 2
    assert value(samples, "spec_decode_num_draft_tokens_total", model_name="model-a") == 8
    assert value(samples, "spec_decode_num_accepted_tokens_total", model_name="model-a") == 6
    per_pos = [value(samples, "spec_decode_num_accepted_tokens_per_pos_total", model_name="model-a", position=str(i))
               for i in range(5)]
    assert per_pos == [2, 2, 1, 1, 0]
    assert value(samples, "spec_decode_window_size", model_name="model-a") == 6
    states = {dict(labels)["state"]: v for (n, labels), v in samples.items() if n == P + "spec_decode_auto_state"}
    assert states == {"off": 0, "observing": 0, "active": 1, "cooldown": 0}
    info = [dict(labels) for (n, labels), v in samples.items() if n == P + "speculative_strategy_info" and v == 1]
    assert info == [{"model_name": "model-a", "strategy": "ngram", "reason": "auto: code fence in prompt"}]
    assert "model-a" not in b.render()[0].decode()


def test_metrics_endpoint_needs_no_api_key_by_default(fm: FixtureModel) -> None:
    app = create_app(fm.engine, fm.tokenizer, served_model_name=fm.name, api_key="k")
    with serve(app) as url, httpx.Client(base_url=url) as http:
        text, _, _ = scrape(http)
        assert P + "num_requests_running" in text
    app = create_app(fm.engine, fm.tokenizer, served_model_name=fm.name, api_key="k", auth_exempt_paths=("/health",))
    with serve(app) as url, httpx.Client(base_url=url) as http:
        r = http.get("/metrics")
        assert r.status_code == 401 and json.loads(r.text)["error"]["code"] == "invalid_api_key"
        assert http.get("/metrics", headers={"Authorization": "Bearer k"}).status_code == 200


def test_each_error_is_counted_once(fm: FixtureModel) -> None:
    # An engine that admits nothing: every request is a 429 at admission, streamed or not.
    engine = TransformersEngine(fm.engine.model, model_name=fm.name, max_context=fm.engine.max_context,
                                max_sessions=0)
    metrics = FrontendMetrics(fm.name)
    with serve(create_app(engine, fm.tokenizer, served_model_name=fm.name, metrics=metrics)) as base, \
            httpx.Client(base_url=base, timeout=60) as http:
        client = openai.OpenAI(base_url=base + "/v1", api_key="x", max_retries=0)
        for stream in (False, True):
            with pytest.raises(openai.RateLimitError):
                client.completions.create(model=fm.name, prompt="x", max_tokens=2, stream=stream)
        _, after, _ = scrape(http)
    assert value(after, "request_errors_total", model_name=fm.name, status="429") == 2
