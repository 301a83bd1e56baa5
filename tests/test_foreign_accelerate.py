"""`accelerate launch` as accelerate 1.15 runs an HF Trainer script: its defaults without a config file, the
DeepSpeed plugin of a DEEPSPEED config, and where FSDP_VERSION is read."""

from __future__ import annotations

from pathlib import Path

import pytest

from shardfit.errors import UserError
from shardfit.foreign.read import JobOptions, read_job
from shardfit.plan.hardware import parse_gpus

TRAIN = ("train.py --model_name_or_path Qwen/Qwen2.5-7B --per_device_train_batch_size 1 --model_max_length 2048 "
         "--gradient_checkpointing True")


def _job(tmp_path: Path, script: str, opts: JobOptions | None = None, **files: str):
    for name, text in files.items():
        (tmp_path / name).write_text(text)
    (tmp_path / "run.sh").write_text(script)
    return read_job("hf", str(tmp_path / "run.sh"), opts or JobOptions(transformers="5.23.0"))


def test_accelerate_without_config_starts_a_rank_per_gpu(tmp_path: Path) -> None:
    """No --config_file and no --num_processes: accelerate starts torch.cuda.device_count() processes (multi-GPU
    when more than one), so the job is 8 DDP ranks on 8 GPUs, 2 with CUDA_VISIBLE_DEVICES=0,1, not one process;
    the note says which defaults accelerate used."""
    opts = JobOptions(transformers="5.23.0", gpus=parse_gpus("8xH100"))
    job = _job(tmp_path, f"accelerate launch {TRAIN} --bf16 True\n", opts)
    assert (job.nproc, job.engine) == (8, "ddp")
    assert any("without a config file" in n and "one process per visible GPU" in n and "mixed precision 'no'" in n
               for n in job.notes)
    two = _job(tmp_path, f"export CUDA_VISIBLE_DEVICES=0,1\naccelerate launch {TRAIN} --bf16 True\n", opts)
    assert (two.nproc, two.engine) == (2, "ddp")
    one = _job(tmp_path, f"accelerate launch --num_processes 1 {TRAIN} --bf16 True\n", opts)
    assert (one.nproc, one.engine) == (1, "single")


def test_accelerate_mixed_precision_reaches_the_trainer(tmp_path: Path) -> None:
    """The Trainer takes ACCELERATE_MIXED_PRECISION (set by the launch from --mixed_precision or the config) when
    neither --bf16 nor --fp16 is given: bf16, not fp32; an explicit --fp16 wins."""
    job = _job(tmp_path, f"accelerate launch --num_processes 2 --mixed_precision bf16 {TRAIN}\n")
    assert job.workload.precision == "bf16"
    assert any("accelerate's mixed precision bf16" in n for n in job.notes)
    cfg = "distributed_type: MULTI_GPU\nmixed_precision: fp16\nnum_processes: 4\n"
    job = _job(tmp_path, f"accelerate launch --config_file acc.yaml {TRAIN}\n", **{"acc.yaml": cfg})
    assert (job.workload.precision, job.nproc, job.engine) == ("fp16", 4, "ddp")
    job = _job(tmp_path, f"accelerate launch --mixed_precision bf16 --num_processes 2 {TRAIN} --fp16 True\n")
    assert job.workload.precision == "fp16"


def test_accelerate_num_processes_counts_every_machine(tmp_path: Path) -> None:
    """accelerate's --num_processes is the total over all machines: 16 on 2 machines is 8 ranks a node."""
    job = _job(tmp_path, f"accelerate launch --num_processes 16 --num_machines 2 {TRAIN} --bf16 True\n")
    assert (job.nproc, job.nnodes) == (8, 2)
    cfg = "distributed_type: MULTI_GPU\nnum_machines: 2\nnum_processes: 16\n"
    job = _job(tmp_path, f"accelerate launch --config_file acc.yaml {TRAIN} --bf16 True\n", **{"acc.yaml": cfg})
    assert (job.nproc, job.nnodes) == (8, 2)


ACC_DS = """compute_environment: LOCAL_MACHINE
distributed_type: DEEPSPEED
deepspeed_config:
{inline}
mixed_precision: bf16
num_processes: 8
"""


