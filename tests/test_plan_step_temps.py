"""What the optimizer step allocates beside the states (issue 46): torch AdamW's multi-tensor temporary over a
param group, measured on real tensors; DeepSpeed's fp32 gradient and the client optimizer's temporary per
partition or ZeRO-3 sub-group, measured on real DeepSpeed steps (bench/deepspeed_memory.py, recorded)."""

from __future__ import annotations

import importlib.util
import json
from dataclasses import replace

import pytest
import torch

from shardfit.foreign.deepspeed import read_deepspeed
from shardfit.plan.deepspeed import ZeroSettings, estimate_deepspeed
from shardfit.plan.estimate import estimate
from shardfit.plan.hardware import parse_gpus
from shardfit.plan.optimizer_states import foreach_temp_bytes
from shardfit.plan.shapes import resolve_shape
from shardfit.plan.workload import Workload
from tests.helpers import ROOT

BENCH = ROOT / "bench" / "deepspeed_memory.py"
RECORDED = ROOT / "bench" / "results" / "deepspeed_memory.json"
_spec = importlib.util.spec_from_file_location("deepspeed_memory", BENCH)
bench = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(bench)


def _step_extra(kind: str) -> tuple[int, int, int]:
    """(bytes the second AdamW step allocates beyond the params, grads and states, the params' bytes, the largest
    param's bytes) for torch's `kind` kernel, every allocation tracked on real CPU tensors."""
    torch.manual_seed(0)
    live = bench.LiveTensors()
    with live.mode:
        model = torch.nn.Sequential(torch.nn.Linear(256, 512), torch.nn.Linear(512, 256), torch.nn.Linear(256, 1024))
        params = list(model.parameters())
        opt = torch.optim.AdamW(params, lr=1e-3, foreach=kind == "foreach", fused=kind == "fused")
        for _ in range(2):  # the first step also creates the moments
            for p in params:
                p.grad = torch.randn_like(p)
            live.track(params + [p.grad for p in params])
            before = live.now
            live.reset_peak()
            opt.step()
    sizes = [p.numel() * p.element_size() for p in params]
    return live.peak - before, sum(sizes), max(sizes)


def test_foreach_adamw_temporary_is_one_copy_of_the_group() -> None:
    """torch AdamW's multi-tensor step allocates exactly one copy of the param group (its `exp_avg_sq_sqrt`), the
    fused kernel nothing: what `foreach_temp_bytes` says for the same parameters."""
    extra, group, _ = _step_extra("foreach")
    params = group // 4
    assert extra == group == foreach_temp_bytes(params, Workload(method="full"))
    fused, _, _ = _step_extra("fused")
    assert fused == 0 == foreach_temp_bytes(params, Workload(method="full", fused_adamw=True))
    assert foreach_temp_bytes(params, Workload(method="full", optimizer="adamw8bit")) == 0


def test_single_gpu_full_finetune_step_holds_the_foreach_copy() -> None:
    """A one-GPU full fine-tune with torch's default AdamW (the HF Trainer's `adamw_torch`) peaks at the step:
    fp32 weights, gradients, moments and one more fp32 copy of the model; 29.9 GiB more than the fused kernel for
    Llama-3-8B (4 bytes x 8.03e9 parameters)."""
    shape = resolve_shape("meta-llama/Meta-Llama-3-8B")
    w = Workload(method="full", seq_len=512, grad_ckpt="full", loss="full", attention="flash")
    hw = parse_gpus("1xH200")
    foreach, fused = estimate(shape, w, hw, "single"), estimate(shape, replace(w, fused_adamw=True), hw, "single")
    assert foreach.peak_phase == "optimizer"
    step = foreach.per_gpu_gib.optimizer - fused.per_gpu_gib.optimizer
    assert step == pytest.approx(4 * shape.params() / 2**30, rel=1e-9)


