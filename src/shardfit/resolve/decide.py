"""The decisions of one job, each made here once: precision, compile and attention, the strategy and the number
of processes, the row shape and the loss chunk. Torch-free: the facts of the device come in as `DeviceFacts`."""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable
from typing import TypeVar

from shardfit import method as methods
from shardfit import objective as objectives
from shardfit import strategy as strategies
from shardfit.config import Config
from shardfit.config.support import adapter_dtype_problem, require_method_support
from shardfit.errors import DoesNotFitError, UserError
from shardfit.plan.choose import plan_for_config
from shardfit.plan.estimate import Candidate, loss_chunk_for
from shardfit.plan.hardware import Hardware
from shardfit.plan.pipeline import config_cut, fastest, layouts
from shardfit.plan.plan import TIE, Alternative, Plan, recommend
from shardfit.plan.precision import runs_autocast
from shardfit.plan.render import format_table
from shardfit.plan.shapes import ModelShape, resolve_shape
from shardfit.plan.workload import workload_of
from shardfit.resolve import pipeline as pipelines
from shardfit.resolve.defaults import (
    compiled_for,
    eager_attention_max_width,
    resolve_attention,
    resolve_experts,
    resolve_static_shape,
    row_width_multiple,
)
from shardfit.resolve.experts_rules import check_ep_layout, check_ep_model
from shardfit.resolve.job import DeviceFacts, Resolved, RowShape
from shardfit.resolve.pipeline_choice import PipelineChoice, choose_pipeline
from shardfit.resolve.sequence import check_layout, check_model, facts_of_shape


def precision_for(value: str, device: DeviceFacts) -> str:
    """The compute precision `auto` stands for: bf16 where it is fast (GPUs that have it, CPUs with bf16 units),
    else fp16 on a GPU and fp32 on a CPU. Any other value is kept."""
    if value != "auto":
        return value
    if device.bf16_fast:
        return "bf16"
    return "fp16" if device.type == "cuda" else "fp32"


def adapter_dtype_for(cfg: Config, precision: str, s: strategies.Strategy) -> tuple[str, str | None]:
    """The dtype the adapters are stored and computed in (`lora.dtype` as the job runs it), and why when that is
    not what the config asked. bf16 adapters take the place of autocast, so they exist only where autocast would
    run: FSDP2's strategies already compute every parameter in bf16 from fp32 shards (MixedPrecisionPolicy), so
    there the adapters stay fp32. A combination that cannot train (see `adapter_dtype_problem`) is a UserError."""
    problem = adapter_dtype_problem(cfg, precision)
    if problem:
        raise UserError(f"'lora.dtype' {problem}")
    if cfg.lora.dtype == "bf16" and not s.autocast:
        return "fp32", (f"lora.dtype bf16 -> fp32 under {s.name}: FSDP2 already computes the adapters in bf16 from "
                        "fp32 shards, with no autocast")
    return cfg.lora.dtype, None


def job_hardware_of(node: Hardware, strategy: str | None, nproc: int, nnodes: int) -> Hardware:
    """The hardware a job of `nproc` processes per node runs on, from what one node has (`node`): model_parallel
    is one process over every local GPU, other strategies use a GPU per process; on a CPU the processes share the
    host's memory."""
    if node.name == "cpu":
        world = nproc * nnodes
        mem = node.cpu_mem_gib or node.gpu_mem_gib
        return dataclasses.replace(node, nodes=1, gpus_per_node=world, gpu_mem_gib=mem / world, cpu_mem_gib=mem)
    per_node = node.gpus_per_node if strategy == "model_parallel" else nproc
    return dataclasses.replace(node, nodes=nnodes, gpus_per_node=per_node)


