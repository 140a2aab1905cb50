"""EngineCore: the step loop. ``schedule -> execute -> update``, nothing else.

It speaks plain messages (EngineCoreRequest in, EngineCoreOutput out) so that it can run in
a background thread today and in its own process later without either side changing.
"""

from __future__ import annotations

import gc
import logging
from pathlib import Path

import torch

from swiftserve.config import DEFAULT_KV_CACHE_MEMORY, EngineConfig
from swiftserve.core.block_manager import BlockManager
from swiftserve.core.messages import EngineCoreOutput, EngineCoreRequest
from swiftserve.core.request import Request, RequestStatus
from swiftserve.core.scheduler import Scheduler
from swiftserve.model.config import ModelConfig
from swiftserve.model.loader import load_model
from swiftserve.model.packed_linear import pack_linears
from swiftserve.model.quant_linear import quantize_model, weight_bytes
from swiftserve.worker.model_runner import ModelRunner

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


def num_kv_blocks(
    config: EngineConfig, model_config: ModelConfig, dtype: torch.dtype, max_model_len: int
) -> int:
    """Pool size from num_kv_blocks, else kv_cache_memory bytes (capped at what can be used)."""
    if config.num_kv_blocks is not None:
        return config.num_kv_blocks
    block_bytes = config.block_size * model_config.kv_bytes_per_token(dtype.itemsize)
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


class EngineCore:
    """Scheduler + ModelRunner, stepped by the caller."""

    def __init__(self, config: EngineConfig, model_dir: str | Path, *, progress: bool = True):
        if config.num_threads:
            torch.set_num_threads(config.num_threads)
        self.config = config
        self.model_config = ModelConfig.from_dir(model_dir)
        self.max_model_len = resolve_max_model_len(config, self.model_config)
        model = load_model(model_dir, config.dtype, self.max_model_len, progress=progress)
        self.dtype = model.dtype
        if config.quantization:
            count = quantize_model(
                model, config.quantization, config.quant_group_size, lm_head=config.quantize_lm_head
            )
            logger.info("quantized %d linear layers to %s", count, config.quantization)
        packed = pack_linears(model)  # what is left in bfloat16 (e.g. lm_head)
        logger.info("prepacked %d linear layers", packed)
        self.weight_bytes = weight_bytes(model)
        blocks = num_kv_blocks(config, self.model_config, self.dtype, self.max_model_len)
        self.block_manager = BlockManager(blocks, config.block_size, config.enable_prefix_caching)
        self.scheduler = Scheduler(
            self.block_manager,
            max_num_seqs=config.max_num_seqs,
            max_num_batched_tokens=config.max_num_batched_tokens,
            max_model_len=self.max_model_len,
            enable_chunked_prefill=config.enable_chunked_prefill,
            policy=config.scheduling_policy,
            aging_interval_s=config.aging_interval_s,
        )
        self.runner = ModelRunner(
            model,
            num_blocks=blocks,
            block_size=config.block_size,
            max_num_batched_tokens=config.max_num_batched_tokens,
            seed=config.seed,
        )
        logger.info("KV cache: %d blocks of %d tokens", blocks, config.block_size)
        # Everything allocated so far lives as long as the engine: keep the cyclic GC from
        # walking it on every collection during steps (DESIGN.md, performance rules).
        gc.collect()
        gc.freeze()

    def add_request(self, request: EngineCoreRequest) -> None:
        """Queue a request; ValueError if it can never fit or a value is out of range.

        The frontend validates first; these checks are the core defending itself.
        """
        if not -(2**31) < request.priority < 2**31:
            raise ValueError(f"priority must be a 32-bit integer, got {request.priority!r}")
        if not 1 <= request.max_tokens < 2**31:
            raise ValueError(f"max_tokens must be in [1, 2**31), got {request.max_tokens!r}")
        ids = request.prompt_token_ids
        if not ids or min(ids) < 0 or max(ids) >= self.model_config.vocab_size:
            raise ValueError("prompt must be non-empty token ids inside the vocabulary")
        self.scheduler.add_request(
            Request(
                request_id=request.request_id,
                prompt_token_ids=request.prompt_token_ids,
                sampling_params=request.sampling_params,
                eos_token_ids=request.eos_token_ids,
                priority=request.priority,
                arrival_time=request.arrival_time,
                max_tokens=request.max_tokens,
            )
        )

    def abort_requests(self, request_ids: list[str], *, stopped: bool = False) -> None:
        """Finish requests now (aborted, or stopped by a stop string); frees their blocks."""
        status = RequestStatus.FINISHED_STOPPED if stopped else RequestStatus.FINISHED_ABORTED
        self.scheduler.finish_requests(request_ids, status)

    def step(self) -> list[EngineCoreOutput]:
        """One forward pass over the scheduled tokens; returns what changed."""
        sched = self.scheduler.schedule()
        result = self.runner.execute(sched)
        return self.scheduler.update(sched, result)

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished()
