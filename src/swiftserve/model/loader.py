"""Load a Hugging Face checkpoint directory (safetensors only: weights are never unpickled)."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import torch
from safetensors import safe_open
from tqdm.auto import tqdm

from swiftserve.model.config import CheckpointError, ModelConfig
from swiftserve.model.llama import LlamaForCausalLM

logger = logging.getLogger(__name__)

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
# Hugging Face tensor suffix -> (our fused tensor suffix, shard index) within a layer.
_FUSED = {
    "self_attn.q_proj": ("self_attn.qkv_proj", 0),
    "self_attn.k_proj": ("self_attn.qkv_proj", 1),
    "self_attn.v_proj": ("self_attn.qkv_proj", 2),
    "mlp.gate_proj": ("mlp.gate_up_proj", 0),
    "mlp.up_proj": ("mlp.gate_up_proj", 1),
}


def resolve_dtype(name: str, cfg: ModelConfig) -> torch.dtype:
    """ "auto" takes the checkpoint's dtype (float32 when it names none)."""
    if name == "auto":
        name = cfg.torch_dtype if cfg.torch_dtype in DTYPES else "float32"
    if name not in DTYPES:
        raise ValueError(f"dtype must be one of auto, {', '.join(DTYPES)}; got {name!r}")
    return DTYPES[name]


def weight_files(path: Path) -> list[Path]:
    """The safetensors files of a checkpoint, single or sharded."""
    index = path / "model.safetensors.index.json"
    if index.is_file():
        weight_map = json.loads(index.read_text()).get("weight_map", {})
        files = sorted({path / name for name in weight_map.values()})
        missing = [f.name for f in files if not f.is_file()]
        if missing:
            raise CheckpointError(f"{path}: shards listed in the index are missing: {missing}")
        return files
    single = path / "model.safetensors"
    if single.is_file():
        return [single]
    if any(path.glob("*.bin")) or any(path.glob("*.pt")):
        raise CheckpointError(
            f"{path}: only pickle weights (*.bin/*.pt) found; swiftserve loads safetensors only"
        )
    raise CheckpointError(f"{path}: no model.safetensors or model.safetensors.index.json")


def _shard_bounds(cfg: ModelConfig, fused: str, index: int) -> tuple[int, int]:
    if fused.endswith("qkv_proj"):
        q = cfg.num_heads * cfg.head_dim
        kv = cfg.num_kv_heads * cfg.head_dim
        return [(0, q), (q, q + kv), (q + kv, q + 2 * kv)][index]
    inter = cfg.intermediate_size
    return (index * inter, (index + 1) * inter)


def _target(name: str, cfg: ModelConfig) -> tuple[str, tuple[int, int] | None] | None:
    """Our parameter name (and row range in a fused weight) for a checkpoint tensor."""
    if name.endswith("rotary_emb.inv_freq"):
        return None
    if name == "lm_head.weight" and cfg.tie_word_embeddings:
        return None
    for hf, (ours, index) in _FUSED.items():
        marker = f".{hf}."
        if marker in name:
            return name.replace(marker, f".{ours}."), _shard_bounds(cfg, ours, index)
    return name, None


def load_model(
    path: str | Path,
    dtype: str = "auto",
    max_positions: int | None = None,
    progress: bool = True,
    device: torch.device | str = "cpu",
    load_format: str = "auto",
) -> LlamaForCausalLM:
    """Build the model on the meta device, allocate it on ``device``, and fill it from the
    checkpoint's safetensors, one tensor at a time (``load_format="dummy"``: seeded random
    weights from config.json alone, for benchmarks of big shapes)."""
    path = Path(path)
    cfg = ModelConfig.from_dir(path)
    torch_dtype = resolve_dtype(dtype, cfg)
    with torch.device("meta"):
        model = LlamaForCausalLM(cfg)
    _materialize(model, torch_dtype, torch.device(device))
    if cfg.tie_word_embeddings:
        model.tie_weights()
    if load_format == "dummy":
        _fill_dummy(model)
    else:
        _load_checkpoint(path, model, cfg, progress)
    model.init_rotary(max_positions or cfg.max_position_embeddings)
    model.eval()
    return model


