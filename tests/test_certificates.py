"""certificates.py: a mesh's CA signs its leaves, and a gRPC server with one mesh's material lets in
that mesh's clients only."""

from __future__ import annotations

import asyncio
import datetime
from pathlib import Path

import grpc
import pytest
from cryptography import x509
from cryptography.x509.verification import PolicyBuilder, Store, VerificationError
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from inferencemesh import tls
from inferencemesh.certificates import expires_at, issue, make_ca, write_tls_dir

DAY = datetime.timedelta(days=1)


def _verify(leaf_pem: bytes, ca_pem: bytes, name: str) -> None:
    store = Store([x509.load_pem_x509_certificate(ca_pem)])
    verifier = PolicyBuilder().store(store).build_server_verifier(x509.DNSName(name))
    verifier.verify(x509.load_pem_x509_certificate(leaf_pem), [])


def test_leaf_verifies_against_its_ca_and_not_another() -> None:
    ca, other = make_ca("mesh-a", DAY), make_ca("mesh-b", DAY)
    leaf = issue(ca, "stage-0", ["stage-0", "stage-0.ns.svc"], DAY)
    assert leaf.ca == ca.cert
    _verify(leaf.cert, ca.cert, "stage-0.ns.svc")
    with pytest.raises(VerificationError):
        _verify(leaf.cert, other.cert, "stage-0.ns.svc")
    with pytest.raises(VerificationError):  # the SANs are the names it is good for
        _verify(leaf.cert, ca.cert, "stage-1")


def test_lifetimes_and_the_tls_dir(tmp_path: Path) -> None:
    now = datetime.datetime.now(datetime.UTC)
    ca = make_ca("mesh", 10 * DAY)
    assert abs(expires_at(ca.cert) - (now + 10 * DAY)) < datetime.timedelta(minutes=1)
    leaf = issue(ca, "frontend", ["frontend"], datetime.timedelta(hours=2))
    assert abs(expires_at(leaf.cert) - (now + datetime.timedelta(hours=2))) < datetime.timedelta(minutes=1)
    # a leaf never outlives the CA that signed it
    assert expires_at(issue(ca, "frontend", ["frontend"], 100 * DAY).cert) <= expires_at(ca.cert)
    with pytest.raises(ValueError):
        make_ca("mesh", datetime.timedelta(0))
    directory = write_tls_dir(tmp_path / "tls", leaf)
    assert tls.load(str(directory)) == leaf
    assert (directory / "tls.key").stat().st_mode & 0o077 == 0


async def _health_check(address: str, credentials: grpc.ChannelCredentials) -> int:
    # the leaves name "stage-0"; the client dials 127.0.0.1, so it asks TLS to check that name
    options = [("grpc.ssl_target_name_override", "stage-0")]
    async with grpc.aio.secure_channel(address, credentials, options=options) as channel:
        reply = await health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=5)
        return reply.status


def test_server_refuses_another_meshs_certificate() -> None:
    """A real grpc.aio server with mesh A's material, credentials made as the stage makes them
    (TlsMaterial.server_credentials: client certificates required)."""
    ca_a, ca_b = make_ca("mesh-a", DAY), make_ca("mesh-b", DAY)
    server_material = issue(ca_a, "stage-0", ["stage-0"], DAY)
    client_a = issue(ca_a, "frontend", ["frontend"], DAY)
    client_b = issue(ca_b, "frontend", ["frontend"], DAY)
    # mesh B's certificate, presented with mesh A's CA as the trust root (the attacker knows the CA)
    forged = tls.TlsMaterial(client_b.cert, client_b.key, ca_a.cert)

    async def go() -> None:
        server = grpc.aio.server()
        health_pb2_grpc.add_HealthServicer_to_server(health.aio.HealthServicer(), server)
        port = server.add_secure_port("127.0.0.1:0", server_material.server_credentials())
        await server.start()
        address = f"127.0.0.1:{port}"
        try:
            assert await _health_check(address, client_a.channel_credentials()) == \
                health_pb2.HealthCheckResponse.SERVING
            for refused in (forged.channel_credentials(), client_b.channel_credentials(),
                            grpc.ssl_channel_credentials(root_certificates=ca_a.cert)):  # no client certificate
                with pytest.raises(grpc.aio.AioRpcError) as failure:
                    await _health_check(address, refused)
                assert failure.value.code() == grpc.StatusCode.UNAVAILABLE
            async with grpc.aio.insecure_channel(address) as plaintext:
                with pytest.raises(grpc.aio.AioRpcError):
                    await health_pb2_grpc.HealthStub(plaintext).Check(health_pb2.HealthCheckRequest(), timeout=5)
        finally:
            await server.stop(None)

    asyncio.run(go())
