"""The GPU costs of issue 45 the planner learned: the head gradient where it is an fp32 matmul, masked attention
over a dense mask against the kernels that take the examples' boundaries, and the host's waits for the device."""

from __future__ import annotations

import dataclasses
from types import SimpleNamespace

import pytest

from shardfit.plan import dispatch
from shardfit.plan.activations import held_mask_bytes
from shardfit.plan.cards import card_of
from shardfit.plan.dispatch import HOST_SYNC_S
from shardfit.plan.flops import attended_positions, step_flops_per_token
from shardfit.plan.hardware import Hardware, parse_gpus
from shardfit.plan.shapes import resolve_shape
from shardfit.plan.timing import head_gradient_flops, head_gradient_s, micro_batch_work, step_time
from shardfit.plan.workload import Workload, workload_of
from shardfit.strategy import get as strategy_of

QWEN05 = resolve_shape("Qwen/Qwen2.5-0.5B-Instruct")
LLAMA8 = resolve_shape("meta-llama/Llama-3.1-8B")
FULL = Workload(method="full", precision="bf16", seq_len=2048, micro_batch=4, grad_ckpt="none", loss_chunk=512)


def _step(w: Workload, gpus: str = "1xH100", shape=QWEN05) -> float:
    return step_time(shape, w, parse_gpus(gpus), "single").step_s


def test_the_full_fine_tunes_step_is_longer_when_the_heads_gradient_is_fp32() -> None:
    """Qwen2.5-0.5B full, seq 2048 x 4 on an H100: the head's weight gradient (2 h V per token, 2.2 TFLOP) at
    TF32 (half the bf16 rate) costs the difference of the two rates at the training utilization, a few percent of
    the step; a V100 in fp16 has no TF32, so its fp32 rate (15.7 of 125 TFLOP/s) makes it far more."""
    widened, fp32 = _step(FULL), _step(dataclasses.replace(FULL, head_grad_fp32=True))
    # shardfit's own loss runs in its trainer, which sets TF32 for a 16-bit run: the one TF32 rule says so
    assert dataclasses.replace(FULL, head_grad_fp32=True, tf32=False).fp32_matmuls_tf32
    assert not FULL.fp32_matmuls_tf32
    flops = head_gradient_flops(QWEN05, FULL)
    assert flops == pytest.approx(2 * 896 * 151936 * 8192)
    card = card_of(parse_gpus("1xH100"))
    # TF32 at half the bf16 rate, at the training utilization or, where the kernels' floor sets the step (a small
    # model), at the GEMM efficiency: the step grows by one of the two, or between them
    at_hfu, at_gemm = (flops / (card.bf16_flops / 2 * e) - flops / (card.bf16_flops * e)
                       for e in (card.hfu, card.matmul_eff))
    assert at_hfu == pytest.approx(head_gradient_s(QWEN05, dataclasses.replace(FULL, head_grad_fp32=True), card,
                                                   card.hfu))
    assert at_gemm * 0.999 <= fp32 - widened <= at_hfu * 1.001
    assert 0.03 < (fp32 - widened) / widened < 0.3
    v100 = dataclasses.replace(FULL, precision="fp16")
    slow = _step(dataclasses.replace(v100, head_grad_fp32=True), "1xV100") / _step(v100, "1xV100") - 1
    assert slow > 3 * (fp32 - widened) / widened


@pytest.mark.parametrize("change", [{"method": "lora"}, {"precision": "fp32"}, {"loss": "full"}])
def test_no_head_gradient_term_where_the_head_does_not_train_in_16_bit_with_shardfits_loss(change: dict) -> None:
    """LoRA's head is frozen; an fp32 run's matmuls are all fp32 in its own rate; the other losses leave the
    head's gradient to autocast."""
    w = dataclasses.replace(FULL, head_grad_fp32=True, **change)
    assert head_gradient_flops(QWEN05, w) == 0.0
    assert _step(w) == _step(dataclasses.replace(w, head_grad_fp32=False))


def test_a_cpu_never_widens_and_its_head_gradient_runs_at_its_fp32_rate() -> None:
    """On a CPU the loss widens both operands whatever torch has: the term applies, at the measured fp32 rate."""
    card = card_of(Hardware(1, 1, 16.0, 16.0, "cpu", 50.0, 5.0))
    term = head_gradient_s(QWEN05, FULL, card, 1.0)
    flops = head_gradient_flops(QWEN05, FULL)
    assert term == pytest.approx(flops / 50e9 - flops / 5e9)  # bf16 slower here: the fp32 matmul saves time
    assert term == head_gradient_s(QWEN05, dataclasses.replace(FULL, head_grad_fp32=True), card, 1.0)


