"""One mesh on a real cluster, looked at from every side: status, in-cluster names, the OpenAI API
from outside and inside, exactness against a local `inferencemesh serve`, metrics, a stage lost
mid-stream, and a re-plan to more stages. The mesh is the `shared_mesh` fixture (conftest.py): one
pipeline (spec.replicas 1), so its pods are <name>-p<k>-stage-<i> and <name>-p<k>-frontend, k the
pipeline status.pipelines calls Ready (a re-plan starts a new pipeline, k changes). The endpoint
Service <name>-frontend selects the router, which relays to the pipelines' frontends: what a test
reads of a frontend's own /metrics it reads from the frontend pod (the router answers /metrics
itself)."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
from imesh_e2e import (
    FRONTEND_PORT,
    LABEL_PIPELINE,
    MODEL,
    OUTLASTING_TOKENS,
    PROMPTS,
    ConditionWatcher,
    conditions,
    exec_python,
    frontend_pod,
    get_json,
    greedy,
    is_ready,
    kubectl,
    mesh,
    not_recovered,
    pod_http,
    pod_ready,
    port_forward,
    prefix,
    ready_pipeline,
    router_pod,
    run_client_pod,
    running_pods,
    stage_pod,
    wait_for,
    wait_router_replicas,
    wait_settled,
)
from prometheus_client.parser import text_string_to_metric_families

from inferencemesh.protocol.transport import KV_BLOCK_TOKENS

openai = pytest.importorskip("openai")


def openai_client(base: str):  # noqa: ANN201
    from openai import OpenAI

    return OpenAI(base_url=f"{base}/v1", api_key="unused", timeout=300, max_retries=0)


def frontend_service(m: dict) -> tuple[str, int]:
    return f"svc/{m['name']}-frontend", m["doc"]["spec"]["frontend"]["service"]["port"]


def frontend_metrics(ns: str, name: str, pipeline: int | None = None) -> str:
    """A frontend pod's own /metrics (through the API server's pod proxy; the Service is the router's)."""
    return pod_http(ns, frontend_pod(ns, name, pipeline)["metadata"]["name"], FRONTEND_PORT, "/metrics")


# ---- (1) + (2): installed, planned, Ready, wired by Service names ------------------------------

def test_the_operator_runs_ready(settings: dict, release: str) -> None:
    ns = settings["operator_namespace"]
    dep = get_json("deployment", f"{release}-inferencemesh-operator", "-n", ns)
    assert dep["status"].get("readyReplicas") == 1
    (pod,) = running_pods(ns, ",".join(f"{k}={v}" for k, v in dep["spec"]["selector"]["matchLabels"].items()))
    assert pod_ready(pod)
    if settings["operator_image"]:
        assert pod["spec"]["containers"][0]["image"] == settings["operator_image"]


def test_the_mesh_is_ready_with_its_columns_filled(settings: dict, shared_mesh: dict) -> None:
    ns, name = shared_mesh["namespace"], shared_mesh["name"]
    obj = wait_settled(ns, name, settings["timeout"])
    status = obj["status"]
    assert status["phase"] == "Ready"
    conds = conditions(ns, name)
    for kind in ("Planned", "StagesReady", "FrontendReady", "Ready"):
        assert conds[kind]["status"] == "True", conds[kind]
    assert conds["Degraded"]["status"] == "False"
    assert [(s["layerStart"], s["layerEnd"]) for s in status["stages"]] == [(0, 4), (4, 8)]
    assert all(s["ready"] for s in status["stages"])
    assert status["endpoint"] == f"http://{name}-frontend.{ns}.svc:{FRONTEND_PORT}/v1"
    # One pipeline (spec.replicas 1, the example's), Ready; the /scale subresource's fields.
    (pipeline,) = status["pipelines"]
    assert pipeline["state"] == "Ready" and pipeline["ready"] is True, pipeline
    assert pipeline["name"] == prefix(name, pipeline["index"]) and pipeline["revision"], pipeline
    assert status["replicas"] == 1 and status["pipelinesSummary"] == "1/1", status
    assert status["selector"] == f"inferencemesh.io/mesh={name},app.kubernetes.io/component=frontend"
    # What `kubectl get imesh` prints: every column filled.
    header, row = kubectl("get", "inferencemesh", name, "-n", ns, "-o", "wide").splitlines()
    cells = dict(zip(header.split(), row.split(), strict=True))
    assert cells["MODEL"] == obj["spec"]["model"]["name"]
    assert cells["PIPELINES"] == "1/1" and cells["PHASE"] == "Ready", cells
    assert cells["STAGES"] == "2/2" and cells["READY"] == "True" and cells["ENDPOINT"] == status["endpoint"]
    assert "<none>" not in row, row


