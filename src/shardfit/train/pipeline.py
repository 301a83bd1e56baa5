"""Training and evaluation through pipeline stages (parallel/pipeline.py): the step's micro-batches go through
torch.distributed.pipelining's 1F1B schedule, or its interleaved 1F1B or interleaved zero bubble (each backward
split into an input-gradient and a weight-gradient pass) over several stages per rank (one schedule
micro-batch per grad_accum micro-batch, so a step is the global batch of one process), the held-out rows through a
forward-only schedule (GPipe's, or the interleaved one's forwards), the gradient norm is the global one over every
stage, and the final adapter or model is gathered from the stages onto rank 0.

The loss is the chunked cross-entropy (train/loss.py) on the last stage, as the schedule's `loss_fn`: summed over
the micro-batch's targets and multiplied by the step's scale (the data-parallel replicas / the global batch's
target count, as the strategy averages the replicas' gradients), with the schedule's own division by the
micro-batch count off (`scale_grads=False`), so the gradients are one process's.
"""

from __future__ import annotations

import contextlib
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import FSDPModule
from torch.distributed.pipelining import (
    PipelineStage,
    Schedule1F1B,
    ScheduleGPipe,
    ScheduleInterleaved1F1B,
    ScheduleInterleavedZeroBubble,
)
from torch.distributed.pipelining.schedules import PipelineScheduleMulti, PipelineScheduleSingle
from torch.nn.parallel import DistributedDataParallel

from shardfit.data.loader import Batch
from shardfit.data.tokenize import IGNORE
from shardfit.parallel.layout import Layout
from shardfit.parallel.pipeline import DecoderStage, row_restarts
from shardfit.train.loss import chunked_cross_entropy
from shardfit.train.media_forward import embed_images

Schedule = PipelineScheduleSingle | PipelineScheduleMulti


