"""Count the bytes expert parallelism's all-to-alls move, against the plan's count (plan/experts.py).

    python bench/expert_all_to_all.py               # 2 gloo ranks; writes bench/results/expert_all_to_all.json
    python bench/expert_all_to_all.py --ranks 4

Each rank builds the same Qwen3-MoE layout (2 blocks, hidden 256, 16 experts, top-4; random weights, so the router
spreads the tokens about evenly, as the plan assumes), keeps 1/N of the experts (parallel/experts.py) and runs one
forward and backward over its own rows. The dispatch counts the token copies that left for another rank's experts
(`ExpertShard.rows_sent`); each copy of `hidden` values crosses four times per micro-batch (dispatch and combine
in forward, their gradients in backward). The plan's figure is `exchange_bytes` x `exchanges_per_block` x blocks.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import socket
import sys
import tempfile
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from transformers import AutoConfig, AutoModelForCausalLM

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "src"))

from shardfit.models.experts import use_experts  # noqa: E402
from shardfit.parallel.experts import shard_experts  # noqa: E402
from shardfit.plan.experts import exchange_bytes, exchanges_per_block  # noqa: E402
from shardfit.plan.shapes import resolve_shape  # noqa: E402
from shardfit.plan.workload import Workload  # noqa: E402

LAYOUT = dict(num_hidden_layers=2, hidden_size=256, intermediate_size=512, moe_intermediate_size=128,
              num_attention_heads=4, num_key_value_heads=2, head_dim=64, num_experts=16, num_experts_per_tok=4,
              vocab_size=4096, max_position_embeddings=2048, norm_topk_prob=True)
ROWS, WIDTH = 2, 512


def _rank(rank: int, world: int, port: int, out: str) -> None:
    os.environ["OMP_NUM_THREADS"] = "1"
    torch.set_num_threads(1)
    store = dist.TCPStore("127.0.0.1", port, world, is_master=rank == 0, timeout=datetime.timedelta(seconds=60))
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world, timeout=datetime.timedelta(seconds=120))
    try:
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(AutoConfig.for_model("qwen3_moe", **LAYOUT)).float()
        use_experts(model, "eager")
        shard = shard_experts(model, world, rank, dist.group.WORLD, world)
        ids = torch.randint(0, LAYOUT["vocab_size"], (ROWS, WIDTH), generator=torch.Generator().manual_seed(rank))
        model(ids).logits.float().square().mean().backward()
        Path(out, f"rank-{rank}.json").write_text(json.dumps({"rows_sent": shard.rows_sent}))
    finally:
        dist.destroy_process_group()


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--ranks", type=int, default=2)
    args = p.parse_args(argv)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with tempfile.TemporaryDirectory() as tmp:
        mp.start_processes(_rank, args=(args.ranks, port, tmp), nprocs=args.ranks, start_method="spawn", join=True)
        sent = [json.loads(Path(tmp, f"rank-{r}.json").read_text())["rows_sent"] for r in range(args.ranks)]
        AutoConfig.for_model("qwen3_moe", **LAYOUT).save_pretrained(tmp)
        shape = resolve_shape(str(Path(tmp) / "config.json"))
    w = Workload(method="full", precision="fp32", seq_len=WIDTH, micro_batch=ROWS, grad_ckpt="none",
                 expert_parallel=args.ranks)
    crossings = 4  # dispatch and combine, forward and backward
    measured = [rows * LAYOUT["hidden_size"] * 4 * crossings for rows in sent]
    planned = exchange_bytes(shape, w, 4) * exchanges_per_block(w) * shape.moe_layers
    result = {"ranks": args.ranks, "layout": LAYOUT, "rows_per_rank": ROWS, "width": WIDTH,
              "measured_bytes_per_rank": measured, "planned_bytes_per_rank": planned,
              "measured_over_planned": [round(m / planned, 4) for m in measured]}
    out = ROOT / "bench" / "results" / ("expert_all_to_all.json" if args.ranks == 2
                                        else f"expert_all_to_all_{args.ranks}.json")
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
