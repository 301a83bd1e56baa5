"""Generation metrics (exact, contains, regex, a user's Python scorer), prompts read from files, and the config
keys that choose metrics and trackers: fast, no model."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from shardfit.config import load_config
from shardfit.errors import UserError
from shardfit.evals.generation import score_answers
from shardfit.evals.scorers import parse_metric, parse_metrics
from shardfit.infer.prompts import read_requests, request_of, requests_from_conversations
from shardfit.train.trackers import resolve_report_to, scalars_of
from tests.helpers import write_config


def _score(spec: str, prediction: str, expected: str) -> float:
    return parse_metric(spec).score(prediction, expected, {}, "test")


def test_builtin_scorers() -> None:
    assert _score("exact", " name=Ana; city=Lisbon \n", "name=Ana; city=Lisbon") == 1.0
    assert _score("exact", "name=Ana; city=Lisboa", "name=Ana; city=Lisbon") == 0.0
    assert _score("contains", "Sure! The answer is PARIS.", "paris") == 1.0
    assert _score("contains", "Lyon", "Paris") == 0.0
    # regex: the first group is extracted from both sides and compared
    gsm = r"regex:answer is (\d+)"
    assert _score(gsm, "Let me think... the answer is 42.", "So the answer is 42") == 1.0
    assert _score(gsm, "the answer is 41", "the answer is 42") == 0.0
    assert _score(gsm, "no number here", "the answer is 42") == 0.0
    # an expected answer the pattern does not match is compared whole
    assert _score(r"regex:(\d+)", "It costs 17 euros", "17") == 1.0
    assert _score(r"regex:\d+", "It costs 17 euros", "17") == 1.0  # no group: the whole match


def test_python_scorer_file(tmp_path: Path) -> None:
    f = tmp_path / "scorer.py"
    f.write_text("def length_ok(prediction, expected, row):\n    return len(prediction) <= row['max_len']\n\n"
                 "def broken(prediction, expected, row):\n    raise KeyError('oops')\n\n"
                 "def wrong_type(prediction, expected, row):\n    return 'yes'\n")
    scorer = parse_metric(f"py:{f}:length_ok")
    assert scorer.name == "length_ok"
    assert scorer.score("short", "", {"max_len": 10}, "x") == 1.0
    assert scorer.score("far too long an answer", "", {"max_len": 10}, "x") == 0.0
    with pytest.raises(UserError, match="failed on data.jsonl:3: KeyError"):
        parse_metric(f"py:{f}:broken").score("a", "b", {}, "data.jsonl:3")
    with pytest.raises(UserError, match="returned str"):
        parse_metric(f"py:{f}:wrong_type").score("a", "b", {}, "x")
    with pytest.raises(UserError, match="has no function nope .*length_ok"):
        parse_metric(f"py:{f}:nope")
    with pytest.raises(UserError, match="no file"):
        parse_metric(f"py:{tmp_path / 'missing.py'}:f")


def test_bad_metric_specs() -> None:
    for spec in ("exactly", "regex:", "regex:(unclosed", "py:only_file.py"):
        with pytest.raises(UserError):
            parse_metric(spec)
    with pytest.raises(UserError, match="named regex"):
        parse_metrics(["regex:a", "regex:b"])


def test_score_answers_means_skip_rows_without_expected() -> None:
    reqs = [request_of({"prompt": "a", "expected": "x"}, "1"), request_of({"prompt": "b"}, "2"),
            request_of({"prompt": "c", "expected": "y"}, "3")]
    scored = score_answers(reqs, ["x", "anything", "z"], parse_metrics(["exact", "contains"]))
    assert scored.means == {"exact": 0.5, "contains": 0.5}
    assert scored.scores[1] == {}


def test_requests_from_every_format(tmp_path: Path) -> None:
    rows = [
        {"prompt": "Hi", "expected": "Hello"},
        {"instruction": "Add", "input": "2+2", "output": "4"},
        {"instruction": "Say hi"},  # alpaca without an answer: a prompt only
        {"messages": [{"role": "system", "content": "S"}, {"role": "user", "content": "Q"},
                      {"role": "assistant", "content": "A"}]},
        {"conversations": [{"from": "human", "value": "Q1"}, {"from": "gpt", "value": "A1"},
                           {"from": "human", "value": "Q2"}]},
    ]
    f = tmp_path / "p.jsonl"
    f.write_text("".join(json.dumps(r) + "\n" for r in rows))
    reqs = read_requests(f, system="Be brief.")
    assert [r.expected for r in reqs] == ["Hello", "4", None, "A", None]
    assert reqs[0].messages == [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    assert reqs[1].messages[-1] == {"role": "user", "content": "Add\n\n2+2"}
    assert reqs[3].messages[0] == {"role": "system", "content": "S"}  # the row's own system prompt is kept
    assert [m["content"] for m in reqs[4].messages[1:]] == ["Q1", "A1", "Q2"]
    assert reqs[1].where == f"{f}:2"
    assert len(read_requests(f, limit=2)) == 2

    f.write_text('{"prompt": "ok"}\n{"text": "no format"}\n')
    with pytest.raises(UserError, match=r"p.jsonl:2: unknown row"):
        read_requests(f)
    f.write_text('{"prompt": "ok"}\n{broken\n')
    with pytest.raises(UserError, match=r"p.jsonl:2: not valid JSON"):
        read_requests(f)


def test_requests_from_held_out_conversations() -> None:
    convs = [[{"role": "user", "content": "Q"}, {"role": "assistant", "content": "A"}],
             [{"role": "user", "content": "Q1"}, {"role": "assistant", "content": "A1"},
              {"role": "user", "content": "Q2"}, {"role": "assistant", "content": "A2"}]]
    reqs = requests_from_conversations(convs)
    assert [r.expected for r in reqs] == ["A", "A2"] and len(reqs[1].messages) == 3
    assert len(requests_from_conversations(convs, limit=1)) == 1


def test_config_keys_for_metrics_and_trackers(tmp_path: Path, small_data: Path) -> None:
    ok = load_config(write_config(tmp_path / "ok.yaml", data=str(small_data), eval_metrics=["exact", "regex:(\\d+)"],
                                  report_to="none"))
    assert ok.report_to == ["none"] and ok.eval_metrics == ["exact", "regex:(\\d+)"]
    assert load_config(write_config(tmp_path / "d.yaml", data=str(small_data))).report_to == ["auto"]
    bad = {"eval_metrics": ["exakt"], "report_to": ["tensorbord"], "eval_samples": 0}
    for key, value in bad.items():
        with pytest.raises(UserError) as e:
            load_config(write_config(tmp_path / "bad.yaml", data=str(small_data), **{key: value}))
        assert f"bad.yaml:2: '{key}'" in str(e.value)
    with pytest.raises(UserError, match="did you mean 'exact'"):
        load_config(write_config(tmp_path / "bad.yaml", data=str(small_data), eval_metrics=["exakt"]))


def test_report_to_resolution(monkeypatch: pytest.MonkeyPatch) -> None:
    assert resolve_report_to(["none"]) == []
    monkeypatch.setattr("shardfit.train.trackers.installed", lambda name: name == "tensorboard")
    assert resolve_report_to(["auto"]) == ["tensorboard"]
    with pytest.raises(UserError, match=r"pip install shardfit\[wandb\]"):
        resolve_report_to(["wandb"])
    monkeypatch.setattr("shardfit.train.trackers.installed", lambda name: False)
    assert resolve_report_to(["auto"]) == []  # auto never fails: TensorBoard only when it is there
    assert scalars_of({"step": 3, "loss": 1.5, "mem_gib": [1.0, 2.0], "strategy": "x", "flag": True}) == {
        "loss": 1.5, "mem_gib/rank0": 1.0, "mem_gib/rank1": 2.0}
