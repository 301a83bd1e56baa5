"""`shardfit diagnose`: every category docs/reference.md lists has a cause and realistic logs that rank it first."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from shardfit.diagnose.engine import diagnose, load_causes
from tests.helpers import ROOT, run_here

CORPUS = Path(__file__).with_name("diagnose_corpus")
LOGS = sorted(CORPUS.glob("*.log"))


def _contract_categories() -> set[str]:
    """The category ids of docs/reference.md (its generated `categories` block)."""
    section = (ROOT / "docs" / "reference.md").read_text().split("<!-- generated: categories -->")[1]
    return set(re.findall(r"^- `([a-z0-9_]+)`:", section.split("<!-- end: categories -->")[0], re.M))


def test_every_contract_category_has_a_cause_and_a_log() -> None:
    ids = {c.id for c in load_causes()}
    categories = _contract_categories()
    assert categories <= ids, categories - ids
    logged = {p.name.split(".")[0] for p in LOGS}
    assert categories <= logged, categories - logged


@pytest.mark.parametrize("log", LOGS, ids=[p.name for p in LOGS])
def test_corpus_log_ranks_its_category_first(log: Path) -> None:
    expected = log.name.split(".")[0]
    findings = diagnose(log.read_text())
    assert findings, "no finding"
    assert findings[0].category == expected, [(f.category, f.confidence) for f in findings]


def test_same_error_line_different_context() -> None:
    line = "RuntimeError: Expected all tensors to be on the same device, but found at least two devices, {}!"
    split = diagnose("model loaded with device_map='auto'\n" + line.format("cuda:0 and cuda:1"))
    stray = diagnose("deepspeed zero3 config, Qwen2.5-Omni talker\n" + line.format("cuda:0 and cpu"))
    assert split[0].category == "device_map_auto_cross_device"
    assert stray[0].category == "zero3_cpu_submodule"
    assert split[0].fix != stray[0].fix


def test_nothing_matches_gives_empty_list() -> None:
    assert diagnose("everything is fine, loss=0.42 at step 100") == []


def test_cli_json_contract(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    log = CORPUS / "oom_full_replica_per_rank.1.log"
    code, printed, err = run_here(capsys, "diagnose", str(log), "--json")
    assert code == 0, err
    out = json.loads(printed)
    f = out["findings"][0]
    assert set(f) == {"category", "confidence", "title", "root_cause", "fix", "prevented_by"}
    assert f["category"] == "oom_full_replica_per_rank" and 0 < f["confidence"] <= 1
    confidences = [x["confidence"] for x in out["findings"]]
    assert confidences == sorted(confidences, reverse=True)

    r = subprocess.run([sys.executable, "-m", "shardfit", "diagnose", "-"], input=log.read_text(), text=True,
                       capture_output=True, timeout=60)
    assert r.returncode == 0 and "full replica" in r.stdout
    code, _, err = run_here(capsys, "diagnose", str(tmp_path / "missing.log"))
    assert code == 2 and "no such file" in err
    code, _, err = run_here(capsys, "diagnose", str(tmp_path))  # a run's folder: said so, not "no such file"
    assert code == 2 and "is a folder" in err and "no such file" not in err
    fifo = tmp_path / "log.fifo"  # a process substitution's pipe, `shardfit diagnose <(kubectl logs ...)`
    os.mkfifo(fifo)
    writer = subprocess.Popen(["sh", "-c", f"cat {log} > {fifo}"])
    code, printed, err = run_here(capsys, "diagnose", str(fifo))
    writer.wait(timeout=60)
    assert code == 0 and "full replica" in printed, err


def test_public_issue_logs_rank_the_right_category_first() -> None:
    """Error output from public issue threads (tests/diagnose_public/cases.yaml, with their URLs): the target of
    issue 5 is the right category first in at least 85% of real logs."""
    cases = yaml.safe_load(Path(__file__).with_name("diagnose_public").joinpath("cases.yaml").read_text())
    assert len(cases) >= 50 and len({c["expected"] for c in cases}) >= 15
    misses = []
    for case in cases:
        findings = diagnose(case["log"])
        top = findings[0].category if findings else None
        if top != case["expected"]:
            misses.append((case["url"], case["expected"], top))
    assert len(misses) <= 0.15 * len(cases), misses
