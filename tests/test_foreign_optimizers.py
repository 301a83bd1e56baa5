"""The optimizer a foreign job steps: the tool's `optim` by its real state bytes (or a stand-in said in a note), and
DeepSpeed's own when the job's DeepSpeed JSON has an optimizer section."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from shardfit.errors import UserError
from shardfit.foreign.asplanned import plan_job
from shardfit.foreign.common import default_optim, optimizer_keys
from shardfit.foreign.job import ForeignJob
from shardfit.foreign.read import JobOptions, read_job
from shardfit.plan.estimate import per_rank, state_bytes, trainable_params
from shardfit.plan.hardware import parse_gpus
from shardfit.plan.optimizer_kinds import OPTIMIZER_KINDS
from shardfit.plan.shapes import resolve_shape
from shardfit.plan.workload import Workload
from shardfit.strategy import get

DS_ADAM = '{"optimizer": {"type": "AdamW", "params": {"lr": "auto"}}, "zero_optimization": {"stage": 2}}'
DS_LAMB = '{"optimizer": {"type": "Lamb"}, "zero_optimization": {"stage": 2}}'
DS_PLAIN = '{"zero_optimization": {"stage": 2}}'


def _job(tool: str, tmp_path: Path, ds: str, optim: str = "paged_adamw_8bit"):  # noqa: ANN202
    """One job of `tool` with `optim` under the DeepSpeed JSON `ds`."""
    (tmp_path / "ds.json").write_text(ds)
    if tool == "llamafactory":
        path = tmp_path / "lf.yaml"
        path.write_text("model_name_or_path: meta-llama/Llama-2-7b-hf\nstage: sft\nfinetuning_type: full\nbf16: true\n"
                        f"optim: {optim}\ndeepspeed: ds.json\ncutoff_len: 1024\nper_device_train_batch_size: 1\n")
    elif tool == "axolotl":
        path = tmp_path / "ax.yml"
        path.write_text(f"base_model: meta-llama/Llama-2-7b-hf\nsequence_len: 1024\nmicro_batch_size: 1\nbf16: true\n"
                        f"optimizer: {optim}\ndeepspeed: ds.json\n")
    elif tool == "hf":
        path = tmp_path / "run.sh"
        path.write_text("deepspeed --num_gpus 8 train.py --model_name_or_path meta-llama/Llama-2-7b-hf --bf16 True "
                        f"--optim {optim} --deepspeed ds.json --max_seq_length 1024\n")
    else:
        path = tmp_path / "swift.sh"
        path.write_text("NPROC_PER_NODE=8 swift sft --model meta-llama/Llama-2-7b-hf --tuner_type full --torch_dtype "
                        f"bfloat16 --optim {optim} --deepspeed ds.json --max_length 1024\n")
    return read_job(tool, str(path), JobOptions(nproc=8))


@pytest.mark.parametrize("tool", ["llamafactory", "axolotl", "hf", "swift"])
def test_a_deepspeed_optimizer_section_overrides_the_tools_optim(tool: str, tmp_path: Path) -> None:
    """transformers' deepspeed_optim_sched hands the optimizer to DeepSpeed when its JSON has a section: fp32 Adam
    states, whatever 8-bit or paged `optim` the tool names; said in a note. Without the section the tool's stands."""
    job = _job(tool, tmp_path, DS_ADAM)
    assert job.zero is not None and job.zero.ds_optimizer
    assert (job.workload.optimizer, job.workload.bnb_optimizer) == ("adamw", False)
    assert any("optimizer section" in n and "deepspeed_optim_sched" in n for n in job.notes)
    lamb = _job(tool, tmp_path, DS_LAMB)
    assert lamb.workload.optimizer == "lamb" and any("its Lamb (fp32 states)" in n for n in lamb.notes)
    plain = _job(tool, tmp_path, DS_PLAIN)
    assert (plain.workload.optimizer, plain.workload.bnb_optimizer) == ("adamw8bit", True)
    assert not any("optimizer section" in n for n in plain.notes)


