"""The report page: one self-contained HTML file (charts embedded as data URIs, no script, no network)."""

from __future__ import annotations

import base64
import html
from pathlib import Path
from typing import Any

import yaml

from shardfit import __version__
from shardfit.report.collect import RunData
from shardfit.report.plots import Chart

SUMMARY_KEYS = ("steps", "train_loss", "eval_loss", "tokens_per_s", "tokens", "peak_mem_gib", "wall_s", "strategy",
                "world_size", "trainable_params", "resumed_from_step")

STYLE = """
body{font-family:system-ui,-apple-system,Segoe UI,sans-serif;margin:24px auto;max-width:1100px;color:#222;
padding:0 16px}
h1{font-size:1.5em}h2{border-bottom:1px solid #ddd;padding-bottom:4px;margin-top:32px}
table{border-collapse:collapse;margin:8px 0;font-size:.9em}td,th{border:1px solid #ddd;padding:4px 8px;text-align:left}
th{background:#f5f5f5}td.num{text-align:right;font-variant-numeric:tabular-nums}
.flag{background:#fff3cd;border:1px solid #e0b000;padding:8px 12px;margin:8px 0;border-radius:4px}
.ok{color:#2a7a2a}.bad{color:#b00020;font-weight:600}
pre{background:#f7f7f7;padding:8px;overflow:auto;font-size:.85em}img{max-width:100%;border:1px solid #eee}
figure{margin:0}figcaption{font-size:.9em;color:#555}
.charts{display:grid;grid-template-columns:repeat(auto-fit,minmax(480px,1fr));gap:16px}
"""


def _e(value: Any) -> str:
    return html.escape(str(value))


def _fmt(value: Any) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:.4g}"
    if isinstance(value, list):
        return ", ".join(_fmt(v) for v in value)
    if isinstance(value, int):
        return f"{value:,}"
    return str(value)


def _cell(value: Any) -> str:
    cls = ' class="num"' if isinstance(value, (int, float, list)) and not isinstance(value, bool) else ""
    return f"<td{cls}>{_e(_fmt(value))}</td>"


def summary_table(runs: list[RunData]) -> str:
    extra = sorted({k for r in runs for k in (r.summary or {}) if k.startswith("eval_") and k != "eval_loss"})
    keys = [k for k in SUMMARY_KEYS if any(k in (r.summary or {}) for r in runs)] + extra
    rows = ["<tr><th></th>" + "".join(f"<th>{_e(r.name)}</th>" for r in runs) + "</tr>"]
    for k in keys:
        rows.append(f"<tr><th>{_e(k)}</th>" + "".join(_cell((r.summary or {}).get(k)) for r in runs) + "</tr>")
    rows.append("<tr><th>global batch (examples/step)</th>" + "".join(_cell(r.global_batch) for r in runs) + "</tr>")
    rows.append("<tr><th>plan: tensors GiB/GPU</th>" + "".join(_cell(r.predicted_gib()) for r in runs) + "</tr>")
    return "<table>" + "".join(rows) + "</table>"


def chart_html(chart: Chart, out: Path) -> str:
    data = base64.b64encode((out / chart.file).read_bytes()).decode()
    note = f"<div class='flag'>{_e(chart.note)}</div>" if chart.note else ""
    return (f"<figure><img alt='{_e(chart.title)}' src='data:image/png;base64,{data}'>"
            f"<figcaption>{_e(chart.title)} ({_e(chart.file)})</figcaption>{note}</figure>")


def eval_table(evaluation: dict[str, Any]) -> str:
    metrics = evaluation.get("metrics", [])
    head = "<tr><th>model</th><th>loss</th><th>perplexity</th>" + "".join(f"<th>{_e(m)}</th>" for m in metrics)
    rows = [head + "</tr>"]
    for name, col in evaluation.get("models", {}).items():
        rows.append(f"<tr><td>{_e(name)}: {_e(col.get('label', ''))}</td>" + _cell(col.get("loss"))
                    + _cell(col.get("perplexity")) + "".join(_cell(col.get("metrics", {}).get(m)) for m in metrics)
                    + "</tr>")
    return (f"<p>{_e(evaluation.get('data'))}: {_e(evaluation.get('examples'))} examples, "
            f"{_e(evaluation.get('tokens'))} assistant tokens</p><table>" + "".join(rows) + "</table>")


