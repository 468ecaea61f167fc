"""When two pickles differ only in their values: the case of a many-rank job's files.

A job's per-rank files pickle the same state dict: the same opcodes, the same memo references,
the same string lengths; only numbers (the rank, a local size) and same-length strings differ.
Two such pickles build trees of one shape, so what the careful reader proved of the first (no
global off the allowlist is reached by structure alone, no runaway depth or sharing, no dict key
whose hash never ends) holds of the second: dict keys that were names or numbers still are, and
containers and references are where they were. Only values change, and those the C unpickler's
``find_class`` and ``persistent_load`` (the same checks) still see.

:class:`Skeleton` is a pickle's value bytes; :meth:`Skeleton.same_shape` answers, in C-speed
slices plus a look at each differing byte, whether another pickle differs from it only there.
"""

from __future__ import annotations

import bisect
import pickletools

# opcode -> (bytes before the value, bytes of length prefix); the value is what follows
_FIXED = {"BININT1": 1, "BININT2": 2, "BININT": 4, "BINFLOAT": 8}
_SIZED = {"LONG1": 1, "SHORT_BINUNICODE": 1, "SHORT_BINBYTES": 1, "BINUNICODE": 4, "BINBYTES": 4}
_BLOCK = 512
MAX_DIFFERENT = 4096  # differing bytes worth checking one by one; beyond, parse the careful way


class Skeleton:
    """The byte ranges of a pickle that hold values (numbers, string and bytes contents), outside
    of which another pickle of the same shape must be byte-equal."""

    def __init__(self, data: bytes) -> None:
        self.data = data
        starts, ends = [], []
        for op, _arg, pos in pickletools.genops(data):
            if op.name in _FIXED:
                start, end = pos + 1, pos + 1 + _FIXED[op.name]
            elif op.name in _SIZED:
                n = _SIZED[op.name]
                start = pos + 1 + n
                end = start + int.from_bytes(data[pos + 1:start], "little")
            else:
                continue
            if end > start:
                starts.append(start)
                ends.append(end)
        self._starts, self._ends = starts, ends

    def _is_value(self, i: int) -> bool:
        k = bisect.bisect_right(self._starts, i) - 1
        return k >= 0 and i < self._ends[k]

    def same_shape(self, other: bytes) -> bool:
        """Whether ``other`` is this pickle with at most :data:`MAX_DIFFERENT` value bytes changed."""
        a = self.data
        if len(other) != len(a):
            return False
        different = 0
        for i in range(0, len(a), _BLOCK):
            if a[i:i + _BLOCK] == other[i:i + _BLOCK]:
                continue
            for j in range(i, min(i + _BLOCK, len(a))):
                if a[j] != other[j]:
                    different += 1
                    if different > MAX_DIFFERENT or not self._is_value(j):
                        return False
        return True
