"""Coverage as data: a small random checkpoint of every verified family (modeling/families.py
VERIFIED), written by transformers' own save_pretrained from its own config class, served at 1, 2
and 3 stages in-process and compared with transformers' greedy generate() in float32; logprobs
within 1e-4; batched decode (several sessions in one pass) exact; the family as a draft model;
the planner's bytes per layer equal the checkpoint's."""

from __future__ import annotations

import json
import warnings
from pathlib import Path

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM

from inferencemesh.checkpoint.errors import CheckpointError
from inferencemesh.checkpoint.read import read_local
from inferencemesh.frontend.engine.proposers.base import Proposal
from inferencemesh.frontend.engine.proposers.draft import DraftBatcher, DraftProposer, draft_together
from inferencemesh.frontend.engine.proposers.draft_model import DraftModel
from inferencemesh.modeling import families
from inferencemesh.modeling.runtime import Segment, StageRuntime
from inferencemesh.planner import PlanInputs
from inferencemesh.sampling import SamplingParams
from inferencemesh.speculation import WindowPolicy

LAYERS = 4
PROMPT, NEW = 12, 10
SPLITS = {1: [0, 4], 2: [0, 2, 4], 3: [0, 1, 3, 4]}
BASE = dict(vocab_size=320, hidden_size=64, intermediate_size=96, num_attention_heads=4, num_key_value_heads=2,
            num_hidden_layers=LAYERS, max_position_embeddings=256, initializer_range=0.5,
            bos_token_id=1, eos_token_id=2, pad_token_id=0)
MOE = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=48)
FAMILY = {
    "llama": {}, "mistral": dict(sliding_window=8), "qwen2": dict(tie_word_embeddings=True),
    "qwen3": dict(head_dim=32), "gemma": dict(head_dim=16),
    "gemma2": dict(head_dim=16, sliding_window=8, query_pre_attn_scalar=16, attn_logit_softcapping=5.0,
                   final_logit_softcapping=3.0),
    "gemma3_text": dict(head_dim=16, sliding_window=8, query_pre_attn_scalar=16, sliding_window_pattern=2,
                        layer_types=["sliding_attention", "full_attention"] * 2),
    "phi3": dict(num_key_value_heads=4), "olmo2": {},
    "mixtral": dict(num_local_experts=4, num_experts_per_tok=2),
    # Uneven layers: layer 1 is dense (mlp_only_layers), the others carry experts.
    "qwen2_moe": dict(MOE, shared_expert_intermediate_size=64, mlp_only_layers=[1]),
    "qwen3_moe": dict(MOE, head_dim=16),
    # Attention sinks, alternating windows, experts.
    "gpt_oss": dict(num_local_experts=4, num_experts_per_tok=2, head_dim=16, sliding_window=8,
                    layer_types=["sliding_attention", "full_attention"] * 2),
    # Its router reads its own linear's weight (not packed); queries scaled by position (position_ids).
    "hunyuan_v1_moe": dict(num_experts=4, moe_topk=2, head_dim=16),
    "ministral3": dict(head_dim=16),
    # The multipliers their forwards apply around the layers, moved off 1.0.
    "granite": dict(embedding_multiplier=4.0, logits_scaling=2.0, residual_multiplier=0.5, attention_multiplier=0.25),
    "cohere": dict(logit_scale=0.5),
    "hyperclovax": dict(logits_scaling=2.0, head_dim=16),
}
assert set(FAMILY) == set(families.VERIFIED)


