"""Moving tokens to the ranks holding their experts and back: the (token, chosen expert) pairs sorted by expert, a
count exchange, then the rows by `all_to_all_single_autograd` both ways, so that the gradients of the experts'
weights arrive on the rank holding them and the hidden states' gradients on the token's rank."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed._functional_collectives import all_to_all_single_autograd


def _exchange_counts(send: torch.Tensor, group: Any) -> torch.Tensor:
    recv = torch.empty_like(send)
    dist.all_to_all_single(recv, send, group=group)
    return recv


def _exchange(rows: torch.Tensor, recv: list[int], send: list[int], group: Any) -> torch.Tensor:
    """`rows` split `send` ways out, `recv` rows back from each rank, with the gradient taking the way back."""
    out = all_to_all_single_autograd(rows.contiguous(), recv, send, group)
    return torch.ops._c10d_functional.wait_tensor(out)


def dispatch_combine(hidden: torch.Tensor, index: torch.Tensor, weights: torch.Tensor, local: int, group: Any,
                     ep: int, compute: Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor],
                     tally: Callable[[int], None] | None = None) -> torch.Tensor:
    """sum_k weights[t, k] * expert_{index[t, k]}(hidden[t]) for every token t, the experts held `local` to a rank
    of `group` (expert e on rank e // local). `compute(rows, local_ids [R, 1], ones [R, 1])` runs this rank's
    experts on the rows it received; `tally(rows)`: told how many rows left for other ranks."""
    k = index.shape[-1]
    flat = index.reshape(-1)
    order = torch.argsort(flat, stable=True)  # pairs by expert: by destination rank, and each rank's by expert
    token = order // k
    expert = flat[order]
    dest = torch.div(expert, local, rounding_mode="floor")
    send_counts = torch.bincount(dest, minlength=ep)
    if ep == 1:
        out = compute(hidden[token], expert[:, None], weights.new_ones(len(token), 1))
    else:
        recv_counts = _exchange_counts(send_counts, group)
        send_sizes, recv_sizes = send_counts.tolist(), recv_counts.tolist()
        if tally is not None:
            tally(sum(send_sizes) - send_sizes[dist.get_rank(group)])
        rows = _exchange(hidden[token], recv_sizes, send_sizes, group)
        ids = flat.new_empty(sum(recv_sizes))
        dist.all_to_all_single(ids, expert - dest * local, recv_sizes, send_sizes, group=group)
        computed = compute(rows, ids[:, None], weights.new_ones(len(ids), 1))
        if rows.requires_grad and not computed.requires_grad:
            # No row came (eager's loop ran no expert and returned fresh zeros): tied to the graph anyway, so that
            # backward runs this exchange's all-to-all as the other ranks do, instead of leaving them waiting.
            computed = computed + rows * 0
        out = _exchange(computed, send_sizes, recv_sizes, group)
    weighted = out * weights.reshape(-1)[order, None].to(out.dtype)
    return torch.zeros_like(hidden).index_add_(0, token, weighted.to(hidden.dtype))