def test_packed_dense_mask_attention_costs_more_than_the_static_shape_flex_path() -> None:
    """Llama-3.1-8B LoRA, 4 x 2048 tokens in one static row on an H100: SDPA's dense mask runs every query over
    the whole 8192-token row (16x the causal half of a 2048-token example that flex/varlen attention computes), and
    separate rows with a dense mask over 2048 tokens sit in between."""
    lora = Workload(method="lora", seq_len=2048, micro_batch=4, grad_ckpt="full", loss_chunk=512)
    static_sdpa = dataclasses.replace(lora, static_shape=True, attention="sdpa")
    static_flex = dataclasses.replace(lora, static_shape=True, attention="flash")
    assert attended_positions(static_sdpa) == 8192 and attended_positions(static_flex) == 1024
    assert attended_positions(lora) == 2048
    dense, rows, flex = (_step(w, shape=LLAMA8) for w in (static_sdpa, lora, static_flex))
    assert dense > rows > flex
    # attention: 4 x attended x 32 heads x 128 FLOPs per token forward; with the backward's 2.5x and the recomputed
    # forward, 4.5 passes over 32 blocks: the step longer by those FLOPs at the training utilization (or, where the
    # kernels' floor sets the flex step, at least at the GEMM efficiency)
    card = card_of(parse_gpus("1xH100"))
    flops = 4.0 * (8192 - 1024) * 32 * 128 * 4.5 * 32 * 8192
    assert (step_flops_per_token(LLAMA8, static_sdpa) - step_flops_per_token(LLAMA8, static_flex)) * 8192 == \
        pytest.approx(flops)
    assert flops / (card.bf16_flops * card.matmul_eff) < dense - flex <= flops / card.peak("bf16") * 1.001
    assert flex == _step(dataclasses.replace(static_flex, static_shape=False), shape=LLAMA8)  # boundaries: no change


def test_the_dense_mask_of_a_static_row_spans_the_whole_row() -> None:
    """Checkpointed blocks keep transformers' bool mask: one [8192, 8192] for a static row of 4 x 2048 tokens,
    four times the four [2048, 2048] of separate rows; none for a boundary kernel."""
    w = Workload(seq_len=2048, micro_batch=4, grad_ckpt="full", attention="sdpa")
    assert held_mask_bytes(w, "single") == 4 * 2048**2
    assert held_mask_bytes(dataclasses.replace(w, static_shape=True), "single") == 8192**2
    assert held_mask_bytes(dataclasses.replace(w, static_shape=True, attention="flash"), "single") == 0


def test_each_wait_for_the_device_stalls_a_gpu_micro_batch_and_not_a_cpus() -> None:
    """Four waits per micro-batch (what the study found before the fixes) against none: 4 HOST_SYNC_S per
    micro-batch on an H100, whichever of compute and launches is the slower; nothing on a CPU."""
    lora = Workload(method="lora", seq_len=512, micro_batch=1, grad_ckpt="none", grad_accum=2, loss_chunk=512)
    waits = dataclasses.replace(lora, host_syncs=4)
    assert _step(waits, shape=LLAMA8) - _step(lora, shape=LLAMA8) == pytest.approx(2 * 4 * HOST_SYNC_S)
    cpu = Hardware(1, 1, 16.0, 16.0, "cpu", 50.0, 50.0)
    s = strategy_of("single")
    assert micro_batch_work(QWEN05, waits, card_of(cpu), s).busy == micro_batch_work(QWEN05, lora, card_of(cpu),
                                                                                       s).busy
    assert dispatch.host_sync_s(lora, card_of(parse_gpus("1xH100")), QWEN05) == 0.0


def _cfg(**over) -> SimpleNamespace:
    base = dict(method="full", precision="bf16", max_seq_len=512, micro_batch=1, grad_ckpt="none",
                lora=SimpleNamespace(rank=8, dropout=0.0, targets="all-linear", experts=True, dtype="fp32"),
                grad_accum=1,
                freeze_trainable=[],
                compile=False, freeze_vision_tower=True, freeze_audio_tower=True, loss_chunk="auto",
                objective="sft", dpo=SimpleNamespace(precompute_reference="auto"), sequence_parallel=1,
                expert_parallel=1, static_shape="auto", attn_implementation="sdpa", float8=False)
    return SimpleNamespace(**{**base, **over})


def test_a_configs_workload_has_its_static_shape_and_the_installed_torchs_head_gradient(monkeypatch) -> None:
    """`static_shape: true` plans one row per micro-batch (auto: as the decided value, resolve/decide.py); the
    head's gradient is planned as fp32 under a torch without addmm's out_dtype."""
    assert workload_of(_cfg(static_shape=True)).static_shape
    assert not workload_of(_cfg()).static_shape
    assert workload_of(_cfg(float8=True)).float8 and not workload_of(_cfg()).float8
    monkeypatch.setattr("shardfit.plan.workload.widening_matmul_in_torch", lambda: False)
    assert workload_of(_cfg()).head_grad_fp32
    monkeypatch.setattr("shardfit.plan.workload.widening_matmul_in_torch", lambda: True)
    assert not workload_of(_cfg()).head_grad_fp32


def test_the_planner_knows_the_widening_matmul_without_importing_torch() -> None:
    """The plan reads the installed torch's version (it starts without torch); the answer is torch's own."""
    import torch

    from shardfit.kernels import widening_matmul_in_torch

    assert widening_matmul_in_torch() == ("dtype_out" in torch.ops.aten.addmm.overloads())
