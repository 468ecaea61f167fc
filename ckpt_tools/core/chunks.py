"""Where a tensor's bytes lie: a :class:`Chunk` per stored rectangle and its :class:`Location`,
and a tensor of many chunks held as columns (:class:`ChunkTable`), the way a many-rank
description keeps them. :mod:`.describe` builds descriptions of them.
"""

from __future__ import annotations

import itertools
import math
import operator
from array import array
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any


# Location and Chunk (and the plan's Copy and Piece) are built once per (tensor, rank): not
# ``frozen``, whose __init__ sets each field through object.__setattr__ at 4x the cost (a
# 256-rank inspect with moments: 2.33 -> 1.94 s). Hashed by value all the same; never changed.
@dataclass(slots=True, unsafe_hash=True)
class Location:
    """Where the bytes of one stored chunk (or object) live.

    kind:
      ``raw``        row-major bytes of the chunk at ``[offset, offset + length)`` (safetensors);
      ``torch_item`` a ``torch.save``'d tensor at ``[offset, offset + length)`` (a DCP item);
      ``bytes_item`` a ``torch.save``'d object at ``[offset, offset + length)`` (DCP BYTE_IO);
      ``pickled``    a value inside a ``torch.save``'d file, reached through ``key``;
      ``value``      a plain value carried by the description itself (``key[0]``, a Python
                     literal), where a layout rewrote a saved one (:mod:`..formats.flatparams`).
    """

    file: str
    kind: str
    offset: int = 0
    length: int = 0
    key: tuple[Any, ...] = ()

    def __reduce__(self) -> tuple:  # (for --workers: its fields, not a state dict of its slots: 4x faster)
        return Location, (self.file, self.kind, self.offset, self.length, self.key)


class Chunk:
    """One stored rectangle of a logical tensor: ``offsets`` and ``sizes`` in it, its
    :class:`Location`, the rank that saved it (or None).

    The location's fields are kept in the chunk (``file``, ``kind``, ``byte_offset``,
    ``length``, ``key``: read them where a loop meets every chunk) and :attr:`location` is
    made when asked: a many-rank description holds a chunk per (tensor, rank) for the whole
    command, and a ``Location`` of its own was 88 bytes more of each (6 MB of a 256-rank DCP's
    72k chunks).
    Equal, hashed and pickled by value, as the dataclass it was; never changed.
    """

    __slots__ = ("offsets", "sizes", "rank", "file", "kind", "byte_offset", "length", "key")

    def __init__(self, offsets: tuple[int, ...], sizes: tuple[int, ...], location: Location,
                 rank: int | None = None) -> None:
        self.offsets, self.sizes, self.rank = offsets, sizes, rank
        self.file, self.kind, self.byte_offset = location.file, location.kind, location.offset
        self.length, self.key = location.length, location.key

    @classmethod
    def at(cls, offsets: tuple[int, ...], sizes: tuple[int, ...], file: str, kind: str, offset: int = 0,
           length: int = 0, key: tuple[Any, ...] = (), rank: int | None = None) -> Chunk:
        """A chunk whose location has these fields (no ``Location`` built on the way)."""
        c = object.__new__(cls)
        c.offsets, c.sizes, c.rank = offsets, sizes, rank
        c.file, c.kind, c.byte_offset, c.length, c.key = file, kind, offset, length, key
        return c

    @property
    def location(self) -> Location:
        return Location(self.file, self.kind, self.byte_offset, self.length, self.key)

    def replaced(self, **changes: Any) -> Chunk:
        """This chunk with ``changes`` to its fields (``offsets``, ``sizes``, ``location``,
        ``rank``), as ``dataclasses.replace`` gives."""
        return Chunk(**{"offsets": self.offsets, "sizes": self.sizes, "location": self.location,
                        "rank": self.rank, **changes})

    def _fields(self) -> tuple:
        return (self.offsets, self.sizes, self.file, self.kind, self.byte_offset, self.length, self.key, self.rank)

    def __eq__(self, other: object) -> bool:
        if other.__class__ is not Chunk:
            return NotImplemented
        return self is other or self._fields() == other._fields()

    def __hash__(self) -> int:
        return hash(self._fields())

    def __repr__(self) -> str:
        return f"Chunk(offsets={self.offsets!r}, sizes={self.sizes!r}, location={self.location!r}, rank={self.rank!r})"

    def __reduce__(self) -> tuple:  # (for --workers: its fields, no Location on the way)
        return _chunk_at, self._fields()

    @property
    def numel(self) -> int:
        return math.prod(self.sizes)


