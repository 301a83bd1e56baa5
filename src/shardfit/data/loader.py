"""Deterministic batching: which rows each rank sees at each step follows from (seed, epoch, step) alone.

That makes resume exact (the data position is just the step) and lets every rank know the token count of the
whole global batch without communication, so the loss is normalised the same way at any world size.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from shardfit.data.packing import PackedRow
from shardfit.data.tokenize import IGNORE


@dataclass
class Batch:
    input_ids: torch.Tensor
    position_ids: torch.Tensor
    targets: torch.Tensor
    n_real_tokens: int
    # Vision-language batches: pixel_values and image_grid_thw of every image in the batch, in token order (absent
    # when no row has an image); input_features (mel bins, frames of every clip side by side) and
    # audio_feature_lens (frames per clip) of every audio clip (Qwen2.5-Omni); pixel_values_videos and video_grid_thw
    # of every video. position_ids is then (4, rows,
    # width): the text positions that bound each packed example, then the three M-RoPE axes.
    media: dict[str, torch.Tensor] = field(default_factory=dict)

    def to(self, device: torch.device | str) -> Batch:
        return Batch(self.input_ids.to(device, non_blocking=True), self.position_ids.to(device, non_blocking=True),
                     self.targets.to(device, non_blocking=True), self.n_real_tokens,
                     {k: v.to(device, non_blocking=True) for k, v in self.media.items()})


def collate(rows: list[PackedRow], pad_id: int, width: int | None = None) -> Batch:
    """Right-pad rows to the longest, or to `width` (fixed shapes for compiled blocks).

    Padding restarts its positions at 0, so it is a block of its own."""
    width = max([len(r) for r in rows] + [width or 0])
    ids = torch.full((len(rows), width), pad_id, dtype=torch.long)
    pos = torch.zeros((len(rows), width), dtype=torch.long)
    tgt = torch.full((len(rows), width), IGNORE, dtype=torch.long)
    for i, r in enumerate(rows):
        n = len(r)
        ids[i, :n] = torch.tensor(r.input_ids)
        pos[i, :n] = torch.tensor(r.position_ids)
        tgt[i, :n] = torch.tensor(r.targets)
        if n < width:
            pos[i, n:] = torch.arange(width - n)
    if not any(r.mrope is not None for r in rows):
        return Batch(ids, pos, tgt, sum(len(r) for r in rows))
    pos4 = pos[None].repeat(4, 1, 1)
    for i, r in enumerate(rows):
        if r.mrope is not None:
            pos4[1:, i, :len(r)] = torch.tensor(r.mrope)
    media: dict[str, torch.Tensor] = {}
    pixels = [p for r in rows for p in r.pixel_values]
    if pixels:
        media = {"pixel_values": torch.cat([p.load() for p in pixels]),
                 "image_grid_thw": torch.cat([g for r in rows for g in r.image_grid_thw])}
    if any(r.videos for r in rows):
        media["pixel_values_videos"] = torch.cat([v.load() for r in rows for v in r.videos])
        media["video_grid_thw"] = torch.cat([g for r in rows for g in r.video_grid_thw])
    clips = [c.load() for r in rows for c in r.audio]
    if clips:
        media["input_features"] = torch.cat([f for f, _ in clips], dim=1)
        media["audio_feature_lens"] = torch.cat([n for _, n in clips])
    return Batch(ids, pos4, tgt, sum(len(r) for r in rows), media)


@dataclass
class StepRows:
    """The micro-batches of one optimizer step for one rank, and the target count of the global batch."""

    micro_batches: list[list[PackedRow]]
    global_targets: int
    global_tokens: int


class BatchSchedule:
    """Epoch-seeded permutation of rows, cut into global batches of micro_batch * world * grad_accum rows.

    The last global batch of an epoch is completed by wrapping to the start of the permutation, so every rank runs
    the same number of forwards (FSDP needs that) and no row is dropped.
    """

    def __init__(self, rows: list[PackedRow], micro_batch: int, grad_accum: int, world: int, rank: int, seed: int):
        self.rows, self.mb, self.accum = rows, micro_batch, grad_accum
        self.world, self.rank, self.seed = world, rank, seed
        self.global_rows = micro_batch * grad_accum * world
        self.steps_per_epoch = max(1, -(-len(rows) // self.global_rows))

    def _order(self, epoch: int) -> list[int]:
        g = torch.Generator().manual_seed(self.seed + epoch)
        perm = torch.randperm(len(self.rows), generator=g).tolist()
        need = self.steps_per_epoch * self.global_rows
        while len(perm) < need:
            perm += perm[: need - len(perm)]
        return perm

    def step(self, global_step: int) -> StepRows:
        """Rows for optimizer step `global_step` (0-based, counted across epochs)."""
        epoch, k = divmod(global_step, self.steps_per_epoch)
        order = self._order(epoch)
        chunk = order[k * self.global_rows:(k + 1) * self.global_rows]
        rows = [self.rows[i] for i in chunk]
        global_targets = sum(r.n_targets for r in rows)
        # Micro-batch m of rank r takes a contiguous slice: identical to single-process order when world=1.
        micro = []
        for m in range(self.accum):
            base = (m * self.world + self.rank) * self.mb
            micro.append(rows[base:base + self.mb])
        return StepRows(micro, global_targets, sum(len(r) for r in rows))

    def epoch_of(self, global_step: int) -> float:
        return global_step / self.steps_per_epoch
