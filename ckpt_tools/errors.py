"""One exception hierarchy, mapped to the exit codes of CONTRACT.md.

Messages name the file, the tensor where one applies, and what to do next; the CLI prints
them as a single ``error: ...`` line.
"""

from __future__ import annotations

import reprlib
from typing import Any


class CkptError(Exception):
    """Base class: anything the tool reports to its user on purpose. Its text is always one
    line: control characters from file names or pickled values are escaped (:func:`one_line`)."""

    exit_code = 5

    def __str__(self) -> str:
        return one_line(super().__str__())


class VerifyFailed(CkptError):
    """`verify` found a difference or a damaged file."""

    exit_code = 1


class UsageError(CkptError):
    """Bad flags or option values."""

    exit_code = 2


class BadInput(CkptError):
    """Unknown format, corrupt or truncated file, unsafe content, inconsistent shards."""

    exit_code = 3


class Damaged(BadInput):
    """A file of a known format whose bytes are not all there or not what the format says
    (truncated, corrupt, a data file missing): ``verify`` reports it as a finding (exit 1),
    other commands refuse it (exit 3)."""


class UnsafeInput(BadInput):
    """Input that would run code if loaded (a pickle with a callable, TorchScript)."""


class NewerFormat(BadInput):
    """Written by a newer release (of torch, say) than ckpt reads: not damage, an upgrade."""


class DestinationError(CkptError):
    """DST exists without --overwrite, is not writable, or the disk is full."""

    exit_code = 4


def first_line(e: BaseException) -> str:
    """The first line of an exception's message (at most 300 characters), for one-line errors."""
    text = str(e).strip().splitlines()
    return text[0][:300] if text else type(e).__name__


_ESCAPES = {i: f"\\x{i:02x}" for i in [*range(0x20), 0x7F, *range(0x80, 0xA0)]}
_ESCAPES.update({ord("\n"): "\\n", ord("\r"): "\\r", ord("\t"): "\\t",
                 0x2028: "\\u2028", 0x2029: "\\u2029", 0x85: "\\x85"})


def one_line(text: str) -> str:
    """``text`` with every control character (newline, carriage return, escape sequences, Unicode
    line separators) written as a backslash escape: a file named ``"a\\nerror: forged"`` cannot
    start a second line on the user's terminal, nor move its cursor."""
    return text.translate(_ESCAPES)


_BRIEF = reprlib.Repr()
_BRIEF.maxlevel, _BRIEF.maxstring, _BRIEF.maxother, _BRIEF.maxlong = 3, 60, 60, 40
for _attr in ("maxtuple", "maxlist", "maxarray", "maxdict", "maxset", "maxfrozenset", "maxdeque"):
    setattr(_BRIEF, _attr, 4)
del _attr


def brief(value: Any) -> str:
    """A short ``repr`` for messages, bounded however deep or shared the value is (a plain
    ``repr`` of a pickled "billion laughs" list never ends)."""
    try:
        return _BRIEF.repr(value)[:200]
    except Exception:  # noqa: BLE001 - a stand-in whose repr fails
        return f"<{type(value).__name__}>"


def count(n: int, noun: str) -> str:
    """``n`` and ``noun``, plural unless one: ``count(1, "rank") == "1 rank"``, ``count(8, "rank") == "8 ranks"``."""
    return f"{n} {noun}" if n == 1 else f"{n} {noun}s"
