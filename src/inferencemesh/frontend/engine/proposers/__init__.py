"""Speculative decoding in the frontend: the frontend proposes, the last stage verifies.

- base: the Proposer interface the engine drives, and the adaptive window;
- ngram: prompt lookup (NgramProposer) and its gated form (AutoProposer);
- draft_model: the draft model's lean forward pass; draft: its proposer and batcher;
- build: load what inferencemesh.speculation decided (resolve_speculation) and make each
  request's proposer.

The shared rule of which strategy runs is inferencemesh.speculation (no torch, used by the
operator too); this package is named for what it holds, proposers, so that the two are not one
letter apart.
"""
