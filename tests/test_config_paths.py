"""A data or model path with nothing at it: refused as a typo only when the name here is surely the one meant,
and refused as no path at all (a wildcard, a looping link, a hub dataset id, a model URL) by the config's loading,
which check and train share; another file of a set (val beside eval, shard_b beside shard_a) stays check's
warning."""

from __future__ import annotations

import os
import re
from pathlib import Path

import pytest

from shardfit.config.load import NotHere, load_config
from shardfit.errors import UserError
from shardfit.models.source import absent_here, resolve_model
from tests.helpers import write_config


def _load(tmp_path: Path, here: list[str], data: object, **keys: object) -> list[NotHere]:
    """The absent data files check lists for `data`, in a folder holding the files `here`."""
    folder = tmp_path / "d"
    folder.mkdir(exist_ok=True)
    for name in here:
        (folder / name).write_text('{"instruction": "a", "output": "b"}\n')
    values = [f"d/{v}" for v in data] if isinstance(data, list) else f"d/{data}"
    absent: list[NotHere] = []
    load_config(write_config(tmp_path / "c.yaml", model="m", data=values, **keys), absent=absent)
    return absent


@pytest.mark.parametrize(("here", "given"), [
    ("val.jsonl", "eval.jsonl"), ("train_en.jsonl", "train_de.jsonl"), ("shard_a.jsonl", "shard_b.jsonl"),
    ("train.jsonl", "train2.jsonl"), ("chat_clean.jsonl", "chat_clean_dedup.jsonl"), ("eval.jsonl", "evals.jsonl"),
    ("model-Q4_K_M.gguf", "model-Q4_K_S.gguf"), ("train_v1.jsonl", "train_v1b.jsonl"),
    ("samples.jsonl", "sample.jsonl"), ("chats.jsonl", "chat.jsonl"), ("pairs_clean.jsonl", "pair_clean.jsonl"),
])
def test_another_file_of_a_set_is_no_typo(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, here: str,
                                          given: str) -> None:
    """difflib's likeness refused these as typos (exit 2 from check), though each may be a file a queued job
    writes, or one only the training node mounts: they stay check's warning."""
    monkeypatch.chdir(tmp_path)
    absent = _load(tmp_path, [here], given)
    assert [a.path for a in absent] == [f"d/{given}"]


