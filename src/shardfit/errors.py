"""Errors that reach the user as a message and an exit code, never as a traceback."""

from __future__ import annotations


class ShardfitError(Exception):
    """Base class: `exit_code` is what the CLI returns."""

    exit_code = 1


class UserError(ShardfitError):
    """Bad input (config, data, arguments). The message names the file/line/key and the fix."""

    exit_code = 2


class RemoteCodeRefused(UserError):
    """The model folder ships Python code it needs in order to load, and trust_remote_code was off. The message
    names the config key (train and check read configs); chat, eval and export take the permission from their
    command line only and say so with `for_command_line`."""

    source_name = ""

    def for_command_line(self, run_config: object | None = None) -> UserError:
        """The error worded for a command's `--trust-remote-code`; `run_config`: the run directory's config.yaml
        when it asked for remote code, which a run directory cannot grant."""
        why = (f" {run_config} says trust_remote_code: true, but a run directory cannot allow code to run: only "
               "the command line can.") if run_config else ""
        return UserError(f"{self.source_name} ships its own Python code, which runs only with --trust-remote-code; "
                         f"pass it if you trust that folder.{why}")


class PlannerBug(ShardfitError):
    """Two of the planner's paths disagree (a memory part below zero): a bug in shardfit, never the input's fault.
    Raised, not asserted, so `python -O` cannot hide it; the message names the part and asks for a report."""

    exit_code = 1


class DoesNotFitError(ShardfitError):
    """The plan predicts out-of-memory for every allowed strategy (or the chosen one)."""

    exit_code = 3


class JobFailed(ShardfitError):
    """The job started and failed (out of memory, diverged, could not write a checkpoint); the message says what
    survives and what to change."""

    exit_code = 1


class Interrupted(ShardfitError):
    """Ctrl-C (any command); `train` says which checkpoint survives and the command that resumes."""

    exit_code = 130  # 128 + SIGINT, what a shell reports for a command stopped by Ctrl-C


# What the allocators say when they cannot allocate: torch's CPU allocator (malloc failing), C++'s operator new, and
# the device allocators (torch.OutOfMemoryError's messages). Read without importing torch: the CLI's last guard
# uses it too, and `plan` and `diagnose` start without torch.
HOST_OOM = ("DefaultCPUAllocator: can't allocate memory", "std::bad_alloc")
DEVICE_OOM = ("CUDA out of memory", "CUDA error: out of memory", "HIP out of memory", "XPU out of memory",
              "MPS backend out of memory")


def ran_out(e: BaseException, device_type: str = "") -> str | None:
    """What ran out when `e` is an out-of-memory error, in words ("host RAM", "GPU memory"); None for any other
    error. `device_type`: the device the process computes on, when known ("cuda", "cpu")."""
    text = str(e)
    if type(e).__name__ == "OutOfMemoryError" or any(k in text for k in DEVICE_OOM):
        return "GPU memory" if device_type != "cpu" else "memory"
    if isinstance(e, MemoryError) or (isinstance(e, RuntimeError) and any(k in text for k in HOST_OOM)):
        return "host RAM"
    return None
