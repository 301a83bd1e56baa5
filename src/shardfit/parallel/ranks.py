"""Rank lists as people read them: [0, 1, 2, 4, 5, 7] -> "0-2,4-5,7"."""

from __future__ import annotations

from collections.abc import Iterable


def span(ranks: Iterable[int]) -> str:
    """Sorted ranks with consecutive runs collapsed: "0-2,4-5,7"."""
    out: list[str] = []
    run: list[int] = []
    for r in sorted(set(ranks)):
        if run and r == run[-1] + 1:
            run.append(r)
            continue
        if run:
            out.append(str(run[0]) if len(run) == 1 else f"{run[0]}-{run[-1]}")
        run = [r]
    if run:
        out.append(str(run[0]) if len(run) == 1 else f"{run[0]}-{run[-1]}")
    return ",".join(out)


def ranks_phrase(ranks: Iterable[int]) -> str:
    """"rank 3" or "ranks 0-2,4"."""
    ranks = sorted(set(ranks))
    return f"rank {ranks[0]}" if len(ranks) == 1 else f"ranks {span(ranks)}"