# Stage gRPC is mutual TLS by default: the probe presents the pod's own certificate (the operator's).
HEALTH = "from inferencemesh.protocol.health import check; from inferencemesh.tls import TlsMaterial; " \
         "import socket, sys; host = sys.argv[1].rsplit(':', 1)[0]; print(socket.gethostbyname(host)); " \
         "tls = TlsMaterial.from_dir('/etc/inferencemesh/tls'); " \
         "sys.exit(0 if check(sys.argv[1], tls=tls, server_name=host) else 3)"


def test_stage_and_frontend_reach_the_next_stage_by_service_name(shared_mesh: dict) -> None:
    ns, name = shared_mesh["namespace"], shared_mesh["name"]
    k = ready_pipeline(ns, name)
    hops = [(stage_pod(ns, name, 0, k), f"{prefix(name, k)}-stage-1"),
            (frontend_pod(ns, name, k), f"{prefix(name, k)}-stage-0")]
    for pod, service in hops:
        cluster_ip = get_json("service", service, "-n", ns)["spec"]["clusterIP"]
        for address in (f"{service}.{ns}.svc:50051", f"{service}.{ns}.svc.cluster.local:50051"):
            proc = exec_python(ns, pod["metadata"]["name"], HEALTH, address)
            assert proc.returncode == 0, f"{pod['metadata']['name']} -> {address}: {proc.stdout}{proc.stderr}"
            assert proc.stdout.split()[0] == cluster_ip


# ---- (3): the OpenAI API, from outside and from inside ---------------------------------------

def test_openai_client_through_port_forward(shared_mesh: dict) -> None:
    ns = shared_mesh["namespace"]
    with port_forward(ns, *frontend_service(shared_mesh)) as base:
        client = openai_client(base)
        assert [m.id for m in client.models.list().data] == [MODEL]
        reply = client.completions.create(model=MODEL, prompt="def add(a, b):", max_tokens=16, temperature=0)
        assert reply.choices[0].text and reply.usage.completion_tokens > 0
        messages = [{"role": "user", "content": "Write a Python loop."}]
        chat = client.chat.completions.create(model=MODEL, max_tokens=16, temperature=0, messages=messages)
        assert chat.choices[0].message.content and chat.choices[0].message.role == "assistant"
        stream = client.chat.completions.create(model=MODEL, max_tokens=16, temperature=0, messages=messages,
                                                stream=True)
        streamed = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
        assert streamed == chat.choices[0].message.content


def test_openai_api_from_a_pod_by_service_dns_name(settings: dict, shared_mesh: dict) -> None:
    ns, name = shared_mesh["namespace"], shared_mesh["name"]
    image = settings["frontend_image"] or frontend_pod(ns, name)["spec"]["containers"][0]["image"]
    url = mesh(ns, name)["status"]["endpoint"]  # http://<name>-frontend.<ns>.svc:8000/v1
    out = run_client_pod(ns, "imesh-e2e-client", image, settings["pull_policy"], url)
    assert [m["id"] for m in out["models"]["data"]] == [MODEL]
    assert out["completion"]["choices"][0]["text"] and out["completion"]["usage"]["completion_tokens"] > 0
    content = out["chat"]["choices"][0]["message"]["content"]
    assert content
    assert out.get("done") and out["stream"], out
    streamed = "".join(c["choices"][0]["delta"].get("content") or "" for c in out["stream"] if c["choices"])
    assert streamed == content