def _chunk_at(offsets, sizes, file, kind, offset, length, key, rank) -> Chunk:
    return Chunk.at(offsets, sizes, file, kind, offset, length, key, rank)


# a tensor with this many chunks or more is described as columns (ChunkTable, ~24 bytes a
# chunk); fewer, as Chunk objects (a table's arrays cost ~300 bytes of their own)
TABLE_MIN = 8


class Palette:
    """The distinct offsets, sizes and lengths of a description's chunk tables, each kept once:
    a table's columns hold their codes (:class:`Coded`). A many-rank save's chunks are a few
    thousand such values met 10^5 times."""

    __slots__ = ("values", "codes")

    def __init__(self, values: list[Any] | None = None, codes: dict[Any, int] | None = None) -> None:
        self.values: list[Any] = values if values is not None else []
        self.codes: dict[Any, int] = codes if codes is not None else {}  # value -> its index in values

    def code(self, value: Any) -> int:
        """``value``'s code (an int, or a tuple of ints)."""
        c = self.codes.get(value)
        if c is None:
            c = self.codes[value] = len(self.values)
            self.values.append(value)
        return c

    def column(self) -> Coded:
        return Coded(self.values, array("I"))


class Coded(Sequence):
    """A column of a :class:`ChunkTable` read as the list of its values: a code a chunk (4
    bytes, an index into a :class:`Palette`'s ``values``), where a list held 8 a chunk and an
    int of its own past 256 (a byte length: 32)."""

    __slots__ = ("values", "codes")

    def __init__(self, values: list[Any], codes: array) -> None:
        self.values, self.codes = values, codes

    def __len__(self) -> int:
        return len(self.codes)

    def __getitem__(self, i):
        if isinstance(i, slice):
            return list(map(self.values.__getitem__, self.codes[i]))
        return self.values[self.codes[i]]

    def __iter__(self) -> Iterator[Any]:
        return map(self.values.__getitem__, self.codes)

    def __eq__(self, other: object) -> bool:
        return list(self) == list(other) if isinstance(other, Sequence) else NotImplemented

    __hash__ = None


