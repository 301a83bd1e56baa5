"""What `convert`/`check --from` read beyond memory (issue 49): LLaMA-Factory's dataset columns carried into
data_columns and the data read as `check` reads it; a precision the hardware computes slowly said; an HF training
script's own code (LoRA, checkpointing, batch, length) read from its syntax tree, never run."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import yaml

from shardfit.check import precision_rules as pr
from shardfit.check.run import validate_data
from shardfit.cli.main import main
from shardfit.config import load_config
from shardfit.data.dataset import read_split
from shardfit.data.formats import ALPACA, detect_format, rename_columns, to_messages
from shardfit.errors import UserError
from shardfit.foreign.data_rules import data_rules
from shardfit.foreign.read import JobOptions, read_job
from shardfit.plan.hardware import Hardware
from tests.helpers import ROOT

HF_SCRIPT = ROOT / "tests" / "foreign_jobs" / "hf" / "lora_script" / "train.py"
LABEL = json.dumps({"sentiment": "positive", "aspect": "battery"})


def _lf_job(tmp: Path, columns: dict | None) -> Path:
    """The user's job of issue 49: reviews -> a JSON label, registered in dataset_info.json with `columns`."""
    data = tmp / "data"
    data.mkdir()
    rows = [{"review": f"Battery lasts {i} days, love it", "label": LABEL} for i in range(6)]
    (data / "reviews.json").write_text(json.dumps(rows))
    entry = {"file_name": "reviews.json", **({"columns": columns} if columns else {})}
    (data / "dataset_info.json").write_text(json.dumps({"reviews": entry}))
    job = tmp / "lf.yaml"
    # A catalog id: planned without weights, and no tokenizer to load (a local model's chat template is checked too)
    job.write_text(yaml.safe_dump({"model_name_or_path": "Qwen/Qwen2.5-7B-Instruct", "stage": "sft",
                                   "finetuning_type": "lora", "dataset": "reviews", "dataset_dir": "data",
                                   "cutoff_len": 256, "per_device_train_batch_size": 4, "bf16": True}))
    return job


def test_convert_carries_the_columns_and_the_config_reads_the_data(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                                   capsys: pytest.CaptureFixture) -> None:
    job = _lf_job(tmp_path, {"query": "review", "response": "label"})
    monkeypatch.chdir(tmp_path)
    out = tmp_path / "converted.yaml"
    assert main(["convert", "--from", "llamafactory", str(job), "--out", str(out)]) == 0
    cfg = load_config(out)
    assert cfg.data_columns == {"input": "review", "output": "label"}
    split = read_split(cfg)
    assert len(split.train) == 6
    assert split.train[0].messages == [{"role": "user", "content": "Battery lasts 0 days, love it"},
                                       {"role": "assistant", "content": LABEL}]


def test_check_from_reads_the_data_as_check_does(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                 capsys: pytest.CaptureFixture) -> None:
    """Without the columns the rows are unreadable: an error finding (exit 1), not "0 findings"; with them, none."""
    bare = _lf_job(tmp_path, None)
    monkeypatch.chdir(tmp_path)
    assert main(["check", "--from", "llamafactory", str(bare), "--gpus", "1x24GB"]) == 1
    out = capsys.readouterr().out
    assert "[  error] data_unreadable at " in out and "unknown format (keys: review, label)" in out
    (tmp_path / "data" / "dataset_info.json").write_text(json.dumps(
        {"reviews": {"file_name": "reviews.json", "columns": {"query": "review", "response": "label"}}}))
    job = read_job("llamafactory", str(bare), JobOptions())
    assert data_rules(job, validate_data) == []
    job.data_missing = ["alpaca_en"]
    assert [f.rule for f in data_rules(job, validate_data)] == ["data_not_found"]


def test_lf_columns_and_formats() -> None:
    from shardfit.foreign.lf_columns import data_columns

    notes: list[str] = []
    assert data_columns({"columns": {"prompt": "q", "query": "ctx", "response": "a", "system": "sys"}}, "x",
                        notes) == {"instruction": "q", "input": "ctx", "output": "a", "system": "sys"}
    assert data_columns({"formatting": "sharegpt", "columns": {"messages": "turns"}}, "x", notes) == \
        {"conversations": "turns"}
    # OpenAI-style messages registered as ShareGPT with role/content tags: shardfit's own messages format.
    assert data_columns({"formatting": "sharegpt", "columns": {"messages": "chat"},
                         "tags": {"role_tag": "role", "content_tag": "content"}}, "x", notes) == {"messages": "chat"}
    assert data_columns({"formatting": "ranking"}, "pairs", notes) == {} and "formatting 'ranking'" in notes[-1]


