"""`float8: true`: which linear layers torchao's Float8Linear replaces, a real CPU run (emulated FP8), the check's
refusals, and the time model's FP8 rate."""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path

import pytest
import torch
from peft import LoraConfig, get_peft_model
from torch import nn
from transformers import AutoModelForCausalLM

from shardfit.check.config_rules import float8_rules
from shardfit.check.run import check_config
from shardfit.config import load_config
from shardfit.errors import UserError
from shardfit.models.nf4 import to_nf4
from shardfit.parallel.float8 import (
    convert_to_float8,
    convertible,
    float8_config,
    float8_linears,
    require_fp8_device,
)
from shardfit.plan import flops
from shardfit.plan.cards import card_of
from shardfit.plan.hardware import parse_gpus
from shardfit.plan.plan import make_plan
from shardfit.plan.shapes import resolve_shape
from shardfit.plan.workload import Workload, workload_of
from shardfit.resolve.defaults import resolve_compile
from tests.helpers import read_jsonl, run_cli, run_here, write_config

pytest.importorskip("torchao")

PROJECTIONS = {"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"}
BASE = dict(method="lora", precision="bf16", float8=True, max_seq_len=128, micro_batch=2, lr=1e-3, log_steps=1,
            save_steps=100, eval_steps=100, max_steps=2, lora={"rank": 4, "alpha": 8}, warmup_ratio=0.0)


def _cfg(tmp: Path, model: Path, data: Path, name: str = "run", **over) -> Path:
    keys = dict(BASE, model=str(model), data=str(data), output_dir=str(tmp / name))
    keys.update(over)
    return write_config(tmp / f"{name}.yaml", **keys)


def test_full_model_converts_the_blocks_linears_only(tiny_llama: Path) -> None:
    model = AutoModelForCausalLM.from_pretrained(tiny_llama)
    assert convert_to_float8(model, model.device) == 2 * len(PROJECTIONS)
    names = float8_linears(model)
    assert {n.rsplit(".", 1)[-1] for n in names} == PROJECTIONS
    assert all(n.startswith("model.layers.") for n in names)  # not the head, not the embedding
    assert type(model.lm_head) is nn.Linear and type(model.model.embed_tokens) is nn.Embedding


def test_lora_converts_the_frozen_base_layers_and_keeps_the_adapters(tiny_llama: Path) -> None:
    model = get_peft_model(AutoModelForCausalLM.from_pretrained(tiny_llama),
                           LoraConfig(r=4, lora_alpha=8, target_modules="all-linear"))
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    convert_to_float8(model, model.device)
    names = float8_linears(model)
    assert len(names) == 2 * len(PROJECTIONS) and all(n.endswith(".base_layer") for n in names)
    adapters = [m for n, m in model.named_modules() if n.endswith((".lora_A.default", ".lora_B.default"))]
    assert adapters and all(type(m) is nn.Linear for m in adapters)
    # The same parameters train: the base weights stay frozen, shared (not copied) into the FP8 layers.
    assert {n for n, p in model.named_parameters() if p.requires_grad} == trainable


def test_convertible_skips_routers_adapters_and_odd_dims() -> None:
    assert convertible(nn.Linear(32, 64), "mlp.gate_proj")
    assert not convertible(nn.Linear(32, 64), "mlp.gate")  # a mixture's router
    assert not convertible(nn.Linear(32, 64), "block_sparse_moe.router.layer")
    assert not convertible(nn.Linear(32, 16), "self_attn.q_proj.lora_A.default")
    assert not convertible(nn.Linear(24, 64), "self_attn.q_proj")  # torchao's FP8 matmul: multiples of 16
    assert not convertible(nn.Linear(32, 40), "self_attn.q_proj")


def test_convertible_skips_an_nf4_weight() -> None:
    layer = nn.Linear(64, 64, bias=False, dtype=torch.bfloat16)
    layer.weight = nn.Parameter(to_nf4(layer.weight.detach(), torch.bfloat16), requires_grad=False)
    assert type(layer) is nn.Linear and not convertible(layer, "self_attn.q_proj")  # NF4 has no FP8 cast


@pytest.mark.parametrize("frozen", [False, True])
def test_the_gpu_config_runs_a_token_count_off_16(frozen: bool) -> None:
    """The meta device applies torch._scaled_mm's GPU checks (emulation skips them): the weight gradient's inner
    dimension is the micro-batch's tokens, 100 here, which torchao must pad to 16. torchao computes that gradient for
    a frozen weight (a LoRA base layer) too."""
    from torchao.float8 import convert_to_float8_training

    config = float8_config(torch.device("cuda"))
    assert not config.emulate
    model = nn.Sequential(nn.Linear(64, 128, bias=False, device="meta", dtype=torch.bfloat16))
    model[0].weight.requires_grad_(not frozen)
    convert_to_float8_training(model, config=config)
    x = torch.empty(100, 64, device="meta", dtype=torch.bfloat16, requires_grad=True)
    y = model(x)
    y.backward(torch.empty_like(y))
    assert x.grad is not None and x.grad.shape == x.shape


