"""Config loading: overrides, types, and the exit-2 errors that name the file, line and key."""

from __future__ import annotations

from pathlib import Path

import pytest

from shardfit.config import load_config
from shardfit.errors import UserError
from tests.helpers import run_cli, write_config


def test_yaml_and_overrides(tmp_path: Path, small_data: Path) -> None:
    cfg_file = write_config(tmp_path / "c.yaml", model="m", data=str(small_data), lr="1e-4", lora={"rank": 4})
    cfg = load_config(cfg_file, ["lr=3e-5", "lora.rank=16", "strategy=zero3", "packing=false"])
    assert cfg.lr == pytest.approx(3e-5)
    assert cfg.lora.rank == 16 and cfg.lora.alpha == 16
    assert cfg.strategy == "zero3" and cfg.packing is False


def test_yaml_float_written_as_1e_minus_4(tmp_path: Path, small_data: Path) -> None:
    # PyYAML reads `1e-4` as a string; users mean a float.
    (tmp_path / "c.yaml").write_text(f"model: m\ndata: {small_data}\nlr: 1e-4\n")
    assert load_config(tmp_path / "c.yaml").lr == pytest.approx(1e-4)


@pytest.mark.parametrize(
    "text, expected",
    [
        ("model: m\nlerning_rate: 0.1\n", r"c.yaml:2: unknown config key 'lerning_rate'"),
        ("model: m\nmicro_batch: two\n", r"c.yaml:2: 'micro_batch' must be int"),
        ("model: m\nlora:\n  rnak: 4\n", r"c.yaml:3: unknown config key 'lora.rnak' \(did you mean 'rank'\?\)"),
        ("model: m\nstrategy: zero4\n", r"'strategy' is 'zero4' \(did you mean 'zero3'\?\)"),
        ("model: m\ndata: nowhere.jsonl\n", r"c.yaml:2: 'data' file not found: nowhere.jsonl"),
        ("model: [unclosed\n", r"c.yaml:\d+: not valid YAML"),
        ("- a\n- b\n", r"must be a mapping"),
        ("model: m\nmethod: freeze\n", r"'freeze_trainable' is empty"),
        ("model: m\nloss_chunk: big\n", r"c.yaml:2: 'loss_chunk' must be int or 'auto', got 'big'"),
        ("model: m\nloss_chunk: 0\n", r"c.yaml:2: 'loss_chunk' must be at least 1"),
    ],
)
def test_bad_config_names_file_line_key(tmp_path: Path, text: str, expected: str) -> None:
    (tmp_path / "c.yaml").write_text(text)
    with pytest.raises(UserError, match=expected):
        load_config(tmp_path / "c.yaml", check_files=True)


def test_loss_chunk_is_auto_or_a_number_of_rows() -> None:
    assert load_config(None, ["model=m"], check_files=False).loss_chunk == "auto"
    assert load_config(None, ["model=m", "loss_chunk=256"], check_files=False).loss_chunk == 256


def test_did_you_mean_for_unknown_key(tmp_path: Path) -> None:
    (tmp_path / "c.yaml").write_text("model: m\nmetod: lora\n")
    with pytest.raises(UserError, match=r"did you mean 'method'"):
        load_config(tmp_path / "c.yaml", check_files=False)


def test_bad_override_syntax() -> None:
    with pytest.raises(UserError, match="expected key=value"):
        load_config(None, ["lr"], check_files=False)


def test_cli_exit_code_2_without_traceback(tmp_path: Path, small_data: Path) -> None:
    cfg = write_config(tmp_path / "c.yaml", model="m", data=str(small_data), micro_batchs=2)
    r = run_cli("train", str(cfg), timeout=120)
    assert r.returncode == 2
    assert "unknown config key 'micro_batchs'" in r.stderr and "did you mean 'micro_batch'" in r.stderr
    assert "Traceback" not in r.stderr
    r = run_cli("train", str(cfg), "--set", "micro_batchs=3", "--set", "lr=oops", timeout=120)
    assert r.returncode == 2 and "Traceback" not in r.stderr
    r = run_cli("train", str(tmp_path / "missing.yaml"), timeout=120)
    assert r.returncode == 2 and "config file not found" in r.stderr
