"""Read a command line, or the shell script that holds one: its environment, its launcher and the program's
arguments (what ms-swift, Qwen's finetune.sh and HF Trainer scripts are run with)."""

from __future__ import annotations

import re
import shlex
from dataclasses import dataclass, field

from shardfit.errors import UserError

LAUNCHERS = ("torchrun", "deepspeed", "accelerate", "python", "python3")
# Modules run with `python -m` to set up, install or fetch, never to train.
SETUP_MODULES = frozenset({"pip", "venv", "virtualenv", "ensurepip", "uv", "pipx", "conda", "site", "http",
                           "huggingface_hub", "modelscope", "nltk", "spacy", "pytest", "unittest", "compileall",
                           "json", "zipfile", "tarfile", "bitsandbytes"})
# torchrun / deepspeed / accelerate launch options that decide how many ranks run, by the name each launcher uses.
NPROC_FLAGS = ("--nproc_per_node", "--nproc-per-node", "--num_gpus", "--num-gpus", "--num_processes",
               "--num-processes")
NNODES_FLAGS = ("--nnodes", "--num_nodes", "--num-nodes", "--num_machines", "--num-machines")


@dataclass
class Command:
    """One command as the shell would run it: `env` holds the script's exports and the assignments before the
    command (later ones win), `launcher` the distributed launcher in front of the program (or None), `program`
    the script or tool (finetune.py, swift sft, llamafactory-cli train), `args` its options by name
    (`--key value`, `--key=value`; a bare flag is "true"), `positional` the rest."""

    env: dict[str, str] = field(default_factory=dict)
    exported: dict[str, str] = field(default_factory=dict)  # what the program sees: exports and its own prefix
    launcher: str | None = None
    launcher_args: dict[str, str] = field(default_factory=dict)
    program: str = ""
    args: dict[str, str] = field(default_factory=dict)
    positional: list[str] = field(default_factory=list)
    order: list[str] = field(default_factory=list)  # option names in the order given
    joined: set[str] = field(default_factory=set)  # option names written as one word, `--key=value`

    @property
    def nproc(self) -> int | None:
        """Ranks per node the launch starts: the launcher's flag, else NPROC_PER_NODE (ms-swift), else None."""
        for flag in NPROC_FLAGS:
            if flag in self.launcher_args:
                n = _int(self.launcher_args[flag], flag)
                # accelerate's --num_processes counts every machine's (utils/launch.py: // num_machines)
                return max(1, n // self.nnodes) if self.launcher == "accelerate" else n
        if "NPROC_PER_NODE" in self.env:
            return _int(self.env["NPROC_PER_NODE"], "NPROC_PER_NODE")
        if self.launcher == "deepspeed" and "CUDA_VISIBLE_DEVICES" in self.env:
            return len(visible_devices(self.env))
        return None

    @property
    def nnodes(self) -> int:
        for flag in NNODES_FLAGS:
            if flag in self.launcher_args:
                return _int(self.launcher_args[flag], flag)
        return _int(self.env.get("NNODES", "1"), "NNODES")


def visible_devices(env: dict[str, str]) -> list[str]:
    """The GPUs CUDA_VISIBLE_DEVICES leaves visible, read as CUDA reads it: the entries before the first that is
    neither an ordinal (0 or more) nor a GPU-/MIG- id, so "", "-1" and "False" hide every GPU. Empty when the
    variable is not set too: `hides_every_gpu` tells the two apart."""
    out = []
    for entry in env.get("CUDA_VISIBLE_DEVICES", "").split(","):
        entry = entry.strip()
        if not (re.fullmatch(r"[0-9]+", entry) or entry.startswith(("GPU-", "MIG-"))):
            break
        out.append(entry)
    return out


def hides_every_gpu(env: dict[str, str]) -> bool:
    """Whether CUDA_VISIBLE_DEVICES is set and leaves CUDA no GPU at all (the job then runs on no GPU)."""
    return "CUDA_VISIBLE_DEVICES" in env and not visible_devices(env)


def _int(text: str, what: str) -> int:
    try:
        return int(text)
    except ValueError:
        raise UserError(f"{what}={text}: expected a number of processes; give it, or pass --nproc N.") from None


def _logical_lines(text: str) -> list[str]:
    """Lines with backslash continuations joined and comments dropped."""
    out, cur = [], ""
    for raw in text.splitlines():
        line = raw.rstrip()
        if line.endswith("\\"):
            cur += line[:-1] + " "
            continue
        cur += line
        if cur.strip() and not cur.lstrip().startswith("#"):
            out.append(cur.strip())
        cur = ""
    if cur.strip():
        out.append(cur.strip())
    return out


_ASSIGN = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*=")


def _expand(word: str, env: dict[str, str]) -> str:
    """$VAR and ${VAR} from what the script has set so far (unknown ones stay as written)."""
    return re.sub(r"\$\{?([A-Za-z_][A-Za-z0-9_]*)\}?", lambda m: env.get(m.group(1), m.group(0)), word)


def parse_command(text: str, where: str, programs: tuple[str, ...]) -> Command:
    """The command in `text` (a command line or a script) whose program is one of `programs` (matched against
    the program's name or a 'tool subcommand' pair). Exports and assignments anywhere before it count."""
    env: dict[str, str] = {}
    exported: dict[str, str] = {}
    for line in _logical_lines(text):
        try:
            words = shlex.split(line, comments=True)
        except ValueError as e:
            raise UserError(f"{where}: cannot split the shell line '{line[:80]}': {e}.") from None
        if not words:
            continue
        export = words[0] == "export"
        if words[0] in ("export", "set", "local") and len(words) > 1:
            words = words[1:]
        assigned = {}
        while words and _ASSIGN.match(words[0]):
            k, _, v = words.pop(0).partition("=")
            assigned[k] = _expand(v, {**env, **assigned})
        if not words:
            env.update(assigned)
            if export:
                exported.update(assigned)
            continue
        words = [_expand(w, {**env, **assigned}) for w in words]
        cmd = _match(words, programs)
        if cmd is not None:
            cmd.env = {**env, **assigned}
            cmd.exported = {**exported, **assigned}
            return cmd
    raise UserError(f"{where}: no command running {' or '.join(programs)} found. Give the command line (or a shell "
                    f"script containing it) that starts the training.")


def _match(words: list[str], programs: tuple[str, ...]) -> Command | None:
    i = 0
    cmd = Command()
    head = words[0].rsplit("/", 1)[-1]
    if head in LAUNCHERS or head.startswith("python"):
        cmd.launcher = head
        i = 1
        if head.startswith("python") and words[i:i + 2] in (["-m", "torch.distributed.run"],
                                                           ["-m", "torch.distributed.launch"]):
            cmd.launcher, i = "torchrun", 3
        elif head == "accelerate" and words[i:i + 1] == ["launch"]:
            i = 2
        while i < len(words) and words[i].startswith("-"):
            name, eq, value = words[i].partition("=")
            if name == "-m" and i + 1 < len(words):  # `python -m pkg.module`, `torchrun -m pkg.module`
                path = words[i + 1].replace(".", "/") + ".py"
                if not _trains(words[i + 1], path, head, words[i + 2:], programs):
                    return None
                words = [*words[:i + 1], path, *words[i + 2:]]
                i += 1
                break
            if not eq and i + 1 < len(words) and not words[i + 1].startswith("-") and not _is_program(
                    words[i + 1], programs) and name not in ("-u",):
                value, i = words[i + 1], i + 1
            cmd.launcher_args[name] = value or "true"
            i += 1
        if head.startswith("python") and cmd.launcher == head:
            cmd.launcher = None  # a plain `python script.py`: no launcher
    if i >= len(words):
        return None
    prog = words[i]
    name = prog.rsplit("/", 1)[-1]
    two = f"{name} {words[i + 1]}" if i + 1 < len(words) else name
    if two in programs:
        cmd.program, i = two, i + 2
    elif (one := _one_word_program(prog, programs)) is not None:
        cmd.program, i = one, i + 1
    else:
        return None
    rest = words[i:]
    j = 0
    while j < len(rest):
        w = rest[j]
        if w.startswith("--"):
            name, eq, value = w.partition("=")
            if not eq:
                values = []
                while j + 1 < len(rest) and not rest[j + 1].startswith("--"):
                    values.append(rest[j + 1])
                    j += 1
                value = " ".join(values) if values else "true"
            cmd.args[name[2:]] = value
            cmd.order.append(name[2:])
            if eq:
                cmd.joined.add(name[2:])
        else:
            cmd.positional.append(w)
        j += 1
    return cmd


def _trains(module: str, path: str, head: str, args: list[str], programs: tuple[str, ...]) -> bool:
    """Whether `head -m module args` is a training command: a tool's own entry module (`swift.cli.sft`, a
    program of `programs` with a package path), or a user's module that a launcher starts or that python runs
    with options; never a setup command (`python -m pip install ...`, `python -m venv .venv`), which would
    otherwise be read as the training script."""
    if any("/" in p and (path == p or path.endswith("/" + p)) for p in programs):
        return True
    if module.split(".")[0] in SETUP_MODULES:
        return False
    return head in LAUNCHERS and not head.startswith("python") or any(a.startswith("--") for a in args)


def _one_word_program(word: str, programs: tuple[str, ...]) -> str | None:
    """The entry of `programs` that one word runs: a name (`finetune.py`), a suffix (`.py`), or a path within a
    package (`swift/cli/sft.py`, matched at the end of the word's path, as an installed package's script is run);
    None when it runs none of them."""
    name = word.rsplit("/", 1)[-1]
    if name in programs:
        return name
    if any(name.endswith(p) for p in programs if p.startswith(".")):
        return name
    return next((p for p in programs if "/" in p and (word == p or word.endswith("/" + p))), None)


def _is_program(word: str, programs: tuple[str, ...]) -> bool:
    name = word.rsplit("/", 1)[-1]
    return _one_word_program(word, programs) is not None or name.split(" ")[0] in {
        p.split(" ")[0] for p in programs}
