"""Where a rank is, read from another thread: its main thread's Python stack (which collective, which FSDP unit,
which line of ours) and torch's flight recorder (the collectives it has issued and which are still pending).

The stack works on every backend. The flight recorder (TORCH_FR_BUFFER_SIZE, set by `init_distributed`) records
every collective of gloo and NCCL process groups; comparing how far each rank got names the rank that is behind.
"""

from __future__ import annotations

import json
import sys
import threading
import traceback
from dataclasses import dataclass, field
from types import FrameType
from typing import Any

# Torch's own files, by the part of their path that names them.
C10D = "torch/distributed/distributed_c10d.py"
FUNCTIONAL = "torch/distributed/_functional_collectives.py"
FSDP2 = "torch/distributed/fsdp/_fully_shard/"
DDP = "torch/nn/parallel/distributed.py"
# FSDPParamGroup methods and what the rank waits for inside them.
FSDP_GATHER = ("unshard", "wait_for_unshard", "pre_forward", "pre_backward", "_prefetch_unshard")
FSDP_REDUCE = ("post_backward", "foreach_reduce", "finalize_backward")


@dataclass
class Where:
    collective: str | None  # "all_reduce", "all_gather of model.layers.3's parameters", ...
    frame: str | None  # the innermost frame outside torch: "shardfit/train/recipe.py:231 in train_step"
    stack: list[str] = field(default_factory=list)  # the main thread's frames, outermost first


def _short(filename: str) -> str:
    """A path as people recognise it: from the package down (site-packages/ and src/ stripped)."""
    f = filename.replace("\\", "/")
    for cut in ("site-packages/", "/src/"):
        if cut in f:
            return f.split(cut, 1)[1]
    return f


def main_thread_frame() -> FrameType | None:
    return sys._current_frames().get(threading.main_thread().ident or -1)


def _frames(frame: FrameType | None) -> list[FrameType]:
    """Innermost first."""
    out = []
    while frame is not None:
        out.append(frame)
        frame = frame.f_back
    return out


def _fsdp_unit(frame: FrameType) -> str | None:
    """The module an FSDPParamGroup frame works for (its fully-qualified name), if this frame has one."""
    owner = frame.f_locals.get("self")
    if type(owner).__name__ != "FSDPParamGroup":
        return None
    return getattr(owner, "_module_fqn", None) or "the root module"


def collective_of(frames: list[FrameType]) -> str | None:
    """The collective a stack is inside, described as precisely as its frames allow."""
    paths = [(f, f.f_code.co_filename.replace("\\", "/"), f.f_code.co_name) for f in frames]
    for f, path, name in paths:  # FSDP2 names the unit whose parameters or gradients move
        if FSDP2 in path:
            unit = _fsdp_unit(f)
            if unit is not None and name in FSDP_GATHER:
                return f"all_gather of {unit}'s parameters (FSDP)"
            if unit is not None and name in FSDP_REDUCE:
                return f"reduce_scatter of {unit}'s gradients (FSDP)"
    public = [name for _, path, name in paths if (C10D in path or FUNCTIONAL in path) and not name.startswith("_")
              and name != "wrapper"]
    if public:
        return public[-1]  # the outermost public call: all_gather_object rather than the all_gather inside it
    if any(DDP in path and name == "_pre_forward" for _, path, name in paths):
        return "broadcast of buffers (DDP forward)"
    return None


def where_is(frame: FrameType | None) -> Where:
    """The collective, our innermost frame and the stack of `frame` (a thread's current frame)."""
    frames = _frames(frame)
    ours = next((f for f in frames if "/torch/" not in f.f_code.co_filename.replace("\\", "/")
                 and "threading.py" not in f.f_code.co_filename), None)
    where = f"{_short(ours.f_code.co_filename)}:{ours.f_lineno} in {ours.f_code.co_name}" if ours else None
    stack = [f"{_short(f.f_code.co_filename)}:{f.f_lineno} in {f.f_code.co_name}" for f in reversed(frames)]
    # In backward, DDP's gradient all-reduce runs in C++ threads: no frame shows it, the flight recorder does.
    return Where(collective_of(frames), where, stack)


def all_stacks() -> str:
    """Every thread's Python stack, main thread first (faulthandler's content, as text we can also parse)."""
    frames = sys._current_frames()
    names = {t.ident: t.name for t in threading.enumerate()}
    main = threading.main_thread().ident
    out = []
    for ident in sorted(frames, key=lambda i: i != main):
        out.append(f"Thread {ident} ({names.get(ident, '?')}), most recent call last:")
        out += ["  " + line.rstrip("\n").replace("\n", "\n  ") for line in traceback.format_stack(frames[ident])]
    return "\n".join(out)


def flight_recorder() -> dict[str, Any] | None:
    """This process's flight recorder: collectives still pending, and the last one issued per process group.
    None when torch has no recorder or nothing was recorded (TORCH_FR_BUFFER_SIZE unset at group creation)."""
    try:
        import torch._C._distributed_c10d as c10d  # private, and absent from builds without distributed
    except ImportError:
        return None
    dump = getattr(c10d, "_dump_fr_trace_json", None) or getattr(c10d, "_dump_nccl_trace_json", None)
    if dump is None:
        return None
    try:
        data = json.loads(dump(True, False))
    except (RuntimeError, ValueError, TypeError):
        return None
    entries = data.get("entries") or []
    status = data.get("pg_status") or {}
    if not entries and not status:
        return None
    pending = [{"op": str(e.get("profiling_name", "?")).split(":")[-1], "seq": int(e.get("collective_seq_id", 0)),
                "pg": str(e.get("pg_id", "?")), "sizes": e.get("input_sizes")}
               for e in entries if not e.get("retired") and e.get("state") != "completed"]
    enqueued = {str(pg): int(v.get("last_enqueued_collective", -1)) for pg, v in status.items()}
    return {"pending": sorted(pending, key=lambda p: (p["pg"], p["seq"])), "enqueued": enqueued}
