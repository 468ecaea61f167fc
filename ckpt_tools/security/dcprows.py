"""DCP's three many-rank records read as rows, not as objects.

A 256-rank ``.metadata`` is mostly three records, one per chunk and two per storage entry: a
``ChunkStorageMetadata`` (offsets and sizes, two ``torch.Size``), a ``MetadataIndex`` (name and
offsets) and a ``_StorageInfo`` (file, offset, length). Unpickled, each is an object with a
state dict, the tuples a ``torch.Size`` call makes, and a ``__setstate__`` call: 0.7 s of the
0.9 s it took to read such a file, and most of what it then held in memory.

:class:`Rows` reads each of these records, where it is pickled as torch pickles it, in one
step of :func:`~ckpt_tools.security.fastpickle.load` into a tuple: :class:`ChunkRow`
``(offsets, sizes)``, :class:`IndexKey` ``(fqn, offsets)`` (what a ``MetadataIndex`` hashes and
compares as; its ``index`` is only a hint) and :class:`StorageRow` ``(file, offset, length)``;
each reads the attributes the record has. Any other form of the record (another field, another
order, a ``torch.Size`` of more than three dims, a string not read in one step) is read as an
object as before, and :func:`~ckpt_tools.security.dcpmeta.compact` turns every record it can
into its row afterwards, so the tree is the same whichever reader built it (tested).

The memo keeps the row for the record and the values of its ``torch.Size`` tuples. Its state
dict and the argument tuple of each ``torch.Size`` call are not built: their memo entries are
:data:`UNREAD`, which :func:`~ckpt_tools.security.bounded.check_tree` turns into a
:class:`~ckpt_tools.security.fastpickle.Decline` if the pickle ever put one into its tree (the
file is then read again the careful way). torch never does.
"""

from __future__ import annotations

import struct
from operator import itemgetter
from typing import Any

from . import bounded
from .fastpickle import Decline

_U4 = struct.Struct("<I").unpack_from
_I4 = struct.Struct("<i").unpack_from
_NEW = b")\x81\x94}\x94("  # EMPTY_TUPLE NEWOBJ MEMOIZE, its state: EMPTY_DICT MEMOIZE MARK
_CALL = b"\x85\x94R\x94"  # TUPLE1 MEMOIZE REDUCE MEMOIZE: Size((...))
_TUPLE_OF = {0x85: 1, 0x86: 2, 0x87: 3}  # TUPLE1..3: how many ints it takes
_END = 0x75, 0x62  # SETITEMS BUILD: the state set


class ChunkRow(tuple):
    """A ``ChunkStorageMetadata``: ``(offsets, sizes)``, tuples of non-negative ints of one length."""

    __slots__ = ()
    offsets = property(itemgetter(0))
    sizes = property(itemgetter(1))


class IndexKey(tuple):
    """A ``MetadataIndex`` as it hashes and compares: ``(fqn, offsets or None)``."""

    __slots__ = ()
    _safe_hash = True  # a name and a flat tuple of ints (bounded.check_key)
    fqn = property(itemgetter(0))
    offset = property(itemgetter(1))
    index = None

    def _key(self) -> tuple:
        return self


class StorageRow(tuple):
    """A ``_StorageInfo`` without transforms: ``(relative_path, offset, length)``."""

    __slots__ = ()
    relative_path = property(itemgetter(0))
    offset = property(itemgetter(1))
    length = property(itemgetter(2))
    transform_descriptors = None


class _Unread:
    """The memo entry of a part of a record that was not built (its state dict, a call's arguments)."""

    __slots__ = ()

    def __repr__(self) -> str:
        return "<unread>"


UNREAD = _Unread()


def _refused(_: Any) -> None:
    raise Decline("a pickle refers back to part of a DCP record read as a row")


for _row in (ChunkRow, IndexKey, StorageRow):
    bounded.inert(_row)
bounded.register(_Unread, _refused)

_NO = object()


