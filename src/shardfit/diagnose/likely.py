"""The ranked likely causes: the answer for short and bare pastes, where no single cause is certain.

A one-line paste ("Expected all tensors to be on the same device ... cuda:0 and cpu!", "CUDA out of memory",
"exits with return code = -9") fits several causes. Every cause whose signature or hint matches is a candidate,
ranked on its total (signatures + context + hints); the context is what the log shows of the setting (setting.py),
so the same line ranks differently under ZeRO-3, FSDP, DDP or a plain `python` launch. The top three are returned,
each with the one check that tells it apart from the others.

A confident finding (confidence >= CONFIDENT) stays first: its specific evidence outranks any hint. Otherwise the
ranking is the answer ("likely"). An entry that is also a finding shows the finding's calibrated confidence; one
that only hints support shows the probability, fitted on the dev corpus (calibration.yaml `likely`), that a hinted
cause at that rank is right. Below a confident first entry, every confidence is kept under CONFIDENT.
"""

from __future__ import annotations

from shardfit.diagnose.model import Finding, Likely, Scored

CONFIDENT = 0.8  # a finding at or above this is presented as the answer, not as one of several likely causes
LIKELY_MIN = 0.5  # a candidate whose total is below this is not worth a user's check
TOP = 3


def _entry(s: Scored, confidence: float) -> Likely:
    c = s.cause
    return Likely(c.id, round(confidence, 2), c.title, s.check or c.check, c.root_cause, c.fix, s.evidence)


def likely_causes(scored: list[Scored], findings: list[Finding], order: list[str],
                  per_rank: list[float]) -> tuple[str, list[Likely]]:
    """(answer, ranked likely causes): answer is "confident" when findings[0] is confident, "likely" when only the
    ranking can be offered, "none" when no cause is a candidate. A likely cause that is also a finding shows the
    finding's confidence; one that only hints support shows `per_rank[rank]`, fitted on dev (calibration.yaml)."""
    pos = {cid: i for i, cid in enumerate(order)}
    pool = sorted((s for s in scored if s.total >= LIKELY_MIN or (s.specific and s.score >= 2.0)),
                  key=lambda s: (-s.total, -s.score, pos[s.cause.id]))
    confident = bool(findings) and findings[0].confidence >= CONFIDENT
    if confident:
        first = next(s for s in scored if s.cause.id == findings[0].category)
        pool = [first] + [s for s in pool if s is not first]
    if not pool:
        return "none", []
    found = {f.category: f.confidence for f in findings}
    out = []
    for i, s in enumerate(pool[:TOP]):
        p = found.get(s.cause.id, per_rank[i] if i < len(per_rank) else 0.05)
        out.append(_entry(s, p if (i == 0 and confident) else min(p, CONFIDENT - 0.01)))
    for i in range(1, len(out)):  # best first: a lower rank never shows more confidence
        out[i].confidence = min(out[i].confidence, out[i - 1].confidence)
    return ("confident" if confident else "likely"), out
