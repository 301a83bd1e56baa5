"""Run under torchrun by tests/test_simulate.py and tests/test_qlora_plan.py: one real zero3 (FSDP2) LoRA step on
gloo ranks over packed rows, tracked with shardfit's FSDPMemTracker (the loss's tensors as Logits); rank 0 writes the
peak per category (GiB) as JSON to argv[2]. argv[3] `qlora`: the decoder's linear weights stored in NF4 first."""

from __future__ import annotations

import json
import sys

import torch
from transformers import AutoModelForCausalLM

from shardfit.config.schema import LoraSettings
from shardfit.models.adapters import apply_lora
from shardfit.models.anatomy import decoder_and_head
from shardfit.models.quantize import quantize_blocks
from shardfit.parallel.env import init_distributed, shutdown
from shardfit.parallel.parallelize import parallelize
from shardfit.simulate.step import packed_positions
from shardfit.simulate.tracker import StepFSDPMemTracker, measure_step
from shardfit.strategy import get as get_strategy
from shardfit.train.loss import CausalLMLoss
from shardfit.train.optim import build_optimizer


def main(model_dir: str, out: str, method: str = "lora") -> None:
    env = init_distributed()
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    if method == "qlora":
        quantize_blocks(model, torch.float32)
    model = apply_lora(model, LoraSettings(rank=4, alpha=8))
    module = parallelize(CausalLMLoss(model, all_labelled=True), get_strategy("zero3"), device=env.device,
                         world=env.world, precision="fp32")
    optimizer = build_optimizer([p for p in module.parameters() if p.requires_grad], 1e-4, 0.0)
    ids = torch.randint(0, 1000, (2, 128))
    tracker = StepFSDPMemTracker(decoder_and_head(model)[0], module, optimizer)
    tracker.track_inputs((ids,))
    cats = measure_step(module, optimizer, (ids, packed_positions(2, 128), ids), tracker)
    if env.is_main:
        with open(out, "w") as f:
            json.dump(cats, f)
    shutdown(env, True)


if __name__ == "__main__":
    main(*sys.argv[1:4])
