"""The planner against the third blind set (bench/published_blind3.yaml): published figures of real fine-tuning
runs, collected by someone who never saw a prediction; an out-of-sample measure, not tuned on.

    python bench/plan_vs_blind3.py         # prints the tables, writes bench/results/plan_vs_blind3.json

The method is the first blind set's (bench/plan_vs_blind.py, whose functions this reuses): each row is predicted
with what it states, the YAML's `unknown` defaults where it states nothing, and its source's mapping of model,
GPUs, strategy, precision and optimizer onto the planner's vocabulary. This set's rows also state their attention,
their LoRA targets and how their peak was read: those strings map through the source's `attentions` and `targets`
and the set's `readings`, with the set's `row_settings` (what a row's text states beyond its columns), into the
row's settings (plan_vs_blind.case_of `settings`). A row the planner cannot describe keeps its reason. The figures
are the first blind set's: memory error against the peak as read, fits-or-not verdicts, tokens/s error.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from pathlib import Path

BENCH = Path(__file__).resolve().parent
sys.path.insert(0, str(BENCH))

import plan_vs_blind as pvb  # noqa: E402

# A row's columns that map through a table of its source (column, table), beyond those case_of reads.
COLUMNS = (("attention", "attentions"), ("lora_targets", "targets"))


def mapped(value: object, table: dict, what: str) -> dict | None:
    """`value` through `table`: its entry; None for a value the table does not hold that states nothing (`unknown`,
    `n/a`, absent); a stated value the table does not hold is an error of the YAML, raised."""
    if value in table:
        return table[value]
    if pvb.known(value) and not str(value).startswith("n/a"):
        raise KeyError(f"{what} {value!r}: not in its table; map it (or say why it is not planned)")
    return None


def settings_of(index: int, row: dict, spec: dict) -> dict | str | None:
    """Row `index`'s settings beyond case_of's columns (attention, LoRA targets, the peak's reading, the set's
    `row_settings`), or the reason a planned-looking row is not planned (a target its source marks `not_planned`);
    None for a row case_of already does not plan (its model, strategy or method carries the reason)."""
    src = spec["sources"][pvb.source_of(row, spec)]
    # With the row's own settings: a length its column writes in words ("64K") is read from them alone.
    if isinstance(pvb.case_of(row, src, spec, spec.get("row_settings", {}).get(index)), str):
        return None
    out: dict = {}
    for column, table in COLUMNS:
        entry = mapped(row[column], src.get(table, {}), f"row {index} {column}")
        if entry and "not_planned" in entry:
            return " ".join(entry["not_planned"].split())
        out.update(entry or {})
    if row["peak_memory"]:
        out.update(mapped(row["peak_memory"].get("reading"), spec["readings"], f"row {index} reading") or {})
    out.update(spec.get("row_settings", {}).get(index, {}))
    return out


def row_evaluator(settings: Callable[[int, dict, dict], dict | str | None]) -> Callable[[int, dict, dict], dict]:
    """One row's evaluation for a set whose rows carry settings: the first blind set's with what `settings` reads
    for the row, or the row's reason for not being planned where `settings` gives one."""
    def evaluate_row(index: int, row: dict, spec: dict) -> dict:
        found = settings(index, row, spec)
        if isinstance(found, str):
            return {**pvb.row_head(index, row, pvb.source_of(row, spec)), "planned": False, "reason": found}
        return pvb.evaluate_row(index, row, spec, found)
    return evaluate_row


def set_runner(path: Path, out: Path, doc: str, settings: Callable[[int, dict, dict], dict | str | None]
               ) -> tuple[Callable[[dict], dict], Callable[[list[str] | None], None]]:
    """The `evaluate` and `main` of a blind set whose rows carry settings (this set's and the later ones'): rows
    of the set at `path` read by `settings` (row_evaluator), results written to `out`, the tables titled by the
    first paragraph of `doc` (the script's docstring)."""
    evaluate_row = row_evaluator(settings)

    def evaluate(spec: dict) -> dict:
        """Every row, the rows not planned with their reasons, and the summaries over all, per source and
        in-sample."""
        return pvb.evaluate(spec, path, evaluate_row)

    def main(argv: list[str] | None = None) -> None:
        """Print the set's tables and write its results."""
        pvb.run(argv, doc.split("\n\n")[0], path, out, evaluate, [pvb.markdown, pvb.docs_table, pvb.headline])

    return evaluate, main


def set_script(number: int, doc: str, settings: Callable[[int, dict, dict], dict | str | None]
               ) -> tuple[Path, Path, Callable[[dict], dict], Callable[[list[str] | None], None]]:
    """What the script of blind set `number` (the third on) binds: its SET (bench/published_blind<number>.yaml),
    its OUT (bench/results/plan_vs_blind<number>.json), and the `evaluate` and `main` of set_runner over them, with
    the script's docstring `doc` and its row reader `settings`."""
    path, out = BENCH / f"published_blind{number}.yaml", BENCH / "results" / f"plan_vs_blind{number}.json"
    return (path, out, *set_runner(path, out, doc, settings))


SET, OUT, evaluate, main = set_script(3, __doc__, settings_of)


if __name__ == "__main__":
    main()
