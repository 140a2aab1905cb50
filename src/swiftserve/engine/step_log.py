"""One JSON line per engine step (``EngineConfig(step_log=PATH)``, ``--step-log PATH``): what
the scheduler planned, what the step-cost model predicted, and what the step took. For
diagnosing the budget planner (docs/benchmarks.md, issue 18); off by default, and nothing
is computed when off."""

from __future__ import annotations

import json
import time
from typing import IO, TYPE_CHECKING

from swiftserve.core.messages import SchedulerOutput

if TYPE_CHECKING:
    from swiftserve.core.scheduler import Scheduler


class StepLog:
    """Appends one record per non-empty step to a file."""

    def __init__(self, path: str):
        self._file: IO[str] = open(path, "a", buffering=1, encoding="utf-8")  # noqa: SIM115 (lives with the engine)
        self._start = time.monotonic()

    def record(self, scheduler: Scheduler, sched: SchedulerOutput, seconds: float, predicted: float) -> None:
        if not sched.scheduled:
            return
        rows = sum(1 for item in sched.scheduled if len(item.token_ids) == 1)
        prompt = [item for item in sched.scheduled if len(item.token_ids) > 1]
        planner = scheduler.planner
        entry: dict[str, object] = {
            "t": round(time.monotonic() - self._start, 4),
            "decode_rows": rows,
            "prompt_tokens": sched.num_batched_tokens - rows,
            # attention work of the prompt chunks: tokens x (context before them + half of them)
            "prompt_attention": sum(len(i.token_ids) * (i.start_pos + len(i.token_ids) / 2) for i in prompt),
            "budget": scheduler.slo_stats()["step_budget"],
            "predicted_s": round(predicted, 5),
            "measured_s": round(seconds, 5),
            "running": scheduler.num_running,
            "waiting": scheduler.num_waiting,
        }
        if planner is not None:
            slack = planner.min_slack
            entry.update(
                margin=planner.margin,
                lead=planner.lead,
                ttft_risk=planner.ttft_risk,
                min_slack=round(slack, 4) if slack != float("inf") else None,  # None: nobody protected
            )
        self._file.write(json.dumps(entry) + "\n")