def test_single_gpu_foreach_step_agrees_with_simulate() -> None:
    """A one-GPU full fine-tune of short rows with torch's multi-tensor AdamW peaks in its step; the fake-tensor
    step (plan --simulate, the same kernel on plain tensors) agrees on the moment and on every column."""
    from shardfit.plan.shapes import ModelShape
    from shardfit.simulate.step import simulate

    shape = ModelShape("tiny-llama", 4, 256, 704, 8, 2, 4096, False, None)
    w = Workload(method="full", precision="bf16", seq_len=16, micro_batch=1, grad_ckpt="full")
    hw = parse_gpus("1x80GB")
    ca, cs = estimate(shape, w, hw, "single"), simulate(shape, w, hw, "single", None)
    assert ca.peak_phase == cs.peak_phase == "optimizer"
    for part in ("weights", "grads", "optimizer", "activations", "logits", "temporaries", "total"):
        assert getattr(ca.per_gpu_gib, part) == pytest.approx(getattr(cs.per_gpu_gib, part), rel=0.05,
                                                              abs=2e-4), part


def test_recorded_deepspeed_optimizer_steps_within_5_percent() -> None:
    """Real DeepSpeed steps with a client torch AdamW (multi-tensor) on short rows, so that the step is the peak:
    ZeRO-3 holds its 16-bit partition and bucket, the sub-group's fp32 gradient and AdamW's copy of it; ZeRO-2 the
    fp32 gradient and the copy; with small sub-groups (`sub_group_size`) ZeRO-3's step holds one sub-group's. The
    step's own peak, measured on both ranks, against the planner's optimizer moment."""
    rows = bench.compare(json.loads(RECORDED.read_text()))
    steps = {r["case"]: r for r in rows if "optimizer_step_error" in r}
    assert {"small-z3-step", "small-z2-step", "small-z3-subgroups"} <= set(steps)
    for r in rows:
        if "optimizer_step_error" in r:
            assert abs(r["optimizer_step_error"]) < 0.05, f"{r['case']} rank {r['rank']}: {r['optimizer_step_error']}"
    assert steps["small-z3-step"]["estimated_phase"] == steps["small-z2-step"]["estimated_phase"] == "optimizer"


def test_zero3_steps_one_sub_group_at_a_time() -> None:
    """ZeRO-3's step holds one sub-group's fp32 gradient and AdamW copy, not the rank's whole partition: for
    Llama-3-70B on 8 GPUs (8.8e9 parameters per rank) the planner's optimizer moment under the default
    sub_group_size of 1e9 is 8 bytes (fp32 gradient, AdamW's fp32 copy) lower for each element beyond the
    sub-group than with one sub-group as large as the partition; a sub-group is at most 1e9 elements plus the
    largest parameter's partition. Smaller sub-groups lower it further."""
    shape = resolve_shape("meta-llama/Meta-Llama-3-70B")
    w = Workload(method="full", seq_len=2048, grad_ckpt="full", loss="full", attention="flash")
    hw = parse_gpus("8xH100")
    z = ZeroSettings(stage=3)
    step = {size: estimate_deepspeed(shape, w, hw, replace(z, sub_group_size=size)).extra["optimizer_step_gib"]
            for size in (z.sub_group_size, 10**13, 100_000_000)}
    partition = shape.params() / 8
    saved = (step[10**13] - step[z.sub_group_size]) * 2**30
    assert 8 * (partition - 1e9 - shape.vocab * shape.hidden / 8) * (1 - 1e-9) <= saved <= 8 * (partition - 1e9)
    assert step[100_000_000] < step[z.sub_group_size]


def test_deepspeed_optimizer_section_and_sub_groups_are_read() -> None:
    """A JSON with an optimizer section is stepped by DeepSpeed's own optimizer (no temporary); sub_group_size is
    read, and without an optimizer section the client AdamW's copy is in the plan."""
    shape = resolve_shape("meta-llama/Meta-Llama-3-8B")
    cfg = {"zero_optimization": {"stage": 3}}
    client = read_deepspeed(cfg, "ds.json", shape.hidden).zero
    own = read_deepspeed({**cfg, "optimizer": {"type": "AdamW"}}, "ds.json", shape.hidden).zero
    assert not client.ds_optimizer and own.ds_optimizer
    z3 = read_deepspeed({"zero_optimization": {"stage": 3, "sub_group_size": 5e8}}, "ds.json", shape.hidden).zero
    assert z3.sub_group_size == 500_000_000
    w = Workload(method="full", seq_len=512, grad_ckpt="full", loss="full", attention="flash")
    hw = parse_gpus("8xH100")
    a, b = (estimate_deepspeed(shape, w, hw, z).extra["optimizer_step_gib"] for z in (client, own))
    # DeepSpeed's own optimizer still meets the flattened 16-bit copy (2 bytes) where AdamW's copy takes 4
    assert a - b == pytest.approx(2 * shape.params() / 8 / 2**30, rel=1e-9)


