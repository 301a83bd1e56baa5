"""Build a report: read the runs, draw the charts, write report.html beside the PNGs."""

from __future__ import annotations

from pathlib import Path

from shardfit.errors import UserError
from shardfit.report.collect import read_run, unique_names
from shardfit.report.html import render_page
from shardfit.report.plots import make_charts


def make_report(run_dirs: list[str], out: str | None = None) -> Path:
    """Write `report.html` and the charts' PNGs for `run_dirs` into `out` (default: RUN_DIR/report for one run,
    ./report for several); returns the HTML file."""
    runs = [read_run(d) for d in run_dirs]
    unique_names(runs)
    out_dir = Path(out) if out else (runs[0].path / "report" if len(runs) == 1 else Path("report"))
    try:
        out_dir.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise UserError(f"--out {out_dir}: cannot create it ({e}).") from None
    charts = make_charts(runs, out_dir)
    page = out_dir / "report.html"
    page.write_text(render_page(runs, charts, out_dir), encoding="utf-8")
    return page
