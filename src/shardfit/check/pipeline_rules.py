"""The plan's memory verdict on a pipeline (`pipeline_parallel: N`): each stage's peak under the cut and schedule the
job runs, on the stage's data-parallel ranks under the job's strategy (plan/pipeline.py), in place of a strategy's
verdict on the whole model, which no rank of a pipeline holds."""

from __future__ import annotations

from shardfit import strategy as strategies
from shardfit.check.findings import Finding
from shardfit.config import Config
from shardfit.errors import DoesNotFitError
from shardfit.plan.plan import Plan
from shardfit.resolve.fits import memory_verdict, refusal_line
from shardfit.resolve.pipeline import stages_of


def _fixes(cfg: Config, stages: int, world: int, offload: bool) -> str:
    """What lowers the fullest stage: for an offload strategy over lone stages (which runs as ddp, its stage held
    on its GPU), zero3 over fewer stages than ranks (a pipeline's stages are not offloaded) or no pipeline; else
    more stages; checkpointing and LoRA only where they are not on already."""
    if offload:
        fewer = stages // 2
        more = f"pipeline_parallel: 1 ({cfg.strategy} over every rank)"
        if fewer > 1:
            more = (f"strategy: zero3 with fewer stages than ranks, which shards each stage over its ranks (e.g. "
                    f"pipeline_parallel: {fewer} on {world} ranks), {more}")
    else:
        more = "more stages (pipeline_parallel and --nproc)"
    ckpt = ", grad_ckpt: full" if cfg.grad_ckpt != "full" else ""
    lora = ", or method: lora" if cfg.method != "lora" else ""
    return f"{more}{ckpt}, a smaller micro_batch or max_seq_len{lora} (see `shardfit plan`)"


def pipeline_plan_rules(cfg: Config, plan: Plan | None, strategy: str = "single") -> list[Finding]:
    """Predicted out-of-memory on a stage: an error (a warning with `force`), naming the stage and what lowers it.
    Nothing when the plan or the model's shape is unknown, or every stage fits."""
    pipe = memory_verdict(plan, strategy, cfg).pipe
    if pipe is None or pipe.fits:
        return []
    stages = stages_of(cfg)
    world = plan.hardware.world if plan is not None else stages
    full = max(range(len(pipe.stage_gibs)), key=lambda s: pipe.stage_gibs[s])
    named = strategies.BY_NAME.get(cfg.strategy)
    offload = named is not None and named.offload and stages == world
    looped = f" ({pipe.per_rank} stages per rank, {pipe.schedule})" if pipe.per_rank > 1 else ""
    where = f"stage {full}" if pipe.per_rank == 1 else "the first rank"
    why = (f"strategy: {cfg.strategy} over one rank per stage runs each stage as ddp: this version does not offload "
           "a pipeline stage to host memory, so the stage is held on its GPU. ") if offload else ""
    return [Finding("predicted_oom", "warning" if cfg.force else "error", f"pipeline_parallel: {stages}",
                    f"{why}{pipe.layout}{looped}: predicted {pipe.stage_gib:.1f} GiB on {where} "
                    f"({pipe.cut[full]} blocks) of {pipe.card_gib:.0f} per GPU, with the blocks cut {list(pipe.cut)}"
                    + (" to even the stages' memory" if pipe.per_rank == 1 else " per rank, evenly over its stages"),
                    _fixes(cfg, stages, world, offload))]


def refuse_stage_oom(findings: list[Finding]) -> None:
    """Exit 3 (DoesNotFitError), as for a strategy predicted not to fit (resolve/fits.py `refuse_if_oom`), when
    `pipeline_plan_rules` predicts out-of-memory on a stage (an error: not forced)."""
    bad = [f for f in findings if f.severity == "error" and not f.auto_fixed]
    if bad:
        raise DoesNotFitError("\n".join(refusal_line(f.where, f.message, f.fix) for f in bad))
