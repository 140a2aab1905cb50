"""Llama-family decoder (Llama 2/3, Qwen2, Mistral) over a flat token batch and a paged KV cache.

q/k/v and gate/up projections are fused (one GEMM each) to cut per-layer kernel calls; the
loader maps Hugging Face's separate tensors into the fused weights.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from swiftserve.model import layer_stack
from swiftserve.model.attention import AttentionMetadata, paged_attention
from swiftserve.model.config import ModelConfig
from swiftserve.model.rotary import RotaryEmbedding, apply_rotary


class RMSNorm(nn.Module):
    """RMS norm computed in float32, cast back (as Hugging Face's LlamaRMSNorm).

    With ``residual``, first adds ``x`` into it and normalizes the sum, returning
    ``(normed, residual)``: the residual stream is carried between layers this way so the
    add and the norm are one fused kernel (``ops``) when the CPU kernels are built.
    """

    def __init__(self, size: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def _norm(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(dtype)

    def forward(self, x: torch.Tensor, ops: Any = None) -> torch.Tensor:
        return ops.rms_norm(x, self.weight, self.eps) if ops is not None else self._norm(x)

    def add_forward(
        self, x: torch.Tensor, residual: torch.Tensor, ops: Any = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``residual + x`` and its norm (the fused kernel updates ``residual`` in place)."""
        if ops is not None:
            return ops.add_rms_norm(x, residual, self.weight, self.eps), residual
        residual = residual + x
        return self._norm(residual), residual


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.num_heads = cfg.num_heads
        self.num_kv_heads = cfg.num_kv_heads
        self.head_dim = cfg.head_dim
        self.q_size = cfg.num_heads * cfg.head_dim
        self.kv_size = cfg.num_kv_heads * cfg.head_dim
        self.qkv_proj = nn.Linear(cfg.hidden_size, self.q_size + 2 * self.kv_size, bias=cfg.attention_bias)
        self.o_proj = nn.Linear(self.q_size, cfg.hidden_size, bias=False)

    def forward(
        self,
        x: torch.Tensor,
        rope: tuple[torch.Tensor, torch.Tensor],
        kv_cache: tuple[torch.Tensor, torch.Tensor],
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        tokens = x.shape[0]
        qkv = self.qkv_proj(x)
        if meta.kernel is not None:  # rotate q and k in place inside the fused output
            meta.kernel.rope_qk_(qkv, rope[0], rope[1], self.num_heads + self.num_kv_heads, self.head_dim)
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.view(tokens, self.num_heads, self.head_dim)
        k = k.view(tokens, self.num_kv_heads, self.head_dim)
        if meta.kernel is None:
            q, k = apply_rotary(q, *rope), apply_rotary(k, *rope)
        v = v.view(tokens, self.num_kv_heads, self.head_dim)
        out = paged_attention(q, k, v, kv_cache[0], kv_cache[1], meta)
        return self.o_proj(out.reshape(tokens, self.q_size))


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.intermediate_size = cfg.intermediate_size
        self.gate_up_proj = nn.Linear(cfg.hidden_size, 2 * cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)

    def forward(self, x: torch.Tensor, ops: Any = None) -> torch.Tensor:
        gate_up = self.gate_up_proj(x)
        if ops is not None:
            return self.down_proj(ops.silu_and_mul(gate_up))
        gate, up = gate_up.split(self.intermediate_size, dim=-1)
        return self.down_proj(F.silu(gate) * up)


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MLP(cfg)

    def forward(self, h, residual, rope, kv_cache, meta):  # type: ignore[no-untyped-def]
        """``h``: the previous layer's output (not yet added to ``residual``, which is None
        before the first layer). Returns this layer's (output, residual)."""
        ops = meta.kernel
        if residual is None:
            residual, h = h, self.input_layernorm(h, ops)
        else:
            h, residual = self.input_layernorm.add_forward(h, residual, ops)
        h = self.self_attn(h, rope, kv_cache, meta)
        h, residual = self.post_attention_layernorm.add_forward(h, residual, ops)
        return self.mlp(h, ops), residual


class LlamaModel(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg) for _ in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


class LlamaForCausalLM(nn.Module):
    """The causal LM. Build it on the meta device, then ``to_empty`` and load weights."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.config = cfg
        self.model = LlamaModel(cfg)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        self.rotary: RotaryEmbedding | None = None
        self._stack: list[torch.Tensor] | None = None  # decoder_stack's weights; [] = not used

    def init_rotary(self, max_positions: int) -> None:
        cfg = self.config
        self.rotary = RotaryEmbedding(cfg.head_dim, max_positions, cfg.rope_theta, cfg.rope_scaling)

    @property
    def dtype(self) -> torch.dtype:
        return self.model.embed_tokens.weight.dtype

    def tie_weights(self) -> None:
        self.lm_head.weight = self.model.embed_tokens.weight

    @torch.inference_mode()
    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        """Hidden states [T, hidden] of a flat batch (logits are computed separately)."""
        assert self.rotary is not None, "call init_rotary() first"
        h = self.model.embed_tokens(input_ids)
        rope = self.rotary.tables(positions, h.dtype)
        if self._stack is None:  # decided once, after the linears were packed
            self._stack = layer_stack.stack_weights(self) or []
        if self._stack and layer_stack.applies(meta, h.shape[0]):
            return layer_stack.run_stack(self, self._stack, h, rope, kv_caches, meta)
        residual = None
        for layer, kv_cache in zip(self.model.layers, kv_caches, strict=True):
            h, residual = layer(h, residual, rope, kv_cache, meta)
        assert residual is not None, "a model has at least one layer"
        return self.model.norm.add_forward(h, residual, meta.kernel)[0]

    @torch.inference_mode()
    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """float32 logits for the selected rows only."""
        return self.lm_head(hidden).float()
