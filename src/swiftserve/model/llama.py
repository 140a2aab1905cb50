"""Llama-family decoder (Llama 2/3, Qwen2, Mistral) over a flat token batch and a paged KV cache.

q/k/v and gate/up projections are fused (one GEMM each) to cut per-layer kernel calls; the
loader maps Hugging Face's separate tensors into the fused weights.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import nn

from swiftserve.model.attention import AttentionMetadata
from swiftserve.model.config import ModelConfig
from swiftserve.model.rotary import RotaryEmbedding

if TYPE_CHECKING:
    from swiftserve.model.ops import TorchOps


class RMSNorm(nn.Module):
    """RMS norm (float32 math, cast back, as Hugging Face's LlamaRMSNorm) through ``ops``.

    ``add_forward`` first adds ``x`` into the residual stream and normalizes the sum, so the
    add and the norm are one fused kernel where the backend has one.
    """

    def __init__(self, size: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor, ops: TorchOps) -> torch.Tensor:
        return ops.rms_norm(x, self.weight, self.eps)

    def add_forward(
        self, x: torch.Tensor, residual: torch.Tensor, ops: TorchOps
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``residual + x`` and its norm (a backend may update ``residual`` in place)."""
        return ops.add_rms_norm(x, residual, self.weight, self.eps)


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
        """Attention of ``x`` [T, hidden] before ``o_proj``, which the layer applies (fused with
        the residual add and norm where the backend has that)."""
        tokens = x.shape[0]
        qkv = meta.ops.qkv_rope(self.qkv_proj, x, rope, self.num_heads, self.num_kv_heads)
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.view(tokens, self.num_heads, self.head_dim)
        k = k.view(tokens, self.num_kv_heads, self.head_dim)
        v = v.view(tokens, self.num_kv_heads, self.head_dim)
        out = meta.ops.paged_attention(q, k, v, kv_cache, meta)
        return out.reshape(tokens, self.q_size)


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.intermediate_size = cfg.intermediate_size
        self.gate_up_proj = nn.Linear(cfg.hidden_size, 2 * cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)

    def forward(self, x: torch.Tensor, ops: TorchOps) -> torch.Tensor:
        return self.down_proj(self.act(x, ops))

    def act(self, x: torch.Tensor, ops: TorchOps) -> torch.Tensor:
        """silu(gate) * up: the MLP before ``down_proj``."""
        return ops.gate_up_silu(self.gate_up_proj, x)


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MLP(cfg)

    def forward(self, h, residual, rope, kv_cache, meta, prev_down=None, defer_down=False):  # type: ignore[no-untyped-def]
        """``h``: the previous layer's output (not yet added to ``residual``, which is None
        before the first layer), or, with ``prev_down``, the previous layer's MLP activation
        that ``prev_down`` still has to project. Returns this layer's (output, residual); with
        ``defer_down`` the output is its MLP activation, for the next layer (or the final norm)
        to project: a projection and the residual add + norm after it are one fused call where
        the backend has one (ops.linear_add_rms; the same bits either way)."""
        ops = meta.ops
        if prev_down is not None:
            h, residual = ops.linear_add_rms(prev_down, h, residual, self.input_layernorm)
        elif residual is None:
            residual, h = h, self.input_layernorm(h, ops)
        else:
            h, residual = self.input_layernorm.add_forward(h, residual, ops)
        h = self.self_attn(h, rope, kv_cache, meta)
        h, residual = ops.linear_add_rms(self.self_attn.o_proj, h, residual, self.post_attention_layernorm)
        return (self.mlp.act(h, ops) if defer_down else self.mlp(h, ops)), residual


class LlamaModel(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        # _weight skips nn.Embedding's random init: on the meta device that init imports
        # torch._dynamo (~1.5 s of start-up) for values the checkpoint overwrites anyway.
        weight = torch.empty(cfg.vocab_size, cfg.hidden_size)
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size, _weight=weight)
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
        self.stack: list[torch.Tensor] | None = None  # ops.decoder_stack's weights (set at load)

    def init_rotary(self, max_positions: int) -> None:
        cfg = self.config
        device = self.model.embed_tokens.weight.device
        self.rotary = RotaryEmbedding(cfg.head_dim, max_positions, cfg.rope_theta, cfg.rope_scaling, device)

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
        if self.stack:
            out = meta.ops.decoder_stack(self, self.stack, h, rope, kv_caches, meta)
            if out is not None:
                return out  # type: ignore[no-any-return]
        residual, down = None, None
        for layer, kv_cache in zip(self.model.layers, kv_caches, strict=True):
            h, residual = layer(h, residual, rope, kv_cache, meta, prev_down=down, defer_down=True)
            down = layer.mlp.down_proj  # type: ignore[union-attr]
        assert residual is not None and down is not None, "a model has at least one layer"
        return meta.ops.linear_add_rms(down, h, residual, self.model.norm)[0]  # type: ignore[no-any-return]

    @torch.inference_mode()
    def forward_stage(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
        meta: AttentionMetadata,
        carried: tuple[torch.Tensor, torch.Tensor] | None,
        last: bool,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """A pipeline stage: this model's layers only (worker/pipeline.py keeps a stage's
        range in ``model.layers``). ``carried``: the previous stage's (output, residual), None
        on the first stage, which embeds ``input_ids``. Returns (output, residual) for the next
        stage, or (final-normed hidden states, None) when ``last``. The same calls in the same
        order as ``forward``'s layer loop: a split model computes the same bits."""
        assert self.rotary is not None, "call init_rotary() first"
        h, residual = carried if carried is not None else (self.model.embed_tokens(input_ids), None)
        rope = self.rotary.tables(positions, h.dtype)
        if self.stack:  # the C++ layer stack over this stage's layers, where it applies
            out = meta.ops.decoder_stack_stage(self, self.stack, h, residual, rope, kv_caches, meta, last)
            if out is not None:
                return out  # type: ignore[no-any-return]
        for layer, kv_cache in zip(self.model.layers, kv_caches, strict=True):
            h, residual = layer(h, residual, rope, kv_cache, meta)
        assert residual is not None, "a stage has at least one layer"
        if last:
            return self.model.norm.add_forward(h, residual, meta.ops)[0], None
        return h, residual

    @torch.inference_mode()
    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """float32 logits for the selected rows only."""
        return self.lm_head(hidden).float()