# transformers' OptimizerNames (and axolotl's torchao ones) -> (planned optimizer, bnb_optimizer, note says)
NAMES = {
    "adamw_torch": ("adamw", False, None), "adamw_torch_fused": ("adamw", False, None),
    "adamw_bnb_8bit": ("adamw8bit", True, None), "paged_adamw_32bit": ("adamw", True, None),
    "adamw_torch_8bit": ("adamw8bit", False, None), "ao_adamw_8bit": ("adamw8bit", False, None),
    "adamw_torch_4bit": ("adamw8bit", False, "over-estimate"), "ao_adamw_4bit": ("adamw8bit", False, "over-estimate"),
    "lion_8bit": ("lion8bit", True, None), "paged_lion_8bit": ("lion8bit", True, None),
    "lion_32bit": ("lion", True, None), "paged_lion_32bit": ("lion", True, None),
    "rmsprop_bnb_8bit": ("rmsprop8bit", True, None), "rmsprop_bnb_32bit": ("rmsprop", True, None),
    "rmsprop_bnb": ("rmsprop", True, None), "rmsprop": ("rmsprop", False, None),
    "ademamix": ("ademamix", True, None), "ademamix_8bit": ("ademamix8bit", True, None),
    "paged_ademamix_32bit": ("ademamix", True, None), "paged_ademamix_8bit": ("ademamix8bit", True, None),
    "adafactor": ("adafactor", False, None), "sgd": ("sgd", False, None), "adagrad": ("adagrad", False, None),
    "schedule_free_adamw": ("schedule_free_adamw", False, None),
    "schedule_free_sgd": ("schedule_free_sgd", False, None),
    "galore_adamw": ("adamw", False, "not modelled"), "lomo": ("adamw", False, "not modelled"),
    "apollo_adamw": ("adamw", False, "not modelled"), "galore_adamw_8bit": ("adamw8bit", False, "not modelled"),
}
# torch's multi-tensor step on a GPU: the optimizers whose `fused_adamw` is off
MULTI_TENSOR = {"adamw_torch", "rmsprop", "sgd", "adagrad", "schedule_free_adamw", "schedule_free_sgd"}


@pytest.mark.parametrize("name", sorted(NAMES))
def test_optimizer_names_plan_their_states_or_say_what_stands_in(name: str) -> None:
    """Each name plans its own optimizer's states (plan/optimizer_kinds.py), or AdamW of the name's width with a
    note naming it (never silently): GaLore, LOMO, APOLLO and torchao's 4-bit AdamW are not modelled."""
    planned, bnb, says = NAMES[name]
    notes: list[str] = []
    keys = optimizer_keys(name, "4.56.0", notes)
    assert (keys["optimizer"], keys["bnb_optimizer"]) == (planned, bnb)
    assert keys["torchao_optimizer"] == name.endswith(("torch_8bit", "ao_adamw_8bit"))  # its own full-width rule
    assert keys["fused_adamw"] == (name not in MULTI_TENSOR)
    if says is None:
        assert notes == []
    else:
        assert len(notes) == 1 and name in notes[0] and says in notes[0]


@pytest.mark.parametrize(("optim_args", "planned"), [(None, "sgd"), ("momentum=0.9,nesterov=True", "sgd_momentum"),
                                                     ("momentum=0", "sgd"), ({"momentum": "0.9"}, "sgd_momentum")])
def test_sgd_keeps_a_buffer_where_optim_args_give_it_momentum(optim_args: object, planned: str) -> None:
    """The Trainer's `sgd` reads `momentum` from `optim_args` from transformers 5.3 (trainer_optimizer.py
    `_get_sgd`)."""
    assert optimizer_keys("sgd", "5.3.0", [], optim_args=optim_args)["optimizer"] == planned


@pytest.mark.parametrize(("optim", "optim_args", "planned"), [
    ("sgd", "momentum=0.9", "sgd"), ("rmsprop", "momentum=0.9,centered=True", "rmsprop")])
