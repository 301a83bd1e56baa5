"""Other tools' keys that move memory or the launch, as a user writes them: each read as the tool runs it, or
said in the plan where shardfit has no equivalent."""

from __future__ import annotations

import dataclasses
import json
import re
from pathlib import Path

import pytest

from shardfit.cli.main import main
from shardfit.errors import UserError
from shardfit.foreign.asplanned import plan_job
from shardfit.foreign.convert import to_config, to_yaml
from shardfit.foreign.keys import epochs, fractional_epochs
from shardfit.foreign.read import JobOptions, read_job
from shardfit.plan.adapters import adapts_experts
from shardfit.plan.estimate import trainable_params
from shardfit.plan.hardware import parse_gpus
from shardfit.plan.shapes import resolve_shape
from shardfit.plan.workload import lora_targets_of

AXOLOTL_LORA = """base_model: Qwen/Qwen2.5-7B
adapter: lora
lora_r: 64
sequence_len: 4096
micro_batch_size: 4
bf16: true
flash_attention: true
gradient_checkpointing: true
"""


def _write(tmp_path: Path, name: str, text: str) -> str:
    path = tmp_path / name
    path.write_text(text)
    return str(path)


def _gib(job) -> float:
    """The job's as-configured GiB a GPU on one H100."""
    return plan_job(job, resolve_shape(job.model), parse_gpus("1xH100")).configured.per_gpu_gib.total


@pytest.mark.parametrize(("tool", "name", "text"), [
    ("axolotl", "qv.yml", AXOLOTL_LORA + "lora_target_modules:\n  - q_proj\n  - v_proj\n"),
    ("llamafactory", "qv.yaml", "model_name_or_path: Qwen/Qwen2.5-7B\nfinetuning_type: lora\nlora_rank: 64\n"
                                "lora_target: q_proj,v_proj\ncutoff_len: 4096\nper_device_train_batch_size: 4\n"
                                "bf16: true\n"),
    ("swift", "qv.sh", "swift sft --model Qwen/Qwen2.5-7B --tuner_type lora --lora_rank 64 --target_modules q_proj "
                       "v_proj --max_length 4096 --per_device_train_batch_size 4\n"),
    ("hf", "qv_hf.sh", "torchrun --nproc_per_node 1 finetune.py --model_name_or_path Qwen/Qwen2.5-7B --use_lora True "
                       "--lora_r 64 --lora_target_modules q_proj v_proj --model_max_length 4096 "
                       "--per_device_train_batch_size 4 --bf16 True --gradient_checkpointing True\n"),
    ("llamafactory", "qv_v1.yaml", "model: Qwen/Qwen2.5-7B\npeft_config:\n  name: lora\n  r: 64\n"
                                   "  target_modules: [q_proj, v_proj]\ncutoff_len: 4096\nmicro_batch_size: 4\n"),
])
def test_named_lora_targets_are_planned_on_those_modules_only(tmp_path: Path, tool: str, name: str,
                                                              text: str) -> None:
    """Adapters on q_proj and v_proj only: the plan counts those (20M trainable at rank 64 on Qwen2.5-7B, not the
    161M of every linear layer: 46.9 GiB a GPU, not 48.5), and the key reads as modelled."""
    job = read_job(tool, _write(tmp_path, name, text), JobOptions())
    assert job.workload.lora_targets == ("q", "v")
    assert not job.not_modelled
    assert not any("over-estimate" in n for n in job.notes)
    every = read_job(tool, _write(tmp_path, "all" + name, text.replace("q_proj,v_proj", "all").replace(
        "q_proj v_proj", "all-linear").replace("lora_target_modules:\n  - q_proj\n  - v_proj\n",
                                               "lora_target_linear: true\n").replace("[q_proj, v_proj]", "all")),
                     JobOptions())
    assert every.workload.lora_targets is None
    assert _gib(job) < _gib(every) - 1.5


def test_axolotl_regex_targets_are_planned_and_carried(tmp_path: Path) -> None:
    """A string of lora_target_modules is one regular expression (peft's reading): planned on the attention
    projections it matches, and carried to shardfit as the same expression, not as a list of its characters."""
    text = AXOLOTL_LORA + "lora_target_modules: 'model.layers.[\\d]+.self_attn.(q|k|v|o)_proj'\n"
    job = read_job("axolotl", _write(tmp_path, "rx.yml", text), JobOptions())
    assert job.workload.lora_targets == ("q", "k", "v", "o")
    assert "lora_target_modules" in job.keys
    assert to_config(job)["lora"]["targets"] == "model.layers.[\\d]+.self_attn.(q|k|v|o)_proj"


def test_axolotl_named_targets_convert_without_lora_target_linear(tmp_path: Path) -> None:
    """Without lora_target_linear axolotl adapts only the named modules; convert writes those, not all-linear."""
    job = read_job("axolotl", _write(tmp_path, "qv.yml", AXOLOTL_LORA + "lora_target_modules: [q_proj, v_proj]\n"),
                   JobOptions())
    assert to_config(job)["lora"]["targets"] == ["q_proj", "v_proj"]


def test_a_regex_of_targets_is_planned_as_the_projections_it_matches(tmp_path: Path) -> None:
    """shardfit's own `lora.targets` as a string is the same regular expression: planned on what it matches; a
    pattern or names the planner cannot place stay every linear layer, said as an over-estimate."""
    assert lora_targets_of(r".*\.(q|v)_proj") == ("q", "v")
    assert lora_targets_of(r"model\.layers\.\d+\.mlp\..*") == ("gate", "up", "down")
    assert lora_targets_of("c_attn") is None
    job = read_job("axolotl", _write(tmp_path, "gpt2.yml", AXOLOTL_LORA + "lora_target_modules: [c_attn]\n"),
                   JobOptions())
    assert job.workload.lora_targets is None
    assert "lora_target_modules" in job.not_modelled
    assert any("over-estimate" in n for n in job.notes)


