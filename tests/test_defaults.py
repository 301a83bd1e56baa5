"""`compile: auto` and `attn_implementation: auto`: the measured rules, and the config keys that take them."""

from __future__ import annotations

from pathlib import Path

import pytest

from shardfit.config import Config, load_config
from shardfit.errors import UserError
from shardfit.parallel.defaults import (
    EAGER_ATTENTION_MAX_LEN,
    resolve_attention,
    resolve_compile,
    resolve_speed_settings,
)


def test_compile_auto_only_where_it_pays() -> None:
    assert resolve_compile("auto", "cpu", packing=True) is False
    assert resolve_compile("auto", "cpu", packing=False) is False
    assert resolve_compile("auto", "cuda", packing=True) is False  # static shapes would undo packing
    assert resolve_compile("auto", "cuda", packing=False) is True
    assert resolve_compile(True, "cpu", packing=True) is True and resolve_compile(False, "cuda", False) is False


def test_attention_auto_follows_device_compile_and_row_shape() -> None:
    assert resolve_attention("auto", "cpu", True, 256, compiled=True) == "eager"
    assert resolve_attention("auto", "cpu", True, 256, compiled=False) == "auto"  # uncompiled eager is slower
    assert resolve_attention("auto", "cpu", True, EAGER_ATTENTION_MAX_LEN + 1, compiled=True) == "auto"
    assert resolve_attention("auto", "cpu", False, 256, compiled=True) == "auto"  # no mask: SDPA's causal kernel
    assert resolve_attention("auto", "cuda", True, 256, compiled=True) == "auto"
    assert resolve_attention("sdpa", "cpu", True, 256, compiled=True) == "sdpa"  # an explicit choice is kept


def test_resolved_config_and_the_keys(tmp_path: Path) -> None:
    cfg = resolve_speed_settings(Config(max_seq_len=256), "cpu")
    assert cfg.compile is False and cfg.attn_implementation == "auto"
    forced = resolve_speed_settings(Config(max_seq_len=256, compile=True), "cpu")
    assert forced.compile is True and forced.attn_implementation == "eager"
    assert resolve_speed_settings(Config(packing=False), "cuda").compile is True
    f = tmp_path / "c.yaml"
    f.write_text("model: m\ndata: d.jsonl\ncompile: auto\n")
    assert load_config(f, check_files=False).compile == "auto"
    assert load_config(f, ["compile=true"], check_files=False).compile is True
    f.write_text("model: m\ndata: d.jsonl\ncompile: sometimes\n")
    with pytest.raises(UserError, match=r"c.yaml:3: 'compile' is 'sometimes'.*choose one of: auto, true, false"):
        load_config(f, check_files=False)