def test_optim_args_are_dropped_before_transformers_passes_them(optim: str, optim_args: str, planned: str) -> None:
    """transformers 4.x and 5.0-5.2 build torch's SGD and RMSprop with the learning rate alone (optim_args ignored
    until PR #44203, in 5.3): no momentum buffer, said in a note naming what is dropped."""
    for version in ("4.56.0", "5.2.0"):
        notes: list[str] = []
        assert optimizer_keys(optim, version, notes, optim_args=optim_args)["optimizer"] == planned
        assert len(notes) == 1 and "momentum" in notes[0] and "ignored" in notes[0] and "5.3" in notes[0]


@pytest.mark.parametrize(("optim_args", "planned", "states"), [
    (None, "rmsprop", 1), ("momentum=0.9", "rmsprop_momentum", 2), ("centered=True", "rmsprop_centered", 2),
    ({"momentum": "0.9", "centered": "true"}, "rmsprop_centered_momentum", 3)])
def test_rmsprop_plans_the_states_optim_args_give_it(optim_args: object, planned: str, states: int) -> None:
    """transformers 5.3's `rmsprop` passes `momentum` and `centered` to torch's RMSprop: `momentum_buffer` and
    `grad_avg` beside `square_avg`, counted as the real optimizer keeps them after a step."""
    keys = optimizer_keys("rmsprop", "5.23.0", [], optim_args=optim_args)
    assert keys["optimizer"] == planned and OPTIMIZER_KINDS[planned].states == states
    kwargs = {"momentum": 0.9} if "momentum" in planned else {}
    real = torch.optim.RMSprop([torch.nn.Parameter(torch.zeros(8))], centered="centered" in planned, **kwargs)
    real.param_groups[0]["params"][0].grad = torch.ones(8)
    real.step()
    assert sum(1 for t in next(iter(real.state.values())).values() if t.dim() > 0) == states


@pytest.mark.parametrize(("optim", "decay", "said"), [
    ("sgd", 0.01, "adds one copy"), ("rmsprop", "0.1", "adds one copy"), ("sgd", None, "may add one copy"),
    ("sgd", 0.0, None), ("adagrad", 0.1, None), ("adamw_torch", 0.1, None), ("rmsprop_bnb", 0.1, None)])
def test_weight_decay_on_torch_sgd_or_rmsprop_is_said_to_copy_the_group(optim: str, decay: object,
                                                                         said: str | None) -> None:
    """torch's multi-tensor SGD and RMSprop add the decay into a copy of the gradients (measured: one more copy of
    the group); the Workload carries no weight decay, so a note says it where the decay is non-zero or unknown."""
    notes: list[str] = []
    optimizer_keys(optim, "5.23.0", notes, weight_decay=decay)
    if said is None:
        assert not any("weight_decay" in n for n in notes), notes
    else:
        assert len(notes) == 1 and said in notes[0] and "not planned" in notes[0], notes


@pytest.mark.parametrize(("optim", "sense", "fix"), [
    ("lomo", "large over-estimate", "--optimizer sgd"), ("adalomo", "over-estimate", "--optimizer adafactor"),
    ("galore_adamw", "over-estimate", "upper bound"), ("apollo_adamw_layerwise", "over-estimate", "upper bound"),
    ("grokadamw", "under-estimate by one state", "--optimizer ademamix")])
def test_a_stand_in_says_which_way_it_errs_and_what_to_pass(optim: str, sense: str, fix: str) -> None:
    """What is still planned as AdamW says whether that over- or under-counts its states, and the closest plan."""
    notes: list[str] = []
    optimizer_keys(optim, "5.23.0", notes)
    assert len(notes) == 1 and sense in notes[0] and fix in notes[0], notes


@pytest.mark.parametrize(("section", "planned", "fused"), [
    ('{"type": "Adagrad"}', "adagrad", False), ('{"type": "Lion"}', "lion", False),
    ('{"type": "SGD", "params": {"momentum": 0.9}}', "sgd_momentum", False),
    ('{"type": "Adafactor"}', "adafactor_torch", False), ('{"type": "lamb"}', "lamb", False)])
