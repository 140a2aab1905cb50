"""ModelConfig: the parts of a Hugging Face config.json that the engine needs, checked."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from swiftserve.errors import CheckpointError

SUPPORTED_ARCHITECTURES = ("LlamaForCausalLM", "Qwen2ForCausalLM", "MistralForCausalLM")
SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3")


__all__ = ["CheckpointError", "ModelConfig"]


@dataclass(frozen=True)
class ModelConfig:
    """Architecture hyper-parameters of a Llama-family checkpoint."""

    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    max_position_embeddings: int
    rope_theta: float
    rope_scaling: dict[str, Any] = field(default_factory=dict)
    attention_bias: bool = False
    tie_word_embeddings: bool = False
    sliding_window: int | None = None
    torch_dtype: str | None = None
    eos_token_ids: tuple[int, ...] = ()

    @classmethod
    def from_dir(cls, path: str | Path) -> ModelConfig:
        """Read and validate ``config.json`` (and ``generation_config.json`` for EOS)."""
        path = Path(path)
        cfg_file = path / "config.json"
        if not cfg_file.is_file():
            raise CheckpointError(f"{path}: no config.json (is this a Hugging Face checkpoint?)")
        try:
            raw = json.loads(cfg_file.read_text())
        except json.JSONDecodeError as e:
            raise CheckpointError(f"{cfg_file}: not valid JSON ({e})") from e
        gen_file = path / "generation_config.json"
        gen = json.loads(gen_file.read_text()) if gen_file.is_file() else {}
        return cls.from_dict(raw, gen, source=str(cfg_file))

    @classmethod
    def from_dict(cls, raw: dict[str, Any], gen: dict[str, Any], source: str = "config") -> ModelConfig:
        archs = raw.get("architectures") or []
        arch = next((a for a in archs if a in SUPPORTED_ARCHITECTURES), None)
        if arch is None:
            raise CheckpointError(
                f"{source}: architecture {archs or raw.get('model_type')!r} is not supported; "
                f"supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
            )
        missing = [
            k
            for k in (
                "vocab_size",
                "hidden_size",
                "intermediate_size",
                "num_hidden_layers",
                "num_attention_heads",
            )
            if k not in raw
        ]
        if missing:
            raise CheckpointError(f"{source}: missing keys {missing}")
        if raw.get("hidden_act", "silu") != "silu":
            raise CheckpointError(f"{source}: hidden_act {raw['hidden_act']!r} not supported (silu)")
        num_heads = raw["num_attention_heads"]
        rope = dict(raw.get("rope_parameters") or raw.get("rope_scaling") or {})
        rope_type = rope.get("rope_type", rope.get("type", "default"))
        if rope_type not in SUPPORTED_ROPE_TYPES:
            raise CheckpointError(
                f"{source}: rope type {rope_type!r} not supported; "
                f"supported: {', '.join(SUPPORTED_ROPE_TYPES)}"
            )
        rope["rope_type"] = rope_type
        theta = rope.get("rope_theta", raw.get("rope_theta", 10000.0))
        use_window = raw.get("use_sliding_window", arch == "MistralForCausalLM")
        window = raw.get("sliding_window") if use_window else None
        eos = gen.get("eos_token_id", raw.get("eos_token_id"))
        eos_ids = tuple(eos) if isinstance(eos, list) else ((eos,) if eos is not None else ())
        return cls(
            architecture=arch,
            vocab_size=raw["vocab_size"],
            hidden_size=raw["hidden_size"],
            intermediate_size=raw["intermediate_size"],
            num_layers=raw["num_hidden_layers"],
            num_heads=num_heads,
            num_kv_heads=raw.get("num_key_value_heads") or num_heads,
            head_dim=raw.get("head_dim") or raw["hidden_size"] // num_heads,
            rms_norm_eps=raw.get("rms_norm_eps", 1e-6),
            max_position_embeddings=raw.get("max_position_embeddings", 2048),
            rope_theta=float(theta),
            rope_scaling=rope,
            attention_bias=bool(raw.get("attention_bias", arch == "Qwen2ForCausalLM")),
            tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
            sliding_window=window,
            torch_dtype=raw.get("dtype") or raw.get("torch_dtype"),
            eos_token_ids=eos_ids,
        )

    def kv_bytes_per_token(self, row_bytes: int) -> int:
        """Bytes of K and V cache per token over all layers, for rows (one token of one KV head)
        of ``row_bytes`` (model/kv_quant.py bytes_per_row)."""
        return 2 * self.num_layers * self.num_kv_heads * row_bytes


ENCODER_TYPES = ("bert", "roberta", "xlm-roberta", "distilbert", "mpnet", "electra")


def is_encoder_checkpoint(path: str | Path) -> bool:
    """True if config.json describes an encoder we embed with (not a causal LM)."""
    cfg_file = Path(path) / "config.json"
    if not cfg_file.is_file():
        return False
    cfg = json.loads(cfg_file.read_text())
    return cfg.get("model_type") in ENCODER_TYPES
