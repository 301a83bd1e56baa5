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


class DoesNotFitError(ShardfitError):
    """The plan predicts out-of-memory for every allowed strategy (or the chosen one)."""

    exit_code = 3


class JobFailed(ShardfitError):
    """The job started and failed (diverged, could not write a checkpoint); the message says what survives."""

    exit_code = 1


class Interrupted(ShardfitError):
    """The user stopped the job (Ctrl-C); the message says which checkpoint survives and how to resume."""

    exit_code = 130  # 128 + SIGINT, what a shell reports for a command stopped by Ctrl-C
