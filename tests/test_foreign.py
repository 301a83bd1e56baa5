"""`plan|check|convert --from TOOL`: real-world-shaped jobs of LLaMA-Factory, ms-swift, axolotl, the HF Trainer and
DeepSpeed (tests/foreign_jobs/) are read, planned, checked and converted; each gives the finding its users
needed."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from shardfit.config import load_config
from shardfit.errors import UserError
from shardfit.foreign.asplanned import plan_job
from shardfit.foreign.common import hf_loss
from shardfit.foreign.convert import to_config, to_yaml
from shardfit.foreign.deepspeed import named_settings, read_deepspeed
from shardfit.foreign.read import JobOptions, read_job
from shardfit.foreign.rules import foreign_rules
from shardfit.foreign.shell import parse_command
from shardfit.plan.hardware import parse_gpus
from shardfit.plan.shapes import resolve_shape
from tests.helpers import ROOT, run_here

JOBS = ROOT / "tests" / "foreign_jobs"

# tool, file, options, GPUs, the engine read, fits as configured, rules that must be found, rules that must not.
CASES = [
    # Seed: LLaMA-Factory Qwen2-VL-72B LoRA with ds_z3_config.json on 8 x 24 GB.
    ("llamafactory", "lf/qwen2vl_72b_lora_ds3.yaml", {"nproc": 8}, "8x24GB", "DeepSpeed ZeRO-3", False,
     {"predicted_oom"}, {"device_map_in_distributed"}),
    ("llamafactory", "lf/llama3_8b_full_ds2.yaml", {"nproc": 8}, "8x24GB", "DeepSpeed ZeRO-2", False,
     {"predicted_oom"}, set()),
    ("llamafactory", "lf/qwen25_7b_qlora.yaml", {}, "1x24GB", "one process, one GPU", True, {"not_modelled"},
     {"predicted_oom"}),
    ("llamafactory", "lf/qwen25_14b_qlora_ds3.yaml", {"nproc": 4}, "4x24GB", "DeepSpeed ZeRO-3", True, set(),
     {"fsdp_quantized_storage"}),
    ("llamafactory", "lf/qwen25_omni_lora_ds3.yaml", {"nproc": 4}, "4xH100", "DeepSpeed ZeRO-3", True, set(),
     {"unused_module"}),
    # Seed: ms-swift Qwen2.5-Omni LoRA with --deepspeed zero3 on 4 x H100: the talker stays on the CPU.
    ("swift", "swift/omni_zero3_4xh100.sh", {}, "4xH100", "DeepSpeed ZeRO-3", True, {"unused_module"}, set()),
    ("swift", "swift/qwen25_7b_lora_ddp.sh", {}, "2x24GB", "DDP (full replica per rank)", True, set(),
     {"predicted_oom", "not_modelled"}),
    ("swift", "swift/qwen25_72b_lora_device_map.sh", {}, "4xA100-80G", "one process, device_map=auto over the "
     "node's GPUs", True, {"device_map_split"}, {"device_map_in_distributed"}),
    ("swift", "swift/qwen25_32b_qlora_zero3.sh", {}, "4x24GB", "DeepSpeed ZeRO-3", True,
     {"fsdp_quantized_storage"}, {"predicted_oom"}),
    # 21 GiB with the embeddings, norms and head back in bf16 (axolotl's cast after the k-bit preparation)
    ("axolotl", "axolotl/llama31_8b_qlora.yml", {}, "1x16GB", "one process, one GPU", False, {"predicted_oom"},
     set()),
    ("axolotl", "axolotl/llama31_70b_qlora_fsdp.yml", {"nproc": 2}, "2x80GB", "FSDP full_shard", True, set(),
     {"fsdp_quantized_storage", "predicted_oom"}),
    # its lora_target_modules (q_proj, v_proj) are planned, so every key is modelled
    ("axolotl", "axolotl/mistral_lora_ddp.yml", {"nproc": 4}, "4x24GB", "DDP (full replica per rank)", True,
     {"gc_ddp_reentrant"}, {"not_modelled"}),
    # Seed: Qwen finetune.py LoRA under torchrun, the script loading with device_map="auto".
    ("hf", "hf/finetune_lora_torchrun.sh", {}, "4x24GB", "DDP (full replica per rank)", True,
     {"device_map_in_distributed", "gc_ddp_reentrant"}, set()),
    # Seed: GLM-4 split over four GPUs with a device map in one process.
    ("hf", "hf/glm4/train.sh", {}, "4x24GB", "one process, device_map=auto over the node's GPUs", True,
     {"device_map_split", "device_map_cross_device"}, {"device_map_in_distributed"}),
    ("hf", "hf/qlora/finetune_qlora_ds3.sh", {}, "8x24GB", "DeepSpeed ZeRO-3", True, {"fsdp_quantized_storage"},
     {"device_map_in_distributed"}),
    ("hf", "hf/trainer_args.json", {"model": "Qwen/Qwen2.5-7B-Instruct", "nproc": 8}, "8x24GB",
     "DeepSpeed ZeRO-3", False, {"predicted_oom", "not_modelled"}, set()),
    ("deepspeed", "deepspeed/ds_z3_offload.json", {"model": "meta-llama/Llama-3.1-70B", "seq": 4096, "nproc": 8},
     "8xA100-80G", "DeepSpeed ZeRO-3 (offload optimizer + params)", True, {"not_modelled"}, {"predicted_oom"}),
    ("deepspeed", "deepspeed/ds_z2.json", {"model": "meta-llama/Llama-3.1-8B", "seq": 2048, "nproc": 8},
     "8xA100-80G", "DeepSpeed ZeRO-2", True, set(), {"predicted_oom", "not_modelled"}),
]


def _plan(tool: str, file: str, opts: dict, gpus: str):
    job = read_job(tool, str(JOBS / file), JobOptions(**opts))
    return plan_job(job, resolve_shape(job.model), parse_gpus(gpus))


@pytest.mark.parametrize("tool,file,opts,gpus,engine,fits,found,absent", CASES, ids=[c[1] for c in CASES])
def test_job_planned_checked_converted(tmp_path: Path, tool: str, file: str, opts: dict, gpus: str, engine: str,
                                       fits: bool, found: set, absent: set) -> None:
    fp = _plan(tool, file, opts, gpus)
    assert fp.job.describe_engine() == engine
    assert fp.configured.fits is fits, fp.configured
    assert fp.configured.per_gpu_gib.total > 0
    if not fits:
        assert fp.would, "a job that does not fit gets the nearest changes that do"
    rules = {f.rule for f in foreign_rules(fp)}
    assert found <= rules, rules
    assert not absent & rules, rules
    # Every key of the file is accounted for: modelled, of no effect on memory, or listed as not modelled.
    _assert_every_key_read(tool, JOBS / file, fp.job)
    # convert writes a config shardfit loads, with the same workload and sharding
    out = tmp_path / "converted.yaml"
    out.write_text(to_yaml(fp.job))
    cfg = load_config(out, check_files=False)
    w = fp.job.workload
    assert (cfg.method, cfg.max_seq_len, cfg.micro_batch, cfg.grad_accum) == (w.method, w.seq_len, w.micro_batch,
                                                                             w.grad_accum)
    assert cfg.strategy == fp.job.strategy
    if fp.job.data:  # local data files resolved, so `shardfit train` finds them
        load_config(out, check_files=True)


def _assert_every_key_read(tool: str, path: Path, job) -> None:
    seen = set(job.keys) | set(job.not_modelled)
    if tool in ("llamafactory", "axolotl"):
        keys = set(yaml.safe_load(path.read_text()))
    elif tool == "deepspeed":  # nested: every top-level section shows up in a dotted key
        keys = set(json.loads(path.read_text()))
        seen = {k.split(".")[0] for k in seen}
    elif path.suffix == ".json":
        keys = set(json.loads(path.read_text()))
    else:
        cmd = parse_command(path.read_text(), str(path), ("swift sft", ".py"))
        keys = set(cmd.args)
    assert keys <= seen, keys - seen


def test_the_remote_code_loss_warning_is_chatglm_s_only(tmp_path: Path) -> None:
    """The device-unsafe loss is ChatGLM's remote code (model_type chatglm); GLM-4.5-Air is transformers' own
    glm4_moe class, whose loss moves the labels to the logits' device: split alike, warned only for the first."""
    found = {}
    for model in ("THUDM/glm-4-9b-chat", "zai-org/GLM-4.5-Air"):
        script = tmp_path / "train.sh"
        script.write_text((JOBS / "hf/glm4/train.sh").read_text().replace("THUDM/glm-4-9b-chat", model))
        (tmp_path / "finetune_glm.py").write_text((JOBS / "hf/glm4/finetune_glm.py").read_text())
        job = read_job("hf", str(script), JobOptions())
        fp = plan_job(job, resolve_shape(job.model), parse_gpus("4x80GB"))
        found[model] = {f.rule for f in foreign_rules(fp)}
    assert {"device_map_split", "device_map_cross_device"} <= found["THUDM/glm-4-9b-chat"]
    assert "device_map_split" in found["zai-org/GLM-4.5-Air"]
    assert "device_map_cross_device" not in found["zai-org/GLM-4.5-Air"]