def strategy_metric(text: str) -> set[str]:
    """Strategies with value 1 in inferencemesh_speculative_strategy_info."""
    found = set()
    for line in text.splitlines():
        m = re.match(r'inferencemesh_speculative_strategy_info\{(.*)\} (\S+)$', line)
        if m and float(m.group(2)) == 1.0:
            found.add(re.search(r'strategy="([^"]*)"', m.group(1)).group(1))
    return found


def test_models_and_status_name_the_strategy_the_frontend_runs(shared_mesh: dict) -> None:
    ns, name = shared_mesh["namespace"], shared_mesh["name"]
    with port_forward(ns, *frontend_service(shared_mesh)) as base:
        import httpx

        (model,) = httpx.get(f"{base}/v1/models", timeout=60).json()["data"]  # relayed by the router
    metrics = frontend_metrics(ns, name)
    served = model["inferencemesh"]["speculative"]
    running = strategy_metric(metrics)
    assert running == {served["strategy"]}, f"/v1/models says {served}, the metric says {running}"
    # The example leaves the strategy unset: the bundled package declares its draft model.
    assert served["strategy"] == "draft", f"the example should run the package's draft, runs {served}"
    status = mesh(ns, name)["status"]["speculative"]
    assert status["strategy"] == served["strategy"], f"status {status} but the frontend runs {served}"


# ---- (4): exactly what `inferencemesh serve` answers ------------------------------------------

def test_greedy_output_equals_local_serve(shared_mesh: dict, reference: dict[str, str]) -> None:
    with port_forward(shared_mesh["namespace"], *frontend_service(shared_mesh)) as base:
        client = openai_client(base)
        got = {prompt: greedy(client, prompt) for prompt in PROMPTS}
    assert got == reference


def counter(text: str, name: str) -> float:
    """The sum of a metric's samples in a /metrics text (0 when it has none)."""
    return sum(s.value for family in text_string_to_metric_families(text) for s in family.samples if s.name == name)


def test_a_repeated_request_reuses_the_first_ones_kv_blocks_at_every_stage(shared_mesh: dict) -> None:
    """The second identical request is served from the prefix cache: the frontend counts its
    prompt's full KV blocks as hits, each stage pod holds written blocks, and the stages compute
    the prompt's tokens but those blocks the second time; the answer is the same."""
    ns, name = shared_mesh["namespace"], shared_mesh["name"]
    k = ready_pipeline(ns, name)
    pods = [stage_pod(ns, name, i, k)["metadata"]["name"] for i in range(2)]

    def stage_metrics(pod: str, metric: str) -> float:
        return counter(pod_http(ns, pod, 9090, "/metrics"), metric)

    prompt = PROMPTS[0] * 3
    hits_before = counter(frontend_metrics(ns, name, k), "inferencemesh_prefix_cache_hits_total")
    with port_forward(ns, *frontend_service(shared_mesh)) as base:
        client = openai_client(base)
        computed, answers = [], []
        for _ in range(2):
            before = [stage_metrics(pod, "inferencemesh_stage_tokens_total") for pod in pods]
            reply = client.completions.create(model=MODEL, prompt=prompt, max_tokens=8, temperature=0)
            answers.append(reply.choices[0].text)
            computed.append([stage_metrics(pod, "inferencemesh_stage_tokens_total") - b
                             for pod, b in zip(pods, before, strict=True)])
    # One pipeline: the router sent both to its frontend, whose own counter says what it reused.
    hits = counter(frontend_metrics(ns, name, k), "inferencemesh_prefix_cache_hits_total") - hits_before
    prompt_tokens = reply.usage.prompt_tokens
    assert answers[0] == answers[1]
    full_blocks = (prompt_tokens - 1) // KV_BLOCK_TOKENS * KV_BLOCK_TOKENS  # all but the last token, by blocks
    assert hits >= full_blocks, f"{hits} prefix-cache hits for a {prompt_tokens}-token prompt"
    for pod in pods:
        assert stage_metrics(pod, "inferencemesh_stage_kv_blocks_used") >= 1, pod
    for first, second in zip(*computed, strict=True):  # per stage: the same decoding, the prompt reused
        assert second <= first - (prompt_tokens - 1) // 2, computed


