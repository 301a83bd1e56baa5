"""The evaluation a Trainer job runs while it trains, planned as a moment of the step (plan/evaluation.py), read
from the tools' keys (foreign/trainer_eval.py), and checked against transformers' Trainer on a tiny model."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest

from shardfit.errors import UserError
from shardfit.foreign.read import JobOptions, read_job
from shardfit.plan.estimate import estimate
from shardfit.plan.evaluation import ASSUMED_STEPS, eval_parts, kept_steps, step_kept_bytes
from shardfit.plan.hardware import parse_gpus
from shardfit.plan.shapes import resolve_shape
from shardfit.plan.workload import Workload

QWEN = "Qwen/Qwen2.5-7B-Instruct"  # a 152k vocabulary: its eval logits are large
TRAINER = Workload(method="lora", loss="full", seq_len=2048, micro_batch=1, quant_backend="bnb")

SCRIPT = """from transformers import Trainer
def compute_metrics(p):
    return {}
trainer = Trainer(model=model, args=args, train_dataset=train, eval_dataset=held, compute_metrics=compute_metrics)
trainer.train()
"""


def _plan(w: Workload, gpus: str = "H100", strategy: str = "single"):
    return estimate(resolve_shape(QWEN), w, parse_gpus(gpus), strategy)


def _hf_job(tmp_path: Path, args: str, script: str = SCRIPT):
    (tmp_path / "train.py").write_text(script)
    launch = tmp_path / "run.sh"
    launch.write_text(f"torchrun --nproc_per_node 2 train.py --model_name_or_path {QWEN} --bf16 True "
                      f"--per_device_train_batch_size 1 --model_max_length 2048 {args}\n")
    return read_job("hf", str(launch), JobOptions())


def test_no_evaluation_leaves_the_plan_as_it_was() -> None:
    base = _plan(TRAINER)
    assert base.peak_phase != "eval"
    same = _plan(replace(TRAINER, eval_accumulation=4, eval_keeps_logits=True))  # no eval_batch: no evaluation
    assert same.per_gpu_gib == base.per_gpu_gib and same.notes == base.notes


def test_an_eval_batch_larger_than_training_peaks_at_evaluation() -> None:
    base = _plan(TRAINER)
    c = _plan(replace(TRAINER, eval_batch=16))
    assert c.peak_phase == "eval"
    # 16 rows x 2048 positions x 152k logits: 16-bit, the fp32 upcast and the fp32 log-softmax
    assert c.per_gpu_gib.logits > 16 * 2048 * 152_000 * 10 / 2**30 * 0.99
    assert c.per_gpu_gib.total > base.per_gpu_gib.total + 30
    assert c.per_gpu_gib.grads == 0  # zero_grad(set_to_none) ran before the evaluation
    assert "per_device_eval_batch_size 16" in c.notes and "smaller per_device_eval_batch_size" in c.notes


def test_an_eval_batch_of_the_training_micro_batch_never_wins() -> None:
    c = _plan(replace(TRAINER, eval_batch=1))
    assert c.peak_phase != "eval" and c.per_gpu_gib == _plan(TRAINER).per_gpu_gib


def test_kept_logits_grow_with_the_eval_set_and_accumulation_bounds_them() -> None:
    shape = resolve_shape(QWEN)
    w = replace(TRAINER, eval_batch=8, eval_keeps_logits=True, eval_examples=160)
    assert kept_steps(w, 2) == (10, False)  # 160 examples over 2 ranks x 8 rows
    assert kept_steps(replace(w, eval_accumulation=3), 2) == (3, False)
    assert kept_steps(replace(w, eval_examples=0), 2) == (ASSUMED_STEPS, True)
    assert kept_steps(replace(w, eval_keeps_logits=False), 2) == (0, False)
    # each rank keeps every rank's gathered logits
    assert step_kept_bytes(shape, w, 2) == 2 * step_kept_bytes(shape, w, 1)
    whole, bounded = _plan(w, "2xH100", "ddp"), _plan(replace(w, eval_accumulation=1), "2xH100", "ddp")
    assert whole.per_gpu_gib.logits > bounded.per_gpu_gib.logits + 8 * step_kept_bytes(shape, w, 2) / 2**30
    assert "eval_accumulation_steps unset" in whole.notes and "prediction_loss_only" in whole.notes
    # one process (single on two GPUs) gathers from no other rank: unbounded, every rank ends up with the whole
    # eval set's logits either way; bounded by eval_accumulation_steps, a step of one rank's rows is half as large
    assert _plan(w, "2xH100", "single").per_gpu_gib.logits == whole.per_gpu_gib.logits
    two = replace(w, eval_accumulation=2)
    assert _plan(two, "2xH100", "single").per_gpu_gib.logits < _plan(two, "2xH100", "ddp").per_gpu_gib.logits - \
        2 * step_kept_bytes(shape, w, 1) / 2**30
    unknown = _plan(replace(w, eval_examples=0))
    assert "eval set size unknown" in unknown.notes


def test_deepspeed_plans_the_evaluation_too() -> None:
    from shardfit.plan.deepspeed import ZeroSettings, estimate_deepspeed
    shape, hw = resolve_shape(QWEN), parse_gpus("8xH100")
    base = estimate_deepspeed(shape, TRAINER, hw, ZeroSettings(stage=3))
    c = estimate_deepspeed(shape, replace(TRAINER, eval_batch=16), hw, ZeroSettings(stage=3))
    assert base.peak_phase != "eval" and c.peak_phase == "eval"
    assert c.per_gpu_gib.total > base.per_gpu_gib.total and "per_device_eval_batch_size 16" in c.notes


def test_hf_job_with_compute_metrics_keeps_logits(tmp_path: Path) -> None:
    job = _hf_job(tmp_path, "--eval_strategy steps --per_device_eval_batch_size 16")
    w = job.workload
    assert (w.eval_batch, w.eval_keeps_logits, w.eval_accumulation) == (16, True, 0)
    assert job.keys["per_device_eval_batch_size"] == "16 (eval forward of 16 rows per GPU, its loss upcast to fp32)"
    assert "eval_strategy" in job.keys and "eval_strategy" not in job.not_modelled
    assert _plan(w).peak_phase == "eval"


def test_prediction_loss_only_keeps_no_logits(tmp_path: Path) -> None:
    w = _hf_job(tmp_path, "--eval_strategy steps --prediction_loss_only True").workload
    assert (w.eval_batch, w.eval_keeps_logits) == (8, False)  # the Trainer's default eval batch
    reduced = SCRIPT.replace("compute_metrics=compute_metrics", "compute_metrics=compute_metrics, "
                             "preprocess_logits_for_metrics=lambda l, _: l.argmax(-1)")
    assert not _hf_job(tmp_path, "--eval_strategy steps", reduced).workload.eval_keeps_logits


def test_eval_accumulation_steps_is_read(tmp_path: Path) -> None:
    w = _hf_job(tmp_path, "--eval_strategy epoch --eval_accumulation_steps 2").workload
    assert (w.eval_keeps_logits, w.eval_accumulation) == (True, 2)
    with pytest.raises(UserError, match="per_device_eval_batch_size"):
        _hf_job(tmp_path, "--eval_strategy steps --per_device_eval_batch_size 0")


def test_hf_job_without_eval_strategy_does_not_evaluate(tmp_path: Path) -> None:
    assert _hf_job(tmp_path, "--per_device_eval_batch_size 16").workload.eval_batch == 0
    assert _hf_job(tmp_path, "--eval_strategy no").workload.eval_batch == 0


def test_tools_with_held_out_data_evaluate_without_keeping_logits(tmp_path: Path) -> None:
    lf = tmp_path / "lf.yaml"
    lf.write_text(f"model_name_or_path: {QWEN}\nstage: sft\ndo_train: true\nfinetuning_type: lora\n"
                  "lora_target: all\ndataset: alpaca_en_demo\ntemplate: qwen\ncutoff_len: 2048\nbf16: true\n"
                  "per_device_train_batch_size: 1\nval_size: 0.1\neval_strategy: steps\neval_steps: 500\n"
                  "per_device_eval_batch_size: 16\ncompute_accuracy: true\noutput_dir: out\n")
    w = read_job("llamafactory", str(lf), JobOptions()).workload
    assert (w.eval_batch, w.eval_keeps_logits) == (16, False)
    ax = tmp_path / "ax.yml"
    ax.write_text(f"base_model: {QWEN}\nadapter: lora\nlora_r: 8\nlora_target_linear: true\nsequence_len: 2048\n"
                  "micro_batch_size: 2\ngradient_accumulation_steps: 1\nbf16: true\nval_set_size: 0.05\n"
                  "datasets:\n  - path: data.jsonl\n    type: alpaca\noutput_dir: out\n")
    w = read_job("axolotl", str(ax), JobOptions()).workload
    assert (w.eval_batch, w.eval_batch_key) == (2, "eval_batch_size")  # axolotl's default: micro_batch_size
    sw = tmp_path / "swift.sh"
    sw.write_text(f"swift sft --model {QWEN} --train_type lora --dataset d.jsonl --max_length 2048 "
                  "--split_dataset_ratio 0.01 --torch_dtype bfloat16\n")
    assert read_job("swift", str(sw), JobOptions()).workload.eval_batch == 1  # ms-swift's default
    sw.write_text(f"swift sft --model {QWEN} --train_type lora --dataset d.jsonl --max_length 2048\n")
    assert read_job("swift", str(sw), JobOptions()).workload.eval_batch == 0


# Trainer calls whose compute_metrics is given in a mapping, or only in a comment or a string (review of 2026-05)
_KW = "from transformers import Trainer\ndef cm(p):\n    return {}\n"


@pytest.mark.parametrize("call", [
    'Trainer(**{"model": model, "args": args, "compute_metrics": cm}).train()',
    "kw = {'model': model, 'compute_metrics': cm}\nTrainer(args=args, **kw).train()",
    "Trainer(**dict(model=model, compute_metrics=cm), args=args).train()",
    "kw = dict(model=model)\nkw['compute_metrics'] = cm\nTrainer(**kw).train()",
])
def test_compute_metrics_given_in_a_mapping_keeps_logits(tmp_path: Path, call: str) -> None:
    job = _hf_job(tmp_path, "--eval_strategy steps", _KW + call + "\n")
    assert job.workload.eval_keeps_logits, call
    assert not any("no training script read" in n or "cannot be told" in n for n in job.notes), job.notes


@pytest.mark.parametrize("call", [
    "# compute_metrics=cm  (disabled: OOMs)\nTrainer(model=model, args=args).train()",
    '"""compute_metrics=cm is left out."""\nTrainer(model=model, args=args).train()',
    "Trainer(model=model, args=args, compute_metrics=None).train()",
    "Trainer(**{'model': model, 'compute_metrics': cm, 'preprocess_logits_for_metrics': pre}).train()",
    "other(compute_metrics=cm)\nTrainer(model=model, args=args).train()",
])
def test_compute_metrics_outside_the_trainer_call_keeps_nothing(tmp_path: Path, call: str) -> None:
    job = _hf_job(tmp_path, "--eval_strategy steps", _KW + call + "\n")
    assert not job.workload.eval_keeps_logits, call
    assert not any("compute_metrics" in n for n in job.notes), job.notes


def test_compute_metrics_from_a_computed_mapping_is_noted(tmp_path: Path) -> None:
    job = _hf_job(tmp_path, "--eval_strategy steps", _KW + "Trainer(model=model, **make_kwargs()).train()\n")
    assert not job.workload.eval_keeps_logits
    assert any("compute_metrics" in n and "train.py:4" in n for n in job.notes), job.notes


def test_eval_accumulation_steps_0_fails_the_first_eval_step(tmp_path: Path) -> None:
    """(step + 1) % 0 raises ZeroDivisionError at the first eval step (trainer.py `evaluation_loop`)."""
    with pytest.raises(UserError, match=r"eval_accumulation_steps.*0.*ZeroDivisionError"):
        _hf_job(tmp_path, "--eval_strategy steps --eval_accumulation_steps 0")


def test_batch_eval_metrics_keeps_no_logits(tmp_path: Path) -> None:
    """batch_eval_metrics hands each step's logits to compute_metrics and drops them (trainer.py)."""
    w = _hf_job(tmp_path, "--eval_strategy steps --batch_eval_metrics true").workload
    assert w.eval_batch == 8 and not w.eval_keeps_logits
    assert _hf_job(tmp_path, "--eval_strategy steps --batch_eval_metrics false").workload.eval_keeps_logits