def test_a_deepspeed_section_of_another_type_plans_that_optimizer(section: str, planned: str, fused: bool,
                                                                  tmp_path: Path) -> None:
    """DeepSpeed builds its own (Adagrad, FusedLion, FusedLamb) or torch.optim's class by name; the plan steps it on
    the fp32 partitions, with torch's default multi-tensor kernel (`fused_adamw` off)."""
    job = _job("hf", tmp_path, '{"optimizer": ' + section + ', "zero_optimization": {"stage": 3}}')
    assert (job.workload.optimizer, job.workload.fused_adamw, job.workload.bnb_optimizer) == (planned, fused, False)
    assert any("optimizer section" in n and "(fp32 states)" in n for n in job.notes), job.notes


def test_a_deepspeed_section_it_cannot_model_stands_in_as_adamw(tmp_path: Path) -> None:
    """Muon (DeepSpeed's MuonWithAuxAdam) is not modelled: AdamW with fp32 moments, said."""
    job = _job("hf", tmp_path, '{"optimizer": {"type": "Muon"}, "zero_optimization": {"stage": 2}}')
    assert job.workload.optimizer == "adamw" and any("type Muon (not modelled" in n for n in job.notes)


@pytest.mark.parametrize(("optim_args", "planned", "dtypes", "per_weight"), [
    (None, "adamw_anyprecision", ("float32", "float32"), 8),
    ("use_kahan_summation=True", "adamw_anyprecision_kahan", ("float32", "float32", "bfloat16"), 10),
    ("use_kahan_summation=t,momentum_dtype=bfloat16,variance_dtype=bfloat16,compensation_buffer_dtype=bfloat16",
     "adamw_anyprecision_kahan", ("bfloat16", "bfloat16", "bfloat16"), 6),
    ({"variance_dtype": "float16"}, "adamw_anyprecision", ("float32", "float16"), 6),
    ("compensation_buffer_dtype=float32", "adamw_anyprecision", ("float32", "float32"), 8)])
def test_anyprecision_adamw_keeps_its_states_in_the_dtypes_optim_args_give(optim_args: object, planned: str,
                                                                            dtypes: tuple, per_weight: int) -> None:
    """transformers' Trainer builds torchdistx's AnyPrecisionAdamW with its momentum and variance in float32 unless
    optim_args name other dtypes, and a compensation buffer (bfloat16 unless named) only with use_kahan_summation:
    the plan's states per trained weight are those dtypes' bytes, for fp32 masters and pure bf16 weights alike."""
    notes: list[str] = []
    keys = optimizer_keys("adamw_anyprecision", "4.56.0", notes, optim_args=optim_args)
    assert notes == [] and (keys["optimizer"], keys["optimizer_dtypes"]) == (planned, dtypes)
    assert keys["fused_adamw"] and not keys["bnb_optimizer"]  # one tensor at a time, no multi-tensor kernel
    shape = resolve_shape("meta-llama/Llama-2-7b-hf")
    for over in ({}, {"pure_16bit": True}):
        w = Workload(method="full", precision="bf16", optimizer=keys["optimizer"],
                     optimizer_dtypes=keys["optimizer_dtypes"], fused_adamw=True, **over)
        assert state_bytes(shape, w)[2] == per_weight * trainable_params(shape, w)


def _hf_job(tmp_path: Path, optim_args: str) -> ForeignJob:
    """An HF Trainer script's job: Llama-2-7B full fine-tune in bf16 on one GPU with `adamw_anyprecision`."""
    path = tmp_path / "run.sh"
    path.write_text("python train.py --model_name_or_path meta-llama/Llama-2-7b-hf --bf16 True --optim "
                    f"adamw_anyprecision {optim_args} --max_seq_length 1024\n")
    return read_job("hf", str(path), JobOptions(nproc=1))


