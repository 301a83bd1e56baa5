"""The cache of tokenised data: a hit on the second run, a miss when the data, the tokenisation keys or the
tokenizer change, a damaged entry rebuilt, off by config or environment; and a real run that uses it."""

from __future__ import annotations

import copy
import dataclasses
import json
from pathlib import Path

import pytest

from shardfit.config import Config
from shardfit.data.cache import cache_dir, cached_encode_split
from shardfit.data.dataset import encode_split, read_split
from shardfit.data.tokenize import ensure_chat_template
from tests.helpers import run_cli, write_config


@pytest.fixture
def cache_home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    monkeypatch.delenv("SHARDFIT_DATA_CACHE", raising=False)
    return tmp_path / "xdg"


@pytest.fixture
def tok(tokenizer):
    tok = copy.deepcopy(tokenizer)
    ensure_chat_template(tok)
    return tok


def _encode(cfg: Config, tok):
    return cached_encode_split(cfg, tok, read_split(cfg))


def _data(tmp_path: Path, small_data: Path, rows: int = 16) -> Path:
    f = tmp_path / "d.jsonl"
    f.write_text("\n".join(small_data.read_text().splitlines()[:rows]) + "\n")
    return f


def test_hit_equals_a_fresh_tokenisation(tmp_path: Path, small_data: Path, tok, cache_home: Path) -> None:
    cfg = Config(data=str(_data(tmp_path, small_data)), eval_split=0.25, max_seq_len=72)
    first = _encode(cfg, tok)
    assert not first.hit and first.path is not None and first.path.parent == cache_dir()
    assert str(first.path).startswith(str(cache_home))
    second_split = read_split(cfg)
    second = cached_encode_split(cfg, tok, second_split)
    assert second.hit and second.path == first.path
    want_train, want_eval = encode_split(cfg, tok, read_split(cfg))
    assert [dataclasses.astuple(e) for e in second.train] == [dataclasses.astuple(e) for e in want_train]
    assert [dataclasses.astuple(e) for e in second.eval] == [dataclasses.astuple(e) for e in want_eval]
    assert second_split.stats.truncated > 0  # the row account of the tokenisation comes back with the hit


def test_miss_when_data_tokenizer_or_max_seq_len_change(tmp_path: Path, small_data: Path, tok, cache_home) -> None:
    data = _data(tmp_path, small_data)
    cfg = Config(data=str(data), max_seq_len=256)
    base = _encode(cfg, tok)
    assert _encode(cfg, tok).hit
    assert not _encode(dataclasses.replace(cfg, max_seq_len=128), tok).hit
    data.write_text(data.read_text().replace("ext=", "extension=", 1))  # same path, new content
    changed = _encode(cfg, tok)
    assert not changed.hit and changed.path != base.path
    other_tok = copy.deepcopy(tok)
    other_tok.chat_template = "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
    assert not _encode(cfg, other_tok).hit


@pytest.mark.parametrize("damage", [b"", b"not a zip file", "truncate"])
def test_damaged_entry_is_rebuilt(tmp_path: Path, small_data: Path, tok, cache_home, damage) -> None:
    cfg = Config(data=str(_data(tmp_path, small_data)), max_seq_len=256)
    first = _encode(cfg, tok)
    raw = first.path.read_bytes()
    first.path.write_bytes(raw[: len(raw) // 2] if damage == "truncate" else damage)
    again = _encode(cfg, tok)
    assert not again.hit and [e.input_ids for e in again.train] == [e.input_ids for e in first.train]
    assert _encode(cfg, tok).hit  # rewritten whole


def test_off_by_config_or_environment(tmp_path: Path, small_data: Path, tok, cache_home,
                                      monkeypatch: pytest.MonkeyPatch) -> None:
    cfg = Config(data=str(_data(tmp_path, small_data)), max_seq_len=256)
    off = _encode(dataclasses.replace(cfg, data_cache=False), tok)
    assert not off.hit and off.path is None and not cache_home.exists()
    monkeypatch.setenv("SHARDFIT_DATA_CACHE", "0")
    assert _encode(cfg, tok).path is None and not cache_home.exists()


def test_unwritable_cache_dir_only_costs_the_cache(tmp_path: Path, small_data: Path, tok,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("")
    monkeypatch.setenv("XDG_CACHE_HOME", str(blocker))  # a file where the folder should be
    cfg = Config(data=str(_data(tmp_path, small_data)), max_seq_len=256)
    assert len(_encode(cfg, tok).train) == 16 and not _encode(cfg, tok).hit


@pytest.mark.slow
@pytest.mark.heavy  # the encoder's cache hit is held above without training
def test_second_run_reads_the_cache(tmp_path: Path, tiny_llama: Path, small_data: Path) -> None:
    """Two real runs: the second says it used the cache and trains exactly as the first."""
    env = {"XDG_CACHE_HOME": str(tmp_path / "xdg"), "SHARDFIT_DATA_CACHE": "1"}
    summaries = []
    for name in ("a", "b"):
        cfg = write_config(tmp_path / f"{name}.yaml", model=str(tiny_llama), data=str(small_data), method="lora",
                           precision="fp32", max_seq_len=128, micro_batch=2, max_steps=2, save_steps=100,
                           output_dir=str(tmp_path / name))
        r = run_cli("train", str(cfg), env=env)
        assert r.returncode == 0, r.stderr[-2000:]
        assert "start-up:" in r.stdout
        summaries.append(json.loads((tmp_path / name / "summary.json").read_text()))
    assert [s["data_cache_hit"] for s in summaries] == [False, True]
    assert "tokenise (cached)" in summaries[1]["startup_s"] and "first step" in summaries[1]["startup_s"]
    assert summaries[0]["train_loss"] == summaries[1]["train_loss"]
