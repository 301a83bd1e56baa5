"""DeepSpeed-Ulysses attention for sequence parallelism: each rank of a sequence-parallel (SP) group holds a
contiguous 1/N slice of every row; around attention, an all-to-all trades the sequence split for a head split, so
each rank attends over the whole row with 1/N of the heads, then the reverse all-to-all gives back its slice.

The kernel is registered with transformers' AttentionInterface as `shardfit_ulysses`; the decoder's forward hands
it the `SequenceShard` (the SP group and the row's full position ids) through its keyword arguments. transformers
builds no mask for a kernel it does not know, so the block-causal mask of packed rows is built here from the full
position ids (a position restart starts a new example, as models/masks.py reads them); rows without a restart run
SDPA's causal kernel. Called without a shard it is plain SDPA; generation switches the model to SDPA for its masks
(`whole_row_attention`).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward

NAME = "shardfit_ulysses"
SHARD_KWARG = "sequence_shard"


@dataclass(frozen=True)
class SequenceShard:
    """What the attention of one micro-batch needs to know of its SP group: the group, its size, the full rows'
    position ids ([batch, width], every rank the same), from which the mask of packed rows follows, and this
    rank's place in the group (a vision-language body cuts its slice of the whole rows' embeddings by it)."""

    group: Any  # torch.distributed ProcessGroup
    size: int
    position_ids: torch.Tensor
    restarts: bool  # whether a row restarts its positions (packed examples), known on the host
    # The rows' width before they were padded to a multiple of `size` (None: not padded): the tokens from there on
    # are the split's own padding, which a one-process run never forwards.
    width: int | None = None
    rank: int = 0  # this rank's place in the group: its slice is the rank-th 1/size of the row

    def to(self, device: torch.device | str) -> SequenceShard:
        return SequenceShard(self.group, self.size, self.position_ids.to(device, non_blocking=True), self.restarts,
                             width=self.width, rank=self.rank)

    def own_tokens(self, rows: int) -> torch.Tensor | None:
        """Which of this rank's `rows` x slice tokens (flattened, row by row) the unsplit rows have: a bool
        [rows x width/size] on the positions' device, or None when the split added no padding."""
        padded = self.position_ids.shape[-1]
        if self.width is None or self.width == padded:
            return None
        s = padded // self.size
        start = self.rank * s
        return (torch.arange(start, start + s, device=self.position_ids.device) < self.width).repeat(rows)

    def mine(self, t: torch.Tensor, dim: int) -> torch.Tensor:
        """This rank's contiguous 1/size of `t` along `dim` (the whole row's width, a multiple of size)."""
        piece = t.shape[dim] // self.size
        return t.narrow(dim, self.rank * piece, piece)


def _seq_to_heads(x: torch.Tensor, group: Any, n: int) -> torch.Tensor:
    """[batch, heads, width/n, dim] (this rank's slice, all heads) -> [batch, heads/n, width, dim] (the whole row,
    this rank's heads): block j of the heads goes to rank j, and rank i's slice arrives as the i-th piece of the row."""
    b, h, s, d = x.shape
    send = x.reshape(b, n, h // n, s, d).permute(1, 0, 2, 3, 4).contiguous()
    recv = torch.empty_like(send)
    dist.all_to_all_single(recv, send, group=group)
    return recv.permute(1, 2, 0, 3, 4).reshape(b, h // n, n * s, d)


def _heads_to_seq(x: torch.Tensor, group: Any, n: int) -> torch.Tensor:
    """The inverse of `_seq_to_heads`: [batch, heads/n, width, dim] -> [batch, heads, width/n, dim]."""
    b, hn, w, d = x.shape
    send = x.reshape(b, hn, n, w // n, d).permute(2, 0, 1, 3, 4).contiguous()
    recv = torch.empty_like(send)
    dist.all_to_all_single(recv, send, group=group)
    return recv.permute(1, 0, 2, 3, 4).reshape(b, n * hn, w // n, d)


class _SeqToHeads(torch.autograd.Function):
    """`_seq_to_heads` whose backward is the reverse all-to-all of the gradient."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: Any, n: int) -> torch.Tensor:
        ctx.group, ctx.n = group, n
        return _seq_to_heads(x, group, n)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, ...]:
        return _heads_to_seq(grad.contiguous(), ctx.group, ctx.n), None, None


class _HeadsToSeq(torch.autograd.Function):
    """`_heads_to_seq` whose backward is the forward all-to-all of the gradient."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: Any, n: int) -> torch.Tensor:
        ctx.group, ctx.n = group, n
        return _heads_to_seq(x, group, n)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, ...]:
        return _seq_to_heads(grad.contiguous(), ctx.group, ctx.n), None, None


def block_causal(position_ids: torch.Tensor) -> torch.Tensor:
    """The boolean mask [batch, 1, width, width] of rows whose positions restart (packed examples): causal within
    each example. Built again in every layer: elementwise work of width^2, against attention's width^2 x head_dim
    multiply-adds per head, and no tensor held across layers."""
    first = position_ids[:, :1] - 1
    seq = (torch.diff(position_ids, prepend=first, dim=-1) != 1).cumsum(-1)
    width = position_ids.shape[-1]
    causal = torch.ones(width, width, dtype=torch.bool, device=position_ids.device).tril()
    return ((seq[:, :, None] == seq[:, None, :]) & causal)[:, None]


def _repeat_kv(x: torch.Tensor, heads: int, n: int) -> torch.Tensor:
    """Key/value heads as many as the all-to-all can split: kept where n divides them, else repeated up to the
    query heads (each query head's own key/value head next to it, as transformers' repeat_kv lays them out)."""
    kv = x.shape[1]
    return x if kv % n == 0 else x.repeat_interleave(heads // kv, dim=1)


def ulysses_attention(module: Any, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                      attention_mask: torch.Tensor | None, dropout: float = 0.0, scaling: float | None = None,
                      **kwargs: Any) -> tuple[torch.Tensor, None]:
    """transformers' attention signature: q [batch, heads, width/n, dim], k/v [batch, kv_heads, width/n, dim] ->
    ([batch, width/n, heads, dim], None)."""
    shard: SequenceShard | None = kwargs.pop(SHARD_KWARG, None)
    if shard is None or shard.size == 1:
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      **kwargs)
    n, heads = shard.size, query.shape[1]
    q = _SeqToHeads.apply(query, shard.group, n)
    k = _SeqToHeads.apply(_repeat_kv(key, heads, n), shard.group, n)
    v = _SeqToHeads.apply(_repeat_kv(value, heads, n), shard.group, n)
    mask = block_causal(shard.position_ids.to(q.device)) if shard.restarts else None
    gqa = k.shape[1] != q.shape[1]
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=dropout,
                                         is_causal=mask is None, scale=scaling, enable_gqa=gqa)
    out = _HeadsToSeq.apply(out, shard.group, n)
    return out.transpose(1, 2).contiguous(), None


@contextlib.contextmanager
def whole_row_attention(model: Any) -> Iterator[None]:
    """Generation with a model set to this kernel: SDPA, for which transformers builds the padding and causal
    masks that generation's batches need (it builds none for a kernel it does not know), then this kernel again."""
    config = getattr(model, "config", None)
    if getattr(config, "_attn_implementation", None) != NAME:
        yield
        return
    model.set_attn_implementation("sdpa")
    try:
        yield
    finally:
        model.set_attn_implementation(NAME)


def register() -> None:
    """Make `shardfit_ulysses` an attention implementation transformers' models accept (idempotent)."""
    AttentionInterface.register(NAME, ulysses_attention)
