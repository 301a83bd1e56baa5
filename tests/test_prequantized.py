"""Checkpoints published already quantized: gpt-oss's MXFP4 experts and block-wise FP8 load dequantized to the
training dtype with the values the format encodes, train, export a plain model, and `check` says what loading does;
formats training cannot start from (GPTQ, bitsandbytes) are refused before any weight is read."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM

from shardfit.config import load_config
from shardfit.models import prequantized
from shardfit.models.build import build_model
from tests.families import make_family_model
from tests.helpers import run_cli, run_here, write_config

# The 16 values of an FP4 (e2m1) code, in code order: the MXFP4 format's definition (OCP MX spec).
FP4 = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0])


def _set_quantization(folder: Path, settings: dict) -> None:
    path = folder / "config.json"
    config = json.loads(path.read_text())
    config["quantization_config"] = settings
    path.write_text(json.dumps(config))


def write_mxfp4(folder: Path) -> dict[str, torch.Tensor]:
    """Rewrite a saved gpt-oss's fused experts as an MXFP4 checkpoint does: per output row, groups of 32 inputs of
    4-bit codes (two per byte, low nibble first) and one power-of-two scale per group (exponent + 127). The values
    are drawn as codes, so the expected weights are exact; returns them as the model holds them ([experts, in,
    out])."""
    weights = load_file(str(folder / "model.safetensors"))
    expected = {}
    gen = torch.Generator().manual_seed(1)
    for name in [k for k in weights if k.endswith(("experts.gate_up_proj", "experts.down_proj"))]:
        experts, inputs, outputs = weights.pop(name).shape
        codes = torch.randint(0, 16, (experts, outputs, inputs // 32, 32), generator=gen)
        exponents = torch.randint(-4, 1, (experts, outputs, inputs // 32), generator=gen)
        values = FP4[codes] * torch.pow(2.0, exponents.float())[..., None]
        expected[name] = values.reshape(experts, outputs, inputs).transpose(1, 2)
        weights[f"{name}_blocks"] = (codes[..., 0::2] | (codes[..., 1::2] << 4)).to(torch.uint8)
        weights[f"{name}_scales"] = (exponents + 127).to(torch.uint8)
    save_file(weights, str(folder / "model.safetensors"), metadata={"format": "pt"})
    _set_quantization(folder, {"quant_method": "mxfp4", "modules_to_not_convert": [
        "model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"]})
    return expected


def write_fp8(folder: Path) -> dict[str, torch.Tensor]:
    """Rewrite every projection of a saved model as a block-wise FP8 checkpoint does (e4m3 values, one inverse
    scale per 128 x 128 block); returns the values it encodes by name."""
    weights = load_file(str(folder / "model.safetensors"))
    expected = {}
    for name in [k for k in weights if k.endswith("proj.weight")]:
        rows, cols = weights[name].shape
        stored = (weights[name] * 64).to(torch.float8_e4m3fn)
        expected[name] = stored.float() / 64
        weights[name] = stored
        weights[name.removesuffix("weight") + "weight_scale_inv"] = torch.full(
            ((rows + 127) // 128, (cols + 127) // 128), 1 / 64)
    save_file(weights, str(folder / "model.safetensors"), metadata={"format": "pt"})
    _set_quantization(folder, {"quant_method": "fp8", "weight_block_size": [128, 128], "activation_scheme": "dynamic"})
    return expected


def _cfg(tmp: Path, model: Path, **over) -> Path:
    data = tmp / "d.jsonl"
    data.write_text("".join(json.dumps({"instruction": f"say {i}", "output": f"number {i} is here"}) + "\n"
                            for i in range(8)))
    return write_config(tmp / "c.yaml", **{**dict(model=str(model), data=str(data), precision="fp32", max_seq_len=64,
                                                  micro_batch=2, max_steps=2, log_steps=1, save_steps=100,
                                                  eval_steps=100, lora={"rank": 4, "alpha": 8}, warmup_ratio=0.0,
                                                  resume="never", output_dir=str(tmp / "run")), **over})


def test_mxfp4_experts_load_as_the_values_the_format_encodes(tmp_path: Path, tokenizer_dir: Path) -> None:
    folder = make_family_model("gpt-oss", tmp_path / "gpt-oss", tokenizer_dir)
    expected = write_mxfp4(folder)
    model = build_model(load_config(_cfg(tmp_path, folder, method="full")), "single", weights=True)
    for name, values in expected.items():
        got = model.get_parameter(name)
        assert got.dtype == torch.float32 and torch.equal(got, values), name
    assert getattr(model, prequantized.FLAG).method == "mxfp4"
    assert not hasattr(model.config, "quantization_config")  # a merged or saved model is a plain one


def test_fp8_weights_load_as_the_values_the_format_encodes(tmp_path: Path, tokenizer_dir: Path) -> None:
    folder = make_family_model("Qwen3-MoE", tmp_path / "qwen3moe", tokenizer_dir)
    expected = write_fp8(folder)
    model = build_model(load_config(_cfg(tmp_path, folder, method="full")), "single", weights=True)
    state = model.state_dict()
    for layer in range(model.config.num_hidden_layers):
        experts = model.model.layers[layer].mlp.experts
        for e in range(experts.gate_up_proj.shape[0]):
            p = f"model.layers.{layer}.mlp.experts.{e}."
            assert torch.equal(experts.gate_up_proj[e], torch.cat([expected[p + "gate_proj.weight"],
                                                                  expected[p + "up_proj.weight"]]))
            assert torch.equal(experts.down_proj[e], expected[p + "down_proj.weight"])
    attention = "model.layers.0.self_attn.q_proj.weight"
    assert torch.equal(state[attention], expected[attention])


def test_dequantization_is_asked_for_whatever_the_device() -> None:
    """transformers keeps MXFP4 / FP8 where the GPU has kernels for them; shardfit always asks it to dequantize."""
    class Config:
        quantization_config = {"quant_method": "mxfp4"}

    kwargs = prequantized.load_kwargs(Config(), "m")
    assert type(kwargs["quantization_config"]).__name__ == "Mxfp4Config" and kwargs["quantization_config"].dequantize
    Config.quantization_config = {"quant_method": "fp8", "weight_block_size": [128, 128]}
    assert prequantized.load_kwargs(Config(), "m")["quantization_config"].dequantize
    Config.quantization_config = {"quant_method": "gguf"}
    assert prequantized.load_kwargs(Config(), "m") == {}


@pytest.mark.slow
def test_an_mxfp4_gpt_oss_trains_checks_and_exports_a_plain_model(tmp_path: Path, tokenizer_dir: Path,
                                                                   capsys: pytest.CaptureFixture) -> None:
    folder = make_family_model("gpt-oss", tmp_path / "gpt-oss", tokenizer_dir)
    write_mxfp4(folder)
    cfg = _cfg(tmp_path, folder, method="lora", lr=1e-2)
    code, out, err = run_here(capsys, "check", str(cfg), "--json")
    assert code == 0, err[-2000:]
    found = {f["rule"]: f for f in json.loads(out)["findings"]}
    assert "dequantizes them to fp32" in found["prequantized_checkpoint"]["message"]
    r = run_cli("train", str(cfg), env={"OMP_NUM_THREADS": "2"})
    assert r.returncode == 0, r.stderr[-3000:]
    assert "MXFP4 experts dequantized to fp32" in r.stderr
    r = run_cli("export", str(tmp_path / "run"), "--merge", "--out", str(tmp_path / "merged"))
    assert r.returncode == 0, r.stderr[-2000:]
    assert "quantization_config" not in json.loads((tmp_path / "merged" / "config.json").read_text())
    merged = AutoModelForCausalLM.from_pretrained(tmp_path / "merged")
    assert merged.generate(torch.tensor([[1, 2, 3]]), max_new_tokens=2, do_sample=False).shape[1] == 5


@pytest.mark.parametrize("settings,name", [({"quant_method": "gptq", "bits": 4}, "gptq"),
                                           pytest.param({"load_in_4bit": True, "quant_method": "bitsandbytes"},
                                                        "bitsandbytes", marks=pytest.mark.heavy)])
def test_formats_training_cannot_start_from_are_refused_before_loading(tmp_path: Path, tokenizer_dir: Path,
                                                                       settings: dict, name: str,
                                                                       capsys: pytest.CaptureFixture) -> None:
    folder = make_family_model("Qwen3 (dense)", tmp_path / "m", tokenizer_dir)
    (folder / "model.safetensors").write_bytes(b"not weights: the refusal must come before they are read")
    _set_quantization(folder, settings)
    cfg = _cfg(tmp_path, folder, method="lora")
    checked = run_here(capsys, "check", str(cfg))
    trained = run_cli("train", str(cfg))
    for command, code, err in (("check", checked[0], checked[2]), ("train", trained.returncode, trained.stderr)):
        assert code == 2, (command, err[-2000:])
        assert f"{name}-quantized checkpoint" in err and "unquantized base" in err, err[-2000:]
        assert "Traceback" not in err and "unexpected" not in err
