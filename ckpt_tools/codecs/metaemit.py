"""DCP's ``.metadata`` written straight from its records: the bytes :func:`.metapickle.dumps`
gives, without a stand-in object per chunk and per storage entry or the pickler's walk of them.

A many-rank ``.metadata`` is mostly two runs of records: each tensor's chunks (a
``ChunkStorageMetadata`` of two ``torch.Size``) and the storage index (a ``MetadataIndex`` and
its ``_StorageInfo`` per item). As stand-ins, each chunk and entry cost ~10 µs (five objects
built, then reduced one by one by the C pickler): 1.5 s of a 256-rank reshard with moments.
Here each is rendered from its fields: the opcodes the pickler writes for it, with the memo
references it makes (classes, field names, ``torch.Size``) looked up once. So are the entries
with one per tensor (its name and header in ``state_dict_metadata``, its path in
``planner_data``): at 25k tensors of a chunk each, saving those object by object in Python
cost more than the C pickler had.

:class:`_Emitter` is :class:`pickle._Pickler`'s algorithm for the few kinds of object a
``.metadata`` holds (strings, ints, tuples, lists, dicts, None and False, the stand-ins of
:mod:`.metapickle`, memoized by identity as it does), so the rest of the file (a tensor's
header, the planner's paths) comes out as that pickler writes it, and framing is its own: a
frame is cut where a ``save`` begins with 64 KiB or more in the current one. A record is
rendered whole only where it cannot reach a cut and where the objects it refers to are
memoized already; otherwise it is saved as its stand-ins through the same algorithm.
Tested byte for byte against :func:`.metapickle.dumps` (itself tested against torch's pickle).
"""

from __future__ import annotations

import operator
import struct
import sys
from array import array
from collections.abc import Callable, Iterable, Iterator
from typing import Any

from . import metapickle as mp

_FRAME = 64 * 1024  # pickle's _FRAME_SIZE_TARGET

_U2 = struct.Struct("<H").pack
_U4 = struct.Struct("<I").pack
_I4 = struct.Struct("<i").pack
_U8 = struct.Struct("<Q").pack
_SMALL_INTS = [b"K" + bytes([i]) for i in range(256)]
_TUPLE_END = {1: b"\x85\x94", 2: b"\x86\x94", 3: b"\x87\x94"}  # TUPLE1/2/3 MEMOIZE
_SIZE_END = b"\x85\x94R\x94"  # (the tuple of ints) TUPLE1 MEMOIZE REDUCE MEMOIZE: torch.Size((...))
# a torch.Size of up to 3 dims after its ints: its tuple's end (an empty tuple: no ints, not
# memoized), then _SIZE_END; and the memo entries it makes
_DIMS_END = {0: (b")" + _SIZE_END, 2), **{d: (end + _SIZE_END, 3) for d, end in _TUPLE_END.items()}}
_NEW = b")\x81\x94}\x94("  # EMPTY_TUPLE NEWOBJ MEMOIZE, the state: EMPTY_DICT MEMOIZE MARK
# the field names as a stand-in's __dict__ holds them (interned, one object each, as in torch's)
_OFFSETS, _SIZES = sys.intern("offsets"), sys.intern("sizes")
_FQN, _INDEX, _OFFSET = sys.intern("fqn"), sys.intern("index"), sys.intern("offset")
_PATH, _LENGTH = sys.intern("relative_path"), sys.intern("length")
_PROPERTIES, _SIZE_KEY, _CHUNKS = sys.intern("properties"), sys.intern("size"), sys.intern("chunks")


_NO_NAME = object()


class Chunks(list):
    """A tensor's chunks as ``(offsets, sizes)`` pairs: pickled as the list of
    ``ChunkStorageMetadata(offsets=Size(offsets), sizes=Size(sizes))`` it stands for."""


