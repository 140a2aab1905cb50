"""The GPU kernel backend: ``TritonOps``, the ``TorchOps`` interface (model/ops.py) over our
Triton kernels (model/triton_kernels.py)."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from swiftserve.model.ops import TorchOps

if TYPE_CHECKING:
    from swiftserve.model.attention import AttentionMetadata
    from swiftserve.model.config import ModelConfig


class TritonOps(TorchOps):
    """Triton kernels (model/triton_kernels.py): the GPU backend, also run on CPU in CI under
    ``TRITON_INTERPRET=1``. GEMMs stay on PyTorch (cuBLAS). Every attention row, decode or
    prompt, goes through one paged kernel reading positions on the device (graph-capturable).
    """

    name = "triton"
    decode_mask = False

    def __init__(self) -> None:
        from swiftserve.model import triton_kernels

        self.tk = triton_kernels

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        return self.tk.rms_norm(x, weight, eps)  # type: ignore[no-any-return]

    def add_rms_norm(
        self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
    ) -> tuple[torch.Tensor, torch.Tensor]:
        return self.tk.rms_norm(x, weight, eps, residual), residual  # residual updated in place

    def rotary_qk_(
        self, qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, num_heads: int, num_kv_heads: int
    ) -> None:
        self.tk.rotary_qk_(qkv, cos, sin, num_heads + num_kv_heads)

    def silu_and_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        return self.tk.silu_and_mul(gate_up)  # type: ignore[no-any-return]

    def write_kv_(
        self,
        k: torch.Tensor,
        v: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        slots: torch.Tensor,
    ) -> None:
        self.tk.write_kv_(k, v, k_cache, v_cache, slots)

    def paged_decode(
        self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta: AttentionMetadata
    ) -> torch.Tensor:
        assert meta.decode_tables is not None and meta.decode_positions is not None
        return self.tk.paged_rows(  # type: ignore[no-any-return]
            q, k_cache, v_cache, meta.decode_tables, meta.decode_positions, q.shape[-1] ** -0.5, meta.window
        )

    def fused_rows(self, cfg: ModelConfig, dtype: torch.dtype) -> bool:
        return True  # prompt rows through the same paged kernel: no per-prompt SDPA
