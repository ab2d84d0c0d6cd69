"""Certificates for mutual TLS between the frontend and the stages: a private CA per mesh (or per
`serve` run) and the leaf certificates it signs, as PEM, written in the directory layout tls.load() reads.

Keys are EC P-256: small, fast to make (the operator issues one per stage and per frontend) and
accepted by every gRPC TLS stack. A leaf is good for both ends of a connection (server and client
authentication), since a stage serves its upstream and is a client of the next stage.
"""

from __future__ import annotations

import datetime
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from inferencemesh.tls import TlsMaterial

# Certificates start this long before they are made, so a peer whose clock is a little behind
# still accepts them. The lifetime is counted from now, not from this earlier start.
CLOCK_SKEW = datetime.timedelta(minutes=5)


@dataclass(frozen=True)
class Authority:
    """A CA: its certificate and private key, both PEM."""

    cert: bytes
    key: bytes


def _now() -> datetime.datetime:
    return datetime.datetime.now(datetime.UTC)


def _name(common_name: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common_name)])


def _pem_key(key: ec.EllipticCurvePrivateKey) -> bytes:
    return key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                             serialization.NoEncryption())


def _builder(subject: str, issuer: x509.Name, public_key: ec.EllipticCurvePublicKey,
             lifetime: datetime.timedelta) -> x509.CertificateBuilder:
    if lifetime <= datetime.timedelta(0):
        raise ValueError(f"certificate lifetime must be positive, got {lifetime}")
    now = _now()
    return (x509.CertificateBuilder().subject_name(_name(subject)).issuer_name(issuer)
            .public_key(public_key).serial_number(x509.random_serial_number())
            .not_valid_before(now - CLOCK_SKEW).not_valid_after(now + lifetime))


def make_ca(common_name: str, lifetime: datetime.timedelta) -> Authority:
    """A self-signed CA that may sign leaf certificates only (no intermediate CAs)."""
    key = ec.generate_private_key(ec.SECP256R1())
    cert = (_builder(common_name, _name(common_name), key.public_key(), lifetime)
            .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
            .add_extension(x509.KeyUsage(digital_signature=False, content_commitment=False, key_encipherment=False,
                                         data_encipherment=False, key_agreement=False, key_cert_sign=True,
                                         crl_sign=True, encipher_only=False, decipher_only=False), critical=True)
            .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), critical=False)
            .sign(key, hashes.SHA256()))
    return Authority(cert.public_bytes(serialization.Encoding.PEM), _pem_key(key))


def issue(ca: Authority, common_name: str, dns_names: list[str], lifetime: datetime.timedelta) -> TlsMaterial:
    """A leaf certificate for `common_name` with `dns_names` as its subject alternative names, usable
    as a TLS server and as a TLS client. It never outlives its CA. Its `ca` field is the CA's
    certificate; a caller that trusts several CAs (during a CA rotation) replaces it."""
    if not dns_names:
        raise ValueError("a leaf certificate needs at least one DNS name (TLS checks the server's name)")
    ca_cert = x509.load_pem_x509_certificate(ca.cert)
    ca_key = serialization.load_pem_private_key(ca.key, password=None)
    if not isinstance(ca_key, ec.EllipticCurvePrivateKey):
        raise ValueError("the CA key is not an EC key")
    key = ec.generate_private_key(ec.SECP256R1())
    lifetime = min(lifetime, ca_cert.not_valid_after_utc - _now())
    cert = (_builder(common_name, ca_cert.subject, key.public_key(), lifetime)
            .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
            .add_extension(x509.KeyUsage(digital_signature=True, content_commitment=False, key_encipherment=False,
                                         data_encipherment=False, key_agreement=False, key_cert_sign=False,
                                         crl_sign=False, encipher_only=False, decipher_only=False), critical=True)
            .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH]),
                           critical=False)
            .add_extension(x509.SubjectAlternativeName([x509.DNSName(n) for n in dns_names]), critical=False)
            .add_extension(x509.AuthorityKeyIdentifier.from_issuer_public_key(ca_key.public_key()), critical=False)
            .sign(ca_key, hashes.SHA256()))
    return TlsMaterial(cert.public_bytes(serialization.Encoding.PEM), _pem_key(key), ca.cert)


def write_tls_dir(directory: str | Path, material: TlsMaterial) -> Path:
    """tls.crt, tls.key and ca.crt in `directory` (made if absent), the layout tls.load() reads;
    the key is readable by its owner only."""
    d = Path(directory)
    d.mkdir(parents=True, exist_ok=True)
    (d / "tls.crt").write_bytes(material.cert)
    (d / "ca.crt").write_bytes(material.ca)
    key = d / "tls.key"
    key.touch(mode=0o600)
    key.chmod(0o600)
    key.write_bytes(material.key)
    return d


def expires_at(cert_pem: bytes) -> datetime.datetime:
    """When the (first) certificate in `cert_pem` stops being valid, in UTC."""
    return x509.load_pem_x509_certificate(cert_pem).not_valid_after_utc
