"""Score `shardfit diagnose` on labelled logs, as pasted whole and as users often paste them (short and bare).

    python -m tests.diagnose_real.evaluate dev              # the part rules were tuned on (prints the misses)
    python -m tests.diagnose_real.evaluate test             # the held-out part (aggregate numbers only)
    python -m tests.diagnose_real.evaluate dev --variant line --misses   (misses are never shown for test)

Each case is scored in three forms (VARIANTS): `full` (the log as collected), `tail` (its last 6 lines: the end of a
traceback) and `line` (one line: the final exception "Type: message", else the last error-looking line). Per form:

- top-1 / top-3: the label is the first / among the first three of the ranked likely causes (the answer shown,
  confident or not), over cases with a known label;
- answered: known cases that got any ranked cause;
- confident-wrong: answers presented as confident (answer == "confident", the top finding at >= 0.8) that are wrong,
  as a share of all cases (known and unrelated) and of the confident answers;
- abstain on unrelated: cases labelled `none` with no ranked cause at all; `not confident on unrelated`: with no
  confident answer;
- findings top-1 / findings empty on unrelated: the same on the `findings` list (the contract before the ranked
  list existed: only causes whose specific signature matched).
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

import yaml

from shardfit.diagnose.engine import analyze, load_knowledge
from shardfit.diagnose.parse import parse
from tests.diagnose_real.split import load_cases

TESTS = Path(__file__).resolve().parent.parent
CONFIDENT = 0.8
VARIANTS = ("full", "tail", "line")
_ERRORISH = re.compile(r"error|exception|fail|killed|timeout|timed out|signal|assert|nan\b|out of memory", re.I)


def synthetic_cases() -> list[dict]:
    """The hand-written corpus (tests/diagnose_corpus) and the first public set (tests/diagnose_public)."""
    out = [{"url": p.name, "label": p.name.split(".")[0], "log": p.read_text()}
           for p in sorted((TESTS / "diagnose_corpus").glob("*.log"))]
    for c in yaml.safe_load((TESTS / "diagnose_public" / "cases.yaml").read_text()):
        out.append({"url": c["url"], "label": c["expected"], "log": c["log"]})
    return out


def shorten(log: str, variant: str) -> str:
    """The log as a user might paste it: whole, its last lines, or the one line that states the error."""
    lines = [x for x in log.splitlines() if x.strip()]
    if variant == "full" or not lines:
        return log
    if variant == "tail":
        return "\n".join(lines[-6:])
    p = parse(log, load_knowledge().facts)
    if p.exception is not None:
        return str(p.exception)
    errorish = [x for x in p.lines if _ERRORISH.search(x)]
    return (errorish or p.lines or lines)[-1]


def evaluate(cases: list[dict], variant: str = "full") -> dict:
    rows = []
    for c in cases:
        a = analyze(shorten(c["log"], variant))
        cats = [x.category for x in a.likely]
        rows.append({"url": c["url"], "label": c["label"], "top": cats[0] if cats else None, "cats": cats,
                     "answer": a.answer, "conf": a.likely[0].confidence if a.likely else 0.0,
                     "finding": a.findings[0].category if a.findings else None,
                     "scores": [(x.category, x.confidence) for x in a.likely]})
    known = [r for r in rows if r["label"] != "none"]
    unrelated = [r for r in rows if r["label"] == "none"]
    confident = [r for r in rows if r["answer"] == "confident"]
    wrong_conf = [r for r in confident if r["top"] != r["label"]]
    n = max(len(known), 1)
    return {
        "variant": variant, "cases": len(rows), "known": len(known), "unrelated": len(unrelated),
        "top1": sum(r["top"] == r["label"] for r in known) / n,
        "top3": sum(r["label"] in r["cats"][:3] for r in known) / n,
        "answered": sum(r["top"] is not None for r in known) / n,
        "findings_top1": sum(r["finding"] == r["label"] for r in known) / n,
        "abstain_unrelated": sum(r["top"] is None for r in unrelated) / max(len(unrelated), 1),
        "findings_abstain_unrelated": sum(r["finding"] is None for r in unrelated) / max(len(unrelated), 1),
        "unconfident_unrelated": sum(r["answer"] != "confident" for r in unrelated) / max(len(unrelated), 1),
        "confident": len(confident),
        "wrong_confident": len(wrong_conf),
        "wrong_at_08": len(wrong_conf) / max(len(confident), 1),
        "confident_wrong_of_all": len(wrong_conf) / max(len(rows), 1),
        "rows": rows,
    }


def report(m: dict, show_misses: bool = True) -> str:
    lines = [f"[{m['variant']:4s}] cases {m['cases']} (known {m['known']}, unrelated {m['unrelated']}): "
             f"top-1 {m['top1']:.1%}, top-3 {m['top3']:.1%}, answered {m['answered']:.1%}, "
             f"confident-wrong {m['wrong_confident']} of {m['confident']} confident "
             f"({m['wrong_at_08']:.1%}; {m['confident_wrong_of_all']:.1%} of all cases), abstain on unrelated "
             f"{m['abstain_unrelated']:.1%}, not confident on unrelated {m['unconfident_unrelated']:.1%}, "
             f"findings top-1 {m['findings_top1']:.1%}, findings empty on unrelated "
             f"{m['findings_abstain_unrelated']:.1%}"]
    if show_misses:
        for r in m["rows"]:
            if (r["cats"] if r["label"] == "none" else r["label"] not in r["cats"][:3]):
                lines.append(f"  MISS {r['label']:32s} got {r['answer']:9s} {r['scores']} {r['url']}")
    return "\n".join(lines)


if __name__ == "__main__":
    args = [a for a in sys.argv[1:] if not a.startswith("--")]
    part = args[0] if args else "dev"
    variants = VARIANTS
    if "--variant" in sys.argv:
        variants = (sys.argv[sys.argv.index("--variant") + 1],)
        part = next((a for a in args if a not in VARIANTS), "dev")
    cases = synthetic_cases() if part == "synthetic" else load_cases(part)
    for v in variants:
        # the held-out part never shows its misses: looking at them would turn it into tuning data
        misses = part != "test" and (v == "full" or "--misses" in sys.argv)
        print(report(evaluate(cases, v), show_misses=misses))
