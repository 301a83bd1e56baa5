"""TRL jobs read with TRL's own defaults: its configs train in bf16 unless fp16 is set (TRL >= 0.19,
`bf16=None` resolved to `not fp16`), which beats accelerate's mixed precision and a DeepSpeed JSON's, while an
explicit bf16 false or fp16 true wins; a script that builds the Trainer's own TrainingArguments keeps theirs."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from shardfit.errors import UserError
from shardfit.foreign.convert import to_config
from shardfit.foreign.read import JobOptions, read_job

SFT = ("from trl import ModelConfig, ScriptArguments, SFTConfig, SFTTrainer, TrlParser\n"
       "parser = TrlParser((ScriptArguments, SFTConfig, ModelConfig))\n"
       "script_args, training_args, model_args = parser.parse_args_and_config()\n"
       "SFTTrainer(model=model_args.model_name_or_path, args=training_args).train()\n")
DPO = ("from trl import DPOConfig, DPOTrainer\n"
       "args = DPOConfig(output_dir='o', per_device_train_batch_size=1{extra})\n"
       "DPOTrainer(model='Qwen/Qwen2.5-0.5B', args=args).train()\n")
HF_ARGS = ("from transformers import TrainingArguments\nfrom trl import SFTTrainer\n"
           "args = TrainingArguments(output_dir='o', per_device_train_batch_size=1)\n"
           "SFTTrainer(model='Qwen/Qwen2.5-0.5B', args=args).train()\n")
BARE = ("from trl import SFTTrainer\n"
        "SFTTrainer(model='Qwen/Qwen2.5-0.5B', train_dataset=None).train()\n")
RUN = "{launch} train.py --model_name_or_path Qwen/Qwen2.5-0.5B --per_device_train_batch_size 1 {flags}\n"


def _job(tmp_path: Path, script: str, flags: str = "", launch: str = "python"):
    (tmp_path / "train.py").write_text(script)
    (tmp_path / "run.sh").write_text(RUN.format(launch=launch, flags=flags))
    return read_job("hf", str(tmp_path / "run.sh"), JobOptions(transformers="5.23.0"))


@pytest.mark.parametrize("script", [SFT, DPO.format(extra=""), BARE])
def test_trl_configs_default_to_bf16(tmp_path: Path, script: str) -> None:
    """No precision flag under a TRL config (named, or the trainer's own when the script passes none): bf16, said
    as TRL's default, and carried into the converted config."""
    job = _job(tmp_path, script)
    assert job.workload.precision == "bf16"
    assert any("TRL's" in n and "default" in n and "bf16" in n for n in job.notes), job.notes
    assert to_config(job)["precision"] == "bf16"


@pytest.mark.parametrize(("script", "flags", "precision"), [
    (SFT, "--bf16 False", "fp32"), (SFT, "--fp16 True", "fp16"), (SFT, "--fp16 False", "bf16"),
    (DPO.format(extra=", bf16=False"), "", "fp32"), (DPO.format(extra=", fp16=True"), "", "fp16"),
    (HF_ARGS, "", "fp32"),
])
def test_explicit_precision_and_hf_arguments_win(tmp_path: Path, script: str, flags: str, precision: str) -> None:
    """bf16 false or fp16 true, on the command line or in the config's call, wins over TRL's default (fp16 false
    leaves it); so do the Trainer's own TrainingArguments, which TRL's trainers copy field by field (bf16 false)."""
    job = _job(tmp_path, script, flags)
    assert job.workload.precision == precision
    assert any("TRL's" in n and "bf16" in n for n in job.notes) == (precision == "bf16")  # fp16 false: TRL's


def test_trl_default_beats_accelerate_and_deepspeed_json(tmp_path: Path) -> None:
    """TRL sets bf16 before TrainingArguments reads ACCELERATE_MIXED_PRECISION, so an accelerate config's fp16
    does not apply; a DeepSpeed JSON's "auto" takes the args' bf16."""
    (tmp_path / "acc.yaml").write_text("compute_environment: LOCAL_MACHINE\ndistributed_type: MULTI_GPU\n"
                                       "mixed_precision: fp16\nnum_processes: 2\n")
    job = _job(tmp_path, SFT, launch="accelerate launch --config_file acc.yaml")
    assert job.workload.precision == "bf16"
    (tmp_path / "ds.json").write_text(json.dumps({"fp16": {"enabled": "auto"}, "bf16": {"enabled": "auto"},
                                                  "zero_optimization": {"stage": 2}}))
    job = _job(tmp_path, SFT, flags="--deepspeed ds.json", launch="torchrun --nproc_per_node 2")
    assert job.workload.precision == "bf16"


@pytest.mark.parametrize(("script", "enabled", "flags", "refused"), [
    (SFT, {"fp16": {"enabled": True}}, "", "fp16.enabled is true while --fp16 resolves to false"),
    (SFT, {"bf16": {"enabled": False}}, "", "bf16.enabled is false while --bf16 resolves to true (TRL's default"),
    (HF_ARGS, {"bf16": {"enabled": True}}, "", "bf16.enabled is true while --bf16 resolves to false"),
    (HF_ARGS, {"fp16": {"enabled": True}}, "--fp16 true", None),
    (SFT, {"fp16": {"enabled": True}}, "--fp16 true", None),
])
def test_a_deepspeed_json_contradicting_the_arguments_is_refused(tmp_path: Path, script: str, enabled: dict,
                                                                 flags: str, refused: str | None) -> None:
    """A JSON's explicit fp16/bf16 `enabled` that differs from what the arguments resolve to (TRL: bf16 unless
    fp16) was planned in either precision, but transformers' HfTrainerDeepSpeedConfig raises on the mismatch
    before step 1: exit 2 naming the JSON key and the flag. Agreeing values, and "auto", plan."""
    (tmp_path / "ds.json").write_text(json.dumps({**enabled, "zero_optimization": {"stage": 2}}))
    if refused is None:
        job = _job(tmp_path, script, flags=f"--deepspeed ds.json {flags}", launch="torchrun --nproc_per_node 2")
        assert job.workload.precision == "fp16"
        return
    with pytest.raises(UserError, match=re.escape(refused)) as e:
        _job(tmp_path, script, flags=f"--deepspeed ds.json {flags}", launch="torchrun --nproc_per_node 2")
    assert "ds.json" in str(e.value) and '"auto"' in str(e.value)


@pytest.mark.parametrize(("flags", "method", "rank", "alpha"), [
    ("--use_peft", "lora", 16, 32), ("--use_peft --lora_r 8 --lora_alpha 16", "lora", 8, 16),
    ("--use_peft --load_in_4bit", "qlora", 16, 32), ("--lora_r 8", "full", None, None), ("", "full", None, None),
])
def test_trl_model_config_decides_lora(tmp_path: Path, flags: str, method: str, rank: int | None,
                                       alpha: int | None) -> None:
    """A script parsing TRL's ModelConfig trains LoRA only with --use_peft (r 16, alpha 32 by default; QLoRA with
    --load_in_4bit), and checkpoints by TRL's default: --lora_r alone trains every weight."""
    job = _job(tmp_path, SFT, flags)
    assert job.workload.method == method and job.workload.grad_ckpt == "full"
    assert not {"use_peft", "load_in_4bit"} & set(job.not_modelled)
    if rank is not None:
        assert job.workload.lora_rank == rank and to_config(job)["lora"]["alpha"] == alpha


def test_trl_cli_is_read_as_the_trl_script_it_launches(tmp_path: Path) -> None:
    """`trl sft ...` runs TRL's sft.py under accelerate launch: its accelerate options (--num_processes) set the
    ranks, the rest are SFTConfig's and ModelConfig's; `trl dpo` is TRL's DPO trainer."""
    (tmp_path / "run.sh").write_text("trl sft --model_name_or_path Qwen/Qwen2.5-0.5B --per_device_train_batch_size 1 "
                                     "--num_processes 4 --use_peft --max_length 1024\n")
    job = read_job("hf", str(tmp_path / "run.sh"), JobOptions(transformers="5.23.0"))
    assert (job.nproc, job.workload.method, job.workload.precision) == (4, "lora", "bf16")
    assert "num_processes" not in job.keys and "num_processes" not in job.not_modelled
    (tmp_path / "dpo.sh").write_text("trl dpo --model_name_or_path Qwen/Qwen2.5-0.5B --num_processes 1\n")
    assert read_job("hf", str(tmp_path / "dpo.sh"), JobOptions(transformers="5.23.0")).workload.objective == "dpo"


@pytest.mark.parametrize("launch", ["trl sft --num_processes 2", "python train.py"])
def test_trl_lora_modules_to_save_are_planned(tmp_path: Path, launch: str) -> None:
    """ModelConfig's --lora_modules_to_save (peft's modules_to_save: a full trainable copy of the embedding and the
    head) was 'not modelled', so a 7B job with it was planned ~16 GiB low; LF, axolotl and ms-swift plan it."""
    (tmp_path / "train.py").write_text(SFT)
    (tmp_path / "run.sh").write_text(f"{launch} --model_name_or_path Qwen/Qwen2.5-0.5B --use_peft "
                                     "--lora_target_modules all-linear --lora_modules_to_save embed_tokens lm_head\n")
    job = read_job("hf", str(tmp_path / "run.sh"), JobOptions(transformers="5.23.0"))
    assert job.workload.lora_saved == ("embed", "head")
    assert "lora_modules_to_save" not in job.not_modelled


@pytest.mark.parametrize(("name", "engine", "stage"), [
    ("zero3", "deepspeed", 3), ("zero2", "deepspeed", 2), ("fsdp2", "fsdp_full", None), ("multi_gpu", "ddp", None),
])
def test_trl_accelerate_config_names_a_bundled_config(tmp_path: Path, name: str, engine: str,
                                                      stage: int | None) -> None:
    """`trl sft --accelerate_config zero3` names the config TRL ships (no file of that name here); it was taken for
    a missing file and planned unsharded. An unknown name, or none, TRL refuses: exit 2."""
    run = "trl sft --model_name_or_path Qwen/Qwen2.5-0.5B --num_processes 8 --accelerate_config {}\n"
    (tmp_path / "run.sh").write_text(run.format(name))
    job = read_job("hf", str(tmp_path / "run.sh"), JobOptions(transformers="5.23.0"))
    assert job.nproc == 8 and job.engine.startswith(engine), (job.engine, job.notes)
    assert (job.zero.stage if job.zero else None) == stage
    for bad in ("zero4", ""):
        (tmp_path / "run.sh").write_text(run.format(bad))
        with pytest.raises(UserError, match="--accelerate_config"):
            read_job("hf", str(tmp_path / "run.sh"), JobOptions(transformers="5.23.0"))


def test_trl_config_yaml_is_read_as_the_command_line(tmp_path: Path) -> None:
    """`trl sft --config sft.yaml` (TRL's documented form) exited 2 for want of --model_name_or_path, and its
    use_peft and batch would have been ignored; the YAML's keys are the command line's now, which win over them,
    and its accelerate keys set the launch."""
    (tmp_path / "sft.yaml").write_text("model_name_or_path: Qwen/Qwen2.5-0.5B\nuse_peft: true\nlora_r: 8\n"
                                       "per_device_train_batch_size: 4\nnum_processes: 4\n"
                                       "lora_target_modules: [q_proj, v_proj]\n")
    (tmp_path / "run.sh").write_text("trl sft --config sft.yaml --lora_r 32\n")
    job = read_job("hf", str(tmp_path / "run.sh"), JobOptions(transformers="5.23.0"))
    assert (job.model, job.nproc, job.workload.method, job.workload.lora_rank) == ("Qwen/Qwen2.5-0.5B", 4, "lora",
                                                                                    32)
    assert job.workload.micro_batch == 4
    (tmp_path / "run.sh").write_text("trl sft --config gone.yaml\n")
    with pytest.raises(UserError, match="--config gone.yaml"):
        read_job("hf", str(tmp_path / "run.sh"), JobOptions(transformers="5.23.0"))


def test_a_trl_parser_script_reads_its_config_yaml(tmp_path: Path) -> None:
    """`python sft.py --config sft.yaml` with a script parsing by TrlParser exited 2 for want of
    --model_name_or_path: the YAML was read only under `trl sft`. TrlParser makes its keys the dataclasses'
    defaults, so the command line's --lora_r 32 wins over the YAML's 8."""
    (tmp_path / "sft.yaml").write_text("model_name_or_path: Qwen/Qwen2.5-0.5B\nuse_peft: true\nlora_r: 8\n"
                                       "per_device_train_batch_size: 4\n")
    (tmp_path / "train.py").write_text(SFT)
    (tmp_path / "run.sh").write_text("python train.py --config sft.yaml --lora_r 32\n")
    job = read_job("hf", str(tmp_path / "run.sh"), JobOptions(transformers="5.23.0"))
    assert (job.model, job.workload.method, job.workload.lora_rank, job.workload.micro_batch) == \
        ("Qwen/Qwen2.5-0.5B", "lora", 32, 4)


def test_lora_config_modules_to_save_in_the_script_is_planned(tmp_path: Path) -> None:
    """LoraConfig(modules_to_save=[...]) in the script's code trains full copies of the embedding and the head, as
    the flag's spelling does; it was not read."""
    script = ("from peft import LoraConfig\nfrom transformers import Trainer, TrainingArguments\n"
              "cfg = LoraConfig(r=8, target_modules=['q_proj', 'v_proj'], modules_to_save=['embed_tokens', "
              "'lm_head'])\nTrainer(args=TrainingArguments(output_dir='o')).train()\n")
    job = _job(tmp_path, script)
    assert job.workload.method == "lora" and job.workload.lora_saved == ("embed", "head"), job.notes


@pytest.mark.parametrize(("model", "targets"), [
    ("Qwen/Qwen2.5-0.5B", ("q", "v")), ("meta-llama/Llama-3.1-8B", ("q", "v")), ("Qwen/Qwen3-30B-A3B", None),
])
def test_use_peft_without_targets_takes_peft_defaults(tmp_path: Path, model: str, targets: tuple | None) -> None:
    """TRL's --use_peft without --lora_target_modules builds LoraConfig(target_modules=None): peft takes its
    default for the model's type (q_proj, v_proj for qwen2 and llama), and raises for a type it has none for
    (qwen3_moe); it was planned as every linear layer."""
    (tmp_path / "train.py").write_text(SFT)
    (tmp_path / "run.sh").write_text(f"python train.py --model_name_or_path {model} --use_peft\n")
    if targets is None:
        with pytest.raises(UserError, match="Please specify `target_modules`"):
            read_job("hf", str(tmp_path / "run.sh"), JobOptions(transformers="5.23.0"))
        return
    job = read_job("hf", str(tmp_path / "run.sh"), JobOptions(transformers="5.23.0"))
    assert job.workload.lora_targets == targets
    assert any("peft's default" in n for n in job.notes)
    assert to_config(job)["lora"]["targets"] == ["q_proj", "v_proj"]


def test_the_bf16_default_note_says_what_transformers_does_on_older_gpus(tmp_path: Path) -> None:
    """transformers 5 checks bf16 with torch.cuda.is_bf16_supported(), which counts torch's emulation, so a T4 or
    V100 runs TRL's bf16 default (slowly) rather than being refused; the note said transformers refuses it."""
    note = next(n for n in _job(tmp_path, SFT).notes if "TRL's SFTConfig default" in n and "bf16" in n)
    assert "is_bf16_supported" in note and "lets it run" in note and "transformers refuses" not in note


def test_one_lora_target_module_reaches_peft_as_a_pattern(tmp_path: Path) -> None:
    """TRL's ModelConfig (trl 1.16 `__post_init__`) unwraps --lora_target_modules of one entry into a string, which
    peft reads as a regular expression over whole module names: `q_proj` matches none (peft raises), `.*q_proj`
    adapts the q projections. It was planned as the list [q_proj]."""
    with pytest.raises(UserError, match=r"TRL's ModelConfig hands peft .* one entry as this string"):
        _job(tmp_path, SFT, "--use_peft --lora_target_modules q_proj")
    job = _job(tmp_path, SFT, "--use_peft --lora_target_modules '.*q_proj'")
    assert job.workload.lora_targets == ("q",)
    # argparse splits on spaces, not commas: `q_proj,v_proj` is one entry, a pattern no module name matches
    with pytest.raises(UserError, match=r"one entry as this string"):
        _job(tmp_path, SFT, "--use_peft --lora_target_modules q_proj,v_proj")
    assert _job(tmp_path, SFT, "--use_peft --lora_target_modules q_proj v_proj").workload.lora_targets == ("q", "v")


def test_trl_config_env_is_applied_as_trl_parser_sets_it(tmp_path: Path) -> None:
    """A TrlParser YAML's `env:` was dropped: TRL exports it before it parses, over the shell's values. Under
    `trl sft` accelerate then counts the GPUs its CUDA_VISIBLE_DEVICES leaves (2 ranks, not every GPU); the
    allocator's and NCCL's settings are shown as not modelled, a WANDB_* variable as changing nothing."""
    (tmp_path / "sft.yaml").write_text("model_name_or_path: Qwen/Qwen2.5-0.5B\nenv:\n  CUDA_VISIBLE_DEVICES: '0,1'\n"
                                       "  PYTORCH_CUDA_ALLOC_CONF: expandable_segments:True\n  NCCL_BUFFSIZE: 8388608\n"
                                       "  WANDB_PROJECT: x\n")
    (tmp_path / "run.sh").write_text("CUDA_VISIBLE_DEVICES=0,1,2,3 trl sft --config sft.yaml\n")
    job = read_job("hf", str(tmp_path / "run.sh"), JobOptions(transformers="5.23.0"))
    assert job.nproc == 2 and not job.every_gpu
    assert job.keys["env CUDA_VISIBLE_DEVICES"] == "0,1 (GPUs)"
    assert job.not_modelled["env PYTORCH_CUDA_ALLOC_CONF"] == "expandable_segments:True"
    assert job.not_modelled["env NCCL_BUFFSIZE"] == "8388608"  # a YAML number, exported as its text
    assert "env WANDB_PROJECT" in job.keys and "env" not in job.keys and "env" not in job.not_modelled
    note = next(n for n in job.notes if n.startswith("sft.yaml's env:"))
    assert "CUDA_VISIBLE_DEVICES=0,1" in note and "over the shell's CUDA_VISIBLE_DEVICES=0,1,2,3" in note


def test_trl_parser_script_env_reaches_its_processes_not_the_launcher(tmp_path: Path) -> None:
    """In a script, TrlParser sets the YAML's env in each process after the launcher started it: one process with
    device_map='auto' splits the model over the GPUs that env leaves; torchrun's rank count stays its own, and
    ranks past those GPUs are said to have none."""
    (tmp_path / "sft.yaml").write_text("model_name_or_path: Qwen/Qwen2.5-0.5B\nenv:\n  CUDA_VISIBLE_DEVICES: 0,1,2\n")
    (tmp_path / "train.py").write_text(SFT.replace("SFTTrainer(model=", "AutoModelForCausalLM.from_pretrained("
                                                   "'x', device_map='auto')\nSFTTrainer(model="))
    (tmp_path / "run.sh").write_text("python train.py --config sft.yaml\n")
    job = read_job("hf", str(tmp_path / "run.sh"), JobOptions(transformers="5.23.0"))
    assert (job.engine, job.gpus) == ("device_map", 3)
    (tmp_path / "train.py").write_text(SFT)
    (tmp_path / "sft.yaml").write_text("model_name_or_path: Qwen/Qwen2.5-0.5B\nenv:\n  CUDA_VISIBLE_DEVICES: 0\n")
    (tmp_path / "run.sh").write_text("torchrun --nproc_per_node 4 train.py --config sft.yaml\n")
    job = read_job("hf", str(tmp_path / "run.sh"), JobOptions(transformers="5.23.0"))
    assert job.nproc == 4 and job.keys["env CUDA_VISIBLE_DEVICES"] == "0 (GPUs)"
    assert any("invalid device ordinal" in n for n in job.notes), job.notes


@pytest.mark.parametrize(("env", "named"), [
    ("env: CUDA_VISIBLE_DEVICES=0\n", "sft.yaml:2: 'env' is str"), ("env:\n", "sft.yaml:2: 'env' is empty"),
    ("env: [A, B]\n", "'env' is list"), ("env:\n  CUDA_VISIBLE_DEVICES: [0, 1]\n", "sft.yaml:3: env.CUDA_VISIBLE"),
    ("env:\n  WANDB_PROJECT:\n", "sft.yaml:3: env.WANDB_PROJECT is empty"),
    ("env:\n  1: x\n", "env name 1 is a YAML int"), ("env:\n  true: x\n", "env name True is a YAML bool"),
    ("env:\n  null: x\n", "env name None is a YAML NoneType"), ("env:\n  A=B: x\n", "env name 'A=B' holds '='"),
    ("env:\n  '': x\n", "env name '' is empty"), ('env:\n  X: "a\\0b"\n', "sft.yaml:3: env.X holds a NUL byte"),
    ("env:\n  A_SET: !!set {a, b}\n", "sft.yaml:3: env.A_SET is a YAML set"),
    ("env:\n  A_BIN: !!binary aGVsbG8=\n", "sft.yaml:3: env.A_BIN is a YAML bytes"),
])
def test_a_trl_config_env_that_is_no_mapping_of_strings_exits_2(tmp_path: Path, env: str, named: str) -> None:
    """TRL refuses an `env` that is not a mapping; a list, mapping or empty value it would export as Python's text
    of it. Each is an error naming the file, line and key, never a traceback."""
    (tmp_path / "sft.yaml").write_text("model_name_or_path: Qwen/Qwen2.5-0.5B\n" + env)
    (tmp_path / "run.sh").write_text("trl sft --config sft.yaml\n")
    with pytest.raises(UserError, match=re.escape(named)):
        read_job("hf", str(tmp_path / "run.sh"), JobOptions(transformers="5.23.0"))


@pytest.mark.parametrize("run", ["torchrun --nproc_per_node 4 train.py --config sft.yaml",
                                 "accelerate launch --num_processes 4 train.py --config sft.yaml",
                                 "trl sft --config sft.yaml --num_processes 4"])
def test_a_trl_config_env_accelerate_variable_builds_the_plugin(tmp_path: Path, run: str) -> None:
    """A YAML env ACCELERATE_USE_FSDP was listed as "no effect" and the job planned as DDP: TrlParser exports it
    before the Trainer builds its Accelerator, which then builds the FSDP plugin from it (accelerate launch copies
    the environment and sets the variable only for its own FSDP or DeepSpeed launches)."""
    (tmp_path / "sft.yaml").write_text("model_name_or_path: Qwen/Qwen2.5-0.5B\nenv:\n  ACCELERATE_USE_FSDP: 'true'\n"
                                       "  ACCELERATE_LOG_LEVEL: info\n")
    (tmp_path / "train.py").write_text(SFT)
    (tmp_path / "run.sh").write_text(run + "\n")
    job = read_job("hf", str(tmp_path / "run.sh"), JobOptions(transformers="5.23.0"))
    assert (job.nproc, job.engine) == (4, "fsdp_full_shard")
    assert job.keys["env ACCELERATE_USE_FSDP"] == "true (FSDP plugin)"
    assert job.not_modelled["env ACCELERATE_LOG_LEVEL"] == "info"


@pytest.mark.parametrize("value", ['""', "'-1'", "false", "'x,0'"])
@pytest.mark.parametrize("run", ["trl sft --config sft.yaml", "python train.py --config sft.yaml"])
def test_a_trl_config_env_hiding_every_gpu_exits_2(tmp_path: Path, value: str, run: str) -> None:
    """A YAML CUDA_VISIBLE_DEVICES that CUDA reads as no GPU ("", -1, False, an id it stops at) was planned as
    every GPU or as one; the job sees none. Exit 2 naming the file, the line and the value."""
    (tmp_path / "sft.yaml").write_text("model_name_or_path: Qwen/Qwen2.5-0.5B\nenv:\n"
                                       f"  CUDA_VISIBLE_DEVICES: {value}\n")
    (tmp_path / "train.py").write_text(SFT)
    (tmp_path / "run.sh").write_text(run + "\n")
    with pytest.raises(UserError, match=r"sft\.yaml:3: env\.CUDA_VISIBLE_DEVICES .*no GPU"):
        read_job("hf", str(tmp_path / "run.sh"), JobOptions(transformers="5.23.0"))


def test_cuda_visible_devices_stops_at_the_first_entry_cuda_cannot_read() -> None:
    """CUDA takes the ids before the first entry that is not an ordinal or a GPU-/MIG- id."""
    from shardfit.foreign.shell import hides_every_gpu, visible_devices
    assert visible_devices({"CUDA_VISIBLE_DEVICES": "0, 1,-1,2"}) == ["0", "1"]
    assert visible_devices({"CUDA_VISIBLE_DEVICES": "GPU-ab12,MIG-cd34"}) == ["GPU-ab12", "MIG-cd34"]
    assert hides_every_gpu({"CUDA_VISIBLE_DEVICES": ""}) and not hides_every_gpu({})


def test_ranks_past_the_yaml_env_gpus_are_caught_under_every_launch(tmp_path: Path) -> None:
    """The "no device" note was missing where ranks outnumber the YAML env's GPUs: `accelerate launch` with no
    --num_processes (one rank per GPU) now notes it, and `trl sft --num_processes 4` with two GPUs exits 2, as the
    trl CLI exports the variable before the ranks start and ranks 2 and 3 cannot start."""
    (tmp_path / "sft.yaml").write_text("model_name_or_path: Qwen/Qwen2.5-0.5B\nenv:\n  CUDA_VISIBLE_DEVICES: '0'\n")
    (tmp_path / "train.py").write_text(SFT)
    (tmp_path / "run.sh").write_text("accelerate launch train.py --config sft.yaml\n")
    job = read_job("hf", str(tmp_path / "run.sh"), JobOptions(transformers="5.23.0"))
    assert job.every_gpu and any("invalid device ordinal" in n for n in job.notes), job.notes
    (tmp_path / "sft.yaml").write_text("model_name_or_path: Qwen/Qwen2.5-0.5B\nenv:\n  CUDA_VISIBLE_DEVICES: 0,1\n")
    (tmp_path / "run.sh").write_text("trl sft --config sft.yaml --num_processes 4\n")
    with pytest.raises(UserError, match=r"sft\.yaml: env\.CUDA_VISIBLE_DEVICES is 0,1, 2 GPU\(s\), .* 4 ranks"):
        read_job("hf", str(tmp_path / "run.sh"), JobOptions(transformers="5.23.0"))


@pytest.mark.parametrize("run", ["python train.py --config=sft.yaml", "trl sft --config=sft.yaml"])
def test_config_joined_by_an_equals_sign_exits_2(tmp_path: Path, run: str) -> None:
    """TrlParser looks for the word `--config`; `--config=sft.yaml` was read and planned, though the real run
    stops at start ("Some specified arguments are not used by the HfArgumentParser"). Exit 2 naming the fix."""
    (tmp_path / "sft.yaml").write_text("model_name_or_path: Qwen/Qwen2.5-0.5B\n")
    (tmp_path / "train.py").write_text(SFT)
    (tmp_path / "run.sh").write_text(run + "\n")
    with pytest.raises(UserError, match="Write --config sft.yaml"):
        read_job("hf", str(tmp_path / "run.sh"), JobOptions(transformers="5.23.0"))


def test_rank_variables_in_a_trl_config_env_count_no_ranks(tmp_path: Path) -> None:
    """A YAML env WORLD_SIZE / NPROC_PER_NODE was labelled "(ranks)" though nothing counted it. They are not
    modelled now, with a note; a WORLD_SIZE other than the ranks started hangs the rendezvous: exit 2."""
    (tmp_path / "train.py").write_text(SFT)
    (tmp_path / "sft.yaml").write_text("model_name_or_path: Qwen/Qwen2.5-0.5B\nenv:\n  NPROC_PER_NODE: 2\n")
    (tmp_path / "run.sh").write_text("trl sft --config sft.yaml --num_processes 4\n")
    job = read_job("hf", str(tmp_path / "run.sh"), JobOptions(transformers="5.23.0"))
    assert job.nproc == 4 and job.not_modelled["env NPROC_PER_NODE"] == "2" and "env NPROC_PER_NODE" not in job.keys
    assert any("count no ranks" in n for n in job.notes), job.notes
    (tmp_path / "sft.yaml").write_text("model_name_or_path: Qwen/Qwen2.5-0.5B\nenv:\n  WORLD_SIZE: 8\n")
    (tmp_path / "run.sh").write_text("torchrun --nproc_per_node 4 train.py --config sft.yaml\n")
    with pytest.raises(UserError, match=r"sft\.yaml: env\.WORLD_SIZE is 8, but the launch starts 4 rank"):
        read_job("hf", str(tmp_path / "run.sh"), JobOptions(transformers="5.23.0"))


def test_a_shell_cuda_visible_devices_hiding_every_gpu_exits_2(tmp_path: Path) -> None:
    """`CUDA_VISIBLE_DEVICES= torchrun ...` (or -1) leaves the job no GPU; it was planned on every GPU."""
    (tmp_path / "train.py").write_text(SFT)
    (tmp_path / "run.sh").write_text("CUDA_VISIBLE_DEVICES=-1 torchrun --nproc_per_node 2 train.py "
                                     "--model_name_or_path Qwen/Qwen2.5-0.5B\n")
    with pytest.raises(UserError, match=r"run\.sh: CUDA_VISIBLE_DEVICES='-1' leaves CUDA no GPU"):
        read_job("hf", str(tmp_path / "run.sh"), JobOptions(transformers="5.23.0"))