def test_rows_read_through_data_columns() -> None:
    row = rename_columns({"review": "Nice", "label": "ok", "id": 3}, {"input": "review", "output": "label"})
    assert row == {"id": 3, "input": "Nice", "output": "ok"} and detect_format(row) == ALPACA
    assert to_messages(row, ALPACA)[0] == {"role": "user", "content": "Nice"}
    with pytest.raises(UserError, match=r"'data_columns' has 'answer'.*the fields are instruction, input, output"):
        load_config(None, defaults={"data_columns": {"answer": "label"}}, check_files=False)


def test_precision_the_hardware_computes_slowly() -> None:
    cpu = Hardware(1, 1, 16.0, name="cpu")

    def fix(p: str) -> str:
        return f"use {p}"

    slow = pr.precision_rules("bf16", cpu, "precision", fix, flags={"avx2", "fma"})
    assert [f.rule for f in slow] == ["precision_slow"] and slow[0].fix == "use fp32"
    assert "no bf16 units (none of avx512_bf16, amx_bf16" in slow[0].message
    assert pr.precision_rules("bf16", cpu, "precision", fix, flags={"avx512_bf16"}) == []
    assert pr.precision_rules("fp32", cpu, "precision", fix, flags=set()) == []
    v100 = pr.precision_rules("bf16", Hardware(1, 8, 32.0, name="V100"), "precision", fix)
    assert [f.rule for f in v100] == ["precision_unsupported"] and v100[0].fix == "use fp16"
    assert pr.precision_rules("bf16", Hardware(1, 8, 80.0, name="H100"), "precision", fix) == []


def test_convert_says_bf16_is_slow_on_this_cpu(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                               capsys: pytest.CaptureFixture) -> None:
    job = _lf_job(tmp_path, {"query": "review", "response": "label"})
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(pr, "cpu_flags", lambda cpuinfo=pr.CPUINFO: {"avx2"})
    monkeypatch.setattr("shardfit.cli.convert_cmd.gpu_host", lambda: False)
    assert main(["convert", "--from", "llamafactory", str(job)]) == 0
    out, err = capsys.readouterr()
    assert out.startswith("# warning: precision bf16 on this CPU") and "precision: bf16" in out
    assert "shardfit: warning: precision bf16 on this CPU" in err and "Fix: precision: fp32" in err
    monkeypatch.setattr(pr, "cpu_flags", lambda cpuinfo=pr.CPUINFO: {"avx2", "amx_bf16"})
    assert main(["convert", "--from", "llamafactory", str(job)]) == 0
    assert "warning" not in capsys.readouterr().err


def test_cpu_flags_from_cpuinfo(tmp_path: Path) -> None:
    f = tmp_path / "cpuinfo"
    f.write_text("processor\t: 0\nflags\t\t: fpu sse avx2 avx512_bf16\n\nprocessor\t: 1\n")
    assert pr.cpu_flags(f) == {"fpu", "sse", "avx2", "avx512_bf16"}
    assert pr.cpu_flags(tmp_path / "absent") is None


def test_hf_script_code_is_read_not_run(capsys: pytest.CaptureFixture) -> None:
    """`check --from hf train.py`: LoRA, checkpointing, batch and length come from the script's code; what was
    read and assumed is printed; the script never runs (it would leave train.executed and exit)."""
    assert main(["check", "--from", "hf", str(HF_SCRIPT), "--gpus", "1x24GB"]) == 0
    out = capsys.readouterr().out
    assert "checked as: lora, bf16, 1024 tokens x micro-batch 2, gradient checkpointing full" in out
    assert "note: read in the script: LoraConfig(r=16, lora_alpha=32) at train.py:19: LoRA; TrainingArguments(" in out
    assert "gradient_checkpointing=True" in out and "SFTTrainer(max_seq_length=1024) at train.py:24" in out
    assert "predicted_oom" not in out
    assert not HF_SCRIPT.with_suffix(".executed").exists()
    w = read_job("hf", str(HF_SCRIPT), JobOptions()).workload
    assert (w.method, w.lora_rank, w.grad_ckpt, w.seq_len, w.micro_batch, w.grad_accum) == \
        ("lora", 16, "full", 1024, 2, 8)


def test_the_command_line_wins_over_the_scripts_code(tmp_path: Path) -> None:
    script = tmp_path / "train.py"
    script.write_text(HF_SCRIPT.read_text())
    launch = tmp_path / "run.sh"
    launch.write_text("torchrun --nproc_per_node 2 train.py --per_device_train_batch_size 4\n")
    job = read_job("hf", str(launch), JobOptions())
    assert job.workload.micro_batch == 4 and job.workload.method == "lora" and job.model == "Qwen/Qwen2.5-7B-Instruct"
    bare = tmp_path / "plain.py"
    bare.write_text("from transformers import TrainingArguments\nTrainingArguments(output_dir=OUT)\n")
    job = read_job("hf", str(bare), JobOptions(model="Qwen/Qwen2.5-7B-Instruct"))
    assumed = " ".join(job.notes)
    assert job.workload.method == "full" and "no LoRA" in assumed and "default, 8" in assumed
    assert "planned at 2048 tokens" in assumed