class Rows:
    """The readers of one file: ``readers(classes)`` maps the record classes ``find_class``
    gives to the steps :func:`~ckpt_tools.security.fastpickle.load` takes for them."""

    def __init__(self) -> None:
        self._names: dict[bytes, str] = {}  # one string per distinct name or path

    def readers(self, chunk: type, index: type, storage: type) -> dict[type, Any]:
        return {chunk: self.chunk, index: self.index, storage: self.storage}

    # each reader: the record whose class is on the stack and whose ``)`` is at ``pos``, as
    # ``(row, end)`` with its memo entries added; or None (nothing added) to read it as an object

    def chunk(self, buf: bytes, pos: int, fend: int, memo: list[Any]) -> tuple[ChunkRow, int] | None:
        if not buf.startswith(_NEW, pos):
            return None
        key, p = _ref(buf, pos + 6, memo)
        if key != "offsets" or type(key) is not str:
            return None
        offsets, p, m1 = _size(buf, p, memo)
        if p < 0:
            return None
        key, p = _ref(buf, p, memo)
        if key != "sizes" or type(key) is not str:
            return None
        sizes, p, m2 = _size(buf, p, memo)
        if p < 0 or len(sizes) != len(offsets) or p + 2 > fend or buf[p] != 0x75 or buf[p + 1] != 0x62:
            return None
        row = ChunkRow((offsets, sizes))
        memo += (row, UNREAD, *m1, *m2)
        return row, p + 2

    def index(self, buf: bytes, pos: int, fend: int, memo: list[Any]) -> tuple[IndexKey, int] | None:
        if not buf.startswith(_NEW, pos):
            return None
        key, p = _ref(buf, pos + 6, memo)
        if key != "fqn" or type(key) is not str:
            return None
        fqn, p, new = self._str(buf, p, memo)
        if p < 0:
            return None
        key, p = _ref(buf, p, memo)
        if key != "index" or type(key) is not str:
            return None
        if buf[p] == 0x4e:  # NONE
            p += 1
        else:
            _, p = _int(buf, p)
            if p < 0:
                return None
        offsets, m = None, ()
        if buf[p] != 0x75:
            key, p = _ref(buf, p, memo)
            if key != "offset" or type(key) is not str:
                return None
            offsets, p, m = _size(buf, p, memo)
            if p < 0:
                return None
        if p + 2 > fend or buf[p] != 0x75 or buf[p + 1] != 0x62:
            return None
        row = IndexKey((fqn, offsets))
        memo += (row, UNREAD, *new, *m)
        return row, p + 2

    def storage(self, buf: bytes, pos: int, fend: int, memo: list[Any]) -> tuple[StorageRow, int] | None:
        if not buf.startswith(_NEW, pos):
            return None
        key, p = _ref(buf, pos + 6, memo)
        if key != "relative_path" or type(key) is not str:
            return None
        path, p, new = self._str(buf, p, memo)
        if p < 0:
            return None
        key, p = _ref(buf, p, memo)
        if key != "offset" or type(key) is not str:
            return None
        offset, p = _int(buf, p)
        if p < 0:
            return None
        key, p = _ref(buf, p, memo)
        if key != "length" or type(key) is not str:
            return None
        length, p = _int(buf, p)
        if p < 0 or p + 2 > fend or buf[p] != 0x75 or buf[p + 1] != 0x62:
            return None
        row = StorageRow((path, offset, length))
        memo += (row, UNREAD, *new)
        return row, p + 2

    def _str(self, buf: bytes, p: int, memo: list[Any]) -> tuple[Any, int, tuple]:
        """A string: a memo reference to one, or SHORT_BINUNICODE MEMOIZE (with the memo entry
        it adds); position -1 for anything else."""
        if buf[p] == 0x8c:
            end = p + 2 + buf[p + 1]
            if buf[end] != 0x94:
                return None, -1, ()
            raw = buf[p + 2:end]
            s = self._names.get(raw)
            if s is None:
                s = self._names[raw] = str(raw, "utf-8", "surrogatepass")
            return s, end + 1, (s,)
        s, p = _ref(buf, p, memo)
        return (s, p, ()) if type(s) is str else (None, -1, ())


def _ref(buf: bytes, p: int, memo: list[Any]) -> tuple[Any, int]:
    """A memo reference (BINGET, LONG_BINGET): its object and where the next opcode is."""
    op = buf[p]
    if op == 0x68:
        i, p = buf[p + 1], p + 2
    elif op == 0x6a:
        i, p = _U4(buf, p + 1)[0], p + 5
    else:
        return _NO, -1
    return (memo[i], p) if i < len(memo) else (_NO, -1)


def _int(buf: bytes, p: int) -> tuple[int, int]:
    """An int as the pickler writes one (BININT1, BININT2, BININT, LONG1 of up to 8 bytes)."""
    op = buf[p]
    if op == 0x4b:
        return buf[p + 1], p + 2
    if op == 0x4d:
        return buf[p + 1] | buf[p + 2] << 8, p + 3
    if op == 0x4a:
        return _I4(buf, p + 1)[0], p + 5
    if op == 0x8a and buf[p + 1] <= 8:
        end = p + 2 + buf[p + 1]
        return int.from_bytes(buf[p + 2:end], "little", signed=True), end
    return 0, -1


def _size(buf: bytes, p: int, memo: list[Any]) -> tuple[tuple, int, tuple]:
    """``torch.Size((...))`` of up to 3 non-negative ints, read as the careful reader reads it
    (its global is the ``tuple`` find_class gives for it), or a memo reference to such a tuple
    (a Size pickled before): the tuple, where the next opcode is, and the memo entries it adds;
    position -1 for anything else."""
    cls, p = _ref(buf, p, memo)
    if cls is not tuple:
        if type(cls) is tuple and len(cls) <= 64 and all(type(v) is int and v >= 0 for v in cls):
            return cls, p, ()
        return (), -1, ()
    if buf[p] == 0x29:  # EMPTY_TUPLE: no dims (not memoized)
        if not buf.startswith(_CALL, p + 1):
            return (), -1, ()
        return (), p + 5, (UNREAD, ())
    dims = []
    while len(dims) < 3:
        v, q = _int(buf, p)
        if q < 0:
            break
        if v < 0:
            return (), -1, ()
        dims.append(v)
        p = q
    if _TUPLE_OF.get(buf[p]) != len(dims) or buf[p + 1] != 0x94 or not buf.startswith(_CALL, p + 2):
        return (), -1, ()
    t = tuple(dims)
    return t, p + 6, (t, UNREAD, t)