# the full fine-tune is heavy: lora runs the same CLI path, test_zero3_two_ranks_with_float8 a full one
@pytest.mark.parametrize("method", ["lora", pytest.param("full", marks=pytest.mark.heavy)])
def test_cli_train_with_float8_on_cpu(tmp_path: Path, tiny_llama: Path, small_data: Path, method: str) -> None:
    cfg = _cfg(tmp_path, tiny_llama, small_data, method=method)
    r = run_cli("train", str(cfg), env={"OMP_NUM_THREADS": "1"})
    assert r.returncode == 0, r.stderr[-3000:]
    assert "float8 on cpu: 14 linear layers emulate FP8" in r.stderr  # 7 per block, 2 blocks
    losses = [m["loss"] for m in read_jsonl(tmp_path / "run" / "metrics.jsonl") if "loss" in m]
    assert len(losses) == 2 and all(math.isfinite(x) for x in losses)


@pytest.mark.slow
def test_zero3_two_ranks_with_float8(tmp_path: Path, tiny_llama: Path, small_data: Path) -> None:
    cfg = _cfg(tmp_path, tiny_llama, small_data, method="full", strategy="zero3")
    r = run_cli("train", str(cfg), "--nproc", "2", env={"OMP_NUM_THREADS": "1"})
    assert r.returncode == 0, r.stderr[-3000:]
    losses = [m["loss"] for m in read_jsonl(tmp_path / "run" / "metrics.jsonl") if "loss" in m]
    assert len(losses) == 2 and all(math.isfinite(x) for x in losses)


@pytest.mark.parametrize("over,rule,fix", [
    ({"method": "qlora"}, "float8_with_4bit_weights", "method: lora"),
    ({"precision": "fp32"}, "float8_needs_bf16", "precision: bf16"),
])
def test_train_refuses_what_float8_cannot_run(tmp_path: Path, tiny_llama: Path, small_data: Path,
                                             capsys: pytest.CaptureFixture, over: dict, rule: str, fix: str) -> None:
    code, _, err = run_here(capsys, "train", str(_cfg(tmp_path, tiny_llama, small_data, **over)))
    assert code == 2, err
    assert rule in err and "float8: false" in err and fix in err and "Traceback" not in err


@pytest.mark.parametrize("over,rule", [({"method": "qlora"}, "float8_with_4bit_weights"),
                                       ({"precision": "fp32"}, "float8_needs_bf16")])
def test_train_under_an_external_launcher_refuses_too(tmp_path: Path, tiny_llama: Path, small_data: Path,
                                                     over: dict, rule: str) -> None:
    """torchrun or srun start each rank with RANK and WORLD_SIZE set: `train` then skips its own pre-launch checks,
    so the rank must refuse by itself (exit 2), not crash in torchao."""
    env = {"OMP_NUM_THREADS": "1", "RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1",
           "MASTER_PORT": "29517"}
    r = run_cli("train", str(_cfg(tmp_path, tiny_llama, small_data, **over)), env=env)
    assert r.returncode == 2, r.stderr[-3000:]
    assert rule in r.stderr and "float8: false" in r.stderr and "a bug in shardfit" not in r.stderr


def test_check_refuses_float8_on_a_card_without_fp8(tmp_path: Path, tiny_llama: Path, small_data: Path) -> None:
    cfg = load_config(_cfg(tmp_path, tiny_llama, small_data, packing=False))  # compiled on a GPU: no other warning
    _, found = check_config(cfg, 1, parse_gpus("1xA100"))
    hits = [f for f in found if f.rule == "float8_unsupported_gpu"]
    assert hits and hits[0].severity == "error" and hits[0].where == "config: float8" and "8.9" in hits[0].message
    job, ok = check_config(cfg, 1, parse_gpus("1xH100"))
    assert not [f for f in ok if f.rule.startswith("float8") and f.severity == "error"]
    staged = float8_rules(cfg, dataclasses.replace(job, pipeline_parallel=2))
    assert [f.rule for f in staged] == ["float8_with_pipeline"] and "pipeline_parallel: 1" in staged[0].fix
    _, here = check_config(cfg, 1)  # this machine's CPU: emulated, said as a note
    assert [f.severity for f in here if f.rule.startswith("float8")] == ["info"]


