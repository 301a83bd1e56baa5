"""`plan|check|convert --from llamafactory` on LLaMA-Factory's v1 configs (top-level `model:`, plugin mappings such
as `dist_config: {name: fsdp2}`) and its Megatron YAMLs (tests/foreign_jobs/lf_v1/): a v1 job is read into the
same job as a v0 one, a Megatron one exits 2 with a `shardfit plan` of its split that runs as printed, and bad v1
input exits 2 naming the file and the key."""

from __future__ import annotations

import json
import re
import shlex
from pathlib import Path

import pytest
import yaml

import shardfit.config.load as load
import shardfit.foreign.common as common
import shardfit.foreign.llamafactory_v1 as v1
from shardfit.cli.main import main
from shardfit.config import load_config
from shardfit.foreign.asplanned import plan_job
from shardfit.foreign.convert import to_yaml
from shardfit.foreign.read import JobOptions, read_job
from shardfit.plan.hardware import parse_gpus
from shardfit.plan.shapes import resolve_shape
from tests.helpers import ROOT, run_here

JOBS = ROOT / "tests" / "foreign_jobs" / "lf_v1"
PLUGINS = ("dist_config", "peft_config", "quant_config", "kernel_config", "optim_config", "init_config")

# file, ranks, GPUs, the engine read, (method, precision, seq, micro-batch, grad accum, rank, row split, expert
# split), fits as configured, keys that must be listed as not modelled.
CASES = [
    ("lora_fsdp2.yaml", 4, "4xH100", "FSDP full_shard", ("lora", "bf16", 4096, 2, 4, 32, 1, 1), True, set()),
    ("full_deepspeed.yaml", 8, "8xA100-80G", "DeepSpeed ZeRO-3", ("full", "bf16", 2048, 4, 1, 8, 1, 1), True, set()),
    ("qlora_single.yaml", None, "1x24GB", "one process, one GPU", ("qlora", "bf16", 1024, 1, 1, 8, 1, 1), True,
     {"optim_config.name", "peft_config.use_dora", "shiny_new_key"}),
    ("freeze_ddp.yaml", 2, "2x24GB", "DDP (full replica per rank)", ("freeze", "bf16", 512, 8, 1, 8, 1, 1), True,
     set()),
    ("moe_cp_ep.yaml", 8, "8xH100", "FSDP full_shard", ("full", "bf16", 16384, 1, 1, 8, 2, 4), False, set()),
]


def _keys(path: Path) -> set[str]:
    """The file's keys as the reader names them: a plugin mapping's as `plugin.key`."""
    out = set()
    for key, value in yaml.safe_load(path.read_text()).items():
        out |= {f"{key}.{k}" for k in value} if key in PLUGINS and isinstance(value, dict) else {key}
    return out


@pytest.mark.parametrize("file,nproc,gpus,engine,workload,fits,unmodelled", CASES, ids=[c[0] for c in CASES])
def test_v1_job_planned_checked_converted(tmp_path: Path, capsys: pytest.CaptureFixture, file: str, nproc: int | None,
                                          gpus: str, engine: str, workload: tuple, fits: bool,
                                          unmodelled: set) -> None:
    path = JOBS / file
    job = read_job("llamafactory", str(path), JobOptions(nproc=nproc))
    w = job.workload
    assert job.model == yaml.safe_load(path.read_text())["model"]
    assert job.describe_engine() == engine
    assert (w.method, w.precision, w.seq_len, w.micro_batch, w.grad_accum, w.lora_rank, w.sequence_parallel,
            w.expert_parallel) == workload
    assert w.loss == "full_shift" and not w.fused_adamw  # v1's own loss over fp32 logits; torch's AdamW
    fp = plan_job(job, resolve_shape(job.model), parse_gpus(gpus))
    assert fp.configured.fits is fits and fp.configured.per_gpu_gib.total > 0
    assert _keys(path) <= set(job.keys) | set(job.not_modelled), _keys(path) - set(job.keys) - set(job.not_modelled)
    assert unmodelled <= set(job.not_modelled), job.not_modelled
    launch = ["--nproc", str(nproc)] if nproc else []
    code, out, err = run_here(capsys, "plan", "--from", "llamafactory", str(path), "--gpus", gpus, *launch)
    assert code == (0 if fits else 3) and engine in out, err  # 3: does not fit as configured
    code, out, err = run_here(capsys, "check", "--from", "llamafactory", str(path), "--gpus", gpus, *launch)
    assert code in (0, 1) and "from llamafactory" in out, err
    converted = tmp_path / "converted.yaml"
    code, _, err = run_here(capsys, "convert", "--from", "llamafactory", str(path), *launch, "--out", str(converted))
    assert code == 0, err
    cfg = load_config(converted, check_files=False)
    assert (cfg.method, cfg.max_seq_len, cfg.micro_batch, cfg.grad_accum, cfg.strategy) == (
        w.method, w.seq_len, w.micro_batch, w.grad_accum, job.strategy)


