"""``python -m swiftserve.bench.gpu_check --out DIR``: the one device check, in stages.

Stages: the machine's ceilings (device copy bandwidth, bf16 matmul), the GPU tests
(``pytest -m gpu`` and the Triton kernel tests on the GPU), parity with transformers on the GPU
(float32, greedy; a divergence reports the logit margin), graph-vs-eager bitwise, then TPOT at
batch 1 and 64 and offline throughput for the SmolLM-135M shape and a Llama-3-8B shape (dummy
weights), eager vs CUDA graphs vs graphs with async scheduling (and busy-poll), and
transformers on the same GPU. ``results.json`` is
rewritten after every stage, so a timeout still leaves data. ``--smoke`` runs a CPU version
(tiny model, PyTorch backend) so the script cannot rot in CI.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
import traceback
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

import torch

LLAMA3_8B = dict(
    hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
    num_key_value_heads=8, vocab_size=128256, max_position_embeddings=8192, rope_theta=500000.0,
)  # fmt: skip


class Check:
    """Runs stages, records each one's result or error, saves after every stage."""

    def __init__(self, out: Path):
        self.out = out
        out.mkdir(parents=True, exist_ok=True)
        self.results: dict[str, Any] = {}

    def stage(self, name: str, fn: Callable[[], Any]) -> Any:
        start = time.perf_counter()
        print(f"== {name}", flush=True)
        try:
            value = fn()
            self.results[name] = {
                "ok": True,
                "seconds": round(time.perf_counter() - start, 1),
                "result": value,
            }
        except Exception as e:  # a stage that breaks must not lose the others
            traceback.print_exc()
            value = None
            self.results[name] = {
                "ok": False,
                "seconds": round(time.perf_counter() - start, 1),
                "error": repr(e),
            }
        print(json.dumps(self.results[name], default=str)[:2000], flush=True)
        (self.out / "results.json").write_text(json.dumps(self.results, indent=2, default=str))
        return value


def _median_ms(fn: Callable[[], Any], repeats: int = 10) -> float:
    fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return sorted(times)[len(times) // 2]


def ceilings() -> dict[str, float]:
    """Device-to-device copy (bytes read + written) and an 8192^3 bf16 matmul on random data."""
    src = torch.randn(2**29, device="cuda", dtype=torch.bfloat16)  # 1 GiB
    dst = torch.empty_like(src)
    copy_ms = _median_ms(lambda: dst.copy_(src))
    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    mm_ms = _median_ms(lambda: a @ b)
    return {"copy_TBps": 2 * src.numel() * 2 / copy_ms / 1e9, "bf16_matmul_TFLOPs": 2 * 8192**3 / mm_ms / 1e9}


def run_tests(root: Path) -> dict[str, Any]:
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "tests/test_gpu.py",
           "tests/test_triton_kernels.py"]  # fmt: skip
    proc = subprocess.run(cmd, cwd=root, capture_output=True, text=True, timeout=240)
    return {"returncode": proc.returncode, "tail": proc.stdout[-1500:] + proc.stderr[-500:]}


def parity(model_dir: Path, device: str, backend: str, **options: Any) -> dict[str, Any]:
    """Greedy tokens of our engine vs transformers (float32) on the same device."""
    from transformers import AutoModelForCausalLM

    from swiftserve import LLM, SamplingParams

    prompts = [[5, 17, 99, 3, 250], [7] * 9, list(range(20, 60)), [300, 2, 11]]
    llm = LLM(
        str(model_dir), dtype="float32", device=device, kernel_backend=backend, progress=False, **options
    )
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True, logprobs=2)
    ours = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    hf = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).to(device).eval()  # type: ignore[arg-type]
    report = []
    for p, out in zip(prompts, ours, strict=True):
        ids = torch.tensor([p], device=device)
        with torch.no_grad():
            ref = hf.generate(ids, max_new_tokens=16, do_sample=False, output_scores=True,
                              return_dict_in_generate=True, min_new_tokens=16)  # fmt: skip
        theirs = ref.sequences[0, len(p) :].tolist()
        mine = out.outputs[0].token_ids
        first = next((i for i, (a, b) in enumerate(zip(mine, theirs, strict=True)) if a != b), None)
        entry: dict[str, Any] = {"equal": mine == theirs, "first_divergence": first}
        if first is not None:  # a near-tie is not a bug: report the reference's logit margin there
            top2 = ref.scores[first][0].float().topk(2).values
            entry["hf_logit_margin"] = float(top2[0] - top2[1])
        report.append(entry)
    return {"all_equal": all(e["equal"] for e in report), "prompts": report}