def _explicit(name: str, nproc: int | None, nnodes: int, local: int) -> tuple[str, int, list[str]]:
    """A strategy the config names: its processes per node (given, or one per local GPU for a multi-rank one)."""
    s = strategies.get(name)
    n = nproc if nproc is not None else (local if s.multi_rank else 1)
    if s.engine == "device_map" and n * nnodes > 1:
        given = " and ".join(f for f, on in ((f"--nproc {nproc}", nproc not in (None, 1)),
                                              (f"--nnodes {nnodes}", nnodes > 1)) if on)
        raise UserError(f"strategy: {name} splits one process's model over its local GPUs and cannot run on "
                        f"{n * nnodes} ranks. Drop {given} to run it in one process, or use --set strategy=zero3.")
    if s.multi_rank and n * nnodes == 1:
        hint = "--nproc N" if local <= 1 else f"drop --nproc 1 (this machine has {local} GPUs)"
        return "single", 1, [f"strategy {name} needs several ranks; one process runs it as single ({hint})"]
    return name, n, []


def _allowed(name: str, method: str, nproc: int | None, nnodes: int, local: int) -> bool:
    """Whether `auto` may pick `name` for `method`: a multi-rank strategy where there are several ranks; single or
    (over several local GPUs) model_parallel where one process per node is given or left to choose, on one node."""
    world = (nproc if nproc is not None else local) * nnodes
    if not methods.get(method).allows(strategies.get(name).engine):
        return False
    if strategies.get(name).multi_rank:
        return world > 1
    one_process = nnodes == 1 and nproc in (None, 1)
    return one_process and (name == "single" or (name == "model_parallel" and local > 1))


def _auto(plan: Plan | None, method: str, nproc: int | None, nnodes: int, local: int,
          force: bool, split: bool = False) -> tuple[str, int, list[str]]:
    """`strategy: auto`: with the processes given, the fastest strategy that fits on that many; without, the
    fastest over every local GPU, which also decides the processes (one for single and model_parallel)."""
    world = (nproc if nproc is not None else local) * nnodes
    if plan is None:
        name = "single" if world == 1 else "zero3"  # shape unknown: sharding is the choice that fits most
        return name, 1 if name == "single" else world // nnodes, [f"strategy auto -> {name}: the model's shape is "
                                                                  "unknown to the planner"]
    allowed = _fitting(plan, method, nproc, nnodes, local, split)
    best, reason = recommend(allowed, plan.hardware) if allowed else (None, "")
    if best is None:
        if not force and world > 1:  # one process: `single`, which the plan's verdict then refuses or forces
            raise DoesNotFitError("no strategy fits this hardware.\n" + format_table(plan, style="config"))
        best, reason = ("single" if world == 1 else "zero3"), "nothing is predicted to fit"
    n = world // nnodes if strategies.get(best).multi_rank else 1
    return best, n, [f"strategy auto -> {best} on {n} process{'es' if n > 1 else ''} per node: {reason}"]


def _auto_pipeline(cfg: Config, plan: Plan, world: int, nnodes: int) -> tuple[str, int, list[str]]:
    """`strategy: auto` for a pipeline with more ranks than stages: of the strategies a stage's data-parallel ranks
    run (resolve/pipeline.py), the fastest whose stages fit (plan/pipeline.py `fastest`), zero3 where none does
    (the plan's verdict on the stages, check/pipeline_rules.py, then refuses it or forces it)."""
    with contextlib.suppress(UserError):  # a shape the planner cannot read: sharding fits the most
        shape = resolve_shape(cfg.model)
        pipes = layouts(shape, plan.workload, plan.hardware, pipelines.stages_of(cfg), pipelines.PP_DP_STRATEGIES)
        pick = fastest(pipes)
        if pick is not None:
            return pick.strategy, world // nnodes, [
                f"strategy auto -> {pick.strategy} over each stage's {pick.dp} ranks: the fastest layout whose "
                f"stages fit ({pick.layout}: {pick.stage_gib:.1f} of {pick.card_gib:.0f} GiB on the fullest stage, "
                f"{pick.tokens_per_s:,.0f} tokens/s; "
                + "; ".join(f"{p.strategy} {p.stage_gib:.1f} GiB {p.tokens_per_s:,.0f} tokens/s" for p in pipes
                            if p is not pick) + ")"]
    return "zero3", world // nnodes, ["strategy auto -> zero3 over each stage's ranks: no layout's stages are "
                                      "predicted to fit, and zero3 shards the most"]


# How the note of a pipeline of one rank per stage begins, under `strategy: auto` or a sharded strategy named:
# `plan CONFIG` prints the notes that begin so under the job's line.
LONE_WHY = "one rank per pipeline stage"