def test_v1_settings_carried_over() -> None:
    """v1's own defaults and plugin keys reach the config: LoRA alpha and dropout (16 and 0.05 unless given), the
    freeze plugin's last blocks, the data its dataset YAML names, fsdp2's offload."""
    lora = to_yaml(read_job("llamafactory", str(JOBS / "lora_fsdp2.yaml"), JobOptions(nproc=4)))
    cfg = yaml.safe_load(lora)
    assert cfg["lora"] == {"rank": 32, "dropout": 0.05, "alpha": 64, "targets": "all-linear"}
    assert cfg["data"].endswith("lf_v1/data/sft.jsonl") and "expert_parallel" not in cfg
    freeze = yaml.safe_load(to_yaml(read_job("llamafactory", str(JOBS / "freeze_ddp.yaml"), JobOptions(nproc=2))))
    assert freeze["freeze_trainable"] == [f"layers.{i}" for i in range(24, 28)]  # Qwen3-0.6B: 28 blocks
    # The patterns must match the parameters apply_freeze walks (`layers.24.` matched none: train refused it).
    from shardfit.models.adapters import _matches

    assert all(_matches(f"model.layers.{i}.mlp.down_proj.weight", f"layers.{i}") for i in range(24, 28))
    assert not _matches("model.layers.2.mlp.down_proj.weight", "layers.24")


@pytest.mark.parametrize("strategy,packing", [(None, False), ("normal", False), ("padding_free", True)])
def test_v1_convert_keeps_padded_rows(tmp_path: Path, strategy: str | None, packing: bool) -> None:
    """v1's default batching pads one example a row; shardfit's default packs, so convert writes packing always."""
    f = tmp_path / "v1.yaml"
    given = f"batching_strategy: {strategy}\n" if strategy else ""
    f.write_text(f"model: Qwen/Qwen3-0.6B\nflash_attn: flash_attention_2\n{given}")
    out = tmp_path / "cfg.yaml"
    out.write_text(to_yaml(read_job("llamafactory", str(f), JobOptions())))
    assert load_config(out, check_files=False).packing is packing


def test_v1_precision_and_offload(tmp_path: Path) -> None:
    """A full fine-tune without dist_config computes in fp32 (v1 casts the model, and bf16 only sets FSDP2's
    compute dtype); fsdp2 with offload_params is the offloaded FSDP."""
    f = tmp_path / "full.yaml"
    f.write_text("model: Qwen/Qwen3-0.6B\nmicro_batch_size: 1\n")
    job = read_job("llamafactory", str(f), JobOptions())
    assert job.workload.precision == "fp32" and job.workload.method == "full" and job.engine == "single"
    f.write_text("model: Qwen/Qwen3-0.6B\ndist_config:\n  name: fsdp2\n  offload_params: true\n")
    assert read_job("llamafactory", str(f), JobOptions(nproc=2)).describe_engine() == \
        "FSDP full_shard with CPU offload"


