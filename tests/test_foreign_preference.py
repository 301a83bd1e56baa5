"""Preference jobs of other tools (`plan|check|convert --from`): LLaMA-Factory's `stage: dpo|kto` with `pref_*`,
ms-swift's `swift rlhf --rlhf_type`, axolotl's `rl:`, a TRL script's trainer become shardfit's `objective` and
`dpo:` keys; what shardfit cannot train exits 2; and the reference model those tools load beside a full fine-tune
is counted as they hold it (whole per GPU, or partitioned under ZeRO-3), where shardfit's own plan has none."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from shardfit.config import load_config
from shardfit.errors import UserError
from shardfit.foreign.asplanned import configured_estimate, plan_job
from shardfit.foreign.convert import to_config, to_yaml
from shardfit.foreign.read import JobOptions, read_job
from shardfit.foreign.rules import foreign_rules
from shardfit.plan.estimate import GIB
from shardfit.plan.hardware import parse_gpus
from shardfit.plan.plan import make_plan
from shardfit.plan.shapes import resolve_shape
from shardfit.plan.workload import workload_of
from tests.helpers import ROOT, run_cli

DS = ROOT / "tests" / "foreign_jobs" / "lf"
LF_FULL = """model_name_or_path: {model}
stage: dpo
do_train: true
finetuning_type: {ft}
dataset: dpo_en_demo
template: llama3
cutoff_len: {seq}
per_device_train_batch_size: 1
gradient_accumulation_steps: 1
learning_rate: 5.0e-6
bf16: true
pref_beta: 0.2
pref_loss: sigmoid
dpo_label_smoothing: 0.1
pref_ftx: 0.5
output_dir: saves/dpo
"""


def _write(tmp_path: Path, name: str, text: str) -> str:
    path = tmp_path / name
    path.write_text(text)
    return str(path)


def _lf(tmp_path: Path, model: str = "meta-llama/Llama-3.2-1B", ft: str = "full", seq: int = 2048,
        extra: str = "") -> str:
    return _write(tmp_path, "lf.yaml", LF_FULL.format(model=model, ft=ft, seq=seq) + extra)


def _converted(tmp_path: Path, job) -> object:
    """The converted config as `shardfit train` would load it."""
    out = tmp_path / "converted.yaml"
    out.write_text(to_yaml(job))
    return load_config(out, check_files=False)


def test_llamafactory_dpo_keys_carry_over(tmp_path: Path) -> None:
    job = read_job("llamafactory", _lf(tmp_path), JobOptions())
    assert job.workload.objective == "dpo" and job.keys["stage"] == "dpo (objective dpo)"
    cfg = _converted(tmp_path, job)
    assert cfg.objective == "dpo" and (cfg.dpo.beta, cfg.dpo.loss, cfg.dpo.label_smoothing) == (0.2, "sigmoid", 0.1)
    text = to_yaml(job)
    assert "# warning: pref_ftx: 0.5 not carried" in text
    assert "keeps a reference model beside the policy (finetuning_type: full" in text


@pytest.mark.parametrize("extra, objective, dpo", [
    ("stage: kto\nkto_chosen_weight: 1.5\nkto_rejected_weight: 0.8\nper_device_train_batch_size: 2\n", "kto",
     {"beta": 0.1, "desirable_weight": 1.5, "undesirable_weight": 0.8}),
    ("stage: dpo\npref_loss: orpo\npref_beta: 0.05\n", "orpo", {"beta": 0.05}),
    ("stage: dpo\npref_loss: simpo\npref_beta: 2.5\nsimpo_gamma: 1.2\n", "simpo", {"beta": 2.5, "simpo_gamma": 1.2}),
    ("stage: dpo\npref_loss: ipo\n", "dpo", {"beta": 0.1, "loss": "ipo"}),
])
def test_llamafactory_stages_and_losses(tmp_path: Path, extra: str, objective: str, dpo: dict) -> None:
    path = _write(tmp_path, "lf.yaml", "model_name_or_path: Qwen/Qwen2.5-7B-Instruct\nfinetuning_type: lora\n" + extra)
    cfg = to_config(read_job("llamafactory", path, JobOptions()))
    assert cfg["objective"] == objective and cfg["dpo"] == dpo


def test_swift_rlhf(tmp_path: Path) -> None:
    dpo = _write(tmp_path, "dpo.sh", "NPROC_PER_NODE=8 swift rlhf --rlhf_type dpo --model Qwen/Qwen2.5-7B-Instruct "
                 "--train_type full --beta 0.3 --loss_type ipo --rpo_alpha 0.5 --deepspeed zero3\n")
    job = read_job("swift", dpo, JobOptions())
    assert to_config(job)["dpo"] == {"beta": 0.3, "loss": "ipo"} and job.keeps_reference()
    assert "warning: --rpo_alpha: 0.5 not carried" in to_yaml(job)
    # ms-swift's simpo defaults (beta 2, gamma 1) are written out; its CPO-SimPO NLL term is said, not carried
    simpo = _write(tmp_path, "simpo.sh", "swift rlhf --rlhf_type simpo --model Qwen/Qwen2.5-7B-Instruct\n")
    job = read_job("swift", simpo, JobOptions())
    assert to_config(job)["dpo"] == {"beta": 2.0, "simpo_gamma": 1.0} and "warning: --cpo_alpha" in to_yaml(job)
    assert read_job("swift", _write(tmp_path, "d.sh", "swift rlhf --model Qwen/Qwen2.5-7B-Instruct\n"),
                    JobOptions()).workload.objective == "dpo"  # ms-swift's default rlhf_type


def test_axolotl_rl(tmp_path: Path) -> None:
    base = "base_model: Qwen/Qwen2.5-7B-Instruct\nsequence_len: 1024\nbf16: true\n"
    ipo = read_job("axolotl", _write(tmp_path, "a.yml", base + "rl: ipo\nrl_beta: 0.4\n"), JobOptions())
    assert to_config(ipo)["dpo"] == {"beta": 0.4, "loss": "ipo"} and ipo.keeps_reference()
    kto = read_job("axolotl", _write(tmp_path, "k.yml", base + "rl: kto\nadapter: lora\nkto_desirable_weight: 2\n"
                                     "kto_undesirable_weight: 0.5\nmicro_batch_size: 2\n"), JobOptions())
    assert to_config(kto)["dpo"] == {"beta": 0.1, "desirable_weight": 2.0, "undesirable_weight": 0.5}
    assert not kto.keeps_reference()  # TRL switches the adapter off instead
    own = read_job("axolotl", _write(tmp_path, "o.yml", base + "rl: dpo\nadapter: lora\nrl_adapter_ref_model: true\n"
                                     "dpo_label_smoothing: 0.2\n"), JobOptions())
    assert own.keeps_reference() and to_config(own)["dpo"]["label_smoothing"] == 0.2


def test_trl_script(tmp_path: Path) -> None:
    (tmp_path / "dpo.py").write_text(
        "from trl import DPOConfig, DPOTrainer\n"
        "args = DPOConfig(output_dir='out', beta=0.05, loss_type='hinge', max_length=1024, bf16=True,\n"
        "                 per_device_train_batch_size=2)\n"
        "trainer = DPOTrainer(model='Qwen/Qwen2.5-7B-Instruct', args=args, train_dataset=None)\n")
    job = read_job("hf", str(tmp_path / "dpo.py"), JobOptions(model="Qwen/Qwen2.5-7B-Instruct"))
    assert job.workload.objective == "dpo" and to_config(job)["dpo"] == {"beta": 0.05, "loss": "hinge"}
    assert job.keeps_reference()  # no peft: TRL copies the model
    (tmp_path / "pre.py").write_text(
        "from peft import LoraConfig\nfrom trl import DPOConfig, DPOTrainer\n"
        "args = DPOConfig(output_dir='out', precompute_ref_log_probs=True)\n"
        "trainer = DPOTrainer(model='m', args=args, peft_config=LoraConfig(r=16))\n")
    pre = read_job("hf", str(tmp_path / "pre.py"), JobOptions(model="Qwen/Qwen2.5-7B-Instruct"))
    assert pre.workload.reference == "precomputed" and to_config(pre)["dpo"]["precompute_reference"] is True


def test_only_the_trained_trl_trainer_lends_its_settings(tmp_path: Path) -> None:
    """The keywords (beta, loss_type, ref_model) of a TRL trainer the script builds but never trains are not the
    run's: of two, the one whose .train() runs says them."""
    from shardfit.foreign.script_ast import read_script

    unused = ("from trl import DPOTrainer, KTOTrainer\nfrom transformers import Trainer\n"
              "d = DPOTrainer(model=m, ref_model=r, beta=0.5, loss_type='hinge', args=args)\n")
    plain = read_script(Path("t.py"), unused + "Trainer(model=m, args=args).train()\n")
    assert plain.trainer is None and not {"beta", "loss_type", "ref_model"} & set(plain.args), plain.args
    kto = read_script(Path("t.py"), unused + "k = KTOTrainer(model=m, args=args, beta=0.2)\nk.train()\n")
    assert kto.trainer == "KTOTrainer" and kto.args.get("beta") == "0.2" and "ref_model" not in kto.args, kto.args
    alone = read_script(Path("t.py"), unused)
    assert alone.trainer == "DPOTrainer" and alone.args["beta"] == "0.5" and alone.args["ref_model"] == "r"


