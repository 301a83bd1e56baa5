"""A strategy that does not fit names its largest part and what lowers it (plan/estimate.py `lowers`), never a
setting the run already has: a LoRA run is not told to use LoRA, nor a checkpointed one checkpointing; an 8-bit
optimizer only as the job's own optimizer's 8-bit form, where it has one and can switch."""

from __future__ import annotations

import dataclasses

import pytest

from shardfit.plan.estimate import estimate, lowers
from shardfit.plan.hardware import parse_gpus
from shardfit.plan.shapes import resolve_shape
from shardfit.plan.workload import Workload

BASE = Workload(method="full", precision="bf16", seq_len=2048, micro_batch=4, grad_ckpt="none", optimizer="adamw")


@pytest.mark.parametrize(("over", "part", "said"), [
    ({}, "weights", "sharding (zero3), LoRA or QLoRA"),
    ({"method": "lora"}, "weights", "sharding (zero3) or QLoRA"),
    ({"method": "qlora"}, "weights", "sharding (zero3)"),
    ({}, "optimizer", "sharding (zero2/zero3), LoRA or 8-bit AdamW"),
    ({"optimizer": "adamw8bit"}, "optimizer", "sharding (zero2/zero3) or LoRA"),
    ({"optimizer": "lion"}, "optimizer", "sharding (zero2/zero3), LoRA or 8-bit Lion"),
    ({"optimizer": "adamw", "no_8bit_form": True}, "optimizer", "sharding (zero2/zero3) or LoRA"),
    ({"optimizer": "sgd_momentum", "method": "lora"}, "optimizer", "sharding (zero2/zero3)"),
    ({"method": "freeze"}, "grads", "sharding (zero2/zero3) or LoRA"),
    ({}, "logits", "a smaller micro-batch or shorter sequences"),
    ({"loss": "full"}, "logits", "a smaller micro-batch, shorter sequences or the chunked loss"),
    ({"grad_ckpt": "selective"}, "activations", "gradient checkpointing, a smaller micro-batch or shorter sequences"),
    ({}, "activations", "gradient checkpointing, a smaller micro-batch or shorter sequences"),
    ({"grad_ckpt": "full", "micro_batch": 1}, "activations", "shorter sequences"),
    ({"micro_batch": 1}, "temporaries", None),
])
def test_what_lowers_a_part_leaves_out_what_the_run_does(over: dict, part: str, said: str | None) -> None:
    assert lowers(part, dataclasses.replace(BASE, **over)) == said


def test_a_lora_plan_that_does_not_fit_offers_what_lora_has_not_done() -> None:
    """Qwen2-VL-72B LoRA on 8 x 24 GB under zero3: its weights are the largest part; more GPUs or QLoRA lower them,
    LoRA is what it runs already."""
    shape = resolve_shape("Qwen/Qwen2-VL-72B-Instruct")
    w = dataclasses.replace(BASE, method="lora", micro_batch=1, grad_ckpt="full", lora_rank=8)
    c = estimate(shape, w, parse_gpus("8x24GB"), "zero3")
    assert not c.fits and c.notes.endswith("largest part: weights 17.1 GiB (lowered by more GPUs or QLoRA)"), c.notes
