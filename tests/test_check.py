"""`shardfit check` and the preflight inside `train`: each rule fires on a setup that has the problem, and stays
silent on a correct one."""

from __future__ import annotations

import json
import shutil
import textwrap
from pathlib import Path

import pytest
import torch
from torch import nn
from transformers import AutoModelForCausalLM, Qwen2_5OmniForConditionalGeneration

from shardfit.check import rules
from shardfit.check.config_rules import device_map_rules
from shardfit.check.findings import is_ok
from shardfit.check.run import check_config
from shardfit.cli.main import main
from shardfit.config import load_config
from shardfit.config.schema import LoraSettings
from shardfit.models.adapters import apply_lora
from shardfit.models.checkpointing import enable_checkpointing
from shardfit.parallel.env import init_distributed
from shardfit.plan.hardware import parse_gpus
from shardfit.plan.plan import make_plan
from shardfit.plan.shapes import resolve_shape
from shardfit.plan.workload import Workload
from shardfit.strategy import get as S
from shardfit.train.recipe import train
from tests.helpers import ROOT, run_cli, run_here, tiny_omni_config, write_config


def _cfg(tmp_path: Path, model: Path, data: Path, **over):
    keys = dict(model=str(model), data=str(data), max_seq_len=128, micro_batch=2, max_steps=2, precision="fp32",
                output_dir=str(tmp_path / "run"))
    keys.update(over)
    return load_config(write_config(tmp_path / "c.yaml", **keys))


def _rules(findings) -> set[str]:
    return {f.rule for f in findings}


def _llama(tiny_llama: Path) -> nn.Module:
    return AutoModelForCausalLM.from_pretrained(tiny_llama, dtype=torch.float32)


def test_device_map_rules(tmp_path: Path, tiny_llama: Path, small_data: Path) -> None:
    cfg = _cfg(tmp_path, tiny_llama, small_data, device_map="auto")
    found = device_map_rules(cfg, S("zero3"), 2)
    assert _rules(found) == {"device_map_in_distributed", "device_map_with_zero3"}
    assert all(f.auto_fixed for f in found)  # ignored with a warning
    strict = _cfg(tmp_path, tiny_llama, small_data, device_map="auto", strict=True)
    assert not is_ok(device_map_rules(strict, S("ddp"), 2))
    assert device_map_rules(_cfg(tmp_path, tiny_llama, small_data), S("zero3"), 2) == []
    assert device_map_rules(cfg, S("model_parallel"), 1) == []


def test_unused_generation_modules_dropped_and_trainable_towers_frozen(tiny_llama: Path) -> None:
    model = _llama(tiny_llama)
    assert rules.unused_module_rules(model, S("zero3"), fix=True) == []  # silent on a plain causal LM
    model.talker = nn.Linear(8, 8)  # Qwen-Omni style speech head, kept on the CPU
    model.visual = nn.Linear(8, 8)  # a vision tower the text forward never runs
    found = rules.unused_module_rules(model, S("ddp"), fix=False)
    by_where = {f.where: f for f in found}
    assert by_where["talker"].fix == "drop_modules: [talker]" and "cuda:0 and cpu" in by_where["talker"].message
    assert by_where["visual"].severity == "error"  # trainable and unused under DDP
    found = rules.unused_module_rules(model, S("ddp"), fix=True)
    assert model.talker is None and not model.visual.weight.requires_grad
    assert all(f.auto_fixed for f in found) and is_ok(found)


def test_fsdp_unit_rules(tiny_llama: Path) -> None:
    model = _llama(tiny_llama)
    assert rules.fsdp_unit_rules(model, S("zero3"), "fp32", fix=False) == []  # tied embed/head both in the root unit
    assert rules.fsdp_unit_rules(model, S("ddp"), "fp32", fix=False) == []
    model.model.layers[0].mlp.down_proj.weight.data = model.model.layers[0].mlp.down_proj.weight.data.bfloat16()
    found = rules.fsdp_unit_rules(model, S("zero3"), "fp32", fix=True)
    assert "fsdp_mixed_dtype" in _rules(found) and is_ok(found)
    assert model.model.layers[0].mlp.down_proj.weight.dtype == torch.float32
    model.model.layers[1].register_parameter("qweight", nn.Parameter(torch.zeros(4, dtype=torch.uint8),
                                                                     requires_grad=False))
    model.model.layers[0].self_attn.o_proj.weight = model.model.embed_tokens.weight  # a tie across units
    found = rules.fsdp_unit_rules(model, S("zero3"), "bf16", fix=False)
    assert {"fsdp_quantized_storage", "fsdp_tied_weights_split"} <= _rules(found) and not is_ok(found)


