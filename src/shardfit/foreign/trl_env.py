"""The `env:` section of a TrlParser YAML (`--config FILE.yaml`), which TrlParser exports into os.environ before it
parses the arguments: read and checked as TrlParser would set it (hf_args.py `_trl_yaml`)."""

from __future__ import annotations

import datetime
from pathlib import Path
from typing import Any

from shardfit.errors import UserError
from shardfit.foreign.shell import hides_every_gpu


def trl_env(data: dict[str, Any], lines: dict[str, int], path: Path) -> dict[str, str]:
    """The `env:` section of a TrlParser YAML: variables TrlParser sets in os.environ (each value as `str()` of it,
    over what the shell exported) before it parses, so before the script touches CUDA. TRL refuses an `env` that is
    not a mapping; a null, list or mapping value it would export as Python's text of it ("None", "['0', '1']"),
    never what was meant, so shardfit refuses those too, naming the key."""
    env = data["env"]
    if not isinstance(env, dict):  # `env:` with nothing under it too: TrlParser refuses None alike
        what = "empty" if env is None else f"{type(env).__name__} {env!r}"
        raise UserError(f"{path}:{lines.get('env', '?')}: 'env' is {what}; TrlParser needs a "
                        f"mapping of variable names to values (ValueError: \"`env` field should be a dict in the "
                        f"YAML file\"), e.g. env: {{CUDA_VISIBLE_DEVICES: \"0,1\"}}.")
    out: dict[str, str] = {}
    for name, value in env.items():
        at = f"{path}:{lines.get(f'env.{name}', lines.get('env', '?'))}"
        if not isinstance(name, str) or not name or "=" in name or "\0" in name:
            why = (f"is a YAML {type(name).__name__}, which os.environ refuses (TypeError: str expected)"
                   if not isinstance(name, str) else "is empty" if not name else
                   "holds '='" if "=" in name else "holds a NUL byte")
            raise UserError(f"{at}: env name {name!r} {why}, so TrlParser fails setting it; give a variable "
                            f"name of letters, digits and _ (quote it if YAML reads it otherwise: \"NAME\": ...).")
        if isinstance(value, str) and "\0" in value:
            raise UserError(f"{at}: env.{name} holds a NUL byte, which os.environ refuses (ValueError: embedded "
                            f"null byte); remove it.")
        if value is not None and not isinstance(value, (dict, list, str, int, float, datetime.date)):
            raise UserError(f"{at}: env.{name} is a YAML {type(value).__name__} ({value!r}): TrlParser would export "
                            f"Python's text of it, not a value you meant. Give a string (quote it: {name}: \"...\").")
        if value is None or isinstance(value, (dict, list)):
            what = "empty" if value is None else f"a {type(value).__name__}"
            raise UserError(f"{at}: env.{name} is {what}; "
                            f"TrlParser exports str() of it ({str(value)!r}) as the variable, not a value you "
                            f"meant. Give a string (quote it: {name}: \"...\") or remove the key.")
        out[str(name)] = str(value)
    if hides_every_gpu(out):
        value = env["CUDA_VISIBLE_DEVICES"]
        raise UserError(f"{path}:{lines.get('env.CUDA_VISIBLE_DEVICES', lines.get('env', '?'))}: "
                        f"env.CUDA_VISIBLE_DEVICES is {value!r}, which TrlParser exports as {str(value)!r}: CUDA "
                        f"reads no GPU id in it (it stops at the first entry that is not 0, 1, ... or a GPU-/MIG- "
                        f"id), so the job sees no GPU. List the GPUs to use (CUDA_VISIBLE_DEVICES: \"0,1\"), or "
                        f"remove the key.")
    return out
