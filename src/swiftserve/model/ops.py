"""One kernel-backend interface, chosen once at load time: model code calls ``ops.x(...)``.

``TorchOps`` is the PyTorch reference (any device): the math every other backend is tested
against, and the path that must match transformers token for token in float32. ``CpuOps``
routes the same calls to our C++ kernels (model/kernels). The GPU backend, ``TritonOps``
(model/triton_ops.py), implements the same methods. No model code branches on which backend it runs.
"""

from __future__ import annotations

import functools
import logging
from dataclasses import dataclass
from types import ModuleType
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F
from torch import nn

from swiftserve.config import KERNEL_BACKENDS
from swiftserve.model import attention, packed_linear
from swiftserve.model.kv_quant import quantize_rows
from swiftserve.model.rotary import apply_rotary

if TYPE_CHECKING:
    from swiftserve.model.attention import AttentionMetadata
    from swiftserve.model.config import ModelConfig

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class KernelOptions:
    """The A/B switches of the kernels (EngineConfig fields of the same names)."""

    bf16_gemm: str = "panel"  # "panel" (our GEMM) or "onednn"
    fused_prefill: bool = True  # bfloat16 prompt rows through the row attention kernel
    layer_stack: bool = True  # the whole decoder stack in one C++ call where it applies
    prompt_tiles: bool = True  # AMX CPUs: prompt runs through the tiled attention kernel


@functools.cache
def amx_available() -> bool:
    """Whether this CPU has AMX tiles that oneDNN uses for bfloat16 GEMMs and SDPA."""
    probe = getattr(torch.cpu, "_is_amx_tile_supported", None)
    try:
        return bool(probe()) if probe is not None else False
    except RuntimeError:
        return False