def test_tools_optimizer_names_decide_the_foreach_copy(tmp_path) -> None:  # noqa: ANN001
    """`adamw_torch` (the HF Trainer's torch AdamW, multi-tensor on a GPU) plans the copy; the fused, 8-bit and
    paged optimizers do not: read from a LLaMA-Factory config as from the other tools' `optim`."""
    from shardfit.foreign.common import multi_tensor_step
    from shardfit.foreign.read import JobOptions, read_job

    assert multi_tensor_step("adamw_torch") and multi_tensor_step("ADAMW_TORCH")
    assert not any(multi_tensor_step(n) for n in ("adamw_torch_fused", "adamw_bnb_8bit", "paged_adamw_32bit"))
    fused = {}
    for optim in ("adamw_torch", "adamw_torch_fused"):
        cfg = tmp_path / f"{optim}.yaml"
        cfg.write_text(f"model_name_or_path: meta-llama/Meta-Llama-3-8B\nstage: sft\nfinetuning_type: full\n"
                       f"optim: {optim}\ncutoff_len: 1024\nper_device_train_batch_size: 1\nbf16: true\n")
        fused[optim] = read_job("llamafactory", str(cfg), JobOptions()).workload.fused_adamw
    assert fused == {"adamw_torch": False, "adamw_torch_fused": True}


@pytest.mark.parametrize("tool, name, text", [
    ("llamafactory", "lf.yaml", "model_name_or_path: meta-llama/Llama-3.2-1B\nstage: sft\nfinetuning_type: full\n"
                                "cutoff_len: 512\nbf16: true\n"),
    ("swift", "run.sh", "swift sft --model meta-llama/Llama-3.2-1B --train_type full --max_length 512\n"),
    ("hf", "run.sh", "torchrun --nproc_per_node 1 train.py --model_name_or_path meta-llama/Llama-3.2-1B "
                     "--bf16 True --max_seq_length 512\n"),
])
def test_missing_optim_is_the_trainers_default_of_its_version(tmp_path, tool: str, name: str, text: str) -> None:
    """A job without `optim` runs the HF Trainer's default: adamw_torch_fused from transformers 4.54 on torch >= 2.8
    (PR #37358; stepped in place, no AdamW copy), adamw_torch before (the multi-tensor copy); the plan says which
    kernel it assumed. An `optim` the job names is read as it is."""
    from shardfit.foreign.read import JobOptions, read_job

    path = tmp_path / name
    path.write_text(text)
    new, old = (read_job(tool, str(path), JobOptions(transformers=v)) for v in ("4.56.2", "4.53.3"))
    assert new.workload.fused_adamw and not new.workload.multi_tensor_step
    assert any("adamw_torch_fused" in n and "4.56.2" in n for n in new.notes)
    assert old.workload.multi_tensor_step and any("adamw_torch" in n and "4.53.3" in n for n in old.notes)
    key = "--optim adamw_torch" if tool != "llamafactory" else "optim: adamw_torch"
    path.write_text(text.rstrip("\n") + (" " if tool != "llamafactory" else "\n") + key + "\n")
    named = read_job(tool, str(path), JobOptions(transformers="4.56.2"))
    assert named.workload.multi_tensor_step and not any("optim not set" in n for n in named.notes)