def test_more_streams_than_the_old_session_limit_run_at_once(shared_mesh: dict) -> None:
    """24 concurrent streams, past the 16 sessions a pipeline once reserved KV for: KV is the pool's,
    block by block, so the frontend runs all 24 at once: every stream has its first token before
    any stream has its last (with 16 sessions, the 17th would start only when one ended)."""
    streams = 24
    prompts = [f"# stream {i}\n{PROMPTS[i % len(PROMPTS)]}" for i in range(streams)]
    with port_forward(shared_mesh["namespace"], *frontend_service(shared_mesh)) as base:
        client = openai_client(base)
        barrier = threading.Barrier(streams)

        def stream(prompt: str) -> tuple[float, float]:
            barrier.wait(timeout=60)  # sent together
            pieces = client.completions.create(model=MODEL, prompt=prompt, max_tokens=48, temperature=0, stream=True,
                                               extra_body={"ignore_eos": True})
            arrivals = [time.monotonic() for chunk in pieces if chunk.choices and chunk.choices[0].text]
            return arrivals[0], arrivals[-1]

        with ThreadPoolExecutor(max_workers=streams) as pool:
            spans = list(pool.map(stream, prompts, timeout=600))
    last_first = max(first for first, _ in spans)
    first_last = min(last for _, last in spans)
    assert last_first < first_last, f"a stream started {last_first - first_last:.2f}s after another had ended"


def test_a_burst_sharing_a_prefix_computes_it_about_once(shared_mesh: dict) -> None:
    """8 requests sent at once with a long prompt in common and their own last line: the first to be
    scheduled computes the common blocks and the others wait for them and take them by reference, so
    the frontend counts most of their common prefix as hits and stage 0 computes far fewer than 8
    prompts' tokens."""
    ns, name = shared_mesh["namespace"], shared_mesh["name"]
    k = ready_pipeline(ns, name)
    stage0 = stage_pod(ns, name, 0, k)["metadata"]["name"]
    common = "".join(f"# shared line {i}: {PROMPTS[i % len(PROMPTS)]}\n" for i in range(24))
    prompts = [f"{common}# request {i}\n" for i in range(8)]

    def metric(text: str, metric_name: str) -> float:
        return counter(text, metric_name)

    hits_before = metric(frontend_metrics(ns, name, k), "inferencemesh_prefix_cache_hits_total")
    tokens_before = metric(pod_http(ns, stage0, 9090, "/metrics"), "inferencemesh_stage_tokens_total")
    with port_forward(ns, *frontend_service(shared_mesh)) as base:
        client = openai_client(base)
        with ThreadPoolExecutor(max_workers=len(prompts)) as pool:
            replies = list(pool.map(lambda p: client.completions.create(model=MODEL, prompt=p, max_tokens=4,
                                                                       temperature=0), prompts, timeout=600))
    hits = metric(frontend_metrics(ns, name, k), "inferencemesh_prefix_cache_hits_total") - hits_before
    computed = metric(pod_http(ns, stage0, 9090, "/metrics"), "inferencemesh_stage_tokens_total") - tokens_before
    prompt_tokens = [r.usage.prompt_tokens for r in replies]
    shared = min(prompt_tokens) - 16  # the common part, give or take the last lines' tokens
    assert hits >= 0.75 * (len(prompts) - 1) * (shared - KV_BLOCK_TOKENS), (hits, prompt_tokens)
    assert computed < 0.5 * sum(prompt_tokens), (computed, prompt_tokens)