def test_a_sibling_the_same_list_names_is_never_the_match(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """data: [shard_a, shard_b] with shard_b not here was 'did you mean shard_a?', a file the list names."""
    monkeypatch.chdir(tmp_path)
    absent = _load(tmp_path, ["traiin.jsonl"], ["traiin.jsonl", "train.jsonl"])
    assert [a.path for a in absent] == ["d/train.jsonl"] and absent[0].near == "", absent


def test_a_close_name_that_is_not_surely_meant_is_named_in_the_warning(tmp_path: Path,
                                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    """eval.jsonl beside val.jsonl: not refused, but the warning names the file that is here."""
    monkeypatch.chdir(tmp_path)
    absent = _load(tmp_path, ["val.jsonl"], "eval.jsonl")
    assert absent[0].hint() == " A close name is here: did you mean d/val.jsonl?", absent


@pytest.mark.parametrize(("here", "given"), [
    ("train.jsonl", "trian.jsonl"), ("train.jsonl", "train.json"), ("train.jsonl", "traiin.jsonl"),
])
def test_a_typo_beside_the_file_is_refused(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, here: str,
                                           given: str) -> None:
    monkeypatch.chdir(tmp_path)
    with pytest.raises(UserError, match=f"did you mean d/{here}\\?"):
        _load(tmp_path, [here], given)


def test_a_typo_two_folders_up_is_refused(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """projetc/sft/train.jsonl beside project/sft/train.jsonl: only one folder up was looked at."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "project" / "sft").mkdir(parents=True)
    (tmp_path / "project" / "sft" / "train.jsonl").write_text("{}\n")
    with pytest.raises(UserError, match="did you mean .*project/sft/train.jsonl"):
        load_config(write_config(tmp_path / "c.yaml", model="m", data="projetc/sft/train.jsonl"), absent=[])


@pytest.mark.parametrize("model", ["./models/Qwen2.5-7B-Instrcut", "tree/models/Qwen2.5-7B-Instrcut"])
def test_a_typo_in_a_dotted_model_folder_is_refused(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                    model: str) -> None:
    """Qwen2.5-7B-Instrcut: Path.suffix took `.5-7B-Instrcut` for a suffix, so no sibling matched. A path of
    three parts is no hub id, so it is a local path without `./` too."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / Path(model).parent / "Qwen2.5-7B-Instruct").mkdir(parents=True)
    for probe in (absent_here, resolve_model):
        with pytest.raises(UserError, match="did you mean (./|tree/)?models/Qwen2.5-7B-Instruct\\?"):
            probe(model)


@pytest.mark.parametrize("model", ["Qwen/Qwen2.5-7B-Instruct", "Qwen/Qwen2.5-0.5", "Qwen/Qwen2.5-0.5B-Instrcut",
                                   "models/tni"])
def test_a_hub_id_stays_one_beside_a_folder_named_like_its_owner(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                                 model: str) -> None:
    """A project keeping a download as Qwen/Qwen2.5-0.5B (`--local-dir` named as the hub id) could name no other
    Qwen hub id: `Qwen/` here made every `Qwen/...` a missing local folder, which check warned about and train
    refused, and the answer hung on the cwd. An owner/name value is local only when something is at it or it is
    written from `./`, `../`, `/` or `~`."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "Qwen" / "Qwen2.5-0.5B").mkdir(parents=True)
    (tmp_path / "models" / "tiyn").mkdir(parents=True)
    assert not absent_here(model)
    assert resolve_model(model).folder == model
    assert absent_here("./Qwen/Qwen2.5-7B-Instruct")


def test_an_owner_name_value_a_sure_typo_of_a_folder_in_its_owner_folder_is_one(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """models/tiyn beside models/tiny was read as a hub id (an owner/name value stays one beside its owner's
    folder), so train said it could not download it, with no "did you mean". A sure typo of a name in the owner
    folder here is that folder's typo; another close name or a series keeps the hub id (the test above)."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "models" / "tiny").mkdir(parents=True)
    (tmp_path / "Qwen" / "Qwen2.5-0.5B-Instruct").mkdir(parents=True)
    for value, meant in (("models/tiyn", "models/tiny"), ("Qwen/Qwen2.5-0.5B-Instrcut", "Qwen/Qwen2.5-0.5B-Instruct")):
        for probe in (absent_here, resolve_model):
            with pytest.raises(UserError, match=f"does not exist; did you mean {meant}\\?"):
                probe(value)
    assert not absent_here("Qwen/Qwen2.5-7B-Instruct") and not absent_here("Qwen/Qwen2.5-0.5B")
    # A letter more or less at a word's end is a family's variant, not a typo: bloom beside a bloomz download.
    (tmp_path / "bigscience" / "bloomz-7b1").mkdir(parents=True)
    assert not absent_here("bigscience/bloom-7b1")
    assert resolve_model("bigscience/bloom-7b1").folder == "bigscience/bloom-7b1"


def test_another_model_is_no_typo_but_named(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """./models/mixtral-7b beside models/mistral-7b: another model; check warns, train's refusal names it."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "models" / "mistral-7b").mkdir(parents=True)
    assert absent_here("./models/mixtral-7b")
    with pytest.raises(UserError, match="does not exist.*did you mean ./models/mistral-7b\\?"):
        resolve_model("./models/mixtral-7b")


@pytest.mark.parametrize(("value", "said"), [
    ("d/*.jsonl", "is a wildcard pattern"), ("d/loop.jsonl", "is a symbolic link that loops"),
    ("tatsu-lab/alpaca", "is no file, and looks like a Hugging Face dataset id"),
])
def test_a_value_that_can_be_no_path_is_refused_as_check_loads_it(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                                   value: str, said: str) -> None:
    """check only warned (exit 0) where train refused: the config's loading, which both share, refuses it."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "d").mkdir()
    (tmp_path / "d" / "train.jsonl").write_text("{}\n")
    os.symlink("loop.jsonl", tmp_path / "d" / "loop.jsonl")
    with pytest.raises(UserError, match=re.escape(f"'data' {value} {said}")):
        load_config(write_config(tmp_path / "c.yaml", model="m", data=value), absent=[])


def test_a_dangling_link_names_its_target(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    (tmp_path / "d").mkdir()
    os.symlink("/nonexistent/x.jsonl", tmp_path / "d" / "link.jsonl")
    absent = _load(tmp_path, [], "link.jsonl")
    assert "(a link to /nonexistent/x.jsonl, which is not here)" in absent[0].describe(), absent


def test_a_model_url_is_the_same_refusal_from_both_probes() -> None:
    """train leaked transformers' 'Repo id must be in the form' for a model URL."""
    for probe in (absent_here, resolve_model):
        with pytest.raises(UserError, match="'model' is a URL"):
            probe("https://huggingface.co/org/name")


def test_the_folders_looked_in_are_normalised(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A config given as ../c.yaml said 'looked in /x/work and /x/work/..'."""
    (tmp_path / "work").mkdir()
    monkeypatch.chdir(tmp_path / "work")
    write_config(tmp_path / "c.yaml", model="m", data="held/train.jsonl")
    absent: list[NotHere] = []
    load_config("../c.yaml", absent=absent)
    assert absent[0].looked_in == (str(tmp_path / "work"), str(tmp_path)), absent


def test_a_bare_name_is_compared_in_the_working_directory(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A regression guard: the walk up from a bare name must reach the working directory (`.`)."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "train.jsonl").write_text("{}\n")
    with pytest.raises(UserError, match="did you mean train.jsonl\\?"):
        load_config(write_config(tmp_path / "c.yaml", model="m", data="trian.jsonl"), absent=[])


@pytest.mark.parametrize(("one", "other"), [("sample.jsonl", "samples.jsonl"), ("chat.jsonl", "chats.jsonl"),
                                            ("dataset", "datasets")])
def test_a_plural_is_named_alike_both_ways(one: str, other: str) -> None:
    """A dropped final s was a sure typo (exit 2) where an added one was a close name: a singular/plural pair is
    the same kind of set both ways, so each is named as a hint, never refused."""
    from shardfit.config.paths import likeness
    assert likeness(one, other) is False and likeness(other, one) is False
