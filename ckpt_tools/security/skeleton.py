"""When two pickles differ only in their values: the case of a many-rank job's files.

A job's per-rank files pickle the same state dict: the same opcodes, the same memo references,
the same string lengths; only numbers (the rank, a local size) and same-length strings differ.
Two such pickles build trees of one shape, so what the careful reader proved of the first (no
global off the allowlist is reached by structure alone, no runaway depth or sharing, no dict key
whose hash never ends) holds of the second: dict keys that were names or numbers still are, and
containers and references are where they were. Only values change, and those the C unpickler's
``find_class`` and ``persistent_load`` (the same checks) still see.

An int is pickled at the width its value needs (``BININT1`` up to 255, ``BININT2`` up to
65,535, ``BININT`` for other 32-bit values, ``LONG1`` beyond), so rank files whose local sizes
differ (a trailing rank's fewer rows, 256 against 255) have pickles of different lengths. Any of
these four in place of another is still one int: the same node of the same tree, so it counts
as a value too, and the rest of the pickle is compared shifted by the width's change. (Picklers
of protocol 2 and up never memoize an int; a memo put after one is no value and must be where
the model has it, like every other byte outside the values.)

:class:`Skeleton` is where a pickle's values lie; :meth:`Skeleton.same_shape` walks another
pickle in step with it: C-speed block compares up to each difference, then a look at what
differs (a value's bytes, or one int opcode for another), at Python cost per difference.
"""

from __future__ import annotations

import bisect
import io
import pickle
import pickletools
import re
from array import array
from collections.abc import Iterable

# opcode -> bytes of its value (fixed width) / of its value's length prefix (sized)
_FIXED = {ord("K"): 1, ord("M"): 2, ord("J"): 4, ord("G"): 8}  # BININT1, BININT2, BININT, BINFLOAT
_SIZED = {0x8A: 1, 0x8C: 1, ord("C"): 1, ord("X"): 4, ord("B"): 4}  # LONG1, SHORT_BINUNICODE, ..BINBYTES
_LONG1 = 0x8A
_INTS = {ord("K"): 1, ord("M"): 2, ord("J"): 4}  # and LONG1: one int, whatever the width
_STRINGS = {0x8C: 1, ord("X"): 4}  # SHORT_BINUNICODE, BINUNICODE: their length prefix
_STOP = ord(".")
_BLOCK, _MAX_BLOCK = 256, 1 << 16
_OPS = {ord(op.code): op for op in pickletools.opcodes}


def _run_pattern() -> re.Pattern[bytes]:
    """A run of opcodes of fixed length that hold no value (memo puts and gets, tuple and dict
    building, ...): skipped at C speed while scanning."""
    by_width: dict[int, list[int]] = {}
    for code, op in _OPS.items():
        width = 0 if op.arg is None else op.arg.n
        if code not in _FIXED and code not in _SIZED and code != _STOP and width >= 0:
            by_width.setdefault(width, []).append(code)
    alts = [b"[" + b"".join(re.escape(bytes([c])) for c in sorted(codes)) + b"]" + (b".{%d}" % w if w else b"")
            for w, codes in sorted(by_width.items())]
    return re.compile(b"(?:" + b"|".join(alts) + b")*", re.DOTALL)


_RUN = _run_pattern()


def _scan(data: bytes) -> tuple[array, array]:
    """Start and end of every opcode holding a value (the opcode byte, any length prefix, the
    value), up to STOP. ValueError for an opcode pickle does not have or a truncated one."""
    starts, ends = array("q"), array("q")
    n, pos, stream = len(data), 0, None
    while pos < n:
        pos = _RUN.match(data, pos).end()
        if pos >= n:
            break
        code = data[pos]
        width = _FIXED.get(code)
        if width is not None:
            end = pos + 1 + width
        elif (prefix := _SIZED.get(code)) is not None:
            end = pos + 1 + prefix + int.from_bytes(data[pos + 1:pos + 1 + prefix], "little")
        elif code == _STOP:
            break
        elif (op := _OPS.get(code)) is not None:  # lines (GLOBAL) or other lengths: no value
            stream = stream or io.BytesIO(data)
            stream.seek(pos + 1)
            op.arg.reader(stream)
            pos = stream.tell()
            continue
        else:
            raise ValueError(f"not a pickle opcode: {code:#x} at {pos}")
        if end > n:
            raise ValueError("a truncated value")
        starts.append(pos)
        ends.append(end)
        pos = end
    return starts, ends


def first_difference(a: bytes, i: int, b: bytes, j: int) -> int | None:
    """The first ``k`` with ``a[i + k] != b[j + k]`` (or where one ends first); None when
    ``a[i:] == b[j:]``. Blocks compared at C speed, doubling while equal."""
    na, nb = len(a) - i, len(b) - j
    n, k, step = min(na, nb), 0, _BLOCK
    while k < n:
        m = min(step, n - k)
        x, y = a[i + k:i + k + m], b[j + k:j + k + m]
        if x != y:
            diff = int.from_bytes(x, "big") ^ int.from_bytes(y, "big")
            return k + m - 1 - (diff.bit_length() - 1) // 8
        k += m
        step = min(2 * step, _MAX_BLOCK)
    return None if na == nb else n