AXOLOTL_LONG = """base_model: Qwen/Qwen2.5-7B
adapter: lora
lora_r: 16
lora_target_linear: true
sequence_len: 8192
micro_batch_size: 2
bf16: true
flash_attention: true
"""


@pytest.mark.parametrize("keys", ["gradient_checkpointing: offload\n", "gradient_checkpointing: offload_disk\n",
                                  "gradient_checkpointing: true\nactivation_offloading: true\n",
                                  "gradient_checkpointing: true\nactivation_offloading: legacy\n"])
def test_axolotl_activation_offloading_checkpoints_and_says_what_is_not_planned(tmp_path: Path, keys: str) -> None:
    """axolotl's `gradient_checkpointing: offload` (its older spelling of activation offloading) checkpoints every
    block: planned with grad_ckpt full (47 GiB a GPU, not the 148 of no checkpointing), and the offload shardfit
    does not model is said in a note and in convert's header, not dropped."""
    job = read_job("axolotl", _write(tmp_path, "long.yml", AXOLOTL_LONG + keys), JobOptions())
    assert job.workload.grad_ckpt == "full"
    assert any("does not model offloaded activations" in n for n in job.notes)
    assert any("not carried" in n for n in job.not_carried)
    assert _gib(job) < 79
    assert to_config(job)["grad_ckpt"] == "full"


def test_axolotl_activation_offloading_without_checkpointing_exits_2(tmp_path: Path) -> None:
    path = _write(tmp_path, "bad.yml", AXOLOTL_LONG + "activation_offloading: true\n")
    with pytest.raises(UserError, match=r"bad.yml:9: 'activation_offloading: true' without gradient_checkpointing"):
        read_job("axolotl", path, JobOptions())


KTO_AXOLOTL = (AXOLOTL_LONG.replace("micro_batch_size: 2", "micro_batch_size: 1")
               + "rl: kto\ngradient_checkpointing: true\n")
KTO_LF = ("model_name_or_path: Qwen/Qwen2.5-7B\nstage: kto\nfinetuning_type: lora\nper_device_train_batch_size: 1\n"
          "gradient_accumulation_steps: 8\nbf16: true\n")
KTO_SWIFT = "swift rlhf --rlhf_type kto --model Qwen/Qwen2.5-7B --per_device_train_batch_size 1"


@pytest.mark.parametrize(("tool", "name", "text", "key"), [
    ("axolotl", "kto.yml", KTO_AXOLOTL, "micro_batch_size 1"),
    ("swift", "kto.sh", KTO_SWIFT + "\n", "--per_device_train_batch_size 1"),
])
def test_kto_batch_its_tool_refuses_is_refused_by_plan_check_and_convert_alike(
        tmp_path: Path, capsys: pytest.CaptureFixture, tool: str, name: str, text: str, key: str) -> None:
    """axolotl runs TRL's KTOTrainer, which refuses a micro-batch of 1; ms-swift refuses a total batch of 1 (one
    rank, one row, no accumulation). plan, check and convert refuse alike, naming the tool's key."""
    job = _write(tmp_path, name, text)
    for command in (["plan", "--gpus", "1xH100"], ["check", "--gpus", "1xH100"], ["convert"]):
        assert main([command[0], "--from", tool, job, *command[1:]]) == 2
        assert f"{key} with objective kto" in capsys.readouterr().err
    assert main(["plan", "--from", tool, job, "--gpus", "1xH100", "--batch", "2"]) == 0


