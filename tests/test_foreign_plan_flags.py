"""`plan --from TOOL FILE` with plan's workload flags: each applies on top of what the file cannot say, or exits 2
naming the flag and why; none is dropped in silence."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from shardfit.cli.main import main
from tests.helpers import ROOT

JOBS = ROOT / "tests" / "foreign_jobs"
LF_QLORA = str(JOBS / "lf" / "qwen25_7b_qlora.yaml")


def _script(tmp_path: Path, q_lora: bool) -> str:
    """A Qwen finetune.py-style command line: the script (not here) loads and prepares the model."""
    f = tmp_path / ("q.sh" if q_lora else "lora.sh")
    f.write_text("python finetune.py --model_name_or_path Qwen/Qwen2.5-7B-Instruct --use_lora True "
                 f"--q_lora {q_lora} --bf16 True --per_device_train_batch_size 1 --model_max_length 2048 "
                 "--output_dir out --gradient_checkpointing True\n")
    return str(f)


def _plan(capsys: pytest.CaptureFixture, *argv: str) -> tuple[int, dict | None, str]:
    """Exit code, the JSON (None when refused) and stderr of `shardfit plan --json ARGV`."""
    capsys.readouterr()
    code = main(["plan", *argv, "--json"])
    out, err = capsys.readouterr()
    return code, json.loads(out) if out.strip() else None, err


def test_frozen_fp32_applies_to_a_script_job(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    job = _script(tmp_path, q_lora=False)
    _, plain, _ = _plan(capsys, "--from", "hf", job, "--gpus", "1x24GB")
    _, flagged, _ = _plan(capsys, "--from", "hf", job, "--gpus", "1x24GB", "--frozen-fp32")
    assert plain is not None and flagged is not None
    before, after = plain["from"]["as_configured"], flagged["from"]["as_configured"]
    # the embedding, head and norms of a 7B model in fp32 instead of bf16: about 2 GiB more weights
    assert after["per_gpu_gib"]["weights"] - before["per_gpu_gib"]["weights"] > 1.5
    assert any(n.startswith("--frozen-fp32") for n in flagged["from"]["notes"])


def test_bnb_compute_fp32_applies_to_a_script_qlora_job(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    code, out, _ = _plan(capsys, "--from", "hf", _script(tmp_path, q_lora=True), "--gpus", "1x24GB",
                         "--bnb-compute-fp32")
    assert code == 0 and out is not None
    assert any(n.startswith("--bnb-compute-fp32") for n in out["from"]["notes"])
    # without 4-bit weights there is no compute dtype of bitsandbytes' to set
    code, out, err = _plan(capsys, "--from", "hf", _script(tmp_path, q_lora=False), "--gpus", "1x24GB",
                           "--bnb-compute-fp32")
    assert (code, out) == (2, None) and "--bnb-compute-fp32" in err and "--method qlora" in err


@pytest.mark.parametrize("flags,named", [
    (["--frozen-fp32"], "prepare_model_for_kbit_training"),  # LLaMA-Factory's loader decides
    (["--bnb-compute-fp32"], "bnb_4bit_compute_dtype"),  # LLaMA-Factory passes its compute dtype
    (["--bnb-optimizer"], "optim"),  # the file's optimizer decides
    (["--no-tool-autocast"], "autocast"),  # a tool's engine is what --from plans
    (["--precision", "fp16"], "--precision fp16"),  # the file says it
    (["--optimizer", "adamw8bit", "--float8"], "--optimizer adamw8bit, --float8"),
])
def test_flags_the_file_decides_exit_2(capsys: pytest.CaptureFixture, flags: list[str], named: str) -> None:
    code, out, err = _plan(capsys, "--from", "llamafactory", LF_QLORA, "--gpus", "1x24GB", *flags)
    assert (code, out) == (2, None)
    assert flags[0] in err and named in err
    assert "Traceback" not in err


def test_tool_autocast_is_how_from_plans(capsys: pytest.CaptureFixture) -> None:
    _, plain, _ = _plan(capsys, "--from", "llamafactory", LF_QLORA, "--gpus", "1x24GB")
    _, flagged, _ = _plan(capsys, "--from", "llamafactory", LF_QLORA, "--gpus", "1x24GB", "--tool-autocast")
    assert plain == flagged


def test_shardfits_own_rows_run_its_own_engine() -> None:
    """An FSDP1 job's terms (flat parameters, no_sync...) are its engine's: the strategies shardfit compares beside
    it run FSDP2, planned as for the same workload without them."""
    from dataclasses import replace

    from shardfit.foreign.asplanned import plan_job
    from shardfit.foreign.read import JobOptions, read_job
    from shardfit.plan.hardware import parse_gpus
    from shardfit.plan.plan import make_plan
    from shardfit.plan.shapes import resolve_shape

    job = read_job("axolotl", str(JOBS / "axolotl" / "llama31_70b_qlora_fsdp.yml"), JobOptions())
    job.workload = replace(job.workload, fsdp1=True, flat_params=True)
    shape, hw = resolve_shape(job.model), parse_gpus("8x24GB")
    fp = plan_job(job, shape, hw)
    own = make_plan(shape, job.workload.on_shardfits_engine(), fp.hardware)
    as_fsdp1 = make_plan(shape, job.workload, fp.hardware)
    for c in fp.plan.candidates:
        if c.strategy in ("zero3", "zero3_offload"):
            mine = next(o for o in own.candidates if o.strategy == c.strategy)
            other = next(o for o in as_fsdp1.candidates if o.strategy == c.strategy)
            assert c.per_gpu_gib.total == mine.per_gpu_gib.total != other.per_gpu_gib.total


def test_a_plot_path_that_cannot_be_written_exits_2(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    assert main(["plan", "--from", "llamafactory", LF_QLORA, "--gpus", "1x24GB", "--plot",
                 str(tmp_path / "plan.xyz")]) == 2
    assert "--plot" in capsys.readouterr().err


def test_check_from_refuses_set(capsys: pytest.CaptureFixture) -> None:
    """`check --from` checks the tool's file as written: a --set would be dropped, so it is refused."""
    assert main(["check", "--from", "llamafactory", LF_QLORA, "--gpus", "1x24GB", "--set", "seq_len=4096"]) == 2
    assert "--set seq_len=4096" in capsys.readouterr().err