class Entries:
    """The storage index as ``(fqn, offsets or None, file, offset, length)`` per item, in order:
    pickled as the dict ``{MetadataIndex(fqn, Size(offsets)): _StorageInfo(file, offset,
    length)}`` it stands for. ``fqn`` and ``file`` are the string objects the writer built
    (pickle memoizes by identity: which of them are one object decides the bytes).

    Read (iterated, indexed, sliced) as that list of rows, each an :class:`Anew` where added
    so; held as columns, the rows made as they are read: three references, two 8-byte numbers
    and a flag an item, ~41 bytes, where a row and its two ints were ~144 (a 1,024 -> 768
    reshard's index is 223k items, made at once when its ``.metadata`` is written)."""

    __slots__ = ("_refs", "_spans", "_anew")

    def __init__(self, rows: Iterable[tuple] = ()) -> None:
        self._refs: list = []  # fqn, offsets, file each
        self._spans = array("q")  # offset, length each
        self._anew = bytearray()
        for row in rows:
            self.append(row)

    def add(self, fqn: str, offsets: tuple | None, file: str, start: int, length: int, fresh: bool = False) -> None:
        """The row ``(fqn, offsets, file, start, length)``, an :class:`Anew` one if ``fresh``."""
        self._refs += (fqn, offsets, file)
        self._spans.extend((start, length))
        self._anew.append(fresh)

    def append(self, row: tuple) -> None:
        fqn, offsets, file, start, length = row
        self.add(fqn, offsets, file, start, length, type(row) is Anew)

    def __len__(self) -> int:
        return len(self._anew)

    def _row(self, i: int) -> tuple:
        refs, spans = self._refs, self._spans
        row = (refs[3 * i], refs[3 * i + 1], refs[3 * i + 2], spans[2 * i], spans[2 * i + 1])
        return Anew(row) if self._anew[i] else row

    def __getitem__(self, i):
        if isinstance(i, slice):
            return [self._row(k) for k in range(*i.indices(len(self)))]
        i = operator.index(i)
        if not -len(self) <= i < len(self):
            raise IndexError("Entries index out of range")
        return self._row(i % len(self))

    def __iter__(self) -> Iterator[tuple]:
        for i in range(len(self)):
            yield self._row(i)


class Anew(tuple):
    """An :class:`Entries` row whose ``fqn`` is pickled as a string object of its own, equal to
    the one given (as torch's gathered write results each bring theirs): the writer need not
    build and hold an object per item only for the pickle to see it once."""

    __slots__ = ()


def anew(s: str) -> str:
    """A string equal to ``s`` and not ``s`` (an :class:`Anew` row's name, as a stand-in)."""
    return s.encode("utf-8", "surrogatepass").decode("utf-8", "surrogatepass")


def chunk(offsets: tuple, sizes: tuple) -> mp.ChunkStorageMetadata:
    """The stand-in a :class:`Chunks` pair stands for."""
    return mp.ChunkStorageMetadata(offsets=mp.Size(offsets), sizes=mp.Size(sizes))


def entry(fqn: str, offsets: tuple | None, file: str, start: int, length: int) -> tuple:
    """The stand-ins (key, value) an :class:`Entries` row stands for."""
    return mp.MetadataIndex(fqn, offsets), mp.StorageInfo(file, start, length)


def stand_ins(meta: mp.Metadata) -> mp.Metadata:
    """``meta`` with its :class:`Chunks` and :class:`Entries` replaced by the stand-ins they
    stand for (in place), as :func:`.metapickle.dumps` and key renaming take it."""
    for md in (meta.state_dict_metadata or {}).values():
        if type(getattr(md, "chunks", None)) is Chunks:
            md.chunks = [chunk(*c) for c in md.chunks]
    if type(meta.storage_data) is Entries:
        meta.storage_data = dict(entry(anew(e[0]), *e[1:]) if type(e) is Anew else entry(*e) for e in meta.storage_data)
    return meta


class Unsupported(Exception):
    """Something :class:`_Emitter` does not write as the pickler would: use the pickler."""


def dumps(meta: mp.Metadata, protocol: int = 4) -> bytes:
    """What :func:`.metapickle.dumps` gives for ``meta`` with its :class:`Chunks` and
    :class:`Entries` as stand-ins; :class:`Unsupported` where this cannot say."""
    out: list[bytes] = []
    dump(meta, out.append, protocol)
    return b"".join(out)


def dump(meta: mp.Metadata, write: Callable[[bytes], Any], protocol: int = 4) -> None:
    """:func:`dumps`, its bytes given to ``write`` a frame (64 KiB) at a time as they are made
    (a 256-rank DCP's ``.metadata`` is ~20 MB: never held whole, nor twice); on
    :class:`Unsupported`, some may have been."""
    if protocol not in (4, 5):
        raise Unsupported(f"protocol {protocol}")
    e = _Emitter(write, protocol)
    # the two maps with an entry per tensor: their entries rendered too
    e.rendered = {id(meta.state_dict_metadata): e._one_tensor, id(meta.planner_data): e._one_path}
    try:
        e.save(meta)
    except (TypeError, struct.error) as err:  # a value that is no plain int where one is rendered
        raise Unsupported(str(err)) from None
    e.write(b".")
    e.finish()


