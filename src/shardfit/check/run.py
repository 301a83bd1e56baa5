"""Run the preflight rules: on the weightless (meta) model for `shardfit check`, on the loaded one inside `train`.

Both build the model with `models.build.build_model` and run the same `preflight`, which fixes what it can (on a
meta model the fixes are only recorded), so `check` reports exactly the findings `train` applies.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from torch import nn

from shardfit import objective as objectives
from shardfit.check import rules
from shardfit.check.config_rules import (
    device_map_rules,
    elsewhere_rules,
    float8_rules,
    qlora_rules,
    refuse_missing_inputs,
)
from shardfit.check.findings import Finding
from shardfit.check.moe_rules import aux_loss_rules, quantized_expert_rules, router_lora_rules
from shardfit.check.pipeline_rules import pipeline_plan_rules
from shardfit.check.precision_rules import precision_rules
from shardfit.check.preference_rules import kto_balance_rules, preference_data_rules
from shardfit.check.prequantized_rules import prequantized_rules
from shardfit.check.vision_rules import vision_unit_rules
from shardfit.config import Config
from shardfit.config.load import NotHere
from shardfit.data.dataset import encode_all, encode_split, read_split, refuse_lost_rows
from shardfit.data.preference import read_preference_split
from shardfit.models.build import build_model, load_tokenizer
from shardfit.models.processor import load_vision_processor
from shardfit.models.source import absent_here as model_absent_here
from shardfit.models.source import resolve_model
from shardfit.parallel.job import resolve_here
from shardfit.parallel.launch import launch_threads
from shardfit.plan.hardware import Hardware
from shardfit.plan.plan import Plan
from shardfit.resolve import DeviceFacts, Resolved, resolve_job
from shardfit.resolve.decide import settled
from shardfit.resolve.pipeline import stages_of
from shardfit.resolve.resume import resumed_job
from shardfit.strategy import Strategy
from shardfit.strategy import get as get_strategy


def preflight(model: nn.Module, cfg: Config, s: Strategy, world: int, plan: Plan | None) -> list[Finding]:
    """Every rule that needs no placed model (config, unused modules, mixtures of experts, FSDP units, precision,
    checkpointing, the plan's verdict); each fixes what it can in place and says so."""
    out = device_map_rules(cfg, s, world) + qlora_rules(cfg, s)
    out += prequantized_rules(model, cfg) + rules.unused_module_rules(model, s, fix=True)
    out += vision_unit_rules(model, cfg, s, fix=True)
    out += router_lora_rules(model, cfg) + aux_loss_rules(model, cfg) + quantized_expert_rules(model, cfg)
    out += rules.fsdp_unit_rules(model, s, cfg.precision, fix=True)
    out += rules.qlora_shard_rules(model, s, world)
    out += rules.grad_ckpt_rules(model, cfg)
    out += rules.reentrant_ckpt_rules(model, s, fix=True)
    out += rules.precision_rules(model, cfg, fix=True)
    out += rules.visible_gpu_rules(s, world)
    # A pipeline's ranks hold a stage each: the verdict is the stages', not the strategy's over the whole model.
    out += rules.plan_rules(plan, s, cfg.force) if stages_of(cfg) == 1 else \
        pipeline_plan_rules(cfg, plan, s.name)
    return out


def created_off_meta_rules(model: nn.Module) -> list[Finding]:
    """On a meta-built model, anything that is NOT meta was created on a real device by the model's own code:
    exactly the buffers that ZeRO-3 would leave behind on the CPU (train moves them to the rank's device)."""
    real = [(n, t) for n, t in list(model.named_parameters()) + list(model.named_buffers()) if not t.is_meta]
    if not real:
        return []
    return [Finding("buffer_on_wrong_device", "error", real[0][0],
                    f"{len(real)} tensors are created on {real[0][1].device} by the model's code (e.g. {real[0][0]}), "
                    "outside the placement of weights: under ZeRO-3 they stay there",
                    "shardfit moves buffers to the rank's device before training", True)]


def validate_data(cfg: Config, whole: bool = True) -> None:
    """The data validation train runs before it loads the model: formats, and with a local tokenizer the chat
    template, truncation and max_bad_rows. A bad row is exit 2 here too. Not `whole` (a data file is not here):
    each row is encoded as train encodes it, but no rule over the whole set is judged (`part_of_data`)."""
    split = read_split(cfg)
    source = resolve_model(cfg.model)
    if source.is_local:
        tokenizer = load_tokenizer(source, cfg.trust_remote_code)
        vision = load_vision_processor(source, cfg, tokenizer)
        if whole:
            encode_split(cfg, tokenizer, split, vision)
            return
        for convs in (split.train, split.eval):
            encode_all(tokenizer, convs, cfg.max_seq_len, split.stats, cfg.skip_bad_rows, vision)
        refuse_lost_rows(split.stats, cfg.max_bad_rows)


def data_findings(cfg: Config, model_here: bool = True, whole: bool = True) -> list[Finding]:
    """The data as `train` reads it for the config's objective: SFT data validated (a bad row is exit 2), preference
    data with its findings (check/preference_rules.py). Without the model here (`model_here` False: a local path
    with nothing at it) the rows are read and checked without its tokenizer. `whole` False: a training data file is
    not here (`part_of_data`), so the rules over every training row (KTO's balance, that one row trains) are left
    out."""
    preference = objectives.get(cfg.objective).preference
    if preference:
        if model_here:
            return preference_data_rules(cfg, whole)
        split = read_preference_split(cfg)
        return kto_balance_rules(cfg, split) if whole else []
    if model_here:
        validate_data(cfg, whole)
    else:
        read_split(cfg)  # a bad row or file is exit 2 here as in train
    return []


# A max_bad_rows this large allows any number of lost rows: what a share of every row allows is not known from part.
_UNJUDGED = float(2**62)


def part_of_data(cfg: Config, absent: Sequence[NotHere]) -> Config | None:
    """`cfg` reading only the data files that are here, so those are read row by row as train reads them while the
    absent ones are warned about (`elsewhere_rules`); None when no data file is here. With a file absent, what
    train judges over every row is not judged on part of them (`whole_data_skipped`): no eval_split held-out rows
    drawn from part (every row is still read), and max_bad_rows only as a count, 0 included (rows lost here are lost on
    the whole), not as a share. With no `data` file here, a present `eval_data` is read in its place."""
    if not absent:
        return cfg
    gone = {(g.key, g.path) for g in absent}

    def here(key: str, value: str | list[str] | None) -> str | list[str] | None:
        if value is None or isinstance(value, str):
            return None if (key, value) in gone else value
        kept = [v for v in value if (key, v) not in gone]
        return kept or None

    data, evals = here("data", cfg.data), here("eval_data", cfg.eval_data)
    if data is None and evals is None:
        return None
    # 0 is a count too (no row may be lost): a row lost here is lost on the whole, whatever the rest holds
    limit = cfg.max_bad_rows if cfg.max_bad_rows >= 1 or cfg.max_bad_rows == 0 else _UNJUDGED
    return dataclasses.replace(cfg, data=data or evals, eval_data=evals if data else None, eval_split=0.0,
                               max_bad_rows=limit)


def whole_data_skipped(cfg: Config, absent: Sequence[NotHere]) -> list[str]:
    """The rules over every row of the data that check did not judge because a data file is not here (`skipped`
    of check --json), each only where the config uses it."""
    if not absent or part_of_data(cfg, absent) is None:  # nothing read: the not-here lines say so
        return []
    rules = []
    train_part = any(g.key == "data" for g in absent)
    if train_part and cfg.objective == "kto":
        rules.append("KTO's desirable and undesirable rows (both kinds must train)")
    if 0 < cfg.max_bad_rows < 1:
        rules.append(f"max_bad_rows as a share of the rows ({cfg.max_bad_rows:g})")
    if train_part and cfg.eval_split > 0 and not cfg.eval_data:
        rules.append("eval_split's held-out rows")
    if train_part:
        rules.append("that at least one row keeps an answer within max_seq_len")
    return [f"data: not judged on the files that are here, as a data file is not: {', '.join(rules)}"] if rules \
        else []


def check_config(cfg: Config, nproc: int | None = None, hw: Hardware | None = None, nodes: int = 1,
                 absent_data: Sequence[NotHere] = ()) -> tuple[Resolved, list[Finding]]:
    """Findings for a config as its job would run: on `hw` (planned GPUs, which compute in bf16) or on `nodes`
    nodes like this machine by default, resolved as `train` resolves it: `nproc` ranks a node when given (train's
    --nproc, torchrun's --nproc-per-node), and a run that resumes as resolve/resume.py `resumed_job` resolves it;
    returns (the resolved job, findings). A path with nothing at it here (a `resume:` checkpoint, the data files in
    `absent_data`, a local model) is a warning (config_rules.py `elsewhere_rules`), and what needs it is not run."""
    refuse_missing_inputs(cfg, elsewhere_ok=True)  # a checkpoint only the training machine sees: a warning
    if hw is None:
        threads = launch_threads(nproc, nodes)  # the ranks' threads, at which train measures a CPU's rates
        job, plan = resumed_job(cfg, lambda c: resolve_here(c, nproc=nproc, nnodes=nodes, threads=threads))
    else:  # every node like the one named
        node = dataclasses.replace(hw, nodes=1)
        job, plan = resumed_job(cfg, lambda c: resolve_job(c, node, DeviceFacts("cuda", True), nproc=nproc,
                                                           nnodes=hw.nodes))
    cfg = settled(cfg, job)
    s = get_strategy(job.strategy)
    elsewhere = elsewhere_rules(cfg, absent_data)
    model_here = not model_absent_here(cfg.model)
    present = part_of_data(cfg, absent_data)
    # every training row here (only eval_data absent): the rules over them hold; `present` drops a max_bad_rows share
    whole = not any(g.key == "data" for g in absent_data)
    data = [] if present is None else data_findings(present, model_here, whole)
    speed = precision_rules(cfg.precision, job.hardware, "config: precision",
                            lambda p: f"precision: {p} (auto picks the precision the device computes fast)")
    if not model_here:  # the rules that need no model, as train runs them before it loads one
        return job, elsewhere + data + device_map_rules(cfg, s, job.world) + qlora_rules(cfg, s) + speed + \
            float8_rules(cfg, job)
    model = build_model(cfg, s, weights=False)
    return job, elsewhere + data + preflight(model, cfg, s, job.world, plan) + created_off_meta_rules(model) + \
        speed + float8_rules(cfg, job)


def skipped_checks(findings: list[Finding], cfg: Config | None = None, absent: Sequence[NotHere] = ()) -> list[str]:
    """What check could not run because a path is not here (the `*_not_here` warnings; with `cfg`, the rules over
    every data row `whole_data_skipped` names), in words: `check --json`'s `skipped`, and its text's
    `not checked:` lines. Without the model no memory verdict exists, so none is given."""
    out = []
    for f in findings:
        key = f.where.removeprefix("config: ")
        if f.rule == "model_not_here":
            out.append("memory: not predicted, the model is not here (the strategy was resolved as for a model of "
                       "unknown shape, and the rules that read its modules did not run)")
        elif f.rule == "data_not_here":
            out.append(f"data: a '{key}' file is not here, so its rows were not read")
        elif f.rule == "resume_not_here":
            out.append("resume: the checkpoint is not here, so it was not checked")
    return out + (whole_data_skipped(cfg, absent) if cfg is not None else [])


def format_findings(job: Resolved, findings: list[Finding], cfg: Config | None = None,
                    absent: Sequence[NotHere] = ()) -> str:
    """The findings as the terminal shows them, after the job they are about and what could not be checked."""
    skipped = [f"not checked: {s}" for s in skipped_checks(findings, cfg, absent)]
    if not findings:
        return f"{job.describe()}\nok: no findings (strategy {job.strategy})"
    lines = [job.describe(), *skipped, f"strategy {job.strategy}: {len(findings)} finding(s)"]
    for f in findings:
        mark = "fixed" if f.auto_fixed else f.severity
        lines.append(f"  [{mark:>7}] {f.rule} at {f.where}\n            {f.message}\n            fix: {f.fix}")
    return "\n".join(lines)