def test_frozen_fp32_refused_where_deepspeed_casts_it_back(capsys: pytest.CaptureFixture) -> None:
    """DeepSpeed bf16 casts every weight back to bf16, so --frozen-fp32 could change nothing: refused (exit 2),
    not planned in bf16 under a note that says fp32."""
    code, out, err = _plan(capsys, "--from", "deepspeed", str(JOBS / "deepspeed" / "ds_z2.json"), "--model",
                           "Qwen/Qwen2.5-7B", "--method", "lora", "--gpus", "2x80GB", "--frozen-fp32")
    assert (code, out) == (2, None)
    assert "--frozen-fp32" in err and "_cast_module_mixed_precision" in err and "Traceback" not in err


def test_use_orig_params_false_is_planned_as_flat_params(tmp_path: Path) -> None:
    """accelerate's fsdp_use_orig_params: false under FSDP1 is flat parameters (trainable and frozen ones apart);
    under FSDP2 it changes nothing."""
    from shardfit.foreign.read import JobOptions, read_job

    src = JOBS / "axolotl" / "llama31_70b_qlora_fsdp.yml"
    job = read_job("axolotl", str(src), JobOptions())
    assert job.workload.fsdp1 and job.workload.flat_params
    two = tmp_path / "fsdp2.yml"
    two.write_text(src.read_text() + "fsdp_version: 2\n")
    job = read_job("axolotl", str(two), JobOptions())
    assert not job.workload.fsdp1 and not job.workload.flat_params
    assert any("fsdp_use_orig_params false with FSDP2" in n for n in job.notes), job.notes


DS_Z2 = str(JOBS / "deepspeed" / "ds_z2.json")


