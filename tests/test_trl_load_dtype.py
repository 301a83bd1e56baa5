"""The dtype a TRL job's model loads in where nothing names one (foreign/kbit.py `job_load`): a YAML of arguments
that sets ModelConfig's dtype to null hands from_pretrained None, and a script that loads the model itself without
a dtype passes none; transformers 5 takes either as "auto" (the checkpoint's dtype, planned as bf16), transformers 4
as fp32 (5.23 modeling_utils.py `from_pretrained`; 4.x `_get_dtype`). And the note of a 16-bit load under the other
16-bit type's autocast, which casts every weight per matmul."""

from __future__ import annotations

from pathlib import Path

import pytest

from shardfit.errors import UserError
from shardfit.foreign.read import JobOptions, read_job


def _yaml_job(tmp_path: Path, body: str, version: str):
    (tmp_path / "job.yaml").write_text("model_name_or_path: Qwen/Qwen2.5-0.5B\nmax_length: 1024\nbf16: true\n" + body)
    (tmp_path / "run.sh").write_text("trl sft --config job.yaml\n")
    return read_job("hf", str(tmp_path / "run.sh"), JobOptions(transformers=version))


@pytest.mark.parametrize("key", ["dtype", "torch_dtype"])
@pytest.mark.parametrize(("version", "fp32"), [("5.23.0", False), ("4.57.1", True)])
def test_a_null_dtype_loads_as_transformers_takes_none(tmp_path: Path, key: str, version: str, fp32: bool) -> None:
    """`dtype: null` in TrlParser's YAML: TRL passes None to from_pretrained (create_model_from_path lets None
    through), which transformers 5 loads as "auto" and 4.x as fp32; not ModelConfig's float32 default."""
    job = _yaml_job(tmp_path, f"use_peft: true\n{key}: null\n", version)
    w = job.workload
    assert w.method == "lora" and w.loaded_fp32 is fp32 and w.frozen_fp32 is fp32
    note = next(n for n in job.notes if f"{key}: null" in n)
    assert "job.yaml" in note and f"transformers {version}" in note
    assert ("taken as bf16" in note) is not fp32


def test_a_null_dtype_full_fine_tune_under_transformers_5_is_pure_16bit(tmp_path: Path) -> None:
    w = _yaml_job(tmp_path, "dtype: null\n", "5.23.0").workload
    assert w.method == "full" and w.pure_16bit
    assert not _yaml_job(tmp_path, "dtype: null\n", "4.57.1").workload.pure_16bit


def test_a_null_dtype_4bit_layers_compute_in_fp32(tmp_path: Path) -> None:
    """TRL hands the same None to BitsAndBytesConfig's compute dtype, which takes None as fp32; the frozen weights
    load as the checkpoint's under transformers 5."""
    w = _yaml_job(tmp_path, "use_peft: true\nload_in_4bit: true\ndtype: null\n", "5.23.0").workload
    assert w.method == "qlora" and w.bnb_compute_fp32 and not w.frozen_fp32


SCRIPT = ("from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer\n"
          "from trl import ModelConfig, ScriptArguments, SFTConfig, SFTTrainer, TrlParser, get_peft_config\n"
          "script_args, training_args, model_args = TrlParser((ScriptArguments, SFTConfig, ModelConfig))"
          ".parse_args_and_config()\n"
          "tok = AutoTokenizer.from_pretrained(model_args.model_name_or_path)\n"
          "config = AutoConfig.from_pretrained(model_args.model_name_or_path)\n"
          "model_kwargs = dict(dtype=model_args.dtype)\n"
          "model = AutoModelForCausalLM.from_pretrained(model_args.model_name_or_path{load})\n"
          "SFTTrainer(model=model, args=training_args, peft_config=get_peft_config(model_args)).train()\n")


def _script_job(tmp_path: Path, load: str, flags: str, version: str = "5.23.0"):
    (tmp_path / "train.py").write_text(SCRIPT.format(load=load))
    (tmp_path / "run.sh").write_text(f"accelerate launch train.py --model_name_or_path Qwen/Qwen2.5-0.5B --bf16 true "
                                     f"--max_length 1024 {flags}\n")
    return read_job("hf", str(tmp_path / "run.sh"), JobOptions(transformers=version))


@pytest.mark.parametrize(("load", "version", "fp32"), [
    ("", "5.23.0", False), ("", "4.57.1", True), (", dtype=None", "5.23.0", False),
    (", **model_kwargs", "5.23.0", True), (", dtype=model_args.dtype", "4.57.1", True)])
def test_a_scripts_from_pretrained_without_dtype_loads_as_transformers_does(tmp_path: Path, load: str, version: str,
                                                                           fp32: bool) -> None:
    """A script that parses ModelConfig but loads the model itself with no dtype (or None): --dtype never reaches
    from_pretrained, so transformers' default loads it ("auto" in 5.x, taken as bf16; fp32 in 4.x), whatever
    --dtype says. One that passes model_args.dtype, or **kwargs that may hold it, loads in ModelConfig's."""
    job = _script_job(tmp_path, load, "--use_peft", version)
    assert job.workload.loaded_fp32 is fp32
    if "model_args" not in load and "**" not in load:
        note = next(n for n in job.notes if "passes no dtype" in n)
        assert "train.py:7" in note and f"transformers {version}" in note
        assert ("4.x: fp32" if version.startswith("5") else '5.x: "auto"') in note