# transformers' examples' way of taking a file of arguments (run_clm.py and its kin), and a script given one path.
ARG_FILE_SCRIPT = ("import os, sys\nfrom transformers import HfArgumentParser, TrainingArguments\n"
                   "parser = HfArgumentParser((ModelArguments, TrainingArguments))\n"
                   "if len(sys.argv) == 2 and sys.argv[1].endswith('.json'):\n"
                   "    margs, targs = parser.parse_json_file(json_file=os.path.abspath(sys.argv[1]))\n"
                   "elif len(sys.argv) == 2 and sys.argv[1].endswith(('.yaml', '.yml')):\n"
                   "    margs, targs = parser.parse_yaml_file(os.path.abspath(sys.argv[1]))\n"
                   "else:\n    margs, targs = parser.parse_args_into_dataclasses()\n")
ARGS = {"model_name_or_path": "Qwen/Qwen2.5-0.5B", "per_device_train_batch_size": 3, "gradient_checkpointing": True,
        "use_lora": True, "lora_r": 8}


@pytest.mark.parametrize(("name", "script", "launch"), [
    ("args.json", ARG_FILE_SCRIPT, "torchrun --nproc_per_node 2 train.py args.json"),
    ("args.yaml", ARG_FILE_SCRIPT, "python train.py args.yaml"),
    ("conf/a.yaml", "from transformers import HfArgumentParser\nPATH = 'conf/a.yaml'\n"
                    "targs, = HfArgumentParser(TrainingArguments).parse_yaml_file(yaml_file=PATH)\n",
     "python train.py"),
    ("my.json", "import argparse\np = argparse.ArgumentParser()\np.add_argument('--config')\na = p.parse_args()\n"
                "targs, = HfArgumentParser(TrainingArguments).parse_json_file(Path(a.config).resolve())\n",
     "python train.py --config my.json"),
])
def test_a_script_reading_its_arguments_from_a_file_is_followed(tmp_path: Path, name: str, script: str,
                                                                 launch: str) -> None:
    """A script handing HfArgumentParser.parse_json_file / parse_yaml_file a file (sys.argv[1], a path in the code,
    an option it parses itself) exited 2 for want of --model_name_or_path: the file was never read. Its keys are
    the job's arguments now."""
    (tmp_path / "train.py").write_text(script)
    (tmp_path / name).parent.mkdir(exist_ok=True)
    (tmp_path / name).write_text(json.dumps(ARGS) if name.endswith(".json") else yaml.safe_dump(ARGS))
    (tmp_path / "run.sh").write_text(launch + "\n")
    job = read_job("hf", str(tmp_path / "run.sh"), JobOptions())
    w = job.workload
    assert (job.model, w.micro_batch, w.grad_ckpt, w.method, w.lora_rank) == ("Qwen/Qwen2.5-0.5B", 3, "full", "lora", 8)
    assert any(f"the arguments in {Path(name).name}" in n for n in job.notes), job.notes
    assert "config" not in job.keys and "config" not in job.not_modelled


def test_the_command_lines_branch_does_not_read_the_file(tmp_path: Path) -> None:
    """With options on the command line the examples' scripts take parse_args_into_dataclasses: no file is read,
    even one named on the line beside them."""
    (tmp_path / "train.py").write_text(ARG_FILE_SCRIPT)
    (tmp_path / "args.json").write_text(json.dumps(ARGS))
    (tmp_path / "run.sh").write_text("python train.py --model_name_or_path Qwen/Qwen2.5-1.5B "
                                     "--per_device_train_batch_size 5\n")
    job = read_job("hf", str(tmp_path / "run.sh"), JobOptions())
    assert (job.model, job.workload.micro_batch, job.workload.method) == ("Qwen/Qwen2.5-1.5B", 5, "full")


