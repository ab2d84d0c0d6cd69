"""What every benchmark measures on: the model (a preset random-weight shape or a real
checkpoint), its dtype, tokenizer and prompt sets, loaded once per run."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from inferencemesh.bundled import resolve_model
from inferencemesh.checkpoint.facts import CheckpointFacts
from inferencemesh.checkpoint.read import read_local
from inferencemesh.checkpoint.tokenizer import load_tokenizer
from inferencemesh.compute_dtype import choose_dtype
from inferencemesh.flags import ConfigError
from inferencemesh.planner import PlanInputs, plan_stages
from inferencemesh.programs.bench.config import BenchConfig

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

SHAPES: dict[str, dict[str, Any]] = {
    # A few hundred thousand parameters: the bench's own tests.
    "llama-tiny": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                       num_key_value_heads=2, vocab_size=512, tie_word_embeddings=False),
    # ~155M parameters: Llama architecture at GPT-2-small width.
    "llama-150m": dict(hidden_size=768, intermediate_size=2816, num_hidden_layers=12, num_attention_heads=12,
                       num_key_value_heads=12, vocab_size=32000, tie_word_embeddings=False),
    # ~1.1B parameters, 2.2 GB in bfloat16: the GPU bench's shape (a Llama-3.2-1B
    # body with a 32k vocabulary).
    "llama-1b": dict(hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32,
                     num_key_value_heads=8, vocab_size=32000, tie_word_embeddings=False),
}

PROMPTS = {
    "code": [
        "import os\nimport sys\n\n\ndef main(argv):\n    \"\"\"Parse the command line and run.\"\"\"\n"
        "    if len(argv) < 2:\n",
        "class LRUCache:\n    def __init__(self, capacity):\n        self.capacity = capacity\n"
        "        self.data = {}\n\n    def get(self, key):\n",
        "def read_config(path):\n    with open(path) as f:\n        lines = f.readlines()\n    result = {}\n"
        "    for line in lines:\n",
        "    def __repr__(self):\n        return '%s(%r)' % (self.__class__.__name__, self.name)\n\n"
        "    def __eq__(self, other):\n",
    ],
    "prose": [
        "The history of the city begins with a small settlement on the river, where traders stopped on their way",
        "She walked into the kitchen, looked at the empty table, and wondered why nobody had told her that",
        "In the summer of that year the weather was unusually warm, and the farmers in the valley",
        "Our team believes that good documentation is as important as good software, because",
    ],
}

# Longest session any benchmark opens: prompts of a few dozen tokens plus --new-tokens.
MAX_CONTEXT = 1024


def make_shape_model(shape: str, dtype: str) -> Path:
    """A random-weight checkpoint of a preset shape, cached under ~/.cache/inferencemesh/bench."""
    from transformers import LlamaConfig, LlamaForCausalLM

    if shape not in SHAPES:
        raise ConfigError(f"unknown --shape {shape!r}; presets: {', '.join(SHAPES)}")
    out = Path.home() / ".cache" / "inferencemesh" / "bench" / f"{shape}-{dtype}"
    if (out / "config.json").exists():
        return out
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(**SHAPES[shape], max_position_embeddings=4096))
    model.to(getattr(torch, dtype)).save_pretrained(out, safe_serialization=True)
    bundled = Path(resolve_model(None))  # any tokenizer will do for random weights: token ids are what count
    for name in ("tokenizer.json", "tokenizer_config.json"):
        if (bundled / name).exists():
            (out / name).write_bytes((bundled / name).read_bytes())
    return out


def prompt_ids(tokenizer: PreTrainedTokenizerBase, sets: list[str] | tuple[str, ...],
               vocab: int) -> dict[str, list[list[int]]]:
    return {name: [[t % vocab for t in tokenizer(p).input_ids] for p in PROMPTS[name]] for name in sets}


@dataclass
class BenchModel:
    """The model a run measures, and its prompts (token ids, per prompt set)."""

    model_dir: Path
    facts: CheckpointFacts
    dtype: torch.dtype
    tokenizer: PreTrainedTokenizerBase
    prompts: dict[str, list[list[int]]]
    requested_dtype: str  # --dtype, bfloat16 for a shape; "auto" stays auto (a draft then loads in its own)
    quantization: str | None = None  # --quantization: the stages quantize the 16-bit weights at load

    @property
    def dtype_name(self) -> str:
        return str(self.dtype).removeprefix("torch.")


def load_bench_model(config: BenchConfig) -> BenchModel:
    """--shape (random weights, bfloat16 unless --dtype) or --model; ConfigError/PlanError for a
    stage count the model cannot be split into, before anything heavy loads."""
    dtype_name = config.dtype if config.dtype != "auto" else ("bfloat16" if config.shape else "auto")
    model_dir = make_shape_model(config.shape, dtype_name) if config.shape else Path(resolve_model(config.model))
    facts = read_local(model_dir)
    # auto: what `serve` computes in (float32 on a CPU without native units for a 16-bit checkpoint)
    dtype = getattr(torch, choose_dtype(dtype_name, facts.checkpoint_dtype, on_cpu=not torch.cuda.is_available()).name)
    if config.quantization:
        from inferencemesh.operator.modelfacts import check_quantization  # serve and plan refuse by the same rule

        check_quantization(facts, config.quantization, str(model_dir))
    for count in config.stages:
        plan_stages(PlanInputs.from_checkpoint(facts, dtype=str(dtype).removeprefix("torch."),
                                               quantization=config.quantization), count)
    tokenizer = load_tokenizer(model_dir)
    return BenchModel(model_dir, facts, dtype, tokenizer, prompt_ids(tokenizer, config.prompts, facts.vocab_size),
                      dtype_name, config.quantization)
