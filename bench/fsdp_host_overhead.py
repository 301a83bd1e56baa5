"""Measure the host time a data-parallel engine's hooks add per block and micro-batch: DDP, FSDP2, FSDP1.

    python bench/fsdp_host_overhead.py       # prints the table, writes bench/results/fsdp_host_overhead.json

DDP's reducer runs a hook as each parameter's gradient is ready (bucketing, the all-reduce calls). A sharded
engine runs Python around every wrapped block: FSDP2's pre- and post-forward and -backward hooks
(all-gather copy-in and copy-out, resharding, the reduce-scatter's copies), FSDP1's as well, and with
use_orig_params=True it re-points every original parameter at the unsharded flat parameter and back each time.
On a GPU the host does this between kernel launches, so where the host sets the pace (short rows, small models)
it adds to the step as surely as the launches do (plan/dispatch.py `engine_host_s`, the host floor).

Measured here on tiny transformers Llama models in one gloo process (world size 1: the hooks and the collectives'
calls run, the transfers are empty), fp32 on the CPU: the time of a forward + backward of one micro-batch of one
16-token row, for 4 and 8 decoder layers, plain and under each engine (FSDP: each block wrapped). The engine's cost per
block is the difference between the two depths, engine minus plain, over the 4 extra blocks: the model's own ops
and the root's fixed work cancel. Medians of interleaved runs. The figure is host time on the machine that ran
this script: a Python-bound cost, which a GPU server's host pays at a similar clock.
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
from peft import LoraConfig, get_peft_model
from torch.distributed.fsdp import FullyShardedDataParallel, ShardingStrategy, fully_shard
from torch.distributed.fsdp.wrap import ModuleWrapPolicy
from transformers import LlamaConfig, LlamaForCausalLM
from transformers.models.llama.modeling_llama import LlamaDecoderLayer

ROOT = Path(__file__).resolve().parent.parent
OUT = ROOT / "bench" / "results" / "fsdp_host_overhead.json"
ENGINES = ("plain", "ddp", "fsdp2", "fsdp2_zero2", "fsdp1", "fsdp1_zero2")


def build(layers: int, method: str, ckpt: bool, engine: str) -> torch.nn.Module:
    """A tiny Llama of `layers` blocks, LoRA (q, v) or full, checkpointed or not, under `engine`."""
    torch.manual_seed(0)
    cfg = LlamaConfig(hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2,
                      num_hidden_layers=layers, vocab_size=128, max_position_embeddings=64,
                      attn_implementation="sdpa")
    model: torch.nn.Module = LlamaForCausalLM(cfg)
    if ckpt:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    if method == "lora":
        model = get_peft_model(model, LoraConfig(r=8, target_modules=["q_proj", "v_proj"]))
    if engine == "ddp":
        model = torch.nn.parallel.DistributedDataParallel(model)
    elif engine.startswith("fsdp2"):  # `zero2`: parameters kept gathered from forward to backward
        reshard = not engine.endswith("zero2")
        for layer in [m for m in model.modules() if isinstance(m, LlamaDecoderLayer)]:
            fully_shard(layer, reshard_after_forward=reshard)
        fully_shard(model, reshard_after_forward=reshard)
    elif engine.startswith("fsdp1"):  # Lightning Fabric's and Composer's setting: blocks, original parameters
        sharding = ShardingStrategy.SHARD_GRAD_OP if engine.endswith("zero2") else ShardingStrategy.FULL_SHARD
        model = FullyShardedDataParallel(model, auto_wrap_policy=ModuleWrapPolicy({LlamaDecoderLayer}),
                                         sharding_strategy=sharding, use_orig_params=True,
                                         limit_all_gathers=True, device_id=torch.device("cpu"))
    return model


def step_s(model: torch.nn.Module, ids: torch.Tensor, repeats: int) -> list[float]:
    """Seconds of each of `repeats` forward + backward passes over `ids` (after two warm-up passes)."""
    out = []
    for i in range(repeats + 2):
        t0 = time.perf_counter()
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        if i >= 2:
            out.append(time.perf_counter() - t0)
        model.zero_grad(set_to_none=True)
    return out


def measure(method: str, ckpt: bool, rounds: int, repeats: int) -> dict[str, float]:
    """Per engine, the host seconds it adds per wrapped block and micro-batch (medians over `rounds`)."""
    ids = torch.randint(0, 128, (1, 16))
    models = {(e, n): build(n, method, ckpt, e) for e in ENGINES for n in (4, 8)}
    times: dict[tuple[str, int], list[float]] = {k: [] for k in models}
    for _ in range(rounds):  # interleaved, so that a slow spell of the machine falls on every variant
        for k, m in models.items():
            times[k].extend(step_s(m, ids, repeats))
    med = {k: statistics.median(v) for k, v in times.items()}
    per_block = {e: (med[(e, 8)] - med[(e, 4)]) / 4 for e in ENGINES}
    return {e: per_block[e] - per_block["plain"] for e in ENGINES if e != "plain"} | {"plain": per_block["plain"]}


def main() -> None:
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29531")
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=0, world_size=1)
    rounds = int(sys.argv[1]) if len(sys.argv) > 1 else 5
    result = {}
    try:
        for method in ("full", "lora"):
            for ckpt in (False, True):
                r = measure(method, ckpt, rounds, repeats=20)
                key = f"{method}/{'ckpt' if ckpt else 'no_ckpt'}"
                result[key] = {k: round(v * 1e3, 3) for k, v in r.items()}
                print(f"{key}: ms per block and micro-batch: " + ", ".join(
                    f"{e} {'' if e == 'plain' else '+'}{v:.3f}" for e, v in result[key].items()), flush=True)
    finally:
        dist.barrier()
        dist.destroy_process_group()
    OUT.parent.mkdir(parents=True, exist_ok=True)
    OUT.write_text(json.dumps({"ms_per_block": result, "torch": torch.__version__}, indent=2))


if __name__ == "__main__":
    main()