def test_eval_do_concat_batches_false_appends_without_the_concat_peak(tmp_path: Path) -> None:
    """EvalLoopContainer appends each step's logits to a list: no torch.cat holding old and new at once."""
    w = _hf_job(tmp_path, "--eval_strategy steps --per_device_eval_batch_size 4 --max_eval_samples 64 "
                          "--eval_do_concat_batches false").workload
    assert w.eval_keeps_logits and not w.eval_concat
    shape, k = resolve_shape(QWEN), kept_steps(w, 1)[0]
    g = step_kept_bytes(shape, w, 1)
    assert k == 16 and eval_parts(shape, w, "single", 1)[1] == (0.0, k * g)  # the list, no torch.cat
    assert eval_parts(shape, replace(w, eval_concat=True), "single", 1)[1] == (0.0, 2 * k * g)
    appended, concatenated = _plan(w), _plan(replace(w, eval_concat=True))
    assert appended.peak_phase == concatenated.peak_phase == "eval"
    # the peak moves to the last step's loss beside the 15 steps kept before it
    assert concatenated.per_gpu_gib.logits > appended.per_gpu_gib.logits + 0.5 * k * g / 2**30


def _swift(tmp_path: Path, args: str):
    sw = tmp_path / "swift.sh"
    sw.write_text(f"swift sft --model {QWEN} --dataset d.jsonl --max_length 2048 --torch_dtype bfloat16 {args}\n")
    return read_job("swift", str(sw), JobOptions())


