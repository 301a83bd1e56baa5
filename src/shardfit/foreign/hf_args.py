"""Where an HF Trainer job's arguments come from besides its command line: the training script's own
code, TRL's `trl <command>` line, and the YAML TrlParser reads with `--config` (its arguments, its `env:`
section, and TRL's ModelConfig arguments read as TRL does)."""

from __future__ import annotations

from pathlib import Path

from shardfit.errors import UserError
from shardfit.foreign.accelerate import TRL_CONFIGS
from shardfit.foreign.arg_files import follow_arg_file
from shardfit.foreign.arg_nulls import NULL_KEYS
from shardfit.foreign.common import load_yaml, local_file, read_text, record
from shardfit.foreign.job import ForeignJob
from shardfit.foreign.keys import Source
from shardfit.foreign.script_ast import ScriptSettings, read_script
from shardfit.foreign.shell import Command, visible_devices
from shardfit.foreign.trl_env import trl_env

# The variables torch's launchers set in each rank for its rendezvous: one a TrlParser YAML sets replaces the
# launcher's in every rank before the process group starts (and accelerate launch never reads NPROC_PER_NODE).
RANK_ENV = ("WORLD_SIZE", "RANK", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "NODE_RANK", "NPROC_PER_NODE",
            "GPUS_PER_NODE")


def config_rank_env(job: ForeignJob, code: ScriptSettings, cmd: Command | None) -> None:
    """A TrlParser YAML's rank variables (RANK_ENV, MASTER_*) count no ranks: filed as not modelled, with a note.
    Its WORLD_SIZE overrides the launcher's in every rank, so one other than the ranks the launch starts makes the
    rendezvous wait for ranks that never come: a UserError."""
    given = [k for k in code.config_env if k in RANK_ENV or k.startswith("MASTER_")]
    for key in given:
        job.keys.pop(f"env {key}", None)
        record(job, f"env {key}", code.config_env[key], modelled=False)
    if not given:
        return
    ranks = None  # one per GPU the machine shows, or a launcher's own default: not known here
    if job.nproc and not job.every_gpu:
        ranks = job.nproc * job.nnodes
    elif not job.every_gpu and (cmd is None or cmd.launcher is None):
        ranks = 1  # `python train.py`: one process
    world = code.config_env.get("WORLD_SIZE")
    if world is not None and ranks is not None and world.strip() != str(ranks):
        raise UserError(f"{code.config_file}: env.WORLD_SIZE is {world}, but the launch starts {ranks} rank(s): "
                        f"TrlParser sets it in every rank over the launcher's value, so the process group waits "
                        f"for {world} ranks and hangs. Remove WORLD_SIZE from env (the launcher sets it).")
    job.notes.append(f"{code.config_file}'s env: {', '.join(given)} replace the launcher's own in each rank; they "
                     f"count no ranks here (the launch does) and are best left to the launcher")


def config_env_notes(job: ForeignJob, code: ScriptSettings, shell: dict[str, str], cmd: Command | None) -> None:
    """Say what the TrlParser YAML's `env:` set, over which of the shell's values, and what its
    CUDA_VISIBLE_DEVICES does: under `trl <command>` accelerate counts those GPUs; in a script TrlParser sets it in
    each rank after the launcher has counted, so a rank past the GPUs it leaves has no device of its own."""
    if not code.config_env:
        return
    trl_cli = cmd is not None and cmd.program.startswith("trl ")
    over = [f"{k}={shell[k]}" for k in code.config_env if k in shell and shell[k] != code.config_env[k]]
    job.notes.append(f"{code.config_file}'s env: sets " + ", ".join(f"{k}={v}" for k, v in code.config_env.items())
                     + (" before `trl` starts accelerate" if trl_cli else " in the script's processes") +
                     " (TrlParser exports it into os.environ" + (f", over the shell's {', '.join(over)}" if over
                                                                 else "") + ")")
    gpus = visible_devices(code.config_env)
    if not gpus:
        return
    value = code.config_env["CUDA_VISIBLE_DEVICES"]
    if trl_cli and job.nproc is not None and job.nproc > len(gpus):
        # the trl CLI exports it before accelerate starts the ranks: each sees these GPUs from its first line
        raise UserError(f"{code.config_file}: env.CUDA_VISIBLE_DEVICES is {value}, {len(gpus)} GPU(s), but "
                        f"--num_processes starts {job.nproc} ranks a machine: ranks {len(gpus)} and up have no GPU "
                        f"and fail (\"invalid device ordinal\"), so the job cannot start. Pass --num_processes "
                        f"{len(gpus)}, or list {job.nproc} GPUs in env.CUDA_VISIBLE_DEVICES.")
    if trl_cli:
        return
    if job.nproc is not None and job.nproc > len(gpus):
        job.notes.append(f"{code.config_file}'s env: CUDA_VISIBLE_DEVICES={value} leaves each of the {job.nproc} "
                         f"ranks {len(gpus)} GPU(s): a rank whose LOCAL_RANK is past them has no device (\"invalid "
                         f"device ordinal\") unless CUDA started before TrlParser ran")
    elif job.every_gpu:
        job.notes.append(f"{code.config_file}'s env: CUDA_VISIBLE_DEVICES={value} leaves each rank {len(gpus)} "
                         f"GPU(s), but the launch starts one rank per GPU the machine shows: on a machine with more, "
                         f"a rank whose LOCAL_RANK is past them has no device (\"invalid device ordinal\") unless "
                         f"CUDA started before TrlParser ran")