@pytest.mark.parametrize(("optim_args", "per_weight", "kept"), [
    ("", 8, 0), ("--optim_args use_kahan_summation=True", 10, 4),
    ("--optim_args momentum_dtype=bfloat16,variance_dtype=bfloat16", 4, 0)])
def test_an_hf_job_with_adamw_anyprecision_plans_its_states_and_step(tmp_path: Path, optim_args: str,
                                                                     per_weight: int, kept: int) -> None:
    """A job naming `adamw_anyprecision` plans AnyPrecision AdamW's states in their own dtypes (not an fp32 AdamW
    stand-in) and its per-tensor step: two copies of the head in the variance's dtype beside the last down
    projection's `centered_variance` (and, with Kahan summation, its fp32 `temp_buffer`)."""
    job = _hf_job(tmp_path, optim_args)
    shape, w = resolve_shape("meta-llama/Llama-2-7b-hf"), job.workload
    assert w.optimizer.startswith("adamw_anyprecision")
    r = per_rank(shape, w, parse_gpus("1xH100", 1, None), get("single"))
    assert r.optimizer == per_weight * trainable_params(shape, w)
    variance = 2 if "variance_dtype=bfloat16" in optim_args else 4
    head, down = shape.vocab * shape.hidden, shape.hidden * shape.intermediate
    assert r.foreach == 2 * variance * head + down * (variance + kept)


@pytest.mark.parametrize(("optim_args", "says"), [
    ("momentum_dtype=bf16", "momentum_dtype=bf16"), ("use_kahan_summation=maybe", "strtobool"),
    ("use_kahan_summation=True,compensation_buffer_dtype=int8", "compensation_buffer_dtype=int8")])
def test_anyprecision_optim_args_the_trainer_refuses_are_a_user_error(tmp_path: Path, optim_args: str,
                                                                      says: str) -> None:
    """A dtype torch has no floating-point one by that name, or a word transformers' strtobool refuses: the
    Trainer would fail on it, so the plan stops with exit 2 naming the file, the key and the fix."""
    with pytest.raises(UserError, match=says) as raised:
        _hf_job(tmp_path, f"--optim_args {optim_args}")
    assert "run.sh" in str(raised.value) and raised.value.exit_code == 2


def _script_job(tmp_path: Path, script: str, args: str = "") -> ForeignJob:
    """The job of `python train.py ARGS` where train.py is `script`."""
    (tmp_path / "train.py").write_text(script)
    (tmp_path / "run.sh").write_text(f"python train.py {args}\n")
    return read_job("hf", str(tmp_path / "run.sh"), JobOptions(nproc=1))


TRAINER_SCRIPT = ("from transformers import AutoModelForCausalLM, TrainingArguments, Trainer\n"
                  "model = AutoModelForCausalLM.from_pretrained('meta-llama/Llama-2-7b-hf')\n"
                  "args = TrainingArguments(output_dir='out', bf16=True, optim='{optim}',\n"
                  "                         optim_args='{optim_args}')\n"
                  "Trainer(model=model, args=args, train_dataset=ds).train()\n")


@pytest.mark.parametrize(("optim", "optim_args", "planned", "dtypes"), [
    ("adamw_anyprecision", "momentum_dtype=bfloat16,variance_dtype=bfloat16", "adamw_anyprecision",
     ("bfloat16", "bfloat16")),
    ("rmsprop", "momentum=0.9", "rmsprop_momentum", ())])
def test_a_script_s_training_arguments_optim_args_are_read(tmp_path: Path, optim: str, optim_args: str,
                                                          planned: str, dtypes: tuple) -> None:
    """TrainingArguments(optim=..., optim_args=...) in the script: the Trainer builds the optimizer from them
    (AnyPrecision AdamW's states in bf16, 4 bytes a weight; RMSprop's momentum buffer), so the plan does too."""
    w = _script_job(tmp_path, TRAINER_SCRIPT.format(optim=optim, optim_args=optim_args)).workload
    assert (w.optimizer, w.optimizer_dtypes) == (planned, dtypes)


