"""The model's greedy output under a grammar, written out without the serving code: each step,
transformers' logits of the whole sequence masked by the same llguidance grammar. What the
structured-output and tool-calling tests compare the served answers with."""

from __future__ import annotations

from typing import Any

import torch

from inferencemesh.frontend.engine.constraints import Constraint
from inferencemesh.frontend.engine.grammar import SessionGrammar, grammar_tokenizer
from inferencemesh.frontend.openai.jobs import END_OF_TURN_TOKENS
from inferencemesh.token_masks import apply_token_masks


def constrained_greedy(model: Any, tokenizer: Any, prompt_ids: list[int], constraint: Constraint,
                       max_tokens: int) -> str:
    """The text the model writes greedily after prompt_ids under constraint (EOS and end-of-turn end it)."""
    vocab = tokenizer.get_vocab()
    stops = sorted({tokenizer.eos_token_id, *(vocab[t] for t in END_OF_TURN_TOKENS if t in vocab)})
    grammar = SessionGrammar(constraint, grammar_tokenizer(tokenizer, len(tokenizer), stops))
    out: list[int] = []
    with torch.inference_mode():
        while len(out) < max_tokens:
            logits = model(torch.tensor([prompt_ids + out])).logits[0, -1:, : len(tokenizer)].float()
            masks, _ = grammar.window_masks([])
            token = int(apply_token_masks(logits, masks).argmax())
            if token in stops:
                break
            grammar.commit([token])
            out.append(token)
    return tokenizer.decode(out, skip_special_tokens=True)
