"""What the docs claim that a machine can check, checked, so they cannot drift from the code:

- every `shardfit ...` command in a code block of docs/*.md and README.md parses with the CLI's own argparser
  (a removed or renamed flag, a wrong command name, a bad choice fail here);
- every `--set KEY=VALUE` in those commands names a config key that exists;
- every YAML block is a shardfit config (fragment) that loads and validates as `train` would load it;
- statements the issues found false stay corrected (chat --image and method: qlora work).

tests/test_readme.py runs the README's commands; this file only parses, so it covers every page in seconds."""

from __future__ import annotations

import contextlib
import dataclasses
import io
import re
import shlex
from pathlib import Path

import pytest
import yaml

from shardfit.cli.main import build_parser
from shardfit.config import Config, load_config
from shardfit.errors import UserError
from tests.helpers import ROOT

DOCS = sorted((ROOT / "docs").glob("*.md")) + [ROOT / "README.md"]
BLOCK = re.compile(r"```([a-z]*)\n(.*?)```", re.S)


def doc_commands() -> list[tuple[str, str]]:
    """(page, command line) for each `shardfit ...` line of a code block; prompts (`$ `), comments and the
    generated usage lines (`[-h]`) taken off, continuation lines joined."""
    out = []
    for doc in DOCS:
        for _, block in BLOCK.findall(doc.read_text()):
            for line in block.replace("\\\n", " ").splitlines():
                line = line.strip().removeprefix("$ ")
                line = re.split(r"\s#", line, maxsplit=1)[0].strip()
                if not line.startswith("shardfit ") or "[-h]" in line:
                    continue
                line = re.split(r"\s(?:\||<|>|2>|&&)\s", line)[0]  # shell plumbing after the command
                if line.split()[1].endswith(":"):  # printed output ("shardfit demo: ..."), not a command
                    continue
                out.append((doc.name, line))
    return out


def _parses(argv: list[str]) -> str | None:
    """None when the CLI's parser accepts `argv`, else its error line."""
    err = io.StringIO()
    try:
        with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
            build_parser().parse_args(argv)
    except SystemExit as e:
        return None if not e.code else err.getvalue().strip().splitlines()[-1]
    return None


def _argv(line: str) -> list[str]:
    # `[--json]` in a synopsis: an option shown as optional is still an option the parser must know.
    return [a[1:-1] if a.startswith("[-") and a.endswith("]") else a for a in shlex.split(line)[1:]]


def test_every_command_in_the_docs_parses() -> None:
    commands = doc_commands()
    assert len(commands) >= 60, len(commands)
    bad = []
    for page, line in commands:
        problem = _parses(_argv(line))
        # A few lines end in an aligned note ("shardfit report a b --out c/   two runs side by side"): the command
        # is what comes before the wide gap.
        parts = re.split(r"\s{3,}(?=[A-Za-z(])", line)
        if problem and len(parts) > 1:
            problem = _parses(_argv(parts[0]))
        if problem:
            bad.append(f"{page}: {line}\n    {problem}")
    assert not bad, "\n".join(bad)


def _key_exists(key: str) -> bool:
    cls, fields = Config, {f.name: f for f in dataclasses.fields(Config)}
    *outer, last = key.split(".")
    for part in outer:
        if part not in fields or not dataclasses.is_dataclass(cls := _nested(cls, part)):
            return False
        fields = {f.name: f for f in dataclasses.fields(cls)}
    return last in fields


def _nested(cls: type, name: str) -> type:
    return type(getattr(cls(), name))


def test_every_set_key_in_the_docs_exists() -> None:
    keys = [(page, m) for page, line in doc_commands() for m in re.findall(r"--set\s+([A-Za-z_.]+)=", line)]
    assert keys
    bad = [f"{page}: --set {k}" for page, k in keys if not _key_exists(k)]
    assert not bad, bad


def yaml_configs() -> list[tuple[str, str]]:
    out = []
    for doc in DOCS:
        for lang, block in BLOCK.findall(doc.read_text()):
            if lang in ("yaml", "yml") and isinstance(yaml.safe_load(block), dict):
                out.append((doc.name, block))
    return out


@pytest.mark.parametrize("page, block", yaml_configs(), ids=lambda x: x if x.endswith(".md") else "")
def test_every_yaml_config_in_the_docs_loads(tmp_path: Path, page: str, block: str) -> None:
    path = tmp_path / "c.yaml"
    path.write_text(block)
    try:
        load_config(path, check_files=False)
    except UserError as e:
        pytest.fail(f"{page}: a config block does not load: {e}\n{block}")


def test_key_check_is_not_vacuous() -> None:
    assert _key_exists("lora.rank") and _key_exists("max_seq_len")
    assert not _key_exists("lora.rnak") and not _key_exists("per_device_train_batch_size")
    assert _parses(["train", "--nproc", "2", "x.yaml"]) is None
    assert _parses(["train", "--no-such-flag"]) is not None


def test_after_training_says_what_works() -> None:
    """docs/after-training.md said `chat --image` is refused and `method: qlora` not implemented; both work."""
    text = (ROOT / "docs" / "after-training.md").read_text()
    assert "--image` is refused" not in text and "not implemented" not in text
    chat = build_parser().parse_args(["chat", "runs/vl", "--image", "a.png", "--prompt", "What is it?"])
    assert chat.image == ["a.png"]
    assert load_config(overrides=["method=qlora"], check_files=False).method == "qlora"