def test_a_bare_deepspeed_json_takes_what_it_cannot_say(capsys: pytest.CaptureFixture) -> None:
    """A DeepSpeed JSON says nothing of the adapters, the attention, the loss or (without an optimizer section)
    the optimizer: the flags apply, as --seq does, each said in a note; --strategy picks shardfit's rows."""
    base = ["--from", "deepspeed", DS_Z2, "--model", "Qwen/Qwen2.5-7B", "--method", "lora", "--gpus", "2x80GB"]
    _, plain, _ = _plan(capsys, *base)
    flags = ["--lora-rank", "64", "--attention", "flash", "--optimizer", "adamw8bit", "--loss", "full",
             "--lora-dropout", "0.1"]
    code, out, err = _plan(capsys, *base, *flags, "--strategy", "zero2")
    assert code in (0, 3) and out is not None and plain is not None, err
    notes = out["from"]["notes"]
    for flag, value in zip(flags[::2], flags[1::2], strict=True):
        assert any(n.startswith(f"{flag} {value}") for n in notes), (flag, notes)
    assert out["from"]["as_configured"] != plain["from"]["as_configured"]
    assert [c["strategy"] for c in out["candidates"]] == ["zero2"]


def test_a_script_flag_the_file_says_is_refused_naming_its_key(tmp_path: Path,
                                                               capsys: pytest.CaptureFixture) -> None:
    job = tmp_path / "r.sh"
    job.write_text("python finetune.py --model_name_or_path Qwen/Qwen2.5-7B-Instruct --use_lora True --lora_r 32 "
                   "--bf16 True --per_device_train_batch_size 1 --model_max_length 2048 --output_dir out\n")
    code, out, err = _plan(capsys, "--from", "hf", str(job), "--gpus", "1x80GB", "--lora-rank", "64")
    assert (code, out) == (2, None) and "--lora-rank 64" in err and "lora_r 32" in err
    code, out, _ = _plan(capsys, "--from", "hf", str(job), "--gpus", "1x80GB", "--attention", "flash")
    assert out is not None and any(n.startswith("--attention flash") for n in out["from"]["notes"])
    # another tool's default decides where its file is silent: refused, and worded so
    code, out, err = _plan(capsys, "--from", "llamafactory", LF_QLORA, "--gpus", "1x24GB", "--lora-rank", "64")
    assert (code, out) == (2, None) and "LLaMA-Factory's own default" in err


def _full_8b(tmp_path: Path, optim: str = "adamw_torch") -> str:
    """An HF Trainer command line: Llama-3-8B full fine-tune, 512 tokens, micro-batch 1, checkpointing on."""
    f = tmp_path / "full.sh"
    f.write_text("python train.py --model_name_or_path meta-llama/Meta-Llama-3-8B --bf16 True --optim "
                 f"{optim} --per_device_train_batch_size 1 --gradient_checkpointing True --model_max_length 512 "
                 "--output_dir out\n")
    return str(f)


def test_what_would_fit_offers_the_8bit_optimizer_the_plan_offers(tmp_path: Path,
                                                                  capsys: pytest.CaptureFixture) -> None:
    """The plan's offers and the job's "what would fit" follow one rule (plan.py `eight_bit_offer`): where the
    plan offers bitsandbytes' 8-bit AdamW, the job's own lines offer it too, in the tool's words; for an optimizer
    DeepSpeed builds from its JSON neither does."""
    code, out, err = _plan(capsys, "--from", "hf", _full_8b(tmp_path), "--gpus", "1x84GB")
    assert code == 3 and out is not None, err
    offered = [a for a in out["alternatives"] if a.startswith("8-bit AdamW")]
    assert len(offered) == 1 and "(--optim adamw_bnb_8bit)" in offered[0], out["alternatives"]
    would = [x for x in out["from"]["what_would_fit"] if x.startswith("--optim adamw_bnb_8bit")]
    assert len(would) == 1, out["from"]["what_would_fit"]
    ds = tmp_path / "ds.json"
    ds.write_text('{"optimizer": {"type": "AdamW"}, "zero_optimization": {"stage": 2}}')
    code, out, _ = _plan(capsys, "--from", "deepspeed", str(ds), "--model", "meta-llama/Meta-Llama-3-8B", "--seq",
                         "512", "--gpus", "2x48GB")
    assert out is not None and not [x for x in out["from"]["what_would_fit"] if "8bit" in x]
    assert not [a for a in out.get("alternatives") or [] if "8-bit" in a]