def _lone_stages(cfg: Config, plan: Plan | None, stages: int, nnodes: int) -> tuple[str, int, list[str]]:
    """`strategy: auto`, or a sharded strategy the config names (zero2, zero3, zero3_offload), over a pipeline of
    one rank per stage: no strategy wraps a lone stage (sharding over one rank splits nothing, and FSDP2's mixed
    precision is not applied to an unwrapped stage), so each stage runs as ddp, the stage itself under the job's
    autocast, which is also what the plan plans for it. An offload strategy keeps the stage on its GPU (not
    offloaded through the pipeline's schedule): the note says so with the plan's verdict on the stages, which the
    stages' check (check/pipeline_rules.py) then refuses with exit 3 or forces."""
    name = cfg.strategy
    note = (f"{LONE_WHY}: strategy {name} -> ddp: a stage of one rank has nothing to shard or replicate, so each "
            "stage runs as ddp (the stage itself, under the job's autocast as in one process, as the plan plans the "
            "stages)")
    if name != "auto" and strategies.get(name).offload:
        pipe = pipelines.job_stages(cfg, plan, "ddp")
        if pipe is None:  # the rank checks the built model's blocks
            note += ("; not offloaded to host memory, and the planner cannot read the model's shape to say whether "
                     "its stages fit on their GPUs")
        else:
            verdict = "predicted to fit" if pipe.fits else "predicted NOT to fit" + (
                ", started anyway (force: true)" if cfg.force else "")
            note += (f"; not offloaded to host memory (the fullest stage held on its GPU: {pipe.stage_gib:.1f} of "
                     f"{pipe.card_gib:.0f} GiB, {verdict})")
    return "ddp", stages // nnodes, [note]


# How the reason of auto's pipeline begins (`plan --config` prints it under the job's line).
PIPE_WHY = "pipeline_parallel auto"


def _auto_pipeline_parallel(cfg: Config, device: DeviceFacts, survey: Plan | None, nproc: int | None, nnodes: int,
                            local: int) -> tuple[int, str | None]:
    """`pipeline_parallel: auto` under `strategy: auto` (`cfg` with it read as 1): the stages of the pipeline
    resolve/pipeline_choice.py recommends (the decision `shardfit plan` shows: the fastest layout that fits, that
    train runs, and that trains more tokens/s than the job auto would otherwise run, beyond the time model's
    precision, or where nothing else fits), with the reason; (1, None) where it recommends none, the rows are
    split, or there is one rank. What auto would otherwise run: the strategy `recommend` picks of those auto may
    run on these ranks (`_fitting`), or, where none fits whole, of those that fit with the rows split as
    `_auto_sequence_parallel` splits them. Its 1F1B runs the step's grad_accum micro-batches; the strategy over
    each stage's ranks is then decided as for a pipeline the config names (`resolve`). The layouts are timed as
    stages run (never compiled: resolve/defaults.py), the strategies as they would run."""
    world = (nproc if nproc is not None else local) * nnodes
    if cfg.strategy != "auto" or cfg.sequence_parallel != 1 or survey is None or world < 2:
        return 1, None
    shape = resolve_shape(cfg.model)  # the survey read it: known here
    rivals, split = auto_rivals(cfg, device, survey, nproc, nnodes, local)
    rules = dataclasses.replace(cfg, pipeline_schedule="1f1b")
    staged = workload_of(_planned(dataclasses.replace(rules, pipeline_parallel=2), device))  # any count alike
    choice = choose_pipeline(survey, shape, staged, survey.hardware, cfg.model, rules, rivals=rivals, split=split)
    if choice is None or not choice.recommended:
        return 1, None
    return choice.pick.stages, _pipeline_why(choice, survey)


def auto_rivals(cfg: Config, device: DeviceFacts, survey: Plan, nproc: int | None, nnodes: int,
                local: int) -> tuple[list[Candidate], int]:
    """What `strategy: auto` would run without a pipeline, which a pipeline is weighed against (and `plan` shows
    it weighed against): the candidates of `survey` auto may pick on these ranks, or, where auto would split the
    rows instead (`_auto_sequence_parallel`), those that fit split; with the split's ranks (1: rows whole)."""
    sp, split_plan, _ = _auto_sequence_parallel(cfg, device, survey.hardware, survey, nproc, nnodes, local)
    if sp > 1 and split_plan is not None:
        return _fitting(split_plan, cfg.method, nproc, nnodes, local, split=True), sp
    return _fitting(survey, cfg.method, nproc, nnodes, local), 1


