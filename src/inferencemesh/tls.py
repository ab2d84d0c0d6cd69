"""Mutual TLS between the frontend and the stages (and stage to stage), from a Secret-shaped directory.

The directory holds tls.crt, tls.key and ca.crt, the layout of a Kubernetes TLS Secret with
its CA, so a mounted Secret works as is. Servers require a client certificate signed by the
CA; clients present theirs and check the server's against the same CA.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import grpc


@dataclass(frozen=True)
class TlsMaterial:
    cert: bytes
    key: bytes
    ca: bytes

    @classmethod
    def from_dir(cls, directory: str | Path) -> TlsMaterial:
        d = Path(directory)
        missing = [n for n in ("tls.crt", "tls.key", "ca.crt") if not (d / n).exists()]
        if missing:
            raise FileNotFoundError(f"{d}: missing {', '.join(missing)} (expected a TLS Secret with ca.crt)")
        return cls((d / "tls.crt").read_bytes(), (d / "tls.key").read_bytes(), (d / "ca.crt").read_bytes())

    def server_credentials(self) -> grpc.ServerCredentials:
        return grpc.ssl_server_credentials([(self.key, self.cert)], root_certificates=self.ca,
                                           require_client_auth=True)

    def channel_credentials(self) -> grpc.ChannelCredentials:
        return grpc.ssl_channel_credentials(root_certificates=self.ca, private_key=self.key,
                                            certificate_chain=self.cert)


def load(directory: str | None) -> TlsMaterial | None:
    return TlsMaterial.from_dir(directory) if directory else None


def aio_channel(address: str, tls: TlsMaterial | None, options: list) -> grpc.aio.Channel:
    if tls is None:
        return grpc.aio.insecure_channel(address, options=options)
    return grpc.aio.secure_channel(address, tls.channel_credentials(), options=options)


def stage_peers(index: int, first_process: int, frontend: str, stage: Callable[[int], str]) -> tuple[str, ...]:
    """The certificate names that may call stage `index` (StageConfig.peers), whoever issues the
    certificates: the mesh's frontend (it feeds the first stage process and asks every stage's
    Info), and the stage process before this one. `stage(i)` names stage i's certificate."""
    return (frontend,) if index <= first_process else (frontend, stage(index - 1))