@pytest.mark.parametrize("mixed,top,method,precision", [
    ({"bf16": {"enabled": "auto"}}, "false", "full", "bf16"),  # the YAML's bf16 never reaches DeepSpeed
    ({}, "true", "full", "bf16"),
    ({"bf16": {"enabled": False}}, "true", "full", "fp32"),  # no mixed precision over v1's fp32 model
    ({"fp16": {"enabled": False}}, "true", "full", "fp32"),
    ({"bf16": {"enabled": False}}, "true", "lora", "bf16"),  # adapters beside the checkpoint's 16 bits
    ({"fp16": {"enabled": True}}, "true", "full", None),  # v1 refuses fp16 under DeepSpeed
])
def test_v1_deepspeed_precision_from_its_json(tmp_path: Path, capsys: pytest.CaptureFixture, mixed: dict, top: str,
                                              method: str, precision: str | None) -> None:
    """Under DeepSpeed v1 decides the precision from the JSON alone (infer_deepspeed_mixed_precision)."""
    (tmp_path / "ds.json").write_text(json.dumps({"zero_optimization": {"stage": 2}, **mixed}))
    f = tmp_path / "v1.yaml"
    peft = "peft_config: {name: lora}\n" if method == "lora" else ""
    f.write_text(f"model: Qwen/Qwen3-0.6B\nbf16: {top}\n{peft}dist_config:\n  name: deepspeed\n"
                 f"  config_file: ds.json\n")
    if precision is None:
        code, _, err = run_here(capsys, "plan", "--from", "llamafactory", str(f), "--gpus", "2xH100", "--nproc", "2")
        assert code == 2 and "'fp16.enabled'" in err and "ds.json" in err and str(f) in err, err
        return
    job = read_job("llamafactory", str(f), JobOptions(nproc=2))
    assert (job.workload.precision, job.describe_engine()) == (precision, "DeepSpeed ZeRO-2")


@pytest.mark.parametrize("section", [{"optimizer": {"type": "AdamW", "params": {"lr": 1e-5}}},
                                     {"scheduler": {"type": "WarmupLR"}}])
def test_v1_deepspeed_optimizer_section_cannot_start(tmp_path: Path, capsys: pytest.CaptureFixture,
                                                     section: dict) -> None:
    """v1 builds its own torch optimizer and scheduler and passes both to accelerate, which raises a ValueError
    beside the JSON's optimizer or scheduler section: exit 2 naming the JSON and the section, not "fits"."""
    (tmp_path / "ds.json").write_text(json.dumps({"zero_optimization": {"stage": 2}, "bf16": {"enabled": True},
                                                  **section}))
    f = tmp_path / "v1.yaml"
    f.write_text("model: Qwen/Qwen3-0.6B\nbf16: true\ndist_config:\n  name: deepspeed\n  config_file: ds.json\n")
    code, out, err = run_here(capsys, "plan", "--from", "llamafactory", str(f), "--gpus", "2xH100", "--nproc", "2")
    key = next(iter(section))
    assert code == 2 and f"'{key}' section" in err and "ds.json" in err and "remove" in err, (out, err)


@pytest.mark.parametrize("quant,method", [("{name: auto}", "lora"), ("{name: auto, quantization_bit: 4}", "qlora"),
                                          ("{name: bnb}", "qlora")])
def test_v1_quant_auto_needs_bits(tmp_path: Path, quant: str, method: str) -> None:
    """v1's `auto` quantization plugin loads the model unquantized unless quantization_bit is given (bnb defaults
    to 4 bits): LoRA over it is planned as plain LoRA, with a note."""
    f = tmp_path / "q.yaml"
    f.write_text(f"model: Qwen/Qwen3-0.6B\npeft_config: {{name: lora}}\nquant_config: {quant}\n")
    job = read_job("llamafactory", str(f), JobOptions())
    assert job.workload.method == method
    assert any("applies no quantization" in n for n in job.notes) is (method == "lora"), job.notes