def script_settings(script: Path | None, src: Source, cmd: Command | None) -> ScriptSettings:
    """What the training script sets in code (script_ast.py, read, never run), added to `src` where the command
    line is silent. A script parsing with TRL's TrlParser reads `--config FILE.yaml` as TRL does first: the YAML's
    keys are its dataclasses' fields, below the command line's."""
    if script is None:
        return ScriptSettings()
    code = read_script(script, read_text(script))
    if code.trl_parser:
        code.config_file = src.get("config")
        code.config_env = _trl_yaml(src, cmd)
    follow_arg_file(code, src, script, cmd)
    for k, v in code.args.items():
        if k not in src:
            src.values[k] = v
            src.order.append(k)
            if k in code.arg_at:
                src.given_at[k] = code.arg_at[k]
    return code


# TRL's own command line (trl 1.16 cli/commands/training.py): `trl <command>` runs trl/scripts/<command>.py under
# `accelerate launch`, by the trainer and config classes that script builds (SFT: no preference trainer).
TRL_CLI = {"sft": (None, "SFTConfig"), "dpo": ("DPOTrainer", "DPOConfig"), "kto": ("KTOTrainer", "KTOConfig"),
           "grpo": ("GRPOTrainer", "GRPOConfig"), "rloo": ("RLOOTrainer", "RLOOConfig"),
           "reward": ("RewardTrainer", "RewardConfig"), "distillation": ("DistillationTrainer", "DistillationConfig")}
# `accelerate launch` options, which `trl <command>` passes to accelerate (its script does not take them).
ACCELERATE_OPTIONS = ("config_file", "num_processes", "num_machines", "machine_rank", "main_process_ip",
                      "main_process_port", "mixed_precision", "multi_gpu", "use_deepspeed", "use_fsdp", "gpu_ids",
                      "fsdp_version", "zero_stage", "deepspeed_config_file", "dynamo_backend")


def trl_cli_settings(cmd: Command, src: Source) -> ScriptSettings:
    """Read `trl <command> ...` as the `accelerate launch trl/scripts/<command>.py ...` it runs: accelerate's options
    (and `--accelerate_config`, its config file) move to the launch; the script's arguments are TRL's config's."""
    cmd.launcher = "accelerate"
    config_file = src.get("config")
    config_env = _trl_yaml(src, cmd)
    # the trl CLI parses the YAML in its own process, which then starts accelerate: the launch sees the variables
    cmd.exported = {**cmd.exported, **config_env}
    for name in (*ACCELERATE_OPTIONS, "accelerate_config"):
        if name in src.values:
            value = src.values.pop(name)
            src.order.remove(name)
            cmd.launcher_args[_trl_accelerate_config(value, src) if name == "accelerate_config" else
                              f"--{name}"] = value
    trainer, config = TRL_CLI[cmd.program.split(" ", 1)[1]]
    return ScriptSettings(trainer=trainer, trl_trainer=trainer or "SFTTrainer", trl_config=config, model_config=True,
                          found=[f"{cmd.program}: TRL's {config} and ModelConfig, launched by accelerate"],
                          config_env=config_env, config_file=config_file)


