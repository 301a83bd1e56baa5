"""`shardfit diagnose` on the blind set (tests/diagnose_blind/cases.yaml: real threads collected by a reader who
never saw a pattern or a prediction, from repositories outside the other corpora). Nothing is tuned on it: the test
only scores it and holds the figures docs/diagnose.md and the README state to what the engine does now."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from tests.diagnose_real.evaluate import evaluate
from tests.helpers import ROOT

CASES = Path(__file__).resolve().parent / "diagnose_blind" / "cases.yaml"


def headline() -> str:
    """The sentence the docs state, computed from the blind set now."""
    cases = yaml.safe_load(CASES.read_text())
    full, line = evaluate(cases, "full"), evaluate(cases, "line")
    return (f"on {full['cases']} blind threads ({full['known']} with a known cause, {full['unrelated']} unrelated): "
            f"top-1 {full['top1']:.1%}, top-3 {full['top3']:.1%} as pasted, top-3 {line['top3']:.1%} from the "
            f"error line alone; {full['wrong_confident']} of {full['confident']} confident answers wrong")


@pytest.fixture(scope="module")
def sentence() -> str:
    return headline()


def test_the_blind_set_is_outside_the_other_corpora() -> None:
    blind = yaml.safe_load(CASES.read_text())
    dev = yaml.safe_load((ROOT / "tests" / "diagnose_real" / "cases.yaml").read_text())
    assert len(blind) >= 30 and all({"url", "repo", "label", "log"} <= set(c) for c in blind)
    assert not {c["repo"] for c in blind} & {c["repo"] for c in dev}
    assert not {c["url"] for c in blind} & {c["url"] for c in dev}


def test_docs_state_what_the_engine_scores_now(sentence: str) -> None:
    for doc in (ROOT / "docs" / "diagnose.md", ROOT / "README.md"):
        assert sentence in " ".join(doc.read_text().split()), f"{doc.name} must state: {sentence}"