@pytest.mark.parametrize(("tool", "name", "text"), [
    ("llamafactory", "kto.yaml", KTO_LF),
    ("swift", "kto.sh", KTO_SWIFT + " --gradient_accumulation_steps 8\n"),
    ("swift", "kto2.sh", "NPROC_PER_NODE=2 " + KTO_SWIFT + "\n"),
])
def test_kto_at_one_row_runs_where_its_tool_runs_it(tmp_path: Path, capsys: pytest.CaptureFixture, tool: str,
                                                    name: str, text: str) -> None:
    """LLaMA-Factory and ms-swift skip TRL's micro-batch check (their own KTO examples use a per-device batch of
    1): the job is planned, and convert writes two rows a micro-batch, which shardfit's KTO needs, with half the
    accumulation, and says so."""
    job = _write(tmp_path, name, text)
    assert main(["plan", "--from", tool, job, "--gpus", "2xH100"]) == 0
    capsys.readouterr()
    read = read_job(tool, job, JobOptions())
    cfg = to_config(read)
    assert cfg["micro_batch"] == 2
    assert cfg["grad_accum"] == max(1, read.workload.grad_accum // 2)
    assert main(["convert", "--from", tool, job]) == 0
    assert "micro_batch 1 -> 2" in capsys.readouterr().out


@pytest.mark.parametrize("line", [
    "accelerate launch --multi_gpu --num_processes 4 /opt/ms-swift/swift/cli/sft.py",
    "torchrun --nproc_per_node 4 -m swift.cli.sft",
    "python -m torch.distributed.run --nproc_per_node=4 swift/cli/sft.py",
])
def test_swift_entry_script_under_a_launcher_is_swift_sft(tmp_path: Path, line: str) -> None:
    """ms-swift's own script run by a launcher (`accelerate launch swift/cli/sft.py ...`) is `swift sft` with
    those ranks, not a script with no training command in it."""
    script = _write(tmp_path, "run.sh", f"{line} \\\n    --model Qwen/Qwen2.5-7B --tuner_type full --deepspeed zero3 "
                                        "--max_length 4096 --per_device_train_batch_size 2\n")
    job = read_job("swift", script, JobOptions())
    assert (job.workload.method, job.nproc, job.engine, job.workload.seq_len) == ("full", 4, "deepspeed", 4096)


@pytest.mark.parametrize("setup", ['python -m pip install -U "transformers>=4.45" peft', "python -m venv .venv",
                                   "python3 -m pip install --upgrade ms-swift"])
@pytest.mark.parametrize(("tool", "train"), [
    ("hf", "torchrun --nproc_per_node 4 train.py --model_name_or_path Qwen/Qwen2.5-7B --per_device_train_batch_size 2"),
    ("hf", "python -m torch.distributed.run --nproc_per_node 4 train.py --model_name_or_path Qwen/Qwen2.5-7B"),
    ("hf", "torchrun --nproc_per_node 4 -m mypkg.train --model_name_or_path Qwen/Qwen2.5-7B"),
    ("swift", "torchrun --nproc_per_node 4 -m swift.cli.sft --model Qwen/Qwen2.5-7B --tuner_type lora"),
])
def test_setup_module_ahead_of_the_training_command_is_skipped(tmp_path: Path, setup: str, tool: str,
                                                                train: str) -> None:
    """`python -m pip install ...` or `python -m venv` before the launch is setup, not the training script: the
    reader finds the launch after it (4 ranks), where it used to read pip.py and find no model."""
    job = read_job(tool, _write(tmp_path, "run.sh", f"{setup}\n{train}\n"), JobOptions())
    assert (job.model, job.nproc) == ("Qwen/Qwen2.5-7B", 4)


def test_swift_rlhf_entry_script_keeps_its_objective(tmp_path: Path) -> None:
    script = _write(tmp_path, "dpo.sh", "torchrun --nproc_per_node 2 swift/cli/rlhf.py --rlhf_type dpo "
                                        "--model Qwen/Qwen2.5-7B\n")
    assert read_job("swift", script, JobOptions()).workload.objective == "dpo"


def test_llamafactory_without_nproc_runs_over_every_named_gpu(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    """`llamafactory-cli train` starts torchrun over every visible GPU itself: a job planned on --gpus 8xH100
    without --nproc runs 8 DDP ranks, not one process, and the plan says so; --nproc 1 keeps one process."""
    job = _write(tmp_path, "lf.yaml", "model_name_or_path: Qwen/Qwen2.5-7B\nfinetuning_type: lora\ncutoff_len: 4096\n"
                                      "per_device_train_batch_size: 2\nbf16: true\n")
    assert main(["plan", "--from", "llamafactory", job, "--gpus", "8xH100"]) == 0
    out = capsys.readouterr().out
    assert "8 rank(s) of 79.2 GiB; DDP (full replica per rank)" in out
    assert "starts torchrun over all 8 visible GPUs itself" in out
    assert main(["plan", "--from", "llamafactory", job, "--gpus", "8xH100", "--nproc", "1"]) == 0
    assert "one process, one GPU" in capsys.readouterr().out


AXOLOTL_FSDP = """base_model: Qwen/Qwen2.5-14B
sequence_len: 4096
micro_batch_size: 1
gradient_accumulation_steps: 4
bf16: true
flash_attention: true
gradient_checkpointing: true
fsdp_config:
  offload_params: false
  auto_wrap_policy: TRANSFORMER_BASED_WRAP
  transformer_layer_cls_to_wrap: Qwen2DecoderLayer
  reshard_after_forward: true
"""


def _gib_on(job, gpus: str) -> float:
    return plan_job(job, resolve_shape(job.model), parse_gpus(gpus)).configured.per_gpu_gib.total


def test_axolotl_dp_shard_size_shards_over_its_group_only(tmp_path: Path) -> None:
    """dp_shard_size 2 on 8 ranks: FSDP shards the full fine-tune over 2 ranks and replicates that 4 times, so
    each GPU holds half the model's states (124 GiB, does not fit), not an eighth (40 GiB)."""
    text = AXOLOTL_FSDP + "fsdp_version: 2\n"
    every = read_job("axolotl", _write(tmp_path, "all.yml", text), JobOptions(nproc=8))
    pairs = read_job("axolotl", _write(tmp_path, "hsdp.yml", text + "dp_shard_size: 2\n"), JobOptions(nproc=8))
    assert "dp_shard_size" in pairs.keys
    assert _gib_on(pairs, "8xH100") > 2.5 * _gib_on(every, "8xH100")


def test_axolotl_replicas_and_context_parallel_size_the_shard_group(tmp_path: Path) -> None:
    """axolotl sizes FSDP's group as accelerate does: dp_replicate_size 4 on 8 ranks shards over 2 (as dp_shard_size
    2 does: 124 GiB, not the 40 of all 8), and the group is dp_shard_size x context_parallel_size (dp_shard 4 x cp 2
    on 8 ranks is all of them: no replica)."""
    text = AXOLOTL_FSDP + "fsdp_version: 2\n"
    def gib(name: str, extra: str) -> float:
        return _gib_on(read_job("axolotl", _write(tmp_path, name, text + extra), JobOptions(nproc=8)), "8xH100")
    two = gib("s2.yml", "dp_shard_size: 2\n")
    assert gib("r4.yml", "dp_replicate_size: 4\n") == pytest.approx(two)
    assert gib("s2r4.yml", "dp_shard_size: 2\ndp_replicate_size: 4\n") == pytest.approx(two)
    cp = "context_parallel_size: 2\n"
    assert gib("c.yml", cp + "dp_shard_size: 4\n") == pytest.approx(gib("c0.yml", cp))
    assert gib("c2.yml", cp + "dp_shard_size: 2\n") < 0.6 * two


def test_axolotl_reference_is_sharded_over_the_shard_group(tmp_path: Path) -> None:
    """A full DPO under dp_shard_size 2: axolotl prepares the reference with FSDP over the same group of 2, so it
    takes half the copy a GPU (7.1 GiB of Qwen2.5-7B), not an eighth: 83 GiB, which does not fit an H100."""
    text = AXOLOTL_FSDP.replace("14B", "7B") + "fsdp_version: 2\nrl: dpo\ndp_shard_size: 2\n"
    job = read_job("axolotl", _write(tmp_path, "d.yml", text), JobOptions(nproc=8))
    got = plan_job(job, resolve_shape(job.model), parse_gpus("8xH100")).configured.per_gpu_gib
    assert got.weights > 20
    assert got.total > 80


def test_axolotl_parallel_sizes_it_cannot_plan_exit_2(tmp_path: Path) -> None:
    with pytest.raises(UserError, match=r"tp.yml:\d+: 'tensor_parallel_size: 2' .* shardfit does not plan tensor"):
        read_job("axolotl", _write(tmp_path, "tp.yml", AXOLOTL_FSDP + "tensor_parallel_size: 2\n"), JobOptions())
    no_fsdp = AXOLOTL_LONG + "gradient_checkpointing: true\ndp_shard_size: 2\n"
    with pytest.raises(UserError, match="'dp_shard_size: 2' without fsdp_config"):
        read_job("axolotl", _write(tmp_path, "ddp.yml", no_fsdp), JobOptions(nproc=4))
    with pytest.raises(UserError, match="'dp_shard_size: 2' with FSDP1"):
        read_job("axolotl", _write(tmp_path, "f1.yml", AXOLOTL_FSDP + "dp_shard_size: 2\n"), JobOptions(nproc=8))
    big = AXOLOTL_FSDP + "fsdp_version: 2\ndp_shard_size: 16\n"
    with pytest.raises(UserError, match="groups of 16 rank.* do not make the 8 ranks"):
        read_job("axolotl", _write(tmp_path, "s16.yml", big), JobOptions(nproc=8))


def test_axolotl_fsdp_version_decides_fsdp1(tmp_path: Path) -> None:
    """axolotl runs FSDP1 unless fsdp_version is 2: FSDP1 keeps an untied input embedding gathered in its root
    unit (Qwen2.5-14B: 1.5 GiB more a GPU)."""
    one = read_job("axolotl", _write(tmp_path, "v1.yml", AXOLOTL_FSDP), JobOptions(nproc=8))
    two = read_job("axolotl", _write(tmp_path, "v2.yml", AXOLOTL_FSDP + "fsdp_version: 2\n"), JobOptions(nproc=8))
    assert one.workload.fsdp1 and not two.workload.fsdp1
    assert "fsdp_version" in two.keys
    assert _gib_on(one, "8xH100") > _gib_on(two, "8xH100") + 1


def test_axolotl_memory_savings_shardfit_does_not_plan_are_said(tmp_path: Path) -> None:
    """tiled_mlp (less activation memory) is said in a note, not read silently; a QLoRA mixture's experts are
    planned 16-bit under transformers 5 without quantize_moe_experts, NF4 with it."""
    text = ("base_model: Qwen/Qwen3-30B-A3B\nadapter: qlora\nload_in_4bit: true\nlora_target_modules: [q_proj]\n"
            "sequence_len: 4096\nbf16: true\ngradient_checkpointing: true\ntiled_mlp: true\n")
    job = read_job("axolotl", _write(tmp_path, "moe.yml", text), JobOptions(transformers="5.2"))
    assert any(n.startswith("tiled_mlp: ") for n in job.notes)
    assert job.workload.fused_experts and not job.workload.quantize_fused_experts
    quantized = read_job("axolotl", _write(tmp_path, "q.yml", text + "quantize_moe_experts: true\n"),
                         JobOptions(transformers="5.2"))
    assert quantized.workload.quantize_fused_experts and "quantize_moe_experts" in quantized.keys


def test_swift_padding_free_is_read_as_planned(tmp_path: Path) -> None:
    """--padding_free drops the pads of a micro-batch: at most what the plan counts, and not packing."""
    job = read_job("swift", _write(tmp_path, "pf.sh", "swift sft --model Qwen/Qwen2.5-7B --padding_free true "
                                                      "--attn_impl flash_attn\n"), JobOptions())
    assert "as planned" in job.keys["padding_free"]
    assert to_config(job)["packing"] is False


def test_swift_experts_impl_is_read(tmp_path: Path) -> None:
    """--experts_impl grouped_mm computes the experts as planned; batched_mm's per-token weight copies are not
    planned, and the plan says so rather than filing the option as unknown."""
    line = "swift sft --model Qwen/Qwen3-30B-A3B --experts_impl {}\n"
    grouped = read_job("swift", _write(tmp_path, "g.sh", line.format("grouped_mm")), JobOptions())
    assert "experts_impl" in grouped.keys
    batched = read_job("swift", _write(tmp_path, "b.sh", line.format("batched_mm")), JobOptions())
    assert "experts_impl" in batched.not_modelled
    assert any(n.startswith("--experts_impl batched_mm") for n in batched.notes)


@pytest.mark.parametrize(("targets", "experts"), [('".*self_attn\\\\.(q|v)_proj"', False), ("[q_proj, v_proj]", False),
                                                 ("[q_proj, gate_proj, up_proj, down_proj]", None)])
def test_axolotl_convert_of_a_mixture_trains_the_experts_axolotl_trains(tmp_path: Path, targets: str,
                                                                        experts: bool | None) -> None:
    """axolotl's q/v targets on Qwen3-30B-A3B adapt no routed expert; shardfit's trainer adapts every expert unless
    `lora.experts` is false, so convert writes false (7M trainable, as axolotl trains, not 636M). Targets that
    reach the experts keep shardfit's default."""
    text = ("base_model: Qwen/Qwen3-30B-A3B\nadapter: lora\nlora_r: 16\nsequence_len: 2048\nmicro_batch_size: 2\n"
            f"bf16: true\ngradient_checkpointing: true\nlora_target_modules: {targets}\n")
    job = read_job("axolotl", _write(tmp_path, "moe.yml", text), JobOptions())
    assert to_config(job)["lora"].get("experts") is experts


@pytest.mark.parametrize(("targets", "dropout"), [("[q_proj, gate_proj, up_proj, down_proj]", 0.0),
                                                 ("[q_proj, v_proj]", 0.05)])
def test_axolotl_convert_of_a_mixture_with_dropout_runs(tmp_path: Path, targets: str, dropout: float) -> None:
    """A mixture's fused routed experts take adapters without dropout (peft's target_parameters), so a recipe whose
    targets reach them converts with lora.dropout 0 and says so in the header (the way to keep the dropout
    instead); where the experts get none (q/v), the dropout is kept."""
    text = ("base_model: Qwen/Qwen3-30B-A3B\nadapter: lora\nlora_r: 16\nlora_dropout: 0.05\nsequence_len: 2048\n"
            f"micro_batch_size: 2\nbf16: true\ngradient_checkpointing: true\nlora_target_modules: {targets}\n")
    job = read_job("axolotl", _write(tmp_path, "moe.yml", text), JobOptions())
    assert to_config(job)["lora"]["dropout"] == dropout
    assert ("# lora.dropout 0.05 -> 0: " in to_yaml(job)) is (dropout == 0)


def test_swift_target_regex_overrides_target_modules(tmp_path: Path) -> None:
    """ms-swift trains --target_regex's modules when both are given: planned and converted as the regex (the MLP's
    gate/up/down: 121M trainable on Qwen2.5-7B at rank 64), not as q/v (20M)."""
    regex = r"^(model\.layers\.\d+\.mlp\.(gate|up|down)_proj)$"
    job = read_job("swift", _write(tmp_path, "rx.sh", "swift sft --model Qwen/Qwen2.5-7B --tuner_type lora "
                                  f"--lora_rank 64 --target_modules q_proj v_proj --target_regex '{regex}'\n"),
                   JobOptions())
    assert job.workload.lora_targets == ("gate", "up", "down")
    assert "overridden by --target_regex" in job.keys["target_modules"]
    assert to_config(job)["lora"]["targets"] == regex


@pytest.mark.parametrize("value", ["5", "true", "{q: 1}", "[q_proj, 3]"])
def test_axolotl_target_modules_neither_names_nor_a_regex_exit_2(tmp_path: Path, capsys: pytest.CaptureFixture,
                                                                   value: str) -> None:
    """A number or mapping for lora_target_modules is bad input: exit 2 naming the file's line and what axolotl
    takes, not a TypeError (a number) nor a mapping's keys planned as module names."""
    job = _write(tmp_path, "bad.yml", AXOLOTL_LORA + f"lora_target_modules: {value}\n")
    assert main(["plan", "--from", "axolotl", job, "--gpus", "1xH100"]) == 2
    assert "bad.yml:9: 'lora_target_modules' is" in capsys.readouterr().err


def test_llamafactory_v1_on_this_machines_gpus_divides_the_global_batch_by_them(
        monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture) -> None:
    """Without --gpus the plan runs on the GPUs found here; v1's launcher starts a rank on each, so its
    global_batch_size 32 (micro 2) is 4 accumulation steps on 4 GPUs, decided before the job is read, not 16 (one
    rank) with the ranks added afterwards."""
    import shardfit.cli.foreign_args as foreign_args
    monkeypatch.setattr(foreign_args, "detect", lambda nodes=1: parse_gpus("4xH100"))
    assert main(["plan", "--from", "llamafactory", "tests/foreign_jobs/lf_v1/lora_fsdp2.yaml"]) == 0
    out = capsys.readouterr().out
    assert "global_batch_size=32 (grad_accum 4)" in out
    assert "llamafactory-cli train" not in out


@pytest.mark.parametrize("value", ["q_proj,v_proj", "[q_proj, v_proj]"])
def test_llamafactory_lora_target_as_text_or_list(tmp_path: Path, value: str) -> None:
    """LLaMA-Factory splits a comma list and takes a YAML list alike: both plan q and v, not all-linear with a
    list's text as one module name."""
    job = read_job("llamafactory", _write(tmp_path, "lf.yaml", "model_name_or_path: Qwen/Qwen2.5-7B\n"
                                          f"finetuning_type: lora\nlora_target: {value}\n"), JobOptions())
    assert job.workload.lora_targets == ("q", "v")
    assert to_config(job)["lora"]["targets"] == ["q_proj", "v_proj"]


def test_axolotl_gradient_checkpointing_word_it_does_not_take_exits_2(tmp_path: Path) -> None:
    """axolotl's `gradient_checkpointing` takes true/false or unsloth/offload/offload_disk as written: `Offload` was
    planned without checkpointing while its offload note said activations were checkpointed."""
    with pytest.raises(UserError, match=r"b.yml:9: 'gradient_checkpointing: Offload'; axolotl takes"):
        read_job("axolotl", _write(tmp_path, "b.yml", AXOLOTL_LONG + "gradient_checkpointing: Offload\n"),
                 JobOptions())


def test_foreign_target_regex_that_does_not_compile_exits_2(tmp_path: Path) -> None:
    """An invalid expression is said to be one, not reported as names the planner does not know."""
    with pytest.raises(UserError, match=r"lora_target_modules '\(q_proj' is not a regular expression"):
        read_job("axolotl", _write(tmp_path, "rx.yml", AXOLOTL_LORA + 'lora_target_modules: "(q_proj"\n'),
                 JobOptions())


def test_axolotl_tensor_parallel_refusal_suggests_the_jobs_workload(tmp_path: Path) -> None:
    """The suggested pipeline plan keeps the job's method, sequence and micro-batch (a full fine-tune at 4096, not
    shardfit's default LoRA at 1024)."""
    with pytest.raises(UserError, match=r"--method full --seq 4096 --batch 1 --pipeline-parallel 2"):
        read_job("axolotl", _write(tmp_path, "tp.yml", AXOLOTL_FSDP + "tensor_parallel_size: 2\n"), JobOptions())


TRAINER_ARGS = {"seed": 0, "num_train_epochs": 2.5, "save_steps": 0.25, "logging_steps": 5, "max_steps": -1,
                "learning_rate": 3e-5, "max_grad_norm": 0.5, "output_dir": "runs/a", "weight_decay": 0.1}


@pytest.mark.parametrize(("tool", "name", "head"), [
    ("llamafactory", "v0.yaml", "model_name_or_path: Qwen/Qwen2.5-7B\nfinetuning_type: lora\n"),
    ("llamafactory", "v1.yaml", "model: Qwen/Qwen2.5-7B\npeft_config:\n  name: lora\n"),
    ("hf", "args.json", None),
], ids=["lf_v0", "lf_v1", "hf"])
def test_trainer_arguments_are_carried_over_alike(tmp_path: Path, tool: str, name: str, head: str | None) -> None:
    """The HF Trainer's arguments mean one thing whichever tool passes them: a seed of 0 is a seed, 2.5 epochs are
    3 whole ones (the Trainer trains half the third: rounded up, said in the YAML's comments), a save_steps below 1
    (a ratio of the run) and max_steps -1 set nothing. LLaMA-Factory v1's own trainer takes no weight_decay (its
    optimizer plugin does): not carried over there, and said as not modelled."""
    if head is None:
        text = json.dumps({"model_name_or_path": "Qwen/Qwen2.5-7B", "use_lora": True, **TRAINER_ARGS})
    else:
        text = head + "".join(f"{k}: {v}\n" for k, v in TRAINER_ARGS.items())
    job = read_job(tool, _write(tmp_path, name, text), JobOptions())
    cfg = to_config(job)
    assert "num_train_epochs 2.5 -> epochs 3: shardfit trains whole epochs, rounded up" in to_yaml(job)
    carried = {k: cfg.get(k) for k in ("seed", "epochs", "save_steps", "log_steps", "max_steps", "lr",
                                       "max_grad_norm", "output_dir")}
    assert carried == {"seed": 0, "epochs": 3, "save_steps": None, "log_steps": 5, "max_steps": None, "lr": 3e-5,
                       "max_grad_norm": 0.5, "output_dir": "runs/a"}
    assert cfg.get("weight_decay") == (None if name == "v1.yaml" else 0.1)


@pytest.mark.parametrize(("given", "whole"), [(2.1, 3), (1.5, 2), (0.5, 1), (2, 2)])
def test_fractional_epochs_round_up(given: float, whole: int) -> None:
    """Whole epochs never fewer than the Trainer's fractional count trains (2.1 is 3, not 2)."""
    assert epochs(given, "num_train_epochs", "t.yaml") == whole
    assert (fractional_epochs({"num_train_epochs": given}) is None) == (given == whole)


def _trainable(job) -> float:
    """The plan's trainable parameters, in millions."""
    return trainable_params(resolve_shape(job.model), job.workload) / 1e6


def test_list_targets_match_as_peft_does_on_the_end_of_module_names(tmp_path: Path) -> None:
    """peft matches a list entry on the end of a module's name, so `q` reaches no `q_proj`: `q,v_proj` adapts
    v_proj only (peft skips q silently: planned so, with a note naming the names to give) and `[q, v]` nothing
    (peft refuses it: exit 2 naming the key and the names), by config/targets.py's one rule."""
    lf = ("model_name_or_path: Qwen/Qwen2.5-7B\nfinetuning_type: lora\nlora_rank: 16\nlora_target: {}\n"
          "cutoff_len: 4096\nbf16: true\n")
    both = read_job("llamafactory", _write(tmp_path, "both.yaml", lf.format("q_proj,v_proj")), JobOptions())
    assert round(_trainable(both), 1) == 5.0
    mixed = read_job("llamafactory", _write(tmp_path, "mixed.yaml", lf.format("q,v_proj")), JobOptions())
    assert mixed.workload.lora_targets == ("v",)
    assert any(re.search(r"lora_target has q, which names no module.*Name the projections: q_proj\..*peft skips q",
                         n) for n in mixed.notes)
    text = AXOLOTL_LORA + "lora_target_modules: [q, v]\n"
    assert main(["plan", "--from", "axolotl", _write(tmp_path, "short.yml", text), "--gpus", "1xH100"]) == 2
    with pytest.raises(UserError, match=r"lora_target_modules has q, v, which name no module.*q_proj, v_proj"):
        read_job("axolotl", _write(tmp_path, "short.yml", text), JobOptions())


def test_regex_targets_are_tried_on_the_models_own_module_names(tmp_path: Path) -> None:
    """A regular expression matches the model's own module names, not every model's: a vision-language model's
    blocks sit under model.language_model, so a pattern written for a text model's model.layers reaches none of
    them (every linear layer planned, said as an over-estimate: 40.4M trainable, not 5.0M), while one over its own
    names plans q and v; a pattern over blocks the model lacks (Qwen2.5-7B has 28) reaches none either."""
    def job(model: str, pattern: str):
        text = AXOLOTL_LORA.replace("Qwen/Qwen2.5-7B", model).replace("lora_r: 64", "lora_r: 16")
        return read_job("axolotl", _write(tmp_path, "rx.yml", text + f"lora_target_modules: '{pattern}'\n"),
                        JobOptions())
    vl = "Qwen/Qwen2.5-VL-7B-Instruct"
    text_layout = job(vl, r"model\.layers\.\d+\.self_attn\.(q|v)_proj")
    assert text_layout.workload.lora_targets is None and "lora_target_modules" in text_layout.not_modelled
    assert round(_trainable(text_layout), 1) == 40.4
    own = job(vl, r"model\.language_model\.layers\.\d+\.self_attn\.(q|v)_proj")
    assert own.workload.lora_targets == ("q", "v") and round(_trainable(own), 1) == 5.0
    assert job("Qwen/Qwen2.5-7B", r"model\.layers\.3\d\.self_attn\.(q|v)_proj").workload.lora_targets is None
    assert job("Qwen/Qwen2.5-7B", r"model\.layers\.2\d\.self_attn\.(q|v)_proj").workload.lora_targets == ("q", "v")


SWIFT_FSDP = ("NPROC_PER_NODE=8 swift sft --model Qwen/Qwen2.5-14B --tuner_type full --torch_dtype bfloat16 "
              "--max_length 4096 --per_device_train_batch_size 1 --gradient_accumulation_steps 4 --fsdp {}\n")


@pytest.mark.parametrize(("fsdp_config", "transformers", "fsdp1"), [
    ({}, "4.57.1", True), ({}, "5.10.1", False), ({"fsdp_version": 1}, "5.23.0", True),
    ({"fsdp_version": 2}, "4.57.1", False), (None, "4.57.1", False),
])
def test_swift_fsdp_version_as_the_trainer_reads_it(tmp_path: Path, fsdp_config: dict | None, transformers: str,
                                                    fsdp1: bool) -> None:
    """ms-swift hands its FSDP JSON to the HF Trainer, which runs FSDP1 unless fsdp_config's (fsdp_)version says 2
    before transformers 5.10, FSDP2 unless it says 1 since; `--fsdp fsdp2` (None here) sets version 2 itself.
    FSDP1 keeps Qwen2.5-14B's untied input embedding gathered in its root unit: 1.5 GiB more a GPU."""
    if fsdp_config is None:
        ref = "fsdp2"
    else:
        ref = "fsdp.json"
        (tmp_path / ref).write_text(json.dumps({"fsdp": "full_shard auto_wrap", "fsdp_config": fsdp_config}))
    job = read_job("swift", _write(tmp_path, "train.sh", SWIFT_FSDP.format(ref)), JobOptions(transformers=transformers))
    assert job.engine == "fsdp_full_shard" and job.workload.fsdp1 is fsdp1
    if fsdp1:
        two = dataclasses.replace(job, workload=dataclasses.replace(job.workload, fsdp1=False))
        assert _gib_on(job, "8xH100") > _gib_on(two, "8xH100") + 1


def test_hf_fsdp_config_version_decides_fsdp1(tmp_path: Path) -> None:
    """TrainingArguments' fsdp_config (a JSON object, or a JSON file beside the job) says the FSDP version: 1 plans
    FSDP1's gathered root embedding, 2 does not; a version neither 1 nor 2 exits 2 naming --fsdp_config."""
    def job(cfg: object, name: str):
        args = {"model_name_or_path": "Qwen/Qwen2.5-14B", "per_device_train_batch_size": 1, "bf16": True,
                "gradient_accumulation_steps": 4,
                "model_max_length": 4096, "gradient_checkpointing": True, "fsdp": "full_shard auto_wrap",
                "fsdp_config": cfg}
        return read_job("hf", _write(tmp_path, name, json.dumps(args)), JobOptions(nproc=8, transformers="5.23.0"))
    one, two = job({"version": 1}, "one.json"), job({"version": 2}, "two.json")
    assert one.workload.fsdp1 and not two.workload.fsdp1 and "fsdp_config" in one.keys
    assert _gib_on(one, "8xH100") > _gib_on(two, "8xH100") + 1
    (tmp_path / "fsdp.json").write_text('{"fsdp_version": 1, "reshard_after_forward": false}')
    from_file = job("fsdp.json", "file.json")
    assert from_file.workload.fsdp1 and from_file.engine == "fsdp_shard_grad_op"
    with pytest.raises(UserError, match=r"--fsdp_config.*version is 3"):
        job({"version": 3}, "three.json")


ACCELERATE_FSDP = """distributed_type: FSDP
fsdp_config:
  fsdp_auto_wrap_policy: TRANSFORMER_BASED_WRAP
  fsdp_offload_params: false
  fsdp_reshard_after_forward: {reshard}
{version}mixed_precision: bf16
num_processes: 8
"""


@pytest.mark.parametrize(("version", "reshard", "engine", "fsdp1"), [
    ("  fsdp_version: 2\n", "true", "fsdp_full_shard", False), ("", "FULL_SHARD", "fsdp_full_shard", True),
    ("  fsdp_version: 2\n", "false", "fsdp_shard_grad_op", False),
])
def test_hf_under_accelerate_fsdp_config(tmp_path: Path, version: str, reshard: str, engine: str,
                                         fsdp1: bool) -> None:
    """`accelerate launch --config_file fsdp.yaml train.py ...` runs the Trainer under accelerate's FSDP plugin: the
    full fine-tune of Qwen2.5-14B is sharded over 8 ranks (40 to 87 GiB a GPU, not DDP's 261), FSDP1 unless the
    config's fsdp_version is 2, as accelerate runs it."""
    (tmp_path / "fsdp.yaml").write_text(ACCELERATE_FSDP.format(version=version, reshard=reshard))
    cmd = ("accelerate launch --config_file fsdp.yaml --num_processes 8 train.py --model_name_or_path "
           "Qwen/Qwen2.5-14B --bf16 True --per_device_train_batch_size 1 --gradient_accumulation_steps 4 "
           "--model_max_length 4096 --gradient_checkpointing True\n")
    job = read_job("hf", _write(tmp_path, "run.sh", cmd), JobOptions())
    assert job.engine == engine and job.workload.fsdp1 is fsdp1
    assert "accelerate:fsdp_version" in job.keys or not version
    assert _gib_on(job, "8xH100") < 100  # DDP: 261


@pytest.mark.parametrize(("value", "engine"), [
    ('"FULL_SHARD"', "fsdp_full_shard"), ('"SHARD_GRAD_OP"', "fsdp_shard_grad_op"), ('"NO_SHARD"', "ddp"),
    ('"HYBRID_SHARD"', "fsdp_full_shard"), ("1", "fsdp_full_shard"), ("2", "fsdp_shard_grad_op"), ("3", "ddp"),
    ("4", "fsdp_full_shard"), ("false", "fsdp_shard_grad_op"), ("true", "fsdp_full_shard"),
])
def test_fsdp1_sharding_strategies_are_read_by_name_and_number(tmp_path: Path, value: str, engine: str) -> None:
    """FSDP1 stores its sharding strategy under reshard_after_forward (accelerate, the Trainer): FULL_SHARD is
    full_shard, not a false boolean's shard_grad_op, alike in the HF Trainer's fsdp_config, ms-swift's FSDP JSON
    and axolotl's fsdp_config; something else exits 2 naming the key."""
    cfg = f'{{"version": 1, "reshard_after_forward": {value}}}'
    args = {"model_name_or_path": "Qwen/Qwen2.5-14B", "bf16": True, "per_device_train_batch_size": 1,
            "model_max_length": 4096, "fsdp": "full_shard auto_wrap", "fsdp_config": json.loads(cfg)}
    hf = read_job("hf", _write(tmp_path, "a.json", json.dumps(args)), JobOptions(nproc=8, transformers="5.23.0"))
    _write(tmp_path, "fsdp.json", f'{{"fsdp": "full_shard auto_wrap", "fsdp_config": {cfg}}}')
    swift = read_job("swift", _write(tmp_path, "s.sh", SWIFT_FSDP.format("fsdp.json")), JobOptions())
    axolotl = read_job("axolotl", _write(tmp_path, "x.yml", AXOLOTL_LORA + f"fsdp_config:\n  fsdp_version: 1\n"
                                                           f"  reshard_after_forward: {value}\n"),
                       JobOptions(nproc=8))
    assert (hf.engine, swift.engine, axolotl.engine) == (engine, engine, engine)
    with pytest.raises(UserError, match=r"fsdp_config 'reshard_after_forward' is 'FULL'.*SHARD_GRAD_OP"):
        args["fsdp_config"] = {"version": 1, "reshard_after_forward": "FULL"}
        read_job("hf", _write(tmp_path, "b.json", json.dumps(args)), JobOptions(nproc=8))


def test_hf_script_lora_config_targets_are_planned(tmp_path: Path) -> None:
    """peft's LoraConfig(target_modules=[...]) written in the training script plans those modules (5.0M trainable at
    rank 16 on Qwen2.5-7B, not every linear layer's 40.4M), and convert carries them over; a string there is peft's
    regular expression."""
    script = ("from peft import LoraConfig\nfrom transformers import AutoModelForCausalLM, TrainingArguments\n"
              "model = AutoModelForCausalLM.from_pretrained('Qwen/Qwen2.5-7B')\n"
              "cfg = LoraConfig(r=16, target_modules={})\n"
              "args = TrainingArguments(output_dir='out', per_device_train_batch_size=1, bf16=True)\n")
    job = read_job("hf", _write(tmp_path, "train.py", script.format("['q_proj', 'v_proj']")), JobOptions())
    assert job.workload.lora_targets == ("q", "v") and round(_trainable(job), 1) == 5.0
    assert to_config(job)["lora"]["targets"] == ["q_proj", "v_proj"]
    rx = read_job("hf", _write(tmp_path, "rx.py", script.format(r"r'.*\.mlp\.(up|down)_proj'")), JobOptions())
    assert rx.workload.lora_targets == ("up", "down")


def test_axolotl_target_linear_on_fused_experts_is_its_list_of_linear_names(tmp_path: Path) -> None:
    """axolotl's lora_target_linear hands peft the names of the model's linear modules: on Qwen3-MoE under
    transformers 5 (fused experts, a router of its own class) only the attention's, so no routed expert trains;
    it was planned as peft's all-linear, whose rewrite adapts every expert."""
    text = AXOLOTL_LORA.replace("Qwen/Qwen2.5-7B", "Qwen/Qwen3-30B-A3B") + "lora_target_linear: true\n"
    job = read_job("axolotl", _write(tmp_path, "moe.yml", text), JobOptions(transformers="5.23.0"))
    assert job.workload.lora_targets == ("q", "k", "v", "o")
    assert not adapts_experts(resolve_shape(job.model), job.workload) and not job.workload.lora_router
