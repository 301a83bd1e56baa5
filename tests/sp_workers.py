"""Gloo ranks spawned by tests/test_sequence_parallel.py: Ulysses attention on a row's slices against plain SDPA
over the whole row, a mixture's routing statistics of the slices against the whole row's, and a mixture's full
fine-tune step under DDP and FSDP2 against one process's."""

from __future__ import annotations

import json
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from shardfit.parallel.ulysses import SHARD_KWARG, SequenceShard, block_causal, ulysses_attention
from tests.helpers import gloo_group

HEADS, DIM, WIDTH, BATCH = 4, 8, 12, 2


def _reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
    """Plain SDPA over the whole rows (key/value heads repeated), its mask built independently: causal and within
    one example, an example starting wherever the position is 0."""
    g = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(g, 1), v.repeat_interleave(g, 1)
    doc = (pos == 0).cumsum(-1)
    w = pos.shape[-1]
    mask = (doc[:, :, None] == doc[:, None, :]) & torch.ones(w, w, dtype=torch.bool).tril()
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask[:, None]).transpose(1, 2)


def attention_rank(rank: int, world: int, port: int, cases: list[tuple[int, bool]], out: str) -> None:
    """Each case (key/value heads, packed rows) once; `out`/rank-R.json gets this rank's errors per case,
    `out`/routing-R.json those of the routers' statistics (`_routing_case`) and `out`/full-moe-R.json those of a
    mixture's full fine-tune (`_full_moe_case`), sharing the ranks' start."""
    with gloo_group(rank, world, port, timeout_s=20):
        results = [_case(rank, world, kv, packed) for kv, packed in cases]
        Path(out, f"rank-{rank}.json").write_text(json.dumps(results))
        Path(out, f"routing-{rank}.json").write_text(json.dumps(_routing_case(rank, world)))
        Path(out, f"full-moe-{rank}.json").write_text(json.dumps(_full_moe_case(rank, world)))


def _case(rank: int, world: int, kv_heads: int, packed: bool) -> dict:
    """One case on this rank: the largest errors of its slice's output and gradients, and the scales."""
    g = torch.Generator().manual_seed(0)
    q = torch.randn(BATCH, HEADS, WIDTH, DIM, generator=g)
    k = torch.randn(BATCH, kv_heads, WIDTH, DIM, generator=g)
    v = torch.randn(BATCH, kv_heads, WIDTH, DIM, generator=g)
    up = torch.randn(BATCH, WIDTH, HEADS, DIM, generator=g)  # the gradient flowing back into the output
    pos = torch.arange(WIDTH).repeat(BATCH, 1)
    if packed:  # row 0: examples of 5 and 7 tokens (the boundary inside rank 0's slice); row 1: 7 and 5
        pos[0] = torch.tensor([*range(5), *range(7)])
        pos[1] = torch.tensor([*range(7), *range(5)])
    full = [t.clone().requires_grad_() for t in (q, k, v)]
    ref = _reference(*full, pos)
    (ref * up).sum().backward()
    s = WIDTH // world
    part = slice(rank * s, (rank + 1) * s)
    mine = [t[:, :, part].clone().requires_grad_() for t in (q, k, v)]
    module = nn.Module()
    got, _ = ulysses_attention(module, *mine, None, scaling=DIM ** -0.5,
                               **{SHARD_KWARG: SequenceShard(dist.group.WORLD, world, pos, packed, rank=rank)})
    (got * up[:, part]).sum().backward()
    return {"out": (got - ref[:, part]).abs().max().item(), "scale": ref.abs().max().item(),
            "grads": [(a.grad - b.grad[:, :, part]).abs().max().item() for a, b in zip(mine, full, strict=True)],
            "grad_scale": max(b.grad.abs().max().item() for b in full),
            "restarts": bool((block_causal(pos) != torch.ones(WIDTH, WIDTH, dtype=torch.bool).tril()).any())}


BLOCKS, EXPERTS, TOP_K, COEF = 2, 4, 2, 0.5


