"""Worker: owns the device and the model.

It loads the checkpoint onto its device, quantizes, packs the linears for the kernel backend
chosen once here (model/ops.py), sizes and allocates the KV cache, and runs steps through its
ModelRunner. The engine core reaches it only through an executor (worker/executor.py).
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import torch

from swiftserve import startup
from swiftserve.config import DEFAULT_KV_CACHE_MEMORY, EngineConfig, graph_sizes
from swiftserve.core.messages import ModelInfo, RunnerOutput, SchedulerOutput
from swiftserve.model.attention import AttentionMetadata
from swiftserve.model.config import ModelConfig
from swiftserve.model.kv_quant import bytes_per_row
from swiftserve.model.llama import LlamaForCausalLM
from swiftserve.model.loader import load_model
from swiftserve.model.ops import KernelOptions, select_ops
from swiftserve.model.packed_linear import make_onednn_copies
from swiftserve.model.quant_linear import quantize_model, weight_bytes
from swiftserve.worker.draft_runner import DraftRunner, check_draft
from swiftserve.worker.guided import GuidedDecoding
from swiftserve.worker.model_runner import ModelRunner
from swiftserve.worker.pipeline_stage import StageLink, StageRunner, keep_stage_layers

logger = logging.getLogger(__name__)


def resolve_max_model_len(config: EngineConfig, model_config: ModelConfig) -> int:
    """config.max_model_len, defaulting to (and never above) the model's position limit."""
    limit = model_config.max_position_embeddings
    if config.max_model_len is None:
        return limit
    if config.max_model_len > limit:
        raise ValueError(
            f"EngineConfig.max_model_len ({config.max_model_len}) exceeds the model's "
            f"max_position_embeddings ({limit})"
        )
    return config.max_model_len


def kv_cache_dtype(config: EngineConfig, model_dtype: torch.dtype) -> torch.dtype:
    """The KV cache's element type: the model's, or int8 (model/kv_quant.py)."""
    return torch.int8 if config.kv_cache_dtype == "int8" else model_dtype


