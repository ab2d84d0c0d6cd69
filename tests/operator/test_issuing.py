"""issuing.settle: a mesh's certificates kept while good, renewed when due, its CA replaced in two steps.
Real certificates and real time (lifetimes of seconds: settle takes any lifetime, the CRD at least 60s)."""

from __future__ import annotations

import datetime
import time
from dataclasses import replace

from cryptography import x509
from cryptography.exceptions import InvalidSignature

from inferencemesh.certificates import expires_at, issue, make_ca
from inferencemesh.operator.issuing import CA_LIFETIME_FACTOR, MeshCertificates, settle

SUBJECTS = {"m-stage-0": ["m-stage-0", "m-stage-0.ns.svc"], "m-frontend": ["m-frontend", "m-frontend.ns.svc"]}
DAY = datetime.timedelta(days=1)


def leaf_data(certs: MeshCertificates) -> dict[str, dict[str, bytes]]:
    """What the leaves' Secrets hold after a reconcile wrote them."""
    return {c: {"tls.crt": m.cert, "tls.key": m.key, "ca.crt": m.ca} for c, m in certs.leaves.items()}


def again(certs: MeshCertificates, lifetime: datetime.timedelta, subjects: dict | None = None) -> MeshCertificates:
    """The next reconcile, reading back what the previous one wrote."""
    return settle(certs.ca.to_data(), leaf_data(certs), subjects or SUBJECTS, "inferencemesh m", lifetime)


def signed_by(leaf: bytes, ca: bytes) -> bool:
    try:
        x509.load_pem_x509_certificate(leaf).verify_directly_issued_by(x509.load_pem_x509_certificate(ca))
    except (ValueError, InvalidSignature):
        return False
    return True


def sleep_until(moment: datetime.datetime) -> None:
    time.sleep(max(0.0, (moment - datetime.datetime.now(datetime.UTC)).total_seconds()) + 0.05)


def test_first_reconcile_issues_and_the_next_keeps_them() -> None:
    now = datetime.datetime.now(datetime.UTC)
    first = settle(None, {}, SUBJECTS, "inferencemesh m", DAY)
    assert sorted(first.leaves) == sorted(SUBJECTS) and first.ca.next is None and first.ca.previous is None
    for leaf in first.leaves.values():
        assert signed_by(leaf.cert, first.ca.signing.cert) and leaf.ca == first.ca.signing.cert
    assert abs(expires_at(first.ca.signing.cert) - (now + CA_LIFETIME_FACTOR * DAY)) < datetime.timedelta(minutes=1)
    assert abs(first.renew_at - (now + DAY * 2 / 3)) < datetime.timedelta(minutes=1)
    assert again(first, DAY) == first  # nothing due: the same material, so the same Secrets (no write)


def test_wrong_or_broken_leaves_are_reissued_and_good_ones_kept() -> None:
    first = settle(None, {}, SUBJECTS, "inferencemesh m", DAY)
    data = leaf_data(first)
    data["m-frontend"]["tls.key"] = b"not a key"
    moved = settle(first.ca.to_data(), data, {**SUBJECTS, "m-stage-0": ["m-stage-0", "elsewhere"]},
                   "inferencemesh m", DAY)
    assert moved.ca == first.ca
    assert moved.leaves["m-frontend"] != first.leaves["m-frontend"]
    assert moved.leaves["m-stage-0"] != first.leaves["m-stage-0"]  # its names changed
    # a leaf another CA signed (e.g. a Secret copied from another mesh) is not kept
    foreign = issue(make_ca("other", DAY), "m-frontend", SUBJECTS["m-frontend"], DAY)
    data = {**leaf_data(first), "m-frontend": {"tls.crt": foreign.cert, "tls.key": foreign.key}}
    assert settle(first.ca.to_data(), data, SUBJECTS, "inferencemesh m", DAY).leaves["m-frontend"].cert != foreign.cert
    # a stage that went away loses its certificate
    assert sorted(again(first, DAY, {"m-frontend": SUBJECTS["m-frontend"]}).leaves) == ["m-frontend"]


