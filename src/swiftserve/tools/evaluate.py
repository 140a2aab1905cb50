"""``swiftserve eval perplexity``: perplexity from the engine's own prompt logprobs.

The text is tokenized once and cut into non-overlapping windows of ``context_len`` tokens;
each window is one prompt. Every token but the first of a window is scored, so
``perplexity = exp(-sum(log p(token | window prefix)) / scored tokens)``. ``--reference hf``
scores the same windows with ``transformers`` for comparison (unquantized models).
"""

from __future__ import annotations

import argparse
import json
import math
import time
from pathlib import Path
from typing import Any


def windows_of(ids: list[int], context_len: int, max_tokens: int | None) -> list[list[int]]:
    """Non-overlapping windows (the last one may be shorter; windows of one token are dropped)."""
    if max_tokens is not None:
        ids = ids[:max_tokens]
    out = [ids[i : i + context_len] for i in range(0, len(ids), context_len)]
    return [w for w in out if len(w) > 1]


def engine_nll(llm: Any, windows: list[list[int]], progress: bool) -> tuple[float, int]:
    """(summed negative log-likelihood, scored tokens) from prompt logprobs."""
    from swiftserve import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=0)
    outs = llm.generate([{"prompt_token_ids": w} for w in windows], params, use_tqdm=progress)
    nll, count = 0.0, 0
    for window, out in zip(windows, outs, strict=True):
        plp = out.prompt_logprobs
        assert plp is not None and len(plp) == len(window)
        for pos in range(1, len(window)):
            entry = plp[pos]
            assert entry is not None
            nll -= entry[window[pos]].logprob
            count += 1
    return nll, count


def hf_nll(model_dir: str, windows: list[list[int]], dtype: str, progress: bool) -> tuple[float, int]:
    """The same sum with Hugging Face ``transformers`` (one window at a time)."""
    import torch
    from tqdm.auto import tqdm
    from transformers import AutoModelForCausalLM

    torch_dtype = torch.float32 if dtype == "auto" else getattr(torch, dtype)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch_dtype).eval()
    nll, count = 0.0, 0
    with torch.inference_mode():
        for window in tqdm(windows, desc="transformers", disable=not progress):
            ids = torch.tensor([window])
            logprobs = torch.log_softmax(model(ids).logits[0, :-1].float(), dim=-1)
            nll -= logprobs.gather(1, ids[0, 1:, None]).sum().item()
            count += len(window) - 1
    return nll, count


def load_text(data: str) -> str:
    """``held-out`` (the demo model's held-out stdlib files) or a UTF-8 text file."""
    if data == "held-out":
        from swiftserve.tools.corpus import heldout_text

        return heldout_text()
    path = Path(data)
    if not path.is_file():
        raise ValueError(f"--data: {data!r} is neither 'held-out' nor a file")
    return path.read_text(encoding="utf-8", errors="replace")


def main(args: argparse.Namespace, engine: dict[str, Any]) -> dict[str, Any]:
    from swiftserve import LLM
    from swiftserve.engine.model_source import resolve_model
    from swiftserve.model.config import ModelConfig

    if args.context_len is None:  # one position is left for the single generated token
        args.context_len = min(
            512, ModelConfig.from_dir(resolve_model(args.model)).max_position_embeddings - 1
        )
    if args.context_len < 2:
        raise ValueError(f"--context-len must be >= 2, got {args.context_len}")
    engine = {"max_model_len": args.context_len + 1, **engine}
    llm = LLM(args.model, progress=not args.quiet, **engine)
    text = load_text(args.data)
    ids = llm.tokenizer.encode(text, add_special_tokens=False)
    windows = windows_of(ids, args.context_len, args.max_eval_tokens)
    if not windows:
        raise ValueError("--data: the text has fewer than two tokens")
    started = time.perf_counter()
    nll, count = engine_nll(llm, windows, progress=not args.quiet)
    report: dict[str, Any] = {
        "perplexity": math.exp(nll / count),
        "tokens": count,
        "model": str(llm.model_path),
        "dtype": llm.engine.model_info.dtype,
        "quantization": llm.config.quantization,
        "quant_group_size": llm.config.quant_group_size if llm.config.quantization == "int4" else None,
        "weight_bytes": llm.engine.model_info.weight_bytes,
        "context_len": args.context_len,
        "windows": len(windows),
        "elapsed_s": round(time.perf_counter() - started, 2),
    }
    if args.reference == "hf":
        ref_nll, ref_count = hf_nll(str(llm.model_path), windows, engine.get("dtype", "auto"), not args.quiet)
        report["hf_perplexity"] = math.exp(ref_nll / ref_count)
        report["relative_difference"] = report["perplexity"] / report["hf_perplexity"] - 1
    print(json.dumps(report, indent=2))
    if args.output_json:
        Path(args.output_json).write_text(json.dumps(report, indent=2) + "\n")
    return report


def add_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--data", default="held-out", help="'held-out' (default) or a text file")
    parser.add_argument(
        "--context-len",
        type=int,
        default=None,
        help="tokens per scored window (default 512 or the model's limit)",
    )
    parser.add_argument("--max-eval-tokens", type=int, default=None, help="score only the first N tokens")
    parser.add_argument(
        "--reference", choices=("none", "hf"), default="none", help="also score with transformers"
    )
    parser.add_argument("--output-json", default=None)
    parser.add_argument("--quiet", action="store_true")
