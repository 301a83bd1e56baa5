"""Other tools' jobs as their 2026 examples write them: ms-swift 4's option names, its Megatron trainer, and what
the readers make of them (found by running their current example configs through `--from`)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import yaml

from shardfit.cli.main import main
from shardfit.config import load_config
from shardfit.errors import UserError
from shardfit.foreign.convert import to_config
from shardfit.foreign.read import JobOptions, read_job


def _write(tmp_path: Path, name: str, text: str) -> str:
    path = tmp_path / name
    path.write_text(text)
    return str(path)


@pytest.mark.parametrize(("option", "method"), [("--tuner_type full", "full"), ("--tuner_type lora", "lora"),
                                                ("--train_type full", "full"), ("", "lora")])
def test_swift_4_names_the_method_tuner_type(tmp_path: Path, option: str, method: str) -> None:
    """ms-swift 4 renamed --train_type to --tuner_type: a full fine-tune written the new way is planned full, with
    its optimizer state for every weight, not as LoRA (the default when neither is given)."""
    script = _write(tmp_path, "full.sh", "NPROC_PER_NODE=4 swift sft --model Qwen/Qwen3-8B --deepspeed zero3 "
                                         f"{option} --max_length 4096\n")
    job = read_job("swift", script, JobOptions())
    assert job.workload.method == method
    assert "tuner_type" not in job.not_modelled


def test_swift_4_unknown_tuner_type_names_the_option(tmp_path: Path) -> None:
    script = _write(tmp_path, "bad.sh", "swift sft --model Qwen/Qwen3-8B --tuner_type reft\n")
    with pytest.raises(UserError, match="--tuner_type reft"):
        read_job("swift", script, JobOptions())


def test_swift_megatron_script_is_named_with_a_plan_of_its_split(tmp_path: Path) -> None:
    """A `megatron sft` script is refused as what it is (Megatron-LM's trainer), with the plan command that
    splits the model the same way, not as a script with no training command in it."""
    script = _write(tmp_path, "moe.sh", "NPROC_PER_NODE=8 \\\nmegatron sft \\\n    --model Qwen/Qwen3-30B-A3B \\\n"
                                        "    --pipeline_model_parallel_size 2 \\\n"
                                        "    --expert_model_parallel_size 4 \\\n    --micro_batch_size 1 \\\n"
                                        "    --max_length 8192\n")
    with pytest.raises(UserError) as err:
        read_job("swift", script, JobOptions())
    text = str(err.value)
    assert "`megatron sft` is ms-swift's Megatron-LM trainer" in text
    assert ("shardfit plan --model Qwen/Qwen3-30B-A3B --gpus 8xH100 --method full --pipeline-parallel 2 "
            "--expert-parallel 4 --seq 8192 --batch 1") in text
    assert "tensor parallelism" not in text
    lora_tp = _write(tmp_path, "tp.sh", "megatron sft --model Qwen/Qwen3-32B --tuner_type lora "
                                        "--tensor_model_parallel_size 4\n")
    with pytest.raises(UserError, match=r"--gpus 1xH100 --method lora .*tensor parallelism is not planned"):
        read_job("swift", lora_tp, JobOptions())


def test_swift_megatron_suggestion_runs_as_printed(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    """The plan command a `megatron sft` refusal prints runs as printed (no GPUS placeholder plan refuses), with
    Megatron's context parallelism as shardfit's row split."""
    script = _write(tmp_path, "cp.sh", "NPROC_PER_NODE=8 megatron sft --model Qwen/Qwen3-30B-A3B --tuner_type lora "
                                       "--expert_model_parallel_size 4 --context_parallel_size 2 --max_length 8192\n")
    with pytest.raises(UserError) as err:
        read_job("swift", script, JobOptions())
    command = re.search(r"`shardfit (plan [^`]*)`", str(err.value))
    assert command is not None and "--sequence-parallel 2" in command.group(1)
    assert main([*command.group(1).split(), "--json"]) in (0, 3)
    assert "error" not in capsys.readouterr().err


def test_swift_script_without_a_trainer_still_says_so(tmp_path: Path) -> None:
    script = _write(tmp_path, "infer.sh", "swift infer --model Qwen/Qwen3-8B\n")
    with pytest.raises(UserError, match="no command running swift sft"):
        read_job("swift", script, JobOptions())


AXOLOTL_FSDP2 = """base_model: Qwen/Qwen3-8B
datasets:
  - path: data.jsonl
    type: chat_template
sequence_len: 4096
micro_batch_size: 1
gradient_accumulation_steps: 2
optimizer: adamw_torch_fused
learning_rate: 2e-5
bf16: true
gradient_checkpointing: true
fsdp_version: 2
fsdp_config:
{fsdp}
"""


@pytest.mark.parametrize(("fsdp", "engine"), [
    ("  offload_params: true\n  reshard_after_forward: true", "fsdp_offload"),
    ("  fsdp_offload_params: true", "fsdp_offload"),
    ("  reshard_after_forward: false\n  auto_wrap_policy: TRANSFORMER_BASED_WRAP", "fsdp_shard_grad_op"),
    ("  offload_params: false\n  reshard_after_forward: true", "fsdp_full_shard"),
])
def test_axolotl_fsdp_config_without_its_old_prefix(tmp_path: Path, fsdp: str, engine: str) -> None:
    """axolotl's examples write `fsdp_config` keys without the `fsdp_` prefix (it strips the old one): CPU offload
    and FSDP2's `reshard_after_forward: false` (weights kept gathered, as SHARD_GRAD_OP) decide the engine."""
    job = read_job("axolotl", _write(tmp_path, "fsdp2.yaml", AXOLOTL_FSDP2.format(fsdp=fsdp)), JobOptions(nproc=8))
    assert job.engine == engine


SWIFT_FSDP = """NPROC_PER_NODE=2 \\
swift sft \\
    --model Qwen/Qwen3-8B \\
    --tuner_type lora \\
    --gradient_checkpointing false \\
    --max_length 4096 \\
    --fsdp {fsdp}
"""


def test_swift_fsdp_option_is_the_engine(tmp_path: Path) -> None:
    """`--fsdp fsdp2` shards with FSDP (not DDP under NPROC_PER_NODE), and the activation checkpointing its config
    turns on is planned though --gradient_checkpointing is false; a JSON of its own decides offload."""
    job = read_job("swift", _write(tmp_path, "fsdp2.sh", SWIFT_FSDP.format(fsdp="fsdp2")), JobOptions())
    assert (job.engine, job.workload.grad_ckpt, job.reentrant_ckpt) == ("fsdp_full_shard", "full", False)
    assert "fsdp" not in job.not_modelled
    _write(tmp_path, "offload.json", '{"fsdp": "full_shard auto_wrap offload", "fsdp_config": '
                                     '{"fsdp_version": 2, "activation_checkpointing": false, '
                                     '"activation_cpu_offload": true}}')
    job = read_job("swift", _write(tmp_path, "off.sh", SWIFT_FSDP.format(fsdp="offload.json")), JobOptions())
    assert (job.engine, job.workload.grad_ckpt) == ("fsdp_offload", "none")
    assert "fsdp:activation_cpu_offload" in job.not_modelled
    _write(tmp_path, "grad_op.json", '{"fsdp_config": {"reshard_after_forward": false}}')
    job = read_job("swift", _write(tmp_path, "op.sh", SWIFT_FSDP.format(fsdp="grad_op.json")), JobOptions())
    assert job.engine == "fsdp_shard_grad_op"
    with pytest.raises(UserError, match="--fsdp missing.json"):
        read_job("swift", _write(tmp_path, "bad.sh", SWIFT_FSDP.format(fsdp="missing.json")), JobOptions())


def test_swift_sequence_parallel_splits_each_row(tmp_path: Path) -> None:
    """`--sequence_parallel_size 8` (ms-swift's Ulysses) gives each rank 1/8 of a 64k row: planned and carried
    over as sequence_parallel, not left out (which planned every rank's logits for the whole row)."""
    script = _write(tmp_path, "sp.sh", "NPROC_PER_NODE=8 swift sft --model Qwen/Qwen2.5-3B-Instruct --tuner_type lora "
                                       "--max_length 65536 --sequence_parallel_size 8 --attn_impl flash_attn\n")
    job = read_job("swift", script, JobOptions())
    assert job.workload.sequence_parallel == 8
    assert job.convert["sequence_parallel"] == 8
    assert "sequence_parallel_size" not in job.not_modelled


@pytest.mark.parametrize(("keys", "attention", "sp", "ep"), [
    ("attn_implementation: flash_attention_2\ncontext_parallel_size: 2\n", "flash", 2, 1),
    ("attn_implementation: kernels-community/vllm-flash-attn3\nsequence_parallel_degree: 4\n", "flash", 4, 1),
    ("attn_implementation: eager\nexpert_parallel_size: 4\n", "eager", 1, 4),
    ("attn_implementation: sdpa\n", "sdpa", 1, 1),
])
def test_axolotl_attention_and_parallel_sizes(tmp_path: Path, keys: str, attention: str, sp: int, ep: int) -> None:
    """axolotl's `attn_implementation` (its deprecated flags' successor), `context_parallel_size` (old name
    `sequence_parallel_degree`) and `expert_parallel_size` reach the plan and the converted config."""
    text = AXOLOTL_FSDP2.format(fsdp="  offload_params: false") + keys
    if ep > 1:  # experts to share out
        text = text.replace("Qwen/Qwen3-8B", "Qwen/Qwen3-30B-A3B")
    job = read_job("axolotl", _write(tmp_path, "par.yaml", text), JobOptions(nproc=8))
    w = job.workload
    assert (w.attention, w.sequence_parallel, w.expert_parallel) == (attention, sp, ep)
    assert job.convert.get("sequence_parallel", 1) == sp and job.convert.get("expert_parallel", 1) == ep
    assert not {"attn_implementation", "context_parallel_size", "expert_parallel_size"} & set(job.not_modelled)


def test_converted_sequence_parallel_job_is_one_check_accepts(tmp_path: Path) -> None:
    """A sequence-parallel job on flash attention converts to shardfit's Ulysses with its own attention (auto):
    `flash_attention_2` beside `sequence_parallel` is a config shardfit refuses."""
    (tmp_path / "train.jsonl").write_text('{"messages": [{"role": "user", "content": "hi"}, '
                                          '{"role": "assistant", "content": "hello"}]}\n')
    script = _write(tmp_path, "sp.sh", "NPROC_PER_NODE=8 swift sft --model Qwen/Qwen2.5-3B-Instruct --tuner_type lora "
                                       "--dataset train.jsonl --max_length 65536 --sequence_parallel_size 8 "
                                       "--attn_impl flash_attn\n")
    cfg = to_config(read_job("swift", script, JobOptions()))
    assert (cfg["sequence_parallel"], cfg["attn_implementation"]) == (8, "auto")
    out = tmp_path / "converted.yaml"
    out.write_text(yaml.safe_dump(cfg))
    assert load_config(str(out)).sequence_parallel == 8


@pytest.mark.parametrize(("extra", "loss_fused"), [
    ("plugins:\n  - axolotl.integrations.cut_cross_entropy.CutCrossEntropyPlugin\n", True),
    ("plugins:\n  - axolotl.integrations.cut_cross_entropy.CutCrossEntropyPlugin\ncut_cross_entropy: false\n", False),
    ("", False),
])
def test_axolotl_cut_cross_entropy_plugin_fuses_the_loss(tmp_path: Path, extra: str, loss_fused: bool) -> None:
    """Listing axolotl's Cut Cross-Entropy plugin turns its loss on (`cut_cross_entropy` defaults to true), as
    axolotl's gpt-oss and long-context examples write it: no full logits are planned."""
    text = AXOLOTL_FSDP2.format(fsdp="  offload_params: false") + extra
    job = read_job("axolotl", _write(tmp_path, "cce.yaml", text), JobOptions(nproc=8))
    assert (job.workload.loss == "chunked") == loss_fused


def test_convert_refusal_names_the_job_not_a_temporary_file(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    """A KTO job of one row a step (one rank, micro-batch 1, no accumulation), which ms-swift refuses: convert says
    so about the user's file and its key, not about a temporary copy."""
    job = _write(tmp_path, "kto.sh", "swift rlhf --rlhf_type kto --model Qwen/Qwen3-4B --max_length 2048 "
                                     "--per_device_train_batch_size 1\n")
    assert main(["convert", "--from", "swift", job]) == 2
    err = capsys.readouterr().err
    assert f"{job}: --per_device_train_batch_size 1 with objective kto" in err
    assert "tmp" not in err.replace(str(tmp_path), "")


def test_axolotl_flex_attention_converts_to_flex(tmp_path: Path) -> None:
    """axolotl's Llama 4 examples run flex attention; the converted config keeps it (Llama 4 has no
    flash_attention_2 in transformers, so that conversion would not build)."""
    text = AXOLOTL_FSDP2.format(fsdp="  offload_params: false") + "attn_implementation: flex_attention\n"
    job = read_job("axolotl", _write(tmp_path, "flex.yaml", text), JobOptions(nproc=8))
    assert job.workload.attention == "flash"
    assert to_config(job)["attn_implementation"] == "flex_attention"


@pytest.mark.parametrize("key", ["activation_checkpointing", "fsdp_activation_checkpointing"])
def test_axolotl_fsdp_activation_checkpointing_is_planned(tmp_path: Path, key: str) -> None:
    """FSDP's own activation checkpointing (axolotl's Llama 4 Scout example, no `gradient_checkpointing`) is
    planned as full checkpointing, not as every block's activations kept (a plan of 800 GiB a GPU)."""
    text = AXOLOTL_FSDP2.format(fsdp=f"  {key}: true").replace("gradient_checkpointing: true\n", "")
    job = read_job("axolotl", _write(tmp_path, "ac.yaml", text), JobOptions(nproc=8))
    assert (job.workload.grad_ckpt, job.reentrant_ckpt) == ("full", False)
    assert to_config(job)["grad_ckpt"] == "full"


@pytest.mark.parametrize(("model", "keys", "nproc", "message"), [
    ("Qwen/Qwen3-30B-A3B", "expert_parallel_size: 3\n", 8, r"expert_parallel_size 3: .*128 routed experts"),
    ("Qwen/Qwen3-30B-A3B", "expert_parallel_size: 256\n", 8, r"expert_parallel_size 256: .*128 routed experts"),
    ("Qwen/Qwen3-8B", "expert_parallel_size: 2\n", 8, r"expert_parallel_size 2: .*dense model"),
    ("Qwen/Qwen3-30B-A3B", "expert_parallel_size: 16\n", 8, r"expert_parallel_size 16: .*data-parallel ranks"),
    ("Qwen/Qwen3-8B", "context_parallel_size: 3\n", None, r"context_parallel_size 3: .*32 attention heads"),
    ("Qwen/Qwen3-8B", "context_parallel_size: 16\n", 8, r"context_parallel_size 16: .*8 ranks"),
    ("Qwen/Qwen3-8B", "sequence_parallel_degree: 0\n", 8, r"sequence_parallel_degree 0: a count of ranks"),
    ("Qwen/Qwen3-8B", "context_parallel_size: 2\nsequence_parallel_degree: 4\n", 8,
     r"'sequence_parallel_degree' is 4 but 'context_parallel_size' is 2"),
])
def test_axolotl_split_the_job_cannot_run_exits_2(tmp_path: Path, capsys: pytest.CaptureFixture, model: str,
                                                  keys: str, nproc: int | None, message: str) -> None:
    """A split the model or the launch cannot share out evenly (more expert ranks than experts, a dense model,
    rows over more ranks than launched, a size of 0, an old and a new name that disagree) exits 2 naming the key,
    as `plan --model` refuses it, rather than planned as if it ran (or a ZeroDivisionError)."""
    text = AXOLOTL_FSDP2.format(fsdp="  offload_params: false").replace("Qwen/Qwen3-8B", model) + keys
    job = _write(tmp_path, "split.yaml", text)
    nprocs = ["--nproc", str(nproc)] if nproc else []
    assert main(["plan", "--from", "axolotl", job, "--gpus", "8xH100", *nprocs]) == 2
    err = capsys.readouterr().err
    assert re.search(message, err) and "Traceback" not in err


def test_axolotl_null_split_sizes_are_axolotl_defaults(tmp_path: Path) -> None:
    """A YAML `context_parallel_size:` left empty is axolotl's default (no split), not an error."""
    text = AXOLOTL_FSDP2.format(fsdp="  offload_params: false") + ("context_parallel_size:\n"
                                                                   "expert_parallel_size:\n")
    job = read_job("axolotl", _write(tmp_path, "null.yaml", text), JobOptions(nproc=8))
    assert (job.workload.sequence_parallel, job.workload.expert_parallel) == (1, 1)


def test_swift_split_the_model_cannot_share_exits_2(tmp_path: Path) -> None:
    script = _write(tmp_path, "sp3.sh", "NPROC_PER_NODE=8 swift sft --model Qwen/Qwen3-8B --tuner_type full "
                                        "--deepspeed zero3 --max_length 32768 --sequence_parallel_size 3\n")
    with pytest.raises(UserError, match=r"sp3.sh: sequence_parallel_size 3: .*32 attention heads"):
        read_job("swift", script, JobOptions())


@pytest.mark.parametrize(("tool", "name", "text"), [
    ("swift", "c.sh", "NPROC_PER_NODE=4 swift sft --model Qwen/Qwen3-8B --tuner_type full --fsdp fsdp2 "
                      "--max_length 4096 --torch_compile true --sequence_parallel_size 2 --dataset train.jsonl\n"),
    ("axolotl", "c.yaml", "base_model: Qwen/Qwen3-8B\nadapter: lora\nsequence_len: 16384\nbf16: true\n"
                          "flash_attention: true\ncontext_parallel_size: 4\ntorch_compile: true\n"
                          "datasets:\n  - path: train.jsonl\n    type: chat_template\n"),
])
def test_converted_split_job_is_one_check_accepts(tmp_path: Path, capsys: pytest.CaptureFixture, tool: str,
                                                  name: str, text: str) -> None:
    """A split job with torch_compile on, or an axolotl one whose launch says no ranks, converts to a config
    `shardfit check` accepts on 4 ranks: compile off (shardfit's split runs uncompiled blocks) and a multi-rank
    strategy, not `compile: true` and `single`, which check refuses."""
    (tmp_path / "train.jsonl").write_text('{"messages": [{"role": "user", "content": "hi"}, '
                                          '{"role": "assistant", "content": "hello"}]}\n')
    job = read_job(tool, _write(tmp_path, name, text), JobOptions())
    cfg = to_config(job)
    assert cfg["compile"] is False and cfg["strategy"] != "single"
    out = tmp_path / "converted.yaml"
    out.write_text(yaml.safe_dump(cfg))
    capsys.readouterr()
    assert main(["check", str(out), "--gpus", "4xH100", "--nproc", "4"]) == 0, capsys.readouterr().err


@pytest.mark.parametrize(("tool", "name", "text", "message"), [
    ("swift", "m.sh", "swift sft --model Qwen/Qwen3-8B --tuner_type full --train_type lora\n",
     "--tuner_type full and --train_type lora"),
    ("axolotl", "a.yaml", "base_model: Qwen/Qwen3-8B\nadapter: lora\nflash_attention: true\n"
                          "attn_implementation: eager\n", "'flash_attention: true' and 'attn_implementation: eager'"),
])
def test_conflicting_old_and_new_names_are_refused(tmp_path: Path, tool: str, name: str, text: str,
                                                   message: str) -> None:
    """Two names of one setting that disagree are refused: which one the tool obeys depends on its version."""
    with pytest.raises(UserError, match=re.escape(message)):
        read_job(tool, _write(tmp_path, name, text), JobOptions())


def test_axolotl_torch_compile_auto_is_on(tmp_path: Path) -> None:
    """axolotl turns `torch_compile: auto` on with any torch 2.5.1 or newer."""
    job = read_job("axolotl", _write(tmp_path, "tc.yaml", "base_model: Qwen/Qwen3-8B\ntorch_compile: auto\n"),
                   JobOptions())
    assert job.workload.compile is True and to_config(job)["compile"] is True


def test_axolotl_null_settings_are_axolotl_defaults_not_off(tmp_path: Path) -> None:
    """A key left empty in YAML is axolotl's default: `reshard_after_forward:` is FSDP's full_shard (not
    shard_grad_op's gathered weights), and `cut_cross_entropy:` under its plugin is the fused loss."""
    text = ("base_model: Qwen/Qwen3-8B\nsequence_len: 2048\nbf16: true\nfsdp_config:\n  reshard_after_forward:\n"
            "  offload_params: false\nplugins:\n  - axolotl.integrations.cut_cross_entropy.CutCrossEntropyPlugin\n"
            "cut_cross_entropy:\n")
    job = read_job("axolotl", _write(tmp_path, "null.yaml", text), JobOptions(nproc=2))
    assert (job.engine, job.workload.loss) == ("fsdp_full_shard", "chunked")


@pytest.mark.parametrize(("tool", "name", "text", "message"), [
    ("axolotl", "dup.yaml", "base_model: Qwen/Qwen3-8B\nfsdp_config:\n  fsdp_offload_params: true\n"
                            "  offload_params: false\n", "fsdp_config gives 'offload_params' twice"),
    ("axolotl", "both.yaml", "base_model: Qwen/Qwen3-8B\ndeepspeed: zero3.json\nfsdp_config:\n"
                             "  offload_params: false\n", "both 'deepspeed' and FSDP"),
    ("swift", "both.sh", "NPROC_PER_NODE=2 swift sft --model Qwen/Qwen3-8B --deepspeed zero3 --fsdp fsdp2\n",
     "--deepspeed zero3 and --fsdp fsdp2 both choose the sharding"),
])
def test_two_shardings_or_spellings_are_refused(tmp_path: Path, tool: str, name: str, text: str,
                                                message: str) -> None:
    """DeepSpeed beside FSDP, or an fsdp_config key in both spellings with different values, is refused rather
    than one silently planned."""
    with pytest.raises(UserError, match=re.escape(message)):
        read_job(tool, _write(tmp_path, name, text), JobOptions(nproc=2))


def test_swift_split_without_nproc_runs_on_one_process(tmp_path: Path) -> None:
    """Without NPROC_PER_NODE ms-swift runs one process, which cannot split rows over 2 ranks: refused, naming
    the option, rather than planned as one GPU holding half of every row."""
    script = _write(tmp_path, "one.sh", "swift sft --model Qwen/Qwen3-8B --sequence_parallel_size 2 "
                                        "--max_length 8192\n")
    with pytest.raises(UserError, match=r"sequence_parallel_size 2: .*1 ranks"):
        read_job("swift", script, JobOptions())
    assert read_job("swift", script, JobOptions(nproc=2)).workload.sequence_parallel == 2


@pytest.mark.parametrize("extra,said", [(["--nproc", "16"], "--nproc 16"), ([], "(its launch)")])
def test_more_ranks_a_node_than_the_named_gpus_is_refused(extra: list[str], said: str,
                                                          capsys: pytest.CaptureFixture[str]) -> None:
    """A job whose launch (or --nproc) starts more ranks a node than --gpus names would put two ranks on one GPU;
    the plan planned the ranks as GPUs of the named card."""
    job = Path(__file__).parent / "foreign_jobs" / "swift" / "qwen25_7b_lora_ddp.sh"  # NPROC_PER_NODE=2
    gpus = "8xH100" if extra else "1xH100"
    assert main(["plan", "--from", "swift", str(job), "--gpus", gpus, *extra]) == 2
    err = capsys.readouterr().err
    assert said in err and "ranks would share GPUs" in err
    assert main(["plan", "--from", "swift", str(job), "--gpus", "2xH100"]) == 0


def test_a_transformers_version_that_is_none_is_refused(capsys: pytest.CaptureFixture[str]) -> None:
    """--transformers names the version whose loss the plan counts: a word that is no version was planned as the
    current release and echoed back in the notes."""
    job = str(Path(__file__).parent / "foreign_jobs" / "lf" / "qwen25_7b_qlora.yaml")
    assert main(["plan", "--from", "llamafactory", job, "--gpus", "1xH100", "--transformers", "not.a.version"]) == 2
    assert "--transformers not.a.version: a transformers version" in capsys.readouterr().err
    assert main(["plan", "--from", "llamafactory", job, "--gpus", "1xH100", "--transformers", "4.47.1"]) in (0, 3)