def test_a_strict_json_schema_is_followed_through_the_pods(shared_mesh: dict) -> None:
    """Structured output on the cluster: the frontend pod's grammar masks travel to the last stage
    pod, and the answer parses and follows the schema; the frontend counts the request by kind."""
    import jsonschema

    schema = {"type": "object", "properties": {"lang": {"enum": ["python", "rust"]},
                                               "port": {"type": "integer", "minimum": 1, "maximum": 65535}},
              "required": ["lang", "port"], "additionalProperties": False}
    with port_forward(shared_mesh["namespace"], *frontend_service(shared_mesh)) as base:
        reply = openai_client(base).chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "The service, as JSON."}], max_completion_tokens=64,
            temperature=0.7, seed=11, response_format={"type": "json_schema", "json_schema": {
                "name": "service", "strict": True, "schema": schema}})
    text = frontend_metrics(shared_mesh["namespace"], shared_mesh["name"])
    assert reply.choices[0].finish_reason == "stop"
    jsonschema.validate(json.loads(reply.choices[0].message.content), schema)
    assert counter(text, "inferencemesh_structured_output_requests_total") >= 1


def test_a_tool_call_comes_back_through_the_pods(shared_mesh: dict) -> None:
    """Function calling on the cluster: the tools reach the prompt through the image's chat template,
    the call grammar's masks reach the last stage pod, and the call parses and matches its schema."""
    import jsonschema

    parameters = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12}},
                  "required": ["city"], "additionalProperties": False}
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": parameters, "strict": True}}]
    with port_forward(shared_mesh["namespace"], *frontend_service(shared_mesh)) as base:
        reply = openai_client(base).chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "Weather in Paris?"}], max_completion_tokens=64,
            temperature=0, tools=tools, tool_choice="required", parallel_tool_calls=False)
    assert reply.choices[0].finish_reason == "tool_calls"
    (call,) = reply.choices[0].message.tool_calls
    assert call.function.name == "get_weather"
    jsonschema.validate(json.loads(call.function.arguments), parameters)


# ---- (8): metrics ------------------------------------------------------------------------------

def promtool_check(text: str) -> subprocess.CompletedProcess:
    return subprocess.run(["promtool", "check", "metrics"], input=text, capture_output=True, text=True, timeout=60)


def test_every_pod_serves_metrics_promtool_accepts(shared_mesh: dict) -> None:
    if not shutil.which("promtool"):
        pytest.skip("promtool not installed (Debian package prometheus)")
    ns, name = shared_mesh["namespace"], shared_mesh["name"]
    k = ready_pipeline(ns, name)
    targets = [stage_pod(ns, name, i, k) for i in range(2)] + [frontend_pod(ns, name, k), router_pod(ns, name)]
    for pod in targets:
        advertised = pod["metadata"]["annotations"]
        assert advertised.get("prometheus.io/scrape") == "true"
        port = int(advertised["prometheus.io/port"])
        declared = {p["containerPort"] for p in pod["spec"]["containers"][0]["ports"]}
        assert port in declared, f"{pod['metadata']['name']}: metrics port {port} not among {declared}"
        text = pod_http(ns, pod["metadata"]["name"], port, advertised.get("prometheus.io/path", "/metrics"))
        assert "inferencemesh_" in text
        if pod["metadata"]["labels"]["app.kubernetes.io/component"] == "router":
            assert "inferencemesh_router_ready_replicas" in text, text[:2000]
        proc = promtool_check(text)
        assert proc.returncode == 0, f"{pod['metadata']['name']}:{port}: {proc.stdout}{proc.stderr}"


# ---- (5): a stage lost in the middle of a greedy stream ---------------------------------------

