"""The UI's pages as HTML strings (forms submit with GET/POST; the server renders every answer).

Links are plain paths: the cookie the token set keeps them working. The one form that changes something (launch)
carries the token in a hidden field, because the server takes a POST only with the token in its body."""

from __future__ import annotations

import html
from pathlib import Path
from typing import Any

from shardfit.config.schema import GRAD_CKPT, METHODS
from shardfit.plan.plan import Plan
from shardfit.plan.render import COLUMNS, header_lines, legend, row_cells, verdict_lines

STYLE = ("body{font-family:system-ui,sans-serif;max-width:1000px;margin:24px auto;padding:0 16px;color:#222}"
         "fieldset{margin:12px 0}label{display:inline-block;margin:4px 12px 4px 0}input,select{margin-left:4px}"
         "pre{background:#f7f7f7;padding:8px;overflow:auto}.err{color:#b00020;font-weight:600}"
         "td,th{border:1px solid #ddd;padding:4px 8px;text-align:left}table{border-collapse:collapse}"
         # The plan's table: numbers stay on one line, the notes wrap, and a window narrower than the numbers
         # scrolls the table sideways instead of cutting columns off.
         ".scroll{overflow-x:auto;max-width:100%}.plan{font-size:.85em}.plan td,.plan th{white-space:nowrap}"
         ".plan td.num{text-align:right;font-variant-numeric:tabular-nums}"
         ".plan td.notes{white-space:normal;min-width:16em}.wrap{white-space:pre-wrap}body.wide{max-width:1500px}")


def _e(value: Any) -> str:
    return html.escape(str(value))


def page(title: str, body: str, refresh_s: float | None = None, wide: bool = False) -> str:
    """A whole page; `wide` lets a page of wide tables (the plan) use more of the window."""
    meta = f"<meta http-equiv='refresh' content='{refresh_s:g}'>" if refresh_s else ""
    return (f"<!DOCTYPE html><html lang='en'><head><meta charset='utf-8'>{meta}<title>{_e(title)}</title>"
            f"<style>{STYLE}</style></head><body{' class=wide' if wide else ''}><p><a href='/'>shardfit</a></p>"
            f"<h1>{_e(title)}</h1>{body}</body></html>")


def _select(name: str, options: tuple[str, ...], chosen: str) -> str:
    opts = "".join(f"<option{' selected' if o == chosen else ''}>{_e(o)}</option>" for o in options)
    return f"<select name='{name}'>{opts}</select>"


def plan_form(models: list[str], values: dict[str, str]) -> str:
    v = {"model": "meta-llama/Llama-3.1-8B", "gpus": "8x24GB", "nodes": "1", "method": "lora", "seq": "2048",
         "batch": "1", "grad_ckpt": "full", **values}
    options = "".join(f"<option value='{_e(m)}'>" for m in models)
    return ("<form action='/plan' method='get'><fieldset><legend>Plan: memory per GPU of every strategy</legend>"
            f"<label>model <input name='model' list='models' size='40' value='{_e(v['model'])}'></label>"
            f"<datalist id='models'>{options}</datalist>"
            f"<label>GPUs <input name='gpus' size='10' value='{_e(v['gpus'])}'></label>"
            f"<label>nodes <input name='nodes' size='3' value='{_e(v['nodes'])}'></label>"
            f"<label>method {_select('method', METHODS, v['method'])}</label>"
            f"<label>sequence <input name='seq' size='6' value='{_e(v['seq'])}'></label>"
            f"<label>batch <input name='batch' size='3' value='{_e(v['batch'])}'></label>"
            f"<label>checkpointing {_select('grad_ckpt', GRAD_CKPT, v['grad_ckpt'])}</label>"
            "<button type='submit'>plan</button></fieldset></form>")


def launch_form(token: str, configs: list[Path]) -> str:
    """The launch form; `configs`: the files passed with `shardfit ui --config`, offered as suggestions."""
    options = "".join(f"<option value='{_e(c)}'>" for c in configs)
    return ("<form action='/launch' method='post'><fieldset><legend>Train: launch a run from a config</legend>"
            f"<input type='hidden' name='token' value='{_e(token)}'>"
            "<label>config file <input name='config' size='50' list='configs' "
            "placeholder='a config under the runs folder'></label>"
            f"<datalist id='configs'>{options}</datalist>"
            "<label>ranks <input name='nproc' size='3' value='1'></label>"
            "<button type='submit'>train</button></fieldset></form>")


def home(models: list[str], runs: list[Path], jobs: dict[int, Any], token: str, configs: list[Path]) -> str:
    """The front page: the plan form, the launch form, the runs and the jobs started here."""
    run_rows = "".join(f"<tr><td><a href='/runs/{_e(r.name)}'>{_e(r.name)}</a></td>"
                       f"<td>{'finished' if (r / 'summary.json').is_file() else 'training or stopped'}</td></tr>"
                       for r in runs) or "<tr><td colspan='2'>no runs yet</td></tr>"
    job_rows = "".join(f"<tr><td><a href='/jobs/{i}'>job {i}</a></td><td>{_e(j.config)}</td><td>{_e(j.state())}"
                       "</td></tr>" for i, j in sorted(jobs.items()))
    return page("shardfit", plan_form(models, {}) + launch_form(token, configs)
                + "<h2>Runs</h2><table><tr><th>run</th><th>state</th></tr>" + run_rows + "</table>"
                + (("<h2>Jobs</h2><table>" + job_rows + "</table>") if job_rows else ""))


def plan_html(plan: Plan) -> str:
    """The plan as `shardfit plan` prints it (the same lines and cells), with its table as an HTML table."""
    head = "".join(f"<th>{_e(name)}</th>" for name, _, _ in COLUMNS)
    rows = []
    for c in plan.to_json()["candidates"]:
        cells = row_cells(c)
        kinds = ["num" if right else "notes" if name == "notes" else "" for name, _, right in COLUMNS]
        rows.append("<tr>" + "".join(f"<td class='{k}'>{_e(v)}</td>" if k else f"<td>{_e(v)}</td>"
                                     for v, k in zip(cells, kinds, strict=True)) + "</tr>")
    return (f"<pre class='wrap'>{_e(chr(10).join(header_lines(plan)))}</pre>"
            f"<div class='scroll'><table class='plan'><tr>{head}</tr>{''.join(rows)}</table></div>"
            f"<p><small>{_e(legend(plan))}</small></p><pre class='wrap'>{_e(chr(10).join(verdict_lines(plan)))}</pre>")


def plan_page(models: list[str], values: dict[str, str], plan: Plan, png_b64: str, exit_note: str) -> str:
    return page("Plan", plan_form(models, values) + f"<p>{_e(exit_note)}</p>{plan_html(plan)}"
                + f"<img alt='plan' src='data:image/png;base64,{png_b64}'>", wide=True)


def error_page(title: str, message: str) -> str:
    return page(title, f"<p class='err'>{_e(message)}</p><p><a href='/'>back</a></p>")


def job_page(job_id: int, job: Any) -> str:
    state = job.state()
    running = state == "running"
    report = f"<p><a href='/runs/{_e(job.run_name)}'>live report of {_e(job.run_name)}</a></p>" if job.run_name else ""
    return page(f"job {job_id}: {state}", f"<p>{_e(' '.join(job.command))}</p>{report}<pre>{_e(job.log_tail())}</pre>",
                refresh_s=5 if running else None)
