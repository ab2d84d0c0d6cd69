"""Sampling parameters on the wire: the frontend writes and the last stage reads them here,
so a field added to SamplingParams cannot be sent by one side and dropped by the other."""

from __future__ import annotations

import math

from inferencemesh.protocol import stage_pb2 as pb
from inferencemesh.sampling import MIN_REPETITION_PENALTY, SamplingParams


def to_wire(params: SamplingParams, logprobs: int | None = None) -> pb.Sampling:
    """logprobs: None for none, else how many top alternatives come with each token's logprob."""
    return pb.Sampling(
        temperature=params.temperature, top_p=params.top_p, top_k=params.top_k, seed=params.seed,
        presence_penalty=params.presence_penalty, frequency_penalty=params.frequency_penalty,
        repetition_penalty=params.repetition_penalty, logit_bias=dict(params.logit_bias),
        min_tokens=params.min_tokens, stop_token_ids=params.stop_token_ids, prompt_tokens=params.prompt_tokens,
        logprobs=logprobs is not None, top_logprobs=logprobs or 0,
    )


def from_wire(s: pb.Sampling) -> tuple[SamplingParams, int | None]:
    """(parameters, logprobs as in to_wire)."""
    params = SamplingParams(
        temperature=s.temperature, top_p=s.top_p, top_k=s.top_k, seed=s.seed,
        presence_penalty=s.presence_penalty, frequency_penalty=s.frequency_penalty,
        repetition_penalty=s.repetition_penalty or 1.0, logit_bias=tuple(sorted(s.logit_bias.items())),
        min_tokens=s.min_tokens, stop_token_ids=tuple(s.stop_token_ids), prompt_tokens=s.prompt_tokens,
    )
    return params, (s.top_logprobs if s.logprobs else None)


# What a stage accepts, whoever sends it: wider than the OpenAI API's ranges (the frontend checks
# those), narrow enough that no value can make the sampling kernels meet inf or NaN. A temperature
# under sampling.GREEDY_BELOW means greedy and divides nothing; a repetition penalty divides the
# logits, so it stays off (0 or 1) or far from the denormals; every id indexes the vocabulary.
MAX_TEMPERATURE = 100.0
MAX_PENALTY = 100.0  # presence and frequency, either sign; repetition at most this
MAX_LOGIT_BIAS = 1e4
MAX_TOP_LOGPROBS = 100


def refusal(s: pb.Sampling, vocab_size: int) -> str | None:
    """Why a stage refuses these sampling parameters (a message naming the field), or None."""
    def bounded(name: str, value: float, low: float, high: float) -> str | None:
        if not math.isfinite(value) or not low <= value <= high:
            return f"sampling.{name} {value!r} is outside [{low:g}, {high:g}]"
        return None

    for name, low, high in (("temperature", 0.0, MAX_TEMPERATURE), ("top_p", 0.0, 1.0),
                            ("presence_penalty", -MAX_PENALTY, MAX_PENALTY),
                            ("frequency_penalty", -MAX_PENALTY, MAX_PENALTY)):
        message = bounded(name, getattr(s, name), low, high)
        if message is not None:
            return message
    if s.repetition_penalty not in (0.0, 1.0):
        message = bounded("repetition_penalty", s.repetition_penalty, MIN_REPETITION_PENALTY, MAX_PENALTY)
        if message is not None:
            return message + " (0 or 1: off)"
    if s.top_k < 0:
        return f"sampling.top_k {s.top_k} is negative (0: off)"
    if s.top_logprobs > MAX_TOP_LOGPROBS:
        return f"sampling.top_logprobs {s.top_logprobs} exceeds {MAX_TOP_LOGPROBS}"
    for token, bias in s.logit_bias.items():
        if not 0 <= token < vocab_size:
            return f"sampling.logit_bias id {token} is outside the vocabulary [0, {vocab_size})"
        message = bounded(f"logit_bias[{token}]", bias, -MAX_LOGIT_BIAS, MAX_LOGIT_BIAS)
        if message is not None:
            return message
    outside = next((t for t in s.stop_token_ids if not 0 <= t < vocab_size), None)
    if outside is not None:
        return f"sampling.stop_token_ids id {outside} is outside the vocabulary [0, {vocab_size})"
    return None
