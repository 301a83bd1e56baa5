"""The C memory allocator a CPU training process runs with: tcmalloc or jemalloc when the system has one.

Every tensor on a CPU is a malloc. glibc's malloc keeps the pages of freed activations between the holes that
long-lived small objects leave, so a LoRA run's resident set grows for tens of steps past what it holds: SmolLM2-135M
LoRA on this project's 2-core Xeon held 0.79 GiB of live heap at its forward peak and 1.3 GiB resident.
Preloading tcmalloc (gperftools) bounds that and makes every allocation cheaper (bench/results/allocator.json):
the same run peaked at 1.15 GiB and trained 1.15x faster, a long-tailed LoRA run 1.16x faster at 0.77x the peak,
two `zero3` ranks 0.92 instead of 1.25 GiB each at 1.07x. PyTorch's own CPU launcher (`torch.backends.xeon.run_cpu`)
preloads one for the same reasons.

An allocator is chosen when the process starts, before the first malloc it would serve, so `shardfit train`
re-executes itself with LD_PRELOAD once (0.1 s). Torch-free: this runs before anything heavy is imported.
`SHARDFIT_ALLOCATOR` picks: `auto` (default: tcmalloc, else jemalloc, else the C library's), `system`, `tcmalloc`,
`jemalloc`, or the path of an allocator's shared library. Hosts with a GPU driver keep the C library's under
`auto`: GPU runs allocate little on the host and were not measured with another allocator.
"""

from __future__ import annotations

import os
import sys
import sysconfig
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from shardfit.errors import UserError

CHOICE_ENV = "SHARDFIT_ALLOCATOR"
# Set in the re-executed process (and inherited by torchrun's ranks): the allocator is decided, never re-exec again.
PRELOADED_ENV = "SHARDFIT_ALLOCATOR_PRELOADED"
# Shared-library names as distributions install them (Debian/Ubuntu: libtcmalloc-minimal4, libjemalloc2; conda:
# gperftools, jemalloc), in the order `auto` tries them: tcmalloc trained faster than jemalloc here at a similar peak.
LIBRARIES = {
    "tcmalloc": ("libtcmalloc_minimal.so.4", "libtcmalloc.so.4", "libtcmalloc_minimal.so", "libtcmalloc.so"),
    "jemalloc": ("libjemalloc.so.2", "libjemalloc.so"),
}
INSTALL_HINT = "apt install libtcmalloc-minimal4 (Debian/Ubuntu), dnf install gperftools-libs, or conda install " \
               "gperftools"
# Set (unless the user set them) in the re-executed process. gperftools prints a line for every allocation over
# 1 GiB (a CPU run's weights): not a user's business. oneDNN, which runs bf16 matmuls on a CPU, keeps up to 1024
# kernels (one per matmul shape and direction) by default; a full fine-tune with row widths of 96-1024 held 1.28 GiB
# at its peak with that and 1.20 GiB with 128, at the same speed (64: 1.17 GiB, 2 % slower). PyTorch's oneDNN
# wrapper (ideep) keeps a second cache above it, of whole matmul computations by shape, 1024 deep unless
# LRU_CACHE_CAPACITY says otherwise (intel/ideep#14): it grew by 70 MB of live heap over the same 48 steps, since
# nearly every step brings a new row width, and at 16 the peak fell by 0.05 GiB at the same speed, the kernels
# themselves still cached below it.
START_ENV = {"TCMALLOC_LARGE_ALLOC_REPORT_THRESHOLD": str(1 << 60), "ONEDNN_PRIMITIVE_CACHE_CAPACITY": "128",
             "LRU_CACHE_CAPACITY": "16"}
GPU_DEVICE_FILES = ("/dev/nvidiactl", "/dev/kfd")


@dataclass(frozen=True)
class Allocator:
    """A malloc implementation to preload: its name and shared library."""

    name: str
    path: str


def library_dirs() -> list[Path]:
    """Where shared libraries are installed: the environment's own lib (conda, a venv) first, then the system's."""
    arch = sysconfig.get_config_var("MULTIARCH") or ""
    dirs = [Path(sys.prefix) / "lib", Path("/usr/local/lib")]
    if arch:
        dirs += [Path("/usr/lib") / arch, Path("/lib") / arch]
    return dirs + [Path("/usr/lib64"), Path("/usr/lib")]


def find(name: str, dirs: Sequence[Path]) -> Allocator | None:
    """The first library of allocator `name` in `dirs`, or None."""
    for d in dirs:
        for lib in LIBRARIES[name]:
            if (d / lib).is_file():
                return Allocator(name, str(d / lib))
    return None


def gpu_host() -> bool:
    """True where a GPU driver is loaded (NVIDIA or ROCm): a look at /dev, no torch import."""
    return any(os.path.exists(p) for p in GPU_DEVICE_FILES)


