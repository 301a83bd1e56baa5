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


def refuse_if_oom(plan: Plan | None, strategy: str, force: bool) -> None:
    """Exit 3 before loading when the plan predicts out-of-memory for the chosen strategy (unless `force`)."""
    verdict = memory_verdict(plan, strategy)
    if force or verdict.fits or verdict.candidate is None or plan is None:
        return
    raise DoesNotFitError(f"strategy {strategy} is predicted not to fit: {verdict.candidate.notes} "
                          f"(set force: true to start anyway).\n" + format_table(plan, style="config"))
