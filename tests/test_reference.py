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
