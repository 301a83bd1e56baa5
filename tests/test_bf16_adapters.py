"""`lora.dtype: bf16`: adapters stored and computed in bf16 without autocast, their fp32 masters in the optimizer.
The rule that refuses what cannot train, the resolved job, fewer ops per layer, an update as exact as fp32 AdamW's,
and a run that tracks the fp32-adapter run and saves an adapter peft loads."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch
from peft import PeftModel
from safetensors import safe_open
from safetensors.torch import load_file
from torch.distributed.checkpoint import FileSystemReader
from transformers import AutoModelForCausalLM

from bench.bf16_adapters import step_ops
from shardfit.config import Config, LoraSettings, load_config
from shardfit.errors import UserError
from shardfit.parallel.env import init_distributed
from shardfit.parallel.expert_grads import step_grad_norm
from shardfit.plan.hardware import parse_gpus
from shardfit.resolve import DeviceFacts, resolve_job
from shardfit.resolve.decide import settled
from shardfit.train.optim import MasterAdamW, build_optimizer
from shardfit.train.recipe import train
from tests.helpers import read_jsonl, write_config

GPU = DeviceFacts("cuda", True)
ONE_H100 = parse_gpus("1xH100")
SMOL = "HuggingFaceTB/SmolLM2-135M-Instruct"
BF16 = LoraSettings(dtype="bf16")


def test_the_key_is_refused_where_it_cannot_train(tmp_path: Path) -> None:
    """Exit 2 naming the key and the fix: a method without adapters, a precision other than bf16 (given, or what
    auto resolves to), and 4-bit weights that dequantize to another dtype."""
    cases = [({"method": "full"}, "method full trains no adapters"),
             ({"precision": "fp32"}, "precision is fp32"),
             ({"precision": "fp16"}, "precision is fp16"),
             ({"method": "qlora", "qlora": {"compute_dtype": "fp32"}}, "qlora.compute_dtype is fp32")]
    for keys, said in cases:
        path = write_config(tmp_path / "c.yaml", model=SMOL, lora={"dtype": "bf16"}, **keys)
        with pytest.raises(UserError) as e:
            load_config(path)
        assert "'lora.dtype'" in str(e.value) and said in str(e.value), str(e.value)
    with pytest.raises(UserError) as e:  # auto is bf16 only where the device computes it fast
        resolve_job(Config(model=SMOL, precision="auto", lora=BF16), parse_gpus("1xT4"), DeviceFacts("cuda", False))
    assert "precision is auto resolved to fp16" in str(e.value)
    with pytest.raises(UserError) as e:
        load_config(write_config(tmp_path / "c.yaml", model=SMOL, lora={"dtype": "fp8"}))
    assert "choose one of: fp32, bf16" in str(e.value)


def test_the_job_decides_the_adapters_dtype_and_autocast_once() -> None:
    job, _ = resolve_job(Config(model=SMOL, strategy="single", lora=BF16), ONE_H100, GPU)
    assert (job.adapter_dtype, job.autocast) == ("bf16", None)
    assert "bf16 adapters, no autocast" in job.describe()
    assert settled(Config(model=SMOL, lora=BF16), job).lora.dtype == "bf16"
    default, _ = resolve_job(Config(model=SMOL, strategy="single"), ONE_H100, GPU)
    assert (default.adapter_dtype, default.autocast) == ("fp32", "bf16")
    # FSDP2 computes every parameter in bf16 from fp32 shards already: the adapters stay fp32 there, said why.
    z3, _ = resolve_job(Config(model=SMOL, strategy="zero3", lora=BF16), parse_gpus("2xH100"), GPU)
    assert (z3.strategy, z3.adapter_dtype, z3.autocast) == ("zero3", "fp32", None)
    assert any(w.startswith("lora.dtype bf16 -> fp32 under zero3") for w in z3.why)
    assert settled(Config(model=SMOL, lora=BF16), z3).lora.dtype == "fp32"


def test_bf16_adapters_dispatch_fewer_ops_per_micro_batch() -> None:
    """A bf16 base with LoRA on all seven linears of its one layer: without autocast each adapter loses its two
    weight casts forward and the two gradient casts back (219 -> 191 kernels per layer, torch 2.13)."""
    autocast, plain = step_ops(1, "fp32"), step_ops(1, "bf16")
    assert plain["matmul"] == autocast["matmul"]
    assert autocast["kernel"] - plain["kernel"] >= 4 * 7, (autocast, plain)


def test_master_weights_update_as_fp32_adamw_does() -> None:
    """The same bf16-representable start and gradients: the master follows fp32 AdamW exactly, the parameter is
    the master rounded, and the state (masters, moments) stays fp32 through a state-dict round trip. Plain AdamW
    on the bf16 weight drifts off."""
    torch.manual_seed(0)
    start = torch.randn(32, 32).bfloat16().float()
    ref, low, naive = (torch.nn.Parameter(start.clone()), torch.nn.Parameter(start.bfloat16()),
                       torch.nn.Parameter(start.bfloat16()))
    opts = [build_optimizer([ref], 2e-4, 0.01), build_optimizer([low], 2e-4, 0.01),
            torch.optim.AdamW([naive], lr=2e-4, weight_decay=0.01)]
    assert isinstance(opts[1], MasterAdamW) and not isinstance(opts[0], MasterAdamW)
    for _ in range(20):
        g = torch.randn(32, 32).bfloat16()
        ref.grad, low.grad, naive.grad = g.float(), g.clone(), g.clone()
        for o in opts:
            o.step()
    master = opts[1].state[low]["master"]
    assert torch.equal(master, ref.detach())
    assert low.dtype == torch.bfloat16 and torch.equal(low.detach(), master.bfloat16())
    assert not torch.equal(naive.detach().float(), ref.detach().bfloat16().float())
    again = torch.nn.Parameter(low.detach().clone())
    loaded = build_optimizer([again], 2e-4, 0.01)
    loaded.load_state_dict(opts[1].state_dict())
    state = loaded.state[again]
    assert {k: v.dtype for k, v in state.items() if k != "step"} == dict.fromkeys(
        ("exp_avg", "exp_avg_sq", "master"), torch.float32)
    assert torch.equal(state["master"], master)


def test_bf16_gradients_clip_by_their_fp32_norm() -> None:
    """The clipping norm (and the logged grad_norm) of bf16 gradients is summed in fp32, not rounded to bf16's three
    significant digits per tensor."""
    torch.manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(40, 40).bfloat16()) for _ in range(3)]
    for p in params:
        p.grad = torch.randn(40, 40).bfloat16()
    exact = torch.linalg.vector_norm(torch.cat([p.grad.float().flatten() for p in params]))
    norm = step_grad_norm(params, None, 1.0)
    assert norm.dtype == torch.float32 and float(norm) == pytest.approx(float(exact), rel=1e-6)
    clipped = torch.linalg.vector_norm(torch.cat([p.grad.float().flatten() for p in params]))
    assert float(clipped) == pytest.approx(1.0, rel=1e-2)  # scaled in bf16: within its rounding


def _run(tmp_path: Path, model: Path, data: Path, name: str, dtype: str, resume: str = "never"):
    """Five bf16 steps of a tiny Llama with `lora.dtype` `dtype`, a checkpoint at step 3."""
    cfg = write_config(tmp_path / f"{name}.yaml", model=str(model), data=str(data), method="lora", precision="bf16",
                       strategy="single", max_seq_len=64, max_bad_rows=0.5, micro_batch=2, lr=1e-2, warmup_ratio=0.0,
                       max_steps=5, log_steps=1, save_steps=3, eval_steps=100,
                       lora={"rank": 4, "alpha": 8, "dtype": dtype}, output_dir=str(tmp_path / name), resume=resume,
                       report_to=["none"])
    return train(load_config(cfg), init_distributed(), quiet=True)


def test_a_bf16_adapter_run_tracks_the_fp32_one_and_saves_a_peft_adapter(tmp_path: Path, tiny_llama: Path,
                                                                           small_data: Path) -> None:
    losses, runs = {}, {}
    for dtype in ("fp32", "bf16"):
        result = _run(tmp_path, tiny_llama, small_data, dtype, dtype)
        runs[dtype] = result.run_dir
        losses[dtype] = [m["loss"] for m in read_jsonl(result.run_dir / "metrics.jsonl") if "loss" in m]
        assert result.summary["resolved"]["adapter_dtype"] == dtype
        trained = {p.dtype for p in result.model.parameters() if p.requires_grad}
        assert trained == {torch.float32 if dtype == "fp32" else torch.bfloat16}
    # The same start (B = 0) and the same steps: within bf16's noise of each other, and both still learning.
    assert losses["bf16"][0] == pytest.approx(losses["fp32"][0], abs=0.005)
    assert max(abs(a - b) for a, b in zip(losses["fp32"], losses["bf16"], strict=True)) < 0.02, losses
    assert losses["bf16"][-1] < losses["bf16"][0]
    # Saved as the run computed with them: bf16, which peft loads into a bf16 base.
    adapter = runs["bf16"] / "adapter"
    with safe_open(str(adapter / "adapter_model.safetensors"), "pt") as f:
        dtypes = {f.get_tensor(k).dtype for k in f.keys()}
    assert dtypes == {torch.bfloat16}
    base = AutoModelForCausalLM.from_pretrained(tiny_llama, dtype=torch.bfloat16)
    model = PeftModel.from_pretrained(base, adapter)
    trained = {n: p for n, p in model.named_parameters() if "lora_B" in n}
    assert trained and any(p.abs().sum() > 0 for p in trained.values())  # B starts at zero: it trained
    assert dataclasses.asdict(load_config(runs["bf16"] / "config.yaml"))["lora"]["dtype"] == "bf16"


def test_a_bf16_adapter_run_resumes_its_masters_exactly(tmp_path: Path, tiny_llama: Path, small_data: Path) -> None:
    """The checkpoint holds the fp32 masters, not only the bf16 weights: resumed at step 3, the run ends bitwise
    where the uninterrupted one did (from the bf16 weights alone the masters would restart rounded)."""
    whole = _run(tmp_path, tiny_llama, small_data, "whole", "bf16").run_dir
    saved = FileSystemReader(whole / "checkpoints" / "step-3").read_metadata().state_dict_metadata
    masters = [k for k in saved if k.endswith(".master")]
    assert masters and all(saved[k].properties.dtype == torch.float32 for k in masters)
    resumed = _run(tmp_path, tiny_llama, small_data, "resumed", "bf16", str(whole / "checkpoints" / "step-3")).run_dir
    a, b = (load_file(str(r / "adapter" / "adapter_model.safetensors")) for r in (whole, resumed))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
