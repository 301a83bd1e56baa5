"""What the tools do with settings a job leaves out or gets wrong before training: their default epoch counts, and
the TrainingArguments combinations transformers' Trainer refuses at start (exit 2 naming the key and the fix)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from shardfit.cli.main import main
from shardfit.errors import UserError
from shardfit.foreign.convert import comments, to_config
from shardfit.foreign.read import JobOptions, read_job
from shardfit.foreign.trainer_checks import trainer_defaults

HF = {"model_name_or_path": "Qwen/Qwen2.5-7B", "bf16": True, "per_device_train_batch_size": 1,
      "model_max_length": 2048}
LF = "model_name_or_path: Qwen/Qwen2.5-7B\nstage: sft\nfinetuning_type: lora\ncutoff_len: 2048\nbf16: true\n"
AXOLOTL = "base_model: Qwen/Qwen2.5-7B\nadapter: lora\nsequence_len: 2048\nmicro_batch_size: 1\nbf16: true\n"
LF_V1 = "model: Qwen/Qwen2.5-7B\nmicro_batch_size: 1\ncutoff_len: 2048\npeft_config:\n  name: lora\n"
SWIFT = "swift sft --model Qwen/Qwen2.5-7B --tuner_type lora --torch_dtype bfloat16 --max_length 2048\n"


def _read(tmp_path: Path, tool: str, name: str, text: str):
    (tmp_path / name).write_text(text)
    return read_job(tool, str(tmp_path / name), JobOptions(transformers="5.23.0"))


def _hf(tmp_path: Path, **args) -> str:
    path = tmp_path / "args.json"
    path.write_text(json.dumps({**HF, **args}))
    return str(path)


@pytest.mark.parametrize(("tool", "name", "text", "epochs"), [
    ("hf", "args.json", json.dumps(HF), 3), ("llamafactory", "lf.yaml", LF, 3), ("swift", "run.sh", SWIFT, 3),
    ("axolotl", "ax.yml", AXOLOTL, 1), ("llamafactory", "v1.yaml", LF_V1, 3),
])
def test_tools_default_epochs_are_planned_and_said(tmp_path: Path, tool: str, name: str, text: str,
                                                    epochs: int) -> None:
    """A job that names no epoch count trains the tool's default: the HF Trainer's num_train_epochs 3.0 (which
    LLaMA-Factory v0 and ms-swift keep), LLaMA-Factory v1's own num_train_epochs 3, axolotl's num_epochs 1.0; the
    converted config trains as many, and the plan's notes and convert's header say it was the tool's default."""
    job = _read(tmp_path, tool, name, text)
    cfg = to_config(job)
    assert cfg["epochs"] == epochs
    assert any("not set" in n and "default" in n and "epoch" in n for n in job.notes)
    assert any(line.startswith(f"epochs {epochs}: ") and "default" in line for line in comments(job, cfg))
    given = _read(tmp_path, "hf", "given.json", json.dumps({**HF, "num_train_epochs": 2}))
    assert to_config(given)["epochs"] == 2 and not any("num_train_epochs not set" in n for n in given.notes)


BEST = {"load_best_model_at_end": True, "eval_strategy": "steps"}