@pytest.mark.parametrize(("content", "named"), [
    (None, "gone.json: no such file here"), ("{not json", "gone.json:1: not valid JSON"),
    ("[1, 2]", "gone.json: the script's parse_json_file(sys.argv[1]) at train.py:5 reads an object"),
])
def test_an_arguments_file_that_cannot_be_read_exits_2(tmp_path: Path, content: str | None, named: str,
                                                       capsys: pytest.CaptureFixture) -> None:
    """The file the script reads its arguments from, missing or not a JSON object: exit 2 naming it."""
    (tmp_path / "train.py").write_text(ARG_FILE_SCRIPT)
    if content is not None:
        (tmp_path / "gone.json").write_text(content)
    (tmp_path / "run.sh").write_text("python train.py gone.json\n")
    with pytest.raises(UserError, match=re.escape(named)):
        read_job("hf", str(tmp_path / "run.sh"), JobOptions())
    assert main(["plan", "--from", "hf", str(tmp_path / "run.sh"), "--gpus", "1x24GB"]) == 2
    assert "gone.json" in capsys.readouterr().err


@pytest.mark.parametrize(("script", "launch"), [
    ("from transformers import HfArgumentParser\n"
     "targs, = HfArgumentParser(TrainingArguments).parse_yaml_file(yaml_file='args.yaml')\n", "python train.py"),
    ("import argparse\np = argparse.ArgumentParser()\np.add_argument('--config')\na, _ = p.parse_known_args()\n"
     "targs, = HfArgumentParser(TrainingArguments).parse_yaml_file(a.config)\n", "python train.py --config args.yaml"),
])
def test_options_beside_an_arguments_file_are_not_planned(tmp_path: Path, script: str, launch: str) -> None:
    """parse_*_file reads the file alone: --gradient_checkpointing, --use_lora and --lora_r given beside it never
    reach the dataclasses, yet were planned (checkpointing, LoRA: memory under-stated). They are filed as not
    modelled now, with a note, and the run is planned as the file says."""
    (tmp_path / "train.py").write_text(script)
    (tmp_path / "args.yaml").write_text("model_name_or_path: Qwen/Qwen2.5-0.5B\nper_device_train_batch_size: 3\n")
    (tmp_path / "run.sh").write_text(launch + " --gradient_checkpointing true --lora_r 8 --use_lora true "
                                     "--per_device_train_batch_size 9\n")
    job = read_job("hf", str(tmp_path / "run.sh"), JobOptions())
    w = job.workload
    assert (w.micro_batch, w.grad_ckpt, w.method) == (3, "none", "full")
    assert {"gradient_checkpointing", "lora_r", "use_lora"} <= set(job.not_modelled), job.not_modelled
    assert any("never reach the parser" in n for n in job.notes), job.notes


@pytest.mark.parametrize("ref", ["~/.kube/config", "{outside}/secret.yaml", "../secret.yaml", "link.yaml"])
def test_an_arguments_file_outside_the_job_is_not_read(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                      ref: str) -> None:
    """A stranger's script naming `~/.kube/config` (or any file outside the job's folders) had shardfit read it and
    print its keys' values in "not modelled". It is not followed now: a note says so, and nothing of it shows."""
    outside = tmp_path / "home"
    (outside / ".kube").mkdir(parents=True)
    secret = "apiVersion: v1\nusers: [{name: admin, user: {token: s3cr3t-TOKEN}}]\n"
    (outside / ".kube" / "config").write_text(secret)
    (tmp_path / "secret.yaml").write_text(secret)
    monkeypatch.setenv("HOME", str(outside))
    job_dir = tmp_path / "job"
    job_dir.mkdir()
    (job_dir / "link.yaml").symlink_to(tmp_path / "secret.yaml")
    (job_dir / "train.py").write_text("from transformers import HfArgumentParser\n"
                                      f"targs, = HfArgumentParser(TrainingArguments).parse_yaml_file("
                                      f"{ref.format(outside=tmp_path)!r})\n")
    (job_dir / "run.sh").write_text("python train.py --model_name_or_path Qwen/Qwen2.5-0.5B\n")
    job = read_job("hf", str(job_dir / "run.sh"), JobOptions(model="Qwen/Qwen2.5-0.5B"))
    shown = repr((job.keys, job.not_modelled, job.notes))
    assert "s3cr3t" not in shown and "apiVersion" not in shown
    assert any("did not read it" in n for n in job.notes), job.notes


def test_unknown_keys_of_an_arguments_file_show_by_name_only(tmp_path: Path) -> None:
    """A key of the arguments file that no argument has is listed, its value not shown."""
    (tmp_path / "train.py").write_text("from transformers import HfArgumentParser\n"
                                       "targs, = HfArgumentParser(TrainingArguments).parse_yaml_file('a.yaml')\n")
    (tmp_path / "a.yaml").write_text("model_name_or_path: Qwen/Qwen2.5-0.5B\ntoken: s3cr3t\n")
    (tmp_path / "run.sh").write_text("python train.py\n")
    job = read_job("hf", str(tmp_path / "run.sh"), JobOptions())
    assert job.not_modelled["token"] == "(value not shown)"