def _int(v: int) -> bytes:
    """An int as pickle.save_long writes it (the plan's ints; anything else fails in it)."""
    if 0 <= v < 256:
        return _SMALL_INTS[v]
    if 0 <= v <= 0xFFFF:
        return b"M" + _U2(v)
    if -0x80000000 <= v <= 0x7FFFFFFF:
        return b"J" + _I4(v)
    n = (v.bit_length() >> 3) + 1
    data = v.to_bytes(n, "little", signed=True)
    if v < 0 and n > 1 and data[-1] == 0xFF and data[-2] & 0x80:
        data = data[:-1]
    if len(data) >= 256:
        raise Unsupported("an int of 256 bytes or more")
    return b"\x8a" + bytes([len(data)]) + data


class _Emitter:
    def __init__(self, out: Callable[[bytes], Any], protocol: int) -> None:
        self.out = out  # given each frame once it is cut
        out(b"\x80" + bytes([protocol]))
        self.cur: list[bytes] = []
        self.n = 0  # bytes in the current frame
        self.memo: dict[int, int] = {}  # id -> memo index, for objects that may be met again
        self.keep: list[Any] = []  # those objects, alive while their ids are keys
        self.count = 0  # memo entries made (an object met once is counted, not kept)
        self._chunk: tuple | None = None  # a chunk's fixed parts, once its references are memoized
        self._entry: tuple | None = None
        self._tensor: tuple | None = None
        self.rendered: dict[int, Callable[[Any], None]] = {}
        # a name's opcodes as a new string, for the names met since the last _NAMES_KEPT (a name
        # is met again within its tensor's entries; all of them kept were ~330 bytes a tensor,
        # 8 MB of a 25k-tensor file's, to save an encode each in the next section)
        self._names: dict[str, tuple[bytes, int] | None] = {}

    # -- pickle's framer and memo

    def write(self, data: bytes) -> None:
        self.cur.append(data)
        self.n += len(data)

    def boundary(self) -> None:
        """Where pickle's save() begins: the frame is cut once it holds 64 KiB."""
        if self.n >= _FRAME:
            self._cut()

    def _cut(self) -> None:
        frame = b"".join(self.cur)
        self.out(b"\x95" + _U8(len(frame)) + frame if len(frame) >= 4 else frame)
        self.cur, self.n = [], 0

    def finish(self) -> None:
        if self.n:
            self._cut()

    def memoize(self, obj: Any) -> None:
        self.memo[id(obj)] = self.count
        self.keep.append(obj)
        self.count += 1
        self.write(b"\x94")

    def get(self, i: int) -> bytes:
        return b"h" + bytes([i]) if i < 256 else b"j" + _U4(i)

    # -- pickle's save(), for what a .metadata holds

    def save(self, obj: Any) -> None:
        self.boundary()
        t = type(obj)
        if t is int:
            self.write(_int(obj))
            return
        if obj is None:
            self.write(b"N")
            return
        if t is bool:
            self.write(b"\x88" if obj else b"\x89")
            return
        i = self.memo.get(id(obj))
        if i is not None:
            self.write(self.get(i))
        elif t is str:
            self._str(obj)
        elif t is tuple:
            self._tuple(obj)
        elif t is dict:
            self.write(b"}")
            self.memoize(obj)
            self._setitems(list(obj.items()), self.rendered.get(id(obj)))
        elif t is list:
            self.write(b"]")
            self.memoize(obj)
            self._appends(obj)
        elif t is Chunks:
            self.write(b"]")
            self.memoize(obj)
            self._appends(obj, self._one_chunk)
        elif t is Entries:
            self.write(b"}")
            self.memoize(obj)
            self._setitems(obj, self._one_entry)
        elif t is mp._Global or isinstance(obj, type) and issubclass(obj, mp._Stand):
            g = obj if t is mp._Global else obj._global
            self.save(g.module)
            self.save(g.name)
            self.write(b"\x93")
            self.memoize(obj)
        elif t is mp.Size:
            self._reduce(mp._SIZE, (tuple(obj),), obj)
        elif t is mp._Reduced:
            self._reduce(obj.func, obj.args, obj)
        elif isinstance(obj, mp._Stand):
            self.save(t)
            self.save(())
            self.write(b"\x81")
            self.memoize(obj)
            state = obj.__getstate__() if t is mp.TensorProperties else (vars(obj) or None)
            if state is not None:
                self.save(state)
                self.write(b"b")
        else:
            raise Unsupported(f"a {t.__name__}")

    def _str(self, s: str) -> None:
        data = s.encode("utf-8", "surrogatepass")
        if len(data) < 256:
            self.write(b"\x8c" + bytes([len(data)]) + data)
        elif len(data) < _FRAME:
            self.write(b"X" + _U4(len(data)) + data)
        else:  # written outside the frames by pickle
            raise Unsupported("a string of 64 KiB or more")
        self.memoize(s)

    def _tuple(self, t: tuple) -> None:
        if not t:
            self.write(b")")
            return
        if len(t) > 3:
            self.write(b"(")
        for x in t:
            self.save(x)
        self.write(_TUPLE_END[len(t)][:1] if len(t) <= 3 else b"t")
        self.memoize(t)

    def _reduce(self, func: Any, args: tuple, obj: Any) -> None:
        self.save(func)
        self.save(args)
        self.write(b"R")
        self.memoize(obj)

    # batched as the C pickler batches an exact list or dict (metapickle.batches)

    def _appends(self, items: list, one: Callable[[Any], None] | None = None) -> None:
        one = one or self.save
        if len(items) == 1:
            one(items[0])
            self.write(b"a")
        for batch in mp.batches(items, closed=False):
            self.write(b"(")
            for x in batch:
                one(x)
            self.write(b"e")

    def _setitems(self, items: list, one: Callable[[Any], None] | None = None) -> None:
        one = one or self._item
        if len(items) == 1:
            one(items[0])
            self.write(b"s")
        for batch in mp.batches(items, closed=True):
            self.write(b"(")
            for x in batch:
                one(x)
            self.write(b"u")

    def _item(self, kv: tuple) -> None:
        self.save(kv[0])
        self.save(kv[1])

    # -- the runs of records, rendered

    def _one_chunk(self, pair: tuple) -> None:
        offsets, sizes = pair
        if self._chunk is not None:
            head, mid = self._chunk
            (at, n), (of, m) = _size_ops(offsets), _size_ops(sizes)
            data = b"".join((head, at, mid, of, b"ub"))
            if self.n + len(data) < _FRAME:  # no save() in it can meet a frame's end
                self.write(data)
                self.count += 2 + n + m  # (itself, its state, the two Sizes')
                return
        self.save(chunk(offsets, sizes))  # the first, or near a frame's end
        if self._chunk is None:
            refs = [self.memo.get(id(x)) for x in (mp.ChunkStorageMetadata, _OFFSETS, _SIZES, mp._SIZE)]
            if None not in refs:
                cls, offsets_key, sizes_key, size = (self.get(i) for i in refs)
                self._chunk = (cls + _NEW + offsets_key + size, sizes_key + size)

    def _one_entry(self, row: tuple) -> None:
        fqn, offsets, file, start, length = row
        parts, memo = self._entry, self.memo
        fresh = type(row) is Anew  # (its name a string of its own, met nowhere else: memoized, not kept)
        name = None if parts is None or offsets is None or id(file) not in memo else \
            self._new_name(fqn) if fresh else self._name(fqn)
        if name is not None:
            index_head, index_mid, info_head, offset_key, length_key = parts
            at, n = _size_ops(offsets)
            data = b"".join((index_head, name[0], index_mid, at, b"ub", info_head, self.get(memo[id(file)]),
                             offset_key, _int(start), length_key, _int(length), b"ub"))
            if self.n + len(data) < _FRAME:
                self.write(data)
                if name[1] and not fresh:  # (memoized after the index and its state dict)
                    memo[id(fqn)] = self.count + 2
                    self.keep.append(fqn)
                self.count += 4 + n + name[1]  # (the index, its state, its Size's; the info, its state)
                return
        k, v = entry(anew(fqn) if fresh else fqn, offsets, file, start, length)
        self.save(k)
        self.save(v)
        if parts is None and offsets is not None:
            self._learn_entry()

    def _learn_entry(self) -> None:
        """An entry's fixed parts, once its classes, field names and torch.Size are memoized."""
        refs = [self.memo.get(id(x)) for x in (mp.MetadataIndex, _FQN, _INDEX, _OFFSET, mp._SIZE, mp.StorageInfo,
                                               _PATH, _LENGTH)]
        if None in refs:
            return
        index, fqn, idx, offset, size, info, path, length = (self.get(i) for i in refs)
        self._entry = (index + _NEW + fqn, idx + b"N" + offset + size, info + _NEW + path, offset, length)

    def _one_tensor(self, kv: tuple) -> None:
        """A state_dict_metadata entry: a tensor's name and header rendered (its chunks by
        :meth:`_one_chunk`), where its references are memoized and no frame ends in it."""
        fqn, md = kv
        parts, memo = self._tensor, self.memo
        if parts is not None and type(md) is mp.TensorStorageMetadata and type(md.chunks) is Chunks \
                and type(md.size) is mp.Size and type(md.properties) is mp.TensorProperties \
                and id(md) not in memo:
            dtype = memo.get(id(md.properties.dtype))
            name = self._name(fqn)
            if dtype is not None and name is not None:
                size = _size_ops(md.size)
                head, after_dtype, size_key, chunks_key = parts
                data = b"".join([name[0], head, self.get(dtype), after_dtype, size_key, size[0], chunks_key, b"]\x94"])
                if self.n + len(data) < _FRAME:
                    self.write(data)
                    if name[1]:
                        memo[id(fqn)] = self.count
                        self.keep.append(fqn)
                    self.count += name[1] + 5 + size[1]
                    self._appends(md.chunks, self._one_chunk)
                    self.write(b"ub")
                    return
        self._item(kv)
        if parts is None and type(md) is mp.TensorStorageMetadata:
            refs = [memo.get(id(x)) for x in (mp.TensorStorageMetadata, _PROPERTIES, mp.TensorProperties, mp.STRIDED,
                                              mp.CONTIGUOUS, _SIZE_KEY, mp._SIZE, _CHUNKS)]
            if None not in refs:
                tsm, props, tp, strided, contiguous, size_key, size_g, chunks = (self.get(i) for i in refs)
                self._tensor = (tsm + _NEW + props + tp + b")\x81\x94(", strided + b"\x89" + contiguous + b"\x89t\x94b",
                                size_key + size_g, chunks)

    def _one_path(self, kv: tuple) -> None:
        """A planner_data entry (a tensor's name, its path): rendered where the name is memoized,
        the path a tuple of names and ints, and no frame ends in it."""
        fqn, path = kv
        memo = self.memo
        key = memo.get(id(fqn))
        if key is not None and type(path) is tuple and path and id(path) not in memo:
            ops, fresh, count = [self.get(key)], {}, self.count
            if len(path) > 3:
                ops.append(b"(")
            for x in path:
                t = type(x)
                if t is int:
                    ops.append(_int(x))
                    continue
                if t is not str:
                    break
                i = fresh.get(id(x))
                op = (self.get(i), 0) if i is not None else self._name(x)
                if op is None:
                    break
                ops.append(op[0])
                if op[1]:
                    fresh[id(x)] = count
                    count += 1
            else:
                ops.append(_TUPLE_END[len(path)] if len(path) <= 3 else b"t\x94")
                data = b"".join(ops)
                if self.n + len(data) < _FRAME:
                    self.write(data)
                    memo.update(fresh)
                    self.keep += [x for x in path if id(x) in fresh]
                    self.count = count + 1
                    return
        self._item(kv)

    def _new_name(self, s: str) -> tuple[bytes, int] | None:
        """A string's opcodes where it is saved as a new object (the string and MEMOIZE, kept by
        value) and that it is new; None for one of 256 bytes or more (as :meth:`_name`)."""
        got = self._names.get(s, _NO_NAME)
        if got is _NO_NAME:
            encoded = s.encode("utf-8", "surrogatepass")
            got = (b"\x8c" + bytes([len(encoded)]) + encoded + b"\x94", 1) if len(encoded) <= 0xFF else None
            if len(self._names) >= _NAMES_KEPT:
                self._names.clear()
            self._names[s] = got
        return got

    def _name(self, s: str) -> tuple[bytes, int] | None:
        """A string's opcodes where it is saved next (a reference, or the string and MEMOIZE) and
        whether it is new; None for one of 256 bytes or more (BINUNICODE: left to :meth:`save`)."""
        i = self.memo.get(id(s))
        return (self.get(i), 0) if i is not None else self._new_name(s)


_NAMES_KEPT = 1 << 12


def _size_ops(dims: tuple) -> tuple[bytes, int]:
    """What a torch.Size of ``dims`` pickles as after its global, and its memo entries (kept:
    a many-rank plan's offsets and sizes are a few thousand values met 10^5 times; they are
    ints, checked so where the source was described, so equal tuples pickle alike)."""
    got = _SIZES_MET.get(dims)
    if got is None:
        if len(_SIZES_MET) >= 1 << 16:
            _SIZES_MET.clear()
        end = _DIMS_END.get(len(dims))
        got = _SIZES_MET[dims] = ((b"".join((*map(_int, dims), end[0])), end[1]) if end is not None else
                                  (b"(" + b"".join(map(_int, dims)) + b"t\x94" + _SIZE_END, 3))
    return got


_SIZES_MET: dict[tuple, tuple[bytes, int]] = {}