def _trl_yaml(src: Source, cmd: Command | None) -> dict[str, str]:
    """`--config FILE` to TrlParser (`trl <command>`, or a script that parses with it): the YAML's keys become the
    defaults of the script's dataclass fields, so the command line's flags win over them (trl 1.16
    scripts/utils.py `parse_args_and_config`, `set_defaults_with_config`); under `trl <command>` its accelerate
    keys go to the launch as the command line's do (cli/commands/training.py). Said in `src` as if given on the
    command line. Returns the YAML's `env:` section (trl_env.py `trl_env`), which is no argument. TrlParser finds the
    option only as the word `--config` (`args.index("--config")`): `--config=FILE` never reaches it, and the
    dataclasses' parser then refuses the word, so that spelling is a UserError."""
    ref = src.values.pop("config", None)
    if ref is None:
        return {}
    if cmd is not None and "config" in cmd.joined:
        raise UserError(f"{src.where}: --config={ref}: TrlParser reads the YAML only from `--config {ref}`, two "
                        f"words; written with '=' it is left to the arguments parser, which refuses it "
                        f"(\"Some specified arguments are not used by the HfArgumentParser: ['--config={ref}']\"), "
                        f"so the job never starts. Write --config {ref}.")
    src.order.remove("config")
    hit = local_file(str(ref), src.path.parent)
    if hit is None:
        raise UserError(f"{src.where}: --config {ref}: no such YAML file here; TRL reads the job's arguments from "
                        f"it. Give its path (relative to the command's file), or the arguments on the command line.")
    data, lines = load_yaml(Path(hit), nested=True)
    for key, value in data.items():
        if key in src.values or key == "env" or value is None and key not in NULL_KEYS:
            continue
        if value is None:  # arg_nulls.py `settle_nulls`, kbit.py `job_load`
            src.null_at[key] = f"{hit}:{lines.get(key, '?')}"
        src.values[key] = None if value is None else " ".join(map(str, value)) if isinstance(value, list) else \
            str(value).lower() if isinstance(value, bool) else str(value)
        src.order.append(key)
    return trl_env(data, lines, Path(hit)) if "env" in data else {}


def _trl_accelerate_config(value: str, src: Source) -> str:
    """The launch option `trl --accelerate_config VALUE` becomes (trl 1.16 cli/accelerate_config.py): a file's
    path, else the name of a config TRL ships (zero3, fsdp2, ...); any other name (or none) TRL refuses."""
    if local_file(value, src.path.parent) is not None or value not in TRL_CONFIGS and \
            ("/" in value or value.endswith((".yaml", ".yml", ".json"))):
        return "--config_file"  # a path, here or on the machine that runs it (the launch notes which)
    if value in TRL_CONFIGS:
        return "--trl_accelerate_config"
    raise UserError(f"{src.at('accelerate_config')}: --accelerate_config {value} is neither a file here nor a config "
                    f"TRL ships; TRL refuses it (\"neither a file nor a valid config in the `trl` package\"). Give "
                    f"the file's path or one of {', '.join(TRL_CONFIGS)}.")


def trl_model_config(src: Source, code: ScriptSettings, notes: list[str]) -> None:
    """Read TRL's ModelConfig arguments as TRL does (trl 1.16 trainer/model_config.py, `get_peft_config`): LoRA only
    with --use_peft (then --lora_r 16 and --lora_alpha 32 by default), 4-bit base weights with --load_in_4bit
    beside it; without --use_peft the script trains every weight, whatever --lora_r says. Said in `src` as the
    Trainer scripts' own keys (use_lora, q_lora, lora_r), which the rest of the reader plans."""
    if not code.model_config:
        return
    if not src.flag("use_peft", "false"):
        for key in ("lora_r", "lora_rank"):
            if key in src.values:
                src.values.pop(key)
                src.order.remove(key)
                notes.append(f"--{key} without --use_peft: TRL's ModelConfig builds no LoRA, the script trains "
                             f"every weight (pass --use_peft for LoRA)")
        return
    src.values.setdefault("use_lora", "true")
    src.values.setdefault("lora_r", "16")
    src.values.setdefault("lora_alpha", "32")
    if src.flag("load_in_4bit", "false"):
        src.values.setdefault("q_lora", "true")
    notes.append("--use_peft: LoRA through TRL's ModelConfig (lora_r 16, lora_alpha 32 unless given" +
                 ("; --load_in_4bit: 4-bit NF4 base weights)" if src.flag("load_in_4bit", "false") else ")"))