def _materialize(model: torch.nn.Module, dtype: torch.dtype, device: torch.device) -> None:
    """Give every meta parameter and buffer uninitialized storage on ``device`` at ``dtype``.

    What ``model.to(dtype).to_empty(device)`` does, minus its cost: those route meta tensors
    through torch's reference ops, whose first use imports sympy (~0.8 s of start-up).
    """
    for module in model.modules():
        for slots in (module._parameters, module._buffers):
            for name, t in slots.items():
                if t is None or not t.is_meta:
                    continue
                kind = dtype if t.is_floating_point() else t.dtype
                new = torch.empty(t.shape, dtype=kind, device=device)
                is_param = name in module._parameters
                slots[name] = torch.nn.Parameter(new, requires_grad=False) if is_param else new  # type: ignore[assignment]


def _fill_dummy(model: LlamaForCausalLM) -> None:
    """Seeded random weights: N(0, 0.02) for matrices, ones for norms (finite activations)."""
    gen = torch.Generator(device=model.lm_head.weight.device).manual_seed(0)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                param.fill_(1.0)
            elif param.dim() >= 2 or name.endswith("bias"):
                param.normal_(0.0, 0.02, generator=gen)


def _load_checkpoint(path: Path, model: LlamaForCausalLM, cfg: ModelConfig, progress: bool) -> None:
    params = dict(model.named_parameters())
    expected = {(n, None) for n in params}
    loaded: set[tuple[str, tuple[int, int] | None]] = set()
    files = weight_files(path)
    names: list[tuple[Path, str]] = []
    for file in files:
        with safe_open(str(file), framework="pt") as f:
            names.extend((file, key) for key in f.keys())  # noqa: SIM118
    bar = tqdm(total=len(names), desc="Loading weights", unit="tensor", disable=not progress)
    for file in files:
        with safe_open(str(file), framework="pt") as f:
            for key in f.keys():  # noqa: SIM118
                _load_tensor(key, f.get_tensor(key), cfg, params, loaded)
                bar.update(1)
    bar.close()
    _check_complete(path, params, expected, loaded, cfg)


def _load_tensor(key, tensor, cfg, params, loaded) -> None:  # type: ignore[no-untyped-def]
    target = _target(key, cfg)
    if target is None:
        return
    name, bounds = target
    param = params.get(name)
    if param is None:
        raise CheckpointError(f"unexpected tensor {key!r} in checkpoint (no such parameter)")
    dest = param.data if bounds is None else param.data[bounds[0] : bounds[1]]
    if tuple(dest.shape) != tuple(tensor.shape):
        raise CheckpointError(f"tensor {key!r} has shape {tuple(tensor.shape)}, expected {tuple(dest.shape)}")
    dest.copy_(tensor)
    loaded.add((name, bounds))


def _check_complete(path, params, expected, loaded, cfg) -> None:  # type: ignore[no-untyped-def]
    missing = []
    for name, _ in sorted(expected):
        if name == "lm_head.weight" and cfg.tie_word_embeddings:
            continue
        parts = [b for (n, b) in loaded if n == name]
        if name.endswith(("qkv_proj.weight", "qkv_proj.bias")):
            ok = len(parts) == 3
        elif name.endswith("gate_up_proj.weight"):
            ok = len(parts) == 2
        else:
            ok = (name, None) in loaded
        if not ok:
            missing.append(name)
    if missing:
        shown = ", ".join(missing[:8]) + (" ..." if len(missing) > 8 else "")
        raise CheckpointError(f"{path}: checkpoint is missing {len(missing)} tensor(s): {shown}")
