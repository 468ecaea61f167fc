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
each reads the attributes the record has, so a reader of the tree takes either. Any other
form of the record (another field, another order, a ``torch.Size`` of more than three dims, a
string not read in one step) is read as an object as before; the careful reader builds objects
only. Either tree, its records taken as the rows they stand for, is the other (tested).

The memo keeps the values of its ``torch.Size`` tuples (each distinct one once: the
:class:`~ckpt_tools.security.fastpickle.Memo` holds codes). Its state dict and the argument
tuple of each ``torch.Size`` call are not built, and the record itself is not kept there: their
memo entries are :data:`~ckpt_tools.security.fastpickle.UNREAD`, which
:func:`~ckpt_tools.security.bounded.check_tree` turns into a
:class:`~ckpt_tools.security.fastpickle.Decline` if the pickle ever put one into its tree (the
file is then read again the careful way). torch never does.
"""

from __future__ import annotations

import re
import struct
from array import array
from operator import itemgetter
from typing import Any

from . import bounded
from .fastpickle import Decline, Memo, Widened, _Unread, pickled_int, pickled_ints

_U4 = struct.Struct("<I").unpack_from
_I4 = struct.Struct("<i").unpack_from  # BININT: signed

# The records as torch pickles them, opcode by opcode. Every record: EMPTY_TUPLE NEWOBJ MEMOIZE
# (after its class), its state: EMPTY_DICT MEMOIZE MARK, key value ..., SETITEMS BUILD. Keys
# are memo references (BINGET, LONG_BINGET) to the field names (the first record of each kind,
# which names them, is read opcode by opcode).
_NEW = rb"\)\x81\x94\}\x94\("
_REF = rb"(h.|j....)"
_INT = rb"(K.|M..|J....)"  # BININT1, BININT2, BININT
_BIG = rb"(K.|M..|J....|\x8a\x05.{5}|\x8a\x06.{6}|\x8a\x07.{7}|\x8a\x08.{8})"  # and LONG1: a byte offset
# torch.Size((ints)): its global, then up to 3 ints and TUPLE1..3 MEMOIZE, or EMPTY_TUPLE (not
# memoized), then TUPLE1 MEMOIZE REDUCE MEMOIZE; or no call: a reference to a Size read before
_SIZE = _REF + rb"(?:(?:((?:K.|M..|J....){1,3})([\x85-\x87])\x94|(\)))\x85\x94R\x94)?"
_END = rb"ub"
_CHUNK = re.compile(_NEW + _REF + _SIZE + _REF + _SIZE + _END, re.S).match
# a MetadataIndex or _StorageInfo: up to its string (a name, a path): a reference or SHORT_BINUNICODE
_HEAD = re.compile(_NEW + _REF + rb"(?:" + _REF + rb"|\x8c(.))", re.S).match
_INDEX = re.compile(_REF + rb"(N|" + _INT[1:-1] + rb")(?:" + _REF + _SIZE + rb")?" + _END, re.S).match
_STORAGE = re.compile(_REF + _BIG + _REF + _BIG + _END, re.S).match
# the usual _StorageInfo whole: its path a reference to the file's name, pickled before
_STORAGE_OF_REF = re.compile(_NEW + _REF + _REF + _REF + _BIG + _REF + _BIG + _END, re.S).match
# the usual MetadataIndex whole: its name a new string (its length checked: a name holding the
# byte of MEMOIZE is read the other way), a Size call
_INDEX_NAMED = re.compile(_NEW + _REF + rb"\x8c(.)([^\x94]*)\x94" + _REF + _INT + _REF + _SIZE + _END, re.S).match
# a storage entry whole, as torch lists them (rank by rank: a chunk's at its tensor's cursor):
# the usual MetadataIndex (as _INDEX_NAMED, or its name a reference to the string pickled before,
# as a save in one process pickles it), its _StorageInfo's class and the usual _StorageInfo (as
# _STORAGE_OF_REF); and the next one, after its MetadataIndex class's reference
_PAIR = (_NEW + _REF + rb"(?:\x8c(.)([^\x94]*)\x94|" + _REF + rb")" + _REF + _INT + _REF + _SIZE + _END
         + _REF + _NEW + _REF + _REF + _REF + _BIG + _REF + _BIG + _END)
_ENTRY = re.compile(rb"()" + _PAIR, re.S).match  # (an empty group where the next one's class is: one layout)
_NEXT_ENTRY = re.compile(_REF + _PAIR, re.S).match


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


class Stored:
    """The storage entries :meth:`Rows.joiner` joined to their chunks while a file was read:
    ``tables[fqn]``, an ``array('q')`` of ``(file, offset, length)`` per chunk of that tensor's
    list, in its order (``file`` an index into ``files``; -1 where that chunk's entry was not
    joined and stays in the storage dict; chunks past its end not joined either). 24 bytes a
    chunk, where a row of its own and its offset's int were ~130."""

    __slots__ = ("files", "tables", "_ids")

    def __init__(self) -> None:
        self.files: list[str] = []
        self.tables: dict[str, array] = {}
        self._ids: dict[str, int] = {}

    def file_id(self, rel: str) -> int:
        got = self._ids.get(rel)
        if got is None:
            got = self._ids[rel] = len(self.files)
            self.files.append(rel)
        return got

    def clear(self) -> None:
        """Forget every join (the file is read again, as records: its entries all in the dict)."""
        self.files.clear()
        self.tables.clear()
        self._ids.clear()