def test_a_script_s_optim_args_the_trainer_refuses_name_the_script_s_line(tmp_path: Path) -> None:
    script = TRAINER_SCRIPT.format(optim="adamw_anyprecision", optim_args="variance_dtype=float8_e4m3fn")
    with pytest.raises(UserError, match="variance_dtype=float8_e4m3fn") as raised:
        _script_job(tmp_path, script)
    assert "train.py:4" in str(raised.value) and raised.value.exit_code == 2


@pytest.mark.parametrize("optim_args", ["use_kahan_summation=", "momentum_dtype=",
                                        "use_kahan_summation=True,compensation_buffer_dtype="])
def test_an_empty_anyprecision_optim_arg_is_a_user_error(optim_args: str) -> None:
    """transformers refuses an empty value (strtobool(''), getattr(torch, '')): exit 2 naming the key, not the
    default planned in its place."""
    key = optim_args.rstrip("=").rsplit(",", 1)[-1]
    with pytest.raises(UserError, match=key) as raised:
        optimizer_keys("adamw_anyprecision", "4.56.0", [], optim_args=optim_args, where="run.sh:1")
    assert raised.value.exit_code == 2


LOOP = ("import torch\nfrom torchdistx.optimizers import AnyPrecisionAdamW\n"
        "from transformers import AutoModelForCausalLM\n"
        "model = AutoModelForCausalLM.from_pretrained('meta-llama/Llama-2-7b-hf', torch_dtype=torch.bfloat16)\n"
        "opt = {optimizer}\n"
        "loader = torch.utils.data.DataLoader(ds, batch_size=1)\n"
        "for batch in loader:\n    loss = model(**batch).loss\n    loss.backward()\n    opt.step()\n"
        "    opt.zero_grad()\n")


@pytest.mark.parametrize(("call", "planned", "dtypes"), [
    ("AnyPrecisionAdamW(model.parameters(), lr=1e-5)", "adamw_anyprecision", ("float32", "bfloat16")),
    ("AnyPrecisionAdamW(model.parameters(), momentum_dtype=torch.bfloat16, variance_dtype=torch.bfloat16)",
     "adamw_anyprecision", ("bfloat16", "bfloat16")),
    ("AnyPrecisionAdamW(model.parameters(), use_kahan_summation=True, compensation_buffer_dtype=torch.float32)",
     "adamw_anyprecision_kahan", ("float32", "bfloat16", "float32"))])
def test_a_hand_written_loop_s_anyprecision_adamw_plans_its_own_dtypes(tmp_path: Path, call: str, planned: str,
                                                                       dtypes: tuple) -> None:
    """torchdistx's AnyPrecisionAdamW built in the script: its keywords, else torchdistx's own defaults (variance
    in bfloat16, unlike the Trainer's float32), stepped one tensor at a time."""
    w = _script_job(tmp_path, LOOP.format(optimizer=call)).workload
    assert (w.optimizer, w.optimizer_dtypes, w.fused_adamw) == (planned, dtypes, True)


def test_a_hand_written_loop_s_computed_anyprecision_dtype_is_a_user_error(tmp_path: Path) -> None:
    with pytest.raises(UserError, match="variance_dtype") as raised:
        _script_job(tmp_path, LOOP.format(optimizer="AnyPrecisionAdamW(model.parameters(), variance_dtype=dt)"))
    assert "train.py:5" in str(raised.value) and raised.value.exit_code == 2


def test_a_hand_written_loop_ignores_optim_args_it_never_reads(tmp_path: Path) -> None:
    """--optim / --optim_args on the command line of a script whose own loop builds torch's AdamW: nothing reads
    them, so a value the Trainer would refuse is no error."""
    job = _script_job(tmp_path, LOOP.format(optimizer="torch.optim.AdamW(model.parameters(), lr=1e-5)"),
                      "--optim adamw_anyprecision --optim_args use_kahan_summation=maybe")
    assert job.workload.optimizer == "adamw"


