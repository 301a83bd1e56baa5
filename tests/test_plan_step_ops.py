"""The optimizer step's own launches (plan/step_ops.py): the counts bench/optimizer_step_ops.py measured, their
scaling with the trainable tensors by implementation, and their place in the step time (once per step, on a GPU)."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest

from shardfit.plan.cards import card_of
from shardfit.plan.comms import param_tensors
from shardfit.plan.dispatch import DISPATCH_KERNEL_S, DISPATCH_VIEW_S, HOST_SYNC_S
from shardfit.plan.estimate import trainable_params
from shardfit.plan.hardware import parse_gpus
from shardfit.plan.optimizer_launches import STEP_LAUNCHES, TORCHAO_CALL_VIEWS, implementation
from shardfit.plan.optimizer_states import step_bytes_per_param
from shardfit.plan.shapes import ModelShape, resolve_shape
from shardfit.plan.step_ops import (
    CLIP_OPS,
    ZERO_GRAD_KERNELS,
    step_host_s,
    step_ops,
    step_sync_s,
    trainable_tensors,
)
from shardfit.plan.timing import step_time
from shardfit.plan.workload import Workload

RESULTS = Path(__file__).resolve().parent.parent / "bench" / "results" / "optimizer_step_ops.json"
GPT2 = ModelShape(id="gpt2", layers=12, hidden=768, intermediate=2048, heads=12, kv_heads=12, vocab=50257, tied=True,
                  model_type="gpt2", attn_bias=True, o_bias=True, norm_bias=True, mlp_extra=3840, positions=1024,
                  attn_dropout=0.1)
# The HF Trainer of January 2021 on torch 1.7: transformers' AdamW, clipping that waits, zero_grad writing zeros.
OLD = Workload(method="full", precision="fp32", seq_len=128, micro_batch=4, grad_ckpt="none", attention="eager",
               loss="full", optimizer_loop="transformers", grad_clip="per_tensor_sync", zero_grad_zeros=True)
NEW = dataclasses.replace(OLD, optimizer_loop="auto", grad_clip="foreach", zero_grad_zeros=False)
RTX3090 = parse_gpus("1x3090")


def test_counts_are_what_the_bench_measured() -> None:
    """The tables hold bench/results/optimizer_step_ops.json's counts: torch's loops with weight decay,
    transformers' AdamW without (the Trainer's default), both clipping paths, zero_grad writing zeros."""
    counts = json.loads(RESULTS.read_text())["counts"]

    def row(name: str) -> tuple[tuple[float, ...], tuple[float, ...]]:
        c = counts[name]
        return tuple(c[f"per_tensor_{k}"] for k in ("kernel", "view", "host")), \
            tuple(c[f"fixed_{k}"] for k in ("kernel", "view", "host"))

    measured = {"adamw_for_loop": "torch_for_loop", "adamw_foreach": "torch_foreach", "adamw_fused": "torch_fused",
                "transformers_adamw": "transformers/no_decay", "transformers_adafactor": "transformers_adafactor",
                "torch_adafactor": "torch_adafactor"}
    measured |= {f"{n}_{loop}": f"torch_{n}_{loop}" for n in ("sgd", "rmsprop", "adagrad")
                 for loop in ("for_loop", "foreach")}
    for key, name in measured.items():
        launches, (per, fixed) = STEP_LAUNCHES[key], row(f"optimizer/{name}")
        assert launches.per_tensor == pytest.approx(per, abs=0.05), key
        # the Adafactors' fixed part is the remainder of matrices and vectors stepped apart: below one op
        assert launches.fixed == pytest.approx(fixed, abs=1.0), key
    host = json.loads(RESULTS.read_text())["host_op_us"]
    assert 0.5 < host["torchao_call_per_tensor"] / host["view"] / TORCHAO_CALL_VIEWS < 2.0
    for path in ("per_tensor", "foreach"):
        per, fixed = row(f"clip_{path}")
        assert CLIP_OPS[path] == (per[0], fixed[0]) and per[1:] == (0.0, 0.0)
    assert ZERO_GRAD_KERNELS[True] == row("zero_grad_zeros")[0][0]
    assert row("zero_grad_none") == ((0.0, 0.0, 0.0), (0.0, 0.0, 0.0))
    assert row("scheduler") == ((0.0, 0.0, 0.0), (0.0, 0.0, 0.0))


def test_python_loops_launch_per_tensor_and_multi_tensor_ops_do_not() -> None:
    """Twice the blocks, twice the tensors: a Python loop's kernels grow with them, foreach's and fused's do not."""
    deeper = dataclasses.replace(GPT2, layers=24)
    for loop, grows in (("for_loop", True), ("transformers", True), ("foreach", False)):
        w = dataclasses.replace(NEW, optimizer_loop=loop)
        assert (step_ops(deeper, w)[0] > step_ops(GPT2, w)[0]) == grows, loop
    fused = dataclasses.replace(NEW, fused_adamw=True)  # in place: torch's fused kernel unless the loop says
    assert step_ops(deeper, fused)[0] == step_ops(GPT2, fused)[0]
    hf_adamw = dataclasses.replace(fused, optimizer_loop="transformers")  # adamw_hf: in place, a Python loop
    assert step_ops(deeper, hf_adamw)[0] > step_ops(GPT2, hf_adamw)[0]


