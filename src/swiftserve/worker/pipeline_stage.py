"""One pipeline stage inside its worker: a range of layers, their KV cache, and the link
that carries hidden states to the next stage (torch.distributed point to point).

Every stage receives the same SchedulerOutput and builds the same batch layout (positions,
block tables, slots: block ids are the same on every stage); the first stage embeds the
token ids, each later stage receives the previous stage's (output, residual) pair, and only
the last stage computes logits and samples. The engine side is worker/pipeline.py.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from swiftserve.core.messages import RunnerOutput, ScheduledRequest, SchedulerOutput
from swiftserve.model.llama import LlamaForCausalLM
from swiftserve.model.ops import TorchOps
from swiftserve.worker.model_runner import ModelRunner, _Batch


def stage_layers(num_layers: int, rank: int, world: int) -> tuple[int, int]:
    """The [start, end) layer range of stage ``rank`` of ``world``: an even split, the first
    stages one layer more where it does not divide (the last stage also holds the norm, the
    lm_head and the sampler)."""
    if world > num_layers:
        raise ValueError(
            f"pipeline_parallel_size ({world}) is larger than the model's {num_layers} layers "
            "(--pipeline-parallel-size): every stage needs at least one layer"
        )
    share, extra = divmod(num_layers, world)
    start = rank * share + min(rank, extra)
    return start, start + share + (1 if rank < extra else 0)


def keep_stage_layers(model: LlamaForCausalLM, rank: int, world: int) -> tuple[int, int]:
    """Drop the layers other stages own (their weights are freed); returns the kept range."""
    start, end = stage_layers(len(model.model.layers), rank, world)
    model.model.layers = nn.ModuleList(list(model.model.layers)[start:end])
    return start, end


class StageLink:
    """Hidden states between neighbouring stages: one message of [2, tokens, hidden]
    (output and residual) per step, sent as raw bytes (any dtype travels over gloo)."""

    def __init__(self, rank: int, world: int):
        self.rank = rank
        self.world = world
        self.first = rank == 0
        self.last = rank == world - 1
        self._sending: tuple[dist.Work, torch.Tensor] | None = None

    def send(self, h: torch.Tensor, residual: torch.Tensor) -> None:
        """Start sending to the next stage; returns at once (the previous send must have
        landed first, so at most one step's buffer is in the air)."""
        self.wait_sent()
        buf = torch.stack((h, residual)).contiguous()
        work = dist.isend(buf.view(torch.uint8), dst=self.rank + 1)
        assert work is not None
        self._sending = (work, buf)

    def wait_sent(self) -> None:
        if self._sending is not None:
            self._sending[0].wait()
            self._sending = None

    def recv(
        self, tokens: int, hidden: int, dtype: torch.dtype, device: torch.device
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The previous stage's (output, residual) for a step of ``tokens`` rows."""
        buf = torch.empty((2, tokens, hidden), dtype=dtype, device=device)
        dist.recv(buf.view(torch.uint8), src=self.rank - 1)
        return buf[0], buf[1]


class StageRunner(ModelRunner):
    """A ModelRunner over one stage's layers: earlier stages forward and pass on, the last
    samples (the ModelRunner's own path from the final hidden states on)."""

    def __init__(self, model: LlamaForCausalLM, ops: TorchOps, link: StageLink, **kwargs: object):
        super().__init__(model, ops, **kwargs)  # type: ignore[arg-type]
        self.link = link

    def forward(self, scheduled: list[ScheduledRequest]) -> tuple[torch.Tensor, _Batch]:
        batch = self._prepare(scheduled)
        t = batch.num_tokens
        carried = None
        if not self.link.first:
            cfg = self.model.config
            carried = self.link.recv(t, cfg.hidden_size, self.model.dtype, self.device)
        h, residual = self.model.forward_stage(
            self._ids_t[:t], self._pos_t[:t], self.kv_caches, batch.meta, carried, self.link.last
        )
        if residual is not None:
            self.link.send(h, residual)
        return h, batch

    @torch.inference_mode()
    def execute(self, sched: SchedulerOutput) -> RunnerOutput:
        if self.link.last:
            return super().execute(sched)
        self._update_states(sched)  # (kept on every stage: the batch layout reads prompts)
        if not sched.is_empty:
            self.forward(sched.scheduled)
        return RunnerOutput()