def _pipeline_why(choice: PipelineChoice, plan: Plan) -> str:
    """The reason auto turned the pipeline of `choice` on, in the plan's numbers, naming what auto would
    otherwise have run."""
    pick = choice.pick
    than = f"more than {choice.against}, the fastest job auto runs otherwise" if choice.against \
        else "and nothing else auto could run fits"
    where = f"{pick.strategy} over each stage's {pick.dp} GPUs" if pick.dp > 1 else "one GPU per stage"
    return (f"{PIPE_WHY} -> {pick.stages}: the plan recommends {pick.layout} ({where}, 1F1B over the step's "
            f"{pick.micro_batches} grad_accum micro-batches, fullest stage {pick.stage_gib:.1f} of "
            f"{pick.card_gib:.0f} GiB): ~{pick.step_s:.0f} s/step, {pick.tokens_per_s:,.0f} tokens/s, {than}; an "
            f"optimizer step then takes micro_batch x grad_accum x {pick.dp} examples, not x {plan.hardware.world} "
            "as under a strategy over every rank (set pipeline_parallel: 1 or a strategy to choose otherwise)")


T = TypeVar("T")

# How the reason of auto's split begins (`plan --config` prints it under the job's line).
SPLIT_WHY = "sequence_parallel auto"


def _fitting(plan: Plan, method: str, nproc: int | None, nnodes: int, local: int,
             split: bool = False) -> list[Candidate]:
    """The candidates of `plan` that fit and that `strategy: auto` may pick (`_allowed`); multi-rank ones only for
    rows split over ranks (`split`)."""
    return [c for c in plan.candidates if c.fits and c.applies and _allowed(c.strategy, method, nproc, nnodes, local)
            and (strategies.get(c.strategy).multi_rank or not split)]


def _one_process_best(plan: Plan, method: str, nproc: int | None, nnodes: int, local: int) -> Candidate | None:
    """With the processes left to auto on one node of several GPUs: the fastest strategy of one process (single,
    model_parallel) that fits where no strategy over every GPU does, which splitting the rows over the GPUs may
    beat; None otherwise (the processes given, a multi-rank strategy fits, or nothing fits)."""
    if nproc is not None or nnodes > 1 or local < 2:
        return None
    fits = _fitting(plan, method, nproc, nnodes, local)
    if not fits or any(strategies.get(c.strategy).multi_rank for c in fits):
        return None
    best, _ = recommend(fits, plan.hardware)
    return next((c for c in fits if c.strategy == best), None)


def _split_allowed(cfg: Config, n: int, world: int, shape: ModelShape) -> bool:
    """Whether sequence_parallel `n` passes the rules (resolve/sequence.py) for this config, model and world."""
    try:
        check_layout(dataclasses.replace(cfg, sequence_parallel=n), "zero3", world)
        check_model(n, facts_of_shape(shape), cfg.model)
    except UserError:
        return False
    return True