class ChunkTable:
    """A tensor's chunks as columns, read as the tuple of :class:`Chunk` s it stands for (each
    made when read): offsets, sizes and byte lengths (:class:`Coded`: a description's few
    distinct values, a code each), each chunk's file (an index into ``files``, names shared by a
    description's tensors, in an ``array('I')``) and byte offset (an ``array('q')``); every chunk
    of one ``kind``; ``keys`` and ``ranks`` where the chunks have them (else no key and no
    rank): a list and an array, or one key :class:`Repeated` and a ``range`` where each chunk
    holds the one key and chunk ``i`` is rank ``i``'s, as in rank files.

    A many-rank DCP's tensors (a chunk per rank, each in its own item): 24 bytes a chunk held
    for the whole command, where a ``Chunk`` with its offset's int was ~130 (9 MB of a 256-rank
    save's 72k chunks) and lists of its fields 40; rank files' (:class:`ChunkColumns`), 24
    where they were 52, and ~104 as Chunks (7 MB less at 1,024 ranks). A plan takes what it
    reads and keeps none (:data:`~.plan.TILED`)."""

    __slots__ = ("offsets", "sizes", "where", "starts", "lengths", "files", "kind", "keys", "ranks")

    def __init__(self, offsets: Sequence[tuple[int, ...]], sizes: Sequence[tuple[int, ...]], where: array,
                 starts: array, lengths: Sequence[int], files: list[str], kind: str,
                 keys: Sequence[tuple[Any, ...]] | None = None, ranks: Sequence[int] | None = None) -> None:
        n = len(offsets)
        if not (len(sizes) == len(where) == len(starts) == len(lengths) == n and (keys is None or len(keys) == n)
                and (ranks is None or len(ranks) == n)):
            raise ValueError("a chunk table's columns differ in length")
        self.offsets, self.sizes, self.where, self.starts, self.lengths = offsets, sizes, where, starts, lengths
        self.files, self.kind, self.keys, self.ranks = files, kind, keys, ranks

    def __len__(self) -> int:
        return len(self.offsets)

    def __getitem__(self, i):
        if type(i) is not int:
            if isinstance(i, slice):
                return tuple([self[k] for k in range(*i.indices(len(self.offsets)))])
            i = operator.index(i)
        o, z, n = self.offsets, self.sizes, self.lengths
        # (an IndexError past the end, as a tuple's; a negative i as a tuple's)
        if type(o) is Coded and type(z) is Coded and type(n) is Coded:  # (the usual: read here, a plan reads many)
            offsets, sizes, length = o.values[o.codes[i]], z.values[z.codes[i]], n.values[n.codes[i]]
        else:
            offsets, sizes, length = o[i], z[i], n[i]
        keys = self.keys  # (i is in range: its codes were read)
        key = () if keys is None else keys.value if type(keys) is Repeated else keys[i]
        return Chunk.at(offsets, sizes, self.files[self.where[i]], self.kind, self.starts[i], length, key,
                        None if self.ranks is None else self.ranks[i])

    def __iter__(self) -> Iterator[Chunk]:
        at, kind, n = Chunk.at, self.kind, len(self.offsets)
        files = map(self.files.__getitem__, self.where)
        keys = self.keys if self.keys is not None else itertools.repeat((), n)
        ranks = self.ranks if self.ranks is not None else itertools.repeat(None, n)
        for offsets, sizes, file, start, length, key, rank in zip(self.offsets, self.sizes, files, self.starts,
                                                                  self.lengths, keys, ranks):
            yield at(offsets, sizes, file, kind, start, length, key, rank)

    def __eq__(self, other: object) -> bool:
        if isinstance(other, ChunkTable):
            other = tuple(other)
        return tuple(self) == other if isinstance(other, tuple) else NotImplemented

    __hash__ = None  # (as a tuple of them is never hashed here: a tensor's hash leaves its chunks out)

    def __repr__(self) -> str:
        return f"ChunkTable({len(self)} chunks)"

    def __reduce__(self) -> tuple:  # (for --workers: the chunks, each by value; arrays do not cross)
        return _chunks, (list(self),)


class TableColumns:
    """The columns of a :class:`ChunkTable` being gathered, a chunk at a time (:meth:`add`):
    ``files`` and ``ids`` (file names and their indices, ``names``: the palette of them) and the
    :class:`Palette` of values shared by a description's tables."""

    __slots__ = ("offsets", "sizes", "where", "starts", "lengths", "names", "palette")

    def __init__(self, files: list[str], ids: dict[str, int], palette: Palette) -> None:
        self.offsets, self.sizes, self.lengths = palette.column(), palette.column(), palette.column()
        self.where, self.starts = array("I"), array("q")
        self.names, self.palette = Palette(files, ids), palette

    def add(self, offsets: tuple[int, ...], sizes: tuple[int, ...], file: str, start: int, length: int) -> None:
        self.put(offsets, sizes, self.names.code(file), start, length)

    def put(self, offsets: tuple[int, ...], sizes: tuple[int, ...], i: int, start: int, length: int) -> None:
        """:meth:`add`, its file by its index."""
        palette = self.palette
        codes = palette.codes  # (the usual: a value met before)
        c = codes.get(offsets)
        self.offsets.codes.append(c if c is not None else palette.code(offsets))
        c = codes.get(sizes)
        self.sizes.codes.append(c if c is not None else palette.code(sizes))
        c = codes.get(length)
        self.lengths.codes.append(c if c is not None else palette.code(length))
        self.where.append(i)
        self.starts.append(start)

    def table(self, kind: str, keys: Sequence | None = None, ranks: Sequence | None = None) -> ChunkTable:
        return ChunkTable(self.offsets, self.sizes, self.where, self.starts, self.lengths, self.names.values, kind, keys,
                          ranks)