LONG_PROMPT, LONG_TOKENS = PROMPTS[0], OUTLASTING_TOKENS


def stream_completion(client, on_token=None) -> str:  # noqa: ANN001
    pieces = []
    for chunk in client.completions.create(model=MODEL, prompt=LONG_PROMPT, max_tokens=LONG_TOKENS,
                                           temperature=0, stream=True):
        if chunk.choices:
            pieces.append(chunk.choices[0].text)
            if on_token:
                on_token(len(pieces))
    return "".join(pieces)


def container_id(pod: dict) -> str:
    (status,) = pod["status"]["containerStatuses"]
    return status["containerID"].split("://", 1)[1]


@pytest.mark.parametrize("how", ["delete-pod", "sigkill-container"])
def test_a_stage_lost_mid_stream_changes_nothing_in_the_answer(how: str, settings: dict, shared_mesh: dict) -> None:
    ns, name = shared_mesh["namespace"], shared_mesh["name"]
    if how == "sigkill-container" and not settings["containerd_address"]:
        pytest.skip("needs IMESH_E2E_CONTAINERD_ADDRESS (the tests run on the node, e.g. tools/cluster/up.sh)")
    wait_settled(ns, name, settings["timeout"])
    k = ready_pipeline(ns, name)
    index = 1 if how == "delete-pod" else 0
    victim = stage_pod(ns, name, index, k)
    started = time.time()

    def disrupt() -> None:
        if how == "delete-pod":
            kubectl("delete", "pod", victim["metadata"]["name"], "-n", ns, "--wait=false")
        else:
            subprocess.run(["ctr", "--address", settings["containerd_address"], "-n", "k8s.io", "tasks", "kill",
                            "-s", "SIGKILL", container_id(victim)], check=True, capture_output=True, timeout=30)

    with port_forward(ns, *frontend_service(shared_mesh)) as base:
        client = openai_client(base)
        timed = time.monotonic()
        undisturbed = stream_completion(client)
        undisturbed_s = time.monotonic() - timed
        done = []

        def on_token(n: int) -> None:
            if n == 4 and not done:
                disrupt()
                done.append(time.monotonic())

        with ConditionWatcher(ns, name) as watch:
            try:
                disturbed = stream_completion(client, on_token)
            except openai.APIError as err:
                failed = err
            else:
                failed = None
            wait_for(lambda: is_ready(ns, name) and conditions(ns, name)["Degraded"]["status"] == "False",
                     settings["timeout"], "the mesh to be Ready and not Degraded again", 2)
        assert done, "the stream ended before the stage could be disrupted"
        if failed:  # say how long the stage was away, against the frontend's recovery window
            back = min((t for t, c in watch.history if t > done[0] and c.get("StagesReady") == "True"), default=None)
            away = f"{back - done[0]:.0f}s" if back else "longer than the test waited"
            raise AssertionError(f"the stream failed ({failed}); stage {index} was back after {away}") from failed
        assert disturbed == undisturbed
        # The frontend really carried the request over a lost stage (not a stream that finished first).
        logs = kubectl("logs", "-n", ns, frontend_pod(ns, name, k)["metadata"]["name"],
                       f"--since={int(time.time() - started) + 5}s")
        assert "recovered in" in logs, not_recovered(logs, undisturbed_s)
        assert ("Degraded", "True") in watch.seen, f"Degraded never showed: {watch.seen}"
        # A lost stage is no new revision: the same pipeline serves on.
        assert ready_pipeline(ns, name) == k
        # And the next request is served normally (once the router routes to the frontend again:
        # the frontend was unready while its stage was away).
        wait_router_replicas(base, 1)
        assert undisturbed.startswith(greedy(client, LONG_PROMPT, max_tokens=8))
    if how == "delete-pod":
        assert stage_pod(ns, name, index, k)["metadata"]["name"] != victim["metadata"]["name"]
    else:
        assert stage_pod(ns, name, index, k)["status"]["containerStatuses"][0]["restartCount"] >= 1


