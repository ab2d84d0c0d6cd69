"""A mesh's own certificates across reconciles: read back from its Secrets, kept while they are
good, renewed before they expire. No API calls: reconcile.py reads the Secrets, calls settle(),
and render_mesh.py turns the result into Secrets again (an unchanged result renders unchanged Secrets,
so a reconcile with nothing due writes nothing).

Leaves (one per stage pod and one for the frontend) live `lifetime` and are renewed at two thirds
of it. The CA lives CA_LIFETIME_FACTOR times as long and is replaced in two steps, so that no
rollout ever meets a certificate its peers do not trust:

  1. at half its life a next CA is made and only trusted: every pod's ca.crt becomes
     [signing, next], the pods roll, and leaves are still signed by the old CA;
  2. a third of a leaf lifetime later (the rollout has long finished) the next CA becomes the signing
     one and every leaf is reissued; the old CA stays trusted until it expires, since pods not yet
     rolled still present leaves it signed.

A lifetime shortened in the spec counts as due at once: anything valid for longer than the policy
allows is replaced. A lengthened one starts step 1 at once, and step 2 comes a third of the old leaf
lifetime later: the old CA is as short-lived as the old policy, and every leaf it signs ends with it.
"""

from __future__ import annotations

import datetime
from dataclasses import dataclass, replace

from cryptography import x509
from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import serialization

from inferencemesh.certificates import CLOCK_SKEW, Authority, expires_at, issue, make_ca
from inferencemesh.tls import TlsMaterial

CA_LIFETIME_FACTOR = 4
RENEW_FRACTION = 2 / 3
# A certificate counts as longer-lived than the policy only beyond this: one issued a moment after
# `now` was read ends a little after now + lifetime.
SLACK = datetime.timedelta(minutes=1)
# The CA Secret's keys; a leaf's Secret holds tls.crt, tls.key and ca.crt (the trust bundle), as tls.load() reads.
CA_CERT, CA_KEY, PREVIOUS_CERT = "ca.crt", "ca.key", "previous-ca.crt"
NEXT_CERT, NEXT_KEY = "next-ca.crt", "next-ca.key"


@dataclass(frozen=True)
class CaState:
    """What the CA Secret holds: the signing CA, a next CA only trusted so far, a retired CA still trusted."""

    signing: Authority
    next: Authority | None = None
    previous: bytes | None = None

    def trust_bundle(self) -> bytes:
        """The CA certificates every pod trusts, signing CA first."""
        return b"".join(c for c in (self.signing.cert, self.next and self.next.cert, self.previous) if c)

    def to_data(self) -> dict[str, bytes]:
        data = {CA_CERT: self.signing.cert, CA_KEY: self.signing.key}
        if self.next:
            data |= {NEXT_CERT: self.next.cert, NEXT_KEY: self.next.key}
        if self.previous:
            data[PREVIOUS_CERT] = self.previous
        return data

    @classmethod
    def from_data(cls, data: dict[str, bytes], now: datetime.datetime) -> CaState | None:
        """The state a CA Secret holds; None when it holds no usable signing CA (missing, unreadable,
        expired), and the mesh starts over with a new one."""
        signing = _authority(data, CA_CERT, CA_KEY, now)
        if signing is None:
            return None
        previous = data.get(PREVIOUS_CERT)
        if previous is not None and _expiry(previous, now) <= now:
            previous = None  # nothing it signed can still be valid
        return cls(signing, _authority(data, NEXT_CERT, NEXT_KEY, now), previous)


@dataclass(frozen=True)
class MeshCertificates:
    ca: CaState
    leaves: dict[str, TlsMaterial]  # by component (the stage's or frontend's object name); .ca is the trust bundle
    renew_at: datetime.datetime  # the first moment something will be due: reconcile again then


def _expiry(pem: bytes, now: datetime.datetime) -> datetime.datetime:
    """A certificate's end of validity; `now` (so: expired) for one that cannot be read."""
    return _life(pem, now)[1]


def _life(pem: bytes, now: datetime.datetime) -> tuple[datetime.datetime, datetime.datetime]:
    """When a certificate was issued (its notBefore is backdated by CLOCK_SKEW) and when it ends;
    (now, now) for one that cannot be read."""
    try:
        cert = x509.load_pem_x509_certificate(pem)
    except ValueError:
        return now, now
    return cert.not_valid_before_utc + CLOCK_SKEW, cert.not_valid_after_utc


def _authority(data: dict[str, bytes], cert_key: str, key_key: str, now: datetime.datetime) -> Authority | None:
    cert, key = data.get(cert_key), data.get(key_key)
    if not cert or not key or _expiry(cert, now) <= now or not _key_matches(cert, key):
        return None
    return Authority(cert, key)


