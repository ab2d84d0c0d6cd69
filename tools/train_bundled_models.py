"""Train the bundled offline models: a byte-level BPE tokenizer, a Llama target and its draft.

Everything comes from a corpus every machine of ours has offline: the Python standard
library's own source. The split into train and held-out files is a pure function of each
file's path, so a rerun with the same seed and Python version reproduces the models.

    python tools/train_bundled_models.py --out src/inferencemesh/bundled

Outputs two Hugging Face model directories (config.json, generation_config.json,
model.safetensors, tokenizer files, README.md model card) and a model-package.json beside
the target that declares the draft as its known-good speculative strategy.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import random
import sys
import sysconfig
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

TARGET_NAME = "imesh-code-target"
DRAFT_NAME = "imesh-code-draft"
EOS = "<|endoftext|>"
SPECIAL_TOKENS = [EOS, "<|im_start|>", "<|im_end|>", "<|pad|>"]
# ChatML with a tools section (Hermes' <tool_call> format, which the frontend's tools.py enforces
# and parses): the bundled target's template is the one source, both models are saved with it.
CHAT_TEMPLATE = (Path(__file__).resolve().parents[1] / "src/inferencemesh/bundled" / TARGET_NAME
                 / "chat_template.jinja").read_text()
HELDOUT_EVERY = 20  # one file in twenty, chosen by path hash, is held out


@dataclass(frozen=True)
class ModelShape:
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    intermediate: int


TARGET_SHAPE = ModelShape(hidden=384, layers=8, heads=6, kv_heads=2, intermediate=1024)
DRAFT_SHAPE = ModelShape(hidden=256, layers=2, heads=4, kv_heads=2, intermediate=640)


def corpus_files() -> tuple[Path, list[str], list[str]]:
    """Return the stdlib root and its .py files split deterministically into train / held-out."""
    root = Path(sysconfig.get_paths()["stdlib"])
    rel = sorted(
        str(p.relative_to(root))
        for p in root.rglob("*.py")
        if "site-packages" not in p.parts and "__pycache__" not in p.parts
    )
    train, heldout = [], []
    for path in rel:
        bucket = int(hashlib.sha256(path.encode()).hexdigest(), 16) % HELDOUT_EVERY
        (heldout if bucket == 0 else train).append(path)
    return root, train, heldout


def read_texts(root: Path, paths: list[str]) -> list[str]:
    texts = []
    for path in paths:
        try:
            texts.append((root / path).read_text(encoding="utf-8"))
        except (UnicodeDecodeError, OSError):
            continue  # a few test fixtures are deliberately not UTF-8
    return texts


def train_tokenizer(texts: list[str], vocab_size: int) -> Tokenizer:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer)
    return tok


def wrap_tokenizer(tok: Tokenizer) -> PreTrainedTokenizerFast:
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token=EOS,
        eos_token=EOS,
        unk_token=None,
        pad_token="<|pad|>",
        additional_special_tokens=["<|im_start|>", "<|im_end|>"],
        model_max_length=2048,
        clean_up_tokenization_spaces=False,
    )
    fast.chat_template = CHAT_TEMPLATE
    return fast


def encode_corpus(tok: Tokenizer, texts: list[str]) -> torch.Tensor:
    eos_id = tok.token_to_id(EOS)
    ids: list[int] = []
    for enc in tok.encode_batch(texts):
        ids.extend(enc.ids)
        ids.append(eos_id)
    return torch.tensor(ids, dtype=torch.int32)


def build_model(shape: ModelShape, vocab_size: int, tok: Tokenizer, max_pos: int) -> LlamaForCausalLM:
    config = LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=shape.hidden,
        intermediate_size=shape.intermediate,
        num_hidden_layers=shape.layers,
        num_attention_heads=shape.heads,
        num_key_value_heads=shape.kv_heads,
        max_position_embeddings=max_pos,
        rope_theta=10000.0,
        rms_norm_eps=1e-5,
        tie_word_embeddings=True,
        bos_token_id=tok.token_to_id(EOS),
        eos_token_id=tok.token_to_id(EOS),
        pad_token_id=tok.token_to_id("<|pad|>"),
    )
    return LlamaForCausalLM(config)


def batches(data: torch.Tensor, seq_len: int, batch: int, gen: torch.Generator):
    while True:
        starts = torch.randint(0, len(data) - seq_len - 1, (batch,), generator=gen)
        rows = torch.stack([data[s : s + seq_len + 1] for s in starts.tolist()]).long()
        yield rows[:, :-1], rows[:, 1:]


def train_model(
    name: str,
    model: LlamaForCausalLM,
    data: torch.Tensor,
    *,
    steps: int,
    seq_len: int,
    batch: int,
    lr: float,
    seed: int,
    teacher: LlamaForCausalLM | None = None,
    distill_weight: float = 0.5,
) -> tuple[int, float]:
    """AdamW with warmup + cosine decay; with a teacher, blend in a KL term toward its logits.

    Distilling the draft toward the target raises how often their argmax agree, which is
    exactly the speculative acceptance rate the draft exists for.
    """
    gen = torch.Generator().manual_seed(seed)
    opt = torch.optim.AdamW(model.parameters(), lr=lr, betas=(0.9, 0.95), weight_decay=0.1)
    warmup = max(1, steps // 20)
    model.train()
    started = time.time()
    tokens = 0
    for step, (x, y) in zip(range(steps), batches(data, seq_len, batch, gen), strict=False):
        progress = (step - warmup) / max(1, steps - warmup)
        scale = (step + 1) / warmup if step < warmup else 0.5 * (1 + math.cos(math.pi * progress))
        for group in opt.param_groups:
            group["lr"] = lr * (0.1 + 0.9 * scale)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            logits = model(input_ids=x).logits.float()
        loss = F.cross_entropy(logits.view(-1, logits.size(-1)), y.reshape(-1))
        if teacher is not None:
            with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
                teacher_logits = teacher(input_ids=x).logits.float()
            kl = F.kl_div(
                F.log_softmax(logits, -1).view(-1, logits.size(-1)),
                F.log_softmax(teacher_logits, -1).view(-1, logits.size(-1)),
                log_target=True,
                reduction="batchmean",
            )
            loss = (1 - distill_weight) * loss + distill_weight * kl
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        tokens += x.numel()
        if step % 50 == 0 or step == steps - 1:
            rate = tokens / (time.time() - started)
            print(f"[{name}] step {step + 1}/{steps} loss {loss.item():.3f} ({rate:.0f} tok/s)", flush=True)
    model.eval()
    return tokens, time.time() - started


@torch.no_grad()
def heldout_windows(data: torch.Tensor, seq_len: int, count: int) -> torch.Tensor:
    stride = max(seq_len, (len(data) - seq_len - 1) // count)
    starts = list(range(0, len(data) - seq_len - 1, stride))[:count]
    return torch.stack([data[s : s + seq_len + 1] for s in starts]).long()


@torch.no_grad()
def evaluate(model: LlamaForCausalLM, windows: torch.Tensor) -> tuple[float, torch.Tensor]:
    """Mean held-out cross-entropy (nats/token) and the argmax prediction at every position."""
    losses, preds = [], []
    for chunk in windows.split(16):
        logits = model(input_ids=chunk[:, :-1]).logits.float()
        losses.append(F.cross_entropy(logits.reshape(-1, logits.size(-1)), chunk[:, 1:].reshape(-1), reduction="sum"))
        preds.append(logits.argmax(-1))
    return (sum(losses) / windows[:, 1:].numel()).item(), torch.cat(preds)


def unigram_loss(train: torch.Tensor, windows: torch.Tensor, vocab: int) -> float:
    counts = torch.bincount(train.long(), minlength=vocab).double() + 1.0  # add-one smoothing
    logp = (counts / counts.sum()).log()
    return -logp[windows[:, 1:].reshape(-1)].mean().item()


@torch.no_grad()
def greedy_sample(model: LlamaForCausalLM, tok: PreTrainedTokenizerFast, prompt: str, new_tokens: int) -> str:
    ids = tok(prompt, return_tensors="pt").input_ids
    out = model.generate(ids, max_new_tokens=new_tokens, do_sample=False, pad_token_id=tok.pad_token_id)
    return tok.decode(out[0, ids.shape[1] :])


def heldout_prompt(root: Path, heldout: list[str]) -> tuple[str, str]:
    """The first function definition of the first suitable held-out file, cut after its signature."""
    for path in heldout:
        text = (root / path).read_text(encoding="utf-8", errors="replace")
        at = text.find("\ndef ")
        if at >= 0:
            end = text.find("\n", text.find(":\n", at) + 1)
            return path, text[at + 1 : end + 1]
    raise RuntimeError("no held-out function found")


def save_model(model: LlamaForCausalLM, tok: PreTrainedTokenizerFast, out: Path, max_new: int) -> None:
    out.mkdir(parents=True, exist_ok=True)
    model.generation_config = GenerationConfig(
        bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id,
        do_sample=False, max_new_tokens=max_new,
    )
    model.to(torch.bfloat16).save_pretrained(out, safe_serialization=True)
    model.float()
    tok.save_pretrained(out)


def model_card(name: str, role: str, *, args: argparse.Namespace, stats: dict, sample: tuple[str, str, str]) -> str:
    path, prompt, completion = sample
    lines = [
        f"# {name}",
        "",
        f"{role} Llama-architecture model trained by InferenceMesh from the Python standard library's",
        "own source (PSF licence), so that it works fully offline. Not a general-purpose model.",
        "",
        "## How it was made",
        "",
        "```",
        f"python tools/train_bundled_models.py --out <dir> --seed {args.seed} "
        f"--target-steps {args.target_steps} --draft-steps {args.draft_steps}",
        "```",
        "",
        "| fact | value |",
        "|---|---|",
    ]
    lines += [f"| {k} | {v} |" for k, v in stats.items()]
    lines += [
        "",
        f"## Greedy sample (held-out file `{path}`)",
        "",
        "Prompt:",
        "",
        "```python",
        prompt.rstrip("\n"),
        "```",
        "",
        "Continuation:",
        "",
        "```python",
        completion,
        "```",
        "",
    ]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--seed", type=int, default=1234)
    parser.add_argument("--vocab-size", type=int, default=4096)
    parser.add_argument("--seq-len", type=int, default=256)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--target-steps", type=int, default=1200)
    parser.add_argument("--draft-steps", type=int, default=800)
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 2)
    args = parser.parse_args()

    torch.manual_seed(args.seed)
    random.seed(args.seed)
    torch.set_num_threads(args.threads)
    t0 = time.time()

    root, train_paths, heldout_paths = corpus_files()
    train_texts, heldout_texts = read_texts(root, train_paths), read_texts(root, heldout_paths)
    python = sys.version.split()[0]
    print(f"corpus: Python {python} stdlib, {len(train_texts)} train / {len(heldout_texts)} held-out files")
    raw_tok = train_tokenizer(train_texts, args.vocab_size)
    tok = wrap_tokenizer(raw_tok)
    vocab = raw_tok.get_vocab_size()
    train_ids = encode_corpus(raw_tok, train_texts)
    heldout_ids = encode_corpus(raw_tok, heldout_texts)
    print(f"tokenizer: vocab {vocab}; {len(train_ids):,} train / {len(heldout_ids):,} held-out tokens "
          f"({time.time() - t0:.0f}s)")

    max_pos = 2048
    target = build_model(TARGET_SHAPE, vocab, raw_tok, max_pos)
    draft = build_model(DRAFT_SHAPE, vocab, raw_tok, max_pos)
    n_target = sum(p.numel() for p in target.parameters())
    n_draft = sum(p.numel() for p in draft.parameters())
    print(f"target {n_target / 1e6:.1f}M params, draft {n_draft / 1e6:.1f}M params")

    common = dict(seq_len=args.seq_len, batch=args.batch)
    target_tokens, target_secs = train_model(
        "target", target, train_ids, steps=args.target_steps, lr=2e-3, seed=args.seed, **common
    )
    draft_tokens, draft_secs = train_model(
        "draft", draft, train_ids, steps=args.draft_steps, lr=3e-3, seed=args.seed + 1, teacher=target, **common
    )

    windows = heldout_windows(heldout_ids, args.seq_len, 96)
    target_loss, target_pred = evaluate(target, windows)
    draft_loss, draft_pred = evaluate(draft, windows)
    baseline = unigram_loss(train_ids, windows, vocab)
    agreement = (target_pred == draft_pred).float().mean().item()
    print(f"held-out loss (nats/token): target {target_loss:.3f} < draft {draft_loss:.3f} < unigram {baseline:.3f}")
    print(f"draft/target argmax agreement on held-out positions: {agreement:.3f}")
    if not target_loss < draft_loss < baseline:
        raise SystemExit("training did not reach target < draft < unigram; refusing to write models")

    path, prompt = heldout_prompt(root, heldout_paths)
    target_sample = greedy_sample(target, tok, prompt, 64)
    draft_sample = greedy_sample(draft, tok, prompt, 64)
    print(f"--- greedy target sample ({path}) ---\n{prompt}{target_sample}")

    target_dir, draft_dir = args.out / TARGET_NAME, args.out / DRAFT_NAME
    save_model(target, tok, target_dir, 256)
    save_model(draft, tok, draft_dir, 256)
    corpus = (f"Python {python} standard library source ({len(train_texts)} train / {len(heldout_texts)} "
              f"held-out files, 1 in {HELDOUT_EVERY} held out by SHA-256 of path)")
    shared = {
        "seed": args.seed,
        "corpus": corpus,
        "tokenizer": f"byte-level BPE, vocabulary {vocab}",
        "sequence length / batch": f"{args.seq_len} / {args.batch}",
        "unigram baseline held-out loss": f"{baseline:.3f} nats/token",
        "draft/target argmax agreement (held-out)": f"{agreement:.3f}",
    }
    (target_dir / "README.md").write_text(model_card(
        TARGET_NAME, "Target (default model of `inferencemesh serve`):", args=args,
        stats={"parameters": f"{n_target:,}", "shape": str(TARGET_SHAPE), "steps": args.target_steps,
               "tokens seen": f"{target_tokens:,}", "training time (2 CPU cores)": f"{target_secs / 60:.1f} min",
               "held-out loss": f"{target_loss:.3f} nats/token", **shared},
        sample=(path, prompt, target_sample)))
    (draft_dir / "README.md").write_text(model_card(
        DRAFT_NAME, f"Draft for `{TARGET_NAME}` (same tokenizer), distilled toward the target:", args=args,
        stats={"parameters": f"{n_draft:,}", "shape": str(DRAFT_SHAPE), "steps": args.draft_steps,
               "tokens seen": f"{draft_tokens:,}", "training time (2 CPU cores)": f"{draft_secs / 60:.1f} min",
               "held-out loss": f"{draft_loss:.3f} nats/token", **shared},
        sample=(path, prompt, draft_sample)))
    package = {
        "name": TARGET_NAME,
        "generation": {
            "speculative_decoding": {
                "default": "bundled-draft",
                "strategies": {
                    "bundled-draft": {
                        "type": "draft-model",
                        "draft_model": f"../{DRAFT_NAME}",
                        "window_policy": {"default": "adaptive", "initial_window": 4, "min_window": 1, "max_window": 8},
                    }
                },
            }
        },
    }
    (target_dir / "model-package.json").write_text(json.dumps(package, indent=2) + "\n")
    print(f"wrote {target_dir} and {draft_dir} in {(time.time() - t0) / 60:.1f} min")


if __name__ == "__main__":
    main()
