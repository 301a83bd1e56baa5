"""`shardfit check` on preference data: answers cut at max_seq_len (with the length that fits them), KTO data of
one kind, and preference rows handed to objective sft."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from shardfit.check.findings import is_ok
from shardfit.check.run import check_config
from shardfit.config import load_config
from shardfit.data.tokenize import encode_messages
from shardfit.errors import UserError
from tests.helpers import write_config

WORDS = "the quick brown fox jumps over the lazy dog while seven wizards quietly judge boxing matches "


def _write(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def _pair(i: int, prompt_words: int = 3) -> dict:
    return {"prompt": f"question {i}: " + " ".join(WORDS.split()[:prompt_words]),
            "chosen": f"a good answer {i}", "rejected": f"a bad answer {i}"}


def _check(tmp_path: Path, model: Path, data: Path, **over):
    keys = dict(model=str(model), data=str(data), max_seq_len=64, micro_batch=1, max_steps=1, precision="fp32",
                objective="dpo", max_bad_rows=0.5, output_dir=str(tmp_path / "run"))
    keys.update(over)
    return check_config(load_config(write_config(tmp_path / "c.yaml", **keys)))[1]


def _tokens(tokenizer, row: dict, side: str) -> int:
    messages = [{"role": "user", "content": row["prompt"]}, {"role": "assistant", "content": row[side]}]
    return len(encode_messages(tokenizer, messages, 10**9).input_ids)


def test_pairs_cut_at_max_seq_len_are_counted_with_the_length_that_fits(tmp_path: Path, tiny_llama: Path,
                                                                         tokenizer) -> None:
    """Two pairs whose answers are cut, one whose prompt leaves no answer token: one warning with both counts, the
    first file:line, and a max_seq_len (each side's prompt + answer, tokenised here) under which none is cut."""
    rows = [_pair(i) for i in range(6)]
    long_answer = WORDS * 2
    rows[2]["chosen"] = long_answer  # the chosen side alone runs past 64 tokens
    rows[4]["rejected"] = long_answer
    rows[5]["prompt"] = WORDS * 6  # the prompt alone fills max_seq_len: no answer token is left on either side
    data = _write(tmp_path / "pairs.jsonl", rows)
    found = {f.rule: f for f in _check(tmp_path, tiny_llama, data)}
    cut = found["preference_answers_cut"]
    assert cut.severity == "warning" and cut.where == f"data: {data}:3"
    assert "2 pairs have an answer cut at max_seq_len=64" in cut.message
    assert "1 pair has been dropped" in cut.message
    longest = max(_tokens(tokenizer, rows[i], side) for i in (2, 4, 5) for side in ("chosen", "rejected"))
    assert longest > 64 and f"max_seq_len: {longest}" in cut.fix
    assert "preference_answers_cut" not in {f.rule for f in _check(tmp_path, tiny_llama, data, max_seq_len=longest)}


def test_pairs_within_max_seq_len_have_no_finding(tmp_path: Path, tiny_llama: Path) -> None:
    data = _write(tmp_path / "pairs.jsonl", [_pair(i) for i in range(4)])
    found = _check(tmp_path, tiny_llama, data, objective="orpo")
    assert not [f for f in found if f.rule in ("preference_answers_cut", "kto_one_kind")]


def test_kto_rows_of_one_kind_are_an_error(tmp_path: Path, tiny_llama: Path) -> None:
    rows = [{"prompt": f"question {i}", "completion": f"answer {i}", "label": True} for i in range(4)]
    data = _write(tmp_path / "kto.jsonl", rows)
    found = _check(tmp_path, tiny_llama, data, objective="kto", micro_batch=2)
    one = [f for f in found if f.rule == "kto_one_kind"]
    assert one and one[0].severity == "error" and not is_ok(found)
    assert "all 4 training rows are desirable" in one[0].message and "undesirable" in one[0].fix
    rows[1]["label"] = False
    mixed = _write(tmp_path / "kto2.jsonl", rows)
    assert "kto_one_kind" not in {f.rule for f in _check(tmp_path, tiny_llama, mixed, objective="kto", micro_batch=2)}


@pytest.mark.parametrize(("row", "says"), [
    (_pair(0), "set objective: dpo (or orpo/simpo)"),
    ({"conversations": [{"from": "human", "value": "hi"}], "chosen": {"from": "gpt", "value": "hello"},
      "rejected": {"from": "gpt", "value": "go away"}}, "set objective: dpo (or orpo/simpo)"),
    ({"prompt": "hi", "completion": "hello", "label": True}, "set objective: kto"),
])
def test_preference_rows_given_to_sft_say_which_objective(tmp_path: Path, tiny_llama: Path, row: dict,
                                                          says: str) -> None:
    """The SFT reader names the objective for preference rows, LLaMA-Factory's ranking rows (which hold a
    ShareGPT conversation too) included, instead of an unknown format or a run that trains on no answer."""
    data = _write(tmp_path / "pref.jsonl", [row])
    with pytest.raises(UserError, match="these are preference rows") as e:
        _check(tmp_path, tiny_llama, data, objective="sft")
    assert says in str(e.value) and f"{data}:1" in str(e.value)