def test_swift_split_dataset_ratio_defaults_by_its_version(tmp_path: Path) -> None:
    """ms-swift 3.0 to 3.5 split 1 % off by default (DataArguments split_dataset_ratio 0.01), 3.6 on and 4 none;
    --tuner_type is ms-swift 4's, --train_type ms-swift 3's name for the method."""
    four = _swift(tmp_path, "--tuner_type lora")
    assert four.workload.eval_batch == 0 and not any("split_dataset_ratio" in n for n in four.notes)
    three = _swift(tmp_path, "--train_type lora")
    assert three.workload.eval_batch == 0
    assert any("split_dataset_ratio" in n and "3.0 to 3.5" in n for n in three.notes), three.notes
    assert _swift(tmp_path, "--train_type lora --split_dataset_ratio 0").notes == \
        [n for n in three.notes if "split_dataset_ratio" not in n]


@pytest.mark.parametrize(("args", "batch"), [
    ("--cached_val_dataset cache/val", 1), ("--eval_dataset gsm8k", 1), ("--val_dataset v.jsonl", 1),
    ("--split_dataset_ratio 0.01 --save_strategy no", 0), ("--val_dataset v.jsonl --eval_strategy no", 0),
    ("--split_dataset_ratio 0.01 --save_strategy epoch", 1),
])
def test_swift_evaluates_with_validation_data_on_its_save_strategy(tmp_path: Path, args: str, batch: int) -> None:
    """eval_strategy follows save_strategy where not given (`_init_eval_strategy`); no validation data, no eval."""
    assert _swift(tmp_path, f"--tuner_type lora {args}").workload.eval_batch == batch


