"""The plan of sequence_parallel: a rank's activations and logits divided by N, the all-to-alls in the step."""

from __future__ import annotations

import dataclasses

import pytest

from shardfit.cli.main import main
from shardfit.plan.cards import card_of
from shardfit.plan.estimate import all_to_all_bytes, estimate
from shardfit.plan.hardware import parse_gpus
from shardfit.plan.shapes import resolve_shape
from shardfit.plan.timing import step_time, ulysses_s
from shardfit.plan.workload import Workload

LONG = Workload(method="lora", seq_len=131072, micro_batch=1, grad_ckpt="full", attention="flash")


def test_a_ranks_activations_shrink_by_n_and_the_step_pays_the_all_to_alls() -> None:
    shape, hw = resolve_shape("Qwen/Qwen3-8B"), parse_gpus("8xH100", 1, None)
    one = estimate(shape, LONG, hw, "zero3").per_gpu_gib
    for n in (2, 4, 8):
        w = dataclasses.replace(LONG, sequence_parallel=n)
        split = estimate(shape, w, hw, "zero3").per_gpu_gib
        # The body's saved activations divide by n (the all-to-all buffers at most on top of them).
        assert one.activations / n <= split.activations <= one.activations / n + all_to_all_bytes(shape, w) / 2**30
        assert all_to_all_bytes(shape, w) > 0 and ulysses_s(shape, w, card_of(hw), hw) > 0
        # The same tokens per rank as a rank without the split would forward at seq_len / n, plus the all-to-alls.
        t, short = step_time(shape, w, hw, "zero3"), step_time(shape, dataclasses.replace(
            LONG, seq_len=LONG.seq_len // n), hw, "zero3")
        assert t.step_s > short.step_s
    assert ulysses_s(shape, LONG, card_of(hw), hw) == 0.0 and all_to_all_bytes(shape, LONG) == 0.0


def test_plan_flag_refuses_heads_that_do_not_share_out(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["plan", "--model", "Qwen/Qwen3-8B", "--gpus", "8xH100", "--sequence-parallel", "3"]) == 2
    assert "has 32 attention heads" in capsys.readouterr().err
