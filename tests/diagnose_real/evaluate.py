"""Score `shardfit diagnose` on labelled logs, as pasted whole and as users often paste them (short and bare).

    python -m tests.diagnose_real.evaluate dev              # the part rules were tuned on (prints the misses)
    python -m tests.diagnose_real.evaluate test             # the held-out part (aggregate numbers only)
    python -m tests.diagnose_real.evaluate dev --variant line --misses   (misses are never shown for test)
    python -m tests.diagnose_real.evaluate docs             # the main table of docs/diagnose.md

Each case is scored in three forms (VARIANTS): `full` (the log as collected), `tail` (its last 6 lines: the end of a
traceback) and `line` (one line: the final exception "Type: message", else the last line that states an error, as a
user would copy it: never a reader's cut mark, an image, a code fence or a metric; see _error_line). Per form:

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

import math
import re
import sys
from functools import cache
from pathlib import Path
from typing import NamedTuple

from shardfit.diagnose.engine import analyze, load_knowledge
from shardfit.diagnose.parse import Parsed, parse
from tests.diagnose_real.split import load_cases, read_corpus

TESTS = Path(__file__).resolve().parent.parent
CONFIDENT = 0.8
VARIANTS = ("full", "tail", "line")
_ERRORISH = re.compile(r"error|\berr\b|exception|fail|\bkill(s|ed)?\b|timeout|timed out|signal|assert|nan\b|"
                       r"out of (\w+ )?memory|\bOOM\b|\bstuck\b|\bhang(s|ing)?\b|\bhung\b|报错|错误|失败|爆显存|"
                       r"显存不[足够]|卡住|超时", re.I)
# a line that states an error in a program's own format: an exception "Type: message" (anywhere in the line: a title
# or a sentence quotes it), a CUDA, NCCL, loader or watchdog error, a failed assert, a signal
_STATED = re.compile(r"(?:^|[^\w.])(?:[A-Za-z_]\w*\.)*[A-Z]\w*(?:Error|Exception)(?:\(\w+\))?:|"
                     r"^\W{0,3}(?i:error|fatal)\b\W|NCCL WARN|Watchdog caught|\bAssertion\b.*\bfailed|^Killed\b|"
                     r"Segmentation fault|core dumped|CUDA error|(?i:out of memory|timed out)|\bSIG[A-Z]{3,}\b|"
                     r"undefined symbol|No module named|cannot import name")
_WARNING = re.compile(r"(?:^|[^\w.])(?:[A-Za-z_]\w*\.)*[A-Z]\w*Warning:")
# lines nobody copies as the error: a reader's cut mark, an image, a bare code fence, punctuation only, a metric
# ("Mean Projection Error: 1.33"); a traceback frame only names where
_NOISE = re.compile(r"^(?:\[\.\.\.\]|\.\.\.|`{3}[\w-]*|!\[.*|<img\b.*|[\W_]*)$|\berror\W{0,3}[:=]\s*-?\d*\.\d",
                    re.I)
_FRAME_LINE = re.compile(r'^File "')
# what a launcher or torch prints after the failure it reports: a rank's exit code (a signal's, -9, says more), the
# others being stopped, the watchdog's standard caution; the error itself stands above them
_AFTERMATH = re.compile(r"failed \(exitcode: \d+\)|ChildFailedError|closing signal SIG|Some NCCL operations have "
                        r"failed or timed out|Killing subprocess")


def synthetic_cases() -> list[dict]:
    """The hand-written corpus (tests/diagnose_corpus) and the first public set (tests/diagnose_public)."""
    out = [{"url": p.name, "label": p.name.split(".")[0], "log": p.read_text()}
           for p in sorted((TESTS / "diagnose_corpus").glob("*.log"))]
    for c in read_corpus(TESTS / "diagnose_public" / "cases.yaml"):
        out.append({"url": c["url"], "label": c["expected"], "log": c["log"]})
    return out


# log -> its one error line, noted when the whole log was analyzed (analyze parses it as `shorten` does): the one-line
# form of a log scored whole before needs no second parse
_LINES: dict[str, str] = {}


def shorten(log: str, variant: str) -> str:
    """The log as a user might paste it: whole, its last lines, or the one line that states the error."""
    lines = [x for x in log.splitlines() if x.strip()]
    if variant == "full" or not lines:
        return log
    if variant == "tail":
        return "\n".join(lines[-6:])
    if log not in _LINES:
        _LINES[log] = _error_line(parse(log, load_knowledge().facts), lines)
    return _LINES[log]


def _error_line(p: Parsed, lines: list[str]) -> str:
    """The line of a parsed log a user would copy as its error: the final exception; else the last line stating an
    error in a program's format, the last one naming a failure in words (a launcher's report of a rank's exit only
    where nothing else does), the last warning, and with none of them the last line that is not a frame. Never a
    cut mark, an image, a bare code fence or a metric."""
    if p.exception is not None:
        return str(p.exception)
    kept = [x for x in p.lines if not _NOISE.search(x)]
    errors = [x for x in kept if not _AFTERMATH.search(x)]
    for pattern, among in ((_STATED, errors), (_ERRORISH, errors), (_ERRORISH, kept), (_WARNING, kept)):
        found = [x for x in among if pattern.search(x)]
        if found:
            return found[-1]
    return ([x for x in kept if not _FRAME_LINE.match(x)] or kept or p.lines or lines)[-1]


class Answer(NamedTuple):
    """What the engine answers on one paste, as the scorers read it: the ranked likely causes with their shown
    confidence, the answer kind, the findings' categories and the raw cause scores (best first)."""
    likely: tuple[tuple[str, float], ...]
    answer: str
    findings: tuple[str, ...]
    scores: tuple[tuple[str, float], ...]


