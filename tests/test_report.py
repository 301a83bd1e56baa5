"""`shardfit report` on run directories: the page's content, the memory imbalance flag against the plan, several
runs side by side, and the page opened in a real headless browser."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml
from PIL import Image

from shardfit.cli.main import main
from shardfit.report.collect import choose_axis, read_run
from shardfit.report.plots import series
from tests.helpers import browser, make_run


def test_report_flags_imbalance_and_shows_the_run(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    run = make_run(tmp_path / "skewed", mem=[[1.0, 1.0], [2.0, 1.2], [3.1, 1.3], [3.1, 1.3]], predicted=2.0)
    data = read_run(run)
    assert data.peak_per_rank() == [3.1, 1.3] and data.predicted_gib() == 2.0
    findings = data.memory_findings()
    assert any(f.startswith("imbalance: rank 0 peaked at 3.10 GiB, rank 1 at 1.30 GiB") for f in findings)
    assert any(f.startswith("over plan: rank(s) 0 ") for f in findings)

    assert main(["report", str(run)]) == 0
    page = run / "report" / "report.html"
    assert str(page) in capsys.readouterr().out
    html = page.read_text()
    for png in ("loss.png", "eval_metrics.png", "lr.png", "grad_norm.png", "tokens_per_s.png", "memory-0.png"):
        assert (run / "report" / png).stat().st_size > 5000, png
        assert f"({png})" in html
    assert html.count("data:image/png;base64,") == 6  # self-contained: every chart embedded
    assert "imbalance: rank 0" in html and "over plan" in html
    assert "device_map_in_distributed" in html and "notes of zero3" in html and "(used)" in html
    assert "strategy: zero3" in html  # the config


def test_balanced_runs_side_by_side(tmp_path: Path) -> None:
    a = make_run(tmp_path / "a" / "run", mem=[[1.0, 1.0]] * 4, predicted=1.5)
    b = make_run(tmp_path / "b" / "run", mem=[[1.0, 1.02]] * 4, predicted=1.5, strategy="ddp",
                 losses=(2.0, 1.9, 1.8, 1.7))
    assert read_run(a).memory_findings() == []
    out = tmp_path / "compare"
    assert main(["report", str(a), str(b), "--out", str(out)]) == 0
    html = (out / "report.html").read_text()
    assert "a/run" in html and "b/run" in html  # same folder names told apart
    assert (out / "memory-0.png").is_file() and (out / "memory-1.png").is_file()
    assert "imbalance" not in html


def _with_batch(run: Path, micro_batch: int, grad_accum: int = 1) -> Path:
    cfg = yaml.safe_load((run / "config.yaml").read_text())
    (run / "config.yaml").write_text(yaml.safe_dump({**cfg, "micro_batch": micro_batch, "grad_accum": grad_accum}))
    return run


def test_runs_with_different_batches_are_compared_by_examples_seen(tmp_path: Path) -> None:
    """Item 10 of issue 49: a step of a run with 4x the batch is 4x the examples; comparing such runs by step
    misleads, so the curves are drawn against examples seen (or tokens, or steps, as asked)."""
    small = read_run(_with_batch(make_run(tmp_path / "small", mem=[[1.0]] * 4, predicted=1.5), 2))
    big = read_run(_with_batch(make_run(tmp_path / "big", mem=[[1.0, 1.0]] * 4, predicted=1.5), 4, grad_accum=2))
    assert (small.global_batch, big.global_batch) == (2, 16)  # micro_batch x grad_accum x ranks
    axis, why = choose_axis([small, big])
    assert axis == "examples" and "small: 2, big: 16" in why
    assert choose_axis([small, small]) == ("step", "") and choose_axis([small, big], "tokens")[0] == "tokens"
    assert series(big.train, "loss", big, "examples")[0] == [16.0, 32.0, 48.0, 64.0]
    assert series(big.evals, "eval_loss", big, "tokens")[0] == [200.0, 400.0]  # metrics.jsonl's running count
    assert big.at(3, "tokens") == 300.0 and big.at(6, "tokens") == 600.0  # logged, and past the last log

    out = tmp_path / "compare"
    assert main(["report", str(small.path), str(big.path), "--out", str(out)]) == 0
    html = (out / "report.html").read_text()
    assert "drawn against examples seen" in html and "global batch (examples/step)" in html
    assert main(["report", str(small.path), str(big.path), "--out", str(out), "--x", "step"]) == 0
    assert "drawn against" not in (out / "report.html").read_text()


def test_report_refuses_a_folder_that_is_not_a_run(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    assert main(["report", str(tmp_path)]) == 2
    assert "not a shardfit run directory" in capsys.readouterr().err


@pytest.mark.skipif(browser() is None, reason="needs Chromium (Debian: apt-get install chromium-headless-shell)")
def test_report_renders_in_a_headless_browser(tmp_path: Path) -> None:
    run = make_run(tmp_path / "run", mem=[[1.0, 1.0], [2.0, 1.2], [3.1, 1.3], [3.1, 1.3]], predicted=2.0)
    assert main(["report", str(run)]) == 0
    page = (run / "report" / "report.html").resolve().as_uri()
    common = [browser(), "--headless", "--no-sandbox", "--disable-gpu", "--hide-scrollbars"]
    dom = subprocess.run(common + ["--dump-dom", page], capture_output=True, text=True, timeout=120).stdout
    assert "<table>" in dom and "<th>tokens_per_s</th>" in dom and "imbalance: rank 0" in dom
    assert len(re.findall(r"<img[^>]+src=\"data:image/png", dom)) == 6
    shot = tmp_path / "shot.png"
    subprocess.run(common + ["--window-size=1200,1600", f"--screenshot={shot}", page], capture_output=True,
                   timeout=120, check=True)
    img = Image.open(shot).convert("RGB")
    assert img.size == (1200, 1600)
    # The charts drew: the lower part of the page holds many colours, not a blank or a broken-image icon.
    assert len(img.crop((0, 700, 1200, 1600)).getcolors(maxcolors=1 << 20)) > 50


def test_watch_rebuilds_a_live_page_until_the_run_finishes(tmp_path: Path) -> None:
    run = make_run(tmp_path / "live", mem=[[1.0]] * 4, predicted=2.0)
    summary = (run / "summary.json").read_text()
    (run / "summary.json").unlink()  # still training
    page = run / "report" / "report.html"
    proc = subprocess.Popen([sys.executable, "-m", "shardfit", "report", str(run), "--watch", "0.5"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.time() + 120
        while not page.is_file() and time.time() < deadline:
            time.sleep(0.2)
        assert "http-equiv='refresh' content='0.5'" in page.read_text() and proc.poll() is None
        (run / "summary.json").write_text(summary)  # the run finishes: one last build, then the command ends
        out, err = proc.communicate(timeout=120)
    finally:
        proc.kill()
    assert proc.returncode == 0, err
    assert "refresh" not in page.read_text() and "report written to" in out


def test_a_rank_is_compared_with_the_tensors_the_plan_says_it_allocates(tmp_path: Path) -> None:
    """Training logs max_memory_allocated(), the tensors alone: a rank 15 % over the plan's tensors is over plan,
    though it stays under the plan's total (with the allocator's reserve and the runtime) by more than 10 %."""
    run = make_run(tmp_path / "run", mem=[[2.3, 2.3]] * 4, predicted=3.0)
    plan = json.loads((run / "plan.json").read_text())
    for c in plan["candidates"]:
        c["per_gpu_gib"] = {"weights": 1.0, "activations": 1.0, "allocator_reserve": 0.04, "runtime_overhead": 1.0,
                            "total": 3.04}
    (run / "plan.json").write_text(json.dumps(plan))
    data = read_run(run)
    assert data.predicted_gib() == pytest.approx(2.0)
    assert any(f.startswith("over plan: rank(s) 0, 1 ") for f in data.memory_findings())


@pytest.mark.parametrize(("name", "text", "want"), [
    ("run.json", '{"fingerprint": {"mod', "run.json:1: not valid JSON"),
    ("run.json", "[1]", "run.json: holds a JSON list"),
    ("run.json", '{"fingerprint": "x"}', "run.json: 'fingerprint' is str"),
    ("eval.json", "null", "eval.json: 'the file' is None"),
    ("eval.json", "{}", "eval.json: 'models' is None"),
    ("eval.json", '{"models": {}}', "eval.json: 'models' is {}"),
    ("summary.json", "null", "summary.json: 'the file' is None"),
])
def test_report_names_a_damaged_run_or_eval_file(tmp_path: Path, capsys: pytest.CaptureFixture, name: str,
                                                 text: str, want: str) -> None:
    """A damaged run.json or eval.json was left out of the page without a word; like every other damaged input
    it is now exit 2 with a message naming the file and what is wrong."""
    run = make_run(tmp_path / "run", mem=[[1.0]] * 4, predicted=1.5)
    (run / name).write_text(text)
    assert main(["report", str(run)]) == 2
    err = capsys.readouterr().err
    assert want in err and "Traceback" not in err, err


def test_report_reads_a_sound_run_json(tmp_path: Path) -> None:
    run = make_run(tmp_path / "run", mem=[[1.0]] * 4, predicted=1.5)
    (run / "run.json").write_text(json.dumps({"fingerprint": {"model": "tiny"}}))
    assert main(["report", str(run)]) == 0