def _auto_sequence_parallel(cfg: Config, device: DeviceFacts, hw: Hardware, survey: Plan | None,
                            nproc: int | None, nnodes: int, local: int) -> tuple[int, Plan | None, str | None]:
    """`strategy: auto` with rows left whole (sequence_parallel 1): when one sequence does not fit on a GPU under
    any strategy auto may pick (nothing fits even at micro-batch 1, so a smaller batch cannot help), the smallest
    sequence_parallel of 2, 4, 8, ... that divides the ranks and the heads, passes the rules and makes the job
    fit; its plan and the reason. With the processes left to auto on one node, a row that fits only one process
    (`_one_process_best`: model_parallel), at the config's micro-batch or, where nothing fits that whole, at
    micro-batch 1, is split too where that trains faster beyond the time model's precision (TIE), so that the job
    is the one `--nproc` with every GPU runs. Where it is not faster the rows stay whole; where that one process
    fits only micro-batch 1, nothing fits as configured then (exit 3, the plan's adjusted recommendation says the
    smaller micro-batch). (1, survey, None) where the rows stay whole."""
    world = (nproc if nproc is not None else local) * nnodes
    if cfg.strategy != "auto" or cfg.sequence_parallel != 1 or pipelines.stages_of(cfg) != 1 or survey is None \
            or world < 2:
        return 1, survey, None
    # With the processes left to auto on several GPUs, one process (model_parallel) fitting a whole row does not
    # settle it: every GPU's rank splitting the rows may train faster, and is then what auto runs.
    lone = _one_process_best(survey, cfg.method, nproc, nnodes, local)
    if lone is None and _fitting(survey, cfg.method, nproc, nnodes, local):
        return 1, survey, None
    one_row = plan_for_config(_planned(dataclasses.replace(cfg, micro_batch=1), device), hw) \
        if cfg.micro_batch > 1 else survey
    if one_row is None:
        return 1, survey, None
    lone_row = lone if one_row is survey else _one_process_best(one_row, cfg.method, nproc, nnodes, local)
    if lone_row is None and _fitting(one_row, cfg.method, nproc, nnodes, local):
        return 1, survey, None
    # Nothing fits the config's micro-batch whole, but one process does at micro-batch 1 (the plan's adjusted
    # recommendation): the split is weighed against that as against `lone`, and where it is no faster, the
    # smaller micro-batch stays the fix (nothing fits: exit 3, with it).
    smaller = lone is None and one_row is not survey
    if smaller:
        lone = lone_row
    shape = resolve_shape(cfg.model)  # the survey read it: known here

    def fitting(n: int) -> tuple[Plan, Candidate] | None:
        plan = plan_for_config(_planned(dataclasses.replace(cfg, sequence_parallel=n), device), hw)
        fits = _fitting(plan, cfg.method, nproc, nnodes, local, split=True) if plan is not None else []
        best, _ = recommend(fits, hw)
        return (plan, next(c for c in fits if c.strategy == best)) if plan is not None and best else None

    found = smallest_split(world, lambda n: _split_allowed(cfg, n, world, shape), fitting)
    if found is None:
        _note_split_elsewhere(cfg, device, hw, survey, nproc, nnodes, local, shape)
        return 1, survey, None
    n, (plan, pick) = found
    if lone is not None:
        if not (pick.tokens_per_s and lone.tokens_per_s and pick.tokens_per_s > lone.tokens_per_s * (1 + TIE)):
            return 1, survey, None  # one process is as fast (or the time model cannot say): rows stay whole
        at = (" at micro-batch 1", f"; micro_batch {cfg.micro_batch} fits no strategy with whole rows") \
            if smaller else ("", "")
        return n, plan, (f"{SPLIT_WHY} -> {n}: one {cfg.max_seq_len:,}-token row fits a GPU only under "
                         f"{lone.strategy} in one process{at[0]} ({lone.tokens_per_s:,.0f} tokens/s{at[1]}); split "
                         f"over {n} of the {world} ranks it takes {pick.per_gpu_gib.total:.1f} GiB under "
                         f"{pick.strategy}, {pick.tokens_per_s:,.0f} tokens/s; an optimizer step then takes "
                         f"micro_batch x grad_accum x {world // n} examples (set sequence_parallel or a strategy to "
                         "choose otherwise)")
    whole = min(c.per_gpu_gib.total for c in survey.candidates if c.applies)
    return n, plan, (f"{SPLIT_WHY} -> {n}: one {cfg.max_seq_len:,}-token row does not fit on a GPU under any "
                     f"strategy (at least {whole:.1f} of {hw.gpu_mem_gib:.0f} GiB), split over {n} ranks it takes "
                     f"{pick.per_gpu_gib.total:.1f} GiB under {pick.strategy}; an optimizer step then takes "
                     f"micro_batch x grad_accum x {world // n} examples (set sequence_parallel or a strategy to "
                     "choose otherwise)")


