"""EngineConfig: every engine option, validated once (vLLM's names where vLLM has them)."""

from __future__ import annotations

from dataclasses import dataclass

from swiftserve._options import check_range, reject_unknown_options

DTYPES = ("auto", "float32", "bfloat16", "float16")
POLICIES = ("fcfs", "priority")
QUANTIZATIONS = ("int8", "int4")
QUANT_GROUP_SIZES = (32, 64, 128)
DEFAULT_KV_CACHE_MEMORY = 2 * 1024**3


@reject_unknown_options
@dataclass(frozen=True)
class EngineConfig:
    """Options of the engine: model, memory, batching and scheduling.

    ``kv_cache_memory`` (bytes) or ``num_kv_blocks`` size the paged KV pool; with neither,
    the pool takes up to 2 GiB but never more than ``max_num_seqs`` full-length sequences need.
    ``quantization``: "int8" (per output channel) or "int4" (groups of ``quant_group_size``
    input features) weight-only quantization of the linear layers at load time; the lm_head
    too when ``quantize_lm_head``, embeddings never.
    ``aging_interval_s``: a waiting request gains one priority level per this many seconds
    waited (priority policy only), which bounds starvation (see core/request_queue.py).
    """

    model: str | None = None
    tokenizer: str | None = None
    dtype: str = "auto"
    seed: int = 0
    max_model_len: int | None = None
    max_num_seqs: int = 128
    max_num_batched_tokens: int = 2048
    block_size: int = 16
    enable_prefix_caching: bool = True
    enable_chunked_prefill: bool = True
    kv_cache_memory: int | None = None
    num_kv_blocks: int | None = None
    scheduling_policy: str = "fcfs"
    aging_interval_s: float = 5.0
    num_threads: int | None = None
    quantization: str | None = None
    quant_group_size: int = 128
    quantize_lm_head: bool = False

    def __post_init__(self) -> None:
        own = "EngineConfig"
        if self.dtype not in DTYPES:
            raise ValueError(f"{own}.dtype must be one of {DTYPES}, got {self.dtype!r}")
        if self.scheduling_policy not in POLICIES:
            raise ValueError(
                f"{own}.scheduling_policy must be one of {POLICIES}, got {self.scheduling_policy!r}"
            )
        if self.quantization is not None and self.quantization not in QUANTIZATIONS:
            raise ValueError(
                f"{own}.quantization must be one of {QUANTIZATIONS} or None, got {self.quantization!r}"
            )
        if self.quant_group_size not in QUANT_GROUP_SIZES:
            raise ValueError(
                f"{own}.quant_group_size must be one of {QUANT_GROUP_SIZES}, got {self.quant_group_size!r}"
            )
        for name, low in (
            ("max_num_seqs", 1),
            ("max_num_batched_tokens", 1),
            ("block_size", 1),
        ):
            _positive_int(own, name, getattr(self, name), low)
        for name in ("max_model_len", "kv_cache_memory", "num_kv_blocks", "num_threads"):
            value = getattr(self, name)
            if value is not None:
                _positive_int(own, name, value, 1)
        _positive_int(own, "seed", self.seed, 0)
        check_range(own, "aging_interval_s", self.aging_interval_s, 0.0, low_open=True)
        if (
            not self.enable_chunked_prefill
            and self.max_model_len is not None
            and self.max_num_batched_tokens < self.max_model_len
        ):
            raise ValueError(
                f"{own}.max_num_batched_tokens ({self.max_num_batched_tokens}) must be >= "
                f"max_model_len ({self.max_model_len}) when enable_chunked_prefill is False"
            )


def _positive_int(owner: str, name: str, value: object, low: int) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < low:
        raise ValueError(f"{owner}.{name} must be an integer >= {low}, got {value!r}")
