"""What `shardfit plan` and a launch's resolve read at start-up, by structure (bench/startup.py times them): the
bundled YAML tables through libyaml's loader, and a local folder's shape from transformers' config class alone,
never its modeling code."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from shardfit.plan import cards, shapes
from tests.helpers import ROOT

TABLES = [(shapes.catalog, shapes.__file__, "catalog.yaml"), (cards._table, cards.__file__, "cards.yaml")]


@pytest.mark.parametrize(("read", "module", "name"), TABLES, ids=["catalog", "cards"])
def test_bundled_tables_read_with_the_c_loader_as_the_python_one_reads_them(
        read, module: str, name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    if not getattr(yaml, "__with_libyaml__", False):
        pytest.skip("PyYAML built without libyaml")
    text = (Path(module).parent / name).read_text()
    python = yaml.load(text, Loader=yaml.SafeLoader)

    def refused(*args: object, **kwargs: object) -> None:
        raise AssertionError("read with the pure-Python loader")

    monkeypatch.setattr(yaml, "safe_load", refused)
    assert read.__wrapped__() == python  # the cached function's body, read afresh


def test_plan_of_a_folder_builds_the_config_class_but_no_model_code(tmp_path: Path) -> None:
    """The shape reads transformers' config class (its defaults and derived layouts are what the rank builds), and
    nothing of the family's modeling code, which only a model build needs."""
    folder = tmp_path / "llama"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({
        "model_type": "llama", "hidden_size": 256, "intermediate_size": 512, "num_attention_heads": 4,
        "num_key_value_heads": 2, "num_hidden_layers": 2, "vocab_size": 1000}))
    probe = ("import runpy, sys\n"
             "sys.argv = ['shardfit', 'plan', '--model', sys.argv[1]]\n"
             "try:\n    runpy.run_module('shardfit', run_name='__main__')\n"
             "except SystemExit as e:\n    assert not e.code, e.code\n"
             "print('MODULES', *sorted(m for m in sys.modules if m.startswith('transformers.models.')))\n")
    env = dict(os.environ, PYTHONPATH=str(ROOT / "src"), OMP_NUM_THREADS="1")
    r = subprocess.run([sys.executable, "-c", probe, str(folder)], capture_output=True, text=True, env=env,
                       timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    modules = r.stdout.split("MODULES", 1)[1].split()
    assert "transformers.models.llama.configuration_llama" in modules
    assert not [m for m in modules if ".modeling_" in m and not m.startswith("transformers.models.auto.")]
