"""The record a log is parsed into (`Parsed`, its exceptions as `Exc`) and the traceback spellings that both
the parser (parse.py) and the fact gathering (facts.py) read: frame lines, library paths, launcher wrappers.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

from shardfit.diagnose.setting import Setting

# exceptions a launcher or a wrapper raises around the failure of the code it ran, not the failure itself
WRAPPER_TYPES = {"ChildFailedError", "ProcessRaisedException", "ProcessExitedException", "RayTaskError",
                 "CalledProcessError", "SystemExit", "KeyboardInterrupt", "CheckpointException"}
_FRAME_PATTERNS = (
    re.compile(r'File "(?P<file>[^"]+)", line (?P<line>\d+), in (?P<func>[\w<>.]+)'),
    re.compile(r"File (?P<file>\S+\.py):(?P<line>\d+),? in (?P<func>[\w<>.]+)"),
    re.compile(r"(?P<file>\S+\.py):(?P<line>\d+) in (?P<func>[\w<>.]+)"),
    re.compile(r"(?P<file>/\S+\.py) in (?P<func>[\w<>.]+)\("),
)
# a frame's file in an installed library or a framework's tree, not in the user's own code
LIBRARY_PATH = re.compile(r"(site|dist)-packages|/lib/python\d|^<frozen|/(torch|transformers|trl|peft|accelerate|"
                          r"deepspeed|datasets|llamafactory|llmtuner|swift|axolotl|openrlhf|verl|lightning|"
                          r"pytorch_lightning|megatron|vllm|xtuner|unsloth|nemo)/")


def match_frame(line: str) -> re.Match[str] | None:
    """The first of the traceback frame spellings `line` holds (python's, loguru's, rich's...), or None."""
    for pat in _FRAME_PATTERNS:
        if m := pat.search(line):
            return m
    return None


@dataclass
class Exc:
    """An exception the log states: its type, its message (wrapped lines re-joined) and the line it starts on."""

    type: str
    message: str
    line: int
    header: bool = False  # read from IPython's traceback header, which names the type only

    def __str__(self) -> str:
        return f"{self.type}: {self.message}" if self.message else self.type


@dataclass
class Parsed:
    """What was understood of a log. `facts` are named booleans the rules test; the rest is shown to the user."""

    input_chars: int = 0
    scanned_chars: int = 0
    lines: list[str] = field(default_factory=list)
    text: str = ""
    squashed: str = ""
    brief: str = ""  # the head and tail of `text`: where hints and the setting are read (see BRIEF_LINES)
    exceptions: list[Exc] = field(default_factory=list)
    exception: Exc | None = None
    frames: list[str] = field(default_factory=list)
    # the innermost frame of a traceback the paste cuts before its exception line, in a library's code
    cut_frames: list[str] = field(default_factory=list)
    exit_codes: list[int] = field(default_factory=list)
    signals: list[str] = field(default_factory=list)
    versions: dict[str, str] = field(default_factory=dict)
    zero_stage: int | None = None
    world_size: int | None = None
    device_map: str | None = None
    dtype: str | None = None
    model_size_b: float | None = None
    nccl_ops: list[tuple[int, str, int | None]] = field(default_factory=list)
    facts: set[str] = field(default_factory=set)
    setting: Setting = field(default_factory=Setting)

    @property
    def failing_frame(self) -> str | None:
        """The innermost frame of the last traceback outside torch/python internals, else the innermost one."""
        for f in reversed(self.frames):
            if not re.match(r"(torch/nn/modules/module\.py|python3\.\d+/|runpy\.py|<frozen|threading\.py)", f):
                return f
        return self.frames[-1] if self.frames else None

    def summary(self) -> dict:
        return {
            "exception": str(self.exception) if self.exception else None,
            "failing_frame": self.failing_frame,
            "exit_codes": sorted(set(self.exit_codes)),
            "signals": sorted(set(self.signals)),
            "versions": dict(sorted(self.versions.items())),
            "zero_stage": self.zero_stage,
            "world_size": self.world_size,
            "device_map": self.device_map,
            "dtype": self.dtype,
            "facts": sorted(self.facts),
            "setting": self.setting.summary(),
            "input_chars": self.input_chars,
            "scanned_chars": self.scanned_chars,
        }