def _int_end(b: bytes, at: int) -> int | None:
    """Where the int opcode at ``b[at]`` ends; None if none is there."""
    if at >= len(b):
        return None
    code = b[at]
    if code in _INTS:
        end = at + 1 + _INTS[code]
    elif code == _LONG1 and at + 1 < len(b):
        end = at + 2 + b[at + 1]
    else:
        return None
    return end if end <= len(b) else None


class Skeleton:
    """Where a pickle holds values (numbers, string and bytes contents), outside of which
    another pickle of the same shape must be byte-equal (shifted by any int's change of width)."""

    def __init__(self, data: bytes) -> None:
        self.data = data
        try:
            self._starts, self._ends = _scan(data)
        except ValueError:  # never after the careful reader; then nothing is proved like it
            self._starts = self._ends = None

    def same_shape(self, other: bytes) -> bool:
        """Whether ``other`` is this pickle with values changed: in each opcode holding one,
        the value's bytes (the same opcode, the same length), or one int opcode for another;
        everything else (every other opcode, memo index, length, GLOBAL name, and what follows
        STOP) byte-equal."""
        a, starts, ends = self.data, self._starts, self._ends
        if starts is None:
            return False
        i = j = 0  # in step: each at an opcode's start, everything before them the same shape
        while True:
            k = first_difference(a, i, other, j)
            if k is None:
                return True
            at = i + k
            n = bisect.bisect_right(starts, at) - 1
            if n < 0 or at >= ends[n]:
                return False  # not within an opcode holding a value
            start, end = starts[n], ends[n]  # start >= i: i is an opcode's start
            if at >= start + 1 + _SIZED.get(a[start], 0):
                i, j = end, end + j - i  # the same opcode and length: its value's bytes differ
            else:  # the opcode (or a LONG1's length) differs: one int for another, or nothing
                other_end = _int_end(other, start + j - i)
                if (a[start] not in _INTS and a[start] != _LONG1) or other_end is None:
                    return False
                i, j = end, other_end
            if j > len(other):
                return False

    def differing_values(self, other: bytes) -> list[tuple[int, int]] | None:
        """Where ``other``, of this pickle's length, differs from it: the ``(start, end)`` of
        each opcode holding a value whose bytes differ (same opcode, same length). None if any
        other byte differs, or the lengths do."""
        a, starts, ends = self.data, self._starts, self._ends
        if starts is None or len(other) != len(a):
            return None
        found: list[tuple[int, int]] = []
        i = 0
        while (k := first_difference(a, i, other, i)) is not None:
            at = i + k
            n = bisect.bisect_right(starts, at) - 1
            if n < 0 or at >= ends[n]:
                return None
            start, end = starts[n], ends[n]
            if at < start + 1 + _SIZED.get(a[start], 0):
                return None  # the opcode or a length prefix differs
            found.append((start, end))
            i = end
        return found

    def strings(self) -> dict[bytes, list[int]]:
        """Each string this pickle holds as a value (its UTF-8 bytes) -> the indexes of its
        opcodes among the values."""
        a, starts, ends, found = self.data, self._starts, self._ends, {}
        for n, start in enumerate(starts or ()):
            prefix = _STRINGS.get(a[start])
            if prefix is not None:
                found.setdefault(a[start + 1 + prefix:ends[n]], []).append(n)
        return found

    def value_at(self, n: int) -> tuple[int, int] | None:
        """The ``n``-th value's opcode ``(start, end)``, None past the last."""
        starts = self._starts
        return (starts[n], self._ends[n]) if starts is not None and 0 <= n < len(starts) else None


def int_value(data: bytes, start: int, end: int) -> int | None:
    """The int that the opcode at ``data[start:end]`` pushes; None if it pushes no int."""
    code = data[start]
    if code == _LONG1:
        return int.from_bytes(data[start + 2:end], "little", signed=True)
    if code not in _INTS:
        return None
    return int.from_bytes(data[start + 1:end], "little", signed=code == ord("J"))


def int_at(data: bytes, at: int) -> tuple[int, int] | None:
    """The int that an int opcode at ``data[at]`` pushes, and where the opcode ends; None if no
    int opcode is there."""
    end = _int_end(data, at)
    return None if end is None else (int_value(data, at, end), end)


def with_ints(data: bytes, places: Iterable[tuple[int, int, int]]) -> bytes:
    """``data`` with the opcode at each ``(start, end, value)`` (in order, apart) replaced by
    the int opcode for ``value``."""
    parts, at = [], 0
    for start, end, value in places:
        parts += (data[at:start], int_opcode(value))
        at = end
    parts.append(data[at:])
    return b"".join(parts)


def int_opcode(value: int) -> bytes:
    """``value`` as the pickler writes it (protocol 2 and up): the narrowest int opcode."""
    return pickle.dumps(value, protocol=2)[2:-1]