class TorchOps:
    """Reference backend: plain PyTorch on any device."""

    name = "torch"
    kernels: ModuleType | None = None
    decode_mask = True  # decode rows need the [B, L] mask built by the runner

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        """RMS norm in float32, cast back (as Hugging Face's LlamaRMSNorm)."""
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
        return weight * x32.to(x.dtype)

    def add_rms_norm(
        self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``(norm(residual + x), residual + x)``; a backend may update ``residual`` in place."""
        residual = residual + x
        return self.rms_norm(residual, weight, eps), residual

    def rotary_qk_(
        self, qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, num_heads: int, num_kv_heads: int
    ) -> None:
        """Rotate the q and k parts of a fused [T, (H + 2 KVH) * D] projection in place."""
        tokens, dim = qkv.shape[0], cos.shape[-1]
        q = qkv[:, : num_heads * dim].view(tokens, num_heads, dim)
        k = qkv[:, num_heads * dim : (num_heads + num_kv_heads) * dim].view(tokens, num_kv_heads, dim)
        q.copy_(apply_rotary(q, cos, sin))
        k.copy_(apply_rotary(k, cos, sin))

    def silu_and_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        gate, up = gate_up.chunk(2, dim=-1)
        return F.silu(gate) * up

    def gate_up_silu(self, gate_up_proj: nn.Module, x: torch.Tensor) -> torch.Tensor:
        """silu(gate) * up of an MLP's fused gate/up projection of ``x`` [T, hidden]."""
        return self.silu_and_mul(gate_up_proj(x))

    def qkv_rope(self, qkv_proj: nn.Module, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor],
                 heads: int, kv_heads: int) -> torch.Tensor:  # fmt: skip
        """The fused q/k/v projection of ``x`` [T, hidden], q and k rotated."""
        qkv = qkv_proj(x)
        self.rotary_qk_(qkv, rope[0], rope[1], heads, kv_heads)
        return qkv  # type: ignore[no-any-return]

    def linear_add_rms(
        self, linear: nn.Module, x: torch.Tensor, residual: torch.Tensor, norm: Any
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``norm.add_forward(linear(x), residual)``: (normed, residual + linear(x))."""
        return self.add_rms_norm(linear(x), residual, norm.weight, norm.eps)

    def write_kv_(
        self,
        k: torch.Tensor,
        v: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        slots: torch.Tensor,
    ) -> None:
        """Store new K/V [T, KVH, D] at their cache slots (quantized into an int8 cache)."""
        heads, width = k_cache.shape[0], k_cache.shape[-1]
        if k_cache.dtype == torch.int8:
            k, v = quantize_rows(k), quantize_rows(v)
        k_cache.view(heads, -1, width).index_copy_(1, slots, k.transpose(0, 1).to(k_cache.dtype))
        v_cache.view(heads, -1, width).index_copy_(1, slots, v.transpose(0, 1).to(v_cache.dtype))

    def paged_decode(
        self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta: AttentionMetadata
    ) -> torch.Tensor:
        """Attention of query rows answered one row at a time through their block tables."""
        return attention.masked_decode(q, k_cache, v_cache, meta)

    def paged_attention(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        kv_cache: tuple[torch.Tensor, torch.Tensor],
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        """Write the new K/V, then attend: decode rows and prompt rows of many requests."""
        self.write_kv_(k, v, kv_cache[0], kv_cache[1], meta.slot_mapping)
        return attention.paged_attention(self, q, k, v, kv_cache[0], kv_cache[1], meta)

    # Prompt tokens in one step above which prompt rows leave the row kernel for SDPA
    # (``fused_rows`` says whether they use it at all).
    fused_rows_limit = 1 << 30

    def fused_rows(self, cfg: ModelConfig, dtype: torch.dtype) -> bool:
        """Whether prompt rows go through ``paged_decode`` as rows (else one SDPA per prompt)."""
        return False

    def tile_rows(self, cfg: ModelConfig, dtype: torch.dtype, kv_dtype: torch.dtype, block_size: int) -> bool:
        """Whether prompt runs of ``TILE_MIN_ROWS``+ rows go to ``prompt_tiles``."""
        return False

    def prompt_tiles(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                     meta: AttentionMetadata, out: torch.Tensor) -> None:  # fmt: skip
        """Attention of the prompt runs in ``meta.tiles``, written into their rows of ``out``."""
        raise NotImplementedError

    def pack_linears(self, model: nn.Module) -> int:
        """Repack linear weights for this backend's GEMM; returns how many were packed."""
        return 0

    def stack_weights(self, model: nn.Module) -> list[torch.Tensor] | None:
        """Weights for ``decoder_stack``, or None when this backend has no whole-stack call."""
        return None

    def decoder_stack(self, model: Any, weights: list[torch.Tensor], h: torch.Tensor, rope: Any,
                      kv_caches: Any, meta: AttentionMetadata) -> torch.Tensor | None:  # fmt: skip
        """The final-normed hidden states in one call, or None when it does not apply."""
        return None

    def decoder_stack_stage(self, model: Any, weights: list[torch.Tensor], h: torch.Tensor,
                            residual: torch.Tensor | None, rope: Any, kv_caches: Any,
                            meta: AttentionMetadata, last: bool) -> Any:  # fmt: skip
        """A pipeline stage's layers in one call ((output, residual), or (final-normed, None)
        when ``last``), or None when it does not apply."""
        return None


class CpuOps(TorchOps):
    """Our C++ CPU kernels (AVX-512 where the CPU has it), same results as TorchOps."""

    name = "cpu"
    decode_mask = False

    # On CPUs with AMX, oneDNN's SDPA and GEMMs (AMX tiles) beat the row kernel and our
    # AVX512-BF16 GEMM on prompt chunks: 5x on a 4k prompt (docs/benchmarks.md, issue 24).
    # Small chunks (speculative verification rows, the tail of a prompt) stay fused.
    AMX_FUSED_ROWS_LIMIT = 64

    def __init__(self, kernels: ModuleType, options: KernelOptions):
        self.kernels = kernels
        self.cpp = kernels  # the same module, typed as present
        self.options = options
        self.stack_max_rows = 1 << 30  # steps with this many rows skip the C++ layer stack
        if amx_available():
            self.fused_rows_limit = self.AMX_FUSED_ROWS_LIMIT

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        return self.cpp.rms_norm(x, weight, eps)  # type: ignore[no-any-return]

    def add_rms_norm(
        self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
    ) -> tuple[torch.Tensor, torch.Tensor]:
        return self.cpp.add_rms_norm(x, residual, weight, eps), residual  # residual updated in place

    def rotary_qk_(
        self, qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, num_heads: int, num_kv_heads: int
    ) -> None:
        self.cpp.rope_qk_(qkv, cos, sin, num_heads + num_kv_heads, cos.shape[-1])

    def silu_and_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        return self.cpp.silu_and_mul(gate_up)  # type: ignore[no-any-return]

    def gate_up_silu(self, gate_up_proj: nn.Module, x: torch.Tensor) -> torch.Tensor:
        packed = getattr(gate_up_proj, "amx_silu", None)
        if packed is not None and x.shape[0] >= packed_linear.AMX_LINEAR_ROWS:
            # prompt chunks on AMX: SiLU-and-mul in the GEMM's epilogue, the [T, 2I] gate/up
            # output never written (the same bits as oneDNN's GEMM then silu_and_mul)
            return self.cpp.amx_linear(x, packed, gate_up_proj.out_features, True)  # type: ignore[no-any-return]
        return self.silu_and_mul(gate_up_proj(x))

    def qkv_rope(self, qkv_proj: nn.Module, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor],
                 heads: int, kv_heads: int) -> torch.Tensor:  # fmt: skip
        packed = getattr(qkv_proj, "amx_rope", None)
        if packed is not None and x.shape[0] >= packed_linear.AMX_LINEAR_ROWS and rope[0].shape[-1] == 64:
            # the rotary in the GEMM's epilogue (the same bits as the GEMM, then rotary_qk_)
            out = qkv_proj.out_features
            bias = qkv_proj.amx_bias  # type: ignore[union-attr]
            return self.cpp.amx_linear_rope(x, packed, out, rope[0], rope[1], (heads + kv_heads) * 64, bias)  # type: ignore[no-any-return]
        return super().qkv_rope(qkv_proj, x, rope, heads, kv_heads)

    def linear_add_rms(
        self, linear: nn.Module, x: torch.Tensor, residual: torch.Tensor, norm: Any
    ) -> tuple[torch.Tensor, torch.Tensor]:
        packed = getattr(linear, "amx", None)
        if (
            packed is not None
            and linear.amx_bias is None  # the fused kernel takes no bias
            and x.shape[0] >= packed_linear.AMX_LINEAR_ROWS
            and residual.dtype == torch.bfloat16
        ):
            # the residual add and the norm over each thread's rows right after its GEMM rows
            # (in L2), not as another pass from L3; the same bits as the unfused calls
            normed = self.cpp.amx_linear_add_rms(
                x, packed, linear.out_features, residual, norm.weight, norm.eps
            )
            return normed, residual  # residual updated in place
        return super().linear_add_rms(linear, x, residual, norm)

    def write_kv_(
        self,
        k: torch.Tensor,
        v: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        slots: torch.Tensor,
    ) -> None:
        if k_cache.dtype == torch.int8:
            self.cpp.write_kv_int8_(k, v, k_cache, v_cache, slots)
        elif k.dtype != k_cache.dtype:
            super().write_kv_(k, v, k_cache, v_cache, slots)
        else:
            self.cpp.write_kv_(k, v, k_cache, v_cache, slots)

    def paged_decode(
        self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta: AttentionMetadata
    ) -> torch.Tensor:
        assert meta.decode_tables is not None and meta.decode_positions is not None
        scale = q.shape[-1] ** -0.5
        kernel = self.cpp.paged_decode_int8 if k_cache.dtype == torch.int8 else self.cpp.paged_decode
        return kernel(  # type: ignore[no-any-return]
            q.contiguous(),
            k_cache,
            v_cache,
            meta.decode_tables,
            meta.decode_positions,
            scale,
            meta.window or -1,
        )

    def fused_rows(self, cfg: ModelConfig, dtype: torch.dtype) -> bool:
        # bfloat16 with the register-resident shapes only; float32 stays on SDPA, the
        # reference path that must match transformers exactly.
        return (
            self.options.fused_prefill
            and dtype == torch.bfloat16
            and cfg.head_dim == 64
            and cfg.num_heads // cfg.num_kv_heads <= 4
        )

    def tile_rows(self, cfg: ModelConfig, dtype: torch.dtype, kv_dtype: torch.dtype, block_size: int) -> bool:
        # bf16 cache, head_dim 64, up to 8 query heads per KV head, whole 16-key tiles per
        # block: the kernel's shapes (model/kernels/prompt_tiles.cpp); AMX CPUs only.
        return (
            self.options.prompt_tiles
            and dtype == torch.bfloat16
            and kv_dtype == torch.bfloat16
            and cfg.head_dim == 64
            and cfg.num_heads // cfg.num_kv_heads <= 8
            and block_size % 16 == 0
            and amx_available()
            and hasattr(self.cpp, "prompt_tiles")
            and bool(self.cpp.prompt_tiles_available())
        )

    def prompt_tiles(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                     meta: AttentionMetadata, out: torch.Tensor) -> None:  # fmt: skip
        tiles = meta.tiles
        assert tiles is not None
        self.cpp.prompt_tiles(
            q, k_cache, v_cache, tiles.tables, tiles.runs, out, q.shape[-1] ** -0.5, meta.window or -1
        )

    def pack_linears(self, model: nn.Module) -> int:
        from swiftserve.model.packed_linear import add_amx_copies, dual_packed, dual_rows, pack_linears

        count = pack_linears(model, self.cpp if self.options.bf16_gemm == "panel" else None)
        if dual_packed(model):  # large steps take the oneDNN or AMX copies: the C++ stack only below them
            self.stack_max_rows = dual_rows(model)
        if self.options.bf16_gemm == "panel" and hasattr(self.cpp, "amx_linear"):
            add_amx_copies(model, self.cpp)
        return count

    def stack_weights(self, model: nn.Module) -> list[torch.Tensor] | None:
        from swiftserve.model import layer_stack

        weights = layer_stack.stack_weights(model) if self.options.layer_stack else None  # type: ignore[arg-type]
        if weights is not None and any(w.dtype in (torch.int8, torch.uint8) for w in weights):
            # a quantized stack: no oneDNN bf16 copies to leave batches to
            self.stack_max_rows = layer_stack.max_rows(model, weights) or 1 << 30
        return weights

    def decoder_stack(self, model: Any, weights: list[torch.Tensor], h: torch.Tensor, rope: Any,
                      kv_caches: Any, meta: AttentionMetadata) -> torch.Tensor | None:  # fmt: skip
        from swiftserve.model import layer_stack

        if h.shape[0] >= self.stack_max_rows or not layer_stack.applies(meta, h.shape[0]):
            return None
        return layer_stack.run_stack(self.cpp, model, weights, h, rope, kv_caches, meta)

    def decoder_stack_stage(self, model: Any, weights: list[torch.Tensor], h: torch.Tensor,
                            residual: torch.Tensor | None, rope: Any, kv_caches: Any,
                            meta: AttentionMetadata, last: bool) -> Any:  # fmt: skip
        from swiftserve.model import layer_stack

        if h.shape[0] >= self.stack_max_rows or not layer_stack.applies(meta, h.shape[0]):
            return None
        return layer_stack.run_stage_stack(self.cpp, model, weights, h, residual, rope, kv_caches, meta, last)


def select_ops(backend: str, device: torch.device, options: KernelOptions) -> TorchOps:
    """The backend for ``backend`` ("auto": the fastest available here), logged once."""
    if backend not in KERNEL_BACKENDS:
        raise ValueError(f"kernel_backend must be one of {KERNEL_BACKENDS}, got {backend!r}")
    ops: TorchOps = TorchOps()
    if backend in ("auto", "cpu") and device.type == "cpu":
        from swiftserve.model.kernels import cpu_kernels

        kernels = cpu_kernels()
        if kernels is not None:
            ops = CpuOps(kernels, options)
        elif backend == "cpu":
            raise ValueError("kernel_backend='cpu' but the C++ kernels could not be built here")
        else:
            logger.info("C++ CPU kernels unavailable (no compiler?): using the PyTorch backend")
    elif backend == "cpu":
        raise ValueError(f"kernel_backend='cpu' needs device cpu, got {device}")
    elif backend == "triton" or (backend == "auto" and device.type == "cuda"):
        from swiftserve.model.triton_ops import TritonOps

        ops = TritonOps()
    logger.info("kernel backend: %s (%s)", ops.name, options)
    return ops
