"""Checkpoint loading: sharded files, tied embeddings, and clear errors for broken checkpoints."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from swiftserve.model.config import CheckpointError, ModelConfig
from swiftserve.model.loader import load_model


def copy_checkpoint(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def test_sharded_checkpoint_loads(model_dirs: dict[str, Path]) -> None:
    path = model_dirs["llama_tied_sharded"]
    assert (path / "model.safetensors.index.json").is_file()
    model = load_model(path, progress=False)
    assert model.lm_head.weight is model.model.embed_tokens.weight


def test_unsupported_architecture_names_supported(llama_dir: Path, tmp_path: Path) -> None:
    path = copy_checkpoint(llama_dir, tmp_path / "m")
    cfg = json.loads((path / "config.json").read_text())
    cfg["architectures"] = ["GPT2LMHeadModel"]
    (path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(CheckpointError, match="LlamaForCausalLM, Qwen2ForCausalLM, MistralForCausalLM"):
        ModelConfig.from_dir(path)


def test_unsupported_rope_type(llama_dir: Path, tmp_path: Path) -> None:
    path = copy_checkpoint(llama_dir, tmp_path / "m")
    cfg = json.loads((path / "config.json").read_text())
    cfg["rope_parameters"] = {"rope_type": "yarn", "factor": 4.0, "rope_theta": 10000.0}
    (path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(CheckpointError, match="yarn"):
        ModelConfig.from_dir(path)


def test_missing_files(llama_dir: Path, tmp_path: Path) -> None:
    with pytest.raises(CheckpointError, match=r"config\.json"):
        ModelConfig.from_dir(tmp_path)
    path = copy_checkpoint(llama_dir, tmp_path / "m")
    (path / "model.safetensors").unlink()
    with pytest.raises(CheckpointError, match=r"model\.safetensors"):
        load_model(path, progress=False)
    (path / "pytorch_model.bin").write_bytes(b"not loaded")
    with pytest.raises(CheckpointError, match="safetensors only"):
        load_model(path, progress=False)


def test_missing_tensor_is_named(llama_dir: Path, tmp_path: Path) -> None:
    from safetensors.torch import load_file, save_file

    path = copy_checkpoint(llama_dir, tmp_path / "m")
    tensors = load_file(str(path / "model.safetensors"))
    del tensors["model.layers.1.self_attn.k_proj.weight"]
    save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(CheckpointError, match=r"layers\.1\.self_attn\.qkv_proj"):
        load_model(path, progress=False)


def test_wrong_shape_is_named(llama_dir: Path, tmp_path: Path) -> None:
    from safetensors.torch import load_file, save_file

    path = copy_checkpoint(llama_dir, tmp_path / "m")
    tensors = load_file(str(path / "model.safetensors"))
    tensors["model.norm.weight"] = tensors["model.norm.weight"][:-1].clone()
    save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(CheckpointError, match=r"model\.norm\.weight.*shape"):
        load_model(path, progress=False)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16", "auto"])
def test_dtypes(llama_dir: Path, dtype: str) -> None:
    import torch

    model = load_model(llama_dir, dtype, progress=False)
    expected = torch.float32 if dtype == "auto" else getattr(torch, dtype)
    assert model.lm_head.weight.dtype == expected