@cache
def answer_of(log: str, variant: str) -> Answer:
    """`analyze(shorten(log, variant))`, once per paste and form in a process: the engine is a pure function of the
    text (its causes and calibration files are fixed while tests run), and the same corpora are scored by several
    tests and by build.py's fits."""
    a = analyze(shorten(log, variant))
    lines = [x for x in log.splitlines() if x.strip()]
    if variant == "full" and lines:  # analyze parsed the whole log as shorten's one-line form would
        _LINES.setdefault(log, _error_line(a.parsed, lines))
    return Answer(tuple((x.category, x.confidence) for x in a.likely), a.answer,
                  tuple(f.category for f in a.findings), tuple(a.scores))


def evaluate(cases: list[dict], variant: str = "full") -> dict:
    rows = []
    for c in cases:
        a = answer_of(c["log"], variant)
        cats = [cat for cat, _ in a.likely]
        rows.append({"url": c["url"], "label": c["label"], "top": cats[0] if cats else None, "cats": cats,
                     "answer": a.answer, "conf": a.likely[0][1] if a.likely else 0.0,
                     "finding": a.findings[0] if a.findings else None, "scores": list(a.likely)})
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


def percent(x: float) -> str:
    """A share as the docs write it: one decimal, a whole 100%."""
    return "100%" if x == 1 else f"{x:.1%}"


def docs_rows() -> list[str]:
    """The rows of docs/diagnose.md's main table (whole logs, last lines, one line), computed from the corpus now;
    tests/test_diagnose_real.py holds the page to them. The held-out rows show aggregates only."""
    from tests.diagnose_real.perturb import mangle

    test, dev = load_cases("test"), load_cases("dev")
    dev_repos = {c["repo"] for c in dev}
    parts = [("**test (held out)**", test, v, True) for v in VARIANTS]
    parts += [("test, confirmed resolution only", [c for c in test if c["resolved"] == "confirmed"], "line", False),
              ("test, repositories absent from dev", [c for c in test if c["repo"] not in dev_repos], "line", False),
              ("test, mangled (79-col wrap, `[rankN]:`, ANSI, `\\r` bars)",
               [dict(c, log=mangle(c["log"], i)) for i, c in enumerate(test)], "full", False)]
    parts += [("dev (in-sample)", dev, v, False) for v in VARIANTS]
    parts.append(("hand-written + first public set (in-sample)", synthetic_cases(), "line", False))
    rows = []
    for name, cases, variant, bold in parts:
        m = evaluate(cases, variant)
        b = "**" if bold else ""
        abstain = (f"{m['abstain_unrelated']:.0%} ({round(m['abstain_unrelated'] * m['unrelated'])}/"
                   f"{m['unrelated']})" if m["unrelated"] else "-")
        rows.append(f"| {name} | {variant} | {m['known']} / {m['unrelated']} | {b}{percent(m['top1'])}{b} | "
                    f"{b}{percent(m['top3'])}{b} | {b}{m['wrong_confident']} of {m['confident']}{b} | {abstain} | "
                    f"{percent(m['findings_top1'])} |")
    return rows


def _wilson(k: int, n: int, z: float = 1.96) -> tuple[float, float]:
    """The 95% Wilson score interval of k successes in n."""
    p, d = k / n, 1 + z * z / n
    centre, half = (p + z * z / (2 * n)) / d, z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / d
    return centre - half, centre + half


def docs_prose() -> list[str]:
    """The sentences under docs/diagnose.md's main table that quote the held-out one-line and whole-log figures."""
    full, line = evaluate(load_cases("test"), "full"), evaluate(load_cases("test"), "line")
    right = round(line["top3"] * line["known"])
    lo, hi = _wilson(right, line["known"])
    return [f"on one-line pastes it answers {line['findings_top1']:.1%} of held-out cases right, the ranked list "
            f"{line['top1']:.1%} first and {line['top3']:.1%} in its top three",
            f"{full['wrong_confident']} wrong among {full['confident']} confident held-out answers (whole logs) "
            f"bounds the confident-wrong rate below about {_upper(full)} ({_bound_name(full, line)}), among "
            f"{line['confident']} (one line) below {_upper(line)}; top-3 {line['top3']:.1%} ({right} "
            f"of {line['known']}) on one line has a 95% Wilson interval of about {lo:.0%}-{hi:.0%}".replace(
                "%-", "-")]


def _upper(m: dict) -> str:
    """A 95% upper bound of the confident-wrong rate: the rule of three (3/n) holds only with none wrong; with some
    wrong, the Wilson interval's upper end."""
    n, w = m["confident"], m["wrong_confident"]
    return f"{3 / n if w == 0 else _wilson(w, n)[1]:.1%}"


def _bound_name(*ms: dict) -> str:
    return "95%, rule of three" if all(m["wrong_confident"] == 0 for m in ms) else "95%, Wilson upper bound"


if __name__ == "__main__":
    if sys.argv[1:] == ["docs"]:  # the main table of docs/diagnose.md and the figures quoted under it
        print("\n".join(docs_rows()) + "\n\n" + "\n".join(docs_prose()))
        sys.exit()
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