def test_freeze_trainable_layers_reach_the_plan(tmp_path: Path) -> None:
    """The blocks `freeze_trainable_layers` trains are what the plan counts, in v1 and v0 YAMLs and in the converted
    config: 8 blocks train four times the weights of the default 2, and the first 8 make backward run through every
    block."""
    from shardfit.plan.estimate import trainable_params
    from shardfit.plan.flops import backward_layers
    from shardfit.plan.workload import blocks_named, workload_of

    shape = resolve_shape("Qwen/Qwen3-0.6B")  # 28 blocks
    f = tmp_path / "f.yaml"
    counts = {}
    for n in (None, 8, -8):
        given = "" if n is None else f", freeze_trainable_layers: {n}"
        f.write_text(f"model: Qwen/Qwen3-0.6B\npeft_config: {{name: freeze{given}}}\n")
        job = read_job("llamafactory", str(f), JobOptions())
        counts[n] = trainable_params(shape, job.workload), backward_layers(shape, job.workload)
        cfg = tmp_path / "cfg.yaml"
        cfg.write_text(to_yaml(job))
        assert trainable_params(shape, workload_of(load_config(cfg, check_files=False))) == counts[n][0]
        v0 = tmp_path / "v0.yaml"
        v0.write_text("model_name_or_path: Qwen/Qwen3-0.6B\nfinetuning_type: freeze\n"
                      + ("" if n is None else f"freeze_trainable_layers: {n}\n"))
        assert trainable_params(shape, read_job("llamafactory", str(v0), JobOptions()).workload) == counts[n][0]
    block = shape.layer_params()
    assert counts[None] == (2 * block + shape.hidden, 2)  # the default is planned as before
    assert counts[8] == (8 * block + shape.hidden, 8) and counts[-8] == (8 * block + shape.hidden, 28)
    # shardfit's own freeze_trainable: the blocks it names, the last two when it names none (a glob, the norm)
    assert blocks_named(["model.layers.11", "layers.3.mlp", "norm"]) == (3, 11)
    assert blocks_named(["layers.1*", "norm"]) == ()


@pytest.mark.parametrize("peft,reference", [("peft_config: {name: lora}\n", False), ("", True)])
def test_v1_pair_dataset_planned_as_dpo(tmp_path: Path, peft: str, reference: bool) -> None:
    """A dataset YAML whose entry has `converter: pair` (LF's own train_lora_dpo.yaml has no pref_* key) is
    v1's DPO data: planned as dpo, a full fine-tune with the trainer's deep-copied reference, LoRA with none."""
    (tmp_path / "pairs.yaml").write_text("prefs:\n  path: org/prefs\n  converter: pair\n")
    f = tmp_path / "dpo.yaml"
    f.write_text(f"model: Qwen/Qwen3-0.6B\n{peft}train_dataset: pairs.yaml\npref_beta: 0.2\n")
    job = read_job("llamafactory", str(f), JobOptions())
    assert job.workload.objective == "dpo" and job.convert["objective"] == "dpo", job.notes
    assert job.convert["dpo"]["beta"] == 0.2 and "pref_beta" in job.keys and "pref_beta" not in job.not_modelled
    assert any("converter: pair" in n for n in job.notes) and (job.reference is not None) is reference
    (tmp_path / "pairs.yaml").write_text("sft:\n  path: org/sft\n")
    assert read_job("llamafactory", str(f), JobOptions()).workload.objective == "sft"


def test_v1_fsdp_on_one_process_and_fsdp_precision(tmp_path: Path) -> None:
    """fsdp2 on one process: v1 has no device mesh and leaves the model unwrapped, so a full fine-tune is the
    unsharded fp32 one; over several ranks `bf16: false` is FSDP2's fp32 param_dtype for LoRA too."""
    f = tmp_path / "v1.yaml"
    f.write_text("model: Qwen/Qwen3-0.6B\ndist_config: {name: fsdp2}\n")
    for opts in (JobOptions(nproc=1), JobOptions(gpus=parse_gpus("1x24GB"))):
        job = read_job("llamafactory", str(f), opts)
        assert (job.engine, job.workload.precision) == ("single", "fp32"), (job.engine, job.workload)
        assert any("no device mesh" in n for n in job.notes)
    assert read_job("llamafactory", str(f), JobOptions(nproc=2)).workload.precision == "bf16"
    f.write_text("model: Qwen/Qwen3-0.6B\nbf16: false\npeft_config: {name: lora}\ndist_config: {name: fsdp2}\n")
    job = read_job("llamafactory", str(f), JobOptions(nproc=2))
    assert (job.engine, job.workload.precision) == ("fsdp_full_shard", "fp32")


