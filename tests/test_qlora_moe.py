"""QLoRA of a mixture of experts: the routed experts' fused 3-D weights stored in NF4 (models/quantize_experts.py),
exactly as the planner counts them, dequantized for every experts implementation with LoRA on them working; one
process trains and writes a standard adapter that merges into the dequantized base; zero3 on 2 ranks shards the
NF4 stacks and equals one process."""

from __future__ import annotations

import importlib.util
import json
import math
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

from shardfit.check.moe_rules import quantized_expert_rules
from shardfit.config import Config, LoraSettings, load_config
from shardfit.models.adapters import apply_lora
from shardfit.models.build import build_model
from shardfit.models.experts import moe_parts
from shardfit.models.quantize import (
    is_nf4,
    nf4_storage_bytes,
    quantize_blocks,
    quantized_experts,
    quantized_linears,
    to_nf4,
)
from shardfit.models.quantize_experts import quantize_experts_under_lora
from shardfit.plan import quant
from shardfit.plan.config_shape import shape_from_config
from shardfit.plan.weight_bytes import linear_weight_bytes
from shardfit.plan.workload import Workload
from tests.families import make_family_model, tiny_text_config
from tests.helpers import read_jsonl, run_cli, run_here, train_here, write_config

pytestmark = pytest.mark.skipif(importlib.util.find_spec("torchao") is None, reason="torchao is not installed")
FAMILIES = ["Qwen3-MoE", "gpt-oss"]
BASE = dict(method="qlora", precision="fp32", max_seq_len=128, micro_batch=2, log_steps=1, save_steps=100,
            eval_steps=100, max_steps=3, lr=1e-2, lora={"rank": 4, "alpha": 8}, warmup_ratio=0.0, resume="never")


def _model(family: str, **config: object) -> torch.nn.Module:
    c = tiny_text_config(family)
    for k, v in config.items():
        setattr(c, k, v)
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(c).float()


@pytest.mark.parametrize("family", FAMILIES)
def test_expert_stacks_are_nf4_as_planned(family: str) -> None:
    """Every fused expert stack is NF4 (flattened to 2-D, the 64-value blocks of the 3-D tensor) and dequantizes
    to exactly torchao's values of it; about half a byte per weight plus scales, the planner's bytes to the byte;
    routers stay dense; the meta build (check, simulate) has the same inner tensors."""
    model = _model(family)
    dense = {f"{e}.{n}": getattr(model.get_submodule(e), n).detach().clone()
             for e in moe_parts(model).experts for n in moe_parts(model).expert_weights}
    quantize_blocks(model, torch.float32)
    stacks = quantized_experts(model)
    assert len(stacks) == 2 * 2 and moe_parts(model).expert_weights == ("down_proj", "gate_up_proj")
    for path, name, nf4 in stacks:
        want = dense[f"{path}.{name}"]
        got = getattr(model.get_submodule(path), name)
        assert got.shape == want.shape and nf4.dim() == 2
        flat = to_nf4(want.reshape(-1, want.shape[-1]), torch.float32).get_original_weight()
        assert torch.equal(got, flat.view(want.shape))
        assert (got - want).abs().max() < 0.15 * want.abs().max()  # half NF4's widest code gap per block
    stored = sum(nf4_storage_bytes(t) for _, _, t in stacks)
    values = sum(t.numel() for _, _, t in stacks)
    assert 0.5 < stored / values < 0.54  # bytes per weight: 4-bit codes, int8 block scales, factors, code book
    routers = [model.get_submodule(r) for r in moe_parts(model).routers]
    assert routers and not any(is_nf4(p) for r in routers for p in r.parameters())
    # The planner's block bytes are what the model keeps: NF4 linears and stacks, the router dense.
    shape = shape_from_config(tiny_text_config(family).to_dict(), family)
    block = model.model.layers[1]
    real = sum(nf4_storage_bytes(p) if is_nf4(p) else p.numel() * 4 for n, p in block.named_parameters()
               if p.dim() >= 2 and not n.endswith("bias"))  # gpt-oss's per-expert biases: the block's extras
    assert linear_weight_bytes(shape, Workload(method="qlora", precision="fp32"), moe=True) == real


