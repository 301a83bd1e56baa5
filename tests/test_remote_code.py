"""A run directory cannot make `chat`, `eval` or `export --merge` run a model folder's Python: only
`--trust-remote-code` on the command line can. A handed-over run whose config.yaml says trust_remote_code: true
ends in exit 2 naming the flag, and the folder's code never runs; with the flag, it does run (the control that
shows the folder really carries code)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from shardfit.cli.main import main
from tests.helpers import run_cli, write_config


@pytest.fixture()
def handed(tmp_path: Path, tokenizer_dir: Path, small_data: Path) -> dict[str, Path]:
    """A model folder whose config needs its own Python (which writes a marker file when it runs), and a run
    directory on it whose config.yaml allows remote code, as someone might hand it over."""
    marker = tmp_path / "marker"
    model = tmp_path / "remote-model"
    model.mkdir()
    for f in tokenizer_dir.iterdir():
        shutil.copy(f, model / f.name)
    (model / "config.json").write_text(json.dumps({
        "model_type": "shardfit_remote_test", "architectures": ["RemoteForCausalLM"],
        "auto_map": {"AutoConfig": "configuration_remote.RemoteConfig",
                     "AutoModelForCausalLM": "modeling_remote.RemoteForCausalLM"}}))
    (model / "configuration_remote.py").write_text(
        f"open({str(marker)!r}, 'w').write('the model folder ran code')\n"
        "from transformers import PretrainedConfig\n\n\n"
        "class RemoteConfig(PretrainedConfig):\n    model_type = 'shardfit_remote_test'\n")
    run = tmp_path / "handed-run"
    (run / "adapter").mkdir(parents=True)
    write_config(run / "config.yaml", model=str(model), data=str(small_data), method="lora",
                 trust_remote_code=True, output_dir=str(run))
    (run / "adapter" / "adapter_config.json").write_text(json.dumps({
        "peft_type": "LORA", "base_model_name_or_path": str(model), "r": 4, "lora_alpha": 8,
        "target_modules": ["q_proj"]}))
    return {"run": run, "model": model, "marker": marker, "data": small_data, "out": tmp_path / "merged"}


CASES = [  # name, the command (given the fixture's paths), whether the run's config.yaml is named as the reason
    ("chat a run", lambda h: ["chat", str(h["run"]), "--prompt", "hi", "--device", "cpu"], True),
    ("eval a run", lambda h: ["eval", str(h["run"]), "--data", str(h["data"]), "--limit", "2", "--device", "cpu"],
     True),
    ("export --merge a run", lambda h: ["export", str(h["run"]), "--merge", "--out", str(h["out"])], True),
    ("chat the model folder itself", lambda h: ["chat", str(h["model"]), "--prompt", "hi", "--device", "cpu"], False),
]


@pytest.mark.parametrize(("name", "command", "names_config"), CASES, ids=[c[0] for c in CASES])
def test_only_the_command_line_allows_remote_code(handed: dict[str, Path], capsys: pytest.CaptureFixture,
                                                   name: str, command, names_config: bool) -> None:
    code = main(command(handed))
    err = capsys.readouterr().err
    assert code == 2, err
    assert "ships its own Python code, which runs only with --trust-remote-code; pass it if you trust" in err
    assert (f"{handed['run'] / 'config.yaml'} says trust_remote_code: true" in err) == names_config, err
    assert "Traceback" not in err and "unexpected" not in err
    assert not handed["marker"].exists()
    assert not handed["out"].exists()


def test_the_flag_does_allow_it(handed: dict[str, Path], tmp_path: Path) -> None:
    """The control: the same run with --trust-remote-code runs the folder's code (then fails on the model class
    the folder does not ship, which is beside the point)."""
    r = run_cli("chat", str(handed["run"]), "--prompt", "hi", "--device", "cpu", "--trust-remote-code",
                env={"HF_MODULES_CACHE": str(tmp_path / "modules")})
    assert handed["marker"].read_text() == "the model folder ran code", r.stderr[-2000:]