@pytest.mark.parametrize(("args", "match", "fixed"), [
    ({"logging_steps": 0}, r"logging_steps 0: logging every 0 steps.*logging_strategy to epoch or no",
     {"logging_steps": 0, "logging_strategy": "epoch"}),
    ({"logging_steps": 0, "logging_strategy": "no", "eval_strategy": "steps"},
     r"eval_steps None: .*neither eval_steps nor logging_steps",
     {"logging_steps": 0, "logging_strategy": "no", "eval_strategy": "steps", "eval_steps": 50}),
    ({"save_steps": 12.5}, r"save_steps 12.5: a step count above 1 must be whole", {"save_steps": 0.125}),
    ({**BEST, "eval_steps": 200, "save_steps": 500}, r"save_steps 500: is not a whole multiple of eval_steps "
     r"200.*\(e.g. 400\)", {**BEST, "eval_steps": 250, "save_steps": 500}),
    ({**BEST, "eval_steps": 0.1, "save_steps": 500}, r"save_steps 500: is not a whole multiple",
     {**BEST, "eval_steps": 0.1, "save_steps": 0.2}),
    ({**BEST, "logging_steps": 300}, r"save_steps 500: is not a whole multiple of eval_steps 300",
     {**BEST, "logging_steps": 100}),  # eval_steps falls back to logging_steps
    ({**BEST, "save_steps": 7, "eval_steps": 5}, r"save_steps 7: is not a whole multiple",
     {**BEST, "save_strategy": "best", "save_steps": 7, "eval_steps": 5}),
    ({"load_best_model_at_end": True, "eval_strategy": "epoch"},
     r"load_best_model_at_end true: needs the save and eval strategies to match.*steps and epoch",
     {"load_best_model_at_end": True, "eval_strategy": "epoch", "save_strategy": "epoch"}),
    ({"fp16": True}, r"bf16 true: with fp16 also true", {"fp16": False}),
    ({"lr_scheduler_type": "reduce_lr_on_plateau"}, r"lr_scheduler_type reduce_lr_on_plateau: .*eval_strategy is no",
     {"lr_scheduler_type": "reduce_lr_on_plateau", "eval_strategy": "epoch"}),
    ({"warmup_steps": -5}, r"warmup_steps -5: a negative warmup", {"warmup_steps": 5}),
])
def test_trainer_refusals_exit_2(tmp_path: Path, args: dict, match: str, fixed: dict) -> None:
    """TrainingArguments that transformers' Trainer refuses in __post_init__ / _validate_args are refused as the
    Trainer would, naming the key and the fix; the fixed arguments, which the Trainer runs, read as before."""
    with pytest.raises(UserError, match=match):
        read_job("hf", _hf(tmp_path, **args), JobOptions(transformers="5.23.0"))
    read_job("hf", _hf(tmp_path, **fixed), JobOptions(transformers="5.23.0"))


def test_trainer_refusals_in_llamafactory_and_on_the_command_line(tmp_path: Path, capsys) -> None:
    """LLaMA-Factory v0 parses the same TrainingArguments: its YAML is refused at the key's line; a command line
    names the option with its dashes; `plan --from` exits 2."""
    with pytest.raises(UserError, match=r"lf.yaml:6: logging_steps 0: .*LLaMA-Factory"):
        _read(tmp_path, "llamafactory", "lf.yaml", LF + "logging_steps: 0\n")
    cmd = "torchrun --nproc_per_node 2 train.py --model_name_or_path Qwen/Qwen2.5-7B --bf16 True --logging_steps 0\n"
    with pytest.raises(UserError, match=r"--logging_steps 0: .*Set --logging_steps"):
        _read(tmp_path, "hf", "run.sh", cmd)
    assert main(["plan", "--from", "hf", str(tmp_path / "run.sh"), "--gpus", "2xH100"]) == 2
    assert "logging_steps" in capsys.readouterr().err


@pytest.mark.parametrize(("fsdp", "cfg", "match"), [
    ("hybrid_shard auto_wrap", {}, r"--fsdp hybrid_shard with FSDP2.*\"version\": 1"),
    ("full_shard", {"reshard_after_forward": "HYBRID_SHARD"}, r"reshard_after_forward 'HYBRID_SHARD' with FSDP2"),
])
def test_trainer_fsdp2_refuses_fsdp1_strategies(tmp_path: Path, fsdp: str, cfg: dict, match: str) -> None:
    """transformers 5.23 runs FSDP2 unless fsdp_config's version is 1, and refuses FSDP1's strategies there
    (`hybrid_shard` in --fsdp, a strategy name as reshard_after_forward); with version 1, or with a transformers
    that runs FSDP1 by default, the same options read as before."""
    args = {"fsdp": fsdp, "fsdp_config": cfg}
    with pytest.raises(UserError, match=match):
        read_job("hf", _hf(tmp_path, **args), JobOptions(nproc=8, transformers="5.23.0"))
    ok = read_job("hf", _hf(tmp_path, fsdp=fsdp, fsdp_config={**cfg, "version": 1}),
                  JobOptions(nproc=8, transformers="5.23.0"))
    assert ok.engine == "fsdp_full_shard" and ok.workload.fsdp1
    old = read_job("hf", _hf(tmp_path, **args), JobOptions(nproc=8, transformers="4.57.1"))
    assert old.engine == "fsdp_full_shard"