def test_meta_build_and_check_of_nf4_experts() -> None:
    """build_model on the meta device stores the stacks as NF4 with the inner tensors of the real ones; the check
    rule is silent then, and names stacks that are not whole 64-value blocks (kept dense, as planned)."""
    real = _model("Qwen3-MoE")
    quantize_blocks(real, torch.float32)
    with torch.device("meta"):
        meta = AutoModelForCausalLM.from_config(tiny_text_config("Qwen3-MoE"))
    quantize_blocks(meta, torch.float32)
    for (_, _, a), (_, _, b) in zip(quantized_experts(real), quantized_experts(meta), strict=True):
        names, _ = a.__tensor_flatten__()
        assert b.is_meta and all(getattr(a, n).shape == getattr(b, n).shape for n in names)
    cfg = Config(model="tiny", data="rows.jsonl", method="qlora", lora=LoraSettings(rank=4))
    assert quantized_expert_rules(real, cfg) == []
    odd = _model("Qwen3-MoE", hidden_size=36, moe_intermediate_size=2)
    quantize_blocks(odd, torch.float32)
    # gate/up 4x4x36 = 9 blocks of 64; down 4x36x2 = 4.5 blocks: kept dense
    assert [n for _, n, _ in quantized_experts(odd)] == ["gate_up_proj"] * 2
    found = quantized_expert_rules(odd, cfg)
    assert [f.rule for f in found] == ["qlora_experts_not_4bit"] and found[0].severity == "warning"
    assert "down_proj" in found[0].where and "[4, 36, 2]" in found[0].message


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("impl", ["eager", "batched_mm", "grouped_mm"])
@pytest.mark.parametrize("sliced", [False, True], ids=["whole", "sliced"])
def test_lora_on_nf4_experts_is_lora_on_their_values(family: str, impl: str, sliced: bool,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """With LoRA on the experts (peft's parameter LoRA over the dequantization), each experts implementation
    computes what the same adapter computes on the dequantized weights stored densely; gradients reach the
    adapters only, and a second forward adds the adapter once, not twice. `sliced`: each stack dequantized one
    expert at a time (a slice budget under one expert), as a large mixture's stacks are."""
    if sliced:
        monkeypatch.setattr(quant, "SLICE_ELEMENTS", 1)
    quantized = _model(family)
    quantized.config._experts_implementation = impl
    quantize_blocks(quantized, torch.float32)  # the stacks' values, then the storage as build_model makes it:
    values = {(p, n): getattr(quantized.get_submodule(p), n).detach().clone() for p, n, _ in
              quantized_experts(quantized)}
    quantized = _model(family)
    quantized.config._experts_implementation = impl
    quantize_blocks(quantized, torch.float32, experts=False)
    dense = _model(family)  # the same initial weights (same seed), then the NF4 values stored densely
    dense.config._experts_implementation = impl
    for (path, name), v in values.items():
        setattr(dense.get_submodule(path), name, torch.nn.Parameter(v, requires_grad=False))
    for n, m in quantized_linears(quantized):
        dense.get_submodule(n).weight = torch.nn.Parameter(m.weight.get_original_weight(), requires_grad=False)
    a, b = (apply_lora(m, LoraSettings(rank=4, alpha=8)) for m in (quantized, dense))
    assert quantize_experts_under_lora(a, torch.float32) == 4 and len(quantized_experts(a)) == 4
    stacks = [(tuple(getattr(a.get_submodule(path), name).shape), w.scaler_block_size)
              for path, name, w in quantized_experts(a)]
    assert all((quant.experts_per_slice(shape, sbs) < shape[0]) == sliced for shape, sbs in stacks)
    torch.manual_seed(1)
    for (na, pa), (nb, pb) in zip(*(((n, p) for n, p in m.named_parameters() if p.requires_grad) for m in (a, b)),
                                  strict=True):
        assert na == nb
        with torch.no_grad():
            pa.copy_(torch.randn_like(pa) * 0.1)
            pb.copy_(pa)
    ids = torch.randint(0, 1000, (2, 16))
    loss = a(input_ids=ids, labels=ids).loss
    torch.testing.assert_close(loss, b(input_ids=ids, labels=ids).loss, rtol=1e-5, atol=1e-5)
    loss.backward()
    trained = [(n, p) for n, p in a.named_parameters() if p.requires_grad]
    assert sum(".experts." in n for n, _ in trained) == 8
    assert all(p.grad is not None and p.grad.abs().sum() > 0 for _, p in trained), \
        [n for n, p in trained if p.grad is None]
    assert not [n for n, p in a.named_parameters() if not p.requires_grad and p.grad is not None]
    torch.testing.assert_close(a(input_ids=ids, labels=ids).loss, loss)


def _train(tmp: Path, model: Path, data: Path, name: str, *extra: str, **over: object) -> Path:
    cfg = write_config(tmp / f"{name}.yaml", **dict(BASE, model=str(model), data=str(data),
                                                     output_dir=str(tmp / name), **over))
    if not extra:
        train_here(cfg)
        return tmp / name
    r = run_cli("train", str(cfg), *extra, env={"OMP_NUM_THREADS": "1"})
    assert r.returncode == 0, r.stderr[-3000:]
    return tmp / name


@pytest.mark.slow
@pytest.mark.parametrize("family", ["Qwen3-MoE", pytest.param("gpt-oss", marks=pytest.mark.heavy)])
def test_qlora_of_a_mixture_trains_and_merges(tmp_path: Path, tokenizer_dir: Path, small_data: Path,
                                              family: str, capsys: pytest.CaptureFixture) -> None:
    """One process: the preflight passes, the loss is finite and falls, the adapter has the experts' LoRA and no
    router's, and `export --merge` writes a dense model whose logits are the 4-bit model's with the adapter."""
    model = make_family_model(family, tmp_path / "m", tokenizer_dir)
    run = _train(tmp_path, model, small_data, "run")
    losses = [m["loss"] for m in read_jsonl(run / "metrics.jsonl") if "loss" in m]
    assert len(losses) == 3 and all(math.isfinite(x) for x in losses) and losses[-1] < losses[0]
    assert json.loads((run / "preflight.json").read_text())["ok"]
    saved = load_file(str(run / "adapter" / "adapter_model.safetensors"))
    assert any(".experts." in k for k in saved) and not [k for k in saved if ".gate.lora" in k or ".router." in k]
    code, _, err = run_here(capsys, "export", str(run), "--merge", "--dtype", "fp32", "--out", str(tmp_path / "merged"))
    assert code == 0, err[-2000:]
    merged = AutoModelForCausalLM.from_pretrained(tmp_path / "merged", dtype=torch.float32).eval()
    assert not quantized_experts(merged)
    from peft import set_peft_model_state_dict

    trained = build_model(load_config(run / "config.yaml", check_files=False), "single", weights=True)
    set_peft_model_state_dict(trained, saved)
    ids = torch.randint(0, 1000, (1, 24))
    with torch.no_grad():
        torch.testing.assert_close(merged(input_ids=ids).logits, trained.eval()(input_ids=ids).logits,
                                   rtol=1e-4, atol=1e-4)


@pytest.mark.slow
@pytest.mark.heavy
def test_qlora_of_a_mixture_zero3_on_two_ranks_equals_one_process(tmp_path: Path, tokenizer_dir: Path,
                                                                   small_data: Path) -> None:
    """FSDP2 shards the NF4 expert stacks (dim 0 of their 2-D storage) and all-gathers them per block: the losses
    are one process's with the same global batch."""
    model = make_family_model("Qwen3-MoE", tmp_path / "m", tokenizer_dir)
    one = _train(tmp_path, model, small_data, "one", grad_accum=2)
    two = _train(tmp_path, model, small_data, "two", "--nproc", "2", strategy="zero3")
    ref, got = ([m for m in read_jsonl(r / "metrics.jsonl") if "loss" in m] for r in (one, two))
    assert len(ref) == len(got) == 3
    for a, b in zip(ref, got, strict=True):
        assert b["loss"] == pytest.approx(a["loss"], rel=1e-5)
    assert json.loads((two / "summary.json").read_text())["world_size"] == 2
    want, have = (load_file(str(r / "adapter" / "adapter_model.safetensors")) for r in (one, two))
    assert want.keys() == have.keys()
    for k in want:
        torch.testing.assert_close(have[k], want[k], rtol=1e-3, atol=1e-5)
