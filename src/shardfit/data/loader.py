"""Deterministic batching: which examples each rank sees at each step follows from (seed, epoch, step) alone.

That makes resume exact (the data position is just the step) and lets every rank know the token count of the
whole global batch without communication, so the loss is normalised the same way at any world size.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from shardfit.data.packing import PackedRow, no_pack
from shardfit.data.tokenize import IGNORE, Encoded
from shardfit.resolve.job import RowShape


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
    # Counted on the host while the batch is still there, so the step never reads them back from a GPU: the
    # labelled positions, and whether any row restarts its positions (packed examples; None: not known).
    n_targets: int | None = None
    restarts: bool | None = None
    # Preference batches (data/preference.py): `seq_ids` (each position's sequence tag, -1: none), `ref_logps` (the
    # reference model's log-probability of each sequence's answer, where computed before training) and
    # `desirable` (KTO); `n_seqs` sequences in all.
    pref: dict[str, torch.Tensor] = field(default_factory=dict)
    n_seqs: int = 0
    # Sequence parallelism: this rank's slice's SP group and the whole rows' positions (parallel/ulysses.py
    # `SequenceShard`, set by parallel/sequence.py `shard_batch`); None: the rows are whole.
    shard: Any = None

    def to(self, device: torch.device | str) -> Batch:
        return Batch(self.input_ids.to(device, non_blocking=True), self.position_ids.to(device, non_blocking=True),
                     self.targets.to(device, non_blocking=True), self.n_real_tokens,
                     {k: v.to(device, non_blocking=True) for k, v in self.media.items()}, self.n_targets,
                     self.restarts, {k: v.to(device, non_blocking=True) for k, v in self.pref.items()}, self.n_seqs,
                     self.shard.to(device) if self.shard is not None else None)

    def pinned(self) -> Batch:
        """The batch in page-locked host memory, from which a copy to a GPU runs without the host waiting for it
        (`to` copies with non_blocking). Only where a GPU takes the batch: pinning needs one."""
        return dataclasses.replace(self, input_ids=self.input_ids.pin_memory(),
                                   position_ids=self.position_ids.pin_memory(), targets=self.targets.pin_memory(),
                                   media={k: v.pin_memory() for k, v in self.media.items()},
                                   pref={k: v.pin_memory() for k, v in self.pref.items()})

    def tensors(self) -> list[torch.Tensor]:
        """Every tensor the batch holds (a copy stream's consumer marks them as used on its own stream)."""
        shard = [self.shard.position_ids] if self.shard is not None else []
        return [self.input_ids, self.position_ids, self.targets, *self.media.values(), *self.pref.values(), *shard]

    @property
    def host_facts(self) -> dict[str, Any]:
        """The loss module's keyword arguments for what the host knows (train/loss.py `CausalLMLoss`), with a
        preference batch's sequences (train/preference.py `PreferenceLoss`)."""
        facts: dict[str, Any] = {"n_targets": self.n_targets, "restarts": self.restarts}
        if self.n_seqs:
            facts.update(self.pref, n_seqs=self.n_seqs)
        if self.shard is not None:
            facts["sequence_shard"] = self.shard
        return facts


def _host_facts(pos: torch.Tensor, tgt: torch.Tensor) -> tuple[int, bool]:
    """The labelled positions and whether a row restarts its positions, from the batch's host tensors."""
    restarts = bool((torch.diff(pos, dim=-1) != 1).any()) if pos.shape[-1] > 1 else False
    return int((tgt != IGNORE).sum()), restarts


def collate(rows: list[PackedRow], pad_id: int, shape: RowShape | None = None) -> Batch:
    """Right-pad rows to the longest, or to `shape.width`, and add empty rows up to `shape.height` (compiled blocks
    want one static shape, while a packed micro-batch has a varying number of rows). `shape.multiple` rounds the
    width up to a multiple of itself, or of an eighth of the width's power of two when that is larger (at most 1/8
    padding), never past `shape.limit` (nor below the longest row), so micro-batches come in few shapes. No shape:
    the longest row, as it is.

    Padding carries no target and continues the positions of its row's last example, so a micro-batch whose rows
    each hold one example has no position restart: transformers then builds no block mask (packed rows still get
    one), SDPA runs its causal kernel, and the real tokens, which come before the padding, are unchanged."""
    shape = shape or RowShape(limit=max([len(r) for r in rows] + [1]), micro_batch=len(rows))
    width = max([len(r) for r in rows] + [shape.width or 0])
    if shape.multiple > 1:
        step = max(shape.multiple, (1 << (width.bit_length() - 1)) // 8)
        rounded = -(-width // step) * step
        width = max(width, min(rounded, shape.limit))
    n_rows = max(len(rows), shape.height or 0)
    ids = torch.full((n_rows, width), pad_id, dtype=torch.long)
    pos = torch.arange(width).repeat(n_rows, 1)
    tgt = torch.full((n_rows, width), IGNORE, dtype=torch.long)
    for i, r in enumerate(rows):
        n = len(r)
        ids[i, :n] = torch.tensor(r.input_ids)
        pos[i, :n] = torch.tensor(r.position_ids)
        tgt[i, :n] = torch.tensor(r.targets)
        if n:
            pos[i, n:] = torch.arange(width - n) + r.position_ids[-1] + 1
    n_targets, restarts = _host_facts(pos, tgt)
    pref, n_seqs = _preference(rows, n_rows, width)
    if not any(r.mrope is not None or r.pixel_values for r in rows):
        return Batch(ids, pos, tgt, sum(len(r) for r in rows), n_targets=n_targets, restarts=restarts, pref=pref,
                     n_seqs=n_seqs)
    if any(r.mrope is not None for r in rows):
        pos4 = pos[None].repeat(4, 1, 1)
        for i, r in enumerate(rows):
            if r.mrope is not None:
                pos4[1:, i, :len(r)] = torch.tensor(r.mrope)
        pos = pos4  # else Gemma 3's images, read with 1-D positions
    return Batch(ids, pos, tgt, sum(len(r) for r in rows), _media(rows), n_targets, restarts, pref, n_seqs)


def _media(rows: list[PackedRow]) -> dict[str, torch.Tensor]:
    """The batch's images, videos and audio clips, each kind in token order, as the forward takes them."""
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
    return media


def _preference(rows: list[PackedRow], n_rows: int, width: int) -> tuple[dict[str, torch.Tensor], int]:
    """A preference micro-batch's sequence tensors (`Batch.pref`) and its sequence count; nothing for SFT rows."""
    infos = [s for r in rows for s in r.seq_info]
    if not infos:
        return {}, 0
    seq_ids = torch.full((n_rows, width), -1, dtype=torch.long)
    for i, r in enumerate(rows):
        if r.seqs:
            seq_ids[i, :len(r)] = torch.tensor(r.seqs)
    infos.sort(key=lambda s: s.tag)
    if [s.tag for s in infos] != list(range(len(infos))):
        raise ValueError(f"preference tags {[s.tag for s in infos]} are not 0..{len(infos) - 1}")
    pref = {"seq_ids": seq_ids}
    if all(s.ref_logp is not None for s in infos):
        pref["ref_logps"] = torch.tensor([s.ref_logp for s in infos], dtype=torch.float64)
    if all(s.desirable is not None for s in infos):
        pref["desirable"] = torch.tensor([s.desirable for s in infos], dtype=torch.bool)
    return pref, len(infos)


@dataclass
class StepRows:
    """The micro-batches of one optimizer step for one rank, and the counts of the global batch."""

    micro_batches: list[list[PackedRow]]
    global_targets: int  # the loss's terms over the global batch: labelled tokens (SFT), pairs or rows (preference)
    global_tokens: int
    global_examples: int


class BatchSchedule:
    """Epoch-seeded permutation of examples, cut into global batches of micro_batch * grad_accum * world examples.

    A micro-batch is `micro_batch` examples whatever `form` does with them: packing (`form` = `pack`) puts them in
    fewer, fuller rows and so only removes padding. An optimizer step therefore sees as many examples, and an epoch
    has as many steps, as in an unpacked run of the same config (the HF Trainer's, LLaMA-Factory's without packing).
    The last global batch of an epoch is completed by wrapping to the start of the permutation, so every rank runs
    the same number of forwards (FSDP needs that) and no example is dropped.
    """

    def __init__(self, examples: list[Encoded], micro_batch: int, grad_accum: int, world: int, rank: int, seed: int,
                 form: Callable[[list[Encoded]], list[PackedRow]] = no_pack):
        self.examples, self.mb, self.accum, self.form = examples, micro_batch, grad_accum, form
        self.world, self.rank, self.seed = world, rank, seed
        self.global_examples = micro_batch * grad_accum * world
        self.steps_per_epoch = max(1, -(-len(examples) // self.global_examples))
        self._epoch: tuple[int, list[int]] | None = None

    def _order(self, epoch: int) -> list[int]:
        if self._epoch is not None and self._epoch[0] == epoch:
            return self._epoch[1]
        g = torch.Generator().manual_seed(self.seed + epoch)
        perm = torch.randperm(len(self.examples), generator=g).tolist()
        need = self.steps_per_epoch * self.global_examples
        while len(perm) < need:
            perm += perm[: need - len(perm)]
        self._epoch = (epoch, perm)
        return perm

    def step(self, global_step: int) -> StepRows:
        """Rows for optimizer step `global_step` (0-based, counted across epochs)."""
        epoch, k = divmod(global_step, self.steps_per_epoch)
        order = self._order(epoch)
        chunk = [self.examples[i] for i in order[k * self.global_examples:(k + 1) * self.global_examples]]
        # Micro-batch m of rank r takes a contiguous slice: identical to single-process order when world=1.
        micro = []
        for m in range(self.accum):
            base = (m * self.world + self.rank) * self.mb
            micro.append(self.form(chunk[base:base + self.mb]))
        return StepRows(micro, sum(ex.units for ex in chunk), sum(ex.n_tokens for ex in chunk), len(chunk))

    def first_shapes(self, steps: int = 32) -> list[tuple[int, int]]:
        """(rows, width) of this rank's micro-batches over the first `steps` optimizer steps, width the longest row
        (before any rounding up): the shapes the attention kernel is handed."""
        return [(len(micro), max(len(r) for r in micro)) for k in range(min(steps, self.steps_per_epoch))
                for micro in self.step(k).micro_batches if micro]

    def new_shape_share(self, steps: int = 32) -> float:
        """The share of this rank's micro-batches over the first `steps` optimizer steps that bring a shape no
        earlier one had: near 1 when widths change every step, near 0 when packed rows fill to one width."""
        shapes = self.first_shapes(steps)
        return len(set(shapes)) / len(shapes) if shapes else 0.0

    def epoch_of(self, global_step: int) -> float:
        return global_step / self.steps_per_epoch
