"""The stage server's own contract: lifecycle, health, capacity, metrics, the plan command."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import time

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from tiny_models import write_tiny_model
from wire import RawStream, failures

from inferencemesh.config import StageConfig
from inferencemesh.modeling.runtime import StageRuntime
from inferencemesh.programs.process import free_port
from inferencemesh.protocol import stage_pb2 as pb
from inferencemesh.protocol import stage_pb2_grpc as pb_grpc
from inferencemesh.stage.server import start_stage_server


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return write_tiny_model(tmp_path_factory.mktemp("tiny") / "llama", "llama", num_layers=2, shards=1)


def test_full_stage_answers_resource_exhausted_and_keeps_serving(tiny) -> None:
    async def go() -> None:
        options = StageConfig(model=str(tiny), layers=(0, 2), stage_index=0, num_stages=1,
                               host="127.0.0.1", port=0, max_sessions=2, max_context=64)
        server, service, port = await start_stage_server(options, runtime=StageRuntime(tiny, 0, 2, max_context=64))
        try:
            async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
                stub = pb_grpc.StageStub(channel)
                stream = RawStream(stub)
                opened = await stream.exchange(*(pb.Frame(session_id=f"s{i}", kind=pb.PREFILL, pos_start=0,
                                                          token_count=1, token_ids=[5], seq=1, kv_blocks=[i])
                                                 for i in range(2)))
                assert not opened.failures and (await stub.Info(pb.InfoRequest())).active_sessions == 2
                third = await stream.exchange(pb.Frame(session_id="s3", kind=pb.PREFILL, pos_start=0, token_count=1,
                                                       token_ids=[5], want_prediction=True, seq=1, kv_blocks=[2]))
                (code, message), = failures(third)
                assert code == grpc.StatusCode.RESOURCE_EXHAUSTED and "maximum of 2 sessions" in message
                # the stream and the sessions it holds still work
                going_on = await stream.exchange(pb.Frame(session_id="s0", kind=pb.DECODE, pos_start=1, token_count=1,
                                                          token_ids=[6], seq=2, kv_blocks=[0]))
                assert not going_on.failures and [(p.seq, len(p.tokens)) for p in going_on.predictions] == [(2, 1)]
                await stream.close()
        finally:
            await server.stop(0)
            await service.close()

    asyncio.run(go())


def test_lifecycle_and_health_of_a_stage_process(tiny, tmp_path) -> None:
    """A good stage goes NOT_SERVING -> SERVING; one whose model cannot be loaded exits (1) at once
    with its reason in one line (what `serve` and a pod's termination message show), instead of
    staying up unready until someone looks."""
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "config.json").write_text(json.dumps({"model_type": "llama", "num_hidden_layers": 2}))
    (broken / "pytorch_model.bin").write_bytes(b"not a pickle we would ever open")
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    procs = {}
    for name, model in (("good", tiny), ("broken", broken)):
        port = free_port()
        argv = [sys.executable, "-m", "inferencemesh", "stage", "--model", str(model), "--layers", "0:2",
                "--stage-index", "0", "--num-stages", "1", "--host", "127.0.0.1", "--port", str(port),
                "--metrics-port", "0"]
        log = open(tmp_path / f"{name}.log", "w")  # a file, not a pipe nobody drains
        procs[name] = (subprocess.Popen(argv, env=env, stdout=log, stderr=subprocess.STDOUT), port)
    try:
        states = {}
        deadline = time.monotonic() + 90
        while time.monotonic() < deadline and len(states) < 2:
            for name, (proc, port) in procs.items():
                if name == "broken" and proc.poll() is not None:
                    states[name] = (proc.returncode, (tmp_path / f"{name}.log").read_text())
                    continue
                assert proc.poll() is None, f"{name} stage exited: {(tmp_path / f'{name}.log').read_text()[-2000:]}"
                with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
                    try:
                        info = pb_grpc.StageStub(channel).Info(pb.InfoRequest(), timeout=2)
                        health = health_pb2_grpc.HealthStub(channel).Check(
                            health_pb2.HealthCheckRequest(service="inferencemesh.v1.Stage"), timeout=2)
                    except grpc.RpcError:
                        continue
                if info.state == "ready":
                    states[name] = (info, health.status)
            time.sleep(0.3)
        good, good_health = states["good"]
        assert good.state == "ready" and good_health == health_pb2.HealthCheckResponse.SERVING
        assert (good.layer_start, good.layer_end, good.is_first, good.is_last) == (0, 2, True, True)
        code, log = states["broken"]
        errors = [line for line in log.splitlines() if "error:" in line]
        assert code == 1 and "Traceback" not in log, log
        assert len(errors) == 1 and "stage 0 cannot load layers 0:2" in errors[0] and "safetensors" in errors[0], log
    finally:
        for proc, _ in procs.values():
            proc.terminate()
            try:
                proc.wait(60)
            except subprocess.TimeoutExpired:
                proc.kill()
                raise


def test_plan_command_prints_json_ranges(tiny) -> None:
    out = subprocess.run([sys.executable, "-m", "inferencemesh", "plan", "--model", str(tiny), "--stages", "2",
                          "--json"], capture_output=True, text=True, check=True).stdout
    stages = json.loads(out)["stages"]
    assert [(s["layer_start"], s["layer_end"]) for s in stages] == [(0, 1), (1, 2)]
    failed = subprocess.run([sys.executable, "-m", "inferencemesh", "plan", "--model", str(tiny), "--stages", "3"],
                            capture_output=True, text=True)
    assert failed.returncode == 2 and "only 2 layers" in failed.stderr