@pytest.mark.parametrize(("optim", "marked"), [
    ("galore_adamw", True), ("lomo", True), ("apollo_adamw", True), ("grokadamw", True), ("stable_adamw", True),
    ("adam", True), ("adamw_torch", False), ("paged_adamw_32bit", False), ("lion_32bit", False)])
def test_an_optimizer_planned_in_another_s_place_is_marked_for_no_8bit_offer(optim: str, marked: bool) -> None:
    assert optimizer_keys(optim, "4.56.0", [])["no_8bit_form"] is marked


def test_a_deepspeed_optimizer_section_is_marked_for_no_8bit_offer(tmp_path: Path) -> None:
    assert _job("hf", tmp_path, DS_ADAM, "adamw_torch").workload.no_8bit_form
    assert not _job("hf", tmp_path, DS_PLAIN, "adamw_torch").workload.no_8bit_form


@pytest.mark.parametrize(("optim", "setting"), [
    ("adamw_torch", "--optim adamw_bnb_8bit"), ("rmsprop", "--optim rmsprop_bnb_8bit"),
    ("lion_32bit", "--optim lion_8bit"), ("galore_adamw", None), ("adam", None)])
def test_a_from_job_s_8bit_offer_names_its_tool_s_own_setting(tmp_path: Path, optim: str,
                                                             setting: str | None) -> None:
    """`plan --from` a Llama-3-8B full fine-tune on 1x84GB: the 8-bit offer is the tool's own optim (which the plan
    then reads), never `--optimizer`, which --from refuses; none for a stand-in or torch's Adam."""
    (tmp_path / "run.sh").write_text("python train.py --model_name_or_path meta-llama/Meta-Llama-3-8B --bf16 True "
                                     f"--optim {optim} --per_device_train_batch_size 1 --gradient_checkpointing True "
                                     "--max_seq_length 512\n")
    job = read_job("hf", str(tmp_path / "run.sh"), JobOptions(nproc=1))
    fp = plan_job(job, resolve_shape(job.model), parse_gpus("1x84GB", 1, None))
    offers = [a.how() for a in fp.plan.alternatives or [] if "optimizer" in dict(a.changes)]
    assert offers == ([setting] if setting else [])
    said = fp.to_json()["alternatives"]
    assert not [p for p in said if "--optimizer" in p]
    assert len([p for p in said if setting and f"({setting}): " in p]) == (1 if setting else 0)


def _axolotl(tmp_path: Path, optim: str, extra: str) -> ForeignJob:
    """An axolotl full fine-tune of Llama-3.1-8B (untied head) on one GPU with `optim` and `extra` keys."""
    path = tmp_path / "groups.yml"
    path.write_text("base_model: meta-llama/Llama-3.1-8B\nsequence_len: 1024\nmicro_batch_size: 1\nbf16: true\n"
                    f"optimizer: {optim}\n{extra}")
    return read_job("axolotl", str(path), JobOptions(nproc=1))


GROUPS = {"embedding_lr_scale: 0.5\n": 0, "embedding_lr: 0.00001\n": 0,
          "lr_groups:\n  - name: attn\n    modules: [self_attn]\n    lr: 0.00001\n": 1}


