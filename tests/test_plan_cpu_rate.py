"""The time model on a CPU job: the measured matmul rate of the training process, not a generic core."""

from __future__ import annotations

from shardfit.plan.cards import card_of
from shardfit.plan.hardware import Hardware, job_hardware
from shardfit.plan.shapes import resolve_shape
from shardfit.plan.timing import step_time
from shardfit.plan.workload import Workload


def test_measured_cpu_rate_replaces_the_table_row() -> None:
    """job_hardware carries the rank's measured (fp32, bf16) GFLOP/s to the card, and the predicted tokens/s of
    a compute-bound CPU step scales with it; without a measurement the table's generic row stays."""
    hw = job_hardware("cpu", 1, (100.0, 2.0))
    assert (hw.cpu_fp32_gflops, hw.cpu_bf16_gflops) == (100.0, 2.0)
    card = card_of(hw)
    assert card.fp32_flops == 100e9 and card.bf16_flops == 2e9
    generic = card_of(Hardware(1, 1, 16.0, 16.0, "cpu"))
    assert generic.fp32_flops == 50e9
    shape = resolve_shape("HuggingFaceTB/SmolLM2-135M-Instruct")
    w = Workload(precision="fp32", seq_len=256, micro_batch=4)
    slow = step_time(shape, w, job_hardware("cpu", 1, (100.0, 2.0)), "single").tokens_per_s
    fast = step_time(shape, w, job_hardware("cpu", 1, (200.0, 4.0)), "single").tokens_per_s
    assert 1.9 < fast / slow <= 2.0