# ---- (6): more stages -----------------------------------------------------------------------------
# A re-plan is a new revision: a new pipeline (the lowest free index) starts beside the old one
# (spec.rollout.maxSurge 1, the default), and the old one drains once the new one is Ready. The
# shared mesh has CPU requests of 100m (mesh_doc(small=True)), so the surge fits the 2-core node.

def scale(ns: str, name: str, count: int) -> None:
    patch = json.dumps({"spec": {"stages": {"count": count}}})
    kubectl("patch", "inferencemesh", name, "-n", ns, "--type=merge", "-p", patch)


def stage_pods(ns: str, name: str) -> list[dict]:
    return running_pods(ns, f"inferencemesh.io/mesh={name},app.kubernetes.io/component=stage")


def pipeline_pod_names(ns: str, name: str, pipeline: int) -> set[str]:
    """Every pod (stages and frontend, terminating ones included) of one pipeline."""
    items = get_json("pods", "-n", ns, "-l", f"inferencemesh.io/mesh={name},{LABEL_PIPELINE}={pipeline}")["items"]
    return {p["metadata"]["name"] for p in items}


def owned_names(ns: str, kind: str, name: str) -> set[str]:
    return {o["metadata"]["name"] for o in get_json(kind, "-n", ns, "-l", f"inferencemesh.io/mesh={name}")["items"]}


@pytest.mark.timeout(1500)  # two re-plans, each a new pipeline loading beside the old one on 2 cores
def test_three_stages_replan_and_answer_the_same(settings: dict, shared_mesh: dict, reference: dict[str, str]) -> None:
    ns, name = shared_mesh["namespace"], shared_mesh["name"]
    wait_settled(ns, name, settings["timeout"])
    old = ready_pipeline(ns, name)
    before = pipeline_pod_names(ns, name, old)
    scale(ns, name, 3)
    try:
        # Settled: the new pipeline Ready, the old one drained and its pods gone.
        status = wait_settled(ns, name, settings["timeout"])["status"]
        (entry,) = status["pipelines"]
        new = entry["index"]
        assert new != old, f"a re-plan must start a new pipeline, still {old}: {status['pipelines']}"
        ranges = [(s["layerStart"], s["layerEnd"]) for s in status["stages"]]
        assert len(ranges) == 3 and ranges[0][0] == 0 and ranges[-1][1] == 8
        assert all(a[1] == b[0] for a, b in zip(ranges, ranges[1:], strict=False)), ranges
        assert status["stagesSummary"] == "3/3"
        assert not pipeline_pod_names(ns, name, old) and not before & pipeline_pod_names(ns, name, new)
        now = stage_pods(ns, name)
        assert len(now) == 3 and all(pod_ready(p) for p in now)
        assert {p["metadata"]["labels"][LABEL_PIPELINE] for p in now} == {str(new)}
        assert sorted(p["metadata"]["labels"]["inferencemesh.io/stage"] for p in now) == ["0", "1", "2"]
        deps = owned_names(ns, "deployments", name)
        assert {f"{prefix(name, new)}-stage-{i}" for i in range(3)} | {f"{prefix(name, new)}-frontend"} <= deps, deps
        assert not [d for d in deps if d.startswith(f"{prefix(name, old)}-")], deps
        assert frontends_all_on(ns, name, 3)
        with port_forward(ns, *frontend_service(shared_mesh)) as base:
            assert set(wait_router_replicas(base, 1)) == {f"{prefix(name, new)}-frontend"}
            client = openai_client(base)
            assert {prompt: greedy(client, prompt) for prompt in PROMPTS} == reference
    finally:
        scale(ns, name, 2)  # put the shared mesh back (one more new pipeline)
        wait_settled(ns, name, settings["timeout"])
    assert len(mesh(ns, name)["status"]["stages"]) == 2


