"""A sampled VERIFY frame's draft distributions on the wire (Frame.draft_q): what the draft sends
decodes at the last stage to the very rows it drew from, a hostile row fails its frame with a
message, and a window costs kilobytes a hop where the dense rows cost megabytes."""

from __future__ import annotations

import grpc
import numpy as np
import pytest
import torch

from inferencemesh.protocol import codec
from inferencemesh.protocol import stage_pb2 as pb
from inferencemesh.protocol.errors import Fault
from inferencemesh.protocol.transport import DRAFT_TOKEN_BYTES, MAX_DRAFT_TOKENS
from inferencemesh.sampling import DraftRow, SamplingParams, draft_row, probabilities
from inferencemesh.stage.decide import decide
from inferencemesh.stage.sessions import StageSession

QWEN_VOCAB = 151_936


def rows_of(vocab: int, k: int, temperature: float, seed: int = 0) -> list[DraftRow]:
    logits = torch.randn(k, vocab, generator=torch.Generator().manual_seed(seed)) * 4
    return [draft_row(q) for q in probabilities(logits, SamplingParams(temperature=temperature))]


def through_the_wire(rows: list[DraftRow], vocab: int) -> list[DraftRow]:
    frame = pb.Frame(kind=pb.VERIFY, draft_q=codec.encode_draft_q(rows))
    return codec.decode_draft_q(pb.Frame.FromString(frame.SerializeToString()).draft_q, len(rows), vocab)


@pytest.mark.parametrize(("vocab", "temperature"), [(4096, 0.8), (4096, 0.05), (QWEN_VOCAB, 1.0)])
def test_the_rows_the_draft_sends_are_the_rows_the_last_stage_reads(vocab: int, temperature: float) -> None:
    sent = rows_of(vocab, 5, temperature)
    for before, after in zip(sent, through_the_wire(sent, vocab), strict=True):
        assert torch.equal(before.ids, after.ids) and torch.equal(before.probs, after.probs)
        assert before.remainder == after.remainder and after.vocab == vocab
        assert 0 < after.ids.numel() <= MAX_DRAFT_TOKENS
        assert abs(float(after.probs.double().sum()) + after.remainder - 1.0) < 1e-5
    if temperature < 0.1:  # a peaked q: a few tokens hold all but DRAFT_TAIL_MASS, and only they are listed
        assert all(row.ids.numel() < 16 for row in sent)


def test_a_window_costs_kilobytes_a_hop_at_a_qwen_vocabulary() -> None:
    """Five drafts of a flat q (the most a row lists): within the bound message_limit counts, and under
    a seventieth of the dense rows' 3 MB."""
    rows = rows_of(QWEN_VOCAB, 5, 100.0)
    assert all(row.ids.numel() == MAX_DRAFT_TOKENS for row in rows)
    size = codec.encode_draft_q(rows).ByteSize()
    assert size <= 5 * (MAX_DRAFT_TOKENS * DRAFT_TOKEN_BYTES + 16)
    assert size * 70 < 5 * QWEN_VOCAB * 4


def good() -> dict:
    return {"sizes": [2, 1], "token_ids": [3, 9, 4], "probs": [0.5, 0.25, 1.0], "remainders": [0.25, 0.0]}


def message(sizes: list[int], token_ids: list[int] | bytes, probs: list[float],
            remainders: list[float]) -> pb.DraftDistributions:
    """Frame.draft_q from lists, packed as the wire has them (bytes: as they are)."""
    ids = token_ids if isinstance(token_ids, bytes) else np.array(token_ids, "<i4").tobytes()
    return pb.DraftDistributions(sizes=sizes, remainders=remainders, token_ids=ids,
                                 probs=np.array(probs, "<f4").tobytes())


HOSTILE = {
    "fewer rows than drafts": {"sizes": [3], "token_ids": [3, 9, 4], "probs": [0.5, 0.25, 0.25]},
    "an empty row": {"sizes": [3, 0], "token_ids": [3, 9, 4], "probs": [0.5, 0.25, 0.25]},
    "a row past the limit": {"sizes": [1, MAX_DRAFT_TOKENS + 1]},
    "sizes past the ids": {"sizes": [2, 2]},
    "a probability too few": {"probs": [0.5, 0.25]},
    "ids of ragged bytes": {"token_ids": bytes(11)},
    "a negative id": {"token_ids": [3, -9, 4]},
    "an id past the vocabulary": {"token_ids": [3, 16, 4]},
    "an id twice": {"token_ids": [3, 3, 4]},
    "a NaN": {"probs": [0.5, float("nan"), 1.0]},
    "a negative probability": {"probs": [1.0, -0.25, 1.0]},
    "an infinite remainder": {"remainders": [float("inf"), 0.0]},
    "a row that is no distribution": {"probs": [0.5, 0.5, 1.0]},
    "a remainder with nothing to spread on": {"sizes": [2, 16], "token_ids": [3, 9, *range(16)],
                                              "probs": [0.5, 0.25, *[0.05] * 16], "remainders": [0.25, 0.2]},
}


@pytest.mark.parametrize("change", HOSTILE.values(), ids=HOSTILE.keys())
def test_a_hostile_row_is_refused(change: dict) -> None:
    with pytest.raises(codec.PayloadError, match="draft_q"):
        codec.decode_draft_q(message(**{**good(), **change}), 2, 16)


def test_the_good_rows_decode() -> None:
    first, second = codec.decode_draft_q(message(**good()), 2, 16)
    assert first.prob(9) == 0.25 and first.prob(0) == 0.25 / 14 and second.prob(4) == 1.0 and second.prob(3) == 0.0


def test_the_last_stage_fails_a_hostile_frame_with_its_reason() -> None:
    session = StageSession("s", sampling=SamplingParams(temperature=1.0, seed=1))
    frame = pb.Frame(session_id="s", kind=pb.VERIFY, pos_start=3, token_count=3, token_ids=[0, 3, 4],
                     draft_q=message(**{**good(), "token_ids": [3, 3, 4]}))
    with pytest.raises(Fault) as caught:
        decide(session, frame, torch.zeros(3, 16), 16)
    assert caught.value.code == grpc.StatusCode.INVALID_ARGUMENT and "twice" in str(caught.value)
    frame.draft_q.CopyFrom(message(**good()))
    assert len(decide(session, frame, torch.zeros(3, 16), 16).tokens) >= 1
