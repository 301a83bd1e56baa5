"""The attention a job runs when it names none follows the transformers version it runs under
(foreign/common.py `default_attention`): SDPA from 4.36, eager attention before -- the kernel an older run
actually used, whose fp32 softmax per head the plan then counts. A job that names its kernel keeps it."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from shardfit.foreign.read import JobOptions, read_job
from tests.helpers import ROOT, run_here

JOBS = ROOT / "tests" / "foreign_jobs"
EAGER_NOTE = "attention not set: transformers 4.35.2 attends eagerly"


def _lf(tmp_path: Path, extra: str = "") -> Path:
    path = tmp_path / "lf.yaml"
    path.write_text("model_name_or_path: Qwen/Qwen2.5-7B\nstage: sft\nfinetuning_type: lora\ncutoff_len: 2048\n"
                    "bf16: true\n" + extra)
    return path


def _axolotl(tmp_path: Path, extra: str = "") -> Path:
    path = tmp_path / "ax.yml"
    path.write_text("base_model: meta-llama/Llama-3.1-8B\nadapter: lora\nsequence_len: 2048\nbf16: true\n"
                    "lora_target_linear: true\n" + extra)
    return path


def _swift(tmp_path: Path, extra: str = "") -> Path:
    path = tmp_path / "run.sh"
    path.write_text("swift sft --model Qwen/Qwen2.5-7B --train_type lora --torch_dtype bfloat16 --max_length 2048"
                    + extra + "\n")
    return path


def _hf(tmp_path: Path, extra: str = "", load: str = "") -> Path:
    (tmp_path / "train.py").write_text(
        "from transformers import AutoModelForCausalLM\nfrom peft import LoraConfig\n"
        "from trl import SFTConfig, SFTTrainer\n"
        f"model = AutoModelForCausalLM.from_pretrained('Qwen/Qwen2.5-0.5B', torch_dtype='bfloat16'{load})\n"
        "args = SFTConfig(output_dir='o', per_device_train_batch_size=1, max_length=1024, bf16=True)\n"
        "SFTTrainer(model=model, args=args, peft_config=LoraConfig(r=16)).train()\n")
    path = tmp_path / "run.sh"
    path.write_text("python train.py --model_name_or_path Qwen/Qwen2.5-0.5B" + extra + "\n")
    return path


UNSET = {"llamafactory": _lf, "axolotl": _axolotl, "swift": _swift, "hf": _hf}


@pytest.mark.parametrize("tool", sorted(UNSET))
@pytest.mark.parametrize(("version", "expected"), [("4.35.2", "eager"), ("4.36.0", "sdpa"), ("5.23.0", "sdpa")])
def test_unset_attention_is_the_version_default(tmp_path: Path, tool: str, version: str, expected: str) -> None:
    """Every tool's job that leaves attention to transformers (LLaMA-Factory's `flash_attn: auto` included) runs
    eager attention before 4.36 and SDPA from it; the note says so only where it is eager."""
    job = read_job(tool, str(UNSET[tool](tmp_path)), JobOptions(transformers=version))
    assert job.workload.attention == expected
    assert any("attends eagerly (SDPA is its default from 4.36)" in n for n in job.notes) is (expected == "eager")


def test_bare_deepspeed_json_follows_the_version(tmp_path: Path) -> None:
    """A DeepSpeed JSON alone: the training script decides its attention; planned as transformers' default."""
    old = read_job("deepspeed", str(JOBS / "deepspeed/ds_z2.json"),
                   JobOptions(transformers="4.35.2", model="Qwen/Qwen2.5-7B"))
    new = read_job("deepspeed", str(JOBS / "deepspeed/ds_z2.json"),
                   JobOptions(transformers="4.36.0", model="Qwen/Qwen2.5-7B"))
    assert (old.workload.attention, new.workload.attention) == ("eager", "sdpa")
    assert any(EAGER_NOTE in n for n in old.notes)


