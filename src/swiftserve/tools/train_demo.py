"""``swiftserve train-demo``: train the small demo Llama on the Python standard library.

Reproducible: the tokenizer, the data order and the initialisation are seeded, the number of
steps is fixed (never "as many as fit in N minutes"), and torch runs on a fixed number of
threads (floating-point sums depend on how work is split). Training runs the Hugging Face
``LlamaForCausalLM`` itself in bfloat16 autocast (2.3x faster than float32 here, with float32
master weights), so the checkpoint it writes is by construction one ``transformers`` reads.
"""

from __future__ import annotations

import json
import math
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np

from swiftserve.tools.corpus import HELDOUT_MODULUS, read_texts, split_files

DEMO_SAMPLING = {"do_sample": True, "temperature": 0.7, "top_p": 0.9, "repetition_penalty": 1.1}


@dataclass(frozen=True)
class TrainConfig:
    """Model shape and optimisation settings of the demo model (about 12M parameters)."""

    vocab_size: int = 6144
    hidden_size: int = 384
    intermediate_size: int = 1024
    num_hidden_layers: int = 6
    num_attention_heads: int = 6
    num_key_value_heads: int = 2
    max_position_embeddings: int = 2048
    seq_len: int = 256
    batch_size: int = 16
    steps: int = 600
    peak_lr: float = 2e-3
    min_lr_ratio: float = 0.1
    warmup_steps: int = 30
    weight_decay: float = 0.1
    grad_clip: float = 1.0
    seed: int = 0
    threads: int = 2
    save_dtype: str = "bfloat16"

    def lr_at(self, step: int) -> float:
        """Linear warm-up, then cosine decay to ``min_lr_ratio * peak_lr``."""
        if step < self.warmup_steps:
            return self.peak_lr * (step + 1) / self.warmup_steps
        progress = (step - self.warmup_steps) / max(1, self.steps - self.warmup_steps)
        cosine = 0.5 * (1 + math.cos(math.pi * min(1.0, progress)))
        return self.peak_lr * (self.min_lr_ratio + (1 - self.min_lr_ratio) * cosine)


# ``--preset draft``: a two-layer model on the same corpus with the demo model's own tokenizer,
# the draft for speculative decoding with the demo model as target (about 3M parameters).
DRAFT_CONFIG = TrainConfig(
    hidden_size=256, intermediate_size=768, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2
)
PRESETS = {"demo": TrainConfig(), "draft": DRAFT_CONFIG}


def _token_stream(tokenizer: Any, texts: list[str]) -> np.ndarray:
    """All training files as one token array, documents separated by <|endoftext|>."""
    sep = tokenizer.convert_tokens_to_ids("<|endoftext|>")
    encoded = tokenizer(texts, add_special_tokens=False)["input_ids"]
    total = sum(len(ids) + 1 for ids in encoded)
    stream = np.empty(total, dtype=np.int32)
    pos = 0
    for ids in encoded:
        stream[pos : pos + len(ids)] = ids
        stream[pos + len(ids)] = sep
        pos += len(ids) + 1
    return stream


def _build_model(cfg: TrainConfig, tokenizer: Any) -> Any:
    import torch
    import transformers

    from swiftserve.tools.demo import model_config

    shape = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
             "num_key_value_heads", "max_position_embeddings")  # fmt: skip
    config = model_config(
        transformers.LlamaConfig, tokenizer, tie_word_embeddings=True, **{k: getattr(cfg, k) for k in shape}
    )
    torch.manual_seed(cfg.seed)
    return transformers.LlamaForCausalLM(config)