class Repeated(Sequence):
    """``value`` ``n`` times, read as a list of it: a :class:`ChunkTable` column whose every
    chunk holds the one object (a rank file's tensor: one storage key on every rank), where a
    list was 8 bytes a chunk (2.4 MB of a 1,024-rank description)."""

    __slots__ = ("value", "n")

    def __init__(self, value: Any, n: int) -> None:
        self.value, self.n = value, n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i):
        if isinstance(i, slice):
            return [self.value] * len(range(*i.indices(self.n)))
        i = operator.index(i)
        if not -self.n <= i < self.n:
            raise IndexError("Repeated index out of range")
        return self.value

    def __iter__(self) -> Iterator[Any]:
        return itertools.repeat(self.value, self.n)

    def __eq__(self, other: object) -> bool:
        return list(self) == list(other) if isinstance(other, Sequence) else NotImplemented

    __hash__ = None


def in_order(order: array) -> array | range:
    """``order`` as ``range(n)`` where it is ``0 .. n-1`` (chunks met in row order already: a
    rank file's); either reads alike."""
    return range(len(order)) if all(x == i for i, x in enumerate(order)) else order


class ChunkColumns:
    """A tensor's chunks gathered as a :class:`ChunkTable`'s columns while rank files are read,
    rank by rank: :meth:`add` a chunk's fields (or :meth:`append` a Chunk), no Chunk kept.
    :meth:`chunks` gives the table, or the tuple of chunks where they are fewer than
    :data:`TABLE_MIN`, not all of one kind, or one was saved by no rank. ``files``, ``ids`` and
    ``palette``: the file names of a description's tables, their indices, and its values."""

    __slots__ = ("columns", "keys", "ranks", "kind", "odd")

    def __init__(self, files: list[str], ids: dict[str, int], palette: Palette | None = None) -> None:
        self.columns = TableColumns(files, ids, palette if palette is not None else Palette())
        # (a key column while every chunk's is one object, a rank column while chunk i is rank
        # i's: a rank file's tensor, its 1,024 chunks 12 KB less)
        self.keys: list[tuple[Any, ...]] | Repeated = Repeated(None, 0)
        self.ranks: array | range = range(0)
        self.kind: str | None = None
        self.odd: list[Chunk] | None = None  # (the chunks, once they are not all of one kind with a rank)

    def append(self, c: Chunk) -> None:
        self.add(c.offsets, c.sizes, c.file, c.kind, c.byte_offset, c.length, c.key, c.rank)

    def add(self, offsets: tuple[int, ...], sizes: tuple[int, ...], file: str, kind: str, offset: int,
            length: int, key: tuple[Any, ...], rank: int | None) -> None:
        if kind != self.kind or rank is None or self.odd is not None:  # (the first chunk, or an odd one)
            if self._odd(offsets, sizes, file, kind, offset, length, key, rank):
                return
        self.columns.add(offsets, sizes, file, offset, length)
        keys, ranks = self.keys, self.ranks
        if type(keys) is not Repeated:
            keys.append(key)
        elif key is keys.value or not keys.n:
            keys.value, keys.n = key, keys.n + 1
        else:
            self.keys = [*keys, key]
        if type(ranks) is not range:
            ranks.append(rank)
        elif rank == len(ranks):
            self.ranks = range(rank + 1)
        else:
            self.ranks = array("i", [*ranks, rank])

    def _odd(self, offsets: tuple[int, ...], sizes: tuple[int, ...], file: str, kind: str, offset: int,
             length: int, key: tuple[Any, ...], rank: int | None) -> bool:
        """The first chunk's kind noted (False: it goes in the columns); else the chunks kept
        as Chunks from here on, this one added (True)."""
        if self.odd is None and rank is not None and self.kind is None:
            self.kind = kind
            return False
        if self.odd is None:
            self.odd = list(self._table())
        self.odd.append(Chunk.at(offsets, sizes, file, kind, offset, length, key, rank))
        return True

    def _table(self) -> ChunkTable:
        return self.columns.table(self.kind, self.keys, self.ranks)

    def chunks(self) -> tuple[Chunk, ...] | ChunkTable:
        if self.odd is not None:
            return tuple(self.odd)
        table = self._table()
        return table if len(table) >= TABLE_MIN else tuple(table)


