"""`check` refuses what `train` refuses: a config naming files a rank opens as it starts (a `resume:` checkpoint,
a `py:` scorer of eval_metrics) that are missing is exit 2 from both, with the same words naming the key."""

from __future__ import annotations

from pathlib import Path

import pytest

from shardfit.cli.main import main
from tests.helpers import write_config


def _run(argv: list[str], capsys: pytest.CaptureFixture) -> tuple[int, str]:
    code = main(argv)
    out = capsys.readouterr()
    return code, out.err + out.out


def _config(tmp_path: Path, model: Path, data: Path, **keys: object) -> Path:
    return write_config(tmp_path / "c.yaml", model=str(model), data=str(data), precision="fp32", max_seq_len=64,
                        micro_batch=2, max_steps=1, output_dir=str(tmp_path / "run"), **keys)


@pytest.mark.parametrize(("keys", "want"), [
    ({"resume": "/nonexistent/checkpoints/step-5"}, "'resume': /nonexistent/checkpoints/step-5 is not a shardfit "
                                                   "checkpoint"),
    ({"eval_metrics": ["py:/nonexistent/scorer.py:f"]}, "metric py:/nonexistent/scorer.py:f: no file"),
], ids=["resume-path", "py-scorer"])
def test_check_refuses_what_train_refuses(tmp_path: Path, tiny_llama: Path, small_data: Path,
                                          capsys: pytest.CaptureFixture, keys: dict, want: str) -> None:
    cfg = str(_config(tmp_path, tiny_llama, small_data, **keys))
    check = _run(["check", cfg], capsys)
    train = _run(["train", cfg], capsys)
    assert check[0] == train[0] == 2, (check, train)
    assert want in check[1] and want in train[1], (check[1][-800:], train[1][-800:])
    assert "Traceback" not in check[1] + train[1]


def test_a_damaged_named_checkpoint_is_refused_by_check(tmp_path: Path, tiny_llama: Path, small_data: Path,
                                                         capsys: pytest.CaptureFixture) -> None:
    ckpt = tmp_path / "old" / "checkpoints" / "step-3"
    ckpt.mkdir(parents=True)
    (ckpt / "trainer.pt").write_bytes(b"x")
    (ckpt / "manifest.json").write_text('{"trainer.pt": {"bytes": 99, "sha256": "0"}}')
    code, out = _run(["check", str(_config(tmp_path, tiny_llama, small_data, resume=str(ckpt)))], capsys)
    assert code == 2 and f"'resume': {ckpt} is damaged (trainer.pt has 1 bytes, not 99)" in out, out
