"""Paths this user may not read: check and train refuse them alike (exit 2, naming the key and the fix), never with
an unexpected PermissionError. Tests run as root, which file modes do not stop, so the OS's refusal is simulated
for the paths inside one folder."""

from __future__ import annotations

import builtins
import errno
import os
from pathlib import Path

import pytest

from shardfit.cli.main import main
from tests.helpers import write_config


def _deny(monkeypatch: pytest.MonkeyPatch, inside: Path, reads_only: bool = False) -> None:
    """The OS refusing this user `inside` as for a folder of mode 000 (its own stat succeeds; it cannot be listed,
    and nothing in it can be looked at or opened); `reads_only`: `inside` is a file of mode 000 (its stat succeeds,
    opening it does not)."""
    def at(path: object) -> Path | None:
        return None if isinstance(path, int) else Path(os.fsdecode(path)).absolute()  # type: ignore[arg-type]

    def wrap(real, refused):  # noqa: ANN001, ANN202
        def probe(path, *args, **kwargs):  # noqa: ANN001, ANN202
            p = at(path)
            if p is not None and refused(p):
                raise PermissionError(errno.EACCES, "Permission denied", str(p))
            return real(path, *args, **kwargs)
        return probe

    def reading(p: Path) -> bool:
        return p == inside or (not reads_only and inside in p.parents)

    for module, name in ((builtins, "open"), (os, "open"), (os, "listdir"), (os, "scandir")):
        monkeypatch.setattr(module, name, wrap(getattr(module, name), reading))
    if not reads_only:
        monkeypatch.setattr(os, "stat", wrap(os.stat, lambda p: inside in p.parents))


def _both(tmp_path: Path, capsys: pytest.CaptureFixture, model: Path | str, data: str) -> list[tuple[int, str]]:
    cfg = str(write_config(tmp_path / "c.yaml", model=str(model), data=data, precision="fp32", max_seq_len=64,
                           max_steps=1, output_dir=str(tmp_path / "run")))
    out = []
    for command in ("check", "train"):
        code = main([command, cfg])
        text = capsys.readouterr()
        out.append((code, text.err + text.out))
    return out


def test_an_unreadable_data_file_is_the_same_exit_2_from_check_and_train(tmp_path: Path, tiny_llama: Path,
                                                                        small_data: Path,
                                                                        capsys: pytest.CaptureFixture,
                                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    """check said 'cannot read the data file' without the key; train, which hashes the data before it reads it,
    died with an unexpected PermissionError (exit 1). Both now refuse at load, naming the line, key and fix."""
    locked = tmp_path / "locked.jsonl"
    locked.write_text(small_data.read_text())
    _deny(monkeypatch, locked, reads_only=True)
    check, train = _both(tmp_path, capsys, tiny_llama, str(locked))
    want = f"c.yaml:2: 'data' {locked} cannot be read on"
    assert check[0] == train[0] == 2, (check, train)
    assert want in check[1] and want in train[1] and "give this user read access" in train[1], (check, train)


def test_a_typo_under_a_folder_this_user_may_not_enter_is_no_traceback(tmp_path: Path, tiny_llama: Path,
                                                                       small_data: Path,
                                                                       capsys: pytest.CaptureFixture,
                                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    """`dat/train.jsonl` beside a `data/` of mode 000: looking for the typo's match raised PermissionError from
    both commands; the path is now only not found (a warning of check, exit 2 from train)."""
    locked = tmp_path / "data"
    locked.mkdir()
    (locked / "train.jsonl").write_text(small_data.read_text())
    _deny(monkeypatch, locked)
    check, train = _both(tmp_path, capsys, tiny_llama, str(tmp_path / "dat" / "train.jsonl"))
    assert check[0] == 0 and train[0] == 2 and "file not found" in train[1], (check, train)
    assert "unexpected" not in check[1] + train[1], (check, train)


def test_a_model_folder_this_user_may_not_read_is_the_same_exit_2(tmp_path: Path, tiny_llama: Path,
                                                                  small_data: Path, capsys: pytest.CaptureFixture,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    """A model folder of mode 000: its stat succeeds, so it was taken as here, and probing its config.json raised
    PermissionError from both commands."""
    _deny(monkeypatch, tiny_llama)
    check, train = _both(tmp_path, capsys, tiny_llama, str(small_data))
    want = f"'model': {tiny_llama} cannot be read on"
    assert check[0] == train[0] == 2 and want in check[1] and want in train[1], (check, train)