def test_axolotl_default_optimizer_is_fused(tmp_path) -> None:
    """axolotl's own default optimizer is adamw_torch_fused (its PR #2293), whatever the transformers version."""
    from shardfit.foreign.read import JobOptions, read_job

    path = tmp_path / "a.yml"
    path.write_text("base_model: meta-llama/Llama-3.2-1B\nsequence_len: 512\nbf16: true\n")
    job = read_job("axolotl", str(path), JobOptions(transformers="4.53.3"))
    assert job.workload.fused_adamw and any("adamw_torch_fused" in n for n in job.notes)
    path.write_text(path.read_text() + "optimizer: adamw_torch\n")
    assert read_job("axolotl", str(path), JobOptions()).workload.multi_tensor_step


def test_deepspeed_torch_adam_section_plans_the_copy() -> None:
    """An optimizer section with `torch_adam: true` makes DeepSpeed build torch's AdamW (multi-tensor on a GPU)
    instead of FusedAdam: the step holds the copy of the sub-group even when the tool's optim is fused, as the
    client's multi-tensor AdamW does; `fused: true` among the params steps in place."""
    shape = resolve_shape("meta-llama/Meta-Llama-3-8B")
    base = {"zero_optimization": {"stage": 3}}
    torch_adam = {**base, "optimizer": {"type": "AdamW", "params": {"lr": 1e-5, "torch_adam": True}}}
    fused = {**base, "optimizer": {"type": "AdamW", "params": {"torch_adam": True, "fused": True}}}
    w = Workload(method="full", seq_len=512, grad_ckpt="full", loss="full", attention="flash", fused_adamw=True)
    hw = parse_gpus("8xH100")
    step = {k: estimate_deepspeed(shape, w, hw, read_deepspeed(c, "ds.json", shape.hidden).zero)
            .extra["optimizer_step_gib"] for k, c in (("torch", torch_adam), ("fused", fused), ("own", {
                **base, "optimizer": {"type": "AdamW"}}))}
    client = estimate_deepspeed(shape, replace(w, fused_adamw=False), hw, read_deepspeed(base, "ds.json",
                                                                                        shape.hidden).zero)
    assert step["torch"] == pytest.approx(client.extra["optimizer_step_gib"], rel=1e-12)
    assert step["fused"] == step["own"] < step["torch"]
    job = read_deepspeed(torch_adam, "ds.json", shape.hidden)
    assert "torch_adam" in job.keys["optimizer.params"] and "optimizer.params" not in job.not_modelled


def test_eight_bit_adamw_has_no_copy_under_fsdp() -> None:
    """bitsandbytes' 8-bit AdamW updates each tensor in place on every strategy: no multi-tensor copy under FSDP
    either (the FSDP branches once planned one whenever `fused_adamw` was off)."""
    from shardfit.plan.estimate import per_rank
    from shardfit.strategy import get

    shape = resolve_shape("meta-llama/Meta-Llama-3-8B")
    hw = parse_gpus("8xH100")
    for name in ("zero2", "zero3"):
        w = Workload(method="full", seq_len=512, grad_ckpt="full")
        assert per_rank(shape, w, hw, get(name)).foreach == foreach_temp_bytes(shape.params(), w) / 8 > 0
        assert per_rank(shape, replace(w, optimizer="adamw8bit"), hw, get(name)).foreach == 0


def test_pipeline_stage_steps_only_what_it_holds() -> None:
    """A middle pipeline stage holds neither the embedding nor the head: at its step the multi-tensor AdamW copies
    only its blocks' parameters, so its optimizer column is the fused kernel's plus that copy, not plus a copy of
    the whole stage-shaped model's embedding and head too."""
    from shardfit.plan.estimate import GIB, trainable_params
    from shardfit.plan.model_shape import ModelShape
    from shardfit.plan.pipeline import stage_breakdown

    shape = ModelShape("tiny-llama", 6, 256, 704, 8, 2, 32000, False, None)
    w = Workload(method="full", precision="bf16", seq_len=16, micro_batch=1, grad_ckpt="full")
    hw = parse_gpus("3x80GB")
    foreach, fused = (stage_breakdown(shape, x, hw, 3, 1, 2) for x in (w, replace(w, fused_adamw=True)))
    held = trainable_params(replace(shape, layers=2), w) - 2 * shape.vocab * shape.hidden
    assert foreach.optimizer - fused.optimizer == pytest.approx(foreach_temp_bytes(held, w) / GIB, rel=1e-9)