@pytest.mark.parametrize("extra", sorted(GROUPS))
def test_axolotl_s_own_param_groups_step_the_head_right_after_the_embedding(tmp_path: Path, extra: str) -> None:
    """axolotl's OptimizerMixin puts embed_tokens and lm_head in a group of their own after the decay group's
    matrices once embedding_lr, embedding_lr_scale or lr_groups is set: transformers' Adafactor then steps the
    head while the embedding's update is still bound (two vocabulary-sized matrices in a row), where the Trainer's
    groups step the embedding first and the head after the last block's down projection."""
    from shardfit.plan.optimizer_states import step_temp_bytes
    from shardfit.plan.shapes import resolve_shape

    plain, grouped = _axolotl(tmp_path, "adafactor", ""), _axolotl(tmp_path, "adafactor", extra)
    w = grouped.workload
    assert w.embedding_group and w.lr_groups == GROUPS[extra] and not plain.workload.embedding_group
    key = extra.split(":")[0]
    assert key in grouped.keys and key not in grouped.not_modelled
    shape = resolve_shape("meta-llama/Llama-3.1-8B")
    matrix, down = shape.vocab * shape.hidden, shape.intermediate * shape.hidden
    added = step_temp_bytes(shape, w, 0) - step_temp_bytes(shape, plain.workload, 0)
    assert added == pytest.approx((matrix - down) * 4)  # one fp32 `update` of the embedding in place of down's


def test_axolotl_s_own_param_groups_register_no_fp32_embedding_states(tmp_path: Path) -> None:
    """axolotl's own create_optimizer registers the embedding for 32-bit states only for bitsandbytes' Adam8bit
    class, which no `optimizer` name builds (adamw_bnb_8bit is its AdamW with optim_bits 8): the embedding's states
    are 8-bit there, fp32 under the Trainer's create_optimizer."""
    from shardfit.plan.optimizer_states import fp32_state_embedding

    assert fp32_state_embedding(_axolotl(tmp_path, "adamw_bnb_8bit", "").workload)
    assert not fp32_state_embedding(_axolotl(tmp_path, "adamw_bnb_8bit", "embedding_lr_scale: 0.5\n").workload)


def test_axolotl_lr_groups_not_a_list_of_mappings_exits_2(tmp_path: Path) -> None:
    with pytest.raises(UserError, match=r"groups.yml:\d+: 'lr_groups' is .*list of mappings"):
        _axolotl(tmp_path, "adafactor", "lr_groups: attn\n")


@pytest.mark.parametrize(("version", "optim"), [("4.20.1", "adamw_hf"), ("4.31.0", "adamw_hf"),
                                                ("4.32.0", "adamw_torch"), ("4.53.0", "adamw_torch"),
                                                ("4.54.0", "adamw_torch_fused")])
def test_default_optim_follows_the_trainers_history(version: str, optim: str) -> None:
    """The HF Trainer's default `optim`: adamw_hf (transformers' own AdamW, stepped in place) before 4.32
    (transformers#25109), adamw_torch until 4.54, adamw_torch_fused since."""
    keys = optimizer_keys(None, version, notes := [])
    assert default_optim(None, version)[0] == optim and optim in notes[0]
    assert keys["fused_adamw"] == (optim != "adamw_torch")


@pytest.mark.parametrize(("version", "optim", "step"), [
    ("4.10.0", None, ("transformers", "per_tensor_sync", True)),
    ("4.20.0", "adamw_torch", ("for_loop", "per_tensor", True)),
    ("4.30.0", "adamw_hf", ("transformers", "foreach", False)),
    ("4.40.0", None, ("foreach", "foreach", False)),
    ("4.40.0", "adamw_torch_fused", ("fused", "foreach", False)),
    ("4.40.0", "paged_adamw_8bit", ("auto", "foreach", False)),
    ("4.20.0", "adafactor", ("auto", "per_tensor", True)),
])
def test_a_jobs_step_runs_its_releases_loops(version: str, optim: str | None, step: tuple) -> None:
    """The step's loop, clipping and zero_grad of a --from job: its optimizer's own loop, else torch's of the
    release its transformers came out with (2.0 with 4.27, 1.10 with 4.12); torch's for-loop AdamW of torch 1.x
    steps in place (no multi-tensor copy)."""
    keys = optimizer_keys(optim, version, [])
    assert (keys["optimizer_loop"], keys["grad_clip"], keys["zero_grad_zeros"]) == step
    w = Workload(method="full", **{k: v for k, v in keys.items() if k != "no_8bit_form"})
    assert w.multi_tensor_step == (step[0] == "foreach" and keys["optimizer"] == "adamw")