def test_a_scripts_default_load_beats_the_command_lines_dtype(tmp_path: Path) -> None:
    """--dtype bfloat16 on the command line does not reach a from_pretrained that passes no dtype: under
    transformers 4 the model still loads in fp32."""
    assert _script_job(tmp_path, "", "--use_peft --dtype bfloat16", "4.57.1").workload.loaded_fp32


def test_a_full_fine_tune_loaded_without_dtype_under_transformers_5(tmp_path: Path) -> None:
    job = _script_job(tmp_path, "", "")
    assert job.workload.method == "full" and job.workload.pure_16bit
    assert any("passes no dtype" in n and "no fp32 masters" in n for n in job.notes), job.notes


@pytest.mark.parametrize(("flags", "low", "autocast"), [("--dtype bfloat16 --fp16 true --bf16 false", "bf16", "fp16"),
                                                        ("--dtype float16", "fp16", "bf16")])
@pytest.mark.parametrize("peft", ["", "--use_peft"])
def test_a_16bit_load_under_the_other_16bit_autocast_says_it_casts(tmp_path: Path, flags: str, low: str,
                                                                   autocast: str, peft: str) -> None:
    """--dtype bfloat16 with --fp16 (or float16 with --bf16): autocast casts every weight to its own type for each
    matmul, uncached (it caches casts of fp32 weights only); the note says so and that the plan holds no copy."""
    (tmp_path / "run.sh").write_text(f"trl sft --model_name_or_path Qwen/Qwen2.5-0.5B --max_length 1024 {peft} "
                                     f"{flags}\n")
    job = read_job("hf", str(tmp_path / "run.sh"), JobOptions(transformers="5.23.0"))
    assert job.workload.precision == autocast
    note = next(n for n in job.notes if f"loads the model in {low}" in n)
    assert "casts nothing" not in note
    assert f"{autocast} autocast casts each {low} weight to {autocast} for every matmul" in note
    assert "neither is planned" in note


def test_a_matching_16bit_load_casts_no_weight(tmp_path: Path) -> None:
    (tmp_path / "run.sh").write_text("trl sft --model_name_or_path Qwen/Qwen2.5-0.5B --max_length 1024 "
                                     "--dtype bfloat16\n")
    job = read_job("hf", str(tmp_path / "run.sh"), JobOptions(transformers="5.23.0"))
    assert any("autocast over bf16 weights casts no weight" in n for n in job.notes), job.notes


@pytest.mark.parametrize(("body", "fp32"), [("dtype: null\ntorch_dtype: bfloat16\n", False),
                                            ("torch_dtype: null\ndtype: bfloat16\n", False),
                                            ("dtype: null\ntorch_dtype: float32\n", True)])
def test_a_null_dtype_beside_a_given_one_loses_to_it(tmp_path: Path, body: str, fp32: bool) -> None:
    """TRL 0.20 to 0.26 copy torch_dtype into a falsy dtype: the key given a value decides, whichever comes
    first; None only where every key given is null (transformers 4.57.1 would take it as fp32)."""
    job = _yaml_job(tmp_path, "use_peft: true\n" + body, "4.57.1")
    assert job.workload.loaded_fp32 is fp32
    assert not any(": null, which TRL hands" in n for n in job.notes), job.notes


@pytest.mark.parametrize(("peft", "launch"), [("", "trl sft"), ("--use_peft", "trl sft"),
                                              ("", "trl sft --deepspeed ds.json")])
def test_a_full_fine_tune_loaded_and_trained_in_fp16_fails(tmp_path: Path, peft: str, launch: str) -> None:
    """--dtype float16 with --fp16 and no DeepSpeed or FSDP: the trained weights and their gradients are fp16, and
    accelerate's GradScaler refuses them at the first step (torch's "Attempting to unscale FP16 gradients."). LoRA
    trains fp32 adapters, DeepSpeed fp32 masters: both run."""
    (tmp_path / "ds.json").write_text('{"zero_optimization": {"stage": 2}, "fp16": {"enabled": "auto"}, '
                                      '"train_micro_batch_size_per_gpu": "auto"}')
    (tmp_path / "run.sh").write_text(f"{launch} --model_name_or_path Qwen/Qwen2.5-0.5B --max_length 1024 "
                                     f"--dtype float16 --fp16 true --bf16 false {peft}\n")
    if peft or "deepspeed" in launch:
        read_job("hf", str(tmp_path / "run.sh"), JobOptions(transformers="5.23.0"))
        return
    with pytest.raises(UserError, match=r"(?s)--dtype float16.*--fp16.*Attempting to unscale FP16 gradients.*"
                                        r"--dtype bfloat16"):
        read_job("hf", str(tmp_path / "run.sh"), JobOptions(transformers="5.23.0"))