def test_a_shortened_lifetime_renews_at_once() -> None:
    first = settle(None, {}, SUBJECTS, "inferencemesh m", DAY)
    short = datetime.timedelta(minutes=5)
    renewed = again(first, short)
    now = datetime.datetime.now(datetime.UTC)
    for component, leaf in renewed.leaves.items():
        assert leaf.cert != first.leaves[component].cert
        assert expires_at(leaf.cert) - now <= short
    # the CA outlives the policy too: its replacement starts (trusted first, signing later)
    assert renewed.ca.signing == first.ca.signing and renewed.ca.next is not None
    assert renewed.renew_at - now <= short / 3


def test_leaves_renew_at_two_thirds_and_the_ca_rolls_over_in_two_steps() -> None:
    lifetime = datetime.timedelta(seconds=3)
    certs = settle(None, {}, SUBJECTS, "inferencemesh m", lifetime)
    old_ca = certs.ca.signing
    # leaves: renewed at 2/3 of their life, by the same CA
    sleep_until(certs.renew_at)
    renewed = again(certs, lifetime)
    assert renewed.ca == certs.ca
    assert all(renewed.leaves[c].cert != certs.leaves[c].cert for c in SUBJECTS)
    # CA step 1 (at half its life): a next CA, trusted by every pod, not yet signing
    certs = renewed
    while certs.ca.next is None:
        sleep_until(certs.renew_at)
        certs = again(certs, lifetime)
    assert certs.ca.signing == old_ca
    assert certs.ca.trust_bundle() == old_ca.cert + certs.ca.next.cert
    assert all(m.ca == certs.ca.trust_bundle() and signed_by(m.cert, old_ca.cert) for m in certs.leaves.values())
    # step 2: the next CA signs, every leaf is reissued by it, the old one is still trusted
    new_ca = certs.ca.next
    while certs.ca.signing != new_ca:
        sleep_until(certs.renew_at)
        certs = again(certs, lifetime)
    assert certs.ca.next is None and certs.ca.previous == old_ca.cert
    assert certs.ca.trust_bundle() == new_ca.cert + old_ca.cert
    assert all(signed_by(m.cert, new_ca.cert) for m in certs.leaves.values())


def test_a_lengthened_lifetime_moves_to_a_long_lived_ca_within_a_third_of_the_old_leaf_lifetime() -> None:
    """Back from a short lifetime: the old CA is as short-lived as the old policy and cuts every leaf
    it signs short, so the next CA signs a third of the old leaf lifetime later (not of the new one,
    days away), and the cut-short leaves are kept meanwhile (not reissued, and their pods rolled,
    at every reconcile)."""
    short = datetime.timedelta(seconds=3)
    certs = settle(None, {}, SUBJECTS, "inferencemesh m", short)
    lengthened = again(certs, DAY)
    now = datetime.datetime.now(datetime.UTC)
    assert lengthened.ca.signing == certs.ca.signing and lengthened.ca.next is not None
    assert lengthened.leaves == {c: replace(m, ca=lengthened.ca.trust_bundle()) for c, m in certs.leaves.items()}
    assert lengthened.renew_at - now <= short / 3
    assert again(lengthened, DAY) == lengthened  # nothing due until then: nothing rewritten
    sleep_until(lengthened.renew_at)
    moved = again(lengthened, DAY)
    assert moved.ca.signing == lengthened.ca.next and moved.ca.previous == certs.ca.signing.cert
    now = datetime.datetime.now(datetime.UTC)
    for leaf in moved.leaves.values():
        assert signed_by(leaf.cert, moved.ca.signing.cert)
        assert abs(expires_at(leaf.cert) - (now + DAY)) < datetime.timedelta(minutes=1)
