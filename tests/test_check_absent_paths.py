"""Paths check cannot read here, and paths that are plainly wrong: an absent file is a warning of `check` (the run
may train where it is) that skips only what needs that file, while a typo beside the real path, or a folder given
as a data file, is exit 2 from `check` and `train` alike."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from shardfit.cli.main import main
from tests.helpers import write_config


def _run(argv: list[str], capsys: pytest.CaptureFixture) -> tuple[int, str]:
    code = main(argv)
    out = capsys.readouterr()
    return code, out.err + out.out


def _cfg(tmp_path: Path, model: Path | str, data: object, **keys: object) -> str:
    return str(write_config(tmp_path / "c.yaml", model=str(model), data=data, precision="fp32", max_seq_len=64,
                            micro_batch=2, max_steps=1, output_dir=str(tmp_path / "run"), **keys))


@pytest.mark.parametrize("absent_key", ["eval_data", "data"])
def test_an_absent_data_file_does_not_hide_a_broken_one_that_is_here(tmp_path: Path, tiny_llama: Path,
                                                                      capsys: pytest.CaptureFixture,
                                                                      absent_key: str) -> None:
    """One absent file (eval_data, or one of a `data:` list) switched off the reading of every data file, so a
    broken file that is here passed check (exit 0) while train refused it: the files here are read as before."""
    bad = tmp_path / "d.jsonl"
    bad.write_text('{"instruction": "hi", "output": "there"}\n{not json\n')
    gone = str(tmp_path / "elsewhere" / "held.jsonl")
    keys = {"eval_data": gone} if absent_key == "eval_data" else {}
    cfg = _cfg(tmp_path, tiny_llama, [str(bad), gone] if absent_key == "data" else str(bad), **keys)
    code, out = _run(["check", cfg], capsys)
    assert code == 2 and "not valid JSON" in out, out[-1500:]


def test_the_absent_eval_file_alone_is_warned_about(tmp_path: Path, tiny_llama: Path, small_data: Path,
                                                    capsys: pytest.CaptureFixture) -> None:
    """Good data here and an absent eval_data: exit 0, one warning naming that file, saying the files here were
    read, and `skipped` naming what was not."""
    gone = str(tmp_path / "elsewhere" / "held.jsonl")
    cfg = _cfg(tmp_path, tiny_llama, str(small_data), eval_data=gone, max_bad_rows=64)
    assert main(["check", cfg, "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    warned = [f for f in out["findings"] if f["rule"] == "data_not_here"]
    assert len(warned) == 1 and warned[0]["where"] == "config: eval_data", warned
    assert gone in warned[0]["message"] and "the data files that are here were" in warned[0]["message"]
    assert out["skipped"] == ["data: a 'eval_data' file is not here, so its rows were not read"], out["skipped"]


def _typo(name: str) -> str:
    """`name` with its last two letters swapped (train -> trian), keeping any suffix."""
    stem, dot, suffix = name.partition(".")
    return stem[:-2] + stem[-1] + stem[-2] + dot + suffix


@pytest.mark.parametrize("which", ["data-file", "data-folder", "model-folder"])
def test_a_typo_beside_the_real_path_is_exit_2_from_check_and_train(tmp_path: Path, tiny_llama: Path,
                                                                     small_data: Path,
                                                                     capsys: pytest.CaptureFixture,
                                                                     which: str) -> None:
    """The folder is here (the storage is mounted) and holds a name a keystroke away: a typo, not a login node's
    missing mount. check warned (exit 0) where train refused; both now refuse, naming the path meant."""
    model, data = tiny_llama, small_data
    if which == "data-file":
        data = small_data.parent / _typo(small_data.name)
    elif which == "data-folder":
        data = small_data.parent.parent / small_data.parent.name[1:] / small_data.name  # data0 -> ata0
    else:
        model = tiny_llama.parent / _typo(tiny_llama.name)
    meant = tiny_llama if which == "model-folder" else small_data
    cfg = _cfg(tmp_path, model, str(data), max_bad_rows=64)
    check = _run(["check", cfg], capsys)
    train = _run(["train", cfg], capsys)
    assert check[0] == train[0] == 2, (check, train)
    assert f"did you mean {meant}?" in check[1] and f"did you mean {meant}?" in train[1], (check, train)


def test_a_numbered_sibling_is_no_typo(tmp_path: Path, tiny_llama: Path, small_data: Path,
                                       capsys: pytest.CaptureFixture) -> None:
    """shard2.jsonl beside shard1.jsonl may be the next file of a series a queued job writes: still a warning, and
    `skipped` says that file's rows were not read (shard1's were), nor what only every row can tell."""
    (tmp_path / "shard1.jsonl").write_text(small_data.read_text())
    cfg = _cfg(tmp_path, tiny_llama, [str(tmp_path / "shard1.jsonl"), str(tmp_path / "shard2.jsonl")],
               max_bad_rows=64)
    code, out = _run(["check", cfg, "--json"], capsys)
    assert code == 0 and "did you mean" not in out, out[-1500:]
    skipped = json.loads(out)["skipped"]
    assert skipped[0] == "data: a 'data' file is not here, so its rows were not read", skipped
    assert skipped[1:] == ["data: not judged on the files that are here, as a data file is not: that at least one "
                           "row keeps an answer within max_seq_len"], skipped


def test_a_data_folder_is_exit_2_from_check_and_train_naming_the_key(tmp_path: Path, tiny_llama: Path,
                                                                      small_data: Path,
                                                                      capsys: pytest.CaptureFixture) -> None:
    """A folder as `data` was 'file not found' from check and an unexpected IsADirectoryError (exit 1) from
    train."""
    cfg = _cfg(tmp_path, tiny_llama, str(small_data.parent), max_bad_rows=64)
    check = _run(["check", cfg], capsys)
    train = _run(["train", cfg], capsys)
    want = f"'data' {small_data.parent} is a folder (it holds {small_data.name})"
    assert check[0] == train[0] == 2, (check, train)
    assert want in check[1] and want in train[1] and "unexpected" not in train[1], (check, train)


def test_without_the_model_check_says_memory_was_not_predicted(tmp_path: Path, small_data: Path,
                                                               capsys: pytest.CaptureFixture) -> None:
    """An absent model folder: no memory verdict exists, and `check --json` said only ok: true; `skipped` (and
    the text's `not checked:` line) now says the memory was not predicted."""
    cfg = _cfg(tmp_path, "/nonexistent/models/Llama-3.1-70B", str(small_data), max_bad_rows=64)
    assert main(["check", cfg, "--json", "--gpus", "1x24GB"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["skipped"] and out["skipped"][0].startswith("memory: not predicted, the model is not here"), out
    code, text = _run(["check", cfg, "--gpus", "1x24GB"], capsys)
    assert code == 0 and "not checked: memory: not predicted, the model is not here" in text, text[-1500:]
    assert "fits" not in text


def test_the_warning_for_a_relative_path_names_the_folders_searched(tmp_path: Path, tiny_llama: Path,
                                                                    small_data: Path, capsys: pytest.CaptureFixture,
                                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    """A relative data path is tried in the working directory, then the config's folder: the warning says so."""
    work = tmp_path / "work"
    work.mkdir()
    monkeypatch.chdir(work)
    cfg = _cfg(tmp_path, tiny_llama, str(small_data), eval_data="held/eval.jsonl", max_bad_rows=64)
    code, out = _run(["check", cfg], capsys)
    assert code == 0 and f"held/eval.jsonl (looked in {work} and {tmp_path})" in out, out[-1500:]
    code, out = _run(["train", cfg], capsys)
    assert code == 2 and f"(looked in {work} and {tmp_path})" in out, out[-1500:]
    assert os.getcwd() == str(work)


def test_a_new_file_that_shares_only_the_suffix_is_no_typo(tmp_path: Path, tiny_llama: Path,
                                                           capsys: pytest.CaptureFixture) -> None:
    """held.jsonl beside d.jsonl: alike only by `.jsonl`, so no typo; d.jsonl, which is here, is read (exit 2 on
    its bad row), and held.jsonl, absent, is only warned about."""
    bad = tmp_path / "d.jsonl"
    bad.write_text('{"instruction": "hi", "output": "there"}\n{not json\n')
    cfg = _cfg(tmp_path, tiny_llama, str(bad), eval_data=str(tmp_path / "held.jsonl"))
    code, out = _run(["check", cfg], capsys)
    assert code == 2 and "not valid JSON" in out and "did you mean" not in out, out[-1500:]
