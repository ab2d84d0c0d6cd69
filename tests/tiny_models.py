"""Write small random Hugging Face checkpoints for tests: Llama, Mistral, Qwen2, Qwen3.

Each checkpoint is what a hub repo looks like: config.json, generation_config.json, a
multi-shard safetensors checkpoint with model.safetensors.index.json, and (optionally) a
byte-level tokenizer with a chat template, so every part of the product can load it offline.

    from tiny_models import write_tiny_model
    path = write_tiny_model(tmp_path / "m", "qwen3", num_layers=4, shards=3)

Run as a script to write one: `python tests/tiny_models.py OUT_DIR --family llama`.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
from safetensors.torch import save_file

FAMILIES = ("llama", "mistral", "qwen2", "qwen3")
SPECIAL_TOKENS = ["<s>", "</s>", "<pad>"]  # ids 256, 257, 258 after the 256 byte tokens
BOS_ID, EOS_ID, PAD_ID = 256, 257, 258
CHAT_TEMPLATE = (
    "{% for m in messages %}<s>{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<s>assistant: {% endif %}"
)

# Small but non-degenerate: grouped-query attention (4 query heads, 2 KV heads) everywhere,
# Qwen3 with a head_dim that differs from hidden/heads, Mistral with a sliding window short
# enough for tests to cross it, Qwen2 with attention biases (built into the family).
_BASE = dict(
    vocab_size=320,
    hidden_size=64,
    intermediate_size=128,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=512,
    rms_norm_eps=1e-6,
    initializer_range=0.5,  # large enough that greedy decoding does not collapse into one repeated token
    bos_token_id=BOS_ID,
    eos_token_id=EOS_ID,
    pad_token_id=PAD_ID,
)
_FAMILY = {
    "llama": dict(tie_word_embeddings=False),
    "mistral": dict(tie_word_embeddings=False, sliding_window=24),
    "qwen2": dict(tie_word_embeddings=True),
    "qwen3": dict(tie_word_embeddings=True, head_dim=32),
}


def tiny_config(family: str, *, num_layers: int = 4, **overrides):
    """The transformers config of a tiny model of `family` (overrides win over the defaults)."""
    from transformers import AutoConfig

    if family not in FAMILIES:
        raise ValueError(f"unknown family {family!r}; choose from {FAMILIES}")
    kwargs = {**_BASE, **_FAMILY[family], "num_hidden_layers": num_layers, **overrides}
    return AutoConfig.for_model(family, **kwargs)


def write_tiny_model(
    directory: str | Path,
    family: str,
    *,
    num_layers: int = 4,
    shards: int = 3,
    seed: int = 0,
    dtype: torch.dtype = torch.float32,
    tokenizer: bool = True,
    **config_overrides,
) -> Path:
    """Write a random `family` checkpoint with `num_layers` layers into `directory`, split into `shards` files.

    Weights are random (seeded) but initialised the way transformers initialises them, so the
    model behaves like an untrained model of that family. config_overrides go to the config
    (e.g. hidden_size=768 for a bigger model). Returns the directory.
    """
    from transformers import AutoModelForCausalLM

    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    config = tiny_config(family, num_layers=num_layers, **config_overrides)
    torch.manual_seed(seed * len(FAMILIES) + FAMILIES.index(family))  # families differ even at one seed
    model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    state = model.state_dict()
    if config.tie_word_embeddings:
        state.pop("lm_head.weight", None)  # hub convention: a tied head is not stored
    _write_shards(directory, state, shards)
    config.dtype = dtype
    config.save_pretrained(directory)
    model.generation_config.save_pretrained(directory)
    if tokenizer:
        write_byte_tokenizer(directory)
    return directory


def _shard_order(name: str) -> tuple:
    """Embeddings first, then layers in order, then the final norm and the head: like real repos."""
    parts = name.split(".")
    if name.startswith("model.layers."):
        return (1, int(parts[2]), name)
    if name.startswith("model.embed_tokens."):
        return (0, 0, name)
    return (2, 0, name)


def _write_shards(directory: Path, state: dict[str, torch.Tensor], shards: int) -> None:
    names = sorted(state, key=_shard_order)
    total = sum(state[n].numel() * state[n].element_size() for n in names)
    shards = max(1, min(shards, len(names)))
    groups: list[list[str]] = [[] for _ in range(shards)]
    done = 0
    for name in names:
        # Fill shards by cumulative bytes so each holds a contiguous, roughly equal slice.
        index = min(shards - 1, done * shards // max(total, 1))
        groups[index].append(name)
        done += state[name].numel() * state[name].element_size()
    groups = [g for g in groups if g]
    weight_map = {}
    for i, group in enumerate(groups):
        file = f"model-{i + 1:05d}-of-{len(groups):05d}.safetensors"
        save_file({n: state[n].contiguous().clone() for n in group}, str(directory / file), metadata={"format": "pt"})
        weight_map.update({n: file for n in group})
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (directory / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))


def write_byte_tokenizer(directory: str | Path) -> None:
    """A byte-level tokenizer (256 byte tokens, no merges, 3 specials) with a chat template."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    alphabet = pre_tokenizers.ByteLevel.alphabet()
    vocab = {ch: i for i, ch in enumerate(sorted(alphabet))}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(SPECIAL_TOKENS)
    directory = Path(directory)
    tok.save(str(directory / "tokenizer.json"))
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": "<s>",
        "eos_token": "</s>",
        "pad_token": "<pad>",
        "add_bos_token": False,
        "model_max_length": 512,
        "chat_template": CHAT_TEMPLATE,
    }
    (directory / "tokenizer_config.json").write_text(json.dumps(config, indent=2))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out")
    parser.add_argument("--family", choices=FAMILIES, default="llama")
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--shards", type=int, default=3)
    args = parser.parse_args()
    print(write_tiny_model(args.out, args.family, num_layers=args.layers, shards=args.shards))


if __name__ == "__main__":
    main()
