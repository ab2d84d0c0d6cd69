"""The check every quantized format's test makes: greedy tokens of a checkpoint served as stage
slices (StageRuntime, float32) equal a reference model's, logprobs within the reference's own
float32 noise (twice its step-by-step logprobs against one forward of the same tokens, at least
1e-4: the stages' tiled matmuls sum in another order) plus float32's relative noise (rtol 1e-5)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import torch

from inferencemesh.modeling.runtime import StageRuntime

PROMPT, NEW = 10, 8


def chain(stages: list[StageRuntime], sessions: list, pos: int, ids: torch.Tensor) -> torch.Tensor:
    """One step through every stage in turn: the last stage's logits."""
    out: torch.Tensor = ids
    for stage, kv in zip(stages, sessions, strict=True):
        out = stage.forward(kv, pos, logits="last", **({"token_ids": out} if stage.is_first else {"hidden": out}))
    return out


def greedy_against(model: torch.nn.Module, path: Path, seed: int, splits: dict[int, list[int]],
                   check_stages: Callable[[list[StageRuntime]], None] | None = None) -> None:
    """Greedy tokens of `path` at each split (stage count -> layer bounds) equal `model`'s."""
    prompt = torch.randint(3, 256, (PROMPT,), generator=torch.Generator().manual_seed(seed))
    ids, expected, expected_lp = prompt.tolist(), [], []
    with torch.no_grad():
        for _ in range(NEW):
            logits = model(torch.tensor([ids])).logits[0, -1]
            expected_lp.append(torch.log_softmax(logits, -1))
            expected.append(int(logits.argmax()))
            ids.append(expected[-1])
        whole = torch.log_softmax(model(torch.tensor([ids[:-1]])).logits[0, PROMPT - 1:], -1)
    tolerance = max(1e-4, 2 * float((whole - torch.stack(expected_lp)).abs().max()))
    for n, bounds in splits.items():
        stages = [StageRuntime(path, a, b, dtype="float32", device="cpu", max_context=64)
                  for a, b in zip(bounds, bounds[1:], strict=False)]
        if check_stages is not None:
            check_stages(stages)
        sessions = [s.new_session() for s in stages]
        logits, got, lps, pos = chain(stages, sessions, 0, prompt), [], [], PROMPT
        for _ in range(NEW):
            lps.append(torch.log_softmax(logits[-1], -1))
            got.append(int(logits[-1].argmax()))
            logits = chain(stages, sessions, pos, torch.tensor([got[-1]]))
            pos += 1
        assert got == expected, (path.name, n)
        assert torch.allclose(torch.stack(lps), torch.stack(expected_lp), atol=tolerance, rtol=1e-5), (path.name, n)
