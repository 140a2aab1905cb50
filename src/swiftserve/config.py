"""EngineConfig: every engine option, validated once (vLLM's names where vLLM has them)."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from swiftserve._options import check_range, reject_unknown_options

DTYPES = ("auto", "float32", "bfloat16", "float16")
POLICIES = ("fcfs", "priority")
QUANTIZATIONS = ("int8", "int4")
QUANT_GROUP_SIZES = (32, 64, 128)
KERNEL_BACKENDS = ("auto", "torch", "cpu", "triton")
BF16_GEMMS = ("panel", "onednn")
DEVICES = ("auto", "cpu", "cuda")
LOAD_FORMATS = ("auto", "dummy")
TOKENIZER_MODES = ("auto", "hf")
DP_BACKENDS = ("mp", "ray")
PP_BACKENDS = ("mp", "ray")
KV_CACHE_DTYPES = ("auto", "int8")
DEFAULT_KV_CACHE_MEMORY = 2 * 1024**3
MAX_SPECULATIVE_TOKENS = 16
SPEC_METHODS = ("ngram", "draft_model")


def _check_draft_dir(own: str, model: str | None) -> None:
    """A draft checkpoint must be a directory with a config.json (checked before any load)."""
    from pathlib import Path

    if not model:
        raise ValueError(f"{own}: method 'draft_model' needs 'model' (the draft checkpoint directory)")
    if not (Path(model) / "config.json").is_file():
        raise ValueError(f"{own}.model: {model!r} is not a checkpoint directory (no config.json)")


@reject_unknown_options
@dataclass(frozen=True)
class SpeculativeConfig:
    """vLLM's ``speculative_config``. ``method="ngram"`` (prompt lookup): the last n tokens
    (n from ``prompt_lookup_max`` down to ``prompt_lookup_min``) are looked up earlier in
    the prompt and output, and the ``num_speculative_tokens`` that followed them are proposed.
    ``method="draft_model"`` (the default when ``model`` is given): a small checkpoint with the
    target's vocabulary proposes them greedily, on its own KV cache over the same block tables
    (worker/draft_runner.py). ``adaptive`` (ours): speculate only in steps where the measured
    acceptance pays for the extra rows (core/ngram.py)."""

    num_speculative_tokens: int = 3
    method: str | None = None
    model: str | None = None
    prompt_lookup_max: int | None = None
    prompt_lookup_min: int | None = None
    adaptive: bool = True  # verify drafts only while the fitted step cost says it pays

    def __post_init__(self) -> None:
        own = "speculative_config"
        method = self.method or ("draft_model" if self.model else None)
        if method not in SPEC_METHODS:
            raise ValueError(f"{own}.method must be one of {SPEC_METHODS}, got {self.method!r}")
        if method == "draft_model":
            _check_draft_dir(own, self.model)
        elif self.model is not None:
            raise ValueError(f"{own}.model is for method 'draft_model', not {method!r}")
        object.__setattr__(self, "method", method)
        _positive_int(own, "num_speculative_tokens", self.num_speculative_tokens, 1)
        if self.num_speculative_tokens > MAX_SPECULATIVE_TOKENS:
            raise ValueError(f"{own}.num_speculative_tokens must be <= {MAX_SPECULATIVE_TOKENS}")
        high = self.prompt_lookup_max or self.prompt_lookup_min or 4
        low = self.prompt_lookup_min or min(high, 2)
        for name, value in (("prompt_lookup_max", high), ("prompt_lookup_min", low)):
            _positive_int(own, name, value, 1)
            if value > 64:
                raise ValueError(f"{own}.{name} must be <= 64, got {value}")
        if low > high:
            raise ValueError(f"{own}: prompt_lookup_min ({low}) must not exceed prompt_lookup_max ({high})")
        object.__setattr__(self, "prompt_lookup_max", high)
        object.__setattr__(self, "prompt_lookup_min", low)

    @classmethod
    def parse(cls, value: SpeculativeConfig | dict[str, Any] | str) -> SpeculativeConfig:
        """From a SpeculativeConfig, a dict, or its JSON text (the CLI flag)."""
        if isinstance(value, SpeculativeConfig):
            return value
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except json.JSONDecodeError as e:
                raise ValueError(f"speculative_config: not JSON: {e}") from e
        if not isinstance(value, dict):
            raise ValueError("speculative_config must be a JSON object")
        return cls(**value)


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
    Requests with a deadline are served earliest-deadline-first within a priority level; one
    without is ordered as if due ``edf_slack_s`` after its arrival; ``deadline_scheduling=False``
    leaves deadlines to the frontend's timer (no EDF, no early failure: the A/B baseline).
    ``target_ttft_ms`` / ``target_tpot_ms`` (P99 targets) make the per-step token budget
    adaptive (core/slo.py); without them it is ``max_num_batched_tokens``.
    ``kernel_backend``: "auto" (the C++ CPU kernels when they built, else PyTorch), "torch"
    (the reference) or "cpu". A/B switches of the CPU kernels: ``bf16_gemm`` ("panel": our
    AVX512-BF16 GEMM; "onednn"), ``fused_prefill`` (bfloat16 prompt rows through the row
    attention kernel instead of SDPA), ``prompt_tiles`` (on AMX CPUs, prompt runs of 8+ rows
    through the tiled attention kernel), ``layer_stack`` (the decoder stack in one C++ call).
    ``device``: "auto" is CUDA when a GPU is visible, else the CPU. On CUDA the KV pool takes
    ``gpu_memory_utilization`` of the GPU's memory less the weights and the activation peak of
    one profiling forward; decode-only steps replay CUDA graphs captured at the
    ``cuda_graph_sizes`` batch buckets (default 1, 2, 4, 8, then steps of 8 up to
    ``max_num_seqs``) unless ``enforce_eager``. ``load_format="dummy"``: seeded random weights
    from config.json alone (benchmarks of big shapes). ``tokenizer_mode``: "auto" loads a
    generic tokenizer.json with the ``tokenizers`` library (no transformers import at start),
    "hf" always through ``transformers.AutoTokenizer``. ``speculative_config`` (a dict, JSON
    text or SpeculativeConfig): n-gram or draft-model speculative decoding, verified exactly
    (core/ngram.py, core/draft.py, worker/draft_runner.py, worker/spec_verify.py).
    ``data_parallel_size`` (server): that many engine processes behind one API server, each
    pinned to its share of ``cpu_affinity`` (default: the cores this process may use, split
    evenly, NUMA node by node) with one torch thread per core (engine/dp_client.py).
    ``pipeline_parallel_size`` P > 1: the layers split into P stages, one worker process each
    (``distributed_executor_backend`` "mp", or "ray" actors), hidden states passed stage to
    stage over torch.distributed (worker/pipeline.py); the engine keeps up to P micro-batches
    in flight. Stages may span ``nnodes`` machines: node 0 runs the engine, the others run
    ``swiftserve serve --node-rank k`` (headless), all reaching ``master_addr``:``master_port``
    within ``distributed_timeout_s``. Tensor parallelism is refused with a clear error.
    ``kv_cache_dtype`` (vLLM's name): "auto" (the model's dtype) or "int8" (CPU: rows of int8
    values with a float32 scale each, model/kv_quant.py; fp8 is the GPU's name, refused here).
    ``async_scheduling`` (vLLM's name): schedule step N+1 while step N runs on a step thread
    (worker/step_stream.py), sampled tokens filled in by the runner; ``busy_poll``: the engine
    thread spins (yielding) for a step's result instead of sleeping on it.
    """

    model: str | None = None
    tokenizer: str | None = None
    tokenizer_mode: str = "auto"
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
    edf_slack_s: float = 30.0
    deadline_scheduling: bool = True
    target_ttft_ms: float | None = None
    target_tpot_ms: float | None = None
    num_threads: int | None = None
    quantization: str | None = None
    quant_group_size: int = 128
    quantize_lm_head: bool = False
    kernel_backend: str = "auto"
    bf16_gemm: str = "panel"
    fused_prefill: bool = True
    prompt_tiles: bool = True
    layer_stack: bool = True
    device: str = "auto"
    gpu_memory_utilization: float = 0.9
    enforce_eager: bool = False
    cuda_graph_sizes: tuple[int, ...] | None = None
    load_format: str = "auto"
    speculative_config: SpeculativeConfig | None = None
    data_parallel_size: int = 1
    data_parallel_backend: str = "mp"
    cpu_affinity: tuple[int, ...] | None = None
    tensor_parallel_size: int = 1
    pipeline_parallel_size: int = 1
    distributed_executor_backend: str = "mp"
    nnodes: int = 1
    node_rank: int = 0
    master_addr: str = "127.0.0.1"
    master_port: int = 0  # 0: a free port (one machine only)
    distributed_timeout_s: float = 60.0
    async_scheduling: bool = False
    busy_poll: bool = False
    kv_cache_dtype: str = "auto"
    step_log: str | None = None  # a JSON line per step: planned, predicted, measured (engine/step_log.py)
    # make lazily built weight copies (oneDNN's, for steps past our AMX GEMM) at start rather than
    # in the first large step (~0.1-0.2 s of one request's TTFT); None: on for `swiftserve serve`
    warm_up: bool | None = None

    def __post_init__(self) -> None:
        own = "EngineConfig"
        self._check_parallel(own)
        if self.speculative_config is not None:
            object.__setattr__(self, "speculative_config", SpeculativeConfig.parse(self.speculative_config))
        if self.async_scheduling and self.speculative_config is not None:
            raise ValueError(f"{own}: async_scheduling does not combine with speculative_config yet")
        if self.kv_cache_dtype.startswith("fp8"):
            raise ValueError(
                f"{own}.kv_cache_dtype={self.kv_cache_dtype!r}: fp8 KV caches are for GPUs; on CPU use 'int8'"
            )
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(
                f"{own}.kv_cache_dtype must be one of {KV_CACHE_DTYPES}, got {self.kv_cache_dtype!r}"
            )
        if self.busy_poll and not self.async_scheduling:
            raise ValueError(f"{own}.busy_poll needs async_scheduling (it is how a step's result is awaited)")
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
        check_range(own, "gpu_memory_utilization", self.gpu_memory_utilization, 0.0, 1.0, low_open=True)
        for size in self.cuda_graph_sizes or ():
            _positive_int(own, "cuda_graph_sizes", size, 1)
        choices = (
            ("kernel_backend", KERNEL_BACKENDS),
            ("bf16_gemm", BF16_GEMMS),
            ("device", DEVICES),
            ("load_format", LOAD_FORMATS),
            ("tokenizer_mode", TOKENIZER_MODES),
        )
        for name, allowed in choices:
            if getattr(self, name) not in allowed:
                raise ValueError(f"{own}.{name} must be one of {allowed}, got {getattr(self, name)!r}")
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
        check_range(own, "edf_slack_s", self.edf_slack_s, 0.0, low_open=True)
        for name in ("target_ttft_ms", "target_tpot_ms"):
            if getattr(self, name) is not None:
                check_range(own, name, getattr(self, name), 0.0, 3.6e6, low_open=True)
        if (
            not self.enable_chunked_prefill
            and self.max_model_len is not None
            and self.max_num_batched_tokens < self.max_model_len
        ):
            raise ValueError(
                f"{own}.max_num_batched_tokens ({self.max_num_batched_tokens}) must be >= "
                f"max_model_len ({self.max_model_len}) when enable_chunked_prefill is False"
            )

    def _check_pipeline(self, own: str) -> None:
        """Pipeline-parallel options (flags named as on the command line)."""
        pp = self.pipeline_parallel_size
        _positive_int(own, "pipeline_parallel_size (--pipeline-parallel-size)", pp, 1)
        _positive_int(own, "nnodes (--nnodes)", self.nnodes, 1)
        _positive_int(own, "node_rank (--node-rank)", self.node_rank, 0)
        _positive_int(own, "master_port (--master-port)", self.master_port, 0)
        check_range(own, "distributed_timeout_s", self.distributed_timeout_s, 0.0, low_open=True)
        if self.distributed_executor_backend not in PP_BACKENDS:
            raise ValueError(
                f"{own}.distributed_executor_backend (--distributed-executor-backend) must be one "
                f"of {PP_BACKENDS}, got {self.distributed_executor_backend!r}"
            )
        if self.node_rank >= self.nnodes:
            raise ValueError(
                f"{own}.node_rank (--node-rank) must be < nnodes ({self.nnodes}), got {self.node_rank}"
            )
        if pp % self.nnodes:
            raise ValueError(
                f"{own}.pipeline_parallel_size ({pp}) must be a multiple of nnodes (--nnodes {self.nnodes}): "
                "each machine runs the same number of stages"
            )
        if self.nnodes > 1 and self.master_port == 0:
            raise ValueError(f"{own}.master_port (--master-port): several machines need a fixed port")
        if pp == 1:
            return
        if self.distributed_executor_backend == "ray" and not _ray_installed():
            raise ValueError(
                f"{own}.distributed_executor_backend='ray' (--distributed-executor-backend) needs Ray: "
                "pip install 'swiftserve[ray]'"
            )
        if self.data_parallel_size > 1:
            raise ValueError(
                f"{own}: pipeline_parallel_size > 1 does not combine with data_parallel_size > 1 yet"
            )
        if self.speculative_config is not None or self.async_scheduling:
            raise ValueError(
                f"{own}: pipeline_parallel_size > 1 does not combine with speculative_config or "
                "async_scheduling (the pipeline already overlaps steps)"
            )

    def _check_parallel(self, own: str) -> None:
        _positive_int(own, "data_parallel_size", self.data_parallel_size, 1)
        if self.data_parallel_backend not in DP_BACKENDS:
            raise ValueError(
                f"{own}.data_parallel_backend must be one of {DP_BACKENDS}, "
                f"got {self.data_parallel_backend!r}"
            )
        if self.data_parallel_backend == "ray":
            raise ValueError(
                f"{own}.data_parallel_backend='ray' is not built: use 'mp' on one machine, or the Ray "
                "Serve app for replicas on a Ray cluster (serve run swiftserve.integrations.ray_serve:app "
                "num_replicas=N)"
            )
        if self.tensor_parallel_size != 1:
            raise ValueError(
                f"{own}.tensor_parallel_size: tensor parallelism is not supported "
                "(use data parallel replicas)"
            )
        self._check_pipeline(own)
        for core in self.cpu_affinity or ():
            _positive_int(own, "cpu_affinity", core, 0)


def _ray_installed() -> bool:
    import importlib.util

    return importlib.util.find_spec("ray") is not None


def _positive_int(owner: str, name: str, value: object, low: int) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < low:
        raise ValueError(f"{owner}.{name} must be an integer >= {low}, got {value!r}")


def graph_sizes(config: EngineConfig) -> tuple[int, ...]:
    """The decode batch sizes to capture: config.cuda_graph_sizes, or 1, 2, 4, 8, 16, 24, ...
    up to max_num_seqs (vLLM's default buckets)."""
    if config.cuda_graph_sizes:
        return tuple(sorted(set(config.cuda_graph_sizes)))
    sizes = [s for s in (1, 2, 4) if s < config.max_num_seqs]
    sizes += list(range(8, config.max_num_seqs, 8))
    return (*sizes, config.max_num_seqs)
