"""`check` with some data files here and some not (a login node that mounts part of the storage): the files here
are read row by row as train reads them, and the rules over the whole data set (KTO's two kinds, a share of the
rows as max_bad_rows) are not judged on the part that is here, but listed in `skipped`."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from shardfit.cli.main import main
from tests.helpers import write_config

ELSEWHERE = "/nonexistent/elsewhere"


def _check(tmp_path: Path, model: Path, capsys: pytest.CaptureFixture, **keys: object) -> tuple[int, dict]:
    keys = {"precision": "fp32", "max_seq_len": 64, "micro_batch": 2, "max_steps": 1, **keys}
    cfg = write_config(tmp_path / "c.yaml", model=str(model), output_dir=str(tmp_path / "run"), **keys)
    code = main(["check", str(cfg), "--json"])
    out = capsys.readouterr()
    assert out.out.strip(), out.err[-1500:]
    return code, json.loads(out.out)


def test_a_broken_eval_file_here_is_read_when_the_data_file_is_not(tmp_path: Path, tiny_llama: Path,
                                                                  capsys: pytest.CaptureFixture) -> None:
    """`data` absent and `eval_data` here: the eval file was not read at all (exit 0) while the warning said the
    files here were; train refuses its bad row, and so does check now."""
    bad = tmp_path / "eval.jsonl"
    bad.write_text('{"instruction": "hi", "output": "there"}\n{not json\n')
    cfg = write_config(tmp_path / "c.yaml", model=str(tiny_llama), data=f"{ELSEWHERE}/train.jsonl",
                       eval_data=str(bad), precision="fp32", max_seq_len=64, max_steps=1,
                       output_dir=str(tmp_path / "run"))
    assert main(["check", str(cfg)]) == 2
    assert "not valid JSON" in capsys.readouterr().err


def test_kto_rows_of_one_kind_here_are_not_judged_while_a_data_file_is_absent(tmp_path: Path, tiny_llama: Path,
                                                                            capsys: pytest.CaptureFixture) -> None:
    """Only desirable rows here, the undesirable ones in an absent file: check said kto_one_kind (an error, exit
    1) about data that holds both kinds; now the balance is listed as not judged."""
    good = tmp_path / "good.jsonl"
    good.write_text("".join(json.dumps({"prompt": f"q {i}", "completion": f"a {i}", "label": True}) + "\n"
                            for i in range(8)))
    code, out = _check(tmp_path, tiny_llama, capsys, objective="kto", data=[str(good), f"{ELSEWHERE}/bad.jsonl"])
    assert code == 0 and "kto_one_kind" not in [f["rule"] for f in out["findings"]], out
    assert any("KTO's desirable and undesirable rows" in s for s in out["skipped"]), out["skipped"]
    # only eval_data absent: every training row is here, so the balance is judged as train judges it
    code, out = _check(tmp_path, tiny_llama, capsys, objective="kto", data=str(good),
                       eval_data=f"{ELSEWHERE}/eval.jsonl")
    assert code == 1 and "kto_one_kind" in [f["rule"] for f in out["findings"]], out


def test_a_share_of_the_rows_as_max_bad_rows_is_not_judged_on_part_of_the_data(tmp_path: Path, tiny_llama: Path,
                                                                               small_data: Path,
                                                                               capsys: pytest.CaptureFixture) -> None:
    """max_bad_rows 0.03 of every row: 3 bad rows of the 21 here were refused as 'more than 0 allowed', though the
    absent file's rows raise the allowance. A count (max_bad_rows 2) lost here is lost on the whole: still exit 2."""
    small = tmp_path / "small.jsonl"
    small.write_text("\n".join(small_data.read_text().splitlines()[:18] + ["{not json"] * 3) + "\n")
    data = [str(small), f"{ELSEWHERE}/big.jsonl"]
    code, out = _check(tmp_path, tiny_llama, capsys, data=data, skip_bad_rows=True, max_bad_rows=0.03,
                       max_seq_len=512)
    assert code == 0, out
    assert any("max_bad_rows as a share of the rows" in s for s in out["skipped"]), out["skipped"]
    cfg = write_config(tmp_path / "n.yaml", model=str(tiny_llama), data=data, skip_bad_rows=True, max_bad_rows=2,
                       precision="fp32", max_seq_len=512, max_steps=1, output_dir=str(tmp_path / "run"))
    assert main(["check", str(cfg)]) == 2
    assert "3 of 21 rows would not train" in capsys.readouterr().err


@pytest.mark.parametrize("absent", ["eval_data", "a data file"])
def test_max_bad_rows_zero_is_judged_on_part_of_the_data(tmp_path: Path, tiny_llama: Path, absent: str,
                                                         capsys: pytest.CaptureFixture) -> None:
    """max_bad_rows 0 (no row may be lost) was taken for a share of the rows and not judged, so check said exit 0
    where train refuses the row too long here whatever the absent file holds; now both exit 2."""
    here = tmp_path / "train.jsonl"
    rows = [{"instruction": f"q{i}", "output": f"a{i}"} for i in range(20)] + [{"instruction": "word " * 400,
                                                                                "output": "x"}]
    here.write_text("".join(json.dumps(r) + "\n" for r in rows))
    keys = {"eval_data": f"{ELSEWHERE}/eval.jsonl"} if absent == "eval_data" else {}
    data = str(here) if absent == "eval_data" else [str(here), f"{ELSEWHERE}/more.jsonl"]
    cfg = write_config(tmp_path / "c.yaml", model=str(tiny_llama), data=data, max_bad_rows=0, precision="fp32",
                       max_seq_len=64, max_steps=1, output_dir=str(tmp_path / "run"), **keys)
    assert main(["check", str(cfg)]) == 2
    err = capsys.readouterr().err
    assert "1 of 21 rows would not train" in err and "max_bad_rows as a share" not in err, err[-1500:]
