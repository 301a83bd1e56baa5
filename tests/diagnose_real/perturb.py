"""Mangle a log the way terminals and chat boxes do, to measure how robust diagnosis is to it:
hard-wrap at 79 columns, prefix lines with a rank tag, colour them (ANSI) and interleave a \\r progress bar.

    python -m tests.diagnose_real.perturb dev|test
"""

from __future__ import annotations

import random
import sys

from tests.diagnose_real.evaluate import evaluate, report
from tests.diagnose_real.split import load_cases


def mangle(log: str, seed: int) -> str:
    rng = random.Random(seed)
    out = []
    for line in log.splitlines():
        if rng.random() < 0.3:
            out.append(f"  {rng.randint(1, 99)}%|███       | {rng.randint(1, 9)}/10 [00:01<00:09, 1.1it/s]\r")
        prefix = f"[rank{rng.randint(0, 7)}]: " if rng.random() < 0.5 else ""
        colour = rng.random() < 0.2
        text = prefix + (f"\x1b[31m{line}\x1b[0m" if colour else line)
        while len(text) > 79:  # hard wrap, mid-word, like a fixed-width terminal
            out.append(text[:79])
            text = text[79:]
        out.append(text)
    return "\n".join(out)


if __name__ == "__main__":
    part = sys.argv[1] if len(sys.argv) > 1 else "dev"
    cases = [dict(c, log=mangle(c["log"], i)) for i, c in enumerate(load_cases(part))]
    print(report(evaluate(cases), show_misses=part == "dev"))
