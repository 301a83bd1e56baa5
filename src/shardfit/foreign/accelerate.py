"""`accelerate launch`, and the environment accelerate's plugins read, as a training script under it runs: the ranks
it starts, the mixed precision it hands the script, and the DeepSpeed or FSDP plugin the script's Accelerator (the
HF Trainer's) builds. Read as accelerate 1.15 does it: commands/launch.py `_validate_launch_command` (a config file's
keys under the flags, accelerate's defaults without one), utils/launch.py `prepare_multi_gpu_env` and
`prepare_deepspeed_cmd_env` (the environment the launcher sets), and utils/dataclasses.py `DeepSpeedPlugin` and
`FullyShardedDataParallelPlugin` (`__post_init__`: what each builds from that environment)."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from shardfit.errors import UserError
from shardfit.foreign.common import STR_TO_BOOL_WORDS, TRUE_WORDS, as_bool, fsdp_settings, load_yaml, local_file
from shardfit.foreign.shell import Command, visible_devices

# DeepSpeedPlugin settings that accelerate refuses beside `deepspeed_config_file` (utils/dataclasses.py
# `DeepSpeedPlugin._deepspeed_config_checks`: they belong in the JSON), by their accelerate config names.
IGNORED_BESIDE_FILE = ("gradient_accumulation_steps", "gradient_clipping", "zero_stage", "offload_optimizer_device",
                       "offload_param_device", "offload_param_nvme_path", "offload_optimizer_nvme_path",
                       "zero3_save_16bit_model")
# `accelerate launch` DeepSpeed flags, which the config file's deepspeed_config keys fill when not given.
DEEPSPEED_FLAGS = (*IGNORED_BESIDE_FILE, "zero3_init_flag", "deepspeed_config_file")
DEFAULT_CONFIG = "~/.cache/huggingface/accelerate/default_config.yaml"
# accelerate's DistributedType values (utils/dataclasses.py): a config's distributed_type is converted by
# DistributedType(value) (commands/config/config_args.py), which takes these exact, upper-case words only.
DISTRIBUTED_TYPES = ("NO", "MULTI_CPU", "MULTI_GPU", "MULTI_NPU", "MULTI_MLU", "MULTI_SDAA", "MULTI_MUSA", "MULTI_XPU",
                     "DEEPSPEED", "FSDP", "XLA", "MEGATRON_LM", "MULTI_HPU", "MULTI_NEURON")
# PrecisionType's values, which utils/launch.py reads lower-cased ("Unknown mixed_precision mode").
PRECISIONS = ("no", "fp8", "fp16", "bf16")


@dataclass
class Accelerate:
    """What accelerate makes of a launch. `nproc` is the ranks a node (None with `every_gpu`: one per GPU the
    machine shows, which only the hardware says); `fsdp` the FSDP settings by `fsdp_settings`' names, with
    "version"; `deepspeed` the DeepSpeed JSON the plugin builds from inline settings, or `deepspeed_file` the JSON
    it loads."""

    source: str
    nproc: int | None = None
    every_gpu: bool = False
    nnodes: int = 1
    mixed_precision: str = "no"
    fsdp: dict[str, Any] | None = None
    deepspeed: dict[str, Any] | None = None
    deepspeed_file: str | None = None
    keys: dict[str, str] = field(default_factory=dict)  # accelerate's settings as given, by their names
    notes: list[str] = field(default_factory=list)
    env_read: dict[str, str] = field(default_factory=dict)  # variables the plan took, with what each decided


# What each ACCELERATE_* / FSDP_* variable decides when the training process's Accelerator builds its plugin from
# the environment (accelerator.py, utils/dataclasses.py `__post_init__`).
PLUGIN_ENV = {"ACCELERATE_USE_FSDP": "FSDP plugin", "ACCELERATE_USE_DEEPSPEED": "DeepSpeed plugin",
              "ACCELERATE_MIXED_PRECISION": "precision", "ACCELERATE_DEEPSPEED_CONFIG_FILE": "ZeRO settings",
              "ACCELERATE_DEEPSPEED_ZERO_STAGE": "ZeRO stage",
              "ACCELERATE_DEEPSPEED_OFFLOAD_OPTIMIZER_DEVICE": "optimizer offload",
              "ACCELERATE_DEEPSPEED_OFFLOAD_PARAM_DEVICE": "parameter offload",
              "ACCELERATE_GRADIENT_ACCUMULATION_STEPS": "grad_accum of the plugin", "FSDP_VERSION": "FSDP1 or FSDP2",
              "FSDP_SHARDING_STRATEGY": "FSDP sharding", "FSDP_RESHARD_AFTER_FORWARD": "FSDP sharding",
              "FSDP_OFFLOAD_PARAMS": "FSDP offload"}


def read_accelerate(cmd: Command | None, base: Path, where: str, in_process: dict[str, str] | None = None) \
        -> Accelerate | None:
    """The accelerate launch of `cmd` (`accelerate launch [--config_file F] [flags] script ...`), or, under another
    launcher, the plugins the ACCELERATE_* / FSDP_* variables its training processes see make accelerate build;
    None when neither. `in_process`: variables set inside each training process before its Accelerator is built
    (a TrlParser YAML's `env:`), over what the shell exported and what the launcher set."""
    if cmd is None:
        return None
    in_process = in_process or {}
    if cmd.launcher == "accelerate":
        acc = _launch(cmd, base, where)
        _inherited_plugin(acc, cmd.exported, in_process)
        return acc
    env = {**cmd.exported, **in_process}
    if not any(k in env for k in ("ACCELERATE_USE_FSDP", "ACCELERATE_USE_DEEPSPEED", "ACCELERATE_MIXED_PRECISION")):
        return None
    acc = Accelerate(f"{where}: the ACCELERATE_* variables the training processes see",
                     mixed_precision=env.get("ACCELERATE_MIXED_PRECISION", "no").lower())
    _env_plugin(acc, env)
    _mark_read(acc, env, ("ACCELERATE_MIXED_PRECISION",))
    return acc


def _env_plugin(acc: Accelerate, env: dict[str, str]) -> None:
    """The DeepSpeed or FSDP plugin an Accelerator builds from `env` when nothing else names one (accelerator.py
    checks ACCELERATE_USE_DEEPSPEED first, then ACCELERATE_USE_FSDP)."""
    if _on(env.get("ACCELERATE_USE_DEEPSPEED")):  # accelerator.py: DeepSpeedPlugin() from the environment
        acc.deepspeed_file = _set(env.get("ACCELERATE_DEEPSPEED_CONFIG_FILE"))
        acc.deepspeed = None if acc.deepspeed_file else _inline_deepspeed({
            "zero_stage": env.get("ACCELERATE_DEEPSPEED_ZERO_STAGE"),
            "offload_optimizer_device": env.get("ACCELERATE_DEEPSPEED_OFFLOAD_OPTIMIZER_DEVICE"),
            "offload_param_device": env.get("ACCELERATE_DEEPSPEED_OFFLOAD_PARAM_DEVICE"),
            "gradient_accumulation_steps": env.get("ACCELERATE_GRADIENT_ACCUMULATION_STEPS")}, acc.source)
        _mark_read(acc, env, [k for k in PLUGIN_ENV if k.startswith("ACCELERATE_") and k != "ACCELERATE_USE_FSDP"
                              and k != "ACCELERATE_MIXED_PRECISION"])
    elif _on(env.get("ACCELERATE_USE_FSDP")):  # accelerator.py: FullyShardedDataParallelPlugin() from it
        acc.fsdp = _env_fsdp(env)
        _mark_read(acc, env, ["ACCELERATE_USE_FSDP", *(k for k in PLUGIN_ENV if k.startswith("FSDP_"))])


def _mark_read(acc: Accelerate, env: dict[str, str], names: Any) -> None:
    """Note which of `names` in `env` the plan took (PLUGIN_ENV says for what)."""
    acc.env_read.update({k: PLUGIN_ENV[k] for k in names if k in env})


def _inherited_plugin(acc: Accelerate, exported: dict[str, str], in_process: dict[str, str]) -> None:
    """What the processes of an `accelerate launch` inherit beyond the launch's own settings: the launcher copies
    os.environ and sets only ACCELERATE_MIXED_PRECISION, and ACCELERATE_USE_FSDP / _DEEPSPEED for an FSDP or
    DeepSpeed launch (utils/launch.py), so a multi-GPU or one-process launch whose environment says
    ACCELERATE_USE_FSDP=true still builds that plugin in each process; variables set in the process itself
    (`in_process`) come last and win over the launcher's."""
    if "ACCELERATE_MIXED_PRECISION" in in_process:
        acc.mixed_precision = in_process["ACCELERATE_MIXED_PRECISION"].strip().lower()
        _mark_read(acc, in_process, ("ACCELERATE_MIXED_PRECISION",))
    if acc.fsdp is None and acc.deepspeed is None and acc.deepspeed_file is None:
        _env_plugin(acc, {**exported, **in_process})
        if acc.env_read.keys() - {"ACCELERATE_MIXED_PRECISION"}:
            acc.notes.append("the launch itself names no DeepSpeed or FSDP, but its processes see " + ", ".join(
                f"{k}={v}" for k, v in {**exported, **in_process}.items() if k in acc.env_read) +
                ": accelerate builds the plugin from them")


def _on(value: str | None) -> bool:
    return str(value).strip().lower() == "true"


def _set(value: Any) -> str | None:
    """A setting that is given: not absent, and not accelerate's "none"."""
    return None if value is None or str(value).strip().lower() in ("none", "") else str(value)


def _env_fsdp(env: dict[str, str]) -> dict[str, Any]:
    """FullyShardedDataParallelPlugin's settings from the environment: FSDP_VERSION (1 when unset), then FSDP1's
    FSDP_SHARDING_STRATEGY or FSDP_RESHARD_AFTER_FORWARD, and FSDP_OFFLOAD_PARAMS."""
    cfg: dict[str, Any] = {"version": env.get("FSDP_VERSION", "1")}
    if cfg["version"] == "1" and "FSDP_SHARDING_STRATEGY" in env:
        cfg["sharding_strategy"] = env["FSDP_SHARDING_STRATEGY"]
    elif "FSDP_RESHARD_AFTER_FORWARD" in env:
        cfg["reshard_after_forward"] = env["FSDP_RESHARD_AFTER_FORWARD"]
    cfg["offload_params"] = env.get("FSDP_OFFLOAD_PARAMS", "false")
    return cfg


def _trl_config(name: str) -> dict[str, Any]:
    """What TRL's bundled accelerate config `name` sets (trl/accelerate_configs/<name>.yaml, the same in TRL 0.24
    and 1.16): 8 processes on one machine in bf16, with DeepSpeed ZeRO, FSDP, DDP or one process."""
    common: dict[str, Any] = {"num_machines": 1, "num_processes": 8, "mixed_precision": "bf16"}
    zero: dict[str, Any] = {"offload_optimizer_device": "none", "offload_param_device": "none"}
    wrap = {"fsdp_auto_wrap_policy": "TRANSFORMER_BASED_WRAP", "fsdp_offload_params": False,
            "fsdp_cpu_ram_efficient_loading": True, "fsdp_activation_checkpointing": False,
            "fsdp_state_dict_type": "FULL_STATE_DICT"}
    return common | {
        "zero1": {"distributed_type": "DEEPSPEED", "deepspeed_config": {
            "zero_stage": 1, "zero3_init_flag": False, "gradient_accumulation_steps": 1}},
        "zero2": {"distributed_type": "DEEPSPEED", "deepspeed_config": {
            "zero_stage": 2, "zero3_init_flag": False, **zero}},
        "zero3": {"distributed_type": "DEEPSPEED", "deepspeed_config": {
            "zero_stage": 3, "zero3_init_flag": True, "zero3_save_16bit_model": True, **zero}},
        "fsdp1": {"distributed_type": "FSDP", "fsdp_config": {
            **wrap, "fsdp_version": 1, "fsdp_reshard_after_forward": "FULL_SHARD"}},
        "fsdp2": {"distributed_type": "FSDP", "fsdp_config": {
            **wrap, "fsdp_version": 2, "fsdp_reshard_after_forward": True}},
        "multi_gpu": {"distributed_type": "MULTI_GPU"},
        "single_gpu": {"distributed_type": "NO"},
    }[name]


TRL_CONFIGS = ("zero1", "zero2", "zero3", "fsdp1", "fsdp2", "multi_gpu", "single_gpu")


def _launch(cmd: Command, base: Path, where: str) -> Accelerate:
    """`accelerate launch`: its flags, over its config file's keys (or those of TRL's bundled config a `trl`
    command names), over accelerate's defaults."""
    flags = {k.lstrip("-").replace("-", "_"): v for k, v in cmd.launcher_args.items()}
    ref = flags.get("config_file")
    bundled = flags.pop("trl_accelerate_config", None)
    acc = Accelerate(f"{where}: accelerate launch" + (f" --config_file {ref}" if ref else "") +
                     (f" --config_file TRL's {bundled}.yaml" if bundled else ""))
    config: dict[str, Any] | None = _trl_config(bundled) if bundled else None
    if ref:
        hit = local_file(ref, base)
        if hit is None:
            acc.notes.append(f"accelerate --config_file {ref} is not here: planned with accelerate's defaults for "
                             f"what the flags leave (give the file beside the script to plan its settings)")
        else:
            config = load_yaml(Path(hit), example="distributed_type: MULTI_GPU, num_processes: 8")[0]
    kind = _kind(flags, config, acc.source)
    acc.nnodes = _count(flags.get("num_machines") or (config or {}).get("num_machines") or 1, "num_machines", acc)
    total = flags.get("num_processes") or (config or {}).get("num_processes")
    if total is None and config is not None:
        # A config file's num_processes defaults to -1 (commands/config/config_args.py ClusterConfig), set to 1
        # only for distributed_type NO (config_args.py `from_yaml_file`), and commands/launch.py
        # `_validate_launch_command` refuses -1: only a launch without a config file counts the GPUs.
        total = 1 if kind == "NO" and config.get("distributed_type") is not False else -1
    if total is not None:
        n = _count(total, "num_processes", acc, from_config=config is not None and "num_processes" not in flags)
        acc.nproc = max(1, n // acc.nnodes)  # the total over all machines (utils/launch.py: // num_machines)
    elif visible_devices(cmd.exported):
        acc.nproc = len(visible_devices(cmd.exported))  # torch.cuda.device_count() sees only these
    else:
        acc.every_gpu = True
    given_mp = flags.get("mixed_precision") or (config or {}).get("mixed_precision")
    acc.mixed_precision = str(given_mp or "no").lower()
    if not isinstance(given_mp, bool) and acc.mixed_precision not in PRECISIONS:  # YAML's bare no reads False
        raise UserError(f"{acc.source}: mixed_precision {given_mp!r}: accelerate refuses it (\"Unknown "
                        f"mixed_precision mode\", utils/launch.py). Give one of {', '.join(PRECISIONS)}.")
    _check_gpu_ids(flags.get("gpu_ids", (config or {}).get("gpu_ids")), acc)
    if config is None:
        used = ["one process per visible GPU (multi-GPU when more than one)"] * (total is None) + \
            ["mixed precision 'no'"] * (given_mp is None) + ["one machine"] * ("num_machines" not in flags)
        if used:
            acc.notes.append(f"accelerate launch without a config file: planned with accelerate's defaults, as when "
                             f"no {DEFAULT_CONFIG} exists where it runs: {', '.join(used)}")
    if kind == "FSDP":
        acc.fsdp = _launch_fsdp(flags, config or {}, cmd.exported, acc)
    elif kind == "DEEPSPEED":
        _launch_deepspeed(flags, config or {}, given_mp is not None and "mixed_precision" not in flags, acc)
    return acc


# The distributed types shardfit plans (GPU data parallel, ZeRO, FSDP, one process); the others run on CPUs
# (MULTI_CPU), TPUs (XLA), other accelerators (MULTI_NPU, MULTI_XPU...) or split each layer by Megatron-LM's
# tensor and pipeline degrees (MEGATRON_LM), none of which the planner models.
PLANNED_TYPES = ("NO", "MULTI_GPU", "DEEPSPEED", "FSDP")


def _kind(flags: dict[str, str], config: dict[str, Any] | None, source: str) -> str:
    """DEEPSPEED, FSDP, MULTI_GPU or NO: a --use_deepspeed / --use_fsdp / --multi_gpu flag, else the config's
    distributed_type (commands/launch.py reads the config's only when no such flag is given). accelerate builds the
    config's DistributedType whatever the flags (commands/config/config_args.py), so a missing or invalid one is
    refused either way. YAML's bare `NO` reads false, which accelerate leaves as it is and runs one process with
    (the caller keeps num_processes required for it); a type the planner does not model exits 2."""
    value = None
    if config is not None:
        if "distributed_type" not in config:
            raise UserError(f"{source}: the config file has no distributed_type: accelerate refuses it (\"A "
                            f"`distributed_type` must be specified in the config file.\"). Add distributed_type: "
                            f"MULTI_GPU (or NO, DEEPSPEED, FSDP).")
        value = "NO" if config["distributed_type"] is False else config["distributed_type"]
        if str(value) not in DISTRIBUTED_TYPES:
            hint = f" (write it {str(value).upper()})" if str(value).upper() in DISTRIBUTED_TYPES else ""
            raise UserError(f"{source}: distributed_type {value!r} is not a valid DistributedType: accelerate "
                            f"refuses it when it reads the file{hint}. Give one of "
                            f"{', '.join(DISTRIBUTED_TYPES[:3])}, DEEPSPEED, FSDP.")
    for flag, kind in (("use_deepspeed", "DEEPSPEED"), ("use_fsdp", "FSDP"), ("multi_gpu", "MULTI_GPU")):
        if str(flags.get(flag, "false")).lower() in TRUE_WORDS:
            return kind
    if value is not None and str(value) not in PLANNED_TYPES:
        raise UserError(f"{source}: distributed_type {value}: shardfit plans GPU jobs run as {', '.join(PLANNED_TYPES)}"
                        f"; {value} runs {_UNPLANNED.get(str(value), 'on other accelerators than NVIDIA GPUs')}, "
                        f"which it does not model. To plan the job on GPUs, give distributed_type MULTI_GPU, "
                        f"DEEPSPEED or FSDP.")
    return str(value or "NO")


_UNPLANNED = {"MULTI_CPU": "on CPUs", "XLA": "on TPUs (torch_xla)",
              "MEGATRON_LM": "Megatron-LM's tensor and pipeline parallelism (megatron_lm_config's tp/pp degrees)"}


def _check_gpu_ids(gpu_ids: Any, acc: Accelerate) -> None:
    """gpu_ids (flag or config) is the launch's CUDA_VISIBLE_DEVICES (utils/launch.py): fewer GPUs than processes
    a machine starts leave ranks without a GPU of their own, which fail when they take it."""
    if gpu_ids is None or str(gpu_ids).strip().lower() == "all" or acc.nproc is None:
        return
    ids = [g for g in str(gpu_ids).split(",") if g.strip()]
    if len(ids) < acc.nproc:
        raise UserError(f"{acc.source}: gpu_ids {gpu_ids} makes {len(ids)} GPU(s) visible, but the launch starts "
                        f"{acc.nproc} processes on each machine: ranks {len(ids)} and up have no GPU. List at least "
                        f"{acc.nproc} GPU ids, use gpu_ids all, or start {len(ids)} processes a machine.")


def _count(value: Any, key: str, acc: Accelerate, from_config: bool = False) -> int:
    try:
        n = int(value)
    except (TypeError, ValueError):
        raise UserError(f"{acc.source}: {key} is {value!r}; give a whole number.") from None
    if n == -1 and from_config:  # commands/launch.py refuses a config that leaves it to the command line
        raise UserError(f"{acc.source}: num_processes is -1 or not given in the config file: accelerate refuses "
                        f"it (\"You need to manually pass in `--num_processes` using this config yaml\"); set "
                        f"num_processes: N in the config file, or pass --num_processes N to accelerate launch.")
    if n < 1:
        raise UserError(f"{acc.source}: {key} is {value!r}; give a whole number of at least 1.")
    return n


def _launch_fsdp(flags: dict[str, str], config: dict[str, Any], env: dict[str, str],
                 acc: Accelerate) -> dict[str, Any]:
    """The config's fsdp_config with the launch's --fsdp_* flags over it. The launcher sets FSDP_VERSION itself
    (utils/launch.py `prepare_multi_gpu_env`: fsdp_version, 1 unless given), which the plugin then reads, so a
    FSDP_VERSION the script exports does not reach the training process."""
    cfg = fsdp_settings(config.get("fsdp_config") or {}, acc.source)
    cfg |= {k.removeprefix("fsdp_"): v for k, v in flags.items() if k.startswith("fsdp_")}
    version = str(cfg.get("version", "1"))
    if version not in ("1", "2"):
        raise UserError(f"{acc.source}: fsdp_version is {cfg['version']!r}; accelerate runs FSDP 1 or 2.")
    if "version" not in cfg:
        acc.notes.append("accelerate's fsdp_version not set: it runs FSDP1 (fsdp_version: 2 for FSDP2)")
    exported = env.get("FSDP_VERSION")
    if exported is not None and exported != version:
        acc.notes.append(f"FSDP_VERSION={exported} is exported, but accelerate launch sets FSDP_VERSION={version} "
                         f"from fsdp_version for the script: planned as FSDP{version}")
    if version == "2":
        _fsdp2_settings(cfg, acc)
    elif "sharding_strategy" not in cfg:
        # the launcher always sets FSDP_SHARDING_STRATEGY (fsdp_sharding_strategy, FULL_SHARD unless given), which
        # FSDP1's plugin takes before reshard_after_forward (utils/launch.py, FullyShardedDataParallelPlugin)
        cfg["sharding_strategy"] = "FULL_SHARD"
        given = cfg.get("reshard_after_forward")
        if given is not None and str(given).strip().upper() not in ("FULL_SHARD", "1", "TRUE"):
            acc.notes.append(f"fsdp_reshard_after_forward {given} with fsdp_version 1: accelerate launch passes "
                             f"FSDP_SHARDING_STRATEGY=FULL_SHARD (fsdp_sharding_strategy's default), which FSDP1 "
                             f"takes first: planned as FULL_SHARD (set fsdp_sharding_strategy: {given} for it)")
    acc.keys["fsdp_version"] = version
    return {**cfg, "version": version}


def _fsdp2_settings(cfg: dict[str, Any], acc: Accelerate) -> None:
    """FSDP2's plugin reads its sharding from reshard_after_forward alone, as true or false (accelerate's
    str_to_bool refuses anything else: "invalid truth value"); a sharding_strategy is FSDP1's and not read."""
    value = cfg.get("reshard_after_forward")
    if value is not None and not isinstance(value, bool) and str(value).strip().lower() not in STR_TO_BOOL_WORDS:
        raise UserError(f"{acc.source}: fsdp_reshard_after_forward {value!r} with fsdp_version 2: accelerate reads "
                        f"it as true or false and refuses anything else (\"invalid truth value\"). Give true "
                        f"(full_shard) or false (shard_grad_op), or fsdp_version 1 for FSDP1's strategies.")
    if cfg.pop("sharding_strategy", None) is not None:
        acc.notes.append("fsdp_sharding_strategy is FSDP1's; with fsdp_version 2 accelerate reads only "
                         "fsdp_reshard_after_forward (true unless given)")


def _launch_deepspeed(flags: dict[str, str], config: dict[str, Any], mp_from_config: bool, acc: Accelerate) -> None:
    """The config's deepspeed_config keys with the launch's flags over them, as DeepSpeedPlugin reads them: a
    deepspeed_config_file's JSON (with no inline setting beside it, which accelerate refuses), else the JSON it
    builds from zero_stage (2 when unset), the offload devices and the accumulation steps."""
    inline = config.get("deepspeed_config") or {}
    if not isinstance(inline, dict):
        raise UserError(f"{acc.source}: deepspeed_config must be a mapping of DeepSpeed settings.")
    settings = {k: v for k, v in inline.items() if v is not None}
    settings |= {k: v for k, v in flags.items() if k in DEEPSPEED_FLAGS}
    for key, value in settings.items():
        acc.keys[f"deepspeed_config.{key}"] = str(value)
    acc.deepspeed_file = _set(settings.get("deepspeed_config_file"))
    if acc.deepspeed_file is None:
        acc.deepspeed = _inline_deepspeed(settings, acc.source)
        zero3_init = settings.get("zero3_init_flag")
        if acc.deepspeed["zero_optimization"]["stage"] == 3 and zero3_init is not None and not as_bool(zero3_init):
            acc.notes.append("zero3_init_flag false: each rank loads the whole model into host RAM before "
                             "DeepSpeed partitions it (GPU memory as planned)")
        return
    # commands/launch.py passes the config's deepspeed_config keys (and mixed_precision, when the config gives
    # it) to the plugin, whose _deepspeed_config_checks refuses any that the JSON decides
    clash = [k for k in inline if k in IGNORED_BESIDE_FILE] + ["mixed_precision"] * mp_from_config
    if clash:
        raise UserError(f"{acc.source}: deepspeed_config_file is given with {', '.join(clash)} in the accelerate "
                        f"config; accelerate refuses that (\"When using `deepspeed_config_file`, the following "
                        f"accelerate config variables will be ignored\"): move them into the DeepSpeed JSON and "
                        f"remove them from the accelerate config.")


def _inline_deepspeed(settings: dict[str, Any], where: str) -> dict[str, Any]:
    """The DeepSpeed JSON DeepSpeedPlugin builds without a config file: ZeRO `zero_stage` (2 when unset), the
    offload devices ("none" when unset), "auto" batch sizes, and `gradient_accumulation_steps` ("auto": the
    Trainer's)."""
    stage = settings.get("zero_stage")
    try:
        stage = 2 if stage is None else int(stage)
    except (TypeError, ValueError):
        raise UserError(f"{where}: zero_stage is {stage!r}; DeepSpeed's stages are 0, 1, 2 and 3.") from None
    gas = settings.get("gradient_accumulation_steps")
    return {"train_batch_size": "auto", "train_micro_batch_size_per_gpu": "auto",
            "gradient_accumulation_steps": "auto" if gas is None or not str(gas).isdigit() else int(gas),
            "zero_optimization": {
                "stage": stage,
                "offload_optimizer": {"device": str(settings.get("offload_optimizer_device") or "none").lower()},
                "offload_param": {"device": str(settings.get("offload_param_device") or "none").lower()}}}