def write(root: Path, family: str) -> Path:
    config = AutoConfig.for_model(family, **{**BASE, **FAMILY[family]})
    torch.manual_seed(sorted(FAMILY).index(family))
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32, attn_implementation="eager").eval()
    path = root / family
    model.save_pretrained(path, safe_serialization=True)
    return path


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def root(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("families")


@pytest.fixture(scope="module")
def prompt() -> torch.Tensor:
    return torch.randint(3, 320, (PROMPT,), generator=torch.Generator().manual_seed(5))


def chain_logits(stages: list[StageRuntime], sessions: list, pos: int, ids: torch.Tensor,
                 logits: str = "last") -> torch.Tensor:
    out: torch.Tensor | None = ids
    for stage, kv in zip(stages, sessions, strict=True):
        feed = {"token_ids": out} if stage.is_first else {"hidden": out}
        out = stage.forward(kv, pos, logits=logits, **feed)
    assert out is not None
    return out


@pytest.mark.parametrize("family", families.VERIFIED)
def test_family_exact_at_1_2_3_stages(root, prompt, family):
    path = write(root, family)
    eager = {"attn_implementation": "eager"} if family == "gemma2" else {}  # transformers' sdpa refuses softcap
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, **eager).eval()
    with torch.no_grad():
        out = model.generate(prompt[None], max_new_tokens=NEW, do_sample=False, min_new_tokens=NEW,
                             output_logits=True, return_dict_in_generate=True)
        # transformers' own float32 noise for this family: generate()'s step-by-step logprobs
        # against one forward over the same tokens (Mixtral's grouped experts: ~3e-4).
        whole_lp = torch.log_softmax(model(out.sequences[:, :-1]).logits[0, PROMPT - 1:].float(), -1)
    expected = out.sequences[0, PROMPT:].tolist()
    expected_lp = torch.stack([torch.log_softmax(x[0].float(), -1) for x in out.logits])
    tolerance = max(1e-4, 2 * float((whole_lp - expected_lp).abs().max()))
    for n, bounds in SPLITS.items():
        stages = [StageRuntime(path, a, b, dtype="float32", device="cpu", max_context=64)
                  for a, b in zip(bounds, bounds[1:], strict=False)]
        sessions = [s.new_session() for s in stages]
        logits = chain_logits(stages, sessions, 0, prompt)
        got, lps, pos = [], [], PROMPT
        for _ in range(NEW):
            lps.append(torch.log_softmax(logits[-1], -1))
            token = int(logits[-1].argmax())
            got.append(token)
            logits = chain_logits(stages, sessions, pos, torch.tensor([token]))
            pos += 1
        assert got == expected, (family, n)
        # 1e-4 (or twice transformers' own noise where that is larger), plus float32's
        # summation-order noise on logprobs of magnitude ~10 (rtol 1e-5)
        assert torch.allclose(torch.stack(lps), expected_lp, atol=tolerance, rtol=1e-5), (family, n, tolerance)
    # Batched decode: three sessions in one packed pass equal each alone.
    stages = [StageRuntime(path, a, b, dtype="float32", device="cpu", max_context=64)
              for a, b in zip(SPLITS[2], SPLITS[2][1:], strict=False)]
    whole = torch.cat([prompt, torch.tensor(expected)])
    alone = []
    for length in (PROMPT, PROMPT + 3, PROMPT + 6):
        sessions = [s.new_session() for s in stages]
        alone.append(chain_logits(stages, sessions, 0, whole[:length + 1])[-1])
    sessions = [[s.new_session() for s in stages] for _ in range(3)]
    for i, length in enumerate((PROMPT, PROMPT + 3, PROMPT + 6)):
        chain_logits(stages, sessions[i], 0, whole[:length])
    outs: list = [whole[length:length + 1] for length in (PROMPT, PROMPT + 3, PROMPT + 6)]
    for j, stage in enumerate(stages):
        outs = stage.forward_batch([Segment(sessions[i][j], length, outs[i])
                                    for i, length in enumerate((PROMPT, PROMPT + 3, PROMPT + 6))])
    for got_logits, want in zip(outs, alone, strict=True):
        # float32 summation order differs between a packed pass and a lone one; its noise grows
        # with the logits' scale (Gemma's, x sqrt(hidden) and (1 + w) norms, reach ~2e-4 at |13|,
        # each form as far from a float64 forward as the other). A wrong position or cache row
        # moves logits by whole units.
        assert torch.allclose(got_logits[-1], want, atol=1e-4 + 3e-5 * float(want.abs().max()), rtol=0), family


LEAN_DRAFT = {"llama", "mistral", "qwen2", "qwen3"}  # the Llama layout; the others run through the stage runtime


@pytest.mark.parametrize("family", families.VERIFIED)
def test_family_works_as_a_draft(root, prompt, family):
    """The draft of a target of the same family (itself here, so every proposal is the target's
    greedy token): proposals through the real proposer and batcher equal generate(), in the form
    the draft picked (the lean forward only where it is this model)."""
    path = root / family if (root / family).exists() else write(root, family)
    eager = {"attn_implementation": "eager"} if family == "gemma2" else {}
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, **eager).eval()
    with torch.no_grad():
        expected = model.generate(prompt[None], max_new_tokens=8, do_sample=False, min_new_tokens=8)[0].tolist()
    draft = DraftModel(str(path), dtype="float32", device="cpu", max_context=64)
    assert draft.form == ("lean" if family in LEAN_DRAFT else "stage"), family
    policy = WindowPolicy(adaptive=False, initial=4, minimum=4, maximum=4)
    proposers = [DraftProposer(draft, policy, SamplingParams(0.0, 1.0, 0, 0), batcher=DraftBatcher()) for _ in range(2)]
    history = prompt.tolist()
    first = proposers[0].propose(history)  # alone
    together = draft_together([(proposers[1], history), (proposers[0], expected[:PROMPT + 4])])  # batched
    assert first is not None and first.tokens == expected[PROMPT:PROMPT + 4], family
    assert [p.tokens for p in together if isinstance(p, Proposal)] == [expected[PROMPT:PROMPT + 4],
                                                                       expected[PROMPT + 4:PROMPT + 8]], family


