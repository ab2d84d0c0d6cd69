"""The product on a CUDA GPU (`pytest -m gpu`; every test here skips without CUDA, so CI's CPU run
skips them all; tools/gpu/checklist.sh runs them on a device). What a GPU run checks first:
float32 greedy tokens of the stage runtime equal
transformers' generate() on the same GPU for every verified family at 1 and 2 stages; the same over
real gRPC with two stage processes sharing the GPU; the embedded first stage; the draft model; the
speculative-sampling distribution with the target's logits on the GPU; `inferencemesh serve` on
the GPU through the OpenAI client; and bf16 greedy agreement with transformers' bf16, reported as
a percentage of positions (bf16 kernels are not bitwise reproducible, so that one is a figure with
a floor, not an equality)."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch
from mesh_helpers import embedded_pipeline, generate, serving, start_mesh
from test_families import FAMILY, LAYERS, NEW, PROMPT, chain_logits, write
from test_sampling import CHI2_CRITICAL_P001, chi_square
from tiny_models import write_tiny_model

from inferencemesh.frontend.engine.pipeline import GrpcPipeline
from inferencemesh.frontend.engine.proposers.draft import DraftProposer
from inferencemesh.frontend.engine.proposers.draft_model import DraftModel
from inferencemesh.modeling import families
from inferencemesh.modeling.runtime import StageRuntime
from inferencemesh.sampling import DraftRow, SamplingParams, draw, probabilities, verify
from inferencemesh.speculation import WindowPolicy

# INFERENCEMESH_TEST_DEVICE=cpu runs these same tests on the CPU: a dry run of their code before
# the device time is spent (the comparisons hold there too).
CUDA = os.environ.get("INFERENCEMESH_TEST_DEVICE", "cuda")
pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(CUDA == "cuda" and not torch.cuda.is_available(), reason="needs a CUDA GPU")]
TOKENS = [72, 101, 108, 108, 111, 44, 32, 119, 111, 114, 108, 100]
PROMPTS = [TOKENS[i:] + TOKENS[:i] for i in range(8)]


def report(name: str, value: object) -> None:
    """A figure the device run keeps: printed, and added to $GPU_REPORT (a JSON file) when set."""
    print(f"GPU-REPORT {name}: {value}")
    path = os.environ.get("GPU_REPORT")
    if path:
        data = json.loads(Path(path).read_text()) if Path(path).exists() else {}
        data[name] = value
        Path(path).write_text(json.dumps(data, indent=1))


def hf_greedy_on(model_dir: Path, prompt: list[int], new_tokens: int, device: str,
                 dtype: torch.dtype = torch.float32) -> list[int]:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).to(device).eval()
    model.generation_config.eos_token_id = None
    with torch.inference_mode():
        out = model.generate(torch.tensor([prompt], device=device), max_new_tokens=new_tokens, do_sample=False,
                             pad_token_id=0)
    return out[0, len(prompt):].tolist()


@pytest.fixture(scope="module")
def root(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("gpu")


@pytest.fixture(scope="module")
def tiny(root) -> Path:
    return write_tiny_model(root / "tiny-llama", "llama", num_layers=4, shards=2)  # root / "llama": the family test's


@pytest.mark.parametrize("family", families.VERIFIED)
def test_family_greedy_on_cuda_equals_transformers_on_cuda(root, family) -> None:
    from transformers import AutoModelForCausalLM

    assert set(FAMILY) == set(families.VERIFIED)
    path = write(root, family)
    prompt = torch.randint(3, 320, (PROMPT,), generator=torch.Generator().manual_seed(5))
    eager = {"attn_implementation": "eager"} if family == "gemma2" else {}
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, **eager).to(CUDA).eval()
    with torch.no_grad():
        out = model.generate(prompt[None].to(CUDA), max_new_tokens=NEW, do_sample=False, min_new_tokens=NEW,
                             output_logits=True, return_dict_in_generate=True)
    expected = out.sequences[0, PROMPT:].tolist()
    expected_lp = torch.stack([torch.log_softmax(x[0].float(), -1) for x in out.logits]).cpu()
    for bounds in ([0, LAYERS], [0, LAYERS // 2, LAYERS]):
        stages = [StageRuntime(path, a, b, dtype="float32", device=CUDA, max_context=64)
                  for a, b in zip(bounds, bounds[1:], strict=False)]
        assert all(p.device.type == CUDA for s in stages for layer in s._layers for p in layer.parameters())
        sessions = [s.new_session() for s in stages]
        logits = chain_logits(stages, sessions, 0, prompt.to(CUDA))
        got, lps, pos = [], [], PROMPT
        for _ in range(NEW):
            assert logits.device.type == CUDA
            lps.append(torch.log_softmax(logits[-1].float(), -1).cpu())
            token = int(logits[-1].argmax())
            got.append(token)
            logits = chain_logits(stages, sessions, pos, torch.tensor([token], device=CUDA))
            pos += 1
        assert got == expected, (family, len(bounds) - 1)
        # CUDA's float32 kernels sum in other orders than transformers' separate projections: 1e-3.
        assert torch.allclose(torch.stack(lps), expected_lp, atol=1e-3, rtol=1e-4), family


def test_two_stage_processes_share_the_gpu_over_grpc(tiny) -> None:
    expected = [hf_greedy_on(tiny, p, 16, CUDA) for p in PROMPTS]
    assert expected[0] == hf_greedy_on(tiny, PROMPTS[0], 16, "cpu")  # the GPU and the CPU agree here
    mesh = start_mesh(tiny, 2, device=CUDA)
    try:
        assert [generate(GrpcPipeline(mesh.addresses), p, 16, temperature=0.0) for p in PROMPTS] == expected
    finally:
        mesh.stop()


def test_embedded_first_stage_on_cuda(tiny) -> None:
    expected = [hf_greedy_on(tiny, p, 16, CUDA) for p in PROMPTS[:3]]
    mesh = start_mesh(tiny, 2, embed_first=True, device=CUDA, max_context=256)
    try:
        got = [generate(embedded_pipeline(tiny, mesh, device=CUDA), p, 16, temperature=0.0) for p in PROMPTS[:3]]
        assert got == expected
    finally:
        mesh.stop()


def test_draft_model_on_cuda_proposes_transformers_greedy_tokens(tiny) -> None:
    expected = hf_greedy_on(tiny, TOKENS, 8, CUDA)
    draft = DraftModel(str(tiny), dtype="float32", device=CUDA, max_context=64)
    assert draft.device.type == CUDA
    proposer = DraftProposer(draft, WindowPolicy(adaptive=False, initial=4, minimum=4, maximum=4),
                             SamplingParams(0.0, 1.0, 0, 0))
    first = proposer.propose(TOKENS)
    assert first is not None and first.tokens == expected[:4]
    second = proposer.propose(TOKENS + expected[:4])
    assert second is not None and second.tokens == expected[4:8]


def test_speculative_sampling_keeps_the_target_distribution_on_cuda() -> None:
    """Leviathan's rule with the target's logits on the GPU and the draft's rows on the host, as the
    last stage sees them: the first and second tokens follow p (chi-square at p = 0.001)."""
    gen = torch.Generator().manual_seed(7)
    vocab = 6
    target_logits = (torch.randn(3, vocab, generator=gen) * 1.5).to(CUDA)
    p = probabilities(target_logits, SamplingParams(temperature=1.0)).cpu()
    q = torch.softmax(torch.randn(2, vocab, generator=gen) * 1.5, -1)
    rows = [DraftRow(torch.arange(vocab), row, 0.0, vocab) for row in q]
    first, second = [], []
    for seed in range(4000):
        drafts = [draw(rows[i], gen)[0] for i in range(2)]
        _, tokens = verify(target_logits, drafts, SamplingParams(temperature=1.0, seed=seed), 100, rows)
        first.append(tokens[0])
        if len(tokens) > 1:
            second.append(tokens[1])
    stat, dof = chi_square(first, p[0])
    assert stat < CHI2_CRITICAL_P001[dof], f"first token deviates from p: chi2={stat:.1f}"
    stat, dof = chi_square(second, p[1])
    assert len(second) > 300 and stat < CHI2_CRITICAL_P001[dof], f"second token deviates: chi2={stat:.1f}"


def test_serve_on_cuda_answers_greedy_through_the_openai_client() -> None:
    """The console script on the GPU: the bundled model (and its draft) at 2 stages, float32, the
    first stage embedded; the text equals transformers' greedy continuation on the GPU."""
    from openai import OpenAI
    from transformers import AutoTokenizer

    from inferencemesh.bundled import resolve_model

    model_dir = Path(resolve_model(None))
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    prompt = "def fibonacci(n):\n"
    ids = tokenizer(prompt).input_ids
    expected = tokenizer.decode(hf_greedy_on(model_dir, ids, 24, CUDA))
    with serving("--stages", "2", "--dtype", "float32", "--device", CUDA) as (base, _proc, lines):
        assert any(f"on {CUDA}" in line for line in lines), "".join(lines)
        client = OpenAI(base_url=f"{base}/v1", api_key="none")
        model = client.models.list().data[0].id
        answer = client.completions.create(model=model, prompt=prompt, max_tokens=24, temperature=0)
    text = answer.choices[0].text
    assert expected.startswith(text) and len(text) > 0, (text, expected)