# `shardfit plan`'s own flags for the changes it offers: a --from job takes none of them (or, for a bare DeepSpeed
# JSON, only --method and --seq, which its file cannot say).
PLAN_FLAGS = ("--batch", "--grad-accum", "--grad-ckpt", "--seq ", "--method", "--optimizer", "--bnb-optimizer",
              "--nodes")
FROM_JOBS = [("llamafactory", "lf/llama3_8b_full_ds2.yaml", "1x80GB"),
             ("axolotl", "axolotl/llama31_8b_qlora.yml", "1x20GB"),
             ("swift", "swift/qwen25_72b_lora_device_map.sh", "2x12GB"),
             ("llamafactory", "lf_v1/full_deepspeed.yaml", "1x24GB")]


@pytest.mark.parametrize(("tool", "job", "gpus"), FROM_JOBS)
def test_every_offer_of_a_from_report_is_the_tool_s_setting_or_left_out(capsys: pytest.CaptureFixture, tool: str,
                                                                       job: str, gpus: str) -> None:
    """`plan --from` refuses shardfit's workload flags where the file says them, so its "nearest alternatives"
    never print them: each is the tool's own setting (a YAML key, a CLI flag, its launch), or one line saying
    that the tool has no such setting."""
    code, out, err = _plan(capsys, "--from", tool, str(JOBS / job), "--gpus", gpus)
    assert out is not None and out.get("alternatives"), err
    for offer in out["alternatives"]:
        assert offer.startswith("left out: ") or not any(f in offer for f in PLAN_FLAGS), offer


def test_a_change_the_tool_has_no_setting_for_is_left_out_saying_why() -> None:
    """The plan's alternatives in a tool's words: micro-batch and accumulation in its keys, checkpointing and
    more nodes its own way; selective checkpointing, which none of the tools sets, left out with the reason."""
    from shardfit.foreign.asplanned import tool_alternative
    from shardfit.foreign.read import JobOptions, read_job
    from shardfit.plan.plan import Alternative

    job = read_job("llamafactory", LF_QLORA, JobOptions())
    batch = tool_alternative(job, Alternative("micro-batch 1 with grad_accum 8", (("micro_batch", 1),
                                                                                 ("grad_accum", 8)), None, "single",
                                              20.0))
    assert batch.how() == "per_device_train_batch_size: 1 with gradient_accumulation_steps 8"
    nodes = tool_alternative(job, Alternative("twice the GPUs", (), 2, "zero3", 20.0))
    assert nodes.how() is not None and "NNODES=2" in nodes.how()
    selective = tool_alternative(job, Alternative("selective checkpointing on", (("grad_ckpt", "selective"),),
                                                  None, "single", 20.0))
    assert selective.how() is None
    said = selective.phrase()
    assert said is not None and said.startswith("left out: selective checkpointing on") and "LLaMA-Factory" in said


@pytest.mark.parametrize(("tool", "job", "seq", "batch"), [
    ("llamafactory", "lf/qwen25_7b_qlora.yaml", "cutoff_len: 1024", "gradient_accumulation_steps 8"),
    ("llamafactory", "lf_v1/full_deepspeed.yaml", "cutoff_len: 1024", "global_batch_size as it is (8 micro-batches"),
    ("axolotl", "axolotl/llama31_8b_qlora.yml", "sequence_len: 1024", "gradient_accumulation_steps 8")])
def test_yaml_tools_say_a_change_as_their_key_and_value(tool: str, job: str, seq: str, batch: str) -> None:
    """A YAML job's change is its key with the value (`cutoff_len: 1024`); LLaMA-Factory v1 accumulates up to its
    global_batch_size, which micro-batch 1 keeps."""
    from shardfit.foreign.asplanned import tool_alternative
    from shardfit.foreign.read import JobOptions, read_job
    from shardfit.plan.plan import Alternative

    read = read_job(tool, str(JOBS / job), JobOptions(nproc=1))
    shorter = tool_alternative(read, Alternative("shorter", (("seq_len", 1024),), None, "single", 1.0)).how()
    assert shorter == seq
    one = tool_alternative(read, Alternative("mb 1", (("micro_batch", 1), ("grad_accum", 8)), None, "single", 1.0))
    assert batch in (one.how() or "")