SFT_CLI = ("from trl import ModelConfig, ScriptArguments, SFTConfig, SFTTrainer, TrlParser\n"
           "parser = TrlParser((ScriptArguments, SFTConfig, ModelConfig))\n"
           "script_args, training_args, model_args = parser.parse_args_and_config()\n"
           "SFTTrainer(model=model_args.model_name_or_path, args=training_args).train()\n")
DPO = ("from trl import DPOConfig, DPOTrainer\n"
       "args = DPOConfig(output_dir='o', per_device_train_batch_size=8)\n"
       "DPOTrainer(model='Qwen/Qwen2.5-7B', args=args).train()\n")
RUN = ("python {script} --model_name_or_path Qwen/Qwen2.5-7B --per_device_train_batch_size 1 --bf16 True "
       "--eval_strategy steps --save_steps {save} --load_best_model_at_end True\n")


@pytest.mark.parametrize(("script", "fits", "misfits"), [(SFT_CLI, 100, 105), (DPO, 30, None)])
def test_trl_scripts_are_checked_with_trls_defaults(tmp_path: Path, script: str, fits: int,
                                                    misfits: int | None) -> None:
    """TRL's configs log every 10 steps (SFTConfig, DPOConfig, GRPOConfig and RLOOConfig alike: trl 0.19-1.16),
    not the HF Trainer's 500, and eval_steps falls back to logging_steps: save_steps 100 with
    load_best_model_at_end runs under an SFTConfig (a multiple of 10), so it is planned, while 105 is still refused
    naming TRL's default."""
    assert all(trainer_defaults(c)["logging_steps"] == 10 for c in ("SFTConfig", "GRPOConfig", "RLOOConfig"))
    assert trainer_defaults(None)["logging_steps"] == 500
    (tmp_path / "train.py").write_text(script)
    job = _read(tmp_path, "hf", "run.sh", RUN.format(script="train.py", save=fits))
    assert job.model == "Qwen/Qwen2.5-7B"
    if misfits is not None:
        with pytest.raises(UserError, match=r"--save_steps 105: is not a whole multiple of eval_steps 10.*TRL's "
                                            r"SFTConfig refuses"):
            _read(tmp_path, "hf", "run.sh", RUN.format(script="train.py", save=misfits))


@pytest.mark.parametrize(("tool", "name", "text", "key"), [
    ("hf", "args.json", json.dumps({**HF, "save_steps": float("inf"), "eval_strategy": "steps",
                                    "load_best_model_at_end": True}), "save_steps"),
    ("hf", "args.json", json.dumps({**HF, "logging_steps": float("nan")}), "logging_steps"),
    ("hf", "args.json", json.dumps({**HF, "use_lora": True, "lora_r": 1e400}), "lora_r"),
    ("llamafactory", "lf.yaml", LF + "save_steps: .inf\neval_strategy: steps\nload_best_model_at_end: true\n",
     "save_steps"),
    ("llamafactory", "lf.yaml", LF + "eval_steps: .nan\neval_strategy: steps\n", "eval_steps"),
    ("llamafactory", "lf.yaml", LF + "lora_rank: .inf\n", "lora_rank"),
    ("llamafactory", "lf.yaml", LF + "lora_dropout: .nan\n", "lora_dropout"),
])
def test_infinite_or_nan_numbers_exit_2_naming_the_key(tmp_path: Path, capsys, tool: str, name: str, text: str,
                                                        key: str) -> None:
    """An infinite or NaN step count or rank was an OverflowError (exit 1, "a bug in shardfit"): now exit 2."""
    (tmp_path / name).write_text(text)
    assert main(["plan", "--from", tool, str(tmp_path / name), "--gpus", "1xH100"]) == 2
    assert key in capsys.readouterr().err


SWIFT_RUN = "swift sft --model Qwen/Qwen2.5-7B --tuner_type lora --torch_dtype bfloat16 --dataset d.jsonl {extra}\n"


