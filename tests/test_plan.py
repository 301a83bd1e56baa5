"""`shardfit plan`: the JSON contract, the seed case, card parsing, nothing-fits (exit 3), and train's refusal."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from shardfit.cli.main import main
from shardfit.errors import UserError
from shardfit.plan.hardware import parse_gpus
from shardfit.plan.shapes import resolve_shape
from tests.conftest import run_cli, write_config

PARTS = ("weights", "grads", "optimizer", "activations", "logits", "temporaries", "runtime_overhead", "total")


def _plan(capsys, *args: str) -> tuple[int, dict]:
    code = main(["plan", *args, "--json"])
    return code, json.loads(capsys.readouterr().out)


def test_seed_case_json_contract(capsys) -> None:
    code, plan = _plan(capsys, "--model", "Qwen/Qwen2-VL-72B-Instruct", "--gpus", "8x24GB", "--method", "lora",
                       "--seq", "2048", "--batch", "1")
    assert code == 0
    assert set(plan) >= {"shardfit_version", "model", "hardware", "workload", "candidates", "recommended", "reason"}
    assert plan["model"]["params"] == pytest.approx(73.4e9, rel=0.01)
    assert 0 < plan["model"]["trainable_params"] < 0.01 * plan["model"]["params"]  # LoRA: the adapter only
    assert plan["hardware"] == {"nodes": 1, "gpus_per_node": 8, "gpu_mem_gib": 24.0, "cpu_mem_gib": None}
    assert plan["workload"]["method"] == "lora" and plan["workload"]["seq_len"] == 2048
    names = [c["strategy"] for c in plan["candidates"]]
    assert names == ["single", "ddp", "zero2", "zero3", "zero3_offload", "model_parallel"]
    for c in plan["candidates"]:
        assert set(c["per_gpu_gib"]) == set(PARTS) and c["estimator"] == "analytic"
        parts = sum(c["per_gpu_gib"][k] for k in PARTS[:-1])
        assert c["per_gpu_gib"]["total"] == pytest.approx(parts, abs=0.01)
    ddp = next(c for c in plan["candidates"] if c["strategy"] == "ddp")
    assert not ddp["fits"] and "full replica per GPU" in ddp["notes"] and ddp["per_gpu_gib"]["weights"] > 130
    zero3 = next(c for c in plan["candidates"] if c["strategy"] == "zero3")
    assert zero3["per_gpu_gib"]["weights"] == pytest.approx(ddp["per_gpu_gib"]["weights"] / 8, rel=0.01)
    assert plan["recommended"] in ("zero3_offload", "model_parallel", "zero3")
    assert "ddp: full replica per GPU" in plan["reason"]


def test_sharding_and_method_monotonic(capsys) -> None:
    _, lora = _plan(capsys, "--model", "meta-llama/Llama-3.1-8B", "--gpus", "4x24GB", "--method", "lora")
    _, full = _plan(capsys, "--model", "meta-llama/Llama-3.1-8B", "--gpus", "4x24GB", "--method", "full")
    _, qlora = _plan(capsys, "--model", "meta-llama/Llama-3.1-8B", "--gpus", "4x24GB", "--method", "qlora")
    t = {p["workload"]["method"]: {c["strategy"]: c["per_gpu_gib"]["total"] for c in p["candidates"]}
         for p in (lora, full, qlora)}
    for s in ("ddp", "zero3"):
        assert t["qlora"][s] < t["lora"][s] < t["full"][s]
    assert t["full"]["zero3"] < t["full"]["zero2"] < t["full"]["ddp"]
    _, ckpt = _plan(capsys, "--model", "meta-llama/Llama-3.1-8B", "--gpus", "1x80GB", "--grad-ckpt", "full")
    _, none = _plan(capsys, "--model", "meta-llama/Llama-3.1-8B", "--gpus", "1x80GB", "--grad-ckpt", "none")
    assert ckpt["candidates"][0]["per_gpu_gib"]["activations"] < none["candidates"][0]["per_gpu_gib"]["activations"]


def test_nothing_fits_exit_3_with_alternatives(capsys) -> None:
    code, plan = _plan(capsys, "--model", "meta-llama/Llama-3.1-70B", "--gpus", "1x24GB", "--method", "full",
                       "--strategy", "ddp")
    assert code == 3 and plan["recommended"] is None and plan["alternatives"]
    r = run_cli("plan", "--model", "meta-llama/Llama-3.1-70B", "--gpus", "1x4090", "--method", "full",
                "--strategy", "ddp", timeout=120)
    assert r.returncode == 3 and "nothing fits" in r.stdout


@pytest.mark.parametrize("spec, count, mem", [("8x24GB", 8, 24.0), ("8x24GiB", 8, 24.0), ("1x4090", 1, 23.6),
                                             ("4xA100-80G", 4, 79.2), ("2xH100", 2, 79.2), ("4xa100-40gb", 4, 39.4)])
def test_gpu_specs(spec: str, count: int, mem: float) -> None:
    hw = parse_gpus(spec)
    assert hw.gpus_per_node == count and hw.gpu_mem_gib == pytest.approx(mem)


def test_unknown_card_and_model() -> None:
    with pytest.raises(UserError, match="unknown card"):
        parse_gpus("2xRTX9999")
    with pytest.raises(UserError, match="Did you mean"):
        resolve_shape("meta-llama/Llama-3.1-8b-typo")


def test_catalog_param_counts_match_published() -> None:
    published = {"meta-llama/Llama-3.1-8B": 8.03e9, "meta-llama/Llama-2-7b-hf": 6.74e9,
                 "Qwen/Qwen2.5-7B-Instruct": 7.62e9, "mistralai/Mixtral-8x7B-v0.1": 46.7e9,
                 "meta-llama/Llama-3.1-405B": 405.9e9, "HuggingFaceTB/SmolLM2-135M-Instruct": 134.5e6,
                 "google/gemma-2-9b": 9.24e9, "Qwen/Qwen3-8B": 8.19e9}
    for model, n in published.items():
        assert resolve_shape(model).params() == pytest.approx(n, rel=0.01), model


def test_local_folder_shape_matches_real_model(tiny_qwen2: Path) -> None:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_qwen2)
    real = sum(p.numel() for p in model.parameters())
    shape = resolve_shape(str(tiny_qwen2))
    # Qwen2 has q/k/v biases, which the analytic count leaves out: tiny here, a rounding error at 7B.
    assert shape.params() == pytest.approx(real, rel=0.02)


def test_train_refuses_predicted_oom(tmp_path: Path, tiny_llama: Path, small_data: Path) -> None:
    cfg = write_config(tmp_path / "c.yaml", model=str(tiny_llama), data=str(small_data), max_seq_len=128,
                       micro_batch=2, max_steps=1, output_dir=str(tmp_path / "run"))
    from shardfit.config import load_config
    from shardfit.errors import DoesNotFitError
    from shardfit.parallel.env import init_distributed
    from shardfit.plan.build import make_plan
    from shardfit.plan.choose import refuse_if_oom
    from shardfit.plan.estimate import Workload

    plan = make_plan(resolve_shape("meta-llama/Llama-3.1-70B"), Workload(method="full"), parse_gpus("1x24GB"))
    refuse_if_oom(plan, "single", force=True)  # force starts anyway
    with pytest.raises(DoesNotFitError, match="strategy single is predicted not to fit"):
        refuse_if_oom(plan, "single", force=False)
    from shardfit.train.loop import train

    result = train(load_config(cfg), init_distributed(), quiet=True)
    written = json.loads((result.run_dir / "plan.json").read_text())
    assert written["recommended"] == "single" and written["model"]["layers"] == 2


@pytest.mark.parametrize(("precision", "grad_ckpt"), [("fp32", "none"), ("bf16", "full"), ("bf16", "selective")])
def test_simulate_matches_real_tracked_step(tiny_llama: Path, precision: str, grad_ckpt: str) -> None:
    """The fake-tensor step measures what the same step needs with real tensors (single process, LoRA; in bf16
    with checkpointing, autocast's copies of the fp32 adapters included; selective checkpointing's kept outputs)."""
    import functools

    import torch
    from transformers import AutoModelForCausalLM

    from shardfit.config.schema import LoraSettings
    from shardfit.models.adapters import apply_lora
    from shardfit.models.checkpointing import enable_hf_checkpointing
    from shardfit.plan.estimate import Workload
    from shardfit.plan.simulate import (
        StepMemTracker,
        measure_step,
        packed_positions,
        simulate,
        skip_frozen_grad_hooks,
        to_breakdown,
    )
    from shardfit.train.loss import CausalLMLoss, decoder_and_head
    from shardfit.train.optim import build_optimizer

    w = Workload(method="lora", precision=precision, seq_len=128, micro_batch=2, grad_ckpt=grad_ckpt, lora_rank=4)
    hw = parse_gpus("1x24GB")
    fake = simulate(resolve_shape(str(tiny_llama)), w, hw, "single", str(tiny_llama))
    assert fake.estimator == "simulated"

    torch.manual_seed(0)
    dtype = torch.float32 if precision == "fp32" else torch.bfloat16
    model = apply_lora(AutoModelForCausalLM.from_pretrained(tiny_llama, dtype=dtype), LoraSettings(rank=4, alpha=8))
    if grad_ckpt != "none":
        enable_hf_checkpointing(model, selective=grad_ckpt == "selective")
    model.train()  # as the training loop runs it (from_pretrained returns it in eval mode: no checkpointing)
    module = CausalLMLoss(model, all_labelled=True)
    optimizer = build_optimizer([p for p in module.parameters() if p.requires_grad], 1e-4, 0.0)
    ids = torch.randint(0, 1000, (2, 128))
    tracker = StepMemTracker(decoder_and_head(model)[0])
    tracker.track_external(module, optimizer)
    skip_frozen_grad_hooks(tracker, module)
    amp = functools.partial(torch.autocast, "cpu", dtype=torch.bfloat16, enabled=precision != "fp32")
    real = to_breakdown(measure_step(module, optimizer, (ids, packed_positions(2, 128), ids), tracker, amp=amp), hw,
                        "single")
    got, want = fake.per_gpu_gib, real
    assert got.logits > 0
    for part in ("weights", "grads", "optimizer", "activations", "logits", "temporaries", "total"):
        assert getattr(got, part) == pytest.approx(getattr(want, part), rel=0.05, abs=1e-4), part


def test_offload_host_ram_limit() -> None:
    from shardfit.plan.estimate import Workload, estimate

    shape = resolve_shape("meta-llama/Llama-3.1-70B")
    roomy = estimate(shape, Workload(method="full"), parse_gpus("8x24GB", cpu_mem_gib=2048), "zero3_offload")
    tight = estimate(shape, Workload(method="full"), parse_gpus("8x24GB", cpu_mem_gib=256), "zero3_offload")
    assert roomy.fits and roomy.cpu_gib * 8 == pytest.approx(70.6e9 * 16 / 2**30, rel=0.02)
    assert not tight.fits and "host RAM too small" in tight.notes


def _saved_bytes_per_token(arch: str, method: str, grad_ckpt: str, layers: int, seq: int = 256,
                           attention: str = "sdpa", autocast: bool = True) -> float:
    """Bytes autograd keeps for backward after one forward of the training module (saved-tensor hooks; weights
    themselves excluded), per token: the quantity the analytic activation estimate models."""
    import torch
    from transformers import AutoModelForCausalLM, LlamaConfig, Qwen2Config

    from shardfit.config.schema import LoraSettings
    from shardfit.models.adapters import apply_lora
    from shardfit.models.checkpointing import enable_hf_checkpointing
    from shardfit.plan.simulate import packed_positions
    from shardfit.train.loss import CausalLMLoss

    cls = LlamaConfig if arch == "llama" else Qwen2Config
    # flash: what flash-attention saves, as SDPA saves it over rows of one unpadded example (no mask built)
    config = cls(hidden_size=256, intermediate_size=704, num_hidden_layers=layers, num_attention_heads=8,
                 num_key_value_heads=2, vocab_size=4096, tie_word_embeddings=False,
                 attn_implementation="sdpa" if attention == "flash" else attention)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32 if method == "full" else torch.bfloat16)
    if method == "lora":
        model = apply_lora(model, LoraSettings(rank=8, alpha=16))
    if not autocast:  # as FSDP2's MixedPrecisionPolicy runs it: 16-bit parameters, adapters included
        model.to(torch.bfloat16)
    if grad_ckpt == "full":
        enable_hf_checkpointing(model)
    module = CausalLMLoss(model, all_labelled=True)
    weights = {p.untyped_storage().data_ptr() for p in module.parameters()}
    kept: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        if t.untyped_storage().data_ptr() not in weights:
            kept[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    ids = torch.randint(0, 4096, (2, seq))
    positions = None if attention == "flash" else packed_positions(2, seq)
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast), \
            torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        module(ids, positions, ids)
    return sum(kept.values()) / (2 * seq)


@pytest.mark.parametrize(("arch", "method", "grad_ckpt", "attention", "strategy"), [
    (arch, method, ckpt, "sdpa", "single") for arch in ("llama", "qwen2") for method in ("lora", "full")
    for ckpt in ("none", "full")] + [("llama", "lora", "none", "eager", "single"),
                                     ("qwen2", "full", "none", "eager", "single"),
                                     ("llama", "lora", "none", "flash", "single"),
                                     ("qwen2", "full", "full", "flash", "single"),
                                     ("llama", "lora", "none", "sdpa", "zero3"),
                                     ("qwen2", "lora", "none", "flash", "zero3"),
                                     ("qwen2", "full", "none", "sdpa", "zero3")])
def test_activation_estimate_matches_saved_tensors(arch: str, method: str, grad_ckpt: str, attention: str,
                                                   strategy: str) -> None:
    """Per decoder block, what the analytic estimate counts equals what autograd really saves, within 5%: under
    autocast (single, ddp) and with 16-bit parameters and no autocast (FSDP2's mixed precision); over packed rows
    (sdpa, eager: a block-diagonal mask) and rows of one example (flash: no mask)."""
    from shardfit.plan.estimate import Workload, activation_bytes
    from shardfit.plan.shapes import ModelShape

    autocast = strategy == "single"
    per_block = _saved_bytes_per_token(arch, method, grad_ckpt, 4, attention=attention, autocast=autocast) - \
        _saved_bytes_per_token(arch, method, grad_ckpt, 2, attention=attention, autocast=autocast)
    shape = ModelShape(f"tiny-{arch}", 2, 256, 704, 8, 2, 4096, False, None)
    w = Workload(method=method, precision="bf16", seq_len=256, micro_batch=2, grad_ckpt=grad_ckpt, lora_rank=8,
                 attention=attention)
    tokens = 512
    two = activation_bytes(shape, w, 2, strategy) - activation_bytes(shape, w, 0, strategy)
    predicted = two / 2 / tokens
    if grad_ckpt == "full":  # the one recomputed block lives only during backward, not in the forward's saved set
        predicted = (activation_bytes(shape, w, 2, strategy) - activation_bytes(shape, w, 1, strategy)) / tokens
    assert predicted == pytest.approx(per_block / 2, rel=0.05)


@pytest.mark.slow
def test_simulate_matches_real_zero3_step_on_two_ranks(tmp_path: Path, tiny_llama: Path) -> None:
    """The fake process group of --simulate measures what a real 2-rank FSDP2 step on gloo holds per rank."""
    import json
    import subprocess
    import sys

    from shardfit.plan.estimate import Workload
    from shardfit.plan.simulate import simulate, to_breakdown

    out = tmp_path / "real.json"
    script = Path(__file__).with_name("zero3_tracked_step.py")
    r = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
                        str(script), str(tiny_llama), str(out)], capture_output=True, text=True, timeout=300,
                       env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert r.returncode == 0, r.stderr[-3000:]
    hw = parse_gpus("2x24GB")
    real = to_breakdown(json.loads(out.read_text()), hw, "zero3")
    w = Workload(method="lora", precision="fp32", seq_len=128, micro_batch=2, grad_ckpt="none", lora_rank=4)
    fake = simulate(resolve_shape(str(tiny_llama)), w, hw, "zero3", str(tiny_llama)).per_gpu_gib
    for part in ("weights", "grads", "optimizer", "activations", "logits", "temporaries", "total"):
        assert getattr(fake, part) == pytest.approx(getattr(real, part), rel=0.05, abs=1e-4), part


def _analytic_and_simulated(arch: str, strategy: str, w: object) -> tuple:
    """The estimate and the fake-tensor step of `w` on a tiny 4-block model (zero3: 2 ranks)."""
    from shardfit.plan.estimate import estimate
    from shardfit.plan.shapes import ModelShape
    from shardfit.plan.simulate import simulate

    shape = ModelShape(f"tiny-{arch}", 4, 256, 704, 8, 2, 4096, False, None)
    hw = parse_gpus("2x80GB" if strategy == "zero3" else "1x80GB")
    return estimate(shape, w, hw, strategy), simulate(shape, w, hw, strategy, None)


def _assert_columns_agree(ca: object, cs: object, total_rel: float) -> None:
    """Estimate and simulation peak at the end of the forward pass, with every column within 5% (0.1 MiB for
    near-empty ones) and the tensor total within `total_rel`."""
    a, s = ca.per_gpu_gib, cs.per_gpu_gib
    assert ca.peak_phase == cs.peak_phase == "forward"
    for part in ("weights", "grads", "optimizer", "activations", "logits", "temporaries"):
        assert getattr(a, part) == pytest.approx(getattr(s, part), rel=0.05, abs=1e-4), part
    assert a.total - a.runtime_overhead == pytest.approx(s.total - s.runtime_overhead, rel=total_rel)


@pytest.mark.parametrize("attention", ["sdpa", "flash", "eager"])
@pytest.mark.parametrize("method", ["lora", "full"])
@pytest.mark.parametrize("strategy", ["single", "zero3"])
@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_analytic_agrees_with_simulate(arch: str, strategy: str, method: str, attention: str) -> None:
    """Both report the breakdown at the step's peak moment (here the loss, at the end of the forward pass): the
    same moment, and every column within 5% (0.1 MiB for near-empty ones), for each attention kernel: SDPA over
    packed rows (its per-block mask), flash (no mask), eager (the scores)."""
    from shardfit.plan.estimate import Workload

    w = Workload(method=method, precision="bf16", seq_len=256, micro_batch=2, grad_ckpt="none", lora_rank=8,
                 attention=attention)
    _assert_columns_agree(*_analytic_and_simulated(arch, strategy, w), total_rel=0.03)


@pytest.mark.parametrize(("arch", "strategy", "method", "attention"), [
    ("llama", "single", "lora", "sdpa"), ("qwen2", "single", "full", "sdpa"), ("llama", "single", "full", "flash"),
    ("qwen2", "single", "lora", "flash"), ("llama", "zero3", "lora", "sdpa"), ("qwen2", "zero3", "lora", "flash")])
def test_checkpointed_analytic_agrees_with_simulate(arch: str, strategy: str, method: str, attention: str) -> None:
    """Checkpointed blocks, peak at the loss: the blocks' inputs, SDPA's mask kept for the recomputation, autocast's
    16-bit copies of fp32 adapters, the loss. Every column within 5%, on one process and under FSDP."""
    from shardfit.plan.estimate import Workload

    w = Workload(method=method, precision="bf16", seq_len=256, micro_batch=2, grad_ckpt="full", lora_rank=8,
                 attention=attention)
    _assert_columns_agree(*_analytic_and_simulated(arch, strategy, w), total_rel=0.02)


@pytest.mark.parametrize(("arch", "strategy", "method", "attention"), [
    ("llama", "single", "lora", "sdpa"), ("qwen2", "single", "lora", "flash"), ("qwen2", "single", "full", "eager"),
    ("llama", "zero3", "full", "flash"), ("qwen2", "zero3", "full", "sdpa")])
def test_selective_checkpointing_agrees_with_simulate(arch: str, strategy: str, method: str, attention: str) -> None:
    """Selective checkpointing (every other matmul's output and the attention kernel's kept; Qwen2's q/k/v
    matmuls carry a bias, LoRA's A and B count as matmuls of their own), peak at the loss: every column within 5%,
    under autocast and under FSDP, for each attention kernel."""
    from shardfit.plan.estimate import Workload

    w = Workload(method=method, precision="bf16", seq_len=256, micro_batch=2, grad_ckpt="selective", lora_rank=8,
                 attention=attention)
    _assert_columns_agree(*_analytic_and_simulated(arch, strategy, w), total_rel=0.02)


def test_selective_checkpointing_keeps_between_full_and_none() -> None:
    """What a selectively checkpointed block keeps lies between a fully checkpointed block's input and everything
    autograd saves without checkpointing, for full and LoRA fine-tunes."""
    from shardfit.plan.estimate import Workload, activation_bytes
    from shardfit.plan.shapes import resolve_shape

    shape = resolve_shape("meta-llama/Llama-3.1-8B")
    for method in ("full", "lora"):
        kept = {ckpt: activation_bytes(shape, Workload(method=method, seq_len=4096, grad_ckpt=ckpt), shape.layers)
                for ckpt in ("none", "selective", "full")}
        assert kept["full"] < kept["selective"] < kept["none"], method


@pytest.mark.parametrize("grad_ckpt", ["none", "full"])
@pytest.mark.parametrize("loss", ["full", "full_shift"])
def test_hf_recipe_agrees_with_simulate(loss: str, grad_ckpt: str) -> None:
    """The HF QLoRA recipe (transformers' own loss, peft's fp32 embeddings/norms/head) at its peak moment: the loss
    at the end of the forward pass (transformers 4.46-4.48's shifted copy) or its gradient, before any checkpointed
    block is recomputed. The estimate and the fake-tensor step agree on the moment and on every column: activations
    within 5%, the others within 2% and the total within 3%."""
    from shardfit.plan.estimate import Workload

    w = Workload(method="lora", precision="bf16", seq_len=256, micro_batch=2, grad_ckpt=grad_ckpt, lora_rank=8,
                 loss=loss, frozen_fp32=True)
    ca, cs = _analytic_and_simulated("llama", "single", w)
    a, s = ca.per_gpu_gib, cs.per_gpu_gib
    assert ca.peak_phase == cs.peak_phase == ("forward" if loss == "full_shift" else "backward")
    for part in ("weights", "grads", "optimizer", "logits"):
        assert getattr(a, part) == pytest.approx(getattr(s, part), rel=0.02, abs=1e-5), part
    assert a.activations == pytest.approx(s.activations, rel=0.05)
    assert a.total - a.runtime_overhead == pytest.approx(s.total - s.runtime_overhead, rel=0.03)


@pytest.mark.parametrize(("arch", "strategy", "method", "attention", "grad_ckpt", "loss", "adapters_16bit"), [
    ("llama", "single", "lora", "flash", "full", "full_shift16", True),
    ("qwen2", "single", "lora", "sdpa", "none", "chunked", True),
    ("llama", "zero3", "lora", "flash", "none", "full_shift16", False),
    ("qwen2", "single", "full", "sdpa", "full", "full_shift16", False)])
def test_older_stacks_agree_with_simulate(arch: str, strategy: str, method: str, attention: str, grad_ckpt: str,
                                          loss: str, adapters_16bit: bool) -> None:
    """What older stacks ran: LoRA adapters in the base model's 16-bit dtype (peft < 0.12: 16-bit states, no
    autocast casts of the adapters or their inputs) and a GPT-2-style loss that copies the shifted 16-bit logits
    (12 bytes per logit under autocast, 6 with FSDP's 16-bit parameters and no autocast). Estimate and fake-tensor
    step agree on the peak moment and on every column within 5%."""
    from shardfit.plan.estimate import Workload

    w = Workload(method=method, precision="bf16", seq_len=256, micro_batch=2, grad_ckpt=grad_ckpt, lora_rank=8,
                 attention=attention, loss=loss, adapters_16bit=adapters_16bit)
    _assert_columns_agree(*_analytic_and_simulated(arch, strategy, w), total_rel=0.02)


def test_optimizer_peak_agrees_with_simulate() -> None:
    """A sharded full fine-tune of short rows peaks in the optimizer step: weights, gradients, AdamW's states and
    the multi-tensor update's fp32 temporary per parameter; estimate and simulation agree on every column."""
    from shardfit.plan.estimate import Workload

    w = Workload(method="full", precision="bf16", seq_len=16, micro_batch=1, grad_ckpt="full")
    ca, cs = _analytic_and_simulated("llama", "zero3", w)
    assert ca.peak_phase == cs.peak_phase == "optimizer"
    for part in ("weights", "grads", "optimizer", "activations", "logits", "temporaries", "total"):
        assert getattr(ca.per_gpu_gib, part) == pytest.approx(getattr(cs.per_gpu_gib, part), rel=0.05,
                                                              abs=2e-4), part


def test_backward_peak_agrees_with_simulate() -> None:
    """A checkpointed, sharded full fine-tune peaks in backward (gradients filling while FSDP holds unsharded
    parameters and gradients); estimate and simulation agree on the moment, the state and the tensor total. How
    backward's total splits between gradients, activations and FSDP's buffers differs (the estimate takes the end
    of backward; FSDP's peak comes in its middle), so the split is not compared."""
    from shardfit.plan.estimate import Workload

    w = Workload(method="full", precision="bf16", seq_len=256, micro_batch=2, grad_ckpt="full")
    ca, cs = _analytic_and_simulated("llama", "zero3", w)
    a, s = ca.per_gpu_gib, cs.per_gpu_gib
    assert ca.peak_phase == cs.peak_phase == "backward"
    for part in ("weights", "optimizer"):
        assert getattr(a, part) == pytest.approx(getattr(s, part), rel=0.01), part
    assert a.total - a.runtime_overhead == pytest.approx(s.total - s.runtime_overhead, rel=0.05)


def test_full_logits_loss_bytes_match_a_real_step() -> None:
    """`--loss full` charges FULL_LOSS_BYTES per logit element: what transformers' own loss really holds at its
    peak (fp32 log-softmax and gradients; the model output is dropped before backward, as the Trainer does),
    measured on a real step of a model whose logits dwarf everything else."""
    import torch
    from torch.distributed._tools.mem_tracker import MemTracker
    from transformers import AutoModelForCausalLM, LlamaConfig

    from shardfit.plan.estimate import FULL_LOSS_BYTES
    from shardfit.plan.simulate import skip_frozen_grad_hooks

    tokens, vocab = 512, 32768
    config = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=1, num_attention_heads=4,
                         num_key_value_heads=2, vocab_size=vocab)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    for p in model.parameters():
        p.requires_grad_(p is model.model.norm.weight)  # a gradient must reach the logits, nothing else of size
    ids = torch.randint(0, vocab, (1, tokens))
    tracker = MemTracker()
    tracker.track_external(model)
    skip_frozen_grad_hooks(tracker, model)
    with tracker:
        model(input_ids=ids, labels=ids).loss.backward()
    peak = {getattr(k, "value", k): v for d in tracker.get_tracker_snapshot("peak").values() for k, v in d.items()}
    per_logit = (peak["Total"] - peak["Parameter"] - peak.get("Buffer", 0)) / (tokens * vocab)
    assert per_logit == pytest.approx(FULL_LOSS_BYTES, rel=0.05)


def test_full_logits_loss_in_plan_and_simulation(capsys) -> None:
    """A run through the model's own loss (HF Trainer style) needs far more than shardfit's chunked loss at long
    sequences; the estimate and the fake-tensor step of that loss agree on it."""
    from shardfit.plan.estimate import Workload, estimate
    from shardfit.plan.shapes import ModelShape
    from shardfit.plan.simulate import simulate

    assert main(["plan", "--model", "meta-llama/Llama-3.1-8B", "--gpus", "1x80GB", "--method", "qlora", "--seq",
                 "16384", "--loss", "full", "--json"]) == 0
    full = json.loads(capsys.readouterr().out)
    assert main(["plan", "--model", "meta-llama/Llama-3.1-8B", "--gpus", "1x80GB", "--method", "qlora", "--seq",
                 "16384", "--json"]) == 0
    chunked = json.loads(capsys.readouterr().out)
    assert full["workload"]["loss"] == "full" and chunked["workload"]["loss"] == "chunked"
    logits = [next(c for c in p["candidates"] if c["strategy"] == "single")["per_gpu_gib"]["logits"]
              for p in (full, chunked)]
    assert logits[0] == pytest.approx(16384 * 128256 * 12 / 2**30, rel=0.01) and logits[1] < 1.0
    # The TRL/axolotl 4-bit recipe on transformers 4.46-4.48: fp32 embeddings/norms/head, shifted logits copy.
    assert main(["plan", "--model", "meta-llama/Llama-3.1-8B", "--gpus", "1x80GB", "--method", "qlora", "--seq",
                 "16384", "--loss", "full_shift", "--frozen-fp32", "--json"]) == 0
    hf = json.loads(capsys.readouterr().out)
    assert hf["workload"]["loss"] == "full_shift" and hf["workload"]["frozen_fp32"] is True
    single = [next(c for c in p["candidates"] if c["strategy"] == "single") for p in (hf, full)]
    assert single[0]["peak_phase"] == "forward"
    assert single[0]["per_gpu_gib"]["weights"] - single[1]["per_gpu_gib"]["weights"] == pytest.approx(
        2 * 128256 * 4096 * 2 / 2**30, rel=0.01)  # embedding and head at 4 bytes instead of 2

    shape = ModelShape("tiny-llama", 2, 64, 128, 4, 2, 32768, False, None)
    w = Workload(method="lora", precision="bf16", seq_len=512, micro_batch=1, grad_ckpt="none", loss="full")
    hw = parse_gpus("1x80GB")
    a, s = estimate(shape, w, hw, "single").per_gpu_gib, simulate(shape, w, hw, "single", None).per_gpu_gib
    ta, ts = a.total - a.runtime_overhead, s.total - s.runtime_overhead
    assert a.logits / ts > 0.8  # logits dominate this shape
    assert 0.95 * ts <= ta <= 1.15 * ts, (ta, ts)


def test_attention_mask_in_plan(capsys) -> None:
    """SDPA over packed rows keeps a 16-bit seq x seq mask per block and k/v repeated to every head; flash attention
    keeps neither. `--attention` picks the column, and a config's attn_implementation maps onto it."""
    from types import SimpleNamespace

    from shardfit.plan.choose import workload_of

    def single(attention: str, ckpt: str) -> dict:
        assert main(["plan", "--model", "meta-llama/Llama-3.1-8B", "--gpus", "1x141GB", "--seq", "8192",
                     "--grad-ckpt", ckpt, "--attention", attention, "--strategy", "single", "--json"]) == 0
        plan = json.loads(capsys.readouterr().out)
        assert plan["workload"]["attention"] == attention
        return plan["candidates"][0]["per_gpu_gib"]

    mask, repeated_kv = 8192 * 8192 * 2, 8192 * 2 * 2 * (4096 - 1024)  # per block, Llama 3.1 8B, batch 1
    sdpa, flash = single("sdpa", "none"), single("flash", "none")
    assert sdpa["activations"] - flash["activations"] == pytest.approx(32 * (mask + repeated_kv) / 2**30, rel=0.01)
    sdpa, flash = single("sdpa", "full"), single("flash", "full")  # the recomputed block's copy and one bool mask
    assert sdpa["activations"] - flash["activations"] == pytest.approx((mask + repeated_kv + 8192**2) / 2**30,
                                                                       rel=0.01)
    cfg = SimpleNamespace(method="lora", precision="bf16", max_seq_len=512, micro_batch=1, grad_ckpt="full",
                          lora=SimpleNamespace(rank=8), grad_accum=1)
    kernels = {"auto": "sdpa", "sdpa": "sdpa", "eager": "eager", "flash_attention_2": "flash",
               "flex_attention": "flash"}
    for name, column in kernels.items():
        assert workload_of(SimpleNamespace(**vars(cfg), attn_implementation=name)).attention == column


def test_published_measurements_script_verdicts() -> None:
    """bench/plan_vs_published.py reads every published case of every source; the planner says OOM where nothing
    ran; where a run just fit its card it predicts that peak within 5%; reported peaks within 20% (Qwen-1.8B's
    short rows sit 15-18% under, unexplained); the median error over all cases within 10% (the issue's target) and
    of each source within 15% (torchtitan's FSDP runs sit 8-12% under their reserved memory)."""
    import importlib.util

    import yaml

    path = Path(__file__).resolve().parent.parent / "bench" / "plan_vs_published.py"
    spec = importlib.util.spec_from_file_location("plan_vs_published", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    data = yaml.safe_load(mod.CASES.read_text())
    result = mod.evaluate(data)
    assert len(data["sources"]) >= 2
    assert len(result["cases"]) == sum(len(src["cases"]) for src in data["sources"].values()) >= 20
    for row in result["cases"]:
        assert row["source"] in data["sources"] and row["predicted_total_gib"] > 0
    assert all(row["verdict_right"] for row in result["cases"] if row["kind"] == "oom")
    assert all(abs(row["error"]) < 0.05 for row in result["cases"] if row["kind"] == "max_context")
    assert all(abs(row["error"]) < 0.20 for row in result["cases"] if row["kind"] == "measured")
    assert all(s["median_abs_error"] < 0.15 for s in result["sources"].values())
    assert result["median_abs_error"] < 0.10
    reserved = [row for row in result["cases"] if row.get("reading") == "reserved"]
    assert reserved and all(row["verdict_right"] for row in reserved)