@pytest.mark.parametrize(("trains", "seq", "objective"), [("s", "4096", None), ("d", "512", "DPOTrainer")])
def test_an_untrained_sft_trainer_lends_nothing_either(trains: str, seq: str, objective: str | None) -> None:
    """An SFTTrainer (here the script's own subclass) built beside the DPOTrainer that trains lends it no length,
    and the other way round; the notes name the call as the script spells it."""
    from shardfit.foreign.script_ast import read_script

    got = read_script(Path("t.py"), "from trl import DPOTrainer, SFTTrainer\nclass MySFT(SFTTrainer):\n    pass\n"
                      "s = MySFT(model=m, max_seq_length=4096, args=a)\n"
                      f"d = DPOTrainer(model=m, beta=0.5, max_length=512, args=a)\n{trains}.train()\n")
    assert got.trainer == objective and got.args.get("max_seq_length", got.args.get("max_length")) == seq, got.args
    assert ("max_seq_length" in got.args) is (trains == "s") and ("max_length" in got.args) is (trains == "d")
    assert any(f.startswith("MySFT(" if trains == "s" else "DPOTrainer(") for f in got.found), got.found


def test_a_subclass_defined_in_a_block_is_still_found() -> None:
    """The chain of the script's own classes resolves in any order of definition: a base defined inside an `if`
    below the subclass that names it."""
    from shardfit.foreign.script_ast import read_script

    got = read_script(Path("t.py"), "from trl import DPOTrainer\nclass Mine(Base):\n    pass\n"
                      "if True:\n    class Base(DPOTrainer):\n        pass\nMine(model=m, args=a, beta=0.1).train()\n")
    assert got.trainer == "DPOTrainer" and got.args["beta"] == "0.1"
    assert any(f.startswith("Mine(beta=0.1) at t.py:7, a DPOTrainer") for f in got.found), got.found


