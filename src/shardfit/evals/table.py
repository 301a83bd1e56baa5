"""`shardfit eval`'s printed table: the loss, perplexity and every metric of each model, side by side."""

from __future__ import annotations

from typing import Any


def _pct(v: float | None) -> str:
    return "-" if v is None else f"{v:.1%}"


def _num(v: float | None, fmt: str) -> str:
    return "-" if v is None else format(v, fmt)


def format_eval(result: dict[str, Any], samples: int = 3) -> str:
    """The table of `shardfit eval --json`'s object, with a few answers under it."""
    metrics = result["metrics"]
    header = f"  {'model':<10}{'loss':>9}{'ppl':>12}" + "".join(f"{m:>11}" for m in metrics)
    lines = [f"Held-out evaluation on {result['data']}: {result['examples']} examples, "
             f"{result['scored']} with an expected answer, {result['tokens']} assistant tokens", header]
    for name, col in result["models"].items():
        lines.append(f"  {name:<10}{_num(col['loss'], '.4f'):>9}{_num(col['perplexity'], '.2f'):>12}"
                     + "".join(f"{_pct(col['metrics'].get(m)):>11}" for m in metrics))
    lines += [f"  {name}: {col['label']}" for name, col in result["models"].items()]
    lines.append("")
    for item in result["samples"][:samples]:
        lines.append(f"  prompt:   {_short(item['prompt'])}")
        lines.append(f"  expected: {_short(item['expected'] or '')}")
        for name in result["models"]:
            ok = item[name]["scores"]
            mark = "  " + " ".join(f"{k}={'OK' if v == 1 else v}" for k, v in ok.items()) if ok else ""
            lines.append(f"  {name + ':':<10}{_short(item[name]['answer'])}{mark}")
        lines.append("")
    return "\n".join(lines)


def _short(text: str, n: int = 100) -> str:
    text = " ".join(text.split())
    return text if len(text) <= n else text[: n - 3] + "..."