def _routing_case(rank: int, world: int) -> dict:
    """The load-balancing loss and expert load of rows split over the ranks against one process's over the whole
    rows: this rank's errors, and how far its slice's own loss and load are from the rows'. The rows are 11 tokens
    wide, padded to 12 by the split: the padding's router logits (random here) must not count."""
    from transformers.models.qwen3_moe.modeling_qwen3_moe import load_balancing_loss_func

    from shardfit.models.experts import AuxLoss, expert_load
    from shardfit.train.loss import CausalLMLoss

    g = torch.Generator().manual_seed(1)
    real = WIDTH - 1
    # Skewed routers (a bias towards expert 0 growing along the row), so the slices' loads differ from the row's.
    full = [(torch.randn(BATCH, WIDTH, EXPERTS, generator=g) + torch.linspace(0, 3, WIDTH)[None, :, None]
             * torch.tensor([1.0, 0, 0, -1])).requires_grad_() for _ in range(BLOCKS)]
    targets = [7, 5]  # this micro-batch's labelled tokens on each rank's slice
    rows = tuple(x[:, :real].flatten(0, 1) for x in full)
    ref = load_balancing_loss_func(rows, EXPERTS, TOP_K, None)
    (COEF * ref * sum(targets)).backward()
    whole_load = expert_load(tuple(r.detach() for r in rows), TOP_K)
    s = WIDTH // world
    part = slice(rank * s, (rank + 1) * s)
    mine = [x.detach()[:, part].clone().requires_grad_() for x in full]
    loss = CausalLMLoss(nn.Module(), moe_top_k=TOP_K, aux=AuxLoss(load_balancing_loss_func, EXPERTS, TOP_K, COEF))
    shard = SequenceShard(dist.group.WORLD, world, torch.arange(WIDTH).repeat(BATCH, 1), False, real,
                          rank=rank)
    aux_sum = loss._routing(tuple(x.flatten(0, 1) for x in mine), targets[rank], torch.zeros(()), shard, BATCH)
    aux_sum.backward()
    total = aux_sum.detach().clone()
    dist.all_reduce(total)
    own = tuple(x.detach()[:, :real - rank * s].flatten(0, 1) for x in mine)
    return {"aux": abs(float(total) - float(COEF * ref * sum(targets))), "aux_scale": float(COEF * ref * sum(targets)),
            "slice_off": abs(float(load_balancing_loss_func(own, EXPERTS, TOP_K, None)) - float(ref)) / float(ref),
            "grads": max((a.grad - b.grad[:, part]).abs().max().item() for a, b in zip(mine, full, strict=True)),
            "grad_scale": max(b.grad.abs().max().item() for b in full),
            "load": (loss.last_moe.load - whole_load).abs().max().item(), "whole_load": whole_load.tolist(),
            "slice_load": expert_load(own, TOP_K).tolist()}


def _full_moe_case(rank: int, world: int) -> dict:
    """A full fine-tune of a tiny Qwen3-MoE (untied head, load-balancing loss on) whose rows split over the ranks,
    wrapped by each strategy's engine as training wraps it: this rank's first step's gradients against one
    process's over the whole rows. Rank 0's slices hold no target, so only the load-balancing loss and the
    attention's all-to-all reach its body, and nothing but the loss's `unlabelled_loss` its head."""
    import copy

    from transformers import AutoModelForCausalLM

    from shardfit import strategy as strategies
    from shardfit.data.loader import collate
    from shardfit.data.packing import PackedRow
    from shardfit.data.tokenize import IGNORE
    from shardfit.models.experts import aux_loss_of, moe_top_k
    from shardfit.parallel import ulysses
    from shardfit.parallel.layout import Layout
    from shardfit.parallel.parallelize import parallelize
    from shardfit.parallel.sequence import shard_batch
    from shardfit.train.loss import CausalLMLoss
    from tests.families import tiny_text_config

    config = tiny_text_config("Qwen3-MoE")
    config.vocab_size, config.router_aux_loss_coef = 256, 0.5
    torch.manual_seed(0)
    base = AutoModelForCausalLM.from_config(config)
    ids = torch.randint(0, 256, (2, 11), generator=torch.Generator().manual_seed(2))
    # The targets sit in the rows' second halves: rank 0's slices (tokens 0-5) are prompt only.
    rows = [PackedRow(r.tolist(), [IGNORE] * 6 + r[1:6].tolist(), list(range(11))) for r in ids]
    batch = collate(rows, pad_id=0)
    routing = {"moe_top_k": moe_top_k(base), "aux": aux_loss_of(base, base.config)}
    ref = CausalLMLoss(copy.deepcopy(base), **routing)
    loss, n = ref(batch.input_ids, batch.position_ids, batch.targets, **batch.host_facts)
    (loss / n).backward()
    want = {k: p.grad for k, p in ref.named_parameters()}
    ulysses.register()
    part = shard_batch(batch, Layout(dp=1, dp_rank=0, sp=world, sp_rank=rank, group=dist.group.WORLD))
    result: dict = {"targets": part.n_targets, "untied": not config.tie_word_embeddings}
    for name, ckpt in (("ddp", "none"), ("zero3", "full")):
        model = copy.deepcopy(base)
        model.set_attn_implementation(ulysses.NAME)
        module = parallelize(CausalLMLoss(model, **routing), strategies.get(name), device=torch.device("cpu"),
                             world=world, precision="fp32", grad_ckpt=ckpt)
        loss, _ = module(part.input_ids, part.position_ids, part.targets, **part.host_facts)
        (loss * world / n).backward()  # recipe.py `train_step`: the engines average over the world
        got = {k.removeprefix("module."): p.grad for k, p in module.named_parameters()}
        got = {k: g.full_tensor() if hasattr(g, "full_tensor") else g for k, g in got.items()}
        result[name] = {"missing": sorted(k for k in want if got.get(k) is None),
                        "err": max((got[k] - g).abs().max().item() for k, g in want.items() if got.get(k) is not None),
                        "scale": max(g.abs().max().item() for g in want.values())}
    return result