def test_check_cli_exits_1_naming_the_key(tmp_path: Path, tiny_llama: Path, small_data: Path,
                                          capsys: pytest.CaptureFixture) -> None:
    code, out, _ = run_here(capsys, "check", str(_cfg(tmp_path, tiny_llama, small_data)), "--gpus", "1xA100",
                            "--json")
    found = json.loads(out)["findings"]
    assert code == 1 and any(f["rule"] == "float8_unsupported_gpu" and "float8: false" in f["fix"] for f in found)


def _speed(model: str, w: Workload, gpus: str, strategy: str) -> float:
    plan = make_plan(resolve_shape(model), w, parse_gpus(gpus))
    return next(c for c in plan.candidates if c.strategy == strategy).tokens_per_s


def test_plan_predicts_fp8_faster_compiled_and_slower_eager() -> None:
    """Compiled, inductor fuses torchao's casts: FP8 is faster but less than twice. Eager, each cast is six kernels
    over the tensor (33 bytes an element, not 5), which costs more than the FP8 matmuls save."""
    w = Workload(method="full", seq_len=4096, micro_batch=1, grad_ckpt="full")
    speed = {(f8, c): _speed("meta-llama/Llama-3.1-8B", dataclasses.replace(w, float8=f8, compile=c), "8xH100",
                             "zero3") for f8 in (False, True) for c in (False, True)}
    assert 1.1 < speed[True, True] / speed[False, True] < 2  # the block linears: most of an 8B model's FLOPs
    assert speed[True, False] < speed[False, False]


def test_lora_pays_the_frozen_weights_gradient_in_fp8() -> None:
    """torchao computes (and drops) a frozen base layer's weight gradient: LoRA's FP8 matmuls are the full
    fine-tune's, its casts too, and the speedup over bf16 is far below the full fine-tune's."""
    shape = resolve_shape("meta-llama/Llama-3.1-8B")
    lora = Workload(method="lora", seq_len=4096, micro_batch=1, grad_ckpt="full", float8=True, compile=True)
    full = dataclasses.replace(lora, method="full")
    assert flops.float8_flops(shape, lora) == flops.float8_flops(shape, full)
    assert flops.float8_cast_bytes(shape, lora) == flops.float8_cast_bytes(shape, full)
    assert flops.float8_replaced_flops(shape, lora) < flops.float8_replaced_flops(shape, full)
    eager = dataclasses.replace(lora, compile=False)
    assert flops.float8_cast_bytes(shape, eager) == pytest.approx(33 / 5 * flops.float8_cast_bytes(shape, lora))
    off = dataclasses.replace(lora, float8=False)
    assert _speed("meta-llama/Llama-3.1-8B", lora, "1xH100", "single") / \
        _speed("meta-llama/Llama-3.1-8B", off, "1xH100", "single") < 1.05


def test_plan_ignores_float8_where_it_is_refused() -> None:
    shape = resolve_shape("meta-llama/Llama-3.1-8B")
    for over in ({"method": "qlora"}, {"precision": "fp16"}):
        w = Workload(seq_len=4096, micro_batch=1, grad_ckpt="full", float8=True, compile=True, **over)
        assert flops.float8_flops(shape, w) == 0 and flops.float8_s(shape, w, card_of(parse_gpus("1xH100")),
                                                                        0.7) == 0


def test_compile_auto_compiles_float8_only_where_one_shape_is_free(tmp_path: Path, tiny_llama: Path,
                                                                    small_data: Path) -> None:
    """float8 wants its casts compiled, but auto does not compile packed rows without static_shape for it: each
    micro-batch would be padded to micro_batch x max_seq_len; nor expert-parallel runs, whose dispatch is not
    compiled (compile: true refuses them)."""
    assert not resolve_compile("auto", "cuda", packing=True)
    assert resolve_compile("auto", "cuda", packing=True, static_shape=True)
    assert resolve_compile("auto", "cuda", packing=False)
    assert not resolve_compile("auto", "cuda", packing=False, expert_parallel=2)
    assert not resolve_compile("auto", "cpu", packing=False)
    packed = workload_of(load_config(_cfg(tmp_path, tiny_llama, small_data, packing=True)))
    assert packed.float8 and not packed.compile  # the plan of a config: auto planned eager, float8 or not
    assert workload_of(load_config(_cfg(tmp_path, tiny_llama, small_data, name="on", compile=True))).compile


