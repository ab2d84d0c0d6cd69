"""Mutual TLS between the frontend and the stages: only holders of a CA-signed certificate get in."""

from __future__ import annotations

import datetime
import ipaddress
import urllib.request
from pathlib import Path

import grpc
import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID
from mesh_helpers import generate, hf_greedy, start_mesh
from tiny_models import write_tiny_model

from inferencemesh.frontend.engine.pipeline import GrpcPipeline
from inferencemesh.protocol import stage_pb2 as pb
from inferencemesh.protocol import stage_pb2_grpc as pb_grpc
from inferencemesh.protocol.health import check
from inferencemesh.tls import TlsMaterial

pytestmark = pytest.mark.slow


def _pem_key(key) -> bytes:
    return key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                             serialization.NoEncryption())


def _cert(subject: str, key, issuer_name: str, issuer_key, *, ca: bool) -> x509.Certificate:
    now = datetime.datetime.now(datetime.UTC)
    builder = (x509.CertificateBuilder()
               .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, subject)]))
               .issuer_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, issuer_name)]))
               .public_key(key.public_key()).serial_number(x509.random_serial_number())
               .not_valid_before(now - datetime.timedelta(minutes=5)).not_valid_after(now + datetime.timedelta(days=1))
               .add_extension(x509.BasicConstraints(ca=ca, path_length=None), critical=True))
    if not ca:
        builder = builder.add_extension(x509.SubjectAlternativeName(
            [x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]), critical=False)
    return builder.sign(issuer_key, hashes.SHA256())


def make_tls_dir(directory: Path, ca_name: str) -> Path:
    """A Secret-shaped directory: a fresh CA and one leaf certificate it signed."""
    directory.mkdir(parents=True)
    ca_key, leaf_key = ec.generate_private_key(ec.SECP256R1()), ec.generate_private_key(ec.SECP256R1())
    ca_cert = _cert(ca_name, ca_key, ca_name, ca_key, ca=True)
    leaf = _cert("inferencemesh", leaf_key, ca_name, ca_key, ca=False)
    (directory / "ca.crt").write_bytes(ca_cert.public_bytes(serialization.Encoding.PEM))
    (directory / "tls.crt").write_bytes(leaf.public_bytes(serialization.Encoding.PEM))
    (directory / "tls.key").write_bytes(_pem_key(leaf_key))
    return directory


def test_mesh_over_mutual_tls_and_refusal_without_a_valid_certificate(tmp_path: Path) -> None:
    model = write_tiny_model(tmp_path / "tiny", "llama", num_layers=2, shards=1)
    good = make_tls_dir(tmp_path / "good", "mesh-ca")
    rogue = make_tls_dir(tmp_path / "rogue", "other-ca")
    mesh = start_mesh(model, 2, tls_dir=str(good))
    try:
        prompt = [10, 20, 30, 40]
        tokens = generate(GrpcPipeline(mesh.addresses, tls=TlsMaterial.from_dir(good)), prompt, 8, temperature=0.0)
        assert tokens == hf_greedy(model, prompt, 8)  # stage-to-stage traffic is TLS too

        def info(channel: grpc.Channel) -> pb.StageInfo:
            return pb_grpc.StageStub(channel).Info(pb.InfoRequest(), timeout=5)

        with grpc.insecure_channel(mesh.addresses[0]) as plaintext, pytest.raises(grpc.RpcError):
            info(plaintext)
        material = TlsMaterial.from_dir(good)
        no_client_cert = grpc.ssl_channel_credentials(root_certificates=material.ca)
        with grpc.secure_channel(mesh.addresses[0], no_client_cert) as channel, pytest.raises(grpc.RpcError):
            info(channel)
        wrong_ca = TlsMaterial(TlsMaterial.from_dir(rogue).cert, TlsMaterial.from_dir(rogue).key, material.ca)
        with grpc.secure_channel(mesh.addresses[0], wrong_ca.channel_credentials()) as channel, \
                pytest.raises(grpc.RpcError):
            info(channel)
        with grpc.secure_channel(mesh.addresses[0], material.channel_credentials()) as channel:
            assert info(channel).is_first
        # grpc.health.v1 over mutual TLS, as serve's start-up wait and the frontend ask it
        assert check(mesh.addresses[1], tls=TlsMaterial.from_dir(good), server_name="localhost")
        assert not check(mesh.addresses[1])  # no certificate: not let in
    finally:
        mesh.stop()


def test_a_stage_serves_only_the_frontend_and_the_stage_before_it(tmp_path: Path) -> None:
    """Certificates as `serve` issues them (one CA, a leaf per process): every leaf is valid for
    the mesh, but stage 0 takes calls from the frontend only, stage 1 from the frontend and
    stage 0; any other process of the mesh (here stage 1 itself) is refused with PERMISSION_DENIED.
    Health stays open to every certificate of the mesh: it is what the probes ask."""
    from inferencemesh.checkpoint.read import read_local
    from inferencemesh.planner import PlanInputs, plan_stages
    from inferencemesh.programs.local_stages import LocalStages, stage_template
    from inferencemesh.programs.serve import run_certificates

    model = write_tiny_model(tmp_path / "tiny", "llama", num_layers=2, shards=1)
    plan = plan_stages(PlanInputs.from_checkpoint(read_local(model)), 2)
    with run_certificates(["stage-0", "stage-1", "frontend"]) as dirs:
        mesh = LocalStages(stage_template(str(model), max_context=256), plan, env={"OMP_NUM_THREADS": "1"},
                           tls_dirs={0: dirs["stage-0"], 1: dirs["stage-1"]})
        assert [c.peers for c in mesh.configs] == [("frontend",), ("frontend", "stage-0")]
        mesh.start()
        try:
            mesh.wait_ready(120)
            as_ = {name: TlsMaterial.from_dir(d) for name, d in dirs.items()}
            prompt = [10, 20, 30, 40]
            tokens = generate(GrpcPipeline(mesh.addresses, tls=as_["frontend"]), prompt, 8, temperature=0.0)
            assert tokens == hf_greedy(model, prompt, 8)  # stage 1 took stage 0's traffic

            def info(address: str, who: str) -> grpc.StatusCode:
                options = [("grpc.ssl_target_name_override", "localhost")]
                with grpc.secure_channel(address, as_[who].channel_credentials(), options) as channel:
                    try:
                        pb_grpc.StageStub(channel).Info(pb.InfoRequest(), timeout=5)
                    except grpc.RpcError as err:
                        assert err.code() != grpc.StatusCode.PERMISSION_DENIED or "may not call" in err.details()
                        return err.code()
                return grpc.StatusCode.OK

            stage0, stage1 = mesh.addresses
            assert info(stage0, "frontend") == grpc.StatusCode.OK
            assert info(stage1, "frontend") == grpc.StatusCode.OK
            assert info(stage1, "stage-0") == grpc.StatusCode.OK
            assert info(stage0, "stage-1") == grpc.StatusCode.PERMISSION_DENIED
            assert info(stage1, "stage-1") == grpc.StatusCode.PERMISSION_DENIED
            assert check(stage0, tls=as_["stage-1"], server_name="localhost")
            # The kubelet's probes: plain HTTP on each stage's metrics port, no certificate, no process.
            for http_port in mesh.metrics_ports:
                with urllib.request.urlopen(f"http://127.0.0.1:{http_port}/ready", timeout=10) as reply:
                    assert reply.status == 200 and reply.read() == b"SERVING\n"
        finally:
            mesh.stop()
