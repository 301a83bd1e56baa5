"""`compile: auto`, `attn_implementation: auto` and `precision: auto`: the measured rules, and the config keys that
take them."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from shardfit.config import Config, load_config
from shardfit.errors import UserError
from shardfit.parallel.defaults import (
    EAGER_ATTENTION_MAX_LEN,
    resolve_attention,
    resolve_compile,
    resolve_speed_settings,
)
from shardfit.parallel.env import fast_cpu_bf16, resolve_precision


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


# Imports first (a starved process would spend minutes on them), then the decision, once the machine is busy.
_PRECISION = """
import sys
from shardfit.parallel.env import resolve_precision
print("ready", flush=True)
sys.stdin.readline()
print(resolve_precision("auto", "cpu"), flush=True)
"""


def test_precision_auto_on_cpu_holds_under_load() -> None:
    """`precision: auto` on a CPU compares bf16 and fp32 matmuls in one thread's CPU time: a low-priority process
    on a machine busy with other work decides as a quiet one does, and the thread count is left as it was."""
    threads = torch.get_num_threads()
    quiet = resolve_precision("auto", "cpu")
    assert quiet == ("bf16" if fast_cpu_bf16() else "fp32") and torch.get_num_threads() == threads
    child = subprocess.Popen(["nice", "-n", "10", sys.executable, "-c", _PRECISION], stdin=subprocess.PIPE,
                             stdout=subprocess.PIPE, text=True, env=dict(os.environ, OMP_NUM_THREADS="2"))
    busy: list[subprocess.Popen] = []
    try:
        assert child.stdout is not None and child.stdin is not None
        assert child.stdout.readline().strip() == "ready"
        busy = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(2 * (os.cpu_count() or 1))]
        child.stdin.write("go\n")
        child.stdin.flush()
        loaded = child.stdout.readline().strip()
    finally:
        for p in [*busy, child]:
            p.kill()
    assert loaded == quiet
