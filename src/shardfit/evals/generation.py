"""Score a model's greedy answers to held-out requests with the chosen scorers."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from shardfit.evals.scorers import Scorer
from shardfit.infer.prompts import Request


@dataclass
class Scored:
    """Each scorer's mean, and every answer with its scores (in request order)."""

    means: dict[str, float]
    answers: list[str]
    scores: list[dict[str, float]]


def score_answers(requests: list[Request], answers: list[str], scorers: list[Scorer]) -> Scored:
    """Score answers against the requests' expected answers; requests without one are not scored."""
    per: list[dict[str, float]] = []
    totals = {s.name: 0.0 for s in scorers}
    n = 0
    for req, answer in zip(requests, answers, strict=True):
        if req.expected is None:
            per.append({})
            continue
        row = {s.name: s.score(answer, req.expected, req.row, req.where) for s in scorers}
        for k, v in row.items():
            totals[k] += v
        per.append(row)
        n += 1
    means = {k: round(v / n, 6) for k, v in totals.items()} if n else {}
    return Scored(means, answers, per)


def scored_requests(requests: list[Request]) -> list[Request]:
    """The requests that carry an expected answer (the ones a metric can score)."""
    return [r for r in requests if r.expected is not None]


def sample_json(requests: list[Request], columns: dict[str, Scored], limit: int | None = None) -> list[dict[str, Any]]:
    """Per-example JSON: the prompt, the expected answer, and each column's answer and scores."""
    out = []
    for i, req in enumerate(requests[:limit]):
        item: dict[str, Any] = {"where": req.where, "prompt": req.messages[-1]["content"], "expected": req.expected}
        for name, col in columns.items():
            item[name] = {"answer": col.answers[i], "scores": col.scores[i]}
        out.append(item)
    return out