@pytest.mark.parametrize(("inline", "stage", "off_opt", "off_par"), [
    ("  zero_stage: 3\n  offload_optimizer_device: cpu\n  offload_param_device: cpu\n  zero3_init_flag: true",
     3, True, True),
    ("  zero_stage: 3\n  offload_optimizer_device: none\n  offload_param_device: none", 3, False, False),
    ("  offload_optimizer_device: cpu\n  gradient_accumulation_steps: 4", 2, True, False),
])
def test_accelerate_deepspeed_inline_settings(tmp_path: Path, inline: str, stage: int, off_opt: bool,
                                              off_par: bool) -> None:
    """distributed_type DEEPSPEED with inline deepspeed_config keys: the plugin's JSON runs ZeRO zero_stage (2 when
    unset) with the offload devices given, as planned, not DDP."""
    job = _job(tmp_path, f"accelerate launch --config_file ds.yaml {TRAIN} --bf16 True\n",
               **{"ds.yaml": ACC_DS.format(inline=inline)})
    assert job.engine == "deepspeed" and job.zero is not None and job.nproc == 8
    assert (job.zero.stage, job.zero.offload_optimizer, job.zero.offload_param) == (stage, off_opt, off_par)
    assert any(f"ZeRO-{stage}" in n for n in job.notes)


def test_accelerate_deepspeed_flags_and_config_file(tmp_path: Path) -> None:
    """--use_deepspeed --zero_stage 3 on the command line, and deepspeed_config_file pointing at a JSON (its stage
    decides); a config that gives zero_stage (or mixed_precision) beside the file exits 2, as accelerate refuses
    it."""
    job = _job(tmp_path, f"accelerate launch --use_deepspeed --zero_stage 3 --num_processes 4 {TRAIN} --bf16 True\n")
    assert (job.engine, job.zero.stage, job.nproc) == ("deepspeed", 3, 4)
    ds_json = '{"zero_optimization": {"stage": 1}, "bf16": {"enabled": true}}'
    cfg = ("distributed_type: DEEPSPEED\ndeepspeed_config:\n  deepspeed_config_file: z1.json\n"
           "  zero3_init_flag: false\nnum_processes: 8\n")
    job = _job(tmp_path, f"accelerate launch --config_file ds.yaml {TRAIN} --bf16 true\n",
               **{"ds.yaml": cfg, "z1.json": ds_json})
    assert (job.engine, job.zero.stage, job.workload.precision) == ("deepspeed", 1, "bf16")
    # the file's bf16 true with --bf16 unset: the Trainer raises on the mismatch (propagate_args_to_deepspeed)
    with pytest.raises(UserError, match="z1.json: bf16.enabled is true while --bf16 resolves to false"):
        _job(tmp_path, f"accelerate launch --config_file ds.yaml {TRAIN}\n", **{"ds.yaml": cfg, "z1.json": ds_json})
    for clash, key in (("  zero_stage: 3\n", "zero_stage"), ("", "mixed_precision")):
        bad = cfg.replace("deepspeed_config:\n", "deepspeed_config:\n" + clash) + \
            ("mixed_precision: bf16\n" if not clash else "")
        with pytest.raises(UserError, match=rf"deepspeed_config_file is given with {key}.*accelerate refuses"):
            _job(tmp_path, f"accelerate launch --config_file ds.yaml {TRAIN}\n", **{"ds.yaml": bad})


def test_accelerate_num_processes_unset_in_config_is_refused(tmp_path: Path) -> None:
    """A config whose num_processes is -1 (left to the command line) without --num_processes: accelerate refuses
    to launch; exit 2 naming the flag."""
    cfg = "distributed_type: MULTI_GPU\nnum_processes: -1\n"
    with pytest.raises(UserError, match=r"num_processes is -1.*--num_processes N"):
        _job(tmp_path, f"accelerate launch --config_file acc.yaml {TRAIN} --bf16 True\n", **{"acc.yaml": cfg})


FSDP_CFG = """distributed_type: FSDP
fsdp_config:
  fsdp_reshard_after_forward: true
  fsdp_offload_params: false
{version}num_processes: 8
"""


def test_fsdp_version_is_read_where_accelerate_reads_it(tmp_path: Path) -> None:
    """FSDP_VERSION: under torchrun with ACCELERATE_USE_FSDP exported the Trainer's Accelerator builds its FSDP plugin
    from the environment, FSDP_VERSION=2 included (FSDP1 when unset); under accelerate launch the launcher sets
    FSDP_VERSION itself from fsdp_version (1 unless given), so an exported one does not count, and --fsdp_version
    (or --fsdp-version) on the launch wins over the config."""
    env = "export ACCELERATE_USE_FSDP=true\n{}torchrun --nproc_per_node 8 " + TRAIN + " --bf16 True\n"
    job = _job(tmp_path, env.format("export FSDP_VERSION=2\n"))
    assert (job.engine, job.workload.fsdp1) == ("fsdp_full_shard", False)
    job = _job(tmp_path, env.format(""))
    assert (job.engine, job.workload.fsdp1) == ("fsdp_full_shard", True)
    launch = f"export FSDP_VERSION=2\naccelerate launch --config_file f.yaml {{}}{TRAIN} --bf16 True\n"
    job = _job(tmp_path, launch.format(""), **{"f.yaml": FSDP_CFG.format(version="")})
    assert job.workload.fsdp1 is True and any("FSDP_VERSION=2 is exported" in n for n in job.notes)
    job = _job(tmp_path, launch.format("--fsdp-version 2 "), **{"f.yaml": FSDP_CFG.format(version="")})
    assert job.workload.fsdp1 is False and job.keys["accelerate:fsdp_version"].startswith("2")
    job = _job(tmp_path, launch.format(""), **{"f.yaml": FSDP_CFG.replace("fsdp_config:\n", "fsdp_config:\n"
                                                                            "  fsdp_version: 2\n").format(version="")})
    assert job.workload.fsdp1 is False