@pytest.mark.parametrize("family", families.VERIFIED)
def test_plan_bytes_per_layer_match_the_checkpoint(root, family):
    path = root / family if (root / family).exists() else write(root, family)
    facts = read_local(path)
    from safetensors import safe_open

    per_layer = [0] * LAYERS
    with safe_open(str(path / "model.safetensors"), "pt") as f:
        for name in f.keys():  # noqa: SIM118 (safe_open is not a dict)
            if name.startswith("model.layers."):
                t = f.get_tensor(name)
                per_layer[int(name.split(".")[2])] += t.numel() * t.element_size()
    inputs = PlanInputs.from_checkpoint(facts, dtype="float32", kv_tokens=64)
    assert list(inputs.layer_bytes) == per_layer
    # The stage that loads a layer reads every tensor of it, experts included.
    names = facts.stage_tensor_names(1, 2)
    assert sum(facts.tensors[n].nbytes for n in names) == per_layer[1]
    if family == "qwen2_moe":  # uneven: the dense layer is smaller than the expert layers
        assert per_layer[1] < per_layer[0] == per_layer[2]
        assert any(".experts." in n for n in facts.stage_tensor_names(0, 1))


def test_uneven_moe_layers_are_planned_by_what_each_stage_holds(root):
    """Qwen2-MoE with a dense layer among expert layers (4x fewer bytes): the plan balances real
    bytes, and each planned stage's weight bytes are what loading that stage allocates."""
    from inferencemesh.modeling.loader import load_stage
    from inferencemesh.planner import plan_stages

    path = root / "qwen2_moe" if (root / "qwen2_moe").exists() else write(root, "qwen2_moe")
    facts = read_local(path)
    inputs = PlanInputs.from_checkpoint(facts, dtype="float32", kv_tokens=64)
    for count in (2, 3):
        for stage in plan_stages(inputs, count):
            held = load_stage(path, stage.layer_start, stage.layer_end, dtype="float32", device="cpu")
            modules = [m for m in (held.embed, held.layers, held.norm, held.lm_head) if m is not None]
            tensors = {id(p): p for m in modules for p in m.parameters()}  # a tied head counted once
            assert sum(p.numel() * p.element_size() for p in tensors.values()) == stage.weight_bytes, stage


@pytest.mark.parametrize(("family", "why"), [
    ("gpt2", "not the standard layout"), ("mamba", "recurrent"), ("t5", "no causal LM"),
    ("gemma3n_text", "weights outside embed/layers/norm"),
])
def test_unsplittable_families_are_refused_with_the_reason(tmp_path, family, why):
    config = AutoConfig.for_model(family).to_dict()
    assert why in (families.refusal(config) or "")
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(CheckpointError, match=f"cannot be served: .*{why}"):
        read_local(tmp_path)


def test_every_hook_is_exercised_by_a_verified_family():
    """Each per-family difference of HOOKS is switched on by some family's config above, so the
    exactness tests cover it."""
    configs = [AutoConfig.for_model(family, **{**BASE, **FAMILY[family]}) for family in FAMILY]
    for hook in families.HOOKS:
        assert any(hook.applies(config) for config in configs), hook.name


def test_hooks_switch_on_from_the_config():
    on = {h.name for h in families.HOOKS if h.applies(AutoConfig.for_model("gemma2", **{**BASE, **FAMILY["gemma2"]}))}
    assert {"final_logit_softcapping", "attention_softcapping", "layer_types", "scaled_embedding"} <= on
    gemma3 = AutoConfig.for_model("gemma3_text", **{**BASE, **FAMILY["gemma3_text"]})
    assert families.forward_hooks(gemma3).rotary_per_layer_type
    llama = AutoConfig.for_model("llama")
    assert families.forward_hooks(llama) == families.ForwardHooks(None, None, None, False)
    granite = AutoConfig.for_model("granite", embedding_multiplier=12.0, logits_scaling=8.0)
    hooks = families.forward_hooks(granite)
    assert hooks.embedding_multiplier == 12.0 and hooks.logit_multiplier == 1 / 8


REGENERATE = "python -m inferencemesh.modeling.families"  # records the table for the installed transformers


