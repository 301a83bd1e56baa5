"""The data and sequence layout of a job with `sequence_parallel: N`: world = dp x N ranks on a device mesh with
dims ("dp", "sp"), neighbouring ranks in one SP group (they exchange activations at every layer, so they share a
node where they can). The ranks of an SP group read the same rows (the data is split over the dp groups only) and
each keeps a contiguous 1/N of every row: input ids, targets and position ids, which stay the row's own, so RoPE
sees each token's true position. Vision-language rows are cut after their embedding (`shard_batch`). The model's
parameters stay with the strategy, over every rank.

Targets are shifted on the whole row before it is cut (data/loader.py), so a slice's last target is the next
slice's first token. Each rank's chunked loss sums its slice's targets; the step's normalisation by the global
batch's target count, with DDP/FSDP averaging the gradients over the world, then gives the unsplit loss and
gradients (train/recipe.py `train_step`).
"""

from __future__ import annotations

import dataclasses

import torch

from shardfit.data.loader import Batch
from shardfit.data.tokenize import IGNORE
from shardfit.parallel.layout import Layout
from shardfit.parallel.ulysses import SequenceShard


def _pad_width(t: torch.Tensor, width: int, fill: torch.Tensor | int) -> torch.Tensor:
    if t.shape[-1] == width:
        return t
    extra = width - t.shape[-1]
    pad = fill if isinstance(fill, torch.Tensor) else torch.full((*t.shape[:-1], extra), fill, dtype=t.dtype)
    return torch.cat([t, pad], dim=-1)


def shard_batch(batch: Batch, layout: Layout) -> Batch:
    """This rank's slice of a host batch: the width padded up to a multiple of the SP size (padding continues each
    row's positions and carries no target, as collate's does), then the `sp_rank`-th contiguous piece of the
    targets; the labelled count is the slice's own, and the loss module gets the SP group and the whole rows'
    positions for the attention's mask.

    Text rows: the input ids and positions are cut here too. Vision-language rows (positions (4, rows, width):
    the text positions, then the three M-RoPE axes, computed for each whole example by the data layer): the input
    ids and all four position rows stay whole, because the image features go into the embeddings of the whole
    row; the body cuts the embeddings and positions after that (train/media_forward.py), so an image's tokens may
    sit on any rank and keep the positions the whole row gives them."""
    if layout.sp == 1:
        return batch
    media_rows = batch.position_ids.dim() == 3
    if batch.pref or (batch.media and not media_rows) or batch.position_ids.dim() not in (2, 3):
        raise ValueError("sequence parallelism splits text rows and M-RoPE image rows only (resolve/sequence.py "
                         "refuses the rest)")
    n, width = layout.sp, batch.input_ids.shape[-1]
    padded = -(-width // n) * n
    extra = padded - width
    pos = batch.position_ids
    pos = _pad_width(pos, padded, pos[..., -1:] + torch.arange(1, extra + 1))
    # Text rows repeat their last token; image rows their first (a template token, never an image placeholder,
    # which would ask the tower for one more image's features).
    fill = batch.input_ids[:, :1] if media_rows else batch.input_ids[:, -1:]
    ids = _pad_width(batch.input_ids, padded, fill.expand(-1, extra))
    tgt = _pad_width(batch.targets, padded, IGNORE)
    piece = slice(layout.sp_rank * (padded // n), (layout.sp_rank + 1) * (padded // n))
    mine = tgt[:, piece]
    text_pos = pos[0] if media_rows else pos  # the mask's restarts: text positions (M-RoPE repeats within images)
    shard = SequenceShard(layout.group, n, text_pos, bool(batch.restarts), width=width, rank=layout.sp_rank)
    if not media_rows:
        ids, pos = ids[:, piece], pos[:, piece]
    return dataclasses.replace(batch, input_ids=ids.contiguous(), position_ids=pos.contiguous(),
                               targets=mine.contiguous(), n_targets=int((mine != IGNORE).sum()), shard=shard)