@pytest.mark.parametrize(("over", "impl"), [
    ({}, "adamw_foreach"), ({"fused_adamw": True}, "adamw_fused"),
    ({"fused_adamw": True, "optimizer_loop": "transformers"}, "transformers_adamw"),
    ({"fused_adamw": True, "optimizer_loop": "for_loop"}, "adamw_for_loop"),
    ({"optimizer": "adamw8bit", "bnb_optimizer": True, "fused_adamw": True}, "bitsandbytes"),
    ({"optimizer": "adamw8bit", "torchao_optimizer": True, "fused_adamw": True}, "torchao"),
    ({"optimizer": "adafactor", "fused_adamw": True}, "transformers_adafactor"),
    ({"optimizer": "adafactor_torch", "fused_adamw": True}, "torch_adafactor"),
    ({"optimizer": "sgd", "optimizer_loop": "for_loop"}, "sgd_for_loop"),
    ({"optimizer": "rmsprop_centered"}, "rmsprop_foreach"),
    ({"optimizer": "adamw_anyprecision", "fused_adamw": True}, "adamw_for_loop"),
])
def test_the_time_model_takes_the_implementation_not_the_memory_flag(over: dict, impl: str) -> None:
    """`fused_adamw` says the step runs in place (memory); what the host launches is the implementation's: torch's
    fused kernel only where nothing else names another (bitsandbytes', torchao's, an Adafactor, a Python loop)."""
    assert implementation(dataclasses.replace(NEW, **over)) == impl


def test_bitsandbytes_waits_per_tensor_and_torchao_pays_a_call_per_tensor() -> None:
    """bitsandbytes synchronizes after every tensor's kernel: one wait per tensor; torchao's compiled call costs the
    host far more than the fused kernel's 3 launches; on a CPU neither is charged."""
    card, n = card_of(RTX3090), param_tensors(GPT2)
    bnb = dataclasses.replace(NEW, optimizer="adamw8bit", bnb_optimizer=True, fused_adamw=True)
    fused = dataclasses.replace(NEW, fused_adamw=True)
    assert step_sync_s(GPT2, bnb, card) == pytest.approx(n * HOST_SYNC_S)
    assert step_sync_s(GPT2, fused, card) == 0.0
    assert step_ops(GPT2, bnb)[0] == step_ops(GPT2, fused)[0] - 3 + n
    ao = dataclasses.replace(bnb, bnb_optimizer=False, torchao_optimizer=True)
    assert step_host_s(GPT2, ao, card) > step_host_s(GPT2, bnb, card) + n * 100e-6
    cpu = dataclasses.replace(parse_gpus("1x24GB"), name="cpu")
    assert step_sync_s(GPT2, bnb, card_of(cpu)) == 0.0 == step_host_s(GPT2, ao, card_of(cpu))


def test_trainable_tensors_by_method() -> None:
    """A full fine-tune walks every tensor; LoRA two adapter matrices per adapted layer; freeze its blocks' share."""
    llama = resolve_shape("meta-llama/Llama-3.1-8B")
    assert trainable_tensors(llama, Workload(method="full")) == param_tensors(llama)
    assert trainable_tensors(llama, Workload(method="lora")) == llama.layers * 7 * 2
    assert trainable_tensors(llama, Workload(method="lora", lora_targets=("q", "v"))) == llama.layers * 2 * 2
    assert trainable_tensors(llama, Workload(method="freeze")) == pytest.approx(param_tensors(llama) * 2 / 32)


def test_old_trainer_steps_launch_what_was_counted() -> None:
    """GPT-2's 110 planned tensors under the 2021 Trainer: transformers' AdamW (7 kernels, 2 views), clipping (2),
    zero_grad (1) per tensor, and the fixed ops; today's defaults launch 19 kernels and read 2 counters a tensor."""
    n = param_tensors(GPT2)
    assert step_ops(GPT2, OLD) == (n * 10 + 2 + 6, n * 2, 0)
    assert step_ops(GPT2, NEW) == (11 + 8, 1, n * 2)
    card = card_of(RTX3090)
    assert step_host_s(GPT2, OLD, card) == pytest.approx((n * 10 + 8) * DISPATCH_KERNEL_S + n * 2 * DISPATCH_VIEW_S)


def test_step_time_charges_the_step_once_per_step() -> None:
    """The step's launches overlap its own kernels (the optimizer's bytes at the memory bandwidth) and the
    clipping's wait adds one sync: the old Trainer's step is longer than today's by that much, once per step
    whatever the accumulation, and the host's time says so."""
    card = card_of(RTX3090)
    optim_gpu = trainable_params(GPT2, OLD) * step_bytes_per_param(OLD) / card.hbm
    host_old, host_new = step_host_s(GPT2, OLD, card), step_host_s(GPT2, NEW, card)
    assert host_old > optim_gpu > host_new  # GPT-2's 110 tensors in a Python loop outrun its 124M weights' bytes
    for accum in (1, 4):
        old, new = (step_time(GPT2, dataclasses.replace(w, grad_accum=accum), RTX3090, "single") for w in (OLD, NEW))
        assert old.step_s - new.step_s == pytest.approx(host_old - optim_gpu + HOST_SYNC_S, rel=1e-6)
        assert old.host_s - new.host_s == pytest.approx(host_old - host_new, rel=1e-9)
        assert old.compute_s == new.compute_s


def test_cpu_steps_carry_no_launches() -> None:
    """On a CPU the host runs the ops inside its measured rates: nothing is charged."""
    cpu = dataclasses.replace(parse_gpus("1x24GB"), name="cpu")
    assert step_time(GPT2, OLD, cpu, "single").step_s == step_time(GPT2, NEW, cpu, "single").step_s