def test_swift_load_best_is_refused_only_where_no_version_evaluates(tmp_path: Path) -> None:
    """Without validation data load_best_model_at_end fails the job; ms-swift 3.0 to 3.5 split 1 % off, so a job
    on --train_type (ms-swift 3) and no ratio may have it, and is planned, not refused."""
    with pytest.raises(UserError, match="load_best_model_at_end"):
        _swift(tmp_path, "--tuner_type lora --load_best_model_at_end true")
    assert _swift(tmp_path, "--train_type lora --load_best_model_at_end true").workload.eval_batch == 0


# Two trainers in one script: the one whose .train() runs decides, as it decides the load dtype (script_loads.py)
@pytest.mark.parametrize(("calls", "keeps"), [
    ("scorer = Trainer(model=rm, args=args, compute_metrics=cm)\nscorer.evaluate()\n"
     "Trainer(model=model, args=args).train()", False),
    ("warm = Trainer(model=model, args=args)\nt = Trainer(model=model, args=args, compute_metrics=cm)\nt.train()",
     True),
])
def test_the_trainer_that_trains_decides_the_eval_logits(tmp_path: Path, calls: str, keeps: bool) -> None:
    """The script's first trainer call is not the one that trains: its metrics say nothing of the training's
    evaluation (a scorer evaluated on its own, a trainer built and dropped)."""
    job = _hf_job(tmp_path, "--eval_strategy steps", _KW + calls + "\n")
    assert job.workload.eval_keeps_logits is keeps, job.notes
    assert not any("compute_metrics (" in n for n in job.notes), job.notes