def plan_table(plan: dict[str, Any], used: str | None) -> str:
    unit = "process (host RAM)" if plan.get("hardware", {}).get("name") == "cpu" else "GPU"
    rows = [f"<tr><th>strategy</th><th>GiB per {unit}</th><th>peak</th><th>fits</th><th>notes</th></tr>"]
    for c in plan.get("candidates", []):
        mark = " (used)" if c.get("strategy") == used else ""
        fits = "n/a" if not c.get("applies", True) else \
            "<span class='ok'>yes</span>" if c.get("fits") else "<span class='bad'>no</span>"
        rows.append(f"<tr><td>{_e(c.get('strategy'))}{_e(mark)}</td>{_cell(c['per_gpu_gib']['total'])}"
                    f"<td>{_e(c.get('peak_phase', ''))}</td><td>{fits}</td><td>{_e(c.get('notes', ''))}</td></tr>")
    m, hw = plan.get("model", {}), plan.get("hardware", {})
    return (f"<p>{_e(m.get('id'))}: {_e(_fmt(m.get('params')))} params, {_e(_fmt(m.get('trainable_params')))} "
            f"trainable; {_e(hw.get('nodes'))} node(s) x {_e(hw.get('gpus_per_node'))} x "
            f"{_e(hw.get('gpu_mem_gib'))} GiB. Recommended: {_e(plan.get('recommended'))}.</p><table>"
            + "".join(rows) + "</table>")


def findings_table(preflight: dict[str, Any]) -> str:
    found = preflight.get("findings", [])
    if not found:
        return "<p class='ok'>no findings</p>"
    rows = ["<tr><th>rule</th><th>severity</th><th>where</th><th>message</th><th>fix</th><th>fixed</th></tr>"]
    for f in found:
        rows.append("<tr>" + "".join(f"<td>{_e(f.get(k, ''))}</td>" for k in ("rule", "severity", "where", "message",
                                                                                "fix", "auto_fixed")) + "</tr>")
    return "<table>" + "".join(rows) + "</table>"


def run_details(run: RunData) -> str:
    parts = [f"<h2>{_e(run.name)}</h2><p><code>{_e(run.path.resolve())}</code></p>"]
    if run.evaluation:
        parts.append("<h3>shardfit eval</h3>" + eval_table(run.evaluation))
    if run.plan:
        parts.append("<h3>Plan</h3>" + plan_table(run.plan, run.strategy))
    if run.preflight:
        parts.append("<h3>Preflight findings</h3>" + findings_table(run.preflight))
    if run.config:
        parts.append("<h3>Config</h3><pre>" + _e(yaml.safe_dump(run.config, sort_keys=False)) + "</pre>")
    return "\n".join(parts)


def render_page(runs: list[RunData], charts: list[Chart], out: Path, refresh_s: float | None = None,
                axis_note: str = "") -> str:
    """The whole page as a string; `refresh_s` makes it reload itself (a live report of runs still training);
    `axis_note` says why the curves are not drawn against steps."""
    flags = [f"<div class='flag'><b>{_e(r.name)}</b>: {_e(f)}</div>" for r in runs for f in r.memory_findings()]
    title = "shardfit report: " + ", ".join(r.name for r in runs)
    return "\n".join([
        "<!DOCTYPE html><html lang='en'><head><meta charset='utf-8'>",
        f"<meta http-equiv='refresh' content='{refresh_s:g}'>" if refresh_s else "",
        f"<title>{_e(title)}</title><style>{STYLE}</style></head><body>",
        f"<h1>{_e(title)}</h1><p>shardfit {_e(__version__)}"
        + (f" &middot; <b>live</b>: rebuilt every {refresh_s:g} s while training" if refresh_s else "") + "</p>",
        "<h2>Summary</h2>", summary_table(runs), *flags,
        "<h2>Curves</h2>", f"<p class='flag'>{_e(axis_note)}</p>" if axis_note else "",
        "<div class='charts'>", *[chart_html(c, out) for c in charts], "</div>",
        *[run_details(r) for r in runs],
        "</body></html>"])