def num_kv_blocks(
    config: EngineConfig,
    model_config: ModelConfig,
    dtype: torch.dtype,
    max_model_len: int,
    extra_bytes_per_token: int = 0,
) -> int:
    """Pool size from num_kv_blocks, else kv_cache_memory bytes (capped at what can be used).
    ``extra_bytes_per_token``: a draft model's KV, which shares the block ids."""
    if config.num_kv_blocks is not None:
        return config.num_kv_blocks
    kv_dtype = kv_cache_dtype(config, dtype)
    row = bytes_per_row(model_config.head_dim, kv_dtype)
    block_bytes = config.block_size * (model_config.kv_bytes_per_token(row) + extra_bytes_per_token)
    useful = config.max_num_seqs * -(-max_model_len // config.block_size)
    memory = config.kv_cache_memory
    blocks = (memory or DEFAULT_KV_CACHE_MEMORY) // block_bytes
    if memory is None:
        blocks = min(blocks, useful)
    if blocks < 1:
        raise ValueError(
            f"EngineConfig.kv_cache_memory ({memory}) is smaller than one KV block ({block_bytes} bytes)"
        )
    return int(blocks)


def resolve_device(name: str) -> torch.device:
    """ "auto": CUDA when a GPU is visible, else the CPU."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cuda" and not torch.cuda.is_available():
        raise ValueError("EngineConfig.device='cuda' but no CUDA device is visible")
    return torch.device(name)


@torch.inference_mode()
def profile_peak_memory(model: Any, ops: Any, num_tokens: int, block_size: int) -> int:
    """Peak CUDA memory (bytes) of one forward over ``num_tokens`` prompt rows plus logits.

    The rows attend through a scratch KV cache of just enough blocks; it is freed after.
    """
    cfg, device = model.config, model.model.embed_tokens.weight.device
    blocks = -(-num_tokens // block_size)
    shape = (cfg.num_kv_heads, blocks, block_size, cfg.head_dim)
    kv = [(torch.zeros(shape, dtype=model.dtype, device=device),) * 2 for _ in range(cfg.num_layers)]
    positions = torch.arange(num_tokens, device=device) % model.rotary.max_positions
    tables = torch.arange(blocks, device=device).expand(num_tokens, blocks).contiguous()
    mask = None
    if ops.decode_mask:
        ctx = torch.arange(blocks * block_size, device=device)
        mask = (ctx[None, :] <= positions[:, None]).view(1, num_tokens, 1, -1)
    meta = AttentionMetadata(
        positions,
        num_tokens,
        tables,
        mask,
        [],
        decode_positions=positions,
        window=cfg.sliding_window,
        ops=ops,
    )
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats(device)
    ids = torch.randint(0, cfg.vocab_size, (num_tokens,), device=device)
    hidden = model(ids, positions, kv, meta)
    model.compute_logits(hidden[: min(num_tokens, 256)])
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated(device)
    del kv, hidden
    torch.cuda.empty_cache()
    return int(peak)


class Worker:
    """One model on one device; ``execute_model`` runs one scheduled step."""

    def __init__(
        self,
        config: EngineConfig,
        model_dir: str | Path,
        *,
        progress: bool = True,
        stage: tuple[int, int] | None = None,
    ):
        """``stage``: (rank, world) of a pipeline stage: keep only that stage's layers."""
        if config.num_threads:
            torch.set_num_threads(config.num_threads)
        self.config = config
        self.model_dir = Path(model_dir)
        self.device = resolve_device(config.device)
        self.model_config = ModelConfig.from_dir(model_dir)
        self.max_model_len = resolve_max_model_len(config, self.model_config)
        if config.kv_cache_dtype == "int8" and (
            self.device.type != "cpu" or config.kernel_backend == "triton"
        ):
            raise ValueError(
                "EngineConfig.kv_cache_dtype='int8' runs on the CPU kernels only for now "
                "(no GPU/Triton INT8 attention yet): use device='cpu' or kv_cache_dtype='auto'"
            )
        if config.quantization and self.device.type != "cpu":
            raise ValueError(
                f"EngineConfig.quantization={config.quantization!r} runs on the CPU only for now "
                "(no CUDA INT8/INT4 kernels yet): use device='cpu' or no quantization"
            )
        timeline = startup.current()
        with timeline.phase("kernels"):
            options = KernelOptions(
                config.bf16_gemm, config.fused_prefill, config.layer_stack, config.prompt_tiles
            )
            self.ops = select_ops(config.kernel_backend, self.device, options)
        with timeline.phase("load weights"):
            model = load_model(
                model_dir, config.dtype, self.max_model_len, progress, self.device, config.load_format
            )
        self.stage = stage
        if stage is not None:
            self.layer_range = keep_stage_layers(model, *stage)
        with timeline.phase("quantize and pack"):
            if config.quantization:
                count = quantize_model(
                    model,
                    config.quantization,
                    config.quant_group_size,
                    lm_head=config.quantize_lm_head,
                    kernels=self.ops.kernels,
                )
                logger.info("quantized %d linear layers to %s", count, config.quantization)
            logger.info("prepacked %d linear layers", self.ops.pack_linears(model))  # what is left in bf16
            if config.warm_up:
                logger.info("warm-up: %d oneDNN weight copies made at start", make_onednn_copies(model))
            model.stack = self.ops.stack_weights(model)  # (a stage's: its own layers)
        self.model = model
        self.runner: ModelRunner | None = None
        self.drafter: DraftRunner | None = None
        self.draft_model = self._load_draft(options, progress)

    def _load_draft(self, options: KernelOptions, progress: bool) -> LlamaForCausalLM | None:
        """The speculative draft model (method "draft_model"), in the target's dtype, with its
        own kernel backend object (a backend keeps per-model state such as stack limits)."""
        spec = self.config.speculative_config
        if spec is None or spec.method != "draft_model":
            return None
        assert spec.model is not None
        draft_dir = Path(spec.model)
        self.draft_config = check_draft(self.model_dir, draft_dir, self.max_model_len)
        with startup.current().phase("draft model"):
            self.draft_ops = select_ops(self.config.kernel_backend, self.device, options)
            dtype = str(self.model.dtype).removeprefix("torch.")
            draft = load_model(draft_dir, dtype, self.max_model_len, progress, self.device)
            self.draft_ops.pack_linears(draft)
            draft.stack = self.draft_ops.stack_weights(draft)
        logger.info(
            "draft model %s: %.1fM parameters", draft_dir, sum(p.numel() for p in draft.parameters()) / 1e6
        )
        return draft

    def _draft_bytes_per_token(self) -> int:
        if self.draft_model is None:
            return 0
        return self.draft_config.kv_bytes_per_token(
            bytes_per_row(self.draft_config.head_dim, self.model.dtype)
        )

    @property
    def model_info(self) -> ModelInfo:
        mc = self.model_config
        return ModelInfo(
            self.max_model_len,
            mc.vocab_size,
            tuple(mc.eos_token_ids),
            str(self.model.dtype).removeprefix("torch."),
            weight_bytes(self.model),
            str(self.device),
        )

    def determine_num_kv_blocks(self) -> int:
        """How many KV blocks this worker's memory budget holds.

        On CUDA (unless num_kv_blocks / kv_cache_memory say otherwise): total memory x
        gpu_memory_utilization, less the peak of one profiling forward at the largest step
        (which counts the weights), over the bytes of one block.
        """
        config = self.config
        if self.device.type != "cuda" or config.num_kv_blocks is not None or config.kv_cache_memory:
            return num_kv_blocks(
                config, self.model_config, self.model.dtype, self.max_model_len, self._draft_bytes_per_token()
            )
        with startup.current().phase("profile memory"):
            peak = profile_peak_memory(self.model, self.ops, config.max_num_batched_tokens, config.block_size)
        total = torch.cuda.get_device_properties(self.device).total_memory
        row = bytes_per_row(self.model_config.head_dim, self.model.dtype)  # (int8 KV is CPU-only)
        block_bytes = config.block_size * (
            self.model_config.kv_bytes_per_token(row) + self._draft_bytes_per_token()
        )
        budget = int(total * config.gpu_memory_utilization) - peak
        useful = config.max_num_seqs * -(-self.max_model_len // config.block_size)
        blocks = min(budget // block_bytes, useful)
        logger.info(
            "GPU memory: %.1f GiB total, profiled peak %.2f GiB, KV pool %d blocks (%.2f GiB)",
            total / 2**30, peak / 2**30, blocks, blocks * block_bytes / 2**30,
        )  # fmt: skip
        if blocks < 1:
            raise ValueError("no GPU memory left for the KV cache: raise gpu_memory_utilization")
        return int(blocks)

    def initialize_kv_cache(self, num_blocks: int) -> None:
        """Allocate the KV cache and the runner's persistent buffers."""
        timeline = startup.current()
        with timeline.phase("KV cache"):
            self.runner = self._make_runner(num_blocks)
        if self.draft_model is not None:
            spec = self.config.speculative_config
            assert spec is not None
            self.drafter = DraftRunner(
                self.draft_model,
                self.draft_ops,
                k=spec.num_speculative_tokens,
                num_blocks=num_blocks,
                block_size=self.config.block_size,
                max_num_tokens=self.config.max_num_batched_tokens + self.config.max_num_seqs,
                max_model_len=self.max_model_len,
            )
        logger.info("KV cache: %d blocks of %d tokens", num_blocks, self.config.block_size)
        # graphs need every attention row on the paged kernel (fixed shapes, no per-step mask)
        graphs = self.stage is None and not self.config.enforce_eager and not self.ops.decode_mask
        if self.device.type == "cuda" and graphs:
            with timeline.phase("CUDA graphs"):
                self.runner.capture_graphs(graph_sizes(self.config), self.max_model_len)

    def _make_runner(self, num_blocks: int) -> ModelRunner:
        """The step runner: a StageRunner for a pipeline stage (only the last one samples,
        so only it builds grammars)."""
        last = self.stage is None or self.stage[0] == self.stage[1] - 1
        mc = self.model_config
        kwargs = dict(
            num_blocks=num_blocks,
            block_size=self.config.block_size,
            max_num_batched_tokens=self.config.max_num_batched_tokens,
            seed=self.config.seed,
            guided=GuidedDecoding(self.model_dir, mc.vocab_size, tuple(mc.eos_token_ids)) if last else None,
            kv_dtype=kv_cache_dtype(self.config, self.model.dtype),
        )
        if self.stage is None:
            return ModelRunner(self.model, self.ops, **kwargs)  # type: ignore[arg-type]
        return StageRunner(self.model, self.ops, StageLink(*self.stage), **kwargs)

    def execute_model(self, scheduler_output: SchedulerOutput) -> RunnerOutput:
        assert self.runner is not None, "initialize_kv_cache() first"
        result = self.runner.execute(scheduler_output)
        if self.drafter is not None and not scheduler_output.is_empty:
            self.drafter.propose(scheduler_output, self.runner.states, result)
        return result