def _refused(_: Any) -> None:
    raise Decline("a pickle refers back to part of a DCP record read as a row")


class _Joined:
    """What a run of storage entries joined to their chunks as they were read leaves on the
    stack (:meth:`Rows.index`): one item where their keys and values were, dropped by the
    joiner's ``pairs`` (a key's place only); anywhere else it refuses the tree."""

    __slots__ = ()

    def __repr__(self) -> str:
        return "<joined>"


JOINED = _Joined()


def _misplaced(_: Any) -> None:
    raise Decline("a run of DCP storage entries read where no storage dict was being filled")


for _row in (ChunkRow, IndexKey, StorageRow):
    bounded.inert(_row)
bounded.register(_Unread, _refused)
bounded.register(_Joined, _misplaced)

_NO = object()
_UNJOINED = array("q", (-1, 0, 0))  # a chunk's place in a table whose entry stays in the dict


def _without_joined(items: list) -> list:
    """A SETITEMS's keys and values without the runs :meth:`Rows.index` joined (each where a
    key goes: one in a value's place is a tree the joiner did not make, declined)."""
    out = None
    for i, x in enumerate(items):
        if x is JOINED:
            if out is None:
                out = items[:i]
            if len(out) % 2:
                raise Decline("a run of joined DCP storage entries where a dict's value goes")
        elif out is not None:
            out.append(x)
    return items if out is None else out