@pytest.mark.parametrize("calls", [
    # alone, and beside a scorer Trainer the script never trains: the subclass (of a subclass) is what trains
    "t = MyDPO(model=m, args=args, beta=0.3)\nt.train()\n",
    "s = Trainer(model=rm, args=args)\nt = MyDPO(model=m, args=args, beta=0.3)\nt.train()\n",
])
def test_a_script_s_own_trl_subclass_keeps_its_objective(tmp_path: Path, calls: str) -> None:
    """Research scripts derive their trainer from TRL's (`class MyDPO(DPOTrainer)`): the objective and keywords
    are DPO's, however many of the script's own classes sit between."""
    from shardfit.foreign.script_ast import read_script

    head = ("from trl import DPOTrainer\nfrom transformers import Trainer\n"
            "class Base(DPOTrainer):\n    pass\nclass MyDPO(Base):\n    pass\n")
    got = read_script(Path("t.py"), head + calls)
    assert got.trainer == "DPOTrainer" and got.trl_trainer == "DPOTrainer" and got.args["beta"] == "0.3", got


@pytest.mark.parametrize("tool, name, text, said", [
    ("llamafactory", "lf.yaml", "model_name_or_path: Qwen/Qwen2.5-7B-Instruct\nstage: ppo\n", "'stage' is 'ppo'"),
    ("llamafactory", "lf.yaml", "model_name_or_path: Qwen/Qwen2.5-7B-Instruct\nstage: rm\n", "reward-model"),
    ("swift", "g.sh", "swift rlhf --rlhf_type grpo --model Qwen/Qwen2.5-7B-Instruct\n", "GRPO"),
    ("axolotl", "a.yml", "base_model: Qwen/Qwen2.5-7B-Instruct\nrl: grpo\n", "'rl' is 'grpo'"),
])
def test_what_shardfit_cannot_train_is_refused(tmp_path: Path, tool: str, name: str, text: str, said: str) -> None:
    with pytest.raises(UserError, match=said) as e:
        read_job(tool, _write(tmp_path, name, text), JobOptions())
    assert "shardfit trains sft, dpo, orpo, simpo, kto" in str(e.value)