def _chunks(chunks: list[Chunk]) -> tuple[Chunk, ...]:
    return tuple(chunks)


def extents(chunks: tuple[Chunk, ...] | ChunkTable) -> Iterator[tuple[tuple[int, ...], str, int, int]]:
    """Each chunk's ``(sizes, file, byte offset, length)``, in order: a table's columns (no
    chunk made), else the chunks' fields."""
    if type(chunks) is ChunkTable:
        return zip(chunks.sizes, map(chunks.files.__getitem__, chunks.where), chunks.starts, chunks.lengths)
    return ((c.sizes, c.file, c.byte_offset, c.length) for c in chunks)


def layout_key(chunks: tuple[Chunk, ...] | ChunkTable) -> tuple | None:
    """A value two chunk tables share where their chunks' offsets, sizes and ranks are the same,
    in order: their codes into one description's values, compared as bytes (no chunk made). A
    model's tensors are a few layouts, so what depends on those alone is found once for each
    (the tables compared must stay alive meanwhile: a key names their values by ``id``). None
    where the chunks are not such a table."""
    if type(chunks) is not ChunkTable:
        return None
    o, z, r = chunks.offsets, chunks.sizes, chunks.ranks
    if type(o) is not Coded or type(z) is not Coded or not (r is None or type(r) is range or type(r) is array):
        return None
    # (codes index a palette's values, which only grow: one list and its codes are one sequence)
    return (id(o.values), id(z.values), o.codes.tobytes(), z.codes.tobytes(),
            r if r is None or type(r) is range else (r.typecode, r.tobytes()))


def kinds(chunks: tuple[Chunk, ...] | ChunkTable) -> set[str]:
    """The kinds of storage the chunks are (a table's one kind: no chunk made)."""
    if type(chunks) is ChunkTable:
        return {chunks.kind} if len(chunks) else set()
    return {c.kind for c in chunks}


def holders(chunks: tuple[Chunk, ...] | ChunkTable) -> Iterator[tuple[int | None, tuple[int, ...]]]:
    """Each chunk's ``(rank, sizes)``, in order: a table's columns (no chunk made), else the
    chunks' fields."""
    if type(chunks) is ChunkTable:
        return zip(chunks.ranks if chunks.ranks is not None else itertools.repeat(None), chunks.sizes)
    return ((c.rank, c.sizes) for c in chunks)


def files_of(chunks: tuple[Chunk, ...] | ChunkTable) -> set[str]:
    """The files the chunks are stored in (a table's from its columns: no chunk made)."""
    if type(chunks) is ChunkTable:
        return set(map(chunks.files.__getitem__, set(chunks.where)))
    return {c.file for c in chunks}


def columns(chunks: tuple[Chunk, ...] | ChunkTable) -> tuple[Sequence[tuple[int, ...]], Sequence[tuple[int, ...]]]:
    """The chunks' offsets and sizes, each in the chunks' order: a table's own columns (no
    chunk made), else gathered from the chunks."""
    if type(chunks) is ChunkTable:
        return chunks.offsets, chunks.sizes
    return [c.offsets for c in chunks], [c.sizes for c in chunks]
