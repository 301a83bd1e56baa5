"""The one rule for whether a job is predicted to fit: a pipeline by its fullest stage (plan/pipeline.py, under the
cut and schedule the job runs), anything else by its strategy's candidate. The rank's refusal before loading
(`refuse_if_oom`), the preflight's stage verdict (check/pipeline_rules.py) and the resume's keep rule
(resolve/resume.py) all read it, so they cannot disagree about one job."""

from __future__ import annotations

from dataclasses import dataclass

from shardfit.config import Config
from shardfit.errors import DoesNotFitError
from shardfit.plan.estimate import Candidate
from shardfit.plan.pipeline import PipelinePlan
from shardfit.plan.plan import Plan
from shardfit.plan.render import format_table
from shardfit.resolve.pipeline import job_stages, stages_of


@dataclass(frozen=True)
class Verdict:
    """The plan's memory verdict on one job. A job the planner cannot plan (no plan, no candidate, a pipeline
    whose stages it cannot cut) is taken to fit, as the rank's own checks take it: `known` is then False."""

    fits: bool
    gib: float  # per GPU at the step's peak (a pipeline's: its fullest stage's); 0 where unknown
    card_gib: float
    tokens_per_s: float | None
    candidate: Candidate | None = None  # the strategy's estimate (no pipeline)
    pipe: PipelinePlan | None = None  # the stages' estimate (a pipeline)

    @property
    def known(self) -> bool:
        return self.candidate is not None or self.pipe is not None


UNKNOWN = Verdict(True, 0.0, 0.0, None)


def memory_verdict(plan: Plan | None, strategy: str, cfg: Config | None = None) -> Verdict:
    """The plan's verdict on `strategy` for `cfg`'s job (`cfg` settled to the job: its pipeline_parallel a count).
    Without `cfg`, or with no pipeline, the strategy's candidate decides; with a pipeline, its stages do."""
    if plan is None:
        return UNKNOWN
    if cfg is not None and stages_of(cfg) > 1:
        pipe = job_stages(cfg, plan, strategy)
        return UNKNOWN if pipe is None else Verdict(pipe.fits, pipe.stage_gib, pipe.card_gib, pipe.tokens_per_s,
                                                    pipe=pipe)
    c = plan.candidate(strategy)
    return UNKNOWN if c is None else Verdict(c.fits, c.per_gpu_gib.total, plan.hardware.gpu_mem_gib,
                                             c.tokens_per_s, candidate=c)


@dataclass(frozen=True)
class Refusal:
    """The plan's refusal of a job predicted not to fit: where in the config, what, and the change that fits. check
    reports it as its `predicted_oom` finding and train raises it (`refusal_line`) in the same words."""

    where: str
    message: str
    fix: str


def refusal_line(where: str, message: str, fix: str) -> str:
    """How train says a refusal that check reports as a finding (where, message, fix): one line, the same words.
    A semicolon after `where`, which is itself `key: value`: 'strategy: single; predicted not to fit: ...'."""
    return f"{where}; {message} (fix: {fix}; or set force: true to start anyway)"


def oom_refusal(plan: Plan | None, strategy: str) -> Refusal | None:
    """The refusal of `strategy` the plan predicts out-of-memory for (none where it fits or the planner cannot
    tell). The fix is an override train and check both take: the strategy that fits, or the nearest change that
    makes one fit."""
    verdict = memory_verdict(plan, strategy)
    c = verdict.candidate
    if plan is None or c is None or verdict.fits:
        return None
    fix = f"--set strategy={plan.recommended}" if plan.recommended else _nearest_fix(plan)
    total = f"{c.per_gpu_gib.total:.1f} GiB"
    said = "not to fit" if f"{total} of" in c.notes else \
        f"{total} per {plan.hardware.unit} of {plan.hardware.gpu_mem_gib:.0f}"  # the notes say it, or we do
    return Refusal(f"strategy: {strategy}", f"predicted {said}: {c.notes}", fix)


def _nearest_fix(plan: Plan) -> str:
    """When no strategy fits as configured: the planner's nearest changes that make one fit, as overrides."""
    phrases = [p for p in (a.phrase("config") for a in plan.alternatives or []) if p]
    return "; or ".join(phrases[:2]) if phrases else "more or larger GPUs (see `shardfit plan`)"


def refuse_if_oom(plan: Plan | None, strategy: str, force: bool) -> None:
    """Exit 3 before loading when the plan predicts out-of-memory for the chosen strategy (unless `force`), in the
    words of check's `predicted_oom` finding, with the plan's table."""
    refusal = None if force else oom_refusal(plan, strategy)
    if refusal is None or plan is None:
        return
    raise DoesNotFitError(refusal_line(refusal.where, refusal.message, refusal.fix) + "\n"
                          + format_table(plan, style="config"))
