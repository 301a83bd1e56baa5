"""`plan --model ORG/NAME` for a model that is not in the catalog but was downloaded before: its config.json is read
from the local Hugging Face cache (the snapshot refs/main names), offline, and only as JSON."""

from __future__ import annotations

import json
from pathlib import Path

import huggingface_hub.constants
import pytest

from shardfit.cli.main import main
from shardfit.errors import UserError
from shardfit.plan.shapes import cached_config_path, resolve_shape

LLAMA = {"model_type": "llama", "architectures": ["LlamaForCausalLM"], "num_hidden_layers": 6, "hidden_size": 512,
         "intermediate_size": 1376, "num_attention_heads": 8, "num_key_value_heads": 2, "vocab_size": 32000,
         "tie_word_embeddings": False, "max_position_embeddings": 4096}


def _cache(root: Path, repo: str, config: dict | str, revision: str = "0123abcd") -> Path:
    """A hub cache as huggingface_hub lays it out: models--ORG--NAME/refs/main and snapshots/<revision>/."""
    folder = root / ("models--" + repo.replace("/", "--"))
    (folder / "refs").mkdir(parents=True)
    (folder / "refs" / "main").write_text(revision)
    snap = folder / "snapshots" / revision
    snap.mkdir(parents=True)
    (snap / "config.json").write_text(config if isinstance(config, str) else json.dumps(config))
    return snap / "config.json"


@pytest.fixture
def hub(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path))
    return tmp_path


def test_a_downloaded_model_plans_from_its_cached_config(hub: Path) -> None:
    _cache(hub, "acme/tiny-llama", LLAMA)
    shape = resolve_shape("acme/tiny-llama")
    assert (shape.layers, shape.hidden, shape.intermediate, shape.kv_heads, shape.vocab) == (6, 512, 1376, 2, 32000)


def test_the_snapshot_refs_main_names_is_read(hub: Path) -> None:
    """An older snapshot beside the current one is not what the plan reads."""
    _cache(hub, "acme/tiny-llama", LLAMA, revision="new")
    old = hub / "models--acme--tiny-llama" / "snapshots" / "old"
    old.mkdir()
    (old / "config.json").write_text(json.dumps({**LLAMA, "num_hidden_layers": 2}))
    assert resolve_shape("acme/tiny-llama").layers == 6


def test_the_catalog_comes_first(hub: Path) -> None:
    """A cached config of a catalog id does not change the plan: plans stay the same on every machine."""
    _cache(hub, "meta-llama/Llama-3.1-8B", LLAMA)
    assert resolve_shape("meta-llama/Llama-3.1-8B").layers == 32


def test_plan_names_the_cached_file_when_it_is_broken(hub: Path, capsys: pytest.CaptureFixture) -> None:
    path = _cache(hub, "acme/broken", "{not json")
    assert main(["plan", "--model", "acme/broken", "--gpus", "1x24GB"]) == 2
    err = capsys.readouterr().err
    assert str(path) in err and "not a valid config.json" in err and "Traceback" not in err


def test_nothing_cached_is_still_refused_with_a_hint(hub: Path) -> None:
    with pytest.raises(UserError, match="not in the local Hugging Face cache and not in the bundled catalog"):
        resolve_shape("acme/never-downloaded")


@pytest.mark.parametrize("model", ["./acme/tiny-llama", "acme/../../etc", "a/b/c/d", "model.gguf", ""])
def test_what_is_not_a_hub_id_is_not_looked_up(hub: Path, model: str) -> None:
    _cache(hub, "acme/tiny-llama", LLAMA)
    assert cached_config_path(model) is None


@pytest.mark.parametrize("model", ["a" * 5000, "~no-such-user-here/tiny-llama", "~no-such-user-here"])
def test_an_id_no_path_lookup_can_take_ends_in_a_message(hub: Path, model: str,
                                                        capsys: pytest.CaptureFixture) -> None:
    """A name longer than the file system allows, or `~user` for no such user, makes pathlib raise (not return
    False): the plan says the model is unknown instead of reporting a bug."""
    assert main(["plan", "--model", model, "--gpus", "1x24GB"]) == 2
    err = capsys.readouterr().err
    assert "not in the bundled catalog" in err and "bug in shardfit" not in err


def test_a_cache_entry_that_cannot_be_listed_is_nothing_cached(hub: Path) -> None:
    """huggingface_hub lists `snapshots/` without guarding it: a file there (or one the user may not read) raises
    OSError, which must read as nothing cached, not a traceback."""
    folder = hub / "models--acme--odd"
    (folder / "refs").mkdir(parents=True)
    (folder / "refs" / "main").write_text("0123abcd")
    (folder / "snapshots").write_text("not a folder")
    assert cached_config_path("acme/odd") is None


def test_a_cached_config_saying_a_bad_size_names_the_cached_file(hub: Path, capsys: pytest.CaptureFixture) -> None:
    """The user named an id, not a file: an error about a key of the cached config.json says where that file is."""
    path = _cache(hub, "acme/no-width", {k: v for k, v in LLAMA.items() if k != "hidden_size"})
    assert main(["plan", "--model", "acme/no-width", "--gpus", "1x24GB"]) == 2
    err = capsys.readouterr().err
    assert "hidden_size" in err and str(path) in err and "Hugging Face cache" in err


def test_a_cached_config_that_is_a_link_to_its_blob_is_read(hub: Path) -> None:
    """The cache's real layout: snapshots/<revision>/config.json is a relative symlink into blobs/."""
    folder = hub / "models--acme--linked"
    (folder / "refs").mkdir(parents=True)
    (folder / "refs" / "main").write_text("0123abcd")
    (folder / "blobs").mkdir()
    (folder / "blobs" / "9f3c").write_text(json.dumps(LLAMA))
    (folder / "snapshots" / "0123abcd").mkdir(parents=True)
    (folder / "snapshots" / "0123abcd" / "config.json").symlink_to(Path("..") / ".." / "blobs" / "9f3c")
    assert resolve_shape("acme/linked").hidden == 512