def install_would_help(environ: Mapping[str, str], active_name: str, device_type: str) -> bool:
    """Whether installing tcmalloc would change this run: a CPU run on `auto` that found none on a host without a
    GPU (`choose` keeps the C library's malloc on a GPU host by design, so there it would change nothing)."""
    auto = (environ.get(CHOICE_ENV, "auto").strip() or "auto") == "auto"
    return device_type == "cpu" and active_name == "system" and auto and not gpu_host()


def choose(environ: Mapping[str, str], dirs: Sequence[Path] | None = None, *, gpu: bool = False) -> Allocator | None:
    """The allocator this process should run with, or None for the C library's own.

    None too when it is already decided: preloaded by an earlier start, or the user's LD_PRELOAD names a malloc."""
    if PRELOADED_ENV in environ or "malloc" in environ.get("LD_PRELOAD", ""):
        return None
    if sys.platform != "linux":
        return None
    choice = environ.get(CHOICE_ENV, "auto").strip() or "auto"
    dirs = library_dirs() if dirs is None else dirs
    if choice == "system":
        return None
    if choice == "auto":
        if gpu:
            return None
        return next((a for a in (find(n, dirs) for n in LIBRARIES) if a is not None), None)
    if choice in LIBRARIES:
        found = find(choice, dirs)
        if found is None:
            raise UserError(f"{CHOICE_ENV}={choice}: no {choice} library in {', '.join(map(str, dirs))}. Install it "
                            f"({INSTALL_HINT.split(',')[0] if choice == 'tcmalloc' else 'apt install libjemalloc2'}) "
                            f"or unset {CHOICE_ENV}.")
        return found
    if "/" in choice:
        if not Path(choice).is_file():
            raise UserError(f"{CHOICE_ENV}={choice}: no such file. Give the path of an allocator's shared library, "
                            f"or one of auto, system, {', '.join(LIBRARIES)}.")
        return Allocator(Path(choice).name, choice)
    raise UserError(f"{CHOICE_ENV}={choice}: not an allocator. Use auto, system, {', '.join(LIBRARIES)}, or the path "
                    "of an allocator's shared library.")


def preload_environment(environ: Mapping[str, str], allocator: Allocator) -> dict[str, str]:
    """`environ` for a process that starts with `allocator` preloaded (and its children: torchrun's ranks)."""
    env = dict(environ)
    env["LD_PRELOAD"] = os.pathsep.join(p for p in (allocator.path, environ.get("LD_PRELOAD", "")) if p)
    env[PRELOADED_ENV] = f"{allocator.name}:{allocator.path}"
    for key, value in START_ENV.items():
        env.setdefault(key, value)
    return env


def release_free_memory() -> str | None:
    """Hand the heap's free pages back to the system, so that the resident set falls to what is alive: tcmalloc's
    ReleaseFreeMemory, jemalloc's purge of every arena, or glibc's malloc_trim, whichever serves this process.
    Returns its name, or None where none of them is loaded. The pages of a freed tensor otherwise stay with the
    allocator, and Python's own objects, which come from arenas of their own, never reuse them."""
    import ctypes

    try:
        process = ctypes.CDLL(None)
    except OSError:
        return None
    if hasattr(process, "MallocExtension_ReleaseFreeMemory"):  # before glibc's: a preload leaves libc loaded too
        process.MallocExtension_ReleaseFreeMemory()
        return "tcmalloc"
    if hasattr(process, "mallctl"):  # 4096 is MALLCTL_ARENAS_ALL: every arena
        process.mallctl(b"arena.4096.purge", None, None, None, ctypes.c_size_t(0))
        return "jemalloc"
    if hasattr(process, "malloc_trim"):
        process.malloc_trim(ctypes.c_size_t(0))
        return "glibc"
    return None


def command_of(argv: Sequence[str]) -> str | None:
    """The subcommand of a `shardfit` command line (its first word that is not an option)."""
    return next((a for a in argv if not a.startswith("-")), None)


def reexec_with_allocator(args: Sequence[str], environ: Mapping[str, str]) -> None:
    """For `shardfit train` (`args`: the words after the program), re-execute this process with the chosen
    allocator preloaded; returns when there is nothing to change. Only the process entry calls it."""
    if command_of(args) != "train":
        return
    allocator = choose(environ, gpu=gpu_host())
    if allocator is None or not sys.executable:  # an embedded interpreter cannot be started again
        return
    sys.stdout.flush()
    sys.stderr.flush()
    os.execve(sys.executable, [sys.executable, *sys.orig_argv[1:]], preload_environment(environ, allocator))


def active(maps: str | None = None) -> str:
    """The allocator this process runs with, as a run reports it: a preloaded library's name if it is mapped into
    the process, else `system`."""
    mark = os.environ.get(PRELOADED_ENV, "")
    name, _, path = mark.partition(":")
    if not path:
        return "system"
    if maps is None:
        try:
            maps = Path("/proc/self/maps").read_text()
        except OSError:
            return "system"
    return name if path in maps or os.path.realpath(path) in maps else "system"
