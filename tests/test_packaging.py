"""Packaging: the wheel installs a working CLI with its data files and declares the extras; starting the CLI
imports no optional or heavy library; shell completion answers."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import sysconfig
import venv
import zipfile
from pathlib import Path

import pytest

from tests.helpers import ROOT, run_cli

HEAVY = ("torch", "transformers", "peft", "matplotlib", "wandb", "mlflow", "tensorboard", "argcomplete")


def test_cli_start_and_tracker_module_import_nothing_optional() -> None:
    code = ("import sys, json; import shardfit.cli.main, shardfit.train.trackers; "
            f"print(json.dumps([m for m in {HEAVY!r} if m in sys.modules and m != 'torch']))")
    # train.trackers sits in the train package (torch is fine there); the CLI module alone must not load torch.
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert json.loads(out) == []
    code = f"import sys, json; import shardfit.cli.main; print(json.dumps([m for m in {HEAVY!r} if m in sys.modules]))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert json.loads(out) == []


def test_version_and_completion(tmp_path: Path) -> None:
    r = run_cli("--version")
    assert r.returncode == 0 and r.stdout.startswith("shardfit 0.")
    out = tmp_path / "completions.txt"
    r = run_cli(env={"_ARGCOMPLETE": "1", "_ARGCOMPLETE_IFS": " ", "COMP_LINE": "shardfit ch", "COMP_POINT": "11",
                     "_ARGCOMPLETE_STDOUT_FILENAME": str(out)})
    assert r.returncode == 0, r.stderr
    assert set(out.read_text().split()) == {"chat", "check"}


@pytest.mark.slow
def test_wheel_installs_a_working_cli(tmp_path: Path) -> None:
    """Build the wheel, install it (no deps) into a fresh venv that borrows this environment's dependencies, and run
    the CLI from outside the source tree: the installed package, not src/, answers."""
    source = tmp_path / "source"  # a copy: building writes build/ and *.egg-info beside the sources
    shutil.copytree(ROOT / "src", source / "src", ignore=shutil.ignore_patterns("__pycache__", "*.egg-info"))
    shutil.copy(ROOT / "pyproject.toml", source)
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w",
                    str(tmp_path / "dist"), str(source)], check=True, capture_output=True)
    (wheel,) = (tmp_path / "dist").glob("shardfit-*.whl")
    with zipfile.ZipFile(wheel) as z:
        names = z.namelist()
        meta = z.read(next(n for n in names if n.endswith("METADATA"))).decode()
    for data in ("shardfit/plan/catalog.yaml", "shardfit/demo/demo.yaml", "shardfit/demo/train.jsonl",
                 "shardfit/diagnose/causes.yaml"):
        assert data in names, data
    for extra in ("tensorboard", "wandb", "mlflow", "qlora", "multimodal", "completion", "ui"):
        assert f"Provides-Extra: {extra}" in meta, extra
    assert 'wandb>=0.19; extra == "wandb"' in meta

    env_dir = tmp_path / "venv"
    venv.create(env_dir, with_pip=False)
    subprocess.run([sys.executable, "-m", "pip", "--python", str(env_dir / "bin" / "python"), "install", "-q",
                    "--no-deps", "--ignore-installed", str(wheel)], check=True, capture_output=True)
    # The dependencies (torch, transformers, ...) come from this environment (after the install, or pip would find
    # this environment's shardfit and skip it); shardfit itself only from the wheel.
    site = next(env_dir.glob("lib/python*/site-packages"))
    (site / "deps.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    clean = {"PATH": f"{env_dir / 'bin'}:/usr/bin:/bin", "HOME": str(tmp_path), "HF_HUB_OFFLINE": "1"}

    def shardfit(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run([str(env_dir / "bin" / "shardfit"), *args], capture_output=True, text=True,
                              cwd=tmp_path, env=clean, timeout=300)

    r = shardfit("--version")
    assert r.returncode == 0 and "shardfit 0." in r.stdout, r.stderr
    where = subprocess.run([str(env_dir / "bin" / "python"), "-c", "import shardfit; print(shardfit.__file__)"],
                           capture_output=True, text=True, env=clean, cwd=tmp_path).stdout
    assert where.startswith(str(env_dir)), where
    r = shardfit("plan", "--model", "meta-llama/Llama-3.1-8B", "--gpus", "8x24GB", "--json")
    assert r.returncode == 0, r.stderr[-2000:]
    assert json.loads(r.stdout)["recommended"]
    for command in ("chat", "eval", "report", "ui", "train", "export"):
        r = shardfit(command, "--help")
        assert r.returncode == 0 and "example" in r.stdout, (command, r.stderr)