class PipelineRun:
    """This rank's stages and the schedules that run them: one stage under 1F1B, several under interleaved 1F1B
    (`stages`, in order; the first one holds the rank's whole share of the model). `chunk`: rows per chunk of the
    loss; `autocast`: the dtype the forward and the loss compute in under autocast (None: none). `module`: what the
    schedule calls for a single stage, the stage as the strategy wrapped it over the stage's data-parallel ranks
    (DDP, FSDP2; set once parallelized): torch's PipelineStage keeps their gradients local until the step's last
    backward, then reduces them once."""

    def __init__(self, stages: list[DecoderStage], layout: Layout, device: torch.device, chunk: int,
                 autocast: torch.dtype | None = None, zero_bubble: bool = False):
        self.stages, self.layout, self.device, self.chunk = stages, layout, device, chunk
        self.zero_bubble = zero_bubble  # several stages: interleaved zero bubble's training steps, not 1F1B's
        self.stage = stages[0]
        self.module: nn.Module = self.stage
        for stage in stages:
            stage.autocast = autocast
        # A vision-language first stage writes the images as one process does
        self.stage.embed_images = embed_images
        self.autocast = autocast
        self.holds_first, self.holds_last = stages[0].is_first, stages[-1].is_last
        self.scale = 1.0
        self.sums: list[torch.Tensor] = []
        # A schedule per micro-batch count: a stage learns its activations' shape at its first step.
        self._train: dict[int, Schedule] = {}
        self._eval: Schedule | None = None

    def _schedule(self, n: int, *, train: bool) -> Schedule:
        """The schedule of `n` micro-batches: 1F1B (GPipe forward-only for evaluation) over one stage per rank,
        interleaved 1F1B or zero bubble over several (evaluation: interleaved 1F1B's forwards, the same)."""
        if len(self.stages) > 1:
            stages = [PipelineStage(s, s.stage, s.stages, self.device, group=self.layout.pp_group)
                      for s in self.stages]
            looped = ScheduleInterleavedZeroBubble if self.zero_bubble and train else ScheduleInterleaved1F1B
            return looped(stages, n, loss_fn=self._loss, scale_grads=False)
        stage = PipelineStage(self.module, self.stage.stage, self.stage.stages, self.device,
                              group=self.layout.pp_group)
        kind = Schedule1F1B if train else ScheduleGPipe
        return kind(stage, n, loss_fn=self._loss, scale_grads=False)

    def _loss(self, hidden: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        amp = torch.autocast(hidden.device.type, dtype=self.autocast) if self.autocast is not None \
            else contextlib.nullcontext()
        if isinstance(self.module, FSDPModule):
            # The head is in the stage's root unit, which FSDP2 may keep sharded between forwards (after the
            # schedule's shape inference): gathered here, its gradient reduced with the stage's at the step's end.
            self.module.unshard()
        with amp:  # the head's chunks in the compute dtype, as in one process's forward
            loss_sum, _ = chunked_cross_entropy(hidden, self.stages[-1].head, targets, self.chunk)
        self.sums.append(loss_sum.detach())
        return loss_sum * self.scale

    def _run(self, schedule: Schedule, batches: list[Batch], *, train: bool) -> list[torch.Tensor]:
        """Micro-batches (all of one shape) through `schedule`, one schedule micro-batch each; the last stage's
        summed loss of each micro-batch (empty on the other ranks)."""
        n = len(batches)
        ids, tgt = (torch.cat([getattr(b, k) for b in batches]) for k in ("input_ids", "targets"))
        pos = torch.cat([_rows_first(b.position_ids) for b in batches])
        self.sums = []
        args = (ids.to(self.device),) if self.holds_first else ()
        target = tgt.to(self.device) if self.holds_last else None
        losses: list[Any] | None = [] if self.holds_last else None
        if self.holds_first:  # each micro-batch's images, which `micro` (each row's micro-batch) picks
            self.stage.media = [{k: v.to(self.device) for k, v in b.media.items()} for b in batches]
        micro = torch.arange(n).repeat_interleave(batches[0].input_ids.shape[0])
        run = schedule.step if train else schedule.eval
        # DDP over the stage's replicas: a schedule's first step infers the activations' shapes by a forward of the
        # module outside torch's per-micro-batch `no_sync`, after which DDP would wait for a backward that never
        # comes and count every parameter twice at the real one. Under `no_sync` throughout, the stage's last
        # backward still reduces the step's gradients once: PipelineStage prepares that reduction itself.
        sync = self.module.no_sync() if isinstance(self.module, DistributedDataParallel) else contextlib.nullcontext()
        # Each row's restarts from the host's positions, kept on the host: the stages' mask choice reads no device.
        with sync:
            run(*args, position_ids=pos.to(self.device), restarts=row_restarts(pos.cpu()), micro=micro,
                target=target, losses=losses, return_outputs=False)
        self.stage.media = []
        # A stage's first step infers its activations' shape by a forward and backward of uninitialised tensors
        # through `_loss` too: the micro-batches' own sums are the last ones.
        return self.sums[-n:] if self.holds_last else []

    def train_step(self, batches: list[Batch], scale: float) -> list[torch.Tensor]:
        """Forward and backward of one optimizer step's micro-batches, the loss multiplied by `scale`; the last
        stage's summed loss of each (empty on the other stages)."""
        n = len(batches)
        if n not in self._train:
            self._train[n] = self._schedule(n, train=True)
        self.scale = scale
        return self._run(self._train[n], batches, train=True)

    def evaluate(self, batch: Batch) -> torch.Tensor | None:
        """One held-out micro-batch's summed loss on the last stage (None on the others)."""
        if self._eval is None:
            self._eval = self._schedule(1, train=False)
        self.scale = 1.0
        sums = self._run(self._eval, [batch], train=False)
        return sums[0] if sums else None


def _rows_first(position_ids: torch.Tensor) -> torch.Tensor:
    """Positions with the rows first, as the schedule splits its inputs into micro-batches: a vision-language
    batch's (4, rows, width) as (rows, 4, width) (parallel/pipeline.py `split_positions` reads them back)."""
    return position_ids.transpose(0, 1) if position_ids.ndim == 3 else position_ids


def over_stages(count: int, layout: Layout) -> int:
    """`count` (this stage's, e.g. its trainable parameters) summed over the pipeline's stages."""
    total = torch.tensor(count, dtype=torch.int64)
    dist.all_reduce(total, group=layout.pp_group)
    return int(total)


def clip_global_norm(params: list[nn.Parameter], max_norm: float, layout: Layout) -> torch.Tensor:
    """Clip the gradients of this stage's `params` by the norm over every stage's (the one process's norm), and
    return that norm (the same on every rank)."""
    grads = [p.grad for p in params if p.grad is not None]
    device = grads[0].device if grads else torch.device("cpu")
    local = torch.nn.utils.get_total_norm(grads, 2.0) if grads else torch.zeros((), device=device)
    if hasattr(local, "full_tensor"):  # FSDP2 shards over the stage's ranks: the stage's whole norm
        local = local.full_tensor()
    squares = local.to(torch.float64) ** 2
    dist.all_reduce(squares, group=layout.pp_group)  # replicas of a stage hold the same (reduced) gradients
    total = squares.sqrt().to(torch.float32)
    coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
    for g in grads:  # a sharded gradient's local shard: every rank scales its share by the same factor
        (g.to_local() if hasattr(g, "to_local") else g).mul_(coef.to(g.device))
    return total


class PipelineEvalModule(nn.Module):
    """What the Evaluator calls: forward(input_ids, position_ids, targets, ...) -> (summed loss, targets) through
    the pipeline, the rows padded to the training micro-batch's shape (the stages know that one). The last stage
    returns the loss, the others zero, so the Evaluator's sum over the ranks counts each row once."""

    def __init__(self, run: PipelineRun, height: int, width: int):
        super().__init__()
        self.stage = run.stage  # a child: train() and eval() reach the model
        self._run = [run]
        self.height, self.width = height, width

    def forward(self, input_ids: torch.Tensor, position_ids: torch.Tensor, targets: torch.Tensor,
                pixel_values: torch.Tensor | None = None, image_grid_thw: torch.Tensor | None = None,
                **_: Any) -> tuple[torch.Tensor, int]:
        media = {k: v for k, v in (("pixel_values", pixel_values), ("image_grid_thw", image_grid_thw))
                 if v is not None}
        pos = torch.stack([_pad(p, self.height, self.width, None) for p in position_ids]) \
            if position_ids.ndim == 3 else _pad(position_ids, self.height, self.width, None)
        loss = self._run[0].evaluate(Batch(_pad(input_ids, self.height, self.width, 0), pos,
                                           _pad(targets, self.height, self.width, IGNORE), 0, media))
        if loss is None:
            return torch.zeros((), dtype=torch.float64), 0
        return loss, int((targets != IGNORE).sum())


def _pad(t: torch.Tensor, height: int, width: int, fill: int | None) -> torch.Tensor:
    """`t` (rows x width) padded to `height` x `width`: `fill`, or continued positions where `fill` is None."""
    rows, w = t.shape
    if fill is None:
        out = torch.arange(width, dtype=t.dtype, device=t.device).repeat(height, 1)
        out[:rows, :w] = t
        if w < width and rows:
            out[:rows, w:] = t[:, -1:] + torch.arange(1, width - w + 1, dtype=t.dtype, device=t.device)
        return out
    out = torch.full((height, width), fill, dtype=t.dtype, device=t.device)
    out[:rows, :w] = t
    return out


def _whole(t: torch.Tensor) -> torch.Tensor:
    """`t` whole on the CPU: a DTensor (FSDP2's shard over the stage's ranks) gathered first, a collective."""
    if hasattr(t, "full_tensor"):
        t = t.full_tensor()
    return t.detach().cpu().contiguous()


def unwrapped(module: nn.Module) -> nn.Module:
    """The stage under DDP's wrapper (FSDP2 keeps the module itself)."""
    return module.module if isinstance(module, DistributedDataParallel) else module


def stage_state(module: nn.Module, trainable_only: bool) -> dict[str, torch.Tensor]:
    """This stage's state on the CPU under the model's names (the loss module's `model.` dropped), its trainable
    parameters only when `trainable_only`. Read directly (shards gathered over the stage's ranks): DCP's full state
    dict with CPU offload would keep it on the world's rank 0 only."""
    module = unwrapped(module)
    if trainable_only:
        items = [(k, p) for k, p in module.named_parameters() if p.requires_grad]
    else:
        items = list(module.state_dict().items())
    return {k[len("model."):]: _whole(v) for k, v in items if k.startswith("model.")}


def adapter_state(module: nn.Module) -> dict[str, torch.Tensor]:
    """This stage's adapter weights as peft writes them to adapter_model.safetensors (its own key conversion:
    peft selects the adapter's entries by the modules the stage holds)."""
    from peft import get_peft_model_state_dict

    return {k: _whole(v) for k, v in get_peft_model_state_dict(unwrapped(module).model).items()}


def gather_stages(run: PipelineRun, module: nn.Module, adapter: bool) -> dict[str, torch.Tensor]:
    """Every stage's trained state on the first stage's rank (empty on the others): the adapter file's entries
    (`adapter`), else the model's state under its own names; a collective over the stage's ranks (the shards'
    gather), then over the first data-parallel replica's pipeline."""
    sd = adapter_state(module) if adapter else stage_state(module, trainable_only=False)
    if run.layout.dp_rank != 0:  # the replicas hold the same weights: the first one's are saved
        return {}
    group = run.layout.pp_group
    first = dist.get_global_rank(group, 0)
    parts: list[Any] | None = [None] * run.layout.pp if dist.get_rank() == first else None
    dist.gather_object(sd, parts, dst=first, group=group)
    merged: dict[str, torch.Tensor] = {}
    for part in parts or []:
        merged.update(part)
    return merged
