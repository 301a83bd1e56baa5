"""`model_parallel` placement: one process, decoder blocks split over the local GPUs by their free memory.

Everything that is not a decoder block (embeddings, final norm, rotary tables, output head) goes to the first
device, so tied embeddings stay one tensor and the loss is computed where its logits are: hidden states make one
trip back from the last block's device, and labels are moved to them (train/loss.py). A user's `device_map:
auto` (accelerate's) does not guarantee either.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from shardfit.errors import UserError


def split_layers(n_layers: int, capacity: list[float], first_device_fixed: float, layer_cost: float) -> list[int]:
    """How many consecutive blocks each device takes: proportional to what is left after fixed costs."""
    if not capacity:
        raise ValueError("no devices")
    room = [max(c - (first_device_fixed if i == 0 else 0.0), 0.0) for i, c in enumerate(capacity)]
    total = sum(room)
    if total <= 0:
        raise ValueError("no memory left for decoder blocks")
    share = [n_layers * r / total for r in room]
    counts = [int(s) for s in share]
    # Hand out the remainder by largest fractional part, so the split is as even as memory allows.
    for i in sorted(range(len(share)), key=lambda i: share[i] - counts[i], reverse=True)[: n_layers - sum(counts)]:
        counts[i] += 1
    if layer_cost > 0:
        over = [i for i, c in enumerate(counts) if c * layer_cost > room[i] + 1e-9]
        if over:
            raise ValueError(f"blocks do not fit on device(s) {over}")
    return counts


def _blocks(model: nn.Module) -> tuple[str, nn.ModuleList]:
    best: tuple[str, nn.ModuleList] | None = None
    for name, module in model.named_modules():
        if isinstance(module, nn.ModuleList) and (best is None or len(module) > len(best[1])):
            best = (name, module)
    if best is None:
        raise TypeError(f"{type(model).__name__} has no list of decoder blocks to split")
    return best


def device_map_for(model: nn.Module, devices: list[int], capacity_bytes: list[float]) -> dict[str, Any]:
    """A `from_pretrained(device_map=...)` map for `model` (built on the meta device) over `devices`."""
    prefix, blocks = _blocks(model)
    n = len(blocks)
    block_bytes = sum(p.numel() * p.element_size() for p in blocks[0].parameters())
    total_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    fixed = total_bytes - n * block_bytes
    counts = split_layers(n, capacity_bytes, fixed, 0.0)
    dmap: dict[str, Any] = {}
    i = 0
    for dev, count in zip(devices, counts, strict=True):
        for _ in range(count):
            dmap[f"{prefix}.{i}"] = dev
            i += 1
    # Every other top-level piece (embeddings, norm, rotary, head, ...) on the first device.
    covered = set(dmap)
    for name, _ in model.named_modules():
        if not name or name == prefix or name.startswith(prefix + "."):
            continue
        if any(name.startswith(c + ".") for c in covered) or any(c.startswith(name + ".") for c in dmap):
            continue
        parent = name.rpartition(".")[0]
        if parent in covered:
            continue
        dmap[name] = devices[0]
        covered.add(name)
    return dmap


def balanced_device_map(model: nn.Module) -> dict[str, Any]:
    """The balanced map of `model` (built on the meta device) over every visible GPU, from their free memory."""
    if not torch.cuda.is_available() or torch.cuda.device_count() < 2:
        raise UserError("'strategy: model_parallel' needs at least two visible GPUs in one process; with one GPU "
                        "use strategy: single, with several ranks zero3.")
    devices = list(range(torch.cuda.device_count()))
    free = [float(torch.cuda.mem_get_info(d)[0]) for d in devices]
    try:
        return device_map_for(model, devices, free)
    except (TypeError, ValueError) as e:
        raise UserError(f"'strategy: model_parallel': {e}.") from None