def _note_split_elsewhere(cfg: Config, device: DeviceFacts, hw: Hardware, survey: Plan, nproc: int | None,
                          nnodes: int, local: int, shape: ModelShape) -> None:
    """Where no split of these ranks fits, one that fits may still exist that does not divide them (16 of 24 ranks
    on 3 nodes of 8): the refusal's alternatives then name the node count it can be laid out on, fewer nodes first,
    instead of "none found"."""
    if survey.alternatives is None:
        return
    world = (nproc if nproc is not None else local) * nnodes
    for k in [*range(nnodes - 1, 0, -1), *range(nnodes + 1, 2 * nnodes + 1)]:
        on, ranks = dataclasses.replace(hw, nodes=k), (nproc if nproc is not None else local) * k

        def fitting(n: int, on: Hardware = on, k: int = k) -> Candidate | None:
            plan = plan_for_config(_planned(dataclasses.replace(cfg, sequence_parallel=n), device), on)
            fits = _fitting(plan, cfg.method, nproc, k, local, split=True) if plan is not None else []
            best, _ = recommend(fits, on)
            return next(c for c in fits if c.strategy == best) if best else None

        found = smallest_split(ranks, lambda n, r=ranks: world % n != 0 and _split_allowed(cfg, n, r, shape),
                               fitting)
        if found is not None:
            n, pick = found
            alt = Alternative(f"every row split over {n} GPUs, on {k} node(s) ({n} does not divide the {world} ranks "
                              f"of {nnodes} nodes: a split must divide the ranks and the heads)",
                              (("sequence_parallel", n),), k, pick.strategy, pick.per_gpu_gib.total, hw.unit)
            if alt not in survey.alternatives:  # the same survey may be resolved twice
                survey.alternatives.insert(0, alt)
            return


def smallest_split(world: int, allowed: Callable[[int], bool],
                   fits: Callable[[int], T | None]) -> tuple[int, T] | None:
    """The smallest sequence_parallel of 2, 4, 8, ... up to `world` that divides it, that `allowed` passes (the
    split's rules) and under which `fits` finds something that fits (its answer with it); None if none does. The
    one rule by which auto (and the plan's suggestion) pick N: the smallest split costs the fewest all-to-alls
    and keeps the most data groups."""
    n = 2
    while n <= world:
        if world % n == 0 and allowed(n):
            found = fits(n)
            if found is not None:
                return n, found
        n *= 2
    return None


