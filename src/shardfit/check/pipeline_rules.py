"""The plan's memory verdict on a pipeline (`pipeline_parallel: N`): each stage's peak under the cut the job runs,
on the stage's data-parallel ranks under the job's strategy (plan/pipeline.py), in place of a strategy's verdict on
the whole model, which no rank of a pipeline holds."""

from __future__ import annotations

from shardfit.check.findings import Finding
from shardfit.config import Config
from shardfit.errors import DoesNotFitError, UserError
from shardfit.plan.pipeline import plan_pipeline
from shardfit.plan.plan import Plan
from shardfit.plan.shapes import resolve_shape
from shardfit.resolve.pipeline import stages_of


def pipeline_plan_rules(cfg: Config, plan: Plan | None, strategy: str = "single") -> list[Finding]:
    """Predicted out-of-memory on a stage: an error (a warning with `force`), naming the stage and what lowers it.
    Nothing when the plan or the model's shape is unknown, or every stage fits."""
    stages = stages_of(cfg)
    if plan is None or stages == 1:
        return []
    try:
        shape = resolve_shape(cfg.model)
    except UserError:
        return []
    if shape.layers < stages:  # the pipeline's rules refuse it, naming the blocks
        return []
    dp = max(1, plan.hardware.world // stages)
    pipe = plan_pipeline(shape, plan.workload, plan.hardware, stages, dp=dp, strategy=strategy)
    if pipe.fits:
        return []
    full = max(range(stages), key=lambda s: pipe.stage_gibs[s])
    return [Finding("predicted_oom", "warning" if cfg.force else "error", f"pipeline_parallel: {stages}",
                    f"{pipe.layout}: predicted {pipe.stage_gib:.1f} GiB on stage {full} ({pipe.cut[full]} blocks) of "
                    f"{pipe.card_gib:.0f} per GPU, with the blocks cut {list(pipe.cut)} to even the stages' memory",
                    "more stages (pipeline_parallel and --nproc), grad_ckpt: full, a smaller micro_batch or "
                    "max_seq_len, or method: lora (see `shardfit plan`)")]


def refuse_stage_oom(findings: list[Finding]) -> None:
    """Exit 3 (DoesNotFitError), as for a strategy predicted not to fit (plan/choose.py `refuse_if_oom`), when
    `pipeline_plan_rules` predicts out-of-memory on a stage (an error: not forced)."""
    bad = [f for f in findings if f.severity == "error" and not f.auto_fixed]
    if bad:
        raise DoesNotFitError("\n".join(f"{f.where}: {f.message} (fix: {f.fix}; or set force: true to start "
                                         "anyway)" for f in bad))
