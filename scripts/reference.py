"""The generated parts of docs/reference.md, from the code itself: commands (argparse), exit codes (errors.py),
strategies (strategy.py), config keys (the schema's `help` metadata), JSON fields (the dataclasses that are
serialised: plan, check, doctor) and diagnose categories (causes.yaml).

`python scripts/reference.py --write` rewrites each block between `<!-- generated: NAME -->` and
`<!-- end: NAME -->` in docs/reference.md; tests/test_reference.py fails when a block differs from what the code
says, so the reference cannot drift.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import re
import sys
import typing
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "src"))

from shardfit import errors  # noqa: E402
from shardfit.check.findings import Finding  # noqa: E402
from shardfit.cli.main import build_parser  # noqa: E402
from shardfit.config.schema import CHOICES, Config, LoraSettings, QLoraSettings  # noqa: E402
from shardfit.diagnose.engine import load_causes  # noqa: E402
from shardfit.doctor.facts import GpuFacts, RankFacts  # noqa: E402
from shardfit.doctor.launch import Launch  # noqa: E402
from shardfit.doctor.report import Timing  # noqa: E402
from shardfit.plan.estimate import Breakdown, Candidate  # noqa: E402
from shardfit.plan.pipeline import PipelinePlan  # noqa: E402
from shardfit.plan.plan import ModelInfo  # noqa: E402
from shardfit.plan.workload import Workload  # noqa: E402
from shardfit.resolve.job import Resolved  # noqa: E402
from shardfit.strategy import TABLE  # noqa: E402

REFERENCE = ROOT / "docs" / "reference.md"
BLOCK = re.compile(r"(<!-- generated: (?P<name>[\w-]+) -->\n)(?P<body>.*?)(<!-- end: (?P=name) -->)", re.S)


def commands() -> str:
    """Every subcommand's usage line, as `--help` prints it."""
    parser = build_parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    out = ["```"]
    for p in sub.choices.values():
        usage = " ".join(p.format_usage().split())
        out.append(usage.removeprefix("usage: "))
        if p.epilog:
            out += [f"    {line.strip()}" for line in p.epilog.splitlines()]
    out.append("```")
    return "\n".join(out)


def exit_codes() -> str:
    rows = ["| code | meaning |", "|---|---|", "| 0 | success (diagnose: also when no known cause matched) |"]
    for cls in (errors.ShardfitError, errors.JobFailed, errors.UserError, errors.DoesNotFitError, errors.Interrupted):
        rows.append(f"| {cls.exit_code} | `{cls.__name__}`: {' '.join((cls.__doc__ or '').split())} |")
    return "\n".join(rows)


def strategies() -> str:
    def mark(b: bool) -> str:
        return "yes" if b else "-"

    rows = ["| strategy | what is replicated / sharded | engine | shards params | shards grads | shards optimizer "
            "| reshard after forward | offload | ranks | `--simulate` |", "|---" * 10 + "|"]
    for s in TABLE:
        rows.append(f"| `{s.name}` | {s.summary} | {s.engine} | {mark(s.shards_params)} | {mark(s.shards_grads)} | "
                    f"{mark(s.shards_optimizer)} | {mark(s.reshard_after_forward)} | {mark(s.offload)} | "
                    f"{'one per GPU (torchrun)' if s.multi_rank else 'one process'} | {mark(s.simulable)} |")
    rows.append("| `auto` | the planner's recommendation (one process: `single`) | | | | | | | | |")
    return "\n".join(rows)


def _type(hint: typing.Any) -> str:
    if typing.get_origin(hint) is typing.Union:  # `int | Literal["auto"]` as a config file spells it
        return " | ".join(_type(arm) for arm in typing.get_args(hint))
    if typing.get_origin(hint) is typing.Literal:
        return " | ".join(str(v) for v in typing.get_args(hint))
    return str(hint).replace("typing.", "").replace("<class '", "").replace("'>", "")


def _cell(text: str) -> str:
    """Text for a markdown table cell (a bare | would end the cell)."""
    return text.replace("|", "\\|")


def _default(f: dataclasses.Field) -> str:
    if f.default is not dataclasses.MISSING:
        return json.dumps(f.default)
    value = f.default_factory()  # type: ignore[misc]
    return "(below)" if dataclasses.is_dataclass(value) else json.dumps(value)


def config_keys() -> str:
    rows = ["| key | type | default | meaning |", "|---|---|---|---|"]
    for cls, prefix in ((Config, ""), (LoraSettings, "lora."), (QLoraSettings, "qlora.")):
        hints = typing.get_type_hints(cls)
        for f in dataclasses.fields(cls):
            meaning = f.metadata.get("help", "")
            if prefix + f.name in CHOICES:
                # YAML spelling: a bool choice reads true/false.
                names = [str(c).lower() if isinstance(c, bool) else c for c in CHOICES[prefix + f.name]]
                meaning += f" (one of: {', '.join(names)})"
            rows.append(f"| `{prefix}{f.name}` | {_cell(_type(hints[f.name]))} | `{_default(f)}` | {_cell(meaning)} |")
    return "\n".join(rows)


def _fields(cls: type) -> str:
    hints = typing.get_type_hints(cls)
    return ", ".join(f"`{f.name}` ({_type(hints[f.name])})" for f in dataclasses.fields(cls) if f.name != "extra")


def json_fields() -> str:
    return "\n".join([
        f"- plan `model`: {_fields(ModelInfo)}",
        f"- plan `workload`: {_fields(Workload)}",
        f"- plan `candidates[]`: {_fields(Candidate)}",
        f"- plan `candidates[].per_gpu_gib`: {_fields(Breakdown)}",
        f"- plan `pipeline` (on several GPUs; the layout to train): {_fields(PipelinePlan)}, `layout` (str), "
        "`note` (str: what train says against it, empty when it runs it), `recommended` (bool: recommended over the "
        "strategies), `versus` (str: why, in numbers), `layouts` (list: every layout planned, each with the fields "
        "above up to `layout`)",
        f"- plan `resolved` (`plan CONFIG`: the job train would run, `auto` settled): {_fields(Resolved)}",
        f"- check `findings[]`: {_fields(Finding)}",
        f"- doctor `launch`: {_fields(Launch)}",
        f"- doctor `ranks[]`: {_fields(RankFacts)}, `device` (str)",
        f"- doctor `ranks[].gpu`: {_fields(GpuFacts)}",
        f"- doctor `links[]`: {_fields(Timing)}",
    ])


def categories() -> str:
    return "\n".join(f"- `{c.id}`: {c.title}" for c in load_causes())


SECTIONS = {"commands": commands, "exit-codes": exit_codes, "strategies": strategies, "config-keys": config_keys,
            "json-fields": json_fields, "categories": categories}


def render(text: str) -> str:
    """`text` with every generated block replaced by what the code says now."""
    def fill(m: re.Match) -> str:
        name = m.group("name")
        if name not in SECTIONS:
            raise KeyError(f"docs/reference.md names an unknown generated block '{name}'")
        return m.group(1) + SECTIONS[name]() + "\n" + m.group(4)

    return BLOCK.sub(fill, text)


def main() -> int:
    text = REFERENCE.read_text()
    new = render(text)
    if "--write" in sys.argv:
        REFERENCE.write_text(new)
        return 0
    if new != text:
        print("docs/reference.md is out of date: run python scripts/reference.py --write", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
