"""Random Llama-family checkpoints in real Hugging Face layout, and where the demo model lives.

The built-in demo (``make serve`` without ``--model``) is the trained checkpoint shipped in
``swiftserve/demo_model`` (see ``train_demo.py`` and the README). The random checkpoints here
serve benchmarks (the SmolLM-135M-shaped preset) and tests. Everything is deterministic: the
tokenizer is a byte-level BPE trained on a fixed slice of this Python's standard library,
the weights come from a seeded ``transformers`` initialisation.
"""

from __future__ import annotations

import sysconfig
from collections.abc import Iterable
from pathlib import Path
from typing import Any

SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}"
    "<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
PRESETS: dict[str, dict[str, Any]] = {
    "demo": dict(
        hidden_size=256,
        intermediate_size=688,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=4096,
        max_position_embeddings=2048,
        tie_word_embeddings=True,
    ),
    "smollm-135m": dict(
        hidden_size=576,
        intermediate_size=1536,
        num_hidden_layers=30,
        num_attention_heads=9,
        num_key_value_heads=3,
        vocab_size=8192,
        max_position_embeddings=2048,
        tie_word_embeddings=True,
    ),
    "tiny": dict(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=512,
        max_position_embeddings=512,
    ),
}
_CORPUS_FILES = (
    "argparse.py",
    "ast.py",
    "collections/__init__.py",
    "dataclasses.py",
    "inspect.py",
    "json/decoder.py",
    "logging/__init__.py",
    "pathlib.py",
    "re/_parser.py",
    "typing.py",
)


def _corpus() -> list[str]:
    root = Path(sysconfig.get_paths()["stdlib"])
    lines: list[str] = []
    for name in _CORPUS_FILES:
        file = root / name
        if file.is_file():
            lines.extend(file.read_text(encoding="utf-8", errors="replace").splitlines(keepends=True))
    return lines or ["def f(x):\n    return x\n"]


def build_tokenizer(vocab_size: int, texts: Iterable[str] | None = None) -> Any:
    """A byte-level BPE tokenizer (HF fast tokenizer) with a ChatML chat template.

    Trained on ``texts`` (default: a fixed slice of the stdlib, enough for random models).
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts if texts is not None else _corpus(), trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        chat_template=CHAT_TEMPLATE,
        clean_up_tokenization_spaces=False,
    )


def model_config(config_cls: Any, tokenizer: Any, **params: Any) -> Any:
    """A ``transformers`` config whose special token ids are the ChatML tokenizer's."""
    eos = tokenizer.convert_tokens_to_ids(["<|im_end|>", "<|endoftext|>"])
    return config_cls(**params, eos_token_id=eos, bos_token_id=None, pad_token_id=eos[1])


def write_random_checkpoint(
    out: str | Path,
    *,
    preset: str = "tiny",
    architecture: str = "llama",
    dtype: str = "float32",
    seed: int = 0,
    max_shard_size: str | None = None,
    **overrides: Any,
) -> Path:
    """Save a seeded random model + tokenizer to ``out`` (config.json, safetensors, tokenizer)."""
    import torch
    import transformers

    if preset not in PRESETS:
        raise ValueError(f"preset must be one of {sorted(PRESETS)}, got {preset!r}")
    config_cls = {
        "llama": transformers.LlamaConfig,
        "qwen2": transformers.Qwen2Config,
        "mistral": transformers.MistralConfig,
    }[architecture]
    params = {**PRESETS[preset], **overrides}
    tokenizer = build_tokenizer(params["vocab_size"])
    config = model_config(config_cls, tokenizer, **params)
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model = model.to(getattr(torch, dtype))
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    kwargs = {"max_shard_size": max_shard_size} if max_shard_size else {}
    model.save_pretrained(out, **kwargs)
    tokenizer.save_pretrained(out)
    return out


DEMO_MODEL_DIR = Path(__file__).with_name("demo_model")


def demo_model_dir() -> Path:
    """The built-in demo: the trained checkpoint shipped in the package (``swiftserve train-demo``)."""
    if (DEMO_MODEL_DIR / "config.json").is_file():
        return DEMO_MODEL_DIR
    raise ValueError(
        f"the built-in demo model is missing ({DEMO_MODEL_DIR}); pass --model DIR, or recreate it "
        f"with `swiftserve train-demo --out {DEMO_MODEL_DIR}` (about 13 minutes on 2 cores)"
    )


def resolve_model(model: str | None) -> Path:
    """A checkpoint directory for ``model`` (the demo when None)."""
    if model is None:
        return demo_model_dir()
    path = Path(model).expanduser()
    if not path.is_dir():
        raise ValueError(f"model: {model!r} is not a local checkpoint directory (no hub access)")
    return path