def test_precision_rule(tmp_path: Path, tiny_llama: Path, small_data: Path) -> None:
    model = _llama(tiny_llama)
    cfg16 = _cfg(tmp_path, tiny_llama, small_data, precision="fp16", method="full")
    assert rules.precision_rules(model, cfg16, fix=True) == []
    model.lm_head.weight.data = model.lm_head.weight.data.half()
    found = rules.precision_rules(model, cfg16, fix=True)
    assert _rules(found) == {"fp16_trainable_weights"} and found[0].auto_fixed
    assert model.lm_head.weight.dtype == torch.float32


def test_plan_rule() -> None:
    big = make_plan(resolve_shape("Qwen/Qwen2-VL-72B-Instruct"), Workload(), parse_gpus("8x24GB"))
    found = rules.plan_rules(big, S("ddp"), force=False)
    assert found[0].rule == "predicted_oom" and "full replica" in found[0].message and not is_ok(found)
    small = make_plan(resolve_shape("HuggingFaceTB/SmolLM2-135M-Instruct"), Workload(), parse_gpus("1x24GB"))
    assert rules.plan_rules(small, S("single"), force=False) == []


def test_several_gpus_rule(monkeypatch) -> None:
    assert rules.visible_gpu_rules(S("single"), 1) == [] or torch.cuda.device_count() > 1
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 4)
    assert _rules(rules.visible_gpu_rules(S("single"), 1)) == {"several_gpus_one_process"}
    assert rules.visible_gpu_rules(S("model_parallel"), 1) == [] and rules.visible_gpu_rules(S("ddp"), 4) == []


REMOTE_CONFIG = '''
from transformers import LlamaConfig


class {name}Config(LlamaConfig):
    model_type = "{mtype}"
'''

REMOTE_MODEL = '''
import torch
from transformers import LlamaForCausalLM
from transformers.models.llama.modeling_llama import LlamaModel

from .configuration_{mtype} import {name}Config


class {name}ForCausalLM(LlamaForCausalLM):
    config_class = {name}Config
{body}
'''

OLD_GC = '''
    supports_gradient_checkpointing = True

    def _set_gradient_checkpointing(self, module, value=False):
        if isinstance(module, LlamaModel):
            module.gradient_checkpointing = value
'''

CPU_ROPE = '''
    def __init__(self, config):
        super().__init__(config)
        # Remote code that builds its rotary cache explicitly on the CPU (as old ChatGLM/InternLM code did).
        self.register_buffer("rope_cache", torch.ones(64, device="cpu"), persistent=False)
'''


def _remote_model(tmp_path: Path, tiny_llama: Path, name: str, body: str) -> Path:
    out = tmp_path / name.lower()
    shutil.copytree(tiny_llama, out)
    mtype = name.lower()
    (out / f"configuration_{mtype}.py").write_text(textwrap.dedent(REMOTE_CONFIG.format(name=name, mtype=mtype)))
    (out / f"modeling_{mtype}.py").write_text(REMOTE_MODEL.format(name=name, mtype=mtype, body=body))
    config = json.loads((out / "config.json").read_text())
    config.update(model_type=mtype, architectures=[f"{name}ForCausalLM"],
                  auto_map={"AutoConfig": f"configuration_{mtype}.{name}Config",
                            "AutoModelForCausalLM": f"modeling_{mtype}.{name}ForCausalLM"})
    (out / "config.json").write_text(json.dumps(config))
    return out


