"""Classes without SDPA (plan/sdpa_classes.py): the release table against the installed transformers' classes, and
the rank, the planner and the readers of other tools' jobs following it -- Gemma 2 (from 5.21) and gpt-oss load
eager attention when the job names none and refuse `sdpa`, so their plans count eager attention's fp32 scores."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import transformers
from transformers import AutoModelForCausalLM, Gemma2Config, GptOssConfig, PaliGemmaConfig
from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

from shardfit.errors import UserError
from shardfit.foreign.read import JobOptions, read_job
from shardfit.models.build import _attention, meta_model
from shardfit.plan.config_shape import shape_from_config
from shardfit.plan.hardware import parse_gpus
from shardfit.plan.plan import make_plan
from shardfit.plan.sdpa_classes import NO_SDPA, runs_eager, sdpa_refusal, without_sdpa
from shardfit.plan.shapes import resolve_shape
from shardfit.plan.workload import Workload
from shardfit.resolve.sequence import check_model, facts_of_config, facts_of_shape
from tests.helpers import run_here, write_config

TINY = dict(vocab_size=128, hidden_size=64, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, head_dim=16)


def test_the_table_is_the_installed_classes() -> None:
    """Every class AutoModelForCausalLM loads says `_supports_sdpa` False exactly where the table says its release
    has no SDPA: a transformers upgrade that adds or changes such a class fails here until the table follows."""
    wrong = {}
    for model_type, name in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.items():
        cls = getattr(transformers, name[0] if isinstance(name, (list, tuple)) else name)
        has = cls._supports_sdpa is not False
        if has is (without_sdpa(model_type) is not None):
            wrong[model_type] = f"{cls.__name__}._supports_sdpa is {cls._supports_sdpa}"
    assert not wrong, wrong
    assert {"gemma2", "gpt_oss", "vaultgemma", "gpt_neo"} <= {t for t in NO_SDPA if without_sdpa(t)}


@pytest.mark.parametrize(("model_type", "version", "eager"), [
    ("gemma2", "4.44.2", False), ("gemma2", "5.20.2", False), ("gemma2", "5.21.0", True), ("gemma2", "5.23.0", True),
    ("gpt_oss", "4.55.0", True), ("gpt_oss", "5.23.0", True), ("got_ocr2", "4.53.3", False),
    ("got_ocr2", "4.54.0", True), ("zamba", "5.9.0", True), ("zamba", "5.10.1", False), ("llama", "4.35.2", True),
    ("llama", "5.23.0", False), ("mistral", "4.36.2", True), ("mistral", "4.37.0", False),
    ("mega", "4.45.2", True), ("xlm-prophetnet", "4.42.0", True), ("transfo-xl", "4.40.0", True),
])
def test_each_release_says_whether_the_class_has_sdpa(model_type: str, version: str, eager: bool) -> None:
    """Deprecated classes (mega, qdqbert, ...) never set _supports_sdpa: moving them to models/deprecated/ gave them
    none."""
    assert runs_eager(model_type, "auto", version) is eager
    assert runs_eager(model_type, "sdpa", version) is (eager and (model_type != "llama" or version >= "4.36"))
    assert not runs_eager(model_type, "flash_attention_2", version) and not runs_eager(model_type, "eager", version)


def test_sdpa_named_before_4_36_is_a_tools_own_patch(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    """Below 4.36 transformers attends eagerly in every class, but a job that names SDPA there runs its tool's own
    patch (axolotl's `sdp_attention` on Llama): planned SDPA, not eager, where the class table holds no entry."""
    assert runs_eager("llama", "auto", "4.35.2") and not runs_eager("llama", "sdpa", "4.35.2")
    assert runs_eager("gptj", "sdpa", "4.35.2")
    path = tmp_path / "ax.yml"
    path.write_text("base_model: meta-llama/Llama-2-7b-hf\nadapter: lora\nsequence_len: 8192\nbf16: true\n"
                    "lora_target_linear: true\nsdp_attention: true\nmicro_batch_size: 1\n")
    code, out, err = run_here(capsys, "plan", "--from", "axolotl", str(path), "--gpus", "1xH200",
                              "--transformers", "4.35.2", "--json")
    assert code in (0, 3), err
    plan = json.loads(out)
    assert plan["workload"]["attention"] == "sdpa", plan["workload"]
    assert not any("no SDPA" in n for n in plan.get("notes", [])), plan.get("notes")


def test_the_refusal_says_the_class_has_no_sdpa_attention() -> None:
    """Most such classes inherit PreTrainedModel's default rather than set the flag themselves."""
    said = sdpa_refusal("gpt_oss", "'attn_implementation: sdpa'", "eager", "5.23.0")
    assert said is not None and "gpt_oss model's class has no SDPA attention (transformers 5.23)" in said
    assert "_supports_sdpa" not in said


@pytest.mark.parametrize(("config_class", "extra"), [
    (Gemma2Config, {}), (GptOssConfig, {"num_local_experts": 4, "num_experts_per_tok": 2}),
])
def test_the_rank_loads_them_eager_and_refuses_sdpa(config_class: type, extra: dict) -> None:
    """models/build.py: a tiny Gemma 2 and gpt-oss, built on the meta device and with real weights, load eager
    attention for `auto`; `sdpa` is refused naming the eager setting, before transformers' ValueError."""
    config = config_class(**TINY, **extra)
    auto = SimpleNamespace(model="m", trust_remote_code=False, attn_implementation="auto")
    assert meta_model(config, torch.bfloat16, auto).config._attn_implementation == "eager"
    real = AutoModelForCausalLM.from_config(config, **_attention(auto, config))
    assert real.config._attn_implementation == "eager"
    with pytest.raises(UserError, match="attn_implementation: eager"):
        _attention(SimpleNamespace(attn_implementation="sdpa"), config)
    with pytest.raises(ValueError):  # what the rank would meet without the refusal
        AutoModelForCausalLM.from_config(config, attn_implementation="sdpa")


@pytest.mark.parametrize("model", ["openai/gpt-oss-20b", "google/gemma-2-9b"])
def test_the_planner_plans_them_eager(model: str) -> None:
    """`auto` (the planner's `sdpa`) is planned as eager attention, whose fp32 scores grow with the row: at 8k
    tokens without checkpointing far more activation memory than the SDPA plan the planner made before."""
    shape = resolve_shape(model)
    assert shape.eager_only
    w = Workload(method="lora", seq_len=8192, attention="sdpa", grad_ckpt="none")
    hw = parse_gpus("8xH200")
    planned = make_plan(shape, w, hw, ("single",))
    as_sdpa = make_plan(dataclasses.replace(shape, eager_only=False), w, hw, ("single",))
    assert planned.workload.attention == "eager" and any("has no SDPA" in n for n in planned.notes)
    eager, sdpa = planned.candidates[0].per_gpu_gib, as_sdpa.candidates[0].per_gpu_gib
    assert eager.activations > 2 * sdpa.activations


def test_plan_simulates_them_eager(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    """`plan --simulate` measures the attention the rank runs: eager for a class without SDPA, as the analytic
    rows plan it (it used to build the model with sdpa and stop on the refusal a config naming sdpa gets)."""
    Gemma2Config(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, head_dim=16, sliding_window=16).save_pretrained(tmp_path)
    code, printed, err = run_here(capsys, "plan", "--model", str(tmp_path), "--gpus", "1x24GB", "--method", "lora",
                                  "--seq", "64", "--batch", "1", "--strategy", "single", "--simulate", "--json")
    assert code == 0, err[-2000:]
    out = json.loads(printed)
    assert out["workload"]["attention"] == "eager" and out["candidates"][0]["estimator"] == "simulated"


@pytest.mark.parametrize("model", ["openai/gpt-oss-20b", "google/gemma-2-9b"])
def test_a_config_naming_sdpa_exits_2_with_the_fix(tmp_path: Path, capsys: pytest.CaptureFixture,
                                                   model: str) -> None:
    cfg = write_config(tmp_path / "c.yaml", model=model, data=str(tmp_path / "d.jsonl"), method="lora",
                       attn_implementation="sdpa")
    code, _, err = run_here(capsys, "plan", str(cfg), "--gpus", "1xH200")
    assert code == 2, err
    assert "'attn_implementation: sdpa'" in err and "class has no SDPA" in err and "attn_implementation: eager" in err
    write_config(cfg, model=model, data=str(tmp_path / "d.jsonl"), method="lora", attn_implementation="auto")
    assert run_here(capsys, "plan", str(cfg), "--gpus", "1xH200")[0] in (0, 3)


def _lf(tmp_path: Path, model: str, extra: str = "") -> Path:
    path = tmp_path / "lf.yaml"
    path.write_text(f"model_name_or_path: {model}\nstage: sft\nfinetuning_type: lora\ncutoff_len: 8192\nbf16: true\n"
                    + extra)
    return path


def _ax(tmp_path: Path, model: str, extra: str = "") -> Path:
    path = tmp_path / "ax.yml"
    path.write_text(f"base_model: {model}\nadapter: lora\nsequence_len: 2048\nbf16: true\nlora_target_linear: true\n"
                    + extra)
    return path


@pytest.mark.parametrize(("model", "version", "expected", "said"), [
    ("google/gemma-2-9b", "5.20.0", "sdpa", None),
    ("google/gemma-2-9b", "5.21.0", "eager", "in gemma2 models (its class has no SDPA, from 5.21 on; SDPA before)"),
    ("openai/gpt-oss-20b", "4.55.0", "eager", "in gpt_oss models (its class has no SDPA, in every release)"),
    ("openai/gpt-oss-20b", "5.23.0", "eager", "in gpt_oss models (its class has no SDPA, in every release)"),
])
def test_foreign_jobs_follow_their_release(tmp_path: Path, model: str, version: str, expected: str,
                                           said: str | None) -> None:
    """A job that names no attention attends as its transformers release does: axolotl leaves it to transformers
    (LLaMA-Factory picks Gemma 2's and gpt-oss's kernel itself)."""
    job = read_job("axolotl", str(_ax(tmp_path, model)), JobOptions(transformers=version))
    assert job.workload.attention == expected
    if said is None:
        assert not any("attention not set" in n for n in job.notes), job.notes
    else:
        assert any(said in n for n in job.notes), job.notes


def test_a_foreign_plan_keeps_sdpa_where_its_release_had_it(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    """Gemma 2 under 5.20 attends with SDPA whatever the installed release says: the plan is not made eager."""
    path = str(_ax(tmp_path, "google/gemma-2-9b"))
    plans = {}
    for version in ("5.20.0", "5.21.0"):
        code, out, err = run_here(capsys, "plan", "--from", "axolotl", path, "--gpus", "1xH200",
                                  "--transformers", version, "--json")
        assert code in (0, 3), err
        plans[version] = json.loads(out)
    assert (plans["5.20.0"]["workload"]["attention"], plans["5.21.0"]["workload"]["attention"]) == ("sdpa", "eager")
    old, new = (plans[v]["from"]["as_configured"]["per_gpu_gib"]["activations"] for v in ("5.20.0", "5.21.0"))
    assert new > old


@pytest.mark.parametrize(("tool", "text", "key"), [
    ("llamafactory", "flash_attn: sdpa\n", "flash_attn"),
    ("axolotl", "sdp_attention: true\n", "sdp_attention"),
    ("axolotl", "attn_implementation: sdpa\n", "attn_implementation"),
])
def test_a_foreign_job_naming_sdpa_cannot_run_as_written(tmp_path: Path, tool: str, text: str, key: str) -> None:
    """transformers refuses to load gpt-oss (and Gemma 2 from 5.21) with SDPA: the job is refused naming its key
    and the eager setting; Gemma 2 under 5.20 loads it."""
    make = (_lf if tool == "llamafactory" else _ax)
    refused = (("openai/gpt-oss-20b", "4.57.0"), ("google/gemma-2-9b", "5.21.0"))
    for model, version in refused[tool == "llamafactory":]:  # LLaMA-Factory runs gpt-oss on its own kernel
        with pytest.raises(UserError, match=f"'{key}: .*class has no SDPA.*Use .*eager"):
            read_job(tool, str(make(tmp_path, model, text)), JobOptions(transformers=version))
    job = read_job(tool, str(make(tmp_path, "google/gemma-2-9b", text)), JobOptions(transformers="5.20.0"))
    assert job.workload.attention == "sdpa"


def test_llamafactory_runs_gpt_oss_on_its_own_flash_kernel(tmp_path: Path) -> None:
    """LLaMA-Factory 0.9.4 (#9354) loads gpt-oss with kernels-community/vllm-flash-attn3 before it reads
    flash_attn: `sdpa` runs (not refused) and `auto` is flash, not eager; Gemma 2's `auto` says what it runs."""
    for extra in ("flash_attn: sdpa\n", "", "flash_attn: disabled\n"):
        job = read_job("llamafactory", str(_lf(tmp_path, "openai/gpt-oss-20b", extra)),
                       JobOptions(transformers="4.57.0"))
        assert job.workload.attention == "flash" and any("vllm-flash-attn3" in n for n in job.notes), job.notes
    job = read_job("llamafactory", str(_lf(tmp_path, "google/gemma-2-9b")), JobOptions(transformers="5.20.0"))
    assert any("flash-attention 2 where flash-attn is installed and eager" in n for n in job.notes), job.notes


G2 = dict(model_type="gemma2", hidden_size=256, intermediate_size=512, num_hidden_layers=2, num_attention_heads=4,
          num_key_value_heads=2, head_dim=64, vocab_size=1024, sliding_window=128, query_pre_attn_scalar=64)
SIGLIP = dict(model_type="siglip_vision_model", hidden_size=64, intermediate_size=128, num_hidden_layers=1,
              num_attention_heads=2, image_size=28, patch_size=14)
QWEN2 = dict(model_type="qwen2", hidden_size=256, intermediate_size=512, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, vocab_size=1024)
GOT_VISION = dict(hidden_size=64, num_hidden_layers=1, num_attention_heads=2, image_size=64, patch_size=16)


def test_a_composites_text_model_picks_its_kernel() -> None:
    """transformers 5 checks each sub-model's class: PaliGemma 2's Gemma 2 text model loads eager under `auto` (so
    it is planned eager) and GOT-OCR2's Qwen2 loads SDPA (planned SDPA); `sdpa` is refused where the top class or
    the text class has none -- the rank and the planner alike."""
    if without_sdpa("gemma2") is None:
        pytest.skip("the installed transformers' Gemma 2 has SDPA")
    pg = PaliGemmaConfig(text_config=G2, vision_config=SIGLIP, projection_dim=256,
                         architectures=["PaliGemmaForConditionalGeneration"])
    auto = SimpleNamespace(model="m", trust_remote_code=False, attn_implementation="auto")
    built = meta_model(pg, torch.bfloat16, auto)
    assert built.model.language_model.config._attn_implementation == "eager"
    assert built.model.vision_tower.config._attn_implementation == "sdpa"  # the tower keeps its own default
    with pytest.raises(UserError, match="gemma2 model's class has no SDPA"):
        _attention(SimpleNamespace(attn_implementation="sdpa"), pg)
    as_file = dict(model_type="paligemma", architectures=["PaliGemmaForConditionalGeneration"], text_config=G2,
                   vision_config=SIGLIP, projection_dim=256, hidden_size=256, vocab_size=1024)
    assert shape_from_config(as_file, "pg2").eager_only

    got = transformers.AutoConfig.for_model("got_ocr2", text_config=QWEN2, vision_config=GOT_VISION)
    with torch.device("meta"):
        loaded = AutoModelForCausalLM.from_config(got, **_attention(auto, got))
    assert loaded.model.language_model.config._attn_implementation == "sdpa"
    shape = shape_from_config(dict(model_type="got_ocr2", architectures=["GotOcr2ForConditionalGeneration"],
                                   text_config=QWEN2, vision_config=GOT_VISION), "got")
    assert not shape.eager_only and shape.text_model_type == "qwen2"
    with pytest.raises(UserError, match="got_ocr2 model's class has no SDPA"):
        _attention(SimpleNamespace(attn_implementation="sdpa"), got)
    with pytest.raises(ValueError):  # what the rank would meet without the refusal
        AutoModelForCausalLM.from_config(got, attn_implementation="sdpa")


@pytest.mark.parametrize("config", [
    dict(model_type="gptj", n_embd=256, n_layer=2, n_head=4, vocab_size=1024, rotary_dim=16),
    dict(model_type="bloom", hidden_size=256, n_layer=2, n_head=4, vocab_size=1024),
])
def test_sequence_parallel_refuses_a_class_without_sdpa(config: dict) -> None:
    """The Ulysses kernel stands in for SDPA; a class without it (GPT-J, BLOOM) keeps its own eager attention, which
    would attend within each rank's slice only: refused naming sequence_parallel, planned and built alike."""
    shape = shape_from_config(config, config["model_type"])
    assert shape.eager_only
    with pytest.raises(UserError, match="sequence_parallel: 2: .*has no SDPA attention.*sequence_parallel: 1"):
        check_model(2, facts_of_shape(shape), config["model_type"])
    built = transformers.AutoConfig.for_model(**config)
    with pytest.raises(UserError, match="has no SDPA attention"):
        check_model(2, facts_of_config(built), config["model_type"])
    check_model(2, facts_of_shape(resolve_shape("meta-llama/Llama-3.1-8B")), "llama")
