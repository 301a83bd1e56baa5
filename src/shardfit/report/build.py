"""Build a report: read the runs, draw the charts, write report.html beside the PNGs."""

from __future__ import annotations

import time
from pathlib import Path

from shardfit.errors import UserError
from shardfit.report.collect import choose_axis, read_run, unique_names
from shardfit.report.html import render_page
from shardfit.report.plots import make_charts


def make_report(run_dirs: list[str], out: str | None = None, refresh_s: float | None = None,
                x: str = "auto") -> Path:
    """Write `report.html` and the charts' PNGs for `run_dirs` into `out` (default: RUN_DIR/report for one run,
    ./report for several); returns the HTML file. `refresh_s`: the page reloads itself that often (live); `x`: the
    curves' x axis (step, examples, tokens, or auto: examples where the runs' global batches differ)."""
    runs = [read_run(d) for d in run_dirs]
    unique_names(runs)
    out_dir = Path(out) if out else (runs[0].path / "report" if len(runs) == 1 else Path("report"))
    try:
        out_dir.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise UserError(f"--out {out_dir}: cannot create it ({e}).") from None
    axis, why = choose_axis(runs, x)
    charts = make_charts(runs, out_dir, axis)
    page = out_dir / "report.html"
    tmp = out_dir / ".report.html.tmp"  # a browser reloading mid-write sees the old page or the new, never half
    tmp.write_text(render_page(runs, charts, out_dir, refresh_s, axis_note=why), encoding="utf-8")
    tmp.replace(page)
    return page


def finished(run_dir: str) -> bool:
    """A run is finished once it wrote summary.json."""
    return (Path(run_dir) / "summary.json").is_file()


def watch(run_dirs: list[str], out: str | None, every_s: float, patience: int = 5, x: str = "auto") -> Path:
    """Rebuild the report every `every_s` seconds until every run has finished (or Ctrl-C); the live page reloads
    itself. A run that has logged nothing yet, or a file caught mid-write, is retried; `patience` failures in a row
    end the watch with the error."""
    failures = 0
    while True:
        done = all(map(finished, run_dirs))
        try:
            page = make_report(run_dirs, out, refresh_s=None if done else every_s, x=x)
            failures = 0
        except UserError:
            failures += 1
            if failures >= patience:
                raise
            page = None
        if page is not None and done:
            return page
        time.sleep(every_s)