@pytest.mark.parametrize("grad_ckpt", ["full", "selective"])
def test_old_gradient_checkpointing_api_is_detected_and_still_trains(tmp_path: Path, tiny_llama: Path,
                                                                     small_data: Path, grad_ckpt: str) -> None:
    old = _remote_model(tmp_path, tiny_llama, "OldGc", OLD_GC)
    cfg = _cfg(tmp_path, old, small_data, grad_ckpt=grad_ckpt, trust_remote_code=True, method="full", lr=1e-3)
    _, found = check_config(cfg, 1)
    assert "gc_remote_code_old_api" in _rules(found)
    _, clean = check_config(_cfg(tmp_path, tiny_llama, small_data, grad_ckpt="full"), 1)
    assert "gc_remote_code_old_api" not in _rules(clean)

    result = train(cfg, init_distributed(), quiet=True)
    assert result.summary["steps"] == 2 and result.summary["train_loss"] is not None
    # The blocks really are checkpointed (torch's wrapper, since the model's own API is the old one).
    assert any("CheckpointWrapper" in type(m).__name__ for m in result.model.modules())


def test_cpu_created_buffer_is_found(tmp_path: Path, tiny_llama: Path, small_data: Path) -> None:
    rope = _remote_model(tmp_path, tiny_llama, "CpuRope", CPU_ROPE)
    _, found = check_config(_cfg(tmp_path, rope, small_data, trust_remote_code=True, strategy="zero3"), 2)
    hits = [f for f in found if f.rule == "buffer_on_wrong_device"]
    assert hits and "rope_cache" in hits[0].where
    _, clean = check_config(_cfg(tmp_path, tiny_llama, small_data, strategy="zero3"), 2)
    assert "buffer_on_wrong_device" not in _rules(clean)


def test_train_refuses_unfixable_error(tmp_path: Path, tiny_llama: Path, small_data: Path,
                                      capsys: pytest.CaptureFixture) -> None:
    cfg = write_config(tmp_path / "c.yaml", model=str(tiny_llama), data=str(small_data), device_map="auto",
                       strict=True, strategy="ddp", max_steps=1, output_dir=str(tmp_path / "run"))
    code, printed, _ = run_here(capsys, "check", str(cfg), "--nproc", "2", "--json")
    out = json.loads(printed)
    assert code == 1 and out["ok"] is False
    assert {"rule", "severity", "where", "message", "fix", "auto_fixed"} == set(out["findings"][0])


def test_check_demo_config_is_clean(capsys: pytest.CaptureFixture) -> None:
    code, printed, err = run_here(capsys, "check", str(ROOT / "src" / "shardfit" / "demo" / "demo.yaml"), "--json")
    assert code == 0, err[-2000:]
    out = json.loads(printed)
    assert out["ok"] is True
    assert [f for f in out["findings"] if f["severity"] != "info"] == []


@pytest.mark.parametrize("bad", ["missing.yaml"])
def test_check_bad_input_exit_2(tmp_path: Path, bad: str, capsys: pytest.CaptureFixture) -> None:
    code, _, err = run_here(capsys, "check", str(tmp_path / bad))
    assert code == 2 and "Traceback" not in err