def test_seed_findings_in_the_tools_words() -> None:
    """The fix each seed user needed, said the way their tool says it."""
    lf = _plan("llamafactory", "lf/qwen2vl_72b_lora_ds3.yaml", {"nproc": 8}, "8x24GB")
    assert lf.configured.per_gpu_gib.total > 24 and any("ds_z3_offload_config.json" in x for x in lf.would)
    omni = {f.rule: f for f in foreign_rules(_plan("swift", "swift/omni_zero3_4xh100.sh", {}, "4xH100"))}
    assert omni["unused_module"].fix == "ENABLE_AUDIO_OUTPUT=0" and "cpu" in omni["unused_module"].message
    qwen = {f.rule: f for f in foreign_rules(_plan("hf", "hf/finetune_lora_torchrun.sh", {}, "4x24GB"))}
    assert "LOCAL_RANK" in qwen["device_map_in_distributed"].fix
    assert "torchrun" in qwen["device_map_in_distributed"].message
    glm = _plan("hf", "hf/glm4/train.sh", {}, "4x24GB")
    assert glm.job.engine == "device_map" and glm.hardware.gpus_per_node == 4 and not glm.job.distributed
    mistral = {f.rule: f for f in foreign_rules(_plan("axolotl", "axolotl/mistral_lora_ddp.yml", {"nproc": 4},
                                                      "4x24GB"))}
    assert "use_reentrant: false" in mistral["gc_ddp_reentrant"].fix