def test_bf16_greedy_agreement_with_transformers_bf16() -> None:
    """bf16 on the GPU: the share of positions where the stage runtime's argmax equals transformers'
    bf16 argmax, both reading transformers' own greedy continuation (teacher-forced, so one early
    disagreement does not decide the rest). Reported; it must stay above 90%."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from inferencemesh.bundled import resolve_model
    from inferencemesh.programs.bench.models import PROMPTS as BENCH_PROMPTS

    model_dir = Path(resolve_model(None))
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16).to(CUDA).eval()
    model.generation_config.eos_token_id = None
    runtime = StageRuntime(model_dir, 0, runtime_layers(model_dir), dtype="bfloat16", device=CUDA, max_context=512)
    agree = total = 0
    for text in BENCH_PROMPTS["code"] + BENCH_PROMPTS["prose"]:
        ids = torch.tensor([tokenizer(text).input_ids], device=CUDA)
        with torch.inference_mode():
            sequence = model.generate(ids, max_new_tokens=64, do_sample=False, pad_token_id=0)
            theirs = model(sequence).logits[0, ids.shape[1] - 1:-1].argmax(-1)
            ours = runtime.forward(runtime.new_session(), 0, token_ids=sequence[0], logits="all")
        mine = ours[ids.shape[1] - 1:-1].argmax(-1)
        agree += int((mine == theirs).sum())
        total += mine.numel()
    share = agree / total
    report("bf16_greedy_agreement", {"positions": total, "agree": agree, "share": round(share, 4)})
    assert share > 0.9, share


def runtime_layers(model_dir: Path) -> int:
    from inferencemesh.checkpoint.read import read_local

    return read_local(model_dir).num_layers
