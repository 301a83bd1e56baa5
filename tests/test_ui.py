"""`shardfit ui`: the local server's plan calculator, run reports and a run launched from a config, checked over
HTTP and in a real headless browser."""

from __future__ import annotations

import threading
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest

from shardfit.ui.server import make_server
from tests.helpers import browser, browser_dom, make_run, write_config

needs_browser = pytest.mark.skipif(browser() is None, reason="needs Chromium (apt-get install "
                                                             "chromium-headless-shell)")


@pytest.fixture()
def ui(tmp_path: Path) -> Iterator[tuple[str, Path]]:
    runs = tmp_path / "runs"
    runs.mkdir()
    server = make_server(runs, port=0)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}", runs
    finally:
        server.shutdown()
        server.server_close()


def _get(url: str) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(url, timeout=120) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()


@needs_browser
def test_plan_calculator_in_a_browser(ui: tuple[str, Path]) -> None:
    base, _ = ui
    status, home = _get(base + "/")
    assert status == 200 and "action='/plan'" in home and "no runs yet" in home
    query = urllib.parse.urlencode({"model": "meta-llama/Llama-3.1-8B", "gpus": "8x24GB", "method": "full",
                                    "seq": "4096", "batch": "1", "grad_ckpt": "full"})
    dom = browser_dom(f"{base}/plan?{query}")
    assert "recommended: zero3" in dom and "zero3_offload" in dom and "data:image/png;base64," in dom
    assert "value=\"4096\"" in dom  # the form keeps what was asked
    status, page = _get(f"{base}/plan?model=no/such-model&gpus=8x24GB")
    assert status == 400 and "no/such-model" in page


@needs_browser
def test_runs_are_listed_and_reported(ui: tuple[str, Path]) -> None:
    base, runs = ui
    make_run(runs / "exp1", mem=[[1.0, 1.0], [2.0, 1.2], [3.1, 1.3], [3.1, 1.3]], predicted=2.0)
    assert "/runs/exp1" in _get(base + "/")[1]
    dom = browser_dom(f"{base}/runs/exp1")
    assert "shardfit report: exp1" in dom and "imbalance: rank 0" in dom and dom.count("data:image/png") == 6
    assert _get(f"{base}/runs/..%2F..%2Fetc")[0] == 400


@pytest.mark.slow
def test_launch_a_run_and_watch_it(ui: tuple[str, Path], tiny_llama: Path, small_data: Path) -> None:
    base, runs = ui
    cfg = write_config(runs.parent / "c.yaml", model=str(tiny_llama), data=str(small_data), method="lora",
                       precision="fp32", max_seq_len=128, micro_batch=4, max_steps=2, log_steps=1, save_steps=100,
                       report_to="none", output_dir=str(runs / "from-ui"))
    bad = urllib.request.Request(base + "/launch", data=b"config=nowhere.yaml&nproc=1", method="POST")
    with pytest.raises(urllib.error.HTTPError) as e:
        urllib.request.urlopen(bad, timeout=60)
    assert e.value.code == 400 and "nowhere.yaml" in e.value.read().decode()

    form = urllib.parse.urlencode({"config": str(cfg), "nproc": "1"}).encode()
    with urllib.request.urlopen(urllib.request.Request(base + "/launch", data=form, method="POST"), timeout=60) as r:
        assert r.url.endswith("/jobs/1")  # redirected to the job's page
    deadline = time.time() + 300
    while "job 1: running" in (page := _get(base + "/jobs/1")[1]) and time.time() < deadline:
        time.sleep(1)
    assert "job 1: finished" in page, page[-3000:]
    assert "/runs/from-ui" in page
    status, report = _get(base + "/runs/from-ui")
    assert status == 200 and "loss.png" in report and "refresh" not in report