def _key_matches(cert_pem: bytes, key_pem: bytes) -> bool:
    try:
        cert = x509.load_pem_x509_certificate(cert_pem)
        key = serialization.load_pem_private_key(key_pem, password=None)
    except ValueError:
        return False
    return cert.public_key() == key.public_key()


def renewal_time(cert_pem: bytes, lifetime: datetime.timedelta, now: datetime.datetime) -> datetime.datetime:
    """When a certificate meant to live `lifetime` is renewed: at two thirds of its life, or now if
    it is valid for longer than `lifetime` (the policy was shortened since it was issued). Its own
    life, not `lifetime`: a leaf its CA's end cut short is not due at once (it would be reissued,
    and its pods rolled, at every reconcile until that CA is replaced)."""
    issued, end = _life(cert_pem, now)
    if end - now > lifetime + SLACK:
        return now
    return issued + (end - issued) * RENEW_FRACTION


def _leaf_usable(material: TlsMaterial | None, ca: Authority, dns_names: list[str], lifetime: datetime.timedelta,
                 now: datetime.datetime) -> bool:
    """Signed by the signing CA, for exactly these names, with its own key, and not due."""
    if material is None or not _key_matches(material.cert, material.key):
        return False
    cert = x509.load_pem_x509_certificate(material.cert)
    try:
        cert.verify_directly_issued_by(x509.load_pem_x509_certificate(ca.cert))
        names = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    except (ValueError, TypeError, InvalidSignature, x509.ExtensionNotFound):
        return False
    return (sorted(names.get_values_for_type(x509.DNSName)) == sorted(dns_names)
            and renewal_time(material.cert, lifetime, now) > now)


def _ca_step(ca: CaState | None, ca_name: str, lifetime: datetime.timedelta,
             now: datetime.datetime) -> tuple[CaState, datetime.datetime]:
    """The CA state after this reconcile, and when it next has to move."""
    ca_lifetime = lifetime * CA_LIFETIME_FACTOR
    if ca is None:
        ca = CaState(make_ca(ca_name, ca_lifetime))
    if ca.next is not None:
        # step 2, once the pods have had a third of a leaf lifetime to roll onto the bundle with the next
        # CA: of the policy the signing CA was made under, if that was shorter (the CA's end cuts every
        # leaf it signs short, so a lengthened policy waits no longer than the old one would have)
        made = _life(ca.next.cert, now)[0]
        issued, end = _life(ca.signing.cert, now)
        leaf_lifetime = min(lifetime, (end - issued) / CA_LIFETIME_FACTOR)
        promote_at = made + leaf_lifetime * (1 - RENEW_FRACTION)
        if now < promote_at:
            return ca, promote_at
        ca = CaState(ca.next, previous=ca.signing.cert)
    # step 1 at half the CA's life (or at once for a CA valid longer than the policy now allows)
    end = expires_at(ca.signing.cert)
    step_at = now if end - now > ca_lifetime + SLACK else end - ca_lifetime / 2
    if now < step_at:
        return ca, step_at
    ca = replace(ca, next=make_ca(ca_name, ca_lifetime))
    return _ca_step(ca, ca_name, lifetime, now)


def settle(ca_data: dict[str, bytes] | None, leaf_data: dict[str, dict[str, bytes]], subjects: dict[str, list[str]],
           ca_name: str, lifetime: datetime.timedelta, now: datetime.datetime | None = None) -> MeshCertificates:
    """The mesh's certificates for this reconcile, from what its Secrets hold (ca_data: the CA
    Secret's data, None if absent; leaf_data: each component's Secret data) and the components it
    needs now (subjects: component -> the DNS names its certificate carries). Keeps what is good,
    issues what is missing, wrong or due."""
    now = now or datetime.datetime.now(datetime.UTC)
    ca, ca_moves_at = _ca_step(CaState.from_data(ca_data, now) if ca_data else None, ca_name, lifetime, now)
    bundle = ca.trust_bundle()
    leaves: dict[str, TlsMaterial] = {}
    renew_at = [ca_moves_at]
    for component, dns_names in sorted(subjects.items()):
        data = leaf_data.get(component) or {}
        have = TlsMaterial(data["tls.crt"], data["tls.key"], bundle) if "tls.crt" in data and "tls.key" in data \
            else None
        if have is None or not _leaf_usable(have, ca.signing, dns_names, lifetime, now):
            have = replace(issue(ca.signing, component, dns_names, lifetime), ca=bundle)
        leaves[component] = have
        renew_at.append(renewal_time(have.cert, lifetime, now))
    return MeshCertificates(ca, leaves, min(renew_at))