def frontends_all_on(ns: str, name: str, stages: int) -> bool:
    """Every frontend pod, terminating ones included, is ready and names `stages` stages."""
    fronts = get_json("pods", "-n", ns, "-l", f"inferencemesh.io/mesh={name},app.kubernetes.io/component=frontend")
    def stages_of(pod: dict) -> int:
        args = pod["spec"]["containers"][0]["args"]
        remote = len(args[args.index("--stage-addresses") + 1].split(",")) if "--stage-addresses" in args else 0
        return remote + ("--first-stage-layers" in args)
    return bool(fronts["items"]) and all(pod_ready(p) and not p["metadata"].get("deletionTimestamp")
                                         and stages_of(p) == stages for p in fronts["items"])


@pytest.mark.timeout(1500)  # two re-plans (on and off), each a new pipeline
def test_an_embedded_first_stage_serves_the_same_without_a_stage_0_pod(
        settings: dict, shared_mesh: dict, reference: dict[str, str]) -> None:
    """spec.frontend.embedFirstStage: stage 0's layers move into the frontend pod. The new pipeline
    has no stage-0 Deployment or Service, its stage 1 takes the frontend's batches, the answers are
    those of `inferencemesh serve`, and stage 0's metrics come from the frontend's /metrics."""
    ns, name = shared_mesh["namespace"], shared_mesh["name"]
    wait_settled(ns, name, settings["timeout"])
    old = ready_pipeline(ns, name)
    patch = json.dumps({"spec": {"frontend": {"embedFirstStage": True}}})
    kubectl("patch", "inferencemesh", name, "-n", ns, "--type=merge", "-p", patch)
    try:
        status = wait_settled(ns, name, settings["timeout"])["status"]
        new = ready_pipeline(ns, name)
        assert new != old, f"embedding stage 0 is a new revision: a new pipeline, still {old}"
        p = prefix(name, new)
        assert [s.get("embedded", False) for s in status["stages"]] == [True, False]
        deps = owned_names(ns, "deployments", name)
        assert f"{p}-stage-0" not in deps and {f"{p}-stage-1", f"{p}-frontend"} <= deps, deps
        assert not [d for d in deps if d.startswith(f"{prefix(name, old)}-")], deps
        services = owned_names(ns, "services", name)
        assert f"{p}-stage-0" not in services and f"{p}-stage-1" in services, services
        assert not [s for s in services if s.startswith(f"{prefix(name, old)}-")], services
        assert [(q["metadata"]["labels"][LABEL_PIPELINE], q["metadata"]["labels"]["inferencemesh.io/stage"])
                for q in stage_pods(ns, name)] == [(str(new), "1")]
        front = frontend_pod(ns, name, new)
        assert pod_ready(front)
        args = front["spec"]["containers"][0]["args"]
        assert "--first-stage-layers" in args, args
        start, end = (int(x) for x in args[args.index("--first-stage-layers") + 1].split(":"))
        assert (start, end) == (status["stages"][0]["layerStart"], status["stages"][0]["layerEnd"])
        with port_forward(ns, *frontend_service(shared_mesh)) as base:
            wait_router_replicas(base, 1)
            client = openai_client(base)
            assert {prompt: greedy(client, prompt) for prompt in PROMPTS} == reference
        families = text_string_to_metric_families(frontend_metrics(ns, name, new))
        stages = {s.labels.get("stage") for f in families if f.name == "inferencemesh_stage_tokens"
                  for s in f.samples}
        assert stages == {"0"}
    finally:
        patch = json.dumps({"spec": {"frontend": {"embedFirstStage": False}}})
        kubectl("patch", "inferencemesh", name, "-n", ns, "--type=merge", "-p", patch)
        wait_settled(ns, name, settings["timeout"])
    assert f"{prefix(name, ready_pipeline(ns, name))}-stage-0" in owned_names(ns, "deployments", name)