@pytest.mark.parametrize(("extra", "match"), [
    ("--load_best_model_at_end true", r"--load_best_model_at_end true without validation data.*--val_dataset"),
    ("--split_dataset_ratio 0.01 --save_steps 50 --eval_steps 30 --load_best_model_at_end true",
     r"--save_steps 50: is not a whole multiple of eval_steps 30.*ms-swift"),
    ("--logging_steps 0", r"--logging_steps 0: logging every 0 steps.*ms-swift"),
    ("--bf16 true --fp16 true", r"--bf16 true: with fp16 also true"),
    ("--fp16 true", r"--bf16 true: with fp16 also true"),  # bf16 unset: --torch_dtype bfloat16's
    ("--lr_scheduler_type reduce_lr_on_plateau --eval_strategy steps",
     r"--lr_scheduler_type reduce_lr_on_plateau: .*eval_strategy is no"),
])
def test_swift_runs_the_trainers_refusals_on_its_own_values(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                                             extra: str, match: str) -> None:
    """ms-swift builds transformers' Seq2SeqTrainingArguments from its own resolved values, so the HF Trainer's
    start-up refusals hold for it, with its defaults: evaluation off without validation data (whatever
    --eval_strategy says), eval_steps save_steps, logging_steps 5, bf16/fp16 from --torch_dtype unless given."""
    with pytest.raises(UserError, match=match):
        _read(tmp_path, "swift", "run.sh", SWIFT_RUN.format(extra=extra))
    assert main(["plan", "--from", "swift", str(tmp_path / "run.sh"), "--gpus", "1xH100"]) == 2
    assert "run.sh" in capsys.readouterr().err


@pytest.mark.parametrize("extra", [
    "--split_dataset_ratio 0.01 --save_steps 50 --load_best_model_at_end true",  # eval_steps: save_steps
    "--val_dataset v.jsonl --save_strategy epoch --load_best_model_at_end true",  # eval_strategy: save's
    "--logging_steps 0 --logging_strategy epoch", "--fp16 true --bf16 false",
])
def test_swift_jobs_the_trainer_runs_are_planned(tmp_path: Path, extra: str) -> None:
    """What ms-swift's defaults make consistent is not refused."""
    assert _read(tmp_path, "swift", "run.sh", SWIFT_RUN.format(extra=extra)).model == "Qwen/Qwen2.5-7B"


@pytest.mark.parametrize(("extra", "match"), [
    ("warmup_steps: 10\nwarmup_ratio: 0.1\n", r"ax.yml:\d+: 'warmup_steps' and 'warmup_ratio'"),
    ("save_strategy: epoch\nsave_steps: 100\n", r"'save_steps: 100' with 'save_strategy: epoch'.*save_strategy: steps"),
    ("saves_per_epoch: 2\nsave_steps: 100\n", r"'save_steps' and 'saves_per_epoch'"),
    ("eval_strategy: epoch\neval_steps: 50\n", r"'eval_steps: 50' with 'eval_strategy: epoch'"),
    ("val_set_size: 0\neval_steps: 50\n", r"'eval_steps' with 'val_set_size: 0'"),
    ("evals_per_epoch: 4\neval_steps: 50\n", r"'eval_steps' and 'evals_per_epoch'"),
    ("evals_per_epoch: 4\neval_strategy: epoch\n", r"'eval_strategy: epoch' with 'evals_per_epoch'"),
    ("early_stopping_patience: 3\nsave_steps: 100\n", r"'early_stopping_patience' without both"),
    ("early_stopping_patience: 3\nsave_steps: 100\neval_steps: 30\n", r"save_steps 100 not a multiple of eval_steps"),
])
def test_axolotl_schedule_refusals(tmp_path: Path, capsys: pytest.CaptureFixture[str], extra: str,
                                   match: str) -> None:
    """axolotl's schema refuses these schedules before anything loads (utils/schemas/validation.py, 0.19.0):
    exit 2 naming the file, the line and the key."""
    with pytest.raises(UserError, match=match):
        _read(tmp_path, "axolotl", "ax.yml", AXOLOTL + extra)
    assert main(["plan", "--from", "axolotl", str(tmp_path / "ax.yml"), "--gpus", "1xH100"]) == 2
    assert "ax.yml" in capsys.readouterr().err


@pytest.mark.parametrize("extra", [
    "save_strategy: steps\nsave_steps: 100\n", "val_set_size: 0\neval_strategy: 'no'\n", "evals_per_epoch: 4\n",
    "early_stopping_patience: 3\nsave_steps: 100\neval_steps: 50\n", "val_set_size: 0.05\neval_steps: 50\n",
])
def test_axolotl_schedules_it_accepts_are_planned(tmp_path: Path, extra: str) -> None:
    """What axolotl's schema lets through is not refused (HF Trainer checks are not assumed for axolotl)."""
    assert _read(tmp_path, "axolotl", "ax.yml", AXOLOTL + extra).model == "Qwen/Qwen2.5-7B"