def test_v1_ranks_default_to_the_gpus(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    """Without --nproc v1's launcher starts a rank per visible GPU: --gpus' count shards FSDP and divides the global
    batch alike, so a global batch 8 ranks do not divide exits 2 as v1 refuses it."""
    f = tmp_path / "v1.yaml"
    f.write_text("model: Qwen/Qwen3-0.6B\ndist_config: {name: fsdp2}\nglobal_batch_size: 16\n")
    job = read_job("llamafactory", str(f), JobOptions(gpus=parse_gpus("8xH100")))
    assert (job.nproc, job.workload.grad_accum, job.engine) == (8, 2, "fsdp_full_shard")
    f.write_text("model: Qwen/Qwen3-0.6B\ndist_config: {name: fsdp2}\nglobal_batch_size: 12\n")
    code, _, err = run_here(capsys, "plan", "--from", "llamafactory", str(f), "--gpus", "8xH100")
    assert code == 2 and "global_batch_size" in err, err


def test_megatron_refusal_plans_on_the_given_gpus(capsys: pytest.CaptureFixture, tmp_path: Path) -> None:
    """The printed plan keeps --gpus' card and count (Megatron runs its split data-parallel over them); a count
    the split does not tile, or a fractional split size, exits 2 naming it."""
    err = _refusal(capsys, "plan", "megatron_tp.yaml", "8xA100-80G")
    printed = re.search(r"`(shardfit plan [^`]+)`", err).group(1)
    assert "--gpus 8xA100-80G" in printed, printed
    code, _, err = run_here(capsys, "plan", "--from", "llamafactory", str(JOBS / "megatron_moe.yaml"),
                            "--gpus", "6xH100")
    assert code == 2 and "multiple of" in err, err
    f = tmp_path / "m.yaml"
    f.write_text("model_name_or_path: Qwen/Qwen3-8B\npipeline_model_parallel_size: 2.5\n")
    code, _, err = run_here(capsys, "plan", "--from", "llamafactory", str(f), "--gpus", "8xH100")
    assert code == 2 and f"{f}:2" in err and "pipeline_model_parallel_size" in err, err


def _refusal(capsys: pytest.CaptureFixture, command: str, file: str, card: str = "8xH100") -> str:
    gpus = ["--gpus", card] if command != "convert" else []
    code, _, err = run_here(capsys, command, "--from", "llamafactory", str(JOBS / file), *gpus)
    assert code == 2 and "Megatron" in err, err
    return err


@pytest.mark.parametrize("file,flags", [
    ("megatron_moe.yaml", ("--pipeline-parallel 4", "--expert-parallel 2", "--grad-accum 8", "--grad-ckpt full")),
    ("megatron_tp.yaml", ("--pipeline-parallel 2", "--grad-accum 2", "--grad-ckpt none")),
])
def test_megatron_yaml_refused_with_its_split(capsys: pytest.CaptureFixture, file: str, flags: tuple) -> None:
    err = _refusal(capsys, "plan", file)
    for command in ("check", "convert"):
        _refusal(capsys, command, file)
    printed = re.search(r"`(shardfit plan [^`]+)`", err).group(1)
    assert all(f in printed for f in flags), printed
    assert ("tensor parallelism is not planned" in err) is (file == "megatron_tp.yaml")
    code, out, err = run_here(capsys, *shlex.split(printed)[1:])  # runs as printed
    assert code == 0 and "pipeline_parallel=" in out, err


BAD = [
    ("micro_batch_size: two\n", "micro_batch_size"),
    ("dist_config:\n  name: fsdp3\n", "dist_config.name"),
    ("dist_config: fsdp2\n", "dist_config"),
    ("dist_config:\n  name: deepspeed\n", "config_file"),
    ("peft_config:\n  name: ia3\n", "peft_config.name"),
    ("quant_config:\n  name: bnb\n  quantization_bit: 3\n", "quant_config.quantization_bit"),
    ("cp_size: 2\ndist_config:\n  name: fsdp2\n", "cp_size"),
    ("flash_attn: fa2\n", "flash_attn"),
    ("micro_batch_size: 3\nglobal_batch_size: 8\n", "global_batch_size"),
    ("batching_strategy: padding_free\n", "batching_strategy"),
    # a zero or negative count is refused before grad accumulation divides by it
    ("micro_batch_size: 0\nglobal_batch_size: 8\n", "micro_batch_size"),
    ("cp_size: 0\nglobal_batch_size: 8\n", "cp_size"),
    ("dp_size: 0\nglobal_batch_size: 8\n", "dp_size"),
    ("micro_batch_size: -1\n", "micro_batch_size"),
    ("cutoff_len: 0\n", "cutoff_len"),
    ("peft_config:\n  name: lora\n  r: 0\n", "peft_config.r"),
    ("peft_config:\n  name: lora\nquant_config:\n  name: gptq\n", "quant_config.name"),  # bnb and auto only
]


@pytest.mark.parametrize("body,key", BAD, ids=[b[1] for b in BAD])
def test_bad_v1_input_exits_2_naming_file_and_key(tmp_path: Path, capsys: pytest.CaptureFixture, body: str,
                                                  key: str) -> None:
    f = tmp_path / "v1.yaml"
    f.write_text("model: Qwen/Qwen3-0.6B\n" + body)
    code, _, err = run_here(capsys, "plan", "--from", "llamafactory", str(f), "--gpus", "1x24GB")
    assert code == 2 and str(f) in err and key in err and "Traceback" not in err, err


@pytest.mark.parametrize("body,key", [("per_device_train_batch_size: -1\n", "per_device_train_batch_size"),
                                      ("cutoff_len: 0\n", "cutoff_len")])
def test_v0_count_below_one_exits_2(tmp_path: Path, capsys: pytest.CaptureFixture, body: str, key: str) -> None:
    """The v0 table shares v1's count reader: a batch or length below 1 names its key (no empty plan)."""
    f = tmp_path / "v0.yaml"
    f.write_text("model_name_or_path: Qwen/Qwen3-0.6B\nfinetuning_type: lora\n" + body)
    code, _, err = run_here(capsys, "plan", "--from", "llamafactory", str(f), "--gpus", "1x24GB")
    assert code == 2 and str(f) in err and key in err and "Traceback" not in err, err


@pytest.mark.parametrize("model,says", [(None, "Qwen/Qwen3-4B-Instruct-2507"), ({"name": "Qwen/Qwen3-4B"}, "hub id")])
def test_v1_without_model_exits_2(tmp_path: Path, capsys: pytest.CaptureFixture, model: object, says: str) -> None:
    """No `model` (v1 would train its default checkpoint) or one that is not a name: exit 2 naming it."""
    f = tmp_path / "v1.yaml"
    f.write_text(yaml.safe_dump({**({"model": model} if model else {}), "dist_config": {"name": "fsdp2"}}))
    code, _, err = run_here(capsys, "plan", "--from", "llamafactory", str(f), "--gpus", "1x24GB")
    assert code == 2 and str(f) in err and "'model'" in err and says in err, err


@pytest.mark.parametrize("command", ["plan", "check", "convert"])
def test_v1_dpo_with_context_parallel_exits_2(tmp_path: Path, capsys: pytest.CaptureFixture, command: str) -> None:
    """v1's DPO trainer refuses cp_size above 1 when it starts (whatever pref_loss): plan, check and convert exit 2
    naming the key and the fix, not a plan of a job that never runs; the same rows as SFT data still plan."""
    (tmp_path / "pairs.yaml").write_text("prefs:\n  path: org/prefs\n  converter: pair\n")
    f = tmp_path / "dpo_cp.yaml"
    f.write_text("model: Qwen/Qwen3-0.6B\npeft_config: {name: lora}\ndist_config: {name: fsdp2}\n"
                 "flash_attn: flash_attention_2\ncp_size: 2\ncutoff_len: 16384\ntrain_dataset: pairs.yaml\n")
    gpus = [] if command == "convert" else ["--gpus", "2xH100"]
    assert main([command, "--from", "llamafactory", str(f), "--nproc", "2", *gpus]) == 2
    err = capsys.readouterr().err
    assert f"{f}:5" in err and "cp_size 2" in err and "DPO" in err and "set it to 1" in err
    (tmp_path / "pairs.yaml").write_text("sft:\n  path: org/sft\n")
    assert read_job("llamafactory", str(f), JobOptions(nproc=2)).workload.sequence_parallel == 2


def test_v1_yaml_is_read_once(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The job's YAML is parsed once: the reader that tells v1 from v0 hands the v1 reader its mapping."""
    seen: list[str] = []

    def counted(path, *args, **kwargs):
        seen.append(str(path))
        return load.read_yaml(path, *args, **kwargs)
    monkeypatch.setattr(common, "read_yaml", counted)
    monkeypatch.setattr(v1, "read_yaml", counted)
    read_job("llamafactory", str(JOBS / "lora_fsdp2.yaml"), JobOptions(nproc=4))
    assert seen.count(str(JOBS / "lora_fsdp2.yaml")) == 1, seen