@pytest.mark.parametrize(("tool", "job", "said"), [
    ("hf", "accelerate", ["--multi_gpu", "--num_machines 2", "--num_processes 8", "--machine_rank <node>"]),
    ("hf", "accelerate --use_fsdp", ["accelerate launch --num_machines 2", "--num_processes 8"]),
    ("hf", "torchrun", ["torchrun --nnodes 2", "--nproc_per_node 4", "--node_rank <node>"]),
    ("axolotl", "axolotl/llama31_8b_qlora.yml", ["num_machines: 2", "num_processes: 8", "machine_rank"])])
def test_more_nodes_are_offered_with_the_launch_s_total_processes(tmp_path: Path, tool: str, job: str,
                                                                   said: list[str]) -> None:
    """accelerate's --num_processes (and num_processes in its config file, which axolotl's multi-node guide sets)
    counts every machine's processes: each runs num_processes // num_machines (commands/launch.py
    `prepare_multi_gpu_env`), so --num_machines 2 alone splits the same ranks over two nodes; without --multi_gpu
    on a one-GPU node it starts no process group at all, but with DeepSpeed or FSDP from accelerate it would turn
    them off. torchrun's --nproc_per_node is per node (default 1)."""
    from shardfit.foreign.asplanned import tool_alternative
    from shardfit.foreign.read import JobOptions, read_job
    from shardfit.plan.plan import Alternative

    if tool == "hf":
        path = tmp_path / "run.sh"
        launch = f"{job.replace('accelerate', 'accelerate launch --num_processes 4')}" if job.startswith(
            "accelerate") else "torchrun --nproc_per_node 4"
        path.write_text(f"{launch} train.py --model_name_or_path meta-llama/Meta-Llama-3-8B --bf16 True "
                        "--output_dir out\n")
        job = str(path)
    read = read_job(tool, str(JOBS / job), JobOptions(nproc=4))
    twice = Alternative("twice the GPUs (2 nodes x 4)", (), 2, "zero3", 20.0)
    how = tool_alternative(read, twice, per_node=4).how()
    assert how is not None and all(s in how for s in said), how


def test_a_from_report_s_more_nodes_offer_counts_the_processes(tmp_path: Path,
                                                                capsys: pytest.CaptureFixture) -> None:
    """Through `plan --from`: `trl sft` runs under accelerate launch, on one 80 GB GPU a node."""
    f = tmp_path / "trl.sh"
    f.write_text("trl sft --model_name_or_path meta-llama/Meta-Llama-3-8B --dataset_name trl-lib/Capybara "
                 "--per_device_train_batch_size 4 --max_length 4096 --output_dir out\n")
    _, out, err = _plan(capsys, "--from", "hf", str(f), "--gpus", "1x80GB")
    assert out is not None, err
    nodes = [a for a in out["alternatives"] if a.startswith("twice the GPUs")]
    assert len(nodes) == 1 and "--num_machines 2" in nodes[0] and "--num_processes 2" in nodes[0], nodes


