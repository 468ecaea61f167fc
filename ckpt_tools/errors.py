"""One exception hierarchy, mapped to the exit codes of CONTRACT.md.

Messages name the file, the tensor where one applies, and what to do next; the CLI prints
them as a single ``error: ...`` line.
"""

from __future__ import annotations


class CkptError(Exception):
    """Base class: anything the tool reports to its user on purpose."""

    exit_code = 5


class VerifyFailed(CkptError):
    """`verify` found a difference or a damaged file."""

    exit_code = 1


class UsageError(CkptError):
    """Bad flags or option values."""

    exit_code = 2


class BadInput(CkptError):
    """Unknown format, corrupt or truncated file, unsafe content, inconsistent shards."""

    exit_code = 3


class UnsafeInput(BadInput):
    """Input that would run code if loaded (a pickle with a callable, TorchScript)."""


class DestinationError(CkptError):
    """DST exists without --overwrite, is not writable, or the disk is full."""

    exit_code = 4


def first_line(e: BaseException) -> str:
    """The first line of an exception's message (at most 300 characters), for one-line errors."""
    text = str(e).strip().splitlines()
    return text[0][:300] if text else type(e).__name__
