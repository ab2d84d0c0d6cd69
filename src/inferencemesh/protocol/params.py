"""Sampling parameters on the wire: the frontend writes and the last stage reads them here,
so a field added to SamplingParams cannot be sent by one side and dropped by the other."""

from __future__ import annotations

from inferencemesh.protocol import stage_pb2 as pb
from inferencemesh.sampling import SamplingParams, unsafe_field


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


MAX_TOP_LOGPROBS = 100  # alternatives per token a stage computes at most


def refusal(s: pb.Sampling, vocab_size: int) -> str | None:
    """Why a stage refuses these sampling parameters (a message naming the field), or None: the
    engine's own table (sampling.unsafe_field), applied to what arrived, whoever sent it."""
    if s.top_logprobs > MAX_TOP_LOGPROBS:
        return f"sampling.top_logprobs {s.top_logprobs} exceeds {MAX_TOP_LOGPROBS}"
    params, _ = from_wire(s)  # (a repetition penalty of 0 on the wire is "off": it reads 1)
    problem = unsafe_field(params, vocab_size)
    return None if problem is None else f"sampling.{problem[0]}: {problem[1]}"
