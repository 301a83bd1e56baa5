"""The arguments file a training script hands HfArgumentParser (parse_json_file / parse_yaml_file), followed as
the script would follow it, read (never run) into the job's arguments, and only inside the job's folders."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from shardfit.errors import UserError
from shardfit.foreign.arg_nulls import NULL_KEYS
from shardfit.foreign.common import load_yaml, parse_json, read_text
from shardfit.foreign.keys import Source
from shardfit.foreign.script_ast import ArgFile, ScriptSettings
from shardfit.foreign.shell import Command


def follow_arg_file(code: ScriptSettings, src: Source, script: Path, cmd: Command | None) -> None:
    """The file of arguments a script hands HfArgumentParser's parse_json_file / parse_yaml_file, read into `src`
    as its arguments (the parser reads nothing else then, so the file's keys win over the command line's). Which
    call runs is told as the script tells it: `sys.argv[1]` when the command gives that one argument and no
    options (the `len(sys.argv) == 2 and sys.argv[1].endswith(".json")` branch of transformers' examples),
    the file of an option the script parses itself (`args.config`) when it is given, and a path in the code when
    the script never parses its command line or the command gives no options. A file named so that is not here
    or not readable is a UserError naming it."""
    positional = cmd.positional if cmd else []
    options = bool(src.values)
    for call in code.arg_files:
        if call.given == "argv":
            index = int(call.ref)
            if options or index > len(positional) or not _suffix_fits(positional[index - 1], call.kind, any(
                    c.given == "argv" and c.kind != call.kind for c in code.arg_files)):
                continue
            ref, how = positional[index - 1], f"sys.argv[{index}]"
        elif call.given == "option":
            if call.ref not in src.values:
                continue
            ref, how = str(src.values.pop(call.ref)), f"--{call.ref}"
            src.order.remove(call.ref)
        elif code.parses_command_line and options:
            continue
        else:
            ref, how = call.ref, "the path in the code"
        _read_arg_file(ref, how, call, code, src, script)
        return


def _job_file(ref: str, *folders: Path) -> tuple[str | None, bool]:
    """The file `ref` names, tried under each of `folders` (an absolute path as it is), and whether it was refused
    for lying outside them: a path a stranger's script names is followed only when it resolves (links followed)
    into one of those folder trees, never through `~` (which transformers does not expand either), so that a plan
    never reads, nor prints, a file elsewhere on this machine."""
    if ref.startswith("~"):
        return None, True
    roots = [f.resolve() for f in folders]
    path = Path(ref)
    outside = False
    for candidate in [path] if path.is_absolute() else [f / path for f in folders]:
        target = candidate.resolve()
        if not any(target.is_relative_to(r) for r in roots):
            outside = outside or candidate.exists() or path.is_absolute()
            continue
        if target.is_file():
            return str(candidate), False
    return None, outside


def _suffix_fits(name: str, kind: str, other_kinds: bool) -> bool:
    """Whether the script's `parse_<kind>_file(sys.argv[N])` reads the argument `name`: by its suffix where the
    script reads the other format too (each branch tests it), else whatever it is called."""
    suffixes = (".json",) if kind == "json" else (".yaml", ".yml")
    return name.lower().endswith(suffixes) or not other_kinds and not name.startswith("-")


def _read_arg_file(ref: str, how: str, call: ArgFile, code: ScriptSettings, src: Source, script: Path) -> None:
    """Read the arguments file `ref` the script's `call` parses, as HfArgumentParser does (its keys are the
    dataclasses' fields), into `src` over the command line's keys; said in the script's findings. The file is
    followed only inside the job's folders (`_job_file`): one elsewhere is not read, and the plan says so."""
    what = f"parse_{call.kind}_file({how}) at {call.at}"
    hit, outside = _job_file(ref, src.path.parent, script.parent)
    if outside:
        # the parser would read that file alone: the command line's options stay unread either way
        code.ignored_args.update({k: str(v) for k, v in src.values.items()})
        src.values.clear()
        src.order.clear()
        code.found.append(f"{what}: {ref} lies outside the folders of {src.path.name} and {script.name}, so "
                          f"shardfit did not read it and plans without the script's arguments (copy the file "
                          f"beside {src.path.name} and name it by a relative path to plan with it)")
        return
    if hit is None:
        raise UserError(f"{src.where}: {ref}: no such file here, and the script reads its arguments from it "
                        f"({what}). Give the file beside the command's file (or its path), or the arguments "
                        f"on the command line.")
    lines: dict[str, int] = {}
    if call.kind == "json":
        data: Any = parse_json(read_text(Path(hit)), hit)
    else:
        data, lines = load_yaml(Path(hit), example="model_name_or_path: ..., per_device_train_batch_size: 1")
    if not isinstance(data, dict):
        raise UserError(f"{hit}: the script's {what} reads an object of argument names (model_name_or_path, "
                        f"per_device_train_batch_size, ...), got {type(data).__name__}.")
    # HfArgumentParser.parse_*_file parses the file's keys alone (parse_dict): an option the command line gives
    # beside it never reaches the dataclasses, so it must not be planned either
    for key in [k for k in src.values if k not in data or data[k] is None]:
        code.ignored_args[key] = str(src.values.pop(key))
        src.order.remove(key)
    for key, value in data.items():
        if value is None and key not in NULL_KEYS:  # None means the field's default (arg_nulls.py)
            continue
        if value is None:
            src.null_at[key] = f"{hit}:{lines[key]}" if key in lines else hit
        if key not in src.values:
            src.order.append(key)
        src.values[key] = value if isinstance(value, str) or value is None else json.dumps(value) if \
            isinstance(value, dict) else " ".join(map(str, value)) if isinstance(value, list) else \
            str(value).lower() if isinstance(value, bool) else str(value)
    code.arg_file_keys.update(k for k, v in data.items() if v is not None)
    code.arg_file = hit
    code.found.append(f"{what}: the arguments in {Path(hit).name}")
    if code.ignored_args:
        code.found.append(f"{', '.join('--' + k for k in code.ignored_args)} on the command line never reach the "
                          f"parser, which reads {Path(hit).name} alone: not planned")
