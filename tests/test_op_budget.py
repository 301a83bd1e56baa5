"""The planner's per-layer op table (plan/dispatch.py LAYER_OPS, what `host_dispatch_s` charges a GPU step) held to
what torch, transformers and peft dispatch today: one decoder layer's aten ops of a training micro-batch, counted
below autograd by bench/dispatch_ops.py's counter on tiny models of 1 and 2 layers. A new release that adds ops per
layer (a cast, a copy, a view) fails here before it shows as a slower step on a GPU."""

from __future__ import annotations

import pytest

from bench.dispatch_ops import ALL_LINEAR, per_layer
from shardfit.plan.dispatch import LAYER_OPS


@pytest.mark.parametrize("key,method,ckpt,targets,bf16", [
    (("full", False, False), "full", False, ALL_LINEAR, False),
    (("lora7", False, True), "lora", False, ALL_LINEAR, True),
    (("lora7", True, False), "lora", True, ALL_LINEAR, False),
    (("lora2", False, False), "lora", False, ["q_proj", "v_proj"], False),
])
def test_one_layer_dispatches_what_the_plan_charges(key: tuple, method: str, ckpt: bool, targets: list[str],
                                                     bf16: bool) -> None:
    got = per_layer("llama", method, ckpt, targets, bf16=bf16)
    assert (got["layer_kernel"], got["layer_view"], got["layer_matmul"]) == LAYER_OPS[key]
