"""docs/reference.md says what the code does: its generated blocks are what scripts/reference.py writes now."""

from __future__ import annotations

import importlib.util
import sys

from tests.helpers import ROOT


def _reference_module():
    spec = importlib.util.spec_from_file_location("reference", ROOT / "scripts" / "reference.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # dataclasses look their module up there
    spec.loader.exec_module(mod)
    return mod


def test_generated_blocks_are_up_to_date() -> None:
    ref = _reference_module()
    text = ref.REFERENCE.read_text()
    assert set(ref.BLOCK.findall(text) and [m.group("name") for m in ref.BLOCK.finditer(text)]) == set(ref.SECTIONS)
    assert ref.render(text) == text, "docs/reference.md is out of date: run python scripts/reference.py --write"


def test_every_config_key_and_command_is_in_the_reference() -> None:
    ref = _reference_module()
    text = ref.REFERENCE.read_text()
    for line in ref.config_keys().splitlines()[2:]:
        assert line in text
    for name in ("train", "plan", "check", "diagnose", "export"):
        assert f"shardfit {name} " in text


def test_the_from_section_of_plan_json_is_documented() -> None:
    """Every key of `plan --json --from`'s `from` object is named in its section of docs/reference.md."""
    from shardfit.foreign.asplanned import plan_job
    from shardfit.foreign.read import JobOptions, read_job
    from shardfit.plan.hardware import parse_gpus
    from shardfit.plan.shapes import resolve_shape

    job = read_job("llamafactory", str(ROOT / "tests/foreign_jobs/lf/qwen25_7b_qlora.yaml"), JobOptions())
    keys = plan_job(job, resolve_shape(job.model), parse_gpus("1x24GB")).to_json()["from"]
    section = _reference_module().REFERENCE.read_text().split("### `plan --json --from TOOL FILE`")[1].split("##")[0]
    assert keys and all(f"`{k}`" in section for k in keys), [k for k in keys if f"`{k}`" not in section]


def test_every_key_plan_adds_to_its_json_is_documented() -> None:
    """The keys `plan --json` adds beside the plan's own (cli/plan_cmd.py and plan_job.py `out[...] = ...`: the
    resumed run's refusal, media, ...) are each named in docs/reference.md's plan JSON section."""
    import re

    source = "".join(p.read_text() for p in sorted((ROOT / "src" / "shardfit" / "cli").glob("plan_*.py")))
    keys = set(re.findall(r'out\["(\w+)"\] = ', source))
    text = _reference_module().REFERENCE.read_text()
    section = text.split("## `shardfit plan --json`")[1].split("\n## ")[0]
    assert "resume_refused" in keys and all(f"`{k}`" in section for k in keys), \
        [k for k in keys if f"`{k}`" not in section]


def test_checks_exit_codes_are_documented() -> None:
    """`check`'s section says its exit codes: 1 when not ok, 3 for a resumed run refused before loading."""
    text = _reference_module().REFERENCE.read_text()
    section = text.split("## `shardfit check --json`")[1].split("\n## ")[0]
    assert "exit code is 0 when `ok`, 1 when not" in section and "exit 3" in section