def test_check_72b_under_ddp_on_8x24gb_from_the_catalog(tmp_path: Path, small_data: Path,
                                                        capsys: pytest.CaptureFixture) -> None:
    """The seed failure: a 72B LoRA under DDP on eight 24 GB cards. No download: the shape is the catalog's. The
    three checks run in this process (the CLI's own `main`, no start-up each): test_readme.py runs the same check
    of examples/qwen72b-ddp.yaml as a user's `shardfit` command."""
    cfg = write_config(tmp_path / "c.yaml", model="Qwen/Qwen2-VL-72B-Instruct", data=str(small_data),
                       method="lora", strategy="ddp", max_seq_len=2048, micro_batch=1, output_dir=str(tmp_path / "r"))

    def check(*flags: str) -> tuple[int, dict]:
        capsys.readouterr()
        code = main(["check", str(cfg), "--gpus", "8x24GB", *flags, "--json"])
        return code, next(f for f in json.loads(capsys.readouterr().out)["findings"] if f["rule"] == "predicted_oom")

    code, oom = check()
    assert code == 1
    assert oom["severity"] == "error" and "full replica per GPU" in oom["message"]
    assert "GiB per GPU" in oom["fix"]  # names a change that fits, with its predicted memory
    # The fix is an override check and train accept (not a plan-only flag), and with it the memory rule passes.
    # The fastest predicted fit: zero3_offload keeps all eight GPUs computing (~600 tokens/s on 4090s), where
    # model_parallel computes on one at a time (~270 tokens/s); tests/test_plan_timing.py checks the numbers.
    assert "--set grad_ckpt=full" in oom["fix"] and "zero3_offload at" in oom["fix"]
    assert "--grad-ckpt" not in oom["fix"]
    assert check("--set", "grad_ckpt=full")[1]["fix"] == "--set strategy=zero3_offload"
    capsys.readouterr()
    main(["check", str(cfg), "--gpus", "8x24GB", "--set", "strategy=model_parallel", "--set", "grad_ckpt=full",
          "--json"])
    out = capsys.readouterr().out
    assert "predicted_oom" not in {f["rule"] for f in json.loads(out)["findings"]}, out


def test_check_unknown_hub_id_is_bad_input(tmp_path: Path, small_data: Path) -> None:
    cfg = write_config(tmp_path / "c.yaml", model="nobody/not-a-model", data=str(small_data))
    r = run_cli("check", str(cfg), timeout=120, env={"HF_HUB_OFFLINE": "1"})
    assert r.returncode == 2 and "Traceback" not in r.stderr
    assert "nobody/not-a-model" in r.stderr and "catalog" in r.stderr


@pytest.mark.parametrize("strategy", ["ddp", "single"])
def test_reentrant_checkpointing_rules(tiny_llama: Path, strategy: str) -> None:
    model = apply_lora(_llama(tiny_llama), LoraSettings(rank=4, alpha=8))
    # Older transformers (and many training scripts) turn on reentrant checkpointing.
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": True})
    # Recent transformers add an input-grad hook for PEFT models here; older ones and hand-rolled loops do not.
    model.disable_input_require_grads()
    found = {f.rule for f in rules.reentrant_ckpt_rules(model, S(strategy), fix=False)}
    assert found == ({"gc_ddp_reentrant", "gc_inputs_no_grad"} if strategy == "ddp" else {"gc_inputs_no_grad"})
    fixed = rules.reentrant_ckpt_rules(model, S(strategy), fix=True)
    assert fixed and all(f.auto_fixed for f in fixed) and is_ok(fixed)
    assert rules.reentrant_ckpt_rules(model, S(strategy), fix=False) == []  # non-reentrant now: silent
    # And the adapters really get gradients after the fix (the failure it prevents is silent: no error, no grads).
    model.train()
    ids = torch.randint(0, 1000, (2, 16))
    model(input_ids=ids, labels=ids).loss.backward()
    lora = [p for n, p in model.named_parameters() if "lora_B" in n]
    assert lora and all(p.grad is not None for p in lora)


def test_reentrant_rules_silent_on_shardfit_checkpointing(tiny_llama: Path) -> None:
    model = apply_lora(_llama(tiny_llama), LoraSettings(rank=4, alpha=8))
    enable_checkpointing(model)
    assert rules.reentrant_ckpt_rules(model, S("ddp"), fix=False) == []