@pytest.mark.parametrize(("tool", "extra", "expected"), [
    ("llamafactory", "flash_attn: sdpa\n", "sdpa"), ("llamafactory", "flash_attn: fa2\n", "flash"),
    ("axolotl", "sdp_attention: true\n", "sdpa"), ("axolotl", "flash_attention: true\n", "flash"),
    ("axolotl", "xformers_attention: true\n", "sdpa"), ("axolotl", "eager_attention: true\n", "eager"),
    ("swift", " --attn_impl flash_attn", "flash"), ("swift", " --attn_impl sdpa", "sdpa"),
    ("hf", " --attn_implementation flash_attention_2", "flash"),
])
def test_a_named_kernel_is_kept_under_an_old_version(tmp_path: Path, tool: str, extra: str, expected: str) -> None:
    """A job that names its kernel keeps it whatever the version (axolotl's own SDPA and xformers patches ran
    before transformers had SDPA); no note about the default."""
    job = read_job(tool, str(UNSET[tool](tmp_path, extra)), JobOptions(transformers="4.35.2"))
    assert job.workload.attention == expected
    assert not any("attends eagerly" in n for n in job.notes)


def test_plan_of_an_old_run_counts_the_eager_softmax(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    """End to end through `plan --from`: the same LLaMA-Factory job without checkpointing planned under 4.35
    (eager: every block's softmax kept) holds more activation memory than under 4.36 (SDPA), and says why."""
    path = str(_lf(tmp_path, "per_device_train_batch_size: 2\ndisable_gradient_checkpointing: true\n"))
    code_old, out_old, err_old = run_here(capsys, "plan", "--from", "llamafactory", path, "--gpus", "1xA100-80GB",
                                          "--transformers", "4.35.2", "--json")
    code_new, out_new, err_new = run_here(capsys, "plan", "--from", "llamafactory", path, "--gpus", "1xA100-80GB",
                                          "--transformers", "4.36.0", "--json")
    assert code_old in (0, 3) and code_new in (0, 3), (err_old, err_new)
    old, new = json.loads(out_old), json.loads(out_new)
    assert any(EAGER_NOTE in n for n in old["from"]["notes"])
    assert not any("attends eagerly" in n for n in new["from"]["notes"])
    assert old["candidates"][0]["per_gpu_gib"]["activations"] > 1.5 * new["candidates"][0]["per_gpu_gib"]["activations"]


@pytest.mark.parametrize(("model", "version", "expected"), [
    ("mistralai/Mistral-7B-v0.1", "4.36.2", "eager"), ("mistralai/Mistral-7B-v0.1", "4.37.0", "sdpa"),
    ("meta-llama/Llama-2-7b-hf", "4.36.2", "sdpa"),
])
def test_classes_that_gained_sdpa_later_attend_eagerly_until_then(tmp_path: Path, model: str, version: str,
                                                                  expected: str) -> None:
    """Mistral's class gained SDPA in 4.37 (transformers PR 28133, after 4.36.0): under 4.36 it still attends
    eagerly where Llama's does not; the note names the family."""
    path = tmp_path / "lf.yaml"
    path.write_text(f"model_name_or_path: {model}\nstage: sft\nfinetuning_type: lora\ncutoff_len: 2048\n")
    job = read_job("llamafactory", str(path), JobOptions(transformers=version))
    assert job.workload.attention == expected
    assert any("in mistral models (SDPA is its default from 4.37)" in n for n in job.notes) is (expected == "eager")


@pytest.mark.parametrize(("model", "version", "expected", "said"), [
    # Phi-3's modeling file set `_supports_sdpa = False` until 4.45
    ("microsoft/Phi-3-mini-4k-instruct", "4.44.2", "eager", "in phi3 models (SDPA is its default from 4.45)"),
    ("microsoft/Phi-3-mini-4k-instruct", "4.45.0", "sdpa", None),
    # Gemma2 had SDPA from its first release, defaulted to eager in 4.45-4.47, and back to SDPA from 4.48
    ("google/gemma-2-9b", "4.44.2", "sdpa", None),
    ("google/gemma-2-9b", "4.45.2", "eager", "defaults gemma2 models to eager attention (4.45 to 4.47 do)"),
    ("google/gemma-2-9b", "4.47.1", "eager", "defaults gemma2 models to eager attention (4.45 to 4.47 do)"),
    ("google/gemma-2-9b", "4.48.0", "sdpa", None),
])
def test_the_version_table_follows_each_class_s_release(tmp_path: Path, model: str, version: str, expected: str,
                                                        said: str | None) -> None:
    """Each class attends as its transformers release's modeling file decides, read from the published wheels."""
    path = tmp_path / "lf.yaml"
    path.write_text(f"model_name_or_path: {model}\nstage: sft\nfinetuning_type: lora\ncutoff_len: 2048\n")
    job = read_job("llamafactory", str(path), JobOptions(transformers=version))
    assert job.workload.attention == expected
    if said is None:
        assert not any("attention not set" in n for n in job.notes), job.notes
    else:
        assert any(said in n for n in job.notes), job.notes


# The first release whose modeling file sets `_supports_sdpa = True`, read in the published wheels (the last release
# before it set nothing or False); the classes that never had it (sdpa_classes.py NO_SDPA) attend eagerly in every one.
@pytest.mark.parametrize(("model_type", "before", "since"), [
    ("llama", "4.35.2", "4.36.0"), ("mistral", "4.36.2", "4.37.0"), ("mixtral", "4.36.2", "4.37.0"),
    ("phi", "4.38.2", "4.39.0"), ("stablelm", "4.38.2", "4.39.0"), ("gpt_neox", "4.41.2", "4.42.0"),
    ("gpt2", "4.41.2", "4.42.0"), ("phi3", "4.44.2", "4.45.0"), ("opt", "4.45.2", "4.46.0"),
    ("persimmon", "4.52.4", "4.53.0"),
])
def test_each_class_attends_with_sdpa_from_its_release(model_type: str, before: str, since: str) -> None:
    from shardfit.foreign.common import default_attention

    notes: list[str] = []
    assert default_attention(before, model_type, notes) == "eager" and notes
    assert default_attention(since, model_type, notes := []) == "sdpa" and not notes


@pytest.mark.parametrize("model_type", ["gpt_neo", "gptj", "bloom", "codegen"])
def test_classes_without_sdpa_attend_eagerly_under_every_release(model_type: str) -> None:
    from shardfit.foreign.common import default_attention
    from shardfit.plan.sdpa_classes import runs_eager

    assert {default_attention(v, model_type, []) for v in ("4.35.2", "4.50.3", "5.23.0")} == {"eager"}
    assert runs_eager(model_type, "sdpa") and runs_eager(model_type, "auto")


@pytest.mark.parametrize(("tool", "kwargs", "expected"), [
    ("hf", {"load": ", use_flash_attention_2=True"}, "flash"),  # transformers 4.34-4.35's spelling
    ("hf", {"load": ", attn_implementation='flash_attention_2'"}, "flash"),
    ("swift", {"extra": " --use_flash_attn true"}, "flash"),  # ms-swift 2.x
    ("llamafactory", {"extra": "flash_attn: true\n"}, "flash"),  # LLaMA-Factory 0.5's boolean
    ("llamafactory", {"extra": "flash_attn: false\n"}, "eager"),
    ("llamafactory", {"extra": "flash_attn: off\n"}, "eager"),  # 0.6-0.8's `off`, which YAML reads as false
])
def test_older_spellings_of_the_kernel_are_read(tmp_path: Path, tool: str, kwargs: dict, expected: str) -> None:
    """The spellings the older stacks used name the kernel: the version's default does not replace them."""
    job = read_job(tool, str(UNSET[tool](tmp_path, **kwargs)), JobOptions(transformers="4.35.2"))
    assert job.workload.attention == expected, job.notes
    assert not any("attends eagerly" in n for n in job.notes)


def test_the_attention_flag_says_what_the_script_runs(tmp_path: Path) -> None:
    """--attention on a bare DeepSpeed JSON is what the training script runs: no version default replaces it."""
    job = read_job("deepspeed", str(JOBS / "deepspeed/ds_z2.json"),
                   JobOptions(transformers="4.35.2", model="Qwen/Qwen2.5-7B", workload={"attention": "flash"}))
    assert job.workload.attention == "flash" and not any("attends eagerly" in n for n in job.notes)
