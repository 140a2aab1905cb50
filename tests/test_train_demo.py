"""``train-demo`` is reproducible and writes a checkpoint both swiftserve and transformers load."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from swiftserve import LLM, SamplingParams
from swiftserve.tools.train_demo import TrainConfig, train_demo

TINY = replace(
    TrainConfig(),
    vocab_size=512,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=256,
    seq_len=32,
    batch_size=4,
    steps=3,
    warmup_steps=1,
)


def test_learning_rate_schedule() -> None:
    cfg = TrainConfig()
    assert cfg.lr_at(0) == pytest.approx(cfg.peak_lr / cfg.warmup_steps)
    assert cfg.lr_at(cfg.warmup_steps) == pytest.approx(cfg.peak_lr)
    assert cfg.lr_at(cfg.steps) == pytest.approx(cfg.peak_lr * cfg.min_lr_ratio)


def test_training_is_reproducible_and_loadable(tmp_path: Path) -> None:
    a = train_demo(tmp_path / "a", TINY, progress=False, max_files=12)
    b = train_demo(tmp_path / "b", TINY, progress=False, max_files=12)
    assert (a / "model.safetensors").read_bytes() == (b / "model.safetensors").read_bytes()
    assert (a / "tokenizer.json").read_text() == (b / "tokenizer.json").read_text()
    # The engine and transformers agree on the written checkpoint (greedy, float32).
    llm = LLM(str(a), progress=False, dtype="float32")
    prompt = llm.tokenizer.encode("def main():\n", add_special_tokens=False)
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    ours = llm.generate({"prompt_token_ids": prompt}, params, use_tqdm=False)
    hf = AutoModelForCausalLM.from_pretrained(a, dtype=torch.float32)
    # Plain greedy: override the sampling defaults the checkpoint's generation_config names.
    ref = hf.generate(
        torch.tensor([prompt]),
        max_new_tokens=8,
        do_sample=False,
        repetition_penalty=1.0,
        eos_token_id=None,
        pad_token_id=0,
    )
    assert ours[0].outputs[0].token_ids == ref[0, len(prompt) :].tolist()


def test_draft_preset_shares_the_target_tokenizer_and_drafts_for_it(tmp_path: Path) -> None:
    """``train-demo --preset draft``: the demo model's tokenizer as it is (same ids), and the
    checkpoint serves as the demo model's speculative draft (exact greedy output)."""
    from swiftserve.engine.model_source import demo_model_dir
    from swiftserve.tools.train_demo import DRAFT_CONFIG

    cfg = replace(
        DRAFT_CONFIG, max_position_embeddings=2048, seq_len=32, batch_size=4, steps=2, warmup_steps=1
    )
    draft = train_demo(tmp_path / "draft", cfg, progress=False, max_files=4, tokenizer_from=demo_model_dir())
    assert (draft / "tokenizer.json").read_text() == (demo_model_dir() / "tokenizer.json").read_text()
    prompts = [{"prompt_token_ids": list(range(30, 60))}, {"prompt_token_ids": [5, 6, 7] * 8}]
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    spec = {"model": str(draft), "num_speculative_tokens": 3, "adaptive": False}
    llm = LLM(str(demo_model_dir()), speculative_config=spec, progress=False)
    plain = LLM(str(demo_model_dir()), progress=False).generate(prompts, params, use_tqdm=False)
    ours = llm.generate(prompts, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in ours] == [o.outputs[0].token_ids for o in plain]
    assert llm.engine.scheduler.spec.num_draft_tokens > 0
