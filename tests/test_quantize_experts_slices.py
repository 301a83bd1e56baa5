"""An NF4 expert stack is dequantized a slice of whole experts at a time into its 16-bit value
(models/quantize_experts.py `DequantizeExperts`): the same values as in one piece, with torchao's transients of
one slice beside the result instead of the whole stack's, as the planner counts them (plan/quant.py
`stack_dequantize_peak_bytes`)."""

from __future__ import annotations

import weakref

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from shardfit.models.nf4 import to_nf4, torchao_available
from shardfit.models.quantize_experts import DequantizeExperts
from shardfit.plan import quant

pytestmark = pytest.mark.skipif(not torchao_available(), reason="torchao is not installed")

SHAPE = (16, 128, 256)  # 16 experts of 32,768 elements: 2 experts a slice under a 65,536-element budget


class _Peak(TorchDispatchMode):
    """The most bytes of tensor storage alive at once among those the ops inside make, keyed by storage (so a view
    of a storage already counted, as torch.split's chunks of an NF4 weight's codes are, adds nothing; torch's
    MemTracker counts such a view's storage again)."""

    def __init__(self) -> None:
        super().__init__()
        self.live: dict[int, int] = {}
        self.now = self.peak = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001
        out = func(*args, **(kwargs or {}))
        for t in torch.utils._pytree.tree_leaves(out):
            if isinstance(t, torch.Tensor) and type(t) is torch.Tensor:
                st = t.untyped_storage()
                if st._cdata not in self.live:
                    self.live[st._cdata] = st.nbytes()
                    self.now += st.nbytes()
                    weakref.finalize(st, self._free, st._cdata)
        self.peak = max(self.peak, self.now)
        return out

    def _free(self, key: int) -> None:
        self.now -= self.live.pop(key, 0)


def _peak(fn) -> tuple[torch.Tensor, int]:  # noqa: ANN001
    mode = _Peak()
    with mode:
        out = fn()
    return out, mode.peak


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_slices_give_the_stack_s_values_at_a_fraction_of_the_memory(dtype: torch.dtype,
                                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    experts, rows, cols = SHAPE
    flat = to_nf4(torch.randn(experts * rows, cols), dtype)
    whole, whole_peak = _peak(lambda: flat.get_original_weight().view(SHAPE))
    monkeypatch.setattr(quant, "SLICE_ELEMENTS", 2 * rows * cols)
    assert quant.experts_per_slice(SHAPE, flat.scaler_block_size) == 2
    sliced, sliced_peak = _peak(lambda: DequantizeExperts(SHAPE)(flat))
    assert torch.equal(sliced, whole) and sliced.dtype == dtype
    size = dtype.itemsize
    assert whole_peak == pytest.approx(quant.dequantize_peak_bytes(experts * rows * cols, size), rel=0.02)
    assert sliced_peak == pytest.approx(quant.stack_dequantize_peak_bytes(SHAPE, size), rel=0.02)
    assert sliced_peak < whole_peak / 3


def test_a_slice_holds_whole_factor_groups() -> None:
    """torchao splits an NF4 weight only into equal chunks of whole factor groups (64 x 256 elements): a stack
    whose one expert is a fraction of a group is sliced in whole groups, and an expert larger than the budget is
    its own slice."""
    assert quant.experts_per_slice((128, 1536, 2048), 256) == 16  # Qwen3-30B-A3B's gate/up: 8 slices
    assert quant.experts_per_slice((8, 28672, 4096), 256) == 1  # Mixtral's gate/up: one expert a slice
    assert quant.experts_per_slice((64, 16, 64), 256) == 64  # a stack under the budget: one slice
    assert quant.experts_per_slice((3, 16, 64), 1) == 3  # three experts that split into no whole slices
