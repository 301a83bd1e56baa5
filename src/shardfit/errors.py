"""Errors that reach the user as a message and an exit code, never as a traceback."""

from __future__ import annotations


class ShardfitError(Exception):
    """Base class: `exit_code` is what the CLI returns."""

    exit_code = 1


class UserError(ShardfitError):
    """Bad input (config, data, arguments). The message names the file/line/key and the fix."""

    exit_code = 2


class DoesNotFitError(ShardfitError):
    """The plan predicts out-of-memory for every allowed strategy (or the chosen one)."""

    exit_code = 3


class JobFailed(ShardfitError):
    """The job started and failed (diverged, could not write a checkpoint); the message says what survives."""

    exit_code = 1
