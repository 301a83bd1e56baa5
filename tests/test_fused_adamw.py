"""AdamW's fused kernel over FSDP2's DTensor shards (train/optim.py): the same losses as the multi-tensor kernel
under zero3 on 2 gloo ranks, and the divergence stop skipping a bad update on the device."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import torch.multiprocessing as mp

from shardfit.plan.shapes import ModelShape
from shardfit.plan.workload import Workload
from tests import optim_workers
from tests.helpers import free_port


@pytest.mark.slow
def test_fused_adamw_on_zero3_shards_equals_the_multi_tensor_update(tmp_path: Path) -> None:
    """A tiny Qwen3 under zero3, fp32, 4 steps with weight decay and clipping: every step's loss within 1e-6 of
    the foreach kernel's; the fused optimizer holds DTensor shards and can skip an update on the device, and a
    non-finite gradient at step 5 leaves every shard as it was and is reported as step 5."""
    mp.start_processes(optim_workers.adamw_rank, args=(2, free_port(), str(tmp_path)), nprocs=2,
                       start_method="spawn", join=True)
    for r in range(2):
        got = json.loads((tmp_path / f"rank-{r}.json").read_text())
        fused, foreach = got["fused"], got["foreach"]
        assert fused["fused"] and fused["sharded"] and fused["on_device"]
        assert not foreach["fused"] and not foreach["on_device"]
        assert fused["losses"][0] == foreach["losses"][0]  # the same start
        assert fused["losses"][-1] < fused["losses"][0]  # it trains
        for a, b in zip(fused["losses"], foreach["losses"], strict=True):
            assert abs(a - b) <= 1e-6, (fused["losses"], foreach["losses"])
        assert fused["stopped_at"] == 5 and fused["unchanged"]


def test_the_fused_updates_missing_temporary_in_plan_and_simulation() -> None:
    """A zero3 full fine-tune of short rows peaks in the multi-tensor optimizer step. With the fused kernel over
    the shards (`fused_adamw`, shardfit's runs) its fp32 temporary is gone, 4 bytes per trainable parameter over
    the 2 ranks, and the peak moves to backward: the estimate and the fake-tensor step (which builds the
    optimizer the workload names) agree on that moment, the states and the total (backward's split between
    gradients, activations and FSDP's buffers is not compared, as in tests/test_simulate.py)."""
    from shardfit.plan.estimate import trainable_params
    from tests.test_simulate import _analytic_and_simulated

    w = Workload(method="full", precision="bf16", seq_len=16, micro_batch=1, grad_ckpt="full", fused_adamw=True)
    ca, cs = _analytic_and_simulated("llama", "zero3", w)
    fa, fs = _analytic_and_simulated("llama", "zero3", dataclasses.replace(w, fused_adamw=False))
    assert (ca.peak_phase, cs.peak_phase, fa.peak_phase, fs.peak_phase) == ("backward", "backward", "optimizer",
                                                                            "optimizer")
    a, s = ca.per_gpu_gib, cs.per_gpu_gib
    for part in ("weights", "optimizer"):
        assert getattr(a, part) == pytest.approx(getattr(s, part), rel=0.01), part
    assert a.total - a.runtime_overhead == pytest.approx(s.total - s.runtime_overhead, rel=0.05)
    shape = ModelShape("tiny-llama", 4, 256, 704, 8, 2, 4096, False, None)
    temporary = trainable_params(shape, w) * 4 / 2
    assert (fa.per_gpu_gib.optimizer - a.optimizer) * 2**30 == pytest.approx(temporary, rel=0.01)
    assert (fs.per_gpu_gib.optimizer - s.optimizer) * 2**30 == pytest.approx(temporary, rel=0.01)
