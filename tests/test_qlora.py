"""QLoRA (`method: qlora`): 4-bit NF4 frozen weights (torchao) built by build_model, trained on one process and
under 2-rank zero3, saved as a standard PEFT adapter, merged into the dequantized weights, refused up front where a
combination cannot work, and checked by the preflight's 4-bit rules."""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import shutil
from pathlib import Path

import pytest
import torch
from peft import PeftModel, set_peft_model_state_dict
from safetensors.torch import load_file
from torch.distributed._tools.mem_tracker import MemTracker
from transformers import AutoModelForCausalLM, BitsAndBytesConfig

from shardfit.check.config_rules import qlora_rules
from shardfit.check.rules import fsdp_unit_rules, qlora_shard_rules
from shardfit.cli.main import main
from shardfit.config import load_config
from shardfit.errors import UserError
from shardfit.infer.load import load_for_inference, resolve_target
from shardfit.models.build import build_model
from shardfit.models.quantize import is_nf4, nf4_storage_bytes, quantize_blocks, quantized_linears, to_nf4
from shardfit.parallel.env import init_distributed
from shardfit.plan import quant
from shardfit.strategy import get as get_strategy
from shardfit.train.recipe import train
from tests.helpers import read_jsonl, run_cli, run_here, write_config

needs_torchao = pytest.mark.skipif(importlib.util.find_spec("torchao") is None,
                                   reason="torchao is not installed (pip install -c constraints.txt torchao==0.18.0)")
ENV = {"OMP_NUM_THREADS": "1"}
# The seed case's recommended QLoRA config (`shardfit plan --model Qwen/Qwen2-VL-72B-Instruct --gpus 8x24GB --method
# qlora`: zero3, whole-block checkpointing), shrunk to a tiny Qwen2 and fp32 (what auto picks on this CPU).
BASE = dict(method="qlora", precision="fp32", max_seq_len=128, micro_batch=2, lr=1e-2, log_steps=1, save_steps=3,
            max_steps=6, eval_steps=100, grad_ckpt="full", lora={"rank": 4, "alpha": 8}, warmup_ratio=0.0)


def _cfg(tmp: Path, model: Path, data: Path, name: str, **over: object) -> Path:
    keys = dict(BASE, model=str(model), data=str(data), output_dir=str(tmp / name))
    keys.update(over)
    return write_config(tmp / f"{name}.yaml", **keys)


def _losses(run: Path) -> list[float]:
    return [m["loss"] for m in read_jsonl(run / "metrics.jsonl") if "loss" in m]


@pytest.fixture(scope="module")
def single_qlora(tmp_path_factory: pytest.TempPathFactory, tiny_qwen2: Path, small_data: Path) -> Path:
    """The one-process reference: 6 steps of 2 rows x 2 accumulation steps (the global batch of 2 ranks)."""
    if importlib.util.find_spec("torchao") is None:
        pytest.skip("torchao is not installed")
    tmp = tmp_path_factory.mktemp("qlora-single")
    cfg = load_config(_cfg(tmp, tiny_qwen2, small_data, "single", grad_accum=2, strategy="single"))
    train(cfg, init_distributed(), quiet=True)
    return tmp / "single"


def test_qlora_config_section_and_its_rules() -> None:
    """The qlora keys load with --set; false double quantization is bad input naming the key; a 16-bit dequant dtype
    that is not the precision and a device-map split are errors before anything loads; a correct config is clean."""
    cfg = load_config(None, ["method=qlora", "qlora.compute_dtype=bf16", "precision=bf16"], check_files=False)
    assert cfg.qlora.quant_type == "nf4" and cfg.qlora.double_quant and cfg.qlora.compute_dtype == "bf16"
    assert qlora_rules(cfg, get_strategy("zero3")) == []
    with pytest.raises(UserError, match="'qlora.double_quant' is false"):
        load_config(None, ["method=qlora", "qlora.double_quant=false"], check_files=False)
    with pytest.raises(UserError, match="'qlora.quant_type' is 'fp4'"):
        load_config(None, ["qlora.quant_type=fp4"], check_files=False)
    fp16 = dataclasses.replace(cfg, qlora=dataclasses.replace(cfg.qlora, compute_dtype="fp16"))
    assert [f.rule for f in qlora_rules(fp16, get_strategy("zero3"))] == ["qlora_compute_dtype_mismatch"]
    assert [f.rule for f in qlora_rules(cfg, get_strategy("model_parallel"))] == ["qlora_split_over_devices"]
    assert qlora_rules(dataclasses.replace(cfg, method="lora"), get_strategy("model_parallel")) == []


def test_qlora_without_torchao_is_refused(tmp_path: Path, tiny_llama: Path, small_data: Path,
                                          monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture) -> None:
    find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "torchao" else
                        find_spec(name, *a))
    assert main(["train", str(_cfg(tmp_path, tiny_llama, small_data, "no-ao"))]) == 2
    err = capsys.readouterr().err
    assert "needs torchao" in err and "torchao==0.18.0" in err and not (tmp_path / "no-ao").exists()