def resolve(cfg: Config, node: Hardware, device: DeviceFacts, plan: Plan | None, *, nproc: int | None = None,
            nnodes: int = 1) -> Resolved:
    """The job `cfg` describes on `nnodes` nodes like `node`, with `nproc` processes per node when the user gave
    them; `plan` is the plan over every local GPU (strategy `auto` reads its recommendation)."""
    local = node.gpus_per_node if device.type == "cuda" else 1
    world = (nproc if nproc is not None else local) * nnodes
    pp = pipelines.stages_of(cfg)  # `auto` not resolved yet (resolve_job resolves it): no pipeline
    if 1 < pp == world and (cfg.strategy == "auto" or strategies.get(cfg.strategy).sharded):
        name, n, why = _lone_stages(cfg, plan, world, nnodes)
    elif cfg.strategy == "auto" and 1 < pp < world and plan is not None:
        name, n, why = _auto_pipeline(cfg, plan, world, nnodes)
    elif cfg.strategy == "auto":
        # A pipeline's memory is its stages' (check/pipeline_rules.py), not a strategy's over the whole model.
        name, n, why = _auto(plan, cfg.method, nproc, nnodes, local, cfg.force or pp > 1,
                             cfg.sequence_parallel > 1)
    else:
        name, n, why = _explicit(cfg.strategy, nproc, nnodes, local)
    s = strategies.get(name)
    check_layout(cfg, name, n * nnodes)
    check_ep_layout(cfg, name, n * nnodes)
    pipelines.check_layout(cfg, n * nnodes, name)
    precision = precision_for(cfg.precision, device)
    compiled = compiled_for(cfg, device.type)
    # A pipeline's stages infer the activations' shape once (torch.distributed.pipelining): every micro-batch is
    # as wide as max_seq_len and micro_batch rows high, as for compiled blocks.
    fixed = compiled or pp > 1
    attention = resolve_attention(cfg.attn_implementation, device.type, cfg.packing, cfg.max_seq_len, compiled)
    hw = job_hardware_of(node, name, n, nnodes)
    # Compiled blocks want one static shape: rows as wide as max_seq_len, as many as a micro-batch's sequences (a
    # preference pair is two).
    height = cfg.micro_batch * objectives.get(cfg.objective).sequences
    rows = RowShape(limit=cfg.max_seq_len, micro_batch=cfg.micro_batch,
                    width=cfg.max_seq_len if fixed else None, height=height if fixed else None,
                    multiple=row_width_multiple(device.type, precision, compiled))
    vocab = plan.model.vocab if plan is not None else None
    if cfg.precision == "auto":
        why.append(f"precision auto -> {precision} on {device.type}")
    adapters, adapters_why = adapter_dtype_for(cfg, precision, s)
    if adapters_why:
        why.append(adapters_why)
    return Resolved(
        strategy=name, method=methods.get(cfg.method).name, nproc_per_node=n, nnodes=nnodes, device=device.type,
        precision=precision, adapter_dtype=adapters,
        # the planner's rule (plan/precision.py `runs_autocast`): bf16 adapters compute with the bf16 base as they
        # are, and FSDP2 casts the parameters itself
        autocast=precision if runs_autocast(
            dataclasses.replace(workload_of(cfg), precision=precision, adapters_16bit=adapters == "bf16"), name)
        else None,
        compile=compiled, attention=attention,
        # Sequence parallelism runs its own kernel at every width (parallel/ulysses.py).
        eager_max_width=eager_attention_max_width(attention, device.type, compiled, precision)
        if cfg.sequence_parallel == 1 and pp == 1 else 0, rows=rows,
        loss_chunk=loss_chunk_for(cfg.loss_chunk, vocab, hw, precision) if vocab else None, hardware=hw,
        why=tuple(why), objective=objectives.get(cfg.objective).name,
        reference=objectives.reference_of(cfg.objective, methods.get(cfg.method).adapters,
                                          cfg.dpo.precompute_reference),
        experts=resolve_experts(device.type), sequence_parallel=cfg.sequence_parallel,
        static_shape=resolve_static_shape(cfg.static_shape, device.type, cfg.packing, attention,
                                          objectives.get(cfg.objective).preference, cfg.sequence_parallel),
        expert_parallel=cfg.expert_parallel, pipeline_parallel=pp,
        pipeline_schedule=cfg.pipeline_schedule)


def _planned(cfg: Config, device: DeviceFacts) -> Config:
    """The settings as they will run, which the plan reads (what a rank plans again from the resolved job)."""
    precision = precision_for(cfg.precision, device)
    compiled = compiled_for(cfg, device.type)
    attention = resolve_attention(cfg.attn_implementation, device.type, cfg.packing, cfg.max_seq_len, compiled)
    return dataclasses.replace(cfg, precision=precision, compile=compiled, attn_implementation=attention,
                               static_shape=resolve_static_shape(
                                   cfg.static_shape, device.type, cfg.packing, attention,
                                   objectives.get(cfg.objective).preference, cfg.sequence_parallel))


def settled(cfg: Config, job: Resolved) -> Config:
    """`cfg` with what the job resolved in place of `auto`: what config.yaml records and the run's fingerprint
    reads."""
    return dataclasses.replace(cfg, precision=job.precision, compile=job.compile, attn_implementation=job.attention,
                               sequence_parallel=job.sequence_parallel, static_shape=job.static_shape,
                               pipeline_parallel=job.pipeline_parallel, pipeline_schedule=job.pipeline_schedule,
                               lora=dataclasses.replace(cfg.lora, dtype=job.adapter_dtype))