def test_two_trainers_none_seen_training_is_noted(tmp_path: Path) -> None:
    """Several trainers and no .train() on one of them: which evaluation runs cannot be told, and the plan says
    so (no logits assumed), naming where the trainers are."""
    calls = "a = Trainer(model=model, args=args, compute_metrics=cm)\nb = Trainer(model=model, args=args)\nrun(a, b)"
    job = _hf_job(tmp_path, "--eval_strategy steps", _KW + calls + "\n")
    assert not job.workload.eval_keeps_logits
    assert any("which of the trainers at train.py:4, train.py:5 trains cannot be told" in n for n in job.notes), \
        job.notes


def _eval_fit(tmp_path: Path, eval_args: str):
    from shardfit.foreign.asplanned import plan_job

    job = _hf_job(tmp_path, "--use_lora True --gradient_checkpointing True --eval_strategy steps " + eval_args)
    return plan_job(job, resolve_shape(QWEN), parse_gpus("2xL40S"))


def test_an_eval_peak_names_the_evaluation_not_the_training_remedies(tmp_path: Path) -> None:
    """At an eval peak the training's remedies (a smaller micro-batch, shorter sequences) would not lower it: the
    note says the peak is at evaluation and leaves what lowers it to the eval note before it."""
    fp = _eval_fit(tmp_path, "--per_device_eval_batch_size 32 --max_eval_samples 2000")
    c = fp.configured
    assert c.peak_phase == "eval" and not c.fits
    assert "at evaluation; largest part: logits" in c.notes, c.notes
    assert "smaller micro-batch" not in c.notes and "a smaller per_device_eval_batch_size" in c.notes


@pytest.mark.parametrize(("eval_args", "first"), [
    # the logits kept are what does not fit: moving them every step is enough
    ("--per_device_eval_batch_size 2 --max_eval_samples 2000", "--eval_accumulation_steps 1: "),
    # one step's logits at 32 rows do not fit either: both, the eval batch the largest halving that fits
    ("--per_device_eval_batch_size 32 --max_eval_samples 2000",
     "--eval_accumulation_steps 1 + --per_device_eval_batch_size 4: "),
])
def test_what_would_fit_tries_the_evaluation_first(tmp_path: Path, eval_args: str, first: str) -> None:
    """The nearest changes that fit start with the evaluation's (they change nothing the training computes), in
    the tool's flags."""
    fp = _eval_fit(tmp_path, eval_args)
    assert not fp.configured.fits and fp.would, fp.would
    assert fp.would[0].startswith(first), fp.would


@pytest.mark.parametrize(("calls", "keeps"), [
    # the attribute set on the trainer that trains counts; on a scorer, or on a config object, it does not
    ("t = Trainer(model=model, args=args)\nt.compute_metrics = cm\nt.train()", True),
    ("scorer = Trainer(model=rm, args=args)\nscorer.compute_metrics = cm\nscorer.evaluate()\n"
     "Trainer(model=model, args=args).train()", False),
    ("cfg.compute_metrics = True\nTrainer(model=model, args=args).train()", False),
    # a trainer built by the script's own function, trained by name, beside a scorer
    ("def make():\n    return Trainer(model=model, args=args, compute_metrics=cm)\n"
     "scorer = Trainer(model=rm, args=args)\nt = make()\nt.train()", True),
    # an unused DPOTrainer does not make the trained Trainer a preference run (whose eval keeps no logits)
    ("from trl import DPOTrainer\nd = DPOTrainer(model=model, args=args)\n"
     "Trainer(model=model, args=args, compute_metrics=cm).train()", True),
])
def test_only_the_trainer_that_trains_counts(tmp_path: Path, calls: str, keeps: bool) -> None:
    job = _hf_job(tmp_path, "--eval_strategy steps", _KW + calls + "\n")
    assert job.workload.eval_keeps_logits is keeps, job.notes
    assert not any("cannot be told" in n for n in job.notes), job.notes


def test_what_would_fit_leaves_the_evaluation_alone_where_training_peaks(tmp_path: Path) -> None:
    """Where the training step is the peak, no evaluation change is offered (it would lower nothing)."""
    from shardfit.foreign.asplanned import plan_job

    job = _hf_job(tmp_path, "--use_lora True --per_device_train_batch_size 16 --eval_strategy steps "
                            "--per_device_eval_batch_size 1 --max_eval_samples 2")
    fp = plan_job(job, resolve_shape(QWEN), parse_gpus("2xL4"))
    assert fp.configured.peak_phase != "eval" and not fp.configured.fits
    assert fp.would and not any("eval" in x for x in fp.would), fp.would