def graph_vs_eager(model_dir: Path) -> dict[str, Any]:
    """Decode steps replayed from CUDA graphs give bitwise the eager logits (via logprobs)."""
    from swiftserve import LLM, SamplingParams

    prompts = [{"prompt_token_ids": [11 + i, 40, 7 + 3 * i, 99]} for i in range(8)]  # batch 8: a bucket
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, logprobs=5)
    outs = {}
    for eager in (True, False):
        llm = LLM(str(model_dir), dtype="bfloat16", device="cuda", enforce_eager=eager,
                  cuda_graph_sizes=(1, 8), progress=False)  # fmt: skip
        outs[eager] = [(o.outputs[0].token_ids, o.outputs[0].logprobs) for o in llm.generate(prompts, params)]
        assert eager or llm.engine.executor.worker.runner.graphs is not None  # type: ignore[attr-defined]
    same = outs[True] == outs[False]
    return {"bitwise_equal_logprobs": same}


def speed(model_dir: Path, device: str, label: str, extra: dict[str, Any], batch_sizes: tuple[int, ...],
          io: tuple[int, int]) -> dict[str, Any]:  # fmt: skip
    """TPOT (ms) at each batch size and offline throughput (tokens/s), fresh random prompts."""
    import random

    from swiftserve import LLM, SamplingParams

    start = time.perf_counter()
    llm = LLM(str(model_dir), device=device, progress=False, **extra)
    result: dict[str, Any] = {"label": label, "init_s": round(time.perf_counter() - start, 1)}
    rng = random.Random(0)
    vocab = min(llm.engine.model_info.vocab_size, 8000)
    params = SamplingParams(temperature=0.0, max_tokens=io[1], ignore_eos=True)
    llm.generate([{"prompt_token_ids": [rng.randrange(10, vocab) for _ in range(8)]}], params, use_tqdm=False)
    for batch in batch_sizes:
        prompts = [
            {"prompt_token_ids": [rng.randrange(10, vocab) for _ in range(io[0])]} for _ in range(batch)
        ]
        t0 = time.perf_counter()
        outs = llm.generate(prompts, params, use_tqdm=False)
        wall = time.perf_counter() - t0
        tpots = []
        for o in outs:
            m = o.metrics
            assert m is not None and m.first_token_time is not None and m.finished_time is not None
            tpots.append((m.finished_time - m.first_token_time) * 1000 / (io[1] - 1))
        result[f"batch{batch}"] = {
            "tpot_ms_median": sorted(tpots)[len(tpots) // 2],
            "output_tokens_per_s": batch * io[1] / wall,
            "wall_s": round(wall, 2),
        }
    result.update(llm.engine.wakeup_stats())  # async scheduling: the engine thread's wake-ups
    return result


def step_profile(model_dir: Path, **options: Any) -> dict[str, Any]:
    """Where a decode step goes: graph replay alone (CUDA events) at batch 1 and 64 (pure
    decode steps), the whole batch-1 step, and the host functions that take the most time
    (cProfile over 64 decode steps)."""
    import cProfile
    import io
    import pstats

    from swiftserve import LLM, SamplingParams

    llm = LLM(
        str(model_dir), dtype="bfloat16", device="cuda", cuda_graph_sizes=(1, 64), progress=False, **options
    )
    params = SamplingParams(temperature=0.0, max_tokens=64, ignore_eos=True)
    prompt = [{"prompt_token_ids": list(range(100, 228))}]
    llm.generate(prompt, params, use_tqdm=False)
    graphs = llm.engine.executor.worker.runner.graphs  # type: ignore[attr-defined]
    replay_ms = _median_ms(graphs.graphs[1][0].replay, repeats=50)
    # batch 64 at a 200-token context: every row reads 13 blocks, writes no KV (slot -1)
    graphs.pos[:64].fill_(200)
    graphs.slots[:64].fill_(-1)
    graphs.tables[:64] = torch.arange(graphs.max_blocks, device=graphs.tables.device)
    replay64_ms = _median_ms(graphs.graphs[64][0].replay, repeats=20)
    profiler = cProfile.Profile()
    t0 = time.perf_counter()
    profiler.enable()
    llm.generate([{"prompt_token_ids": list(range(300, 428))}], params, use_tqdm=False)
    profiler.disable()
    step_ms = (time.perf_counter() - t0) * 1000 / 64
    out = io.StringIO()
    pstats.Stats(profiler, stream=out).sort_stats("tottime").print_stats(18)
    return {
        "graph_replay_ms": replay_ms,
        "graph_replay_batch64_ms": replay64_ms,
        "step_ms_profiled": step_ms,
        "top": out.getvalue()[-6000:],
    }


def hf_throughput(model_dir: Path, batch: int, io: tuple[int, int]) -> dict[str, Any]:
    """transformers ``generate`` on the same GPU, bfloat16, same shapes (no padding needed)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.bfloat16).to("cuda").eval()  # type: ignore[arg-type]
    ids = torch.randint(10, 8000, (batch, io[0]), device="cuda")
    with torch.no_grad():
        model.generate(ids[:, :8], max_new_tokens=4, do_sample=False, min_new_tokens=4)
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        model.generate(ids, max_new_tokens=io[1], do_sample=False, min_new_tokens=io[1])
        torch.cuda.synchronize()
    wall = time.perf_counter() - t0
    return {"output_tokens_per_s": batch * io[1] / wall, "wall_s": round(wall, 2)}


def dummy_8b(root: Path, tokenizer_dir: Path) -> Path:
    """A Llama-3-8B-shaped checkpoint directory: config.json and a tokenizer, no weights."""
    import shutil

    out = root / "llama3-8b-shape"
    out.mkdir(parents=True, exist_ok=True)
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        if (tokenizer_dir / name).is_file():
            shutil.copy(tokenizer_dir / name, out / name)
    config = json.loads((tokenizer_dir / "config.json").read_text())
    config.update(LLAMA3_8B, tie_word_embeddings=False, torch_dtype="bfloat16")
    (out / "config.json").write_text(json.dumps(config))
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--out", required=True)
    parser.add_argument("--smoke", action="store_true", help="CPU version for CI (tiny model)")
    parser.add_argument("--skip", default="", help="comma-separated stage names to skip")
    parser.add_argument("--models-dir", default=None, help="where to write the test checkpoints")
    args = parser.parse_args(argv)
    from swiftserve.tools.demo import write_random_checkpoint

    out = Path(args.out)
    check = Check(out)
    skip = set(filter(None, args.skip.split(",")))
    root = Path(__file__).resolve().parents[3]
    models = Path(args.models_dir) if args.models_dir else out / "models"
    tiny = write_random_checkpoint(models / "tiny", preset="tiny", architecture="llama", seed=0)
    check.results["env"] = {
        "torch": torch.__version__, "cuda": torch.cuda.is_available(),
        "device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
    }  # fmt: skip
    if args.smoke:
        check.stage("parity_cpu", lambda: parity(tiny, "cpu", "torch"))
        check.stage("parity_cpu_async", lambda: parity(tiny, "cpu", "torch", async_scheduling=True))
        check.stage("speed_tiny_cpu", lambda: speed(tiny, "cpu", "tiny cpu", {}, (1, 4), (16, 8)))
        cpu_async = {"async_scheduling": True}
        check.stage(
            "speed_tiny_cpu_async", lambda: speed(tiny, "cpu", "tiny cpu async", cpu_async, (1, 4), (16, 8))
        )
        return 0 if all(r.get("ok", True) for r in check.results.values()) else 1
    smol = write_random_checkpoint(models / "smollm", preset="smollm-135m", architecture="llama", seed=0)
    stages: list[tuple[str, Callable[[], Any]]] = [
        ("ceilings", ceilings),
        ("tests", lambda: run_tests(root)),
        ("parity_cuda_triton", lambda: parity(tiny, "cuda", "triton")),
        ("parity_cuda_torch", lambda: parity(tiny, "cuda", "torch")),
        ("parity_cuda_async", lambda: parity(tiny, "cuda", "triton", async_scheduling=True)),
        ("graph_vs_eager", lambda: graph_vs_eager(tiny)),
    ]
    graphs = (1, 2, 4, 8, 16, 32, 64)
    overlap: dict[str, Any] = {"cuda_graph_sizes": graphs, "async_scheduling": True}
    variants: tuple[tuple[str, dict[str, Any]], ...] = (
        ("graphs", {"cuda_graph_sizes": graphs}),
        ("graphs_overlap", overlap),
        ("graphs_overlap_busy_poll", {**overlap, "busy_poll": True}),
        ("eager", {"enforce_eager": True}),
    )
    for label, extra in variants:
        opts = {"dtype": "bfloat16", "max_num_seqs": 64, **extra}
        stages.append((f"smollm_{label}", partial(speed, smol, "cuda", label, opts, (1, 64), (128, 128))))
    stages.append(("smollm_transformers", lambda: hf_throughput(smol, 64, (128, 128))))
    stages.append(("step_profile", lambda: step_profile(smol)))
    big = dummy_8b(models, smol)
    big_opts = {"load_format": "dummy", "max_model_len": 1024}
    stages.append(("llama8b_step_profile", lambda: step_profile(big, **big_opts)))
    for label, extra in variants[:2] + variants[3:]:
        opts = {
            "dtype": "bfloat16",
            "max_num_seqs": 64,
            "load_format": "dummy",
            "max_model_len": 1024,
            **extra,
        }
        stages.append((f"llama8b_{label}", partial(speed, big, "cuda", label, opts, (1, 64), (128, 128))))
    for name, fn in stages:
        if name not in skip:
            check.stage(name, fn)
    return 0


if __name__ == "__main__":
    sys.exit(main())