def require_ranks_fit_node(node: Hardware, device: DeviceFacts, nproc: int | None) -> None:
    """A UserError where `nproc` ranks a node are more than the node's GPUs: torchrun starts them, but each rank
    takes the GPU of its local rank (parallel/env.py `init_distributed`), and the ranks past the last GPU have
    none. On a CPU the ranks share the host, which runs any number of them."""
    n = node.gpus_per_node
    if device.type != "cuda" or nproc is None or nproc <= n:
        return
    raise UserError(f"--nproc {nproc}: {nproc} ranks a node, more than the node's {n} GPU{'s' * (n > 1)} "
                    f"({node.name}); each rank runs on the GPU of its local rank, so ranks {n} to {nproc - 1} would "
                    f"have none. --nproc counts the ranks of one node (torchrun's --nproc-per-node): launch at most "
                    f"{n} a node, and more nodes for more ranks.")


def resolve_job(cfg: Config, node: Hardware, device: DeviceFacts, *, nproc: int | None = None,
                nnodes: int = 1) -> tuple[Resolved, Plan | None]:
    """Resolve `cfg` on `nnodes` nodes like `node` and plan the job as resolved: the one entry point train, check
    and plan call. The method must be trainable by this installation; a node runs no more ranks than its GPUs."""
    require_method_support(cfg)
    require_ranks_fit_node(node, device, nproc)
    # `pipeline_parallel: auto` is read as no pipeline until the plan over every rank recommends one (below).
    pipe_auto = cfg.pipeline_parallel == "auto"
    if pipe_auto:
        cfg = dataclasses.replace(cfg, pipeline_parallel=1)
    if cfg.sequence_parallel > 1:  # the model's heads and kind, from its config, before anything loads
        shape = None
        with contextlib.suppress(UserError):  # a shape the planner cannot read: the rank checks the built model
            shape = resolve_shape(cfg.model)
        if shape is not None:
            check_model(cfg.sequence_parallel, facts_of_shape(shape), cfg.model)
    if cfg.expert_parallel > 1 or pipelines.stages_of(cfg) > 1:  # the model's kind, from its config, before loading
        shape = None
        with contextlib.suppress(UserError):  # a shape the planner cannot read: the rank checks the built model
            shape = resolve_shape(cfg.model)
        if shape is not None and cfg.expert_parallel > 1:
            check_ep_model(cfg.expert_parallel, shape.experts, cfg.model, every_expert=shape.every_expert,
                           multimodal=shape.multimodal)
        if shape is not None and pipelines.stages_of(cfg) > 1:
            pipelines.check_model(pipelines.stages_of(cfg), pipelines.facts_of_shape(shape), cfg.model, cfg.method,
                                  per_rank=pipelines.stages_per_rank(cfg))
    planned = _planned(cfg, device)
    local = node.gpus_per_node if device.type == "cuda" else 1
    survey_hw = job_hardware_of(node, None, nproc or local, nnodes)
    survey = plan_for_config(planned, survey_hw)
    pp, pipe_why = _auto_pipeline_parallel(cfg, device, survey, nproc, nnodes, local) if pipe_auto else (1, None)
    if pp > 1:  # the job as it will run, planned as if its keys were set (`settled` records them in the config)
        cfg = dataclasses.replace(cfg, pipeline_parallel=pp, pipeline_schedule="1f1b")
        planned = _planned(cfg, device)
        survey = plan_for_config(planned, survey_hw)
    sp, survey, split_why = _auto_sequence_parallel(cfg, device, survey_hw, survey, nproc, nnodes, local)
    if sp > 1:  # the job as it will run: its rows split over sp ranks (`settled` records it in the config)
        cfg = dataclasses.replace(cfg, sequence_parallel=sp)
        planned = _planned(cfg, device)
    job = resolve(cfg, node, device, survey, nproc=nproc, nnodes=nnodes)
    first = tuple(w for w in (pipe_why, split_why) if w is not None)
    if first:
        job = dataclasses.replace(job, why=(*first, *job.why))
    plan = plan_for_config(planned, job.hardware) if job.hardware != (survey.hardware if survey else None) \
        else survey
    if job.pipeline_parallel > 1:  # where the stages are cut, decided with the plan's memory model
        job = dataclasses.replace(job, stage_layers=config_cut(planned, job.hardware, job.pipeline_parallel,
                                                                 job.strategy))
    if plan is not None and job.loss_chunk is None:
        job = dataclasses.replace(job, loss_chunk=loss_chunk_for(cfg.loss_chunk, plan.model.vocab, job.hardware,
                                                                 job.precision))
    return job, plan