class Rows:
    """The readers of one file: ``readers(classes)`` maps the record classes ``find_class``
    gives to the steps :func:`~ckpt_tools.security.fastpickle.load` takes for them.

    What a memo reference names is looked up once (by its bytes) and kept: fastpickle never
    changes a memo entry while it reads records so (a BINPUT over one is declined)."""

    def __init__(self) -> None:
        self._refs: dict[bytes, Any] = {}  # memo reference -> what it named
        self._dims: dict[bytes, tuple[int, ...]] = {}  # a Size's ints, as pickled -> the tuple
        self._lengths: dict[bytes, int] = {}  # an item's length, as pickled -> the int
        # a chunk's row by its Sizes' ints as pickled: one row per distinct chunk (a many-rank
        # save's tensors of one shape have the same chunks: 1,024 ranks, 298k chunks, ~3k rows)
        self._chunks: dict[tuple[bytes, bytes], ChunkRow] = {}
        # the references a record's field names were last found at, and the Size global's
        self._chunk_keys: tuple = ()
        self._storage_keys: tuple = ()
        self._index_keys: tuple = ()
        self._sizes: set[bytes] = set()
        # runs of memo codes (as bytes, at its codes' width) by a Size's pickled ints, for the
        # memo codes they were worked out for (a memo widens once: its runs are then worked out again)
        self._memo: Memo | None = None
        self._codes: array | None = None
        self._unbuilt2 = b""  # the codes of two UNREAD memo entries: a record and its state dict
        self._pack: tuple = ()  # packs 5, 3 and 1 codes
        self._head_codes: dict[bytes, bytes] = {}
        self._tail_codes: dict[bytes, bytes] = {}
        self._named: dict[bytes, tuple[str, bytes]] = {}  # one string per distinct name or path, and its code
        # the joiner's (see joiner): name -> [its chunk rows' list, the cursor, its table or None]
        self._tensors: dict[str, list] | None = None
        self._into: Stored | None = None
        self._classes: tuple = ()  # the index and storage record classes
        self._class_refs: dict[bytes, Any] = {}  # memo reference -> the record class it names

    def readers(self, chunk: type, index: type, storage: type) -> dict[type, Any]:
        self._classes = (index, storage)
        return {chunk: self.chunk, index: self.index, storage: self.storage}

    def joiner(self, tensor: type, index: type, into: Stored) -> Any:
        """``pairs`` for :func:`~ckpt_tools.security.fastpickle.load`: a storage entry read as
        rows (an :class:`IndexKey` and its :class:`StorageRow`, its ints in range) is joined to
        the chunk it names, the :class:`ChunkRow` at its tensor's cursor (torch lists a tensor's
        chunks and their entries alike, rank by rank): its file, offset and length go into
        ``into``'s table for that tensor, at that chunk's place, and the entry is not put in the
        dict. Any other entry goes in as read (an ``index`` record, as the first of its kind is
        read, moves its tensor's cursor on). The tensors are those a dict maps a name to
        (``tensor`` records: the ``state_dict_metadata``, pickled before the entries); each name
        has its own cursor and table, a chunks list two of them share included. At 256 ranks a
        chunk and its entry were ~260 bytes of rows and dict; joined, a ``ChunkRow`` and 24.
        With a joiner, :meth:`index` joins runs of the usual entries as it reads them
        (:data:`JOINED` in their place)."""
        tensors: dict[str, list] = {}
        self._tensors, self._into = tensors, into
        tables = into.tables
        unjoined = _UNJOINED
        join = self._join

        def pairs(_: dict, items: list) -> list:
            if not items:
                return items
            items = _without_joined(items)
            key = items[0] if items else None
            if type(key) is str:
                for i in range(1, len(items), 2):
                    md = items[i]
                    if type(md) is tensor and type(items[i - 1]) is str:
                        chunks = getattr(md, "chunks", None)
                        if type(chunks) is list:
                            tensors[items[i - 1]] = [chunks, 0, None]
                            tables.pop(items[i - 1], None)  # (a name met again: its new list's)
                return items
            if type(key) is not IndexKey and type(key) is not index:
                return items
            left = []
            for i in range(0, len(items) - 1, 2):
                k, v = items[i], items[i + 1]
                left += (k, v)
                if type(k) is IndexKey:
                    fqn, offsets = k
                    if type(v) is StorageRow and join(fqn, offsets, *v):
                        del left[-2:]
                        continue
                elif type(k) is index:
                    fqn, offsets = k._key()
                else:
                    continue
                t = tensors.get(fqn)
                if t is None or t[1] >= len(t[0]):
                    continue
                chunks, at, table = t
                c = chunks[at]
                if (c[0] is offsets or c[0] == offsets) if type(c) is ChunkRow else getattr(c, "offsets", None) == offsets:
                    # (its chunk's entry, not joined: the chunk finds it in the dict)
                    if table is not None:
                        table.extend(unjoined)
                    t[1] = at + 1
            return left

        return pairs

    def _join(self, fqn: str, offsets: Any, path: str, offset: int, length: int) -> bool:
        """The entry ``(fqn, offsets) -> (path, offset, length)`` joined to its chunk, the row at
        its tensor's cursor (see :meth:`joiner`), where it is that chunk's and its ints in range;
        else False, nothing changed."""
        t = self._tensors.get(fqn)
        if t is None:
            return False
        chunks, at, table = t
        if at >= len(chunks):
            return False
        c = chunks[at]
        if type(c) is not ChunkRow or not (c[0] is offsets or c[0] == offsets) or \
                not (0 <= offset < 1 << 63 and 0 <= length < 1 << 63):
            return False
        if table is None:
            table = t[2] = self._into.tables[fqn] = _UNJOINED * at
        table.extend((self._into.file_id(path), offset, length))
        t[1] = at + 1
        return True

    # each reader: the record whose class is on the stack and whose ``)`` is at ``pos``, as
    # ``(row, end)`` with its memo entries added; or None (nothing added) to read it as an object

    def chunk(self, buf: bytes, pos: int, fend: int, memo: Memo) -> tuple[ChunkRow, int] | None:
        m = _CHUNK(buf, pos, fend)
        if m is None:
            return None
        k1, c1, d1, t1, e1, k2, c2, d2, t2, e2 = m.groups()
        if (k1, k2) != self._chunk_keys:
            if self._ref(k1, memo) != "offsets" or self._ref(k2, memo) != "sizes":
                return None
            self._chunk_keys = (k1, k2)
        if d1 is not None and d2 is not None and c1 in self._sizes and c2 in self._sizes:
            # the usual chunk: two Size calls of 1 to 3 ints, their global known
            dims = self._dims
            offsets, sizes = dims.get(d1) or _ints_of(dims, d1), dims.get(d2) or _ints_of(dims, d2)
            if offsets is None or sizes is None or len(offsets) != t1[0] - 0x84 or len(sizes) != len(offsets) or \
                    len(sizes) != t2[0] - 0x84:
                return None
            # its memo entries: row, UNREAD, offsets, UNREAD, offsets, then sizes, UNREAD, sizes
            if memo.codes is not self._codes:
                self._bind(memo)
            head = self._head_codes.get(d1) or self._codes_of(memo, d1, offsets, head=True)
            tail = self._tail_codes.get(d2) or self._codes_of(memo, d2, sizes, head=False)
            memo.codes.frombytes(head)
            memo.codes.frombytes(tail)
            row = self._chunks.get((d1, d2))
            if row is None:
                if len(self._chunks) >= 1 << 16:
                    self._chunks.clear()
                row = self._chunks[d1, d2] = ChunkRow((offsets, sizes))
            return row, m.end()
        offsets, m1 = self._size(c1, d1, t1, e1, memo)
        sizes, m2 = self._size(c2, d2, t2, e2, memo)
        if offsets is None or sizes is None or len(offsets) != len(sizes):
            return None
        memo.codes.extend((0, 0, *m1, *m2))
        return ChunkRow((offsets, sizes)), m.end()

    def index(self, buf: bytes, pos: int, fend: int, memo: Memo) -> tuple[IndexKey | _Joined, int] | None:
        if memo.codes is not self._codes:
            self._bind(memo)
        if self._tensors is not None:  # (a joiner: the usual entries joined as read, a run at a time)
            end = self._joined_run(buf, pos, fend, memo)
            if end > pos:
                return JOINED, end
        m = _INDEX_NAMED(buf, pos, fend)
        if m is not None:  # whole in one match: its name new, that name read before
            key, short, raw, k1, _, k2, c, d, t, _ = m.groups()
            got = self._named.get(raw)
            if got is not None and short[0] == len(raw):
                row = self._usual_index(got[0], got[1], (key, k1, k2), c, d, t, m.end(), memo)
                if row is not None:
                    return row
        fqn, new, p, key = self._head("fqn", buf, pos, fend, memo)
        m = None if p < 0 else _INDEX(buf, p, fend)
        if m is None:
            return None
        k1, _, k2, c, d, t, e = m.groups()
        row = self._usual_index(fqn, new, (key, k1, k2), c, d, t, m.end(), memo)
        if row is not None:
            return row
        ref = self._ref
        if ref(k1, memo) != "index":
            return None
        offsets, m1 = None, ()
        if k2 is not None:
            if ref(k2, memo) != "offset":
                return None
            offsets, m1 = self._size(c, d, t, e, memo)
            if offsets is None:
                return None
            self._index_keys = (key, k1, k2)
        memo.codes.frombytes(self._unbuilt2)
        memo.codes.frombytes(new)
        memo.codes.extend(m1)
        return IndexKey((fqn, offsets)), m.end()

    def _joined_run(self, buf: bytes, pos: int, fend: int, memo: Memo) -> int:
        """Where a run of the usual storage entries from ``pos`` (the first one's index record,
        its class read) ends, each joined to its chunk (:meth:`_join`) and its memo entries
        added as it is read; ``pos`` where the first is not one. The usual entry: the index as
        :meth:`_usual_index` reads it (its name a new string, or a reference to a string: a save
        in one process refers to the state dict's), its offsets a Size call, and its storage
        info as :meth:`storage` reads it. 256 ranks: 72k entries in ~3,700 runs (they end at a
        frame's end, a SETITEMS), not 145k records and their keys and values on the stack for
        the joiner: the read 1.24 -> 1.05 s. A name or offsets value met first is entered in the
        memo in the run (a many-tensor save names each tensor first in its entries: 25k tensors
        at 16 ranks were read in 52k runs of one entry, now 316). Its fields and classes compared as
        their references' bytes, no tuple or call per entry: the read of 256 ranks ~10% less CPU."""
        named, tails, dims, refs, sizes = self._named, self._tail_codes, self._dims, self._refs, self._sizes
        index, storage = self._classes
        ik, ik1, ik2 = self._index_keys or (None, None, None)
        sk0, sk1, sk2 = self._storage_keys or (None, None, None)
        unbuilt2, lengths, join = self._unbuilt2, self._lengths, self._join
        index_ref = storage_ref = None  # the class references checked last (a run's are all the same)
        codes, start = memo.codes, pos
        m = _ENTRY(buf, pos, fend)
        while m is not None:
            _, key, short, raw, name, k1, _, k2, c, d, t, _, cls, k0, ref, k3, offset, k4, length = m.groups()
            path = refs.get(ref)
            if short is not None and short[0] != len(raw) or d is None or type(path) is not str or c not in sizes or \
                    key != ik or k1 != ik1 or k2 != ik2 or k0 != sk0 or k3 != sk1 or k4 != sk2:
                break
            if cls != storage_ref:
                if self._class_of(cls, memo) is not storage:
                    break
                storage_ref = cls
            offsets = dims.get(d) or _ints_of(dims, d)
            if offsets is None or len(offsets) != t[0] - 0x84:
                break
            # where entering a name or offsets value widens the memo's codes, the run so far
            # stands and this entry is read next; with none read yet, the run is read again
            # (fastpickle reads a Widened record so)
            if short is None:  # (its name a reference: no memo entry of its own)
                got = (self._ref(name, memo), b"")
                if type(got[0]) is not str:
                    break
            else:
                got = named.get(raw)
            tail = tails.get(d)
            try:
                if got is None:
                    got = self._new_name(raw, memo)
                if tail is None:
                    tail = self._codes_of(memo, d, offsets, head=False)
            except Widened:
                if pos == start:
                    raise
                break
            offset = _I4(offset, 1)[0] if offset[0] == 0x4a else pickled_int(offset)  # (BININT: the usual)
            if not join(got[0], offsets, path, offset, lengths.get(length) or self._length(length)):
                break
            # index: row, UNREAD, its name, offsets, UNREAD, offsets; storage: row, UNREAD
            codes.frombytes(unbuilt2)
            codes.frombytes(got[1])
            codes.frombytes(tail)
            codes.frombytes(unbuilt2)
            pos = m.end()
            m = _NEXT_ENTRY(buf, pos, fend)
            if m is not None and m.group(1) != index_ref:
                if self._class_of(m.group(1), memo) is not index:
                    break
                index_ref = m.group(1)
        return pos

    def _class_of(self, ref: bytes, memo: Memo) -> Any:
        """The index or storage record class the memo reference ``ref`` names, else None."""
        got = self._class_refs.get(ref)
        if got is None:
            i = ref[1] if len(ref) == 2 else _U4(ref, 1)[0]
            got = memo[i] if i < len(memo) else None
            if not any(got is cls for cls in self._classes):
                return None
            self._class_refs[ref] = got
        return got

    def _usual_index(self, fqn: str, new: bytes, keys: tuple, c: bytes, d: bytes | None, t: bytes | None,
                     end: int, memo: Memo) -> tuple[IndexKey, int] | None:
        """The usual entry (its fields where the last one's were, its offset a Size call of 1 to
        3 ints) as ``(row, end)``, its memo entries added: row, UNREAD, (its name, if ``new``,)
        offsets, UNREAD, offsets. None (nothing added) for any other."""
        if d is None or c not in self._sizes or keys != self._index_keys:
            return None
        offsets = self._dims.get(d) or _ints_of(self._dims, d)
        if offsets is None or len(offsets) != t[0] - 0x84:
            return None
        if new:
            run = self._tail_codes.get(d) or self._codes_of(memo, d, offsets, head=False)
            codes = memo.codes  # (after the run: working it out may widen them)
            codes.frombytes(self._unbuilt2)
            codes.frombytes(new)
            codes.frombytes(run)
        else:
            memo.codes.frombytes(self._head_codes.get(d) or self._codes_of(memo, d, offsets, head=True))
        return IndexKey((fqn, offsets)), end

    def storage(self, buf: bytes, pos: int, fend: int, memo: Memo) -> tuple[StorageRow, int] | None:
        if memo.codes is not self._codes:
            self._bind(memo)
        m = _STORAGE_OF_REF(buf, pos, fend)
        if m is not None:  # the usual: the path a reference, its fields where they were last
            k0, ref, k1, offset, k2, length = m.groups()
            path = self._refs.get(ref)
            if type(path) is str and (k0, k1, k2) == self._storage_keys:
                memo.codes.frombytes(self._unbuilt2)  # (row, UNREAD)
                return StorageRow((path, pickled_int(offset), self._length(length))), m.end()
        path, new, p, key = self._head("relative_path", buf, pos, fend, memo)
        m = None if p < 0 else _STORAGE(buf, p, fend)
        if m is None:
            return None
        k1, offset, k2, length = m.groups()
        ref = self._ref
        if ref(k1, memo) != "offset" or ref(k2, memo) != "length":
            return None
        self._storage_keys = (key, k1, k2)  # (where its fields' names are: the next one's, too)
        memo.codes.frombytes(self._unbuilt2)
        memo.codes.frombytes(new)
        return StorageRow((path, pickled_int(offset), self._length(length))), m.end()

    def _bind(self, memo: Memo) -> None:
        # a new memo, or this one's codes widened: its names keep their strings (each one object,
        # its code the same, four bytes now); its Sizes' runs are worked out again as met
        tc = memo.codes.typecode
        named = {} if memo is not self._memo else \
            {raw: (s, array(tc, array("H", run)).tobytes()) for raw, (s, run) in self._named.items()}
        self._memo, self._codes = memo, memo.codes
        self._unbuilt2 = array(tc, (0, 0)).tobytes()
        self._pack = tuple(struct.Struct(f"{n}{tc}").pack for n in (5, 3, 1))  # (native, as frombytes)
        self._head_codes, self._tail_codes, self._named = {}, {}, named

    def _codes_of(self, memo: Memo, pickled: bytes, t: tuple, *, head: bool) -> bytes:
        """The codes (as bytes) of the memo entries a record adds with the Size ``t``, pickled
        as ``pickled``: with ``head``, a chunk's or index's first five, else a chunk's last three."""
        c = memo.shared(t)
        if head:
            run = self._head_codes[pickled] = self._pack[0](0, 0, c, 0, c)
        else:
            run = self._tail_codes[pickled] = self._pack[1](c, 0, c)
        return run

    def _length(self, pickled: bytes) -> int:
        """An item's length as pickled, as an int one object per value (a tensor's items share
        theirs: the description keeps one per chunk)."""
        n = self._lengths.get(pickled)
        if n is None:
            n = self._lengths[pickled] = pickled_int(pickled)
        return n

    def _head(self, field: str, buf: bytes, pos: int, fend: int, memo: Memo) -> tuple[Any, bytes, int, bytes]:
        """A record's first field, a string: it, the memo codes it adds (as bytes), where the
        rest begins (-1: not this form) and the reference its name was found at."""
        m = _HEAD(buf, pos, fend)
        if m is None:
            return None, b"", -1, b""
        key, sref, short = m.groups()
        if self._ref(key, memo) != field:
            return None, b"", -1, b""
        if short is None:
            s = self._ref(sref, memo)
            return (s, b"", m.end(), key) if type(s) is str else (None, b"", -1, b"")
        end = m.end() + short[0]
        if end >= fend or buf[end] != 0x94:  # SHORT_BINUNICODE MEMOIZE
            return None, b"", -1, b""
        if memo.codes is not self._codes:
            self._bind(memo)
        raw = buf[m.end():end]
        got = self._named.get(raw)
        if got is None:
            got = self._new_name(raw, memo)
        return got[0], got[1], end + 1, key

    def _new_name(self, raw: bytes, memo: Memo) -> tuple[str, bytes]:
        """A name (or path) read for the first time, from its UTF-8 bytes ``raw``: the string,
        the one the load read before where it did (its metadata's key), and its memo code,
        noted by its bytes; :class:`Widened` (nothing noted) where the code widened the memo."""
        s = str(raw, "utf-8", "surrogatepass")
        s = memo.strings.setdefault(s, s)
        got = self._named[raw] = (s, self._pack[2](memo.shared(s)))
        return got

    def _ref(self, ref: bytes, memo: Memo) -> Any:
        """What the memo reference ``ref`` names (only strings and ``tuple``, the Size global, and
        tuples are asked for: anything else compares unequal to what is asked)."""
        got = self._refs.get(ref, _NO)
        if got is _NO:
            i = ref[1] if len(ref) == 2 else _U4(ref, 1)[0]
            if i >= len(memo):
                return _NO
            got = memo[i]
            if not (type(got) is str or got is tuple or type(got) is tuple):
                return _NO  # (not kept: a comparison with a str must not reach its __eq__)
            self._refs[ref] = got
        return got

    def _size(self, cls: bytes, dims: bytes | None, op: bytes | None, empty: bytes | None,
              memo: Memo) -> tuple[tuple | None, tuple]:
        """``torch.Size((...))`` of up to 3 non-negative ints, read as the careful reader reads
        it (its global is the ``tuple`` find_class gives for it), or a memo reference to such a
        tuple (a Size pickled before): the tuple and the memo codes it adds; None for
        anything else."""
        got = self._ref(cls, memo)
        if dims is not None:
            t = self._dims.get(dims) or _ints_of(self._dims, dims)
            if t is None or got is not tuple or len(t) != op[0] - 0x84:  # TUPLE1..3 takes 1..3
                return None, ()
            self._sizes.add(cls)  # (the Size global's reference: chunk() takes the next at once)
            c = memo.shared(t)
            return t, (c, 0, c)
        if empty is not None:
            return ((), (0, memo.shared(()))) if got is tuple else (None, ())
        if type(got) is tuple and len(got) <= 64 and all(type(v) is int and v >= 0 for v in got):
            return got, ()
        return None, ()


def _ints_of(known: dict[bytes, tuple[int, ...]], b: bytes) -> tuple[int, ...] | None:
    """:func:`~.fastpickle.pickled_ints` of ``b``, kept in ``known`` (a Size's ints recur: each
    tensor's sizes, each rank's offsets)."""
    t = pickled_ints(b)
    if t is not None:
        known[b] = t
    return t
