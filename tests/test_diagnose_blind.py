"""`shardfit diagnose` on the blind set (tests/diagnose_blind/cases.yaml: real threads collected by readers who
never saw a pattern or a prediction, from repositories outside every other corpus). Nothing is tuned on it: the
test only scores it and holds the figures docs/diagnose.md and the README state to what the engine does now. The
former blind sets (tests/diagnose_outsiders/) are dev data since the engine was tuned on them; their in-sample
figures are held to docs/diagnose.md too, labelled as such."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.diagnose_real.evaluate import evaluate
from tests.diagnose_real.split import read_corpus
from tests.helpers import ROOT

CASES = Path(__file__).resolve().parent / "diagnose_blind" / "cases.yaml"
OUTSIDERS = Path(__file__).resolve().parent / "diagnose_outsiders" / "cases.yaml"


def _figures(cases: list[dict], what: str) -> str:
    full, line = evaluate(cases, "full"), evaluate(cases, "line")
    return (f"on {full['cases']} {what} ({full['known']} with a known cause, {full['unrelated']} unrelated): "
            f"top-1 {full['top1']:.1%}, top-3 {full['top3']:.1%} as pasted, top-3 {line['top3']:.1%} from the "
            f"error line alone; {full['wrong_confident']} of {full['confident']} confident answers wrong")


def headline() -> str:
    """The sentence the docs and the README state, computed from the blind set now."""
    return _figures(read_corpus(CASES), "blind threads")


def outsiders_line() -> str:
    """The in-sample sentence of docs/diagnose.md: the former blind sets, tuned on since."""
    return _figures(read_corpus(OUTSIDERS), "former blind threads (now dev, in-sample)")


def _repo(case: dict) -> str:
    """A thread's repository (or site), from its `repo` key or its url."""
    return (case.get("repo") or "/".join(case["url"].split("/")[3:5])).lower()


@pytest.fixture(scope="module")
def sentence() -> str:
    return headline()


def test_the_blind_set_is_outside_the_other_corpora() -> None:
    blind = read_corpus(CASES)
    # batch 18 is small (10): the sources of such threads are nearly used up; the docs pool it with the rest
    assert len(blind) >= 10 and all({"url", "repo", "label", "log"} <= set(c) for c in blind)
    assert len({c["url"] for c in blind}) == len(blind)
    for corpus in (ROOT / "tests" / "diagnose_real" / "cases.yaml", ROOT / "tests" / "diagnose_public" / "cases.yaml",
                   ROOT / "tests" / "diagnose_short" / "cases.yaml", OUTSIDERS):
        other = [c for c in read_corpus(corpus) if isinstance(c, dict) and "url" in c]
        assert not {_repo(c) for c in blind} & {_repo(c) for c in other}, corpus
        assert not {c["url"] for c in blind} & {c["url"] for c in other}, corpus


def test_docs_state_what_the_engine_scores_now(sentence: str) -> None:
    for doc in (ROOT / "docs" / "diagnose.md", ROOT / "README.md"):
        assert sentence in " ".join(doc.read_text().split()), f"{doc.name} must state: {sentence}"


def test_docs_state_the_former_blind_sets_as_in_sample() -> None:
    line = outsiders_line()
    assert line in " ".join((ROOT / "docs" / "diagnose.md").read_text().split()), f"docs must state: {line}"