def test_convert_exits_2(tmp_path: Path) -> None:
    ppo = _write(tmp_path, "ppo.yaml", "model_name_or_path: Qwen/Qwen2.5-7B-Instruct\nstage: ppo\n")
    r = run_cli("convert", "--from", "llamafactory", ppo)
    assert r.returncode == 2 and f"{ppo}:2" in r.stderr and "shardfit trains sft, dpo, orpo, simpo, kto" in r.stderr
    assert "Traceback" not in r.stderr
    # kto_pair is planned (a DPO job's memory) but has no shardfit objective to convert to
    pair = _write(tmp_path, "pair.yaml", LF_FULL.format(model="meta-llama/Llama-3.2-1B", ft="full", seq=1024)
                  .replace("pref_loss: sigmoid", "pref_loss: kto_pair").replace("dpo_label_smoothing: 0.1\n", ""))
    assert read_job("llamafactory", pair, JobOptions()).workload.objective == "dpo"
    with pytest.raises(UserError, match="kto_pair"):
        to_config(read_job("llamafactory", pair, JobOptions()))


def test_full_dpo_counts_the_reference_copy_the_converted_config_does_not(tmp_path: Path) -> None:
    """LLaMA-Factory loads a full fine-tune's model a second time as the reference: on one 24 GB GPU the job
    as configured does not fit, holding one 16-bit copy of the weights more than the converted config, which
    precomputes its reference and fits."""
    job = read_job("llamafactory", _lf(tmp_path), JobOptions())
    shape, hw = resolve_shape(job.model), parse_gpus("1x24GB")
    fp = plan_job(job, shape, hw)
    cfg = _converted(tmp_path, job)
    ours = make_plan(shape, workload_of(cfg), hw).candidate(cfg.strategy)
    assert ours is not None and cfg.strategy == "single" and cfg.dpo.precompute_reference == "auto"
    copy = shape.params() * 2 / GIB  # bf16
    assert fp.configured.per_gpu_gib.weights - ours.per_gpu_gib.weights == pytest.approx(copy, rel=1e-6)
    assert not fp.configured.fits and ours.fits
    assert "reference model copy" in fp.configured.notes
    found = {f.rule: f for f in foreign_rules(fp)}
    assert found["reference_copy"].severity == "error" and "whole on every GPU" in found["reference_copy"].message
    assert "finetuning_type: lora" in found["reference_copy"].fix and "shardfit convert" in found["reference_copy"].fix


@pytest.mark.parametrize("ds, share", [("ds_z3_config.json", 8), ("ds_z2_config.json", 1)])
def test_reference_copy_is_sharded_as_the_tool_shards_it(tmp_path: Path, ds: str, share: int) -> None:
    """trl's prepare_deepspeed keeps ZeRO-3 for the reference (1/8 of it per rank), and runs ZeRO-1/2 jobs'
    reference at stage 0 (all of it on every rank)."""
    path = _lf(tmp_path, model="Qwen/Qwen2.5-7B-Instruct", seq=2048, extra=f"deepspeed: {DS / ds}\n")
    job = read_job("llamafactory", path, JobOptions(nproc=8))
    shape, hw = resolve_shape(job.model), parse_gpus("8xA100-80G")
    fp = plan_job(job, shape, hw)
    without = configured_estimate(dataclasses.replace(job, reference=None), shape,
                                  dataclasses.replace(job.workload, precompute_reference=False), fp.hardware)
    extra = fp.configured.per_gpu_gib.weights - without.per_gpu_gib.weights
    assert extra == pytest.approx(shape.params() * 2 / share / GIB, rel=1e-6)
    assert "reference_copy" in {f.rule for f in foreign_rules(fp)}


def test_no_copy_where_the_tool_keeps_none(tmp_path: Path) -> None:
    """LoRA (the adapters switched off), ORPO/SimPO (no reference): no reference_copy finding, no extra weights."""
    for ft, extra in (("lora", ""), ("full", "pref_loss: orpo\n")):
        text = LF_FULL.format(model="meta-llama/Llama-3.2-1B", ft=ft, seq=1024)
        if extra:
            text = text.replace("pref_loss: sigmoid\n", extra).replace("dpo_label_smoothing: 0.1\n", "")
        job = read_job("llamafactory", _write(tmp_path, "lf.yaml", text), JobOptions())
        fp = plan_job(job, resolve_shape(job.model), parse_gpus("1x24GB"))
        ours = fp.plan.candidate("single")
        assert ours is not None and "reference_copy" not in {f.rule for f in foreign_rules(fp)}
        assert fp.configured.per_gpu_gib.weights == pytest.approx(ours.per_gpu_gib.weights)
