"""Another tool's job as `shardfit check` sees it beyond memory: its data read the way `check` reads a config's
(the converted config's files and data_columns; the chat template too when the model is a local folder), and
whether the hardware computes its precision at speed. Each problem is a finding, never an exit 2: the job is the
tool's, and the report lists everything found."""

from __future__ import annotations

from collections.abc import Callable

from shardfit.check.findings import Finding
from shardfit.check.precision_rules import precision_rules
from shardfit.config import Config, load_config
from shardfit.errors import UserError
from shardfit.foreign.convert import to_config
from shardfit.foreign.job import TOOL_NAMES, ForeignJob
from shardfit.plan.hardware import Hardware


def data_rules(job: ForeignJob, validate: Callable[[Config], None]) -> list[Finding]:
    """Data the job names but that is not here, and data shardfit cannot read (a missing column mapping, a bad
    row, a file that is not JSON), each with what the converted config would need. `validate` reads a config's
    data as `check` does (check/run.py's validate_data: torch and the tokenizer, so the command passes it in)."""
    out = []
    if job.data_missing:
        out.append(Finding(
            "data_not_found", "warning", job.source,
            f"{len(job.data_missing)} dataset(s) are not local files here ({', '.join(job.data_missing)}), so "
            "neither this check nor a converted config reads them",
            "give the data as local .json/.jsonl files (e.g. file_name in dataset_info.json) to check it"))
    if not job.data:
        return out
    try:
        cfg = load_config(None, defaults=to_config(job), check_files=False)
        validate(cfg)
    except UserError as e:
        out.append(Finding(
            "data_unreadable", "error", ", ".join(job.data),
            f"the job's data cannot be read as {TOOL_NAMES[job.tool]} names it: {e}",
            "map the rows' columns (dataset_info.json `columns`; a converted config's data_columns), or fix the "
            "file the message names"))
    return out


def job_precision_rules(job: ForeignJob, hw: Hardware) -> list[Finding]:
    """The job's precision on the hardware it is checked for, fixed in its own words."""
    def fix(precision: str) -> str:
        flags = "its bf16 flag off" + (" and fp16 on" if precision == "fp16" else "")
        return f"train in {precision}: {flags} (a converted config: precision: {precision}, or auto)"

    return precision_rules(job.workload.precision, hw, job.source, fix)