def test_a_gpu_below_sm89_is_refused_when_the_run_starts(monkeypatch: pytest.MonkeyPatch) -> None:
    """The live guard behind the check's card table: the device's own compute capability."""
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *_: "NVIDIA A100-SXM4-80GB")
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *_: (8, 0))
    with pytest.raises(UserError, match="float8: true needs a GPU of compute capability 8.9.*8.0.*float8: false"):
        require_fp8_device(torch.device("cuda", 0))
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *_: (8, 9))
    require_fp8_device(torch.device("cuda", 0))
    require_fp8_device(torch.device("cpu"))
    monkeypatch.setattr(torch.version, "hip", "6.2")  # ROCm: its capability numbers are not NVIDIA's
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *_: (9, 0))
    with pytest.raises(UserError, match="NVIDIA GPUs only.*float8: false"):
        require_fp8_device(torch.device("cuda", 0))


def test_plan_cli_says_fp8_and_warns_on_a_card_without_it(capsys: pytest.CaptureFixture) -> None:
    args = ("plan", "--model", "meta-llama/Llama-3.1-8B", "--method", "full", "--seq", "4096", "--float8")
    code, out, _ = run_here(capsys, *args, "--gpus", "8xH100", "--compile")
    assert code == 0 and "bf16 + FP8 matmuls, compiled" in out.splitlines()[0] and "note: float8" not in out
    code, out, _ = run_here(capsys, *args, "--gpus", "8xH100")  # as a packed config resolves: uncompiled
    assert code == 0 and "FP8 matmuls, uncompiled" in out.splitlines()[0] and "float8 uncompiled" in out
    code, out, _ = run_here(capsys, *args, "--gpus", "8xA100")
    assert code == 0 and "float8 on A100: the card has no FP8 tensor cores" in out
    code, out, _ = run_here(capsys, *args, "--gpus", "1xMI300X")
    assert code == 0 and "NVIDIA GPUs only" in out and "compute capability" not in out


@pytest.mark.parametrize("flags,note", [
    (("--gpus", "8xH100", "--no-compile"), "float8 uncompiled: torchao's casts to FP8 run as separate kernels"),
    (("--gpus", "1xH100", "--method", "qlora"), "float8 with method qlora: check and train refuse it"),
    (("--gpus", "1xH100", "--precision", "fp16"), "float8 with precision fp16: check and train refuse it"),
    (("--gpus", "8xH100", "--pipeline-parallel", "2"), "float8 with pipeline stages: check and train refuse it"),
    (("--method", "lora"), "float8 on a CPU is emulated: the casts run without the FP8 speed"),
])
def test_plan_cli_notes_where_float8_does_not_speed_up(capsys: pytest.CaptureFixture, flags: tuple,
                                                        note: str) -> None:
    code, out, _ = run_here(capsys, "plan", "--model", "meta-llama/Llama-3.1-8B", "--seq", "4096", "--batch", "1",
                            "--float8", *flags)
    assert code in (0, 3) and note in out, out[:2000]


def test_check_warns_when_float8_runs_uncompiled(tmp_path: Path, tiny_llama: Path, small_data: Path) -> None:
    def rules(**over) -> list[str]:
        cfg = load_config(_cfg(tmp_path, tiny_llama, small_data, name=f"c{len(over)}", **over))
        return [f.rule for f in check_config(cfg, 1, parse_gpus("1xH100"))[1] if f.rule.startswith("float8")]

    assert rules(packing=False) == []  # compile: auto compiles unpacked rows on a GPU
    assert rules(packing=True) == ["float8_uncompiled"]  # packed rows stay eager without static_shape
    assert rules(compile=False) == ["float8_uncompiled"]
    cfg = load_config(_cfg(tmp_path, tiny_llama, small_data, name="c1"))
    job, _ = check_config(cfg, 1, parse_gpus("1xH100"))
    split = float8_rules(cfg, dataclasses.replace(job, compile=False, sequence_parallel=2))
    assert [f.rule for f in split] == ["float8_uncompiled"] and split[0].fix.startswith("float8: false")


def test_axolotl_fp8_is_planned_as_float8(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    """axolotl's `fp8: true` (torchao's float8 training through accelerate) plans and converts as `float8`; without
    its torch_compile the casts run eager, slower than the bf16 run."""
    job = dict(base_model="meta-llama/Llama-3.1-8B", bf16=True, sequence_len=4096, micro_batch_size=1,
               gradient_checkpointing=True, fsdp_config={"reshard_after_forward": True})
    speeds = {}
    for fp8 in (False, True):
        path = write_config(tmp_path / f"ax-{fp8}.yml", **job, fp8=fp8)
        code, out, _ = run_here(capsys, "plan", "--from", "axolotl", str(path), "--gpus", "8xH100", "--json")
        plan = json.loads(out)
        assert code == 0 and plan["workload"]["float8"] is fp8
        speeds[fp8] = max(c["tokens_per_s"] or 0 for c in plan["candidates"])
    assert speeds[True] < speeds[False]