def _optimizer(model: Any, cfg: TrainConfig) -> Any:
    """AdamW; no weight decay on norms (1-D parameters)."""
    import torch

    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    groups = [{"params": decay, "weight_decay": cfg.weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=cfg.peak_lr, betas=(0.9, 0.95), eps=1e-8)


def _train_loop(model: Any, stream: np.ndarray, cfg: TrainConfig, progress: bool) -> list[float]:
    """Run ``cfg.steps`` optimiser steps on random windows of the stream; returns the losses."""
    import torch
    from tqdm.auto import tqdm

    rng = np.random.default_rng(cfg.seed)
    optimizer = _optimizer(model, cfg)
    model.train()
    losses: list[float] = []
    bar = tqdm(range(cfg.steps), desc="Training demo model", unit="step", disable=not progress)
    for step in bar:
        # Hugging Face shifts the labels itself: labels == input_ids trains next-token prediction.
        starts = rng.integers(0, len(stream) - cfg.seq_len, size=cfg.batch_size)
        batch = torch.from_numpy(np.stack([stream[s : s + cfg.seq_len] for s in starts]).astype(np.int64))
        for group in optimizer.param_groups:
            group["lr"] = cfg.lr_at(step)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = model(input_ids=batch, labels=batch).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(loss.detach().item())
        bar.set_postfix(loss=f"{sum(losses[-20:]) / len(losses[-20:]):.3f}")
    bar.close()
    return losses


def train_demo(
    out: str | Path,
    cfg: TrainConfig | None = None,
    progress: bool = True,
    max_files: int | None = None,
    tokenizer_from: str | Path | None = None,
) -> Path:
    """Train the demo model and write a Hugging Face checkpoint directory to ``out``.

    ``max_files`` keeps only the first training files (for quick tests). ``tokenizer_from``:
    a checkpoint whose tokenizer to use as it is instead of training one (a draft model must
    share its target's token ids exactly).
    """
    import torch

    cfg = cfg or TrainConfig()
    started = time.perf_counter()
    torch.set_num_threads(cfg.threads)
    train_files, heldout_files = split_files()
    train_files = train_files[:max_files]
    texts = list(read_texts(train_files))
    if progress:
        print(f"Corpus: {len(texts)} train files, {len(heldout_files)} held out; training the tokenizer...")
    tokenizer = _tokenizer(cfg, texts, tokenizer_from)
    stream = _token_stream(tokenizer, texts)
    model = _build_model(cfg, tokenizer)
    params = sum(p.numel() for p in model.parameters())
    if progress:
        print(f"{len(stream):,} training tokens; model {params / 1e6:.1f}M parameters; {cfg.steps} steps")
    losses = _train_loop(model, stream, cfg, progress)
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    model.eval()
    # Default sampling for requests that leave it unset (the server reads generation_config.json
    # as vLLM does): a 12M-parameter model loops under greedy decoding.
    model.generation_config.update(**DEMO_SAMPLING)
    model.to(getattr(torch, cfg.save_dtype)).save_pretrained(out)
    tokenizer.save_pretrained(out)
    report = {
        "config": asdict(cfg),
        "parameters": params,
        "train_files": len(texts),
        "heldout_files": len(heldout_files),
        "heldout_rule": f"crc32(path relative to stdlib) % {HELDOUT_MODULUS} == 0",
        "train_tokens_available": len(stream),
        "tokens_seen": cfg.steps * cfg.batch_size * cfg.seq_len,
        "final_loss": sum(losses[-20:]) / len(losses[-20:]),
        "losses_every_20": losses[::20],
        "elapsed_s": round(time.perf_counter() - started, 1),
        "torch": torch.__version__,
        "tokenizer_from": str(tokenizer_from) if tokenizer_from else None,
    }
    (out / "training.json").write_text(json.dumps(report, indent=2) + "\n")
    if progress:
        print(f"Saved to {out} in {report['elapsed_s']} s; final loss {report['final_loss']:.3f}")
    return out


def _tokenizer(cfg: TrainConfig, texts: list[str], tokenizer_from: str | Path | None) -> Any:
    from swiftserve.tools.demo import build_tokenizer

    if tokenizer_from is None:
        return build_tokenizer(cfg.vocab_size, texts)
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(tokenizer_from))
    if len(tokenizer) != cfg.vocab_size:
        raise ValueError(
            f"the tokenizer of {tokenizer_from} has {len(tokenizer)} tokens, not {cfg.vocab_size}"
        )
    return tokenizer
