"""A dispatch-mode counter of the ops that make the host wait for the device (a "host sync") on a GPU.

On CUDA these ops copy a value the host needs back from the device (`.item()`, `bool(t)`, `float(t)`), or size
their output by the data (`nonzero`, boolean-mask indexing, `masked_select`, `unique`, ...), which needs the count
on the host before the output can be allocated: the host stops queueing kernels until the device has caught up
(`torch.cuda.set_sync_debug_mode` warns on the same ops). On a CPU the same ops run without waiting, so the counter
recognises them by name and arguments: a test on a CPU then catches what would stall a GPU.
"""

from __future__ import annotations

import traceback
from collections import Counter
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

# Ops whose output size or value the host must read from the device.
SYNCING = {"_local_scalar_dense", "item", "is_nonzero", "equal", "nonzero", "masked_select", "unique",
           "_unique", "_unique2", "unique_consecutive", "unique_dim", "bincount", "tolist"}
# Indexing with a boolean mask turns the mask into indices with `nonzero` inside the op's kernel.
INDEXING = {"index", "index_put", "index_put_", "_index_put_impl_", "_unsafe_index", "_unsafe_index_put"}


def _histc_reads_bounds(args: tuple[Any, ...], kwargs: dict[str, Any]) -> bool:
    """`histc` reads its input's min and max back only when its bounds are equal (the default 0, 0): with bounds
    given, CUDA's kernel counts on the device (transformers counts expert assignments so, to avoid `bincount`)."""
    low = args[2] if len(args) > 2 else kwargs.get("min", 0)
    high = args[3] if len(args) > 3 else kwargs.get("max", 0)
    return low == high


def _has_mask_index(args: tuple[Any, ...]) -> bool:
    indices = args[1] if len(args) > 1 and isinstance(args[1], (list, tuple)) else ()
    return any(isinstance(i, torch.Tensor) and i.dtype in (torch.bool, torch.uint8) for i in indices)


class HostSyncs(TorchDispatchMode):
    """Counts host syncs by op, with where in shardfit or transformers each came from (`where`).

    Reads in shardfit's data stage are not counted: it builds each batch on the host before the batch moves to the
    device (data/loader.py), so its tensors never live on a GPU."""

    HOST_SIDE = ("data/",)

    def __init__(self) -> None:
        super().__init__()
        self.ops: Counter[str] = Counter()
        self.where: Counter[str] = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = func.overloadpacket.__name__
        if name in SYNCING or (name in INDEXING and _has_mask_index(args)) or \
                (name == "histc" and _histc_reads_bounds(args, kwargs)) or \
                (name == "repeat_interleave" and kwargs.get("output_size") is None and len(args) < 3):
            caller = self._caller()
            if not caller.startswith(self.HOST_SIDE):
                self.ops[name] += 1
                self.where[caller] += 1
        return func(*args, **kwargs)

    @staticmethod
    def _caller() -> str:
        """The innermost frame in shardfit or transformers (autograd's backward shows as `backward`)."""
        for frame in reversed(traceback.extract_stack()[:-3]):
            if "/shardfit/" in frame.filename or "/transformers/" in frame.filename:
                return f"{frame.filename.rsplit('/', 2)[-2]}/{frame.filename.rsplit('/', 1)[-1]}:{frame.lineno} " \
                       f"{frame.name}"
        return "backward (autograd)"

    @property
    def total(self) -> int:
        return sum(self.ops.values())