def test_swift_under_accelerate_launch(tmp_path: Path) -> None:
    """ms-swift's entry script under `accelerate launch` runs as many ranks as accelerate starts: one per visible
    GPU without a config file (4 on 4 GPUs, not one process), the config file's num_processes with one."""
    run = "accelerate launch {}/opt/ms-swift/swift/cli/sft.py --model Qwen/Qwen2.5-7B --tuner_type lora " \
          "--torch_dtype bfloat16 --max_length 2048\n"
    (tmp_path / "run.sh").write_text(run.format(""))
    job = read_job("swift", str(tmp_path / "run.sh"), JobOptions(transformers="5.23.0", gpus=parse_gpus("4xH100")))
    assert (job.nproc, job.engine) == (4, "ddp")
    (tmp_path / "acc.yaml").write_text("distributed_type: MULTI_GPU\nnum_processes: 2\n")
    (tmp_path / "run.sh").write_text(run.format("--config_file acc.yaml "))
    job = read_job("swift", str(tmp_path / "run.sh"), JobOptions(transformers="5.23.0"))
    assert (job.nproc, job.engine) == (2, "ddp")


def test_accelerate_fsdp2_reads_reshard_after_forward_only(tmp_path: Path) -> None:
    """With fsdp_version 2 accelerate's plugin shards by fsdp_reshard_after_forward alone: an FSDP1
    fsdp_sharding_strategy (SHARD_GRAD_OP) is not read, so the run reshards as full_shard; a strategy name as
    reshard_after_forward exits 2, as accelerate refuses it."""
    cfg = FSDP_CFG.replace("  fsdp_reshard_after_forward: true\n", "  fsdp_version: 2\n{shard}").format(
        shard="  fsdp_sharding_strategy: SHARD_GRAD_OP\n", version="")
    job = _job(tmp_path, f"accelerate launch --config_file f.yaml {TRAIN} --bf16 True\n", **{"f.yaml": cfg})
    assert (job.engine, job.workload.fsdp1) == ("fsdp_full_shard", False)
    assert any("fsdp_sharding_strategy is FSDP1's" in n for n in job.notes)
    bad = FSDP_CFG.replace("fsdp_reshard_after_forward: true", "fsdp_version: 2\n  fsdp_reshard_after_forward: "
                                                                "HYBRID_SHARD").format(version="")
    with pytest.raises(UserError, match=r"fsdp_reshard_after_forward 'HYBRID_SHARD' with fsdp_version 2"):
        _job(tmp_path, f"accelerate launch --config_file f.yaml {TRAIN} --bf16 True\n", **{"f.yaml": bad})


def test_accelerate_fsdp1_takes_the_sharding_strategy_the_launcher_sets(tmp_path: Path) -> None:
    """FSDP1 under accelerate launch: the launcher always passes FSDP_SHARDING_STRATEGY (the config's
    fsdp_sharding_strategy, FULL_SHARD unless given), which the plugin takes before reshard_after_forward, so a
    reshard_after_forward of SHARD_GRAD_OP alone still runs full_shard (said in a note); fsdp_sharding_strategy
    SHARD_GRAD_OP runs shard_grad_op."""
    cfg = FSDP_CFG.replace("fsdp_reshard_after_forward: true", "fsdp_reshard_after_forward: SHARD_GRAD_OP")
    job = _job(tmp_path, f"accelerate launch --config_file f.yaml {TRAIN} --bf16 True\n",
               **{"f.yaml": cfg.format(version="")})
    assert (job.engine, job.workload.fsdp1) == ("fsdp_full_shard", True)
    assert any("FSDP_SHARDING_STRATEGY=FULL_SHARD" in n for n in job.notes)
    cfg = FSDP_CFG.replace("fsdp_reshard_after_forward: true", "fsdp_sharding_strategy: SHARD_GRAD_OP")
    job = _job(tmp_path, f"accelerate launch --config_file f.yaml {TRAIN} --bf16 True\n",
               **{"f.yaml": cfg.format(version="")})
    assert job.engine == "fsdp_shard_grad_op"


