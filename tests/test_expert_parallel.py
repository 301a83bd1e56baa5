"""Expert parallelism: the dispatch against the whole block (one process, and 2 gloo ranks), the rules, and 2-rank
CLI runs against one process."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp
from transformers import AutoModelForCausalLM

from shardfit.models.experts import use_experts
from shardfit.parallel.experts import shard_experts
from tests import ep_workers
from tests.families import tiny_text_config
from tests.helpers import free_port

SHARED = ["Qwen3-MoE", "gpt-oss", "GLM-4.5", "DeepSeek-V3"]


@pytest.mark.parametrize("implementation", ["eager", "grouped_mm"])
def test_one_rank_dispatch_is_the_block(implementation: str) -> None:
    """With one rank holding every expert the dispatch (sort by expert, compute, weight, sum back) gives the
    block's own output exactly, through transformers' experts computation."""
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(tiny_text_config("Qwen3-MoE")).float()
    use_experts(model, implementation)
    ids = torch.randint(0, 1000, (2, 12))
    ref = model(ids).logits
    shard = shard_experts(copy.deepcopy(model), 1, 0, None, 1)
    got = next(iter(shard.modules.values()))
    assert shard.total == shard.local == 4 and got.forward is not type(got).forward
    ep = copy.deepcopy(model)
    shard_experts(ep, 1, 0, None, 1)
    assert torch.equal(ep(ids).logits, ref)


@pytest.mark.slow
def test_two_ranks_share_the_experts(tmp_path: Path) -> None:
    """2 gloo ranks, each with half the experts of every block: the logits of each rank's rows and the gradients
    (experts on their rank, the rest summed) equal the whole model's (fp32), and the gathered experts are the
    whole model's weights again. Qwen3-MoE, gpt-oss (per-expert biases), GLM-4.5 and DeepSeek-V3 (shared experts,
    dense first blocks)."""
    mp.start_processes(ep_workers.block_rank, args=(2, free_port(), SHARED, str(tmp_path)), nprocs=2,
                       start_method="spawn", join=True)
    for r in range(2):
        for family, got in json.loads((tmp_path / f"rank-{r}.json").read_text()).items():
            assert got["logits"] <= 1e-5 * got["scale"], (family, got)
            assert got["expert_grad"] <= 1e-5 * got["grad_scale"], (family, got)
            assert got["other_grad"] <= 1e-5 * got["grad_scale"], (family, got)
            assert got["gathered_equal"], family