def test_tool_memory_behaviour_reaches_the_workload() -> None:
    """Each tool's own memory rules: LLaMA-Factory's pure_bf16 adapters, axolotl's k-bit preparation undone, Liger's
    fused loss, the loss of the transformers version, DeepSpeed's "auto" buckets from the model's width."""
    omni = read_job("llamafactory", str(JOBS / "lf/qwen25_omni_lora_ds3.yaml"), JobOptions(nproc=4))
    assert omni.workload.adapters_16bit and not omni.workload.frozen_fp32
    ax = read_job("axolotl", str(JOBS / "axolotl/llama31_8b_qlora.yml"), JobOptions())
    # axolotl casts a dense model's embeddings, norms and head back to bf16 after the k-bit preparation
    assert not ax.workload.frozen_fp32 and ax.workload.method == "qlora" and ax.workload.attention == "flash"
    assert read_job("llamafactory", str(JOBS / "lf/qwen25_7b_qlora.yaml"), JobOptions()).workload.loss == "chunked"
    old = read_job("swift", str(JOBS / "swift/omni_zero3_4xh100.sh"), JobOptions(transformers="4.47.1"))
    assert old.workload.loss == "full_shift" and hf_loss("4.50.0", False) == "full"
    z = read_job("llamafactory", str(JOBS / "lf/qwen2vl_72b_lora_ds3.yaml"), JobOptions(nproc=8)).zero
    assert z is not None and z.reduce_bucket_size == 8192**2 and z.param_persistence_threshold == 81920
    assert z.prefetch_bucket_size == int(0.9 * 8192**2) and not z.overlap_comm


def test_deepspeed_reader() -> None:
    z = read_deepspeed({"zero_optimization": {"stage": 3, "offload_param": {"device": "cpu"}}}, "x", 1024).zero
    assert z.stage == 3 and z.offload_param and not z.offload_optimizer and z.overlap_comm  # DeepSpeed's default
    job = read_deepspeed({"zero_optimization": {"stage": 2, "fancy_new_knob": 1}, "bf16": {"enabled": True}}, "x", 8)
    assert "zero_optimization.fancy_new_knob" in job.not_modelled and job.precision == "bf16"
    for name, stage, opt, par in (("zero3_offload", 3, True, True), ("ds_z2_config.json", 2, False, False),
                                  ("zero3_bf16_cpuoffload_params.json", 3, False, True)):
        got = read_deepspeed(named_settings(name), name, 8).zero
        assert (got.stage, got.offload_optimizer, got.offload_param) == (stage, opt, par), name
    with pytest.raises(UserError, match="stage"):
        read_deepspeed({"zero_optimization": {"stage": 4}}, "ds.json", 8)


