"""A draft proposal the grammar forbids, through the engine and a real stage: the frontend cuts the
verify window at the first forbidden draft (the stage never sees it), and the output is exactly
plain constrained decoding's."""

from __future__ import annotations

import json
from typing import Any

import jsonschema
import pytest
from mesh_helpers import generate
from transformers import AutoTokenizer

from inferencemesh.bundled import DEFAULT_MODEL, bundled_path
from inferencemesh.frontend.engine.grammar import ConstrainedOutput, grammar_tokenizer
from inferencemesh.frontend.engine.proposers.base import Proposal, Proposer
from inferencemesh.frontend.openai.jobs import END_OF_TURN_TOKENS
from inferencemesh.frontend.openai.structured_outputs import constraint_from_request
from inferencemesh.modeling.runtime import StageRuntime
from inferencemesh.programs.mesh import in_process_pipeline
from inferencemesh.token_masks import allowed_tokens, is_allowed


@pytest.fixture(scope="module")
def grammar_tokenizer_() -> tuple[Any, Any]:
    hf = AutoTokenizer.from_pretrained(bundled_path(DEFAULT_MODEL))
    vocab = hf.get_vocab()
    stops = sorted({hf.eos_token_id, *(vocab[t] for t in END_OF_TURN_TOKENS if t in vocab)})
    return hf, grammar_tokenizer(hf, len(hf), stops)


class ForbiddenDraftProposer(Proposer):
    """Proposes a window whose second draft the grammar forbids: an allowed token, a forbidden
    one, then two more. Records how many drafts each verify frame really carried."""

    def __init__(self) -> None:
        self.sent: list[int] = []

    def propose(self, history: list[int]) -> Proposal | None:
        grammar = self.grammar
        assert grammar is not None  # the engine hands a constrained choice's grammar to its proposer
        first = grammar.mask_after([])
        if first is None or grammar.is_finished:
            return None
        allowed = allowed_tokens(first[0])
        good = int(allowed.max())  # a long token, not whitespace
        if good in grammar.tokenizer.eos_token_ids:
            return None
        after = grammar.mask_after([good])
        assert after is not None
        bad = next(t for t in range(grammar.tokenizer.vocab_size) if not is_allowed(after[0], t))
        return Proposal([good, bad, good, good])

    def observe(self, proposed: int, accepted: int, propose_s: float, round_trip_s: float) -> None:
        self.sent.append(proposed)


def test_a_forbidden_draft_cuts_the_window_and_changes_nothing(grammar_tokenizer_: Any) -> None:
    """The proposer's second draft is always forbidden: every verify frame carries one draft (the
    window is cut there), and the output is the one plain constrained decoding gives."""
    hf, tok = grammar_tokenizer_
    schema = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 10},
                                               "port": {"type": "integer", "minimum": 1, "maximum": 999}},
              "required": ["name", "port"], "additionalProperties": False}
    constraint = constraint_from_request(guided_json=schema)
    assert constraint is not None
    runtime = StageRuntime(bundled_path(DEFAULT_MODEL), 0, 8, dtype="float32", max_context=256)
    prompt = hf("# the service\nconfig = ").input_ids
    proposers: list[ForbiddenDraftProposer] = []

    def run(proposer_for: Any) -> list[int]:
        return generate(in_process_pipeline([runtime]), prompt, 48, proposer_for=proposer_for, temperature=0.0,
                        constrained=ConstrainedOutput(constraint, tok),
                        stop_token_ids=frozenset(tok.eos_token_ids))

    plain = run(None)
    cut = run(lambda _request: proposers.append(ForbiddenDraftProposer()) or proposers[-1])
    assert cut == plain
    jsonschema.validate(json.loads(hf.decode(plain, skip_special_tokens=True)), schema)
    assert proposers and proposers[0].sent and set(proposers[0].sent) <= {0, 1} and 1 in proposers[0].sent
