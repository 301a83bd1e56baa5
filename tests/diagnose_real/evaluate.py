"""Score `shardfit diagnose` on labelled logs: top-1 / top-3 on known causes, abstention on unrelated errors (label
`none`), and how often a confident (>= 0.8) top finding is wrong.

    python -m tests.diagnose_real.evaluate dev      # the part rules were tuned on (prints the misses)
    python -m tests.diagnose_real.evaluate test     # the held-out part (the headline numbers)
"""

from __future__ import annotations

import sys
from pathlib import Path

import yaml

from shardfit.diagnose.engine import analyze
from tests.diagnose_real.split import load_cases

TESTS = Path(__file__).resolve().parent.parent
CONFIDENT = 0.8


def synthetic_cases() -> list[dict]:
    """The hand-written corpus (tests/diagnose_corpus) and the first public set (tests/diagnose_public)."""
    out = [{"url": p.name, "label": p.name.split(".")[0], "log": p.read_text()}
           for p in sorted((TESTS / "diagnose_corpus").glob("*.log"))]
    for c in yaml.safe_load((TESTS / "diagnose_public" / "cases.yaml").read_text()):
        out.append({"url": c["url"], "label": c["expected"], "log": c["log"]})
    return out


def evaluate(cases: list[dict]) -> dict:
    rows = []
    for c in cases:
        a = analyze(c["log"])
        cats = [f.category for f in a.findings]
        rows.append({"url": c["url"], "label": c["label"], "top": cats[0] if cats else None, "cats": cats,
                     "conf": a.findings[0].confidence if a.findings else 0.0, "scores": a.scores})
    known = [r for r in rows if r["label"] != "none"]
    unrelated = [r for r in rows if r["label"] == "none"]
    confident = [r for r in rows if r["top"] and r["conf"] >= CONFIDENT]
    wrong_conf = [r for r in confident if r["top"] != r["label"]]
    n = max(len(known), 1)
    return {
        "cases": len(rows), "known": len(known), "unrelated": len(unrelated),
        "top1": sum(r["top"] == r["label"] for r in known) / n,
        "top3": sum(r["label"] in r["cats"] for r in known) / n,
        "silent_on_known": sum(r["top"] is None for r in known) / n,
        "abstain_unrelated": sum(r["top"] is None for r in unrelated) / max(len(unrelated), 1),
        "confident": len(confident),
        "wrong_at_08": len(wrong_conf) / max(len(confident), 1),
        "rows": rows,
    }


def report(m: dict, show_misses: bool = True) -> str:
    lines = [f"cases {m['cases']} (known {m['known']}, unrelated {m['unrelated']}): top-1 {m['top1']:.1%}, "
             f"top-3 {m['top3']:.1%}, silent on known {m['silent_on_known']:.1%}, abstain on unrelated "
             f"{m['abstain_unrelated']:.1%}, wrong at >= {CONFIDENT} {m['wrong_at_08']:.1%} of {m['confident']}"]
    if show_misses:
        for r in m["rows"]:
            if r["top"] != (None if r["label"] == "none" else r["label"]):
                lines.append(f"  MISS {r['label']:32s} got {r['top']!s:32s} {r['conf']:.2f} {r['url']}  "
                             f"{r['scores'][:3]}")
    return "\n".join(lines)


if __name__ == "__main__":
    part = sys.argv[1] if len(sys.argv) > 1 else "dev"
    cases = synthetic_cases() if part == "synthetic" else load_cases(part)
    print(report(evaluate(cases), show_misses=part != "test" or "--misses" in sys.argv))
