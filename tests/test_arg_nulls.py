"""Nulls in a file of arguments (foreign/arg_nulls.py): a TrlParser YAML's or parse_yaml_file's `key: null` reaches
the dataclass as None, which for these keys is not the default: `max_length: null` truncates no row (trl 1.x
SFTConfig), so the plan needs --seq; a null gradient_checkpointing is off; a null batch size fails the job."""

from __future__ import annotations

from pathlib import Path

import pytest

from shardfit.errors import UserError
from shardfit.foreign.read import JobOptions, read_job

BASE = "model_name_or_path: Qwen/Qwen2.5-0.5B\nbf16: true\n"


def _trl(tmp_path: Path, body: str, seq: int | None = None, command: str = "trl sft --config job.yaml"):
    (tmp_path / "job.yaml").write_text(BASE + body)
    (tmp_path / "run.sh").write_text(command + "\n")
    return read_job("hf", str(tmp_path / "run.sh"), JobOptions(transformers="5.23.0", seq=seq))


@pytest.mark.parametrize("command", ["trl sft --config job.yaml", "trl dpo --config job.yaml"])
def test_a_null_max_length_needs_seq(tmp_path: Path, command: str) -> None:
    """No truncation: the rows' own lengths, which the plan cannot size; the error names file, line and key."""
    with pytest.raises(UserError, match=r"job\.yaml:3: max_length: null truncates no row.*--seq N"):
        _trl(tmp_path, "max_length: null\n", command=command)


def test_a_null_max_length_with_seq_plans_at_it(tmp_path: Path) -> None:
    job = _trl(tmp_path, "max_length: null\n", seq=700)
    assert job.workload.seq_len == 700
    assert any("job.yaml:3: max_length: null" in n and "--seq 700" in n for n in job.notes), job.notes


def test_the_command_lines_length_beats_a_null(tmp_path: Path) -> None:
    """The command line's flag wins over the YAML (TrlParser's defaults), so its null never reaches the config."""
    job = _trl(tmp_path, "max_length: null\n", command="trl sft --config job.yaml --max_length 300")
    assert job.workload.seq_len == 300


def test_a_null_gradient_checkpointing_is_off(tmp_path: Path) -> None:
    """TRL's configs default gradient_checkpointing to true; a null replaces that with None, which the Trainer
    takes as off."""
    assert _trl(tmp_path, "max_length: 512\n").workload.grad_ckpt == "full"
    job = _trl(tmp_path, "max_length: 512\ngradient_checkpointing: null\n")
    assert job.workload.grad_ckpt == "none"
    assert any("job.yaml:4: gradient_checkpointing: null" in n for n in job.notes), job.notes


@pytest.mark.parametrize("key", ["per_device_train_batch_size", "gradient_accumulation_steps"])
def test_a_null_batch_fails_the_job(tmp_path: Path, key: str) -> None:
    with pytest.raises(UserError, match=rf"job\.yaml:4: {key}: null .*TypeError"):
        _trl(tmp_path, f"max_length: 512\n{key}: null\n")


def test_a_null_lora_r_fails_the_job(tmp_path: Path) -> None:
    with pytest.raises(UserError, match=r"job\.yaml:5: lora_r: null .*LoraConfig\(r=None\)"):
        _trl(tmp_path, "max_length: 512\nuse_peft: true\nlora_r: null\n")


def test_other_nulls_mean_the_default(tmp_path: Path) -> None:
    job = _trl(tmp_path, "max_length: 512\nuse_peft: null\npacking: null\n")
    assert job.workload.method == "full" and job.workload.seq_len == 512


def test_a_null_length_in_parse_yaml_file(tmp_path: Path) -> None:
    """HfArgumentParser.parse_yaml_file's null reaches SFTConfig alike."""
    (tmp_path / "train.py").write_text(
        "import sys\nfrom transformers import HfArgumentParser, AutoModelForCausalLM\n"
        "from trl import SFTConfig, SFTTrainer\n"
        "(args,) = HfArgumentParser(SFTConfig).parse_yaml_file(sys.argv[1])\n"
        "model = AutoModelForCausalLM.from_pretrained(\"Qwen/Qwen2.5-0.5B\", dtype=\"bfloat16\")\n"
        "SFTTrainer(model=model, args=args).train()\n")
    (tmp_path / "args.yaml").write_text("output_dir: o\nmax_length: null\n")
    (tmp_path / "run.sh").write_text("python train.py args.yaml\n")
    with pytest.raises(UserError, match=r"args\.yaml:2: max_length: null"):
        read_job("hf", str(tmp_path / "run.sh"), JobOptions(transformers="5.23.0"))


def _hf(tmp_path: Path, args: str):
    """The HF Trainer (no TRL config: checkpointing off by default) run from the command line."""
    (tmp_path / "train.py").write_text("from transformers import HfArgumentParser, Trainer, TrainingArguments\n"
                                       "(args,) = HfArgumentParser((TrainingArguments,)).parse_args_into_dataclasses()"
                                       "\nTrainer(model=model, args=args).train()\n")
    (tmp_path / "run.sh").write_text(f"python train.py --model_name_or_path Qwen/Qwen2.5-0.5B --bf16 true "
                                     f"--max_length 512 --per_device_train_batch_size 1 {args}\n")
    return read_job("hf", str(tmp_path / "run.sh"), JobOptions(transformers="5.23.0"))


@pytest.mark.parametrize(("args", "ckpt"), [
    ("--activation_checkpointing true", "full"), ("--activation_checkpointing", "full"),
    ("--gradient_checkpointing true", "full"), ("", "none"),
    # the new name wins where both are given (TrainingArguments `__post_init__`, transformers 5.x)
    ("--activation_checkpointing false --gradient_checkpointing true", "none"),
    ("--gradient_checkpointing false --activation_checkpointing true", "full"),
])
def test_activation_checkpointing_is_gradient_checkpointings_new_name(tmp_path: Path, args: str, ckpt: str) -> None:
    job = _hf(tmp_path, args)
    assert job.workload.grad_ckpt == ckpt
    assert "activation_checkpointing" not in job.not_modelled
    assert ("gradient checkpointing not set" in " ".join(job.notes)) == (not args)


def test_activation_checkpointing_kwargs_say_reentrant(tmp_path: Path) -> None:
    job = _hf(tmp_path, "--activation_checkpointing true "
                        "--activation_checkpointing_kwargs '{\"use_reentrant\": false}'")
    assert not job.reentrant_ckpt and "activation_checkpointing_kwargs" not in job.not_modelled
    assert _hf(tmp_path, "--activation_checkpointing true").reentrant_ckpt


def test_a_null_gradient_checkpointing_leaves_a_set_activation_checkpointing(tmp_path: Path) -> None:
    """The old name is read only where the new one is None: its null changes nothing then."""
    job = _trl(tmp_path, "max_length: 512\nactivation_checkpointing: true\ngradient_checkpointing: null\n")
    assert job.workload.grad_ckpt == "full"
    assert not any("gradient_checkpointing: null" in n for n in job.notes), job.notes
    off = _trl(tmp_path, "max_length: 512\nactivation_checkpointing: false\ngradient_checkpointing: null\n")
    assert off.workload.grad_ckpt == "none"
