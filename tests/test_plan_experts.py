"""The plan of expert_parallel: a rank's share of the experts' states, the all-to-alls in the step time."""

from __future__ import annotations

import dataclasses

import pytest

from shardfit.cli.main import main
from shardfit.plan import quant
from shardfit.plan.adapters import lora_expert_params
from shardfit.plan.cards import card_of
from shardfit.plan.estimate import estimate
from shardfit.plan.experts import all_to_all_s, exchange_bytes, routed_expert_params
from shardfit.plan.hardware import parse_gpus
from shardfit.plan.shapes import resolve_shape
from shardfit.plan.timing import step_time
from shardfit.plan.workload import Workload

W = Workload(method="full", precision="bf16", seq_len=1024, micro_batch=1, grad_ckpt="full", fused_adamw=True)
GIB = 2**30


def test_a_rank_keeps_one_nth_of_the_experts_and_pays_the_all_to_alls() -> None:
    """Qwen3-30B-A3B under ddp on 8 H100s: each of N ranks holds (N-1)/N fewer expert weights, gradients and
    AdamW moments (fp32 in a full fine-tune: 4 + 4 + 8 bytes each; fused AdamW, whose step adds none), and the step
    adds 6 all-to-alls per block (checkpointed) of tokens x top-k x hidden x 2 bytes x (N-1)/N each."""
    shape, hw = resolve_shape("Qwen/Qwen3-30B-A3B"), parse_gpus("8xH100", 1, None)
    experts = routed_expert_params(shape)
    assert experts == shape.layers * shape.experts * 3 * shape.hidden * shape.expert_width
    one = estimate(shape, W, hw, "ddp").per_gpu_gib
    for n in (2, 8):
        w = dataclasses.replace(W, expert_parallel=n)
        got = estimate(shape, w, hw, "ddp").per_gpu_gib
        assert one.weights - got.weights == pytest.approx(experts * (n - 1) / n * 4 / GIB, rel=1e-6)
        assert one.grads - got.grads == pytest.approx(experts * (n - 1) / n * 4 / GIB, rel=1e-6)
        assert one.optimizer - got.optimizer == pytest.approx(experts * (n - 1) / n * 8 / GIB, rel=1e-6)
        assert exchange_bytes(shape, w, 2) == 1024 * shape.top_k * shape.hidden * 2 * (n - 1) / n
        a2a = all_to_all_s(shape, w, card_of(hw), hw, 2)
        assert a2a > 6 * shape.layers * exchange_bytes(shape, w, 2) / card_of(hw).link
        assert step_time(shape, w, hw, "ddp").step_s == pytest.approx(step_time(shape, W, hw, "ddp").step_s + a2a)
        # zero3_offload runs without expert parallelism: its row is unchanged
        assert estimate(shape, w, hw, "zero3_offload").per_gpu_gib.total == \
            estimate(shape, W, hw, "zero3_offload").per_gpu_gib.total
    assert all_to_all_s(shape, W, card_of(hw), hw, 2) == 0.0


def test_lora_on_the_experts_is_shared_out_with_them() -> None:
    """LoRA with `lora.experts` (the default) under expert parallelism: each rank keeps 1/N of the experts' adapter
    factors with their gradients and AdamW moments (fp32: 4 + 4 + 8 bytes each); with `lora.experts: false` there
    are none to share and only the frozen weights move."""
    shape, hw = resolve_shape("Qwen/Qwen3-30B-A3B"), parse_gpus("8xH100", 1, None)
    lora = dataclasses.replace(W, method="lora")
    adapters = lora_expert_params(shape, lora)
    assert adapters == shape.layers * shape.experts * lora.lora_rank * (2 * shape.hidden + 3 * shape.expert_width)
    assert lora_expert_params(shape, dataclasses.replace(lora, lora_experts=False)) == 0
    one = estimate(shape, lora, hw, "ddp").per_gpu_gib
    got = estimate(shape, dataclasses.replace(lora, expert_parallel=8), hw, "ddp").per_gpu_gib
    frozen = routed_expert_params(shape) * 2  # bf16
    assert one.weights - got.weights == pytest.approx((frozen + adapters * 4) * 7 / 8 / GIB, rel=1e-6)
    assert one.grads - got.grads == pytest.approx(adapters * 4 * 7 / 8 / GIB, rel=1e-6)
    assert one.optimizer - got.optimizer == pytest.approx(adapters * 8 * 7 / 8 / GIB, rel=1e-6)


def test_plan_flag(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["plan", "--model", "Qwen/Qwen3-30B-A3B", "--gpus", "8xH100", "--expert-parallel", "3"]) == 2
    assert "128 routed experts per block, which 3 ranks cannot share out" in capsys.readouterr().err
    assert main(["plan", "--model", "Qwen/Qwen3-8B", "--gpus", "8xH100", "--expert-parallel", "2"]) == 2
    assert "is a dense model" in capsys.readouterr().err
    assert main(["plan", "--model", "Qwen/Qwen3-30B-A3B", "--gpus", "2xH100", "--expert-parallel", "4"]) == 2
    assert "must divide the 2 data-parallel ranks" in capsys.readouterr().err
    # Qwen3-235B-A22B LoRA on 8 x 80 GB: ddp with 1/8 of the experts (and of their adapters) per GPU still holds
    # 68 GiB of weights, too many beside 4k tokens' activations and the backward's gradient of a merged expert
    # stack (its 16 experts' gate/up in bf16, 0.4 GiB)
    main(["plan", "--model", "Qwen/Qwen3-235B-A22B", "--gpus", "8xH100", "--method", "lora", "--grad-ckpt", "full",
          "--batch", "1", "--seq", "4096", "--expert-parallel", "8"])
    ddp = next(line for line in capsys.readouterr().out.splitlines() if line.startswith("ddp "))
    assert "replica with 1/8 of the experts per GPU: 82.3 GiB" in ddp


def test_qlora_experts_move_off_a_rank_as_they_are_stored() -> None:
    """QLoRA stores the experts in NF4: expert parallelism moves 7/8 of those bytes (and of the expert adapters at
    fp32) off a ddp rank, not 7/8 of a 16-bit copy; FSDP2's gathered block loses its NF4 experts, so no part of the
    zero3 row goes below nothing."""
    shape, hw = resolve_shape("Qwen/Qwen3-30B-A3B"), parse_gpus("8xH100", 1, None)
    q = dataclasses.replace(W, method="qlora")
    nf4 = shape.moe_layers * sum(quant.weight_bytes(r, c, 2, q.double_quant)
                                 for n, r, c in shape.stored_weights(True) if n.startswith("expert_"))
    adapters = lora_expert_params(shape, q)
    ep = dataclasses.replace(q, expert_parallel=8)
    one, got = estimate(shape, q, hw, "ddp").per_gpu_gib, estimate(shape, ep, hw, "ddp").per_gpu_gib
    assert one.weights - got.weights == pytest.approx((nf4 + adapters * 4) * 7 / 8 / GIB, rel=1e-6)
    row = estimate(shape, ep, hw, "zero3").per_gpu_gib
    assert min(row.weights, row.grads, row.optimizer, row.activations, row.logits, row.temporaries) >= 0