def test_shell_commands() -> None:
    script = """#!/bin/bash
# comment
export MODEL=Qwen/Qwen2.5-7B-Instruct
n=4
CUDA_VISIBLE_DEVICES=0,1,2,3 \\
NPROC_PER_NODE=$n swift sft --model $MODEL --lora_rank 16 \\
    --dataset a.jsonl b.jsonl --gradient_checkpointing
"""
    cmd = parse_command(script, "s.sh", ("swift sft",))
    assert cmd.args["model"] == "Qwen/Qwen2.5-7B-Instruct" and cmd.nproc == 4 and cmd.args["dataset"] == \
        "a.jsonl b.jsonl" and cmd.args["gradient_checkpointing"] == "true"
    assert "n" not in cmd.exported and cmd.exported["NPROC_PER_NODE"] == "4"
    tr = parse_command("torchrun --nnodes 2 --nproc_per_node=8 train.py --bf16 True", "c", (".py",))
    assert (tr.launcher, tr.nproc, tr.nnodes, tr.program, tr.args["bf16"]) == ("torchrun", 8, 2, "train.py", "True")
    ds = parse_command("deepspeed --num_gpus 2 finetune.py --deepspeed z.json", "c", (".py",))
    assert ds.launcher == "deepspeed" and ds.nproc == 2
    py = parse_command("python -m torch.distributed.run --nproc-per-node 4 t.py", "c", (".py",))
    assert py.launcher == "torchrun" and py.nproc == 4
    with pytest.raises(UserError, match="no command running"):
        parse_command("echo hi", "x.sh", ("swift sft",))


def test_convert_carries_what_shardfit_needs() -> None:
    job = read_job("llamafactory", str(JOBS / "lf/qwen2vl_72b_lora_ds3.yaml"), JobOptions(nproc=8))
    cfg = to_config(job)
    assert cfg["data"].endswith("mllm_demo.json")  # through dataset_info.json; the hub dataset is left out
    assert cfg["lora"] == {"rank": 8, "alpha": 16, "targets": "all-linear"} and cfg["lr"] == 1e-4
    omni = to_config(read_job("swift", str(JOBS / "swift/omni_zero3_4xh100.sh"), JobOptions()))
    assert omni["drop_modules"] == ["talker", "token2wav"] and omni["strategy"] == "zero3"
    text = to_yaml(read_job("hf", str(JOBS / "hf/finetune_lora_torchrun.sh"), JobOptions()))
    assert "device_map=auto dropped" in text and "device_map:" not in text.split("\n", 3)[-1]