def table_differences(recorded: dict, live: dict) -> list[str]:
    """Where a recorded family table's decisions differ from the live ones, one line each (the
    transformers version they were recorded with is not a decision)."""
    lines = []
    for family in sorted(set(recorded["refusals"]) | set(live["refusals"])):
        was, now = recorded["refusals"].get(family, "absent"), live["refusals"].get(family, "absent")
        if was != now:
            lines.append(f"{family}: recorded {was or 'served'!r}, now {now or 'served'!r}")
    for family in sorted(set(recorded["undecided"]) ^ set(live["undecided"])):
        lines.append(f"{family}: {'no longer' if family in recorded['undecided'] else 'now'} undecided")
    return lines


def test_the_recorded_family_table_is_the_live_decision():
    """FAMILY_TABLE (what the operator, which has no transformers, decides from) equals refusal()
    of every causal-LM family in the installed transformers; the verified families are served by
    it in any case. Another transformers version that decides the same needs no new table."""
    table = families.family_table()
    for family in families.VERIFIED:  # served, or left to the stages (Hunyuan's default config builds no model)
        assert table["refusals"].get(family, "absent") is None or family in table["undecided"], family
    live = families.build_family_table()
    stale = table_differences(table, live)
    assert not stale, (
        f"{families.TABLE_PATH.name} (recorded with transformers {table['transformers']}) is stale for the installed "
        f"transformers {live['transformers']}: regenerate it with `{REGENERATE}` and commit it. "
        f"{len(stale)} decisions differ:\n" + "\n".join(stale))
    if table["transformers"] != live["transformers"]:
        warnings.warn(f"{families.TABLE_PATH.name} was recorded with transformers {table['transformers']} and holds "
                      f"for {live['transformers']} too (`{REGENERATE}` records the version)", stacklevel=1)


def test_a_stale_family_table_is_seen():
    recorded = {"transformers": "1.0", "refusals": {"llama": None, "gpt2": "not the standard layout", "old": None},
                "undecided": ["hunyuan_v1_moe"]}
    same_facts = {**recorded, "transformers": "2.0"}
    assert table_differences(recorded, same_facts) == []
    live = {"transformers": "2.0", "refusals": {"llama": "its layers include linear_attention", "gpt2": None,
                                                "new": None}, "undecided": ["new_undecided"]}
    assert table_differences(recorded, live) == [
        "gpt2: recorded 'not the standard layout', now 'served'",
        "llama: recorded 'served', now 'its layers include linear_attention'",
        "new: recorded 'absent', now 'served'",
        "old: recorded 'served', now 'absent'",
        "hunyuan_v1_moe: no longer undecided",
        "new_undecided: now undecided",
    ]


def test_without_transformers_the_table_decides(monkeypatch):
    monkeypatch.setattr(families, "_transformers_installed", lambda: False)
    assert families.refusal(AutoConfig.for_model("qwen3_moe").to_dict()) is None
    assert "not the standard layout" in (families.refusal(AutoConfig.for_model("gpt2").to_dict()) or "")
    assert "not in this release's family table" in (families.refusal({"model_type": "my_own_llm"}) or "")
    # A family whose default config builds no model is left to its stages (they see the real config).
    undecided = families.family_table()["undecided"][0]
    assert families.refusal({"model_type": undecided, "num_hidden_layers": 4}) is None
    # What a config.json itself says still counts for a family the table serves.
    linear = {**AutoConfig.for_model("llama").to_dict(), "layer_types": ["full_attention", "linear_attention"]}
    assert "linear_attention" in (families.refusal(linear) or "")


def test_the_models_command_lists_what_is_served():
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-m", "inferencemesh", "models"], capture_output=True, text=True,
                         timeout=60, check=True).stdout
    served = out.split("Pass the family check", 1)[1].split("Decided from", 1)[0]
    assert "gpt_oss" in out and "qwen3_moe" in served and "cohere" in served
    assert "deepseek_v3" not in served and "gpt2" not in served
    assert all(hook.name in out for hook in families.HOOKS)


@pytest.mark.parametrize(("config", "why"), [
    ('{"model_type": "llama", "num_hidden_layers": "four"}', "does not build a llama config"),
    ('{"model_type": "llama", "num_hidden_layers": 100000000}', "not between 1 and 4096"),
    ('{"model_type": "llama", "num_hidden_layers": 0}', "not between 1 and 4096"),
    ('{"model_type": 5}', "unknown to the installed transformers"),
    ("[1, 2]", "not a JSON object"),
    ('{"model_type": "llama",', "not JSON"),
])
def test_a_hostile_config_is_refused_in_one_line(tmp_path, config, why):
    """Never a traceback or a hang (a huge layer count is refused before anything is built)."""
    (tmp_path / "config.json").write_text(config)
    with pytest.raises(CheckpointError, match=why) as caught:
        read_local(tmp_path)
    assert "\n" not in str(caught.value)