def test_trl_s_model_config_is_offered_lora_as_its_own_flags(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    """TRL's scripts build LoRA from ModelConfig's --use_peft (4-bit: --load_in_4bit beside it); --use_lora and
    --q_lora are the Qwen-style scripts' own, which TRL's parser does not have."""
    f = tmp_path / "trl.sh"
    f.write_text("trl sft --model_name_or_path meta-llama/Meta-Llama-3-8B --dataset_name trl-lib/Capybara "
                 "--per_device_train_batch_size 4 --max_length 4096 --output_dir out\n")
    _, out, err = _plan(capsys, "--from", "hf", str(f), "--gpus", "1x80GB")
    assert out is not None, err
    said = out["alternatives"] + out["from"]["what_would_fit"]
    assert not [s for s in said if "--use_lora" in s or "--q_lora" in s], said
    assert [s for s in out["alternatives"] if s.startswith("LoRA") and "(--use_peft)" in s], said
    assert [s for s in out["alternatives"] if s.startswith("QLoRA") and "(--use_peft --load_in_4bit)" in s], said


def test_a_change_the_tool_cannot_make_is_never_stacked_into_an_offer(capsys: pytest.CaptureFixture) -> None:
    """LLaMA-Factory v1 names no 8-bit optimizer: its "what would fit" may say so on a line of its own, but a
    stack of changes that fits only with it is no offer the user can run."""
    _, out, err = _plan(capsys, "--from", "llamafactory", str(JOBS / "lf_v1" / "full_deepspeed.yaml"), "--gpus",
                        "1x12GB")
    assert out is not None, err
    stacked = [x for x in out["from"]["what_would_fit"] if " + " in x]
    assert stacked and not [x for x in stacked if "left out" in x], stacked


@pytest.mark.parametrize(("key", "offer"), [("train_type", "--train_type lora"), ("sft_type", "--sft_type lora"),
                                            ("tuner_type", "--tuner_type lora"), (None, "--tuner_type lora")])
def test_swift_s_lora_offer_names_the_job_s_own_method_flag(tmp_path: Path, key: str | None, offer: str) -> None:
    """ms-swift 3 has --train_type (--sft_type before it), ms-swift 4 --tuner_type; an argument its version lacks
    stops it ("remaining_argv", modelscope/ms-swift#7823), so the offer keeps the name the job already gives."""
    from shardfit.foreign.asplanned import tool_alternative
    from shardfit.foreign.read import JobOptions, read_job
    from shardfit.plan.plan import Alternative

    f = tmp_path / "full.sh"
    method = f" --{key} full" if key else ""
    f.write_text(f"CUDA_VISIBLE_DEVICES=0 swift sft --model Qwen/Qwen2.5-7B-Instruct{method} --torch_dtype "
                 "bfloat16 --max_length 1024 --output_dir out\n")
    job = read_job("swift", str(f), JobOptions())
    assert tool_alternative(job, Alternative("LoRA", (("method", "lora"),), None, "single", 4.0)).how() == offer


@pytest.mark.parametrize(("tool", "job", "said"), [
    ("llamafactory", "lf/llama3_8b_full_ds2.yaml", "finetuning_type: lora with quantization_bit: 4"),
    ("llamafactory", "lf_v1/full_deepspeed.yaml", "peft_config: {name: lora} with quant_config: {name: bnb"),
    ("swift", "--train_type full", "--train_type lora --quant_bits 4 --quant_method bnb"),
    ("hf", "python finetune.py", "--use_lora True --q_lora True")])
def test_a_qlora_offer_to_a_full_fine_tune_also_makes_it_lora(tmp_path: Path, tool: str, job: str,
                                                               said: str) -> None:
    """4-bit frozen weights train only through adapters: LLaMA-Factory refuses quantization_bit without
    finetuning_type lora ("Quantization is only compatible with the LoRA or OFT method"), ms-swift quantizes a
    --train_type full run it cannot train, Qwen's finetune.py reads --q_lora only with --use_lora. The offer to a
    full fine-tune says both."""
    from shardfit.foreign.asplanned import tool_alternative
    from shardfit.foreign.read import JobOptions, read_job
    from shardfit.plan.plan import Alternative

    if tool in ("swift", "hf"):
        f = tmp_path / "full.sh"
        f.write_text(f"CUDA_VISIBLE_DEVICES=0 swift sft --model Qwen/Qwen2.5-7B-Instruct {job} --max_length 1024 "
                     "--output_dir out\n" if tool == "swift" else
                     f"{job} --model_name_or_path Qwen/Qwen2.5-7B-Instruct --bf16 True --output_dir out\n")
        path = str(f)
    else:
        path = str(JOBS / job)
    read = read_job(tool, path, JobOptions(nproc=1))
    assert read.workload.method == "full"
    how = tool_alternative(read, Alternative("QLoRA", (("method", "qlora"),), None, "single", 4.0)).how()
    assert how is not None and said in how, how