def test_cli_plan_check_convert(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    lf = str(JOBS / "lf/qwen2vl_72b_lora_ds3.yaml")
    code, out, err = run_here(capsys, "plan", "--from", "llamafactory", lf, "--gpus", "8x24GB", "--nproc", "8")
    assert code == 3, err  # as configured it does not fit
    assert "as configured: DeepSpeed ZeRO-3" in out and "does not fit" in out and "what would" in out
    code, out, err = run_here(capsys, "plan", "--from", "llamafactory", lf, "--gpus", "8x24GB", "--nproc", "8",
                              "--json")
    d = json.loads(out)
    assert d["from"]["as_configured"]["fits"] is False and d["from"]["ranks"] == 8 and d["candidates"]
    code, out, err = run_here(capsys, "check", "--from", "swift", str(JOBS / "swift/omni_zero3_4xh100.sh"), "--gpus",
                              "4xH100", "--json")
    assert code == 1
    found = {f["rule"]: f for f in json.loads(out)["findings"]}
    assert found["unused_module"]["fix"] == "ENABLE_AUDIO_OUTPUT=0"
    converted = tmp_path / "shardfit.yaml"
    code, out, err = run_here(capsys, "convert", "--from", "llamafactory", lf, "--out", str(converted))
    assert code == 0, err
    assert load_config(converted).strategy == "zero3"


def test_cli_bad_input_exits_2(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    ds = str(JOBS / "deepspeed/ds_z2.json")
    code, _, err = run_here(capsys, "plan", "--from", "deepspeed", ds, "--gpus", "8x80GB")
    assert code == 2 and "--model" in err and "Traceback" not in err
    bad = tmp_path / "ds.json"
    bad.write_text('{"zero_optimization": {"stage": 3,}}')
    code, _, err = run_here(capsys, "check", "--from", "deepspeed", str(bad), "--model", "meta-llama/Llama-3.1-8B")
    assert code == 2 and f"{bad}:1" in err
    lf = tmp_path / "lf.yaml"
    lf.write_text("model_name_or_path: meta-llama/Llama-3.1-8B\nfinetuning_type: lorra\n")
    code, _, err = run_here(capsys, "plan", "--from", "llamafactory", str(lf), "--gpus", "1x24GB")
    assert code == 2 and f"{lf}:2" in err and "finetuning_type" in err
    code, _, err = run_here(capsys, "convert", str(lf))
    assert code == 2 and "--from" in err
    code, _, err = run_here(capsys, "plan", "--from", "axolotl", str(tmp_path / "missing.yml"))
    assert code == 2 and "not found" in err


def test_deepspeed_json_precision_must_match_the_arguments(tmp_path: Path) -> None:
    """A JSON's explicit fp16.enabled true with --fp16 unset: transformers raises on the mismatch before step 1,
    so exit 2 naming both; with --fp16 true the job plans in fp16."""
    (tmp_path / "ds.json").write_text('{"fp16": {"enabled": true}, "zero_optimization": {"stage": 2}}')
    run = ("deepspeed --num_gpus 2 train.py --model_name_or_path Qwen/Qwen2.5-7B-Instruct --deepspeed ds.json "
           "--max_seq_length 1024{}\n")
    (tmp_path / "run.sh").write_text(run.format(""))
    with pytest.raises(UserError, match="fp16.enabled is true while --fp16 resolves to false"):
        read_job("hf", str(tmp_path / "run.sh"), JobOptions())
    (tmp_path / "run.sh").write_text(run.format(" --fp16 true"))
    job = read_job("hf", str(tmp_path / "run.sh"), JobOptions())
    assert (job.workload.precision, job.nproc, job.zero.stage, job.workload.seq_len) == ("fp16", 2, 2, 1024)


@pytest.mark.parametrize("text, expected", [
    (b"model_name_or_path: meta-llama/Llama-3.1-8B\nlora_rank: 8\nlora_rank: 16\n", ":3: 'lora_rank' is given twice"),
    (b"model_name_or_path: caf\xe9\n", "not UTF-8"),
    (b"a: &x [1, *x]\n", "refers to itself"),
])
def test_tool_yaml_is_read_as_strictly_as_ours(tmp_path: Path, text: bytes, expected: str) -> None:
    """Another tool's YAML goes through the same hardened reader as a shardfit config: no traceback, no silent
    last-one-wins for a key given twice."""
    for tool in ("llamafactory", "axolotl"):
        path = tmp_path / f"{tool}.yaml"
        path.write_bytes(text)
        with pytest.raises(UserError, match=expected.replace("'", ".")):
            read_job(tool, str(path), JobOptions())


def _with_torch_compile(tool: str, src: Path, dst: Path, value: str | None) -> None:
    """A copy of one of tests/foreign_jobs' files with `torch_compile` set to `value` (None: left out)."""
    text = src.read_text()
    if value is not None:
        if tool in ("llamafactory", "axolotl"):
            text += f"\ntorch_compile: {value}\n"
        elif src.suffix == ".json":
            text = json.dumps({**json.loads(text), "torch_compile": value == "true"})
        else:
            text = text.rstrip() + f" \\\n    --torch_compile {value}\n"
    dst.write_text(text)


@pytest.mark.parametrize("tool,file,opts", [
    ("llamafactory", "lf/qwen25_7b_qlora.yaml", {}), ("axolotl", "axolotl/mistral_lora_ddp.yml", {"nproc": 4}),
    ("swift", "swift/qwen25_7b_lora_ddp.sh", {}),
    ("hf", "hf/trainer_args.json", {"model": "Qwen/Qwen2.5-7B-Instruct", "nproc": 8})])
def test_torch_compile_is_planned_and_carried_over(tmp_path: Path, tool: str, file: str, opts: dict) -> None:
    """TrainingArguments' `torch_compile` (and axolotl's) compiles the model, as shardfit's `compile: true` does: the
    plan times it compiled and the converted config says so; left out, the plan stays eager and the converted
    config leaves shardfit's `compile: auto`."""
    seen = {}
    for value in (None, "true"):
        path = tmp_path / f"{value}{Path(file).suffix}"
        _with_torch_compile(tool, JOBS / file, path, value)
        job = read_job(tool, str(path), JobOptions(**opts))
        cfg = yaml.safe_load(to_yaml(job))
        seen[value] = (job.workload.compile, cfg.get("compile", "auto"))
        _assert_every_key_read(tool, path, job)
    assert seen == {None: (False, "auto"), "true": (True, True)}