def test_quantized_model_placement_rule(tiny_llama: Path) -> None:
    """Read from the same metadata transformers sets on a bitsandbytes model (is_loaded_in_4bit, hf_device_map) and
    accelerate checks; no GPU or bitsandbytes needed to exercise the rule itself."""
    model = _llama(tiny_llama)
    cpu = torch.device("cpu")
    assert rules.quantized_placement_rules(model, cpu, 2) == []  # not quantized: silent
    model.is_loaded_in_4bit = True
    model.hf_device_map = {"model.embed_tokens": 0, "model.layers.0": 0, "model.layers.1": 1, "lm_head": 1}
    (spread,) = rules.quantized_placement_rules(model, torch.device("cuda", 0), 2)
    assert spread.rule == "quantized_model_device" and "cuda:0, cuda:1" in spread.message
    assert "LOCAL_RANK" in spread.fix
    model.hf_device_map = {"": 0}
    (other,) = rules.quantized_placement_rules(model, torch.device("cuda", 1), 2)  # rank 1 got rank 0's GPU
    assert "loaded on cuda:0" in other.message and "cuda:1" in other.message
    assert rules.quantized_placement_rules(model, torch.device("cuda", 0), 2) == []  # its own GPU: silent


def test_qwen_omni_talker_kept_is_reported_not_a_device_error() -> None:
    """An Omni model built whole (as other tools load it): the speech modules are named for dropping."""
    model = Qwen2_5OmniForConditionalGeneration(tiny_omni_config())  # talker and token2wav kept, on the CPU
    found = {f.where: f for f in rules.unused_module_rules(model, S("zero3"), fix=False)}
    for name in ("talker", "token2wav"):
        assert found[name].fix == f"drop_modules: [{name}]"
        assert "would stay unplaced" in found[name].message and "cuda:0 and cpu" in found[name].message
    # The thinker's audio and vision towers are outside the text forward too.
    assert any(w.endswith("audio_tower") for w in found) and any(w.endswith("visual") for w in found)
    fixed = rules.unused_module_rules(model, S("zero3"), fix=True)
    assert model.talker is None and model.token2wav is None and is_ok(fixed)


@pytest.mark.parametrize("drop", [[], ["talker", "token2wav"]])
def test_check_omni_under_ddp_gives_consistent_drop_advice(tmp_path: Path, tiny_omni: Path, small_data: Path,
                                                          drop: list[str]) -> None:
    """check builds the model as train does (talker and token2wav never built for text training): it never asks for
    a drop_modules entry the config already has, nor for the speech modules at all."""
    cfg = _cfg(tmp_path, tiny_omni, small_data, strategy="ddp", drop_modules=drop)
    job, found = check_config(cfg, 2)
    assert job.strategy == "ddp" and job.world == 2 and is_ok(found)
    assert not any("talker" in f.fix or "token2wav" in f.fix for f in found), [f.fix for f in found]
    towers = {f.where.rpartition(".")[2] for f in found if f.rule == "unused_module"}
    assert towers == {"audio_tower", "visual"}  # the thinker's towers: outside the text forward, frozen


def test_check_resolves_a_resumed_run_as_train_does(tmp_path: Path, tiny_llama: Path, small_data: Path,
                                                    capsys: pytest.CaptureFixture[str]) -> None:
    """A run directory recorded as zero3 with rows split over 2 ranks (one data-parallel rank, a global batch of
    2): `check --nproc 2` of the same config under auto shows the job `train` resumes it with (the recorded one:
    ddp over 2 data-parallel ranks would train 4 a step), with the reason, not the job of a fresh directory."""
    import yaml

    cfg = _cfg(tmp_path, tiny_llama, small_data)
    run = Path(cfg.output_dir)
    run.mkdir()
    from shardfit.train.rundir import fingerprint

    # This config's run (the keep rule keeps only that), recorded at a global batch of 2.
    (run / "run.json").write_text(json.dumps({"fingerprint": fingerprint(cfg, 2)}))
    (run / "config.yaml").write_text(yaml.safe_dump({**cfg.to_dict(), "strategy": "auto", "sequence_parallel": 2,
                                                     "pipeline_parallel": 1}))
    (run / "preflight.json").write_text(json.dumps({"strategy": "zero3", "ok": True, "findings": []}))
    main(["check", str(tmp_path / "c.yaml"), "--nproc", "2", "--json"])
    job = json.loads(capsys.readouterr().out)["resolved"]
    assert (job["strategy"], job["sequence_parallel"]) == ("zero3", 2)
    assert any(w.startswith("resumed as recorded: ") and "a global batch of 4 examples" in w for w in job["why"])