@needs_torchao
@pytest.mark.parametrize(("rows", "cols"), [(16, 32), (32, 64), (192, 576), (256, 256), (704, 256)])
def test_nf4_layout_is_what_torchao_stores_and_allocates(rows: int, cols: int) -> None:
    """plan/quant.py's bytes of an NF4 weight and of its dequantization are what torchao keeps and allocates (the
    dequantization measured with torch's MemTracker); the weight splits into 2, 4 and 8 row shards (192x576 is
    SmolLM2-135M's k_proj, whose 1,728 blocks torchao's default grouping of 256 scales cannot hold)."""
    w = to_nf4(torch.randn(rows, cols), torch.float32)
    assert nf4_storage_bytes(w) == quant.nf4_bytes(rows, cols, 4)
    for world in (2, 4, 8):
        assert quant.shard_problem(rows, cols, world) is None
        assert len(torch.chunk(w, world)) == world
    tracker = MemTracker()
    with tracker:
        dense = w.get_original_weight()
    peak = tracker.get_tracker_snapshot("peak")[torch.device("cpu")]["Total"]
    assert dense.shape == (rows, cols)
    # The scale expansion and the dequantized block scales are small next to the weight: within 2%.
    assert peak == pytest.approx(quant.dequantize_peak_bytes(rows * cols, 4), rel=0.02)
    assert quant.shard_problem(rows, cols, 5) is not None


@needs_torchao
def test_qlora_model_stores_decoder_weights_in_a_quarter(tiny_qwen2: Path) -> None:
    """build_model with method qlora: every linear of the decoder blocks is NF4 (about a quarter of its bf16
    bytes: 0.258 for real widths, a little more for these tiny ones, whose scale groups are small), exactly the
    planner's bytes; embeddings/norms/head stay dense, the adapters train in fp32; the meta build (check, simulate)
    has the same layout."""
    cfg = load_config(None, ["method=qlora", "precision=bf16", f"model={tiny_qwen2}"], check_files=False)
    model = build_model(cfg, "single", weights=True)
    layers = quantized_linears(model)
    assert len(layers) == 2 * 7
    nf4 = sum(nf4_storage_bytes(m.weight) for _, m in layers)
    bf16 = sum(m.weight.numel() * 2 for _, m in layers)
    assert 0.25 < nf4 / bf16 < 0.28
    assert nf4 == sum(quant.weight_bytes(*m.weight.shape, 2) for _, m in layers)
    assert not is_nf4(model.get_output_embeddings().weight) and model.get_output_embeddings().weight.dtype == \
        torch.bfloat16
    assert all(p.dtype == torch.float32 for p in model.parameters() if p.requires_grad)
    meta = build_model(cfg, "single", weights=False)
    for (name, m), (_, mm) in zip(layers, quantized_linears(meta), strict=True):
        names, _ = m.weight.__tensor_flatten__()
        assert mm.weight.is_meta and all(getattr(m.weight, n).shape == getattr(mm.weight, n).shape for n in names), name


@needs_torchao
def test_preflight_rules_for_4bit_weights(tiny_llama: Path) -> None:
    """Silent on a correct qlora zero3 model; the shard layout rule fires for a world size the weights do not split
    into; the fp32 unit fix leaves NF4 weights 4-bit (a cast would dequantize them); bitsandbytes storage in an FSDP
    unit is an error (FSDP2 shards its packed data without its quant_state)."""
    cfg = load_config(None, ["method=qlora", "precision=fp32", "qlora.compute_dtype=bf16", f"model={tiny_llama}"],
                      check_files=False)
    model = build_model(cfg, "zero3", weights=False)
    zero3 = get_strategy("zero3")
    assert {f.rule for f in fsdp_unit_rules(model, zero3, "fp32", fix=True)} <= {"fsdp_mixed_requires_grad"}
    assert all(is_nf4(m.weight) for _, m in quantized_linears(model)) and quantized_linears(model)
    assert qlora_shard_rules(model, zero3, 2) == []
    bad = qlora_shard_rules(model, zero3, 3)
    assert [f.rule for f in bad] == ["qlora_shard_layout"] and "3 shards" in bad[0].message
    assert qlora_shard_rules(model, get_strategy("ddp"), 3) == []
    bnb = pytest.importorskip("bitsandbytes", reason="bitsandbytes is not installed: its storage rule is not run")
    quantized = AutoModelForCausalLM.from_pretrained(tiny_llama, quantization_config=BitsAndBytesConfig(
        load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_compute_dtype=torch.float32))
    assert any(type(p).__module__.startswith(bnb.__name__) for p in quantized.parameters())
    rules = [f.rule for f in fsdp_unit_rules(quantized, zero3, "fp32", fix=False)]
    assert "fsdp_quantized_storage" in rules
    with pytest.raises(UserError, match="already quantized"):
        quantize_blocks(quantized, torch.float32)


