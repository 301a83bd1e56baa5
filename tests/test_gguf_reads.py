"""One parse of a GGUF file per load (models/gguf_reads.py): the demo's first run parsed the bundled GGUF three
times (its config, its tokenizer, its weights), seconds each on a 2-core CPU. Counted on a tiny GGUF written here,
with the model cache empty (a first run) and off; the loads are bitwise those of the unshared path."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import gguf
import pytest
import torch

from shardfit.config import Config
from shardfit.demo.run import load_base
from shardfit.models import gguf_cache
from shardfit.models.build import build_model, load_tokenizer
from shardfit.models.gguf_reads import GGUFReads
from shardfit.models.source import resolve_model
from tests.helpers import train_here, write_config
from tests.test_model_cache import make_tiny_gguf


@pytest.fixture
def tiny_gguf(tmp_path: Path) -> Path:
    (tmp_path / "models").mkdir()
    return make_tiny_gguf(tmp_path / "models" / "tiny.gguf")


@pytest.fixture
def parses(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The paths of every GGUF parse in the test, whoever makes it (transformers' loaders all build a GGUFReader)."""
    seen: list[str] = []
    original = gguf.GGUFReader.__init__

    def counting(self: Any, path: Any, *args: Any, **kwargs: Any) -> None:
        seen.append(str(path))
        original(self, path, *args, **kwargs)

    monkeypatch.setattr(gguf.GGUFReader, "__init__", counting)
    return seen


def _state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def _cfg(path: Path) -> Config:
    return Config(model=str(path), method="lora", precision="fp32")


@pytest.mark.parametrize("cache", ["empty", "off"])
def test_the_demo_load_parses_the_gguf_once(tiny_gguf: Path, tmp_path: Path, cache: str,
                                            monkeypatch: pytest.MonkeyPatch, parses: list[str]) -> None:
    monkeypatch.setenv(gguf_cache.ENV, "0")
    plain_tok = load_tokenizer(resolve_model(str(tiny_gguf)))
    plain = _state(build_model(_cfg(tiny_gguf), "single", weights=True))
    assert len(parses) >= 3  # config, tokenizer and weights: each parsed the whole file

    parses.clear()
    monkeypatch.setenv(gguf_cache.ENV, "0" if cache == "off" else str(tmp_path / "cache"))
    tok, model, _ = load_base(_cfg(tiny_gguf), experts=None)
    assert parses == [str(tiny_gguf)]
    shared = _state(model)
    assert shared.keys() == plain.keys()
    assert all(shared[k].dtype == plain[k].dtype and torch.equal(shared[k], plain[k]) for k in plain)
    text = "hello tt"
    assert tok(text)["input_ids"] == plain_tok(text)["input_ids"]
    assert tok.chat_template == plain_tok.chat_template and tok.pad_token_id == plain_tok.pad_token_id


def test_reads_are_shared_only_in_scope_and_a_changed_file_is_parsed_again(tiny_gguf: Path,
                                                                         parses: list[str]) -> None:
    reads = GGUFReads()
    with reads.shared():
        first = gguf.GGUFReader(str(tiny_gguf))
        assert gguf.GGUFReader(tiny_gguf) is first  # str or Path: the same file
        make_tiny_gguf(tiny_gguf, seed=1)  # rewritten in place: same path and size, a new mtime
        os.utime(tiny_gguf, ns=(tiny_gguf.stat().st_atime_ns, tiny_gguf.stat().st_mtime_ns + 10**9))
        assert gguf.GGUFReader(str(tiny_gguf)) is not first
    assert len(parses) == 2
    assert isinstance(gguf.GGUFReader, type)  # the scope gave the class back
    gguf.GGUFReader(str(tiny_gguf))
    assert len(parses) == 3  # outside the scope every read parses
    with reads.shared():  # the object keeps its parses for its owner's next scope
        gguf.GGUFReader(str(tiny_gguf))
    assert len(parses) == 3
    reads.clear()
    with reads.shared():
        gguf.GGUFReader(str(tiny_gguf))
    assert len(parses) == 4


def test_a_scope_gives_the_reader_back_when_a_load_fails(tiny_gguf: Path) -> None:
    original = gguf.GGUFReader
    with pytest.raises(RuntimeError), GGUFReads().shared():
        raise RuntimeError("a load that fails")
    assert gguf.GGUFReader is original


def test_a_run_on_a_gguf_file_parses_it_once(tiny_gguf: Path, tmp_path: Path, small_data: Path,
                                             monkeypatch: pytest.MonkeyPatch, parses: list[str]) -> None:
    """`shardfit train` on a .gguf file, its first run (an empty model cache): the tokenizer, the config, the
    weights and the adapter's base name (the GGUF's metadata) all from one parse."""
    monkeypatch.setenv(gguf_cache.ENV, str(tmp_path / "cache"))
    cfg = write_config(tmp_path / "run.yaml", model=str(tiny_gguf), data=str(small_data), method="lora",
                       precision="fp32", max_seq_len=512, micro_batch=1, max_steps=1, save_steps=100,
                       output_dir=str(tmp_path / "run"))
    train_here(cfg)
    assert parses == [str(tiny_gguf)]
