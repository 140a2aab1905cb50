"""Random Llama-family checkpoints in real Hugging Face layout, and where the demo model lives.

The built-in demo (``make serve`` without ``--model``) is the trained checkpoint shipped in
``swiftserve/demo_model`` (see ``train_demo.py`` and the README). The random checkpoints here
serve benchmarks (the SmolLM-135M-shaped preset) and tests. Everything is deterministic: the
tokenizer is a byte-level BPE trained on a fixed slice of this Python's standard library,
the weights come from a seeded ``transformers`` initialisation.
"""

from __future__ import annotations

import json
import sysconfig
from collections.abc import Iterable
from pathlib import Path
from typing import Any

SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
# ChatML, plus Qwen2.5's (Hermes) way of offering tools and replaying tool calls and results;
# a conversation without tools renders exactly as plain ChatML.
CHAT_TEMPLATE = (
    "{% if tools %}<|im_start|>system\n"
    "{% if messages and messages[0]['role'] == 'system' %}{{ messages[0]['content'] }}\n\n{% endif %}"
    "# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
    "You are provided with function signatures within <tools></tools> XML tags:\n<tools>\n"
    "{% for tool in tools %}{{ tool | tojson }}\n{% endfor %}</tools>\n\n"
    "For each function call, return a json object with function name and arguments within "
    "<tool_call></tool_call> XML tags:\n<tool_call>\n"
    '{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call><|im_end|>\n'
    "{% endif %}{% for message in messages %}"
    "{% if tools and loop.first and message['role'] == 'system' %}"
    "{% elif message['role'] == 'assistant' and message['tool_calls'] is defined %}"
    "<|im_start|>assistant\n{% if message['content'] %}{{ message['content'] }}\n{% endif %}"
    "{% for call in message['tool_calls'] %}"
    "{% set f = call['function'] if call['function'] is defined else call %}"
    '<tool_call>\n{"name": {{ f[\'name\'] | tojson }}, "arguments": '
    "{% if f['arguments'] is string %}{{ f['arguments'] }}{% else %}{{ f['arguments'] | tojson }}{% endif %}"
    "}\n</tool_call>{% if not loop.last %}{{ '\\n' }}{% endif %}{% endfor %}<|im_end|>\n"
    "{% elif message['role'] == 'tool' %}"
    "<|im_start|>user\n<tool_response>\n{{ message['content'] }}\n</tool_response><|im_end|>\n"
    "{% else %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n{% endif %}"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
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


def write_random_encoder(out: str | Path, seed: int = 0) -> Path:
    """A tiny random BERT with a WordPiece tokenizer and sentence-transformers modules."""
    import torch
    from tokenizers import BertWordPieceTokenizer
    from transformers import BertConfig, BertModel, BertTokenizerFast  # type: ignore[attr-defined]

    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    wp = BertWordPieceTokenizer(lowercase=True)
    wp.train_from_iterator(_corpus(), vocab_size=1000, show_progress=False)
    wp.save_model(str(out))
    tokenizer = BertTokenizerFast(vocab_file=str(out / "vocab.txt"), do_lower_case=True)
    torch.manual_seed(seed)
    config = BertConfig(
        vocab_size=tokenizer.vocab_size,
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        intermediate_size=128,
        max_position_embeddings=128,
    )
    BertModel(config).eval().save_pretrained(out)
    tokenizer.save_pretrained(out)
    (out / "modules.json").write_text(
        json.dumps(
            [
                {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
                {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"},
                {
                    "idx": 2,
                    "name": "2",
                    "path": "2_Normalize",
                    "type": "sentence_transformers.models.Normalize",
                },
            ]
        )
    )
    (out / "1_Pooling").mkdir(exist_ok=True)
    (out / "1_Pooling" / "config.json").write_text(
        json.dumps(
            {
                "word_embedding_dimension": 64,
                "pooling_mode_mean_tokens": True,
                "pooling_mode_cls_token": False,
                "pooling_mode_max_tokens": False,
                "pooling_mode_mean_sqrt_len_tokens": False,
            }
        )
    )
    (out / "sentence_bert_config.json").write_text(
        json.dumps({"max_seq_length": 128, "do_lower_case": False})
    )
    return out