@needs_torchao
def test_qlora_adapter_is_standard_and_merges_into_dequantized_weights(tmp_path: Path, tiny_qwen2: Path,
                                                                       single_qlora: Path,
                                                                       capsys: pytest.CaptureFixture) -> None:
    """The adapter loads onto the unquantized base with PeftModel.from_pretrained; `export --merge` writes a dense
    model whose logits are those of the 4-bit model with the adapter (what the run trained), in the chosen dtype;
    chat and eval load the run as it trained."""
    run = single_qlora
    summary = json.loads((run / "summary.json").read_text())
    assert summary["strategy"] == "single" and summary["steps"] == 6
    losses = _losses(run)
    assert len(losses) == 6 and losses[-1] < losses[0]
    base = AutoModelForCausalLM.from_pretrained(tiny_qwen2, dtype=torch.float32)
    peft = PeftModel.from_pretrained(base, str(run / "adapter")).eval()
    assert peft.peft_config["default"].r == 4
    assert run_here(capsys, "export", str(run), "--merge", "--dtype", "fp32", "--out", str(tmp_path / "m32"))[0] == 0
    code, _, err = run_here(capsys, "export", str(run), "--merge", "--out", str(tmp_path / "m16"))
    assert code == 0, err[-2000:]
    merged16 = AutoModelForCausalLM.from_pretrained(tmp_path / "m16")
    assert merged16.dtype == torch.bfloat16 and not quantized_linears(merged16)
    cfg = load_config(run / "config.yaml", check_files=False)
    trained = build_model(cfg, "single", weights=True)
    set_peft_model_state_dict(trained, load_file(str(run / "adapter" / "adapter_model.safetensors")))
    merged = AutoModelForCausalLM.from_pretrained(tmp_path / "m32", dtype=torch.float32).eval()
    ids = torch.randint(0, 1000, (1, 24))
    with torch.no_grad():
        want = trained.eval()(input_ids=ids).logits
        torch.testing.assert_close(merged(input_ids=ids).logits, want, rtol=1e-4, atol=1e-4)
        # The unquantized base with the adapter computes something else: the merge is into the 4-bit weights.
        assert not torch.allclose(peft(input_ids=ids).logits, want, atol=1e-4)
        # `shardfit chat|eval RUN_DIR` apply the adapter to the same dequantized 4-bit weights.
        loaded = load_for_inference(resolve_target(str(run)), device=torch.device("cpu"), precision="fp32", show=False)
        torch.testing.assert_close(loaded.model(input_ids=ids).logits, want, rtol=1e-4, atol=1e-4)


@needs_torchao
@pytest.mark.slow
def test_seed_case_stand_in_trains_qlora_zero3_on_two_ranks(tmp_path: Path, tiny_qwen2: Path, small_data: Path,
                                                            single_qlora: Path, capsys: pytest.CaptureFixture) -> None:
    """The seed case's recommended config (qlora + zero3, checkpointed blocks) on a tiny untied Qwen2 over 2 gloo
    ranks: the losses and the adapter are those of one process with the same global batch (the 4-bit weights are
    the same on both sides; only reduction order differs), and a DCP checkpoint resumes on one process."""
    cfg = _cfg(tmp_path, tiny_qwen2, small_data, "z3", strategy="zero3")
    r = run_cli("train", str(cfg), "--nproc", "2", env=ENV)
    assert r.returncode == 0, r.stderr[-3000:]
    run = tmp_path / "z3"
    ref, got = _losses(single_qlora), _losses(run)
    assert len(got) == len(ref) == 6
    for a, b in zip(ref, got, strict=True):
        assert b == pytest.approx(a, rel=1e-4)
    summary = json.loads((run / "summary.json").read_text())
    assert summary["world_size"] == 2 and summary["strategy"] == "zero3"
    preflight = json.loads((run / "preflight.json").read_text())
    assert preflight["ok"] and not [f for f in preflight["findings"] if f["severity"] != "info"]
    want = load_file(str(single_qlora / "adapter" / "adapter_model.safetensors"))
    two_rank = load_file(str(run / "adapter" / "adapter_model.safetensors"))
    assert want.keys() == two_rank.keys()
    for k in want:
        torch.testing.assert_close(two_rank[k], want[k], rtol=1e-3, atol=1e-5)
    shutil.rmtree(run / "checkpoints" / "step-6")
    shutil.rmtree(run / "adapter")
    # One process launches nothing: it resumes in this one (the CLI's `main`), without a new interpreter's start-up.
    code, _, err = run_here(capsys, "train", str(cfg), "--set", "grad_accum=2")
    assert code == 0, err[-3000:]
    assert json.loads((run / "summary.json").read_text())["resumed_from_step"] == 3
    resumed = load_file(str(run / "adapter" / "adapter_model.safetensors"))
    for k in two_rank:
        torch.testing.assert_close(resumed[k], two_rank[k], rtol=1e-3, atol=1e-5)