def test_a_config_without_num_processes_is_refused_as_accelerate_refuses_it(tmp_path: Path) -> None:
    """A config file leaves num_processes at -1 (ClusterConfig's default) unless distributed_type is NO, and
    accelerate launch refuses -1 ("You need to manually pass in `--num_processes` using this config yaml"): exit 2
    naming the key and the fix, not one rank per GPU; --num_processes on the command line, or NO, plans."""
    cfg = "distributed_type: MULTI_GPU\nmixed_precision: bf16\nuse_cpu: false\n"
    with pytest.raises(UserError, match=r"num_processes is -1 or not given in the config file.*set num_processes"):
        _job(tmp_path, f"accelerate launch --config_file acc.yaml {TRAIN}\n", **{"acc.yaml": cfg})
    given = _job(tmp_path, f"accelerate launch --config_file acc.yaml --num_processes 4 {TRAIN}\n",
                 **{"acc.yaml": cfg})
    assert given.nproc == 4
    single = _job(tmp_path, f"accelerate launch --config_file acc.yaml {TRAIN}\n",
                  **{"acc.yaml": "distributed_type: 'NO'\nmixed_precision: bf16\n"})
    assert single.nproc == 1 and not single.every_gpu


@pytest.mark.parametrize(("cfg", "match"), [
    ("distributed_type: fsdp\nnum_processes: 8\n", r"distributed_type 'fsdp' is not a valid DistributedType.*write "
                                                   r"it FSDP"),
    ("distributed_type: MULTI_GPU\nnum_processes: 8\nmixed_precision: 5\n", r"mixed_precision 5: accelerate refuses"),
    ("distributed_type: MULTI_GPU\nnum_processes: 8\ngpu_ids: 0,1\n", r"gpu_ids 0,1 makes 2 GPU\(s\) visible.*8 "
                                                                      r"processes")])
def test_accelerate_configs_accelerate_refuses_exit_2(tmp_path: Path, cfg: str, match: str) -> None:
    """A distributed_type that is no exact DistributedType (lower case), a mixed_precision that is no
    PrecisionType, and gpu_ids fewer than the processes a machine starts are refused as accelerate refuses them
    (or its ranks fail), naming the key; the same configs written right plan."""
    with pytest.raises(UserError, match=match):
        _job(tmp_path, f"accelerate launch --config_file acc.yaml {TRAIN} --bf16 True\n", **{"acc.yaml": cfg})
    fixed = cfg.replace("fsdp", "FSDP").replace("5", "bf16").replace("0,1", "0,1,2,3,4,5,6,7")
    job = _job(tmp_path, f"accelerate launch --config_file acc.yaml {TRAIN} --bf16 True\n", **{"acc.yaml": fixed})
    assert job.nproc == 8


def test_an_empty_accelerate_config_names_accelerates_keys(tmp_path: Path) -> None:
    """An empty --config_file is no mapping: the message shows accelerate's keys, not a training config's."""
    with pytest.raises(UserError, match=r"acc\.yaml: expected a mapping of keys \(distributed_type: MULTI_GPU"):
        _job(tmp_path, f"accelerate launch --config_file acc.yaml {TRAIN} --bf16 True\n", **{"acc.yaml": ""})


def test_accelerate_distributed_type_as_accelerate_reads_it(tmp_path: Path) -> None:
    """YAML's bare `distributed_type: NO` reads false, which accelerate runs as one process (with num_processes;
    without it accelerate refuses the -1 it leaves); a config with no distributed_type, or `{}`, is refused as
    accelerate refuses it; MULTI_CPU, XLA and MEGATRON_LM run nothing the planner models: exit 2 naming the key,
    a flag or not."""
    run = f"accelerate launch --config_file acc.yaml {TRAIN} --bf16 True\n"
    job = _job(tmp_path, run, **{"acc.yaml": "distributed_type: NO\nnum_processes: 1\n"})
    assert (job.nproc, job.engine) == (1, "single")
    with pytest.raises(UserError, match="num_processes is -1 or not given"):
        _job(tmp_path, run, **{"acc.yaml": "distributed_type: NO\n"})
    for text in ("num_processes: 8\nmixed_precision: bf16\n", "{}\n"):
        with pytest.raises(UserError, match=r"no distributed_type: accelerate refuses it.*distributed_type: MULTI_GPU"):
            _job(tmp_path, run, **{"acc.yaml": text})
    for kind in ("MULTI_CPU", "XLA", "MEGATRON_LM"):
        with pytest.raises(UserError, match=rf"distributed_type {kind}: shardfit plans GPU jobs"):
            _job(tmp_path, run, **{"acc.yaml": f"distributed_type: {kind}\nnum_processes: 8\n"})
    with pytest.raises(UserError, match=r"distributed_type 'deepspeed' is not a valid DistributedType"):
        _job(tmp_path, f"accelerate launch --use_deepspeed --config_file acc.yaml {TRAIN}\n",
             **{"acc.yaml": "distributed_type: deepspeed\nnum_processes: 8\n"})
