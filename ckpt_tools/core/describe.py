"""What a checkpoint holds, described from headers and metadata alone.

A :class:`Checkpoint` lists every logical (unsharded) tensor with its global shape and dtype,
and, for each tensor, the chunks that store it: which rectangle of the global tensor a chunk
covers and where its bytes live. Plans are computed from two descriptions; no tensor data is
needed until the engine carries a plan out.
"""

from __future__ import annotations

import itertools
import math
import operator
from array import array
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field, replace
from functools import cached_property
from pathlib import Path
from typing import Any

from .dtypes import DType
from .groups import Roots
from ..errors import BadInput

GROUPS = ("model", "optimizer", "extra")


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


# a tensor with this many chunks or more is described as columns (ChunkTable, 40-52 bytes a
# chunk); fewer, as Chunk objects (a table's lists and arrays cost ~300 bytes of their own)
TABLE_MIN = 8


class ChunkTable:
    """A tensor's chunks as columns, read as the tuple of :class:`Chunk` s it stands for (each
    made when read): offsets and sizes (lists of shared tuples), and ``(file, byte offset,
    length)`` per chunk in one ``array('q')``, ``file`` an index into ``files`` (names shared by
    a description's tensors); every chunk of one ``kind``; ``keys`` (a list) and ``ranks`` (an
    ``array('i')``) where the chunks have them (else no key and no rank).

    A many-rank DCP's tensors (a chunk per rank, each in its own item): 40 bytes a chunk held
    for the whole command, where a ``Chunk`` with its offset's int was ~130 (9 MB of a 256-rank
    save's 72k chunks); rank files' (:class:`ChunkColumns`), 52 where it was ~104 (15 MB at
    1,024 ranks). A plan takes what it reads and keeps none (:data:`~.plan.TILED`)."""

    __slots__ = ("offsets", "sizes", "spans", "files", "kind", "keys", "ranks")

    def __init__(self, offsets: list[tuple[int, ...]], sizes: list[tuple[int, ...]], spans: array,
                 files: list[str], kind: str, keys: list[tuple[Any, ...]] | None = None,
                 ranks: array | None = None) -> None:
        n = len(offsets)
        if not (len(sizes) == n and len(spans) == 3 * n and (keys is None or len(keys) == n)
                and (ranks is None or len(ranks) == n)):
            raise ValueError("a chunk table's columns differ in length")
        self.offsets, self.sizes, self.spans, self.files, self.kind = offsets, sizes, spans, files, kind
        self.keys, self.ranks = keys, ranks

    def __len__(self) -> int:
        return len(self.offsets)

    def __getitem__(self, i):
        if type(i) is not int:
            if isinstance(i, slice):
                return tuple([self[k] for k in range(*i.indices(len(self.offsets)))])
            i = operator.index(i)
        offsets = self.offsets[i]  # (an IndexError past the end, as a tuple's; a negative i as a tuple's)
        at = 3 * i if i >= 0 else 3 * (i + len(self.offsets))
        spans = self.spans
        return Chunk.at(offsets, self.sizes[i], self.files[spans[at]], self.kind, spans[at + 1], spans[at + 2],
                        () if self.keys is None else self.keys[i], None if self.ranks is None else self.ranks[i])

    def __iter__(self) -> Iterator[Chunk]:
        at, files, kind, spans = Chunk.at, self.files, self.kind, self.spans
        if self.keys is None and self.ranks is None:
            for k, (offsets, sizes) in enumerate(zip(self.offsets, self.sizes)):
                j = 3 * k
                yield at(offsets, sizes, files[spans[j]], kind, spans[j + 1], spans[j + 2])
            return
        keys = self.keys if self.keys is not None else [()] * len(self.offsets)
        ranks = self.ranks if self.ranks is not None else [None] * len(self.offsets)
        for k, (offsets, sizes, key, rank) in enumerate(zip(self.offsets, self.sizes, keys, ranks)):
            j = 3 * k
            yield at(offsets, sizes, files[spans[j]], kind, spans[j + 1], spans[j + 2], key, rank)

    def __eq__(self, other: object) -> bool:
        if isinstance(other, ChunkTable):
            other = tuple(other)
        return tuple(self) == other if isinstance(other, tuple) else NotImplemented

    __hash__ = None  # (as a tuple of them is never hashed here: a tensor's hash leaves its chunks out)

    def __repr__(self) -> str:
        return f"ChunkTable({len(self)} chunks)"

    def __reduce__(self) -> tuple:  # (for --workers: the chunks, each by value; arrays do not cross)
        return _chunks, (list(self),)


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


def _in_order(order: array) -> array | range:
    """``order`` as ``range(n)`` where it is ``0 .. n-1`` (chunks met in row order already: a
    rank file's); either reads alike."""
    return range(len(order)) if all(x == i for i, x in enumerate(order)) else order


class ChunkColumns:
    """A tensor's chunks gathered as a :class:`ChunkTable`'s columns while rank files are read,
    rank by rank: :meth:`add` a chunk's fields (or :meth:`append` a Chunk), no Chunk kept.
    :meth:`chunks` gives the table, or the tuple of chunks where they are fewer than
    :data:`TABLE_MIN`, not all of one kind, or one was saved by no rank. ``files`` and ``ids``:
    the file names of a description's tables and their indices, shared by its tensors."""

    __slots__ = ("offsets", "sizes", "spans", "keys", "ranks", "kind", "files", "ids", "odd")

    def __init__(self, files: list[str], ids: dict[str, int]) -> None:
        self.offsets: list[tuple[int, ...]] = []
        self.sizes: list[tuple[int, ...]] = []
        # (a key column while every chunk's is one object, a rank column while chunk i is rank
        # i's: a rank file's tensor, its 1,024 chunks 12 KB less)
        self.keys: list[tuple[Any, ...]] | Repeated = Repeated(None, 0)
        self.ranks: array | range = range(0)
        self.spans = array("q")
        self.kind: str | None = None
        self.files, self.ids = files, ids
        self.odd: list[Chunk] | None = None  # (the chunks, once they are not all of one kind with a rank)

    def append(self, c: Chunk) -> None:
        self.add(c.offsets, c.sizes, c.file, c.kind, c.byte_offset, c.length, c.key, c.rank)

    def add(self, offsets: tuple[int, ...], sizes: tuple[int, ...], file: str, kind: str, offset: int,
            length: int, key: tuple[Any, ...], rank: int | None) -> None:
        if kind != self.kind or rank is None or self.odd is not None:  # (the first chunk, or an odd one)
            if self._odd(offsets, sizes, file, kind, offset, length, key, rank):
                return
        i = self.ids.get(file)
        if i is None:
            i = self.ids[file] = len(self.files)
            self.files.append(file)
        self.offsets.append(offsets)
        self.sizes.append(sizes)
        self.spans.extend((i, offset, length))
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
        return ChunkTable(self.offsets, self.sizes, self.spans, self.files, self.kind, self.keys, self.ranks)

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
        files, spans = chunks.files, chunks.spans
        return ((z, files[spans[j]], spans[j + 1], spans[j + 2]) for j, z in zip(range(0, len(spans), 3), chunks.sizes))
    return ((c.sizes, c.file, c.byte_offset, c.length) for c in chunks)


def holders(chunks: tuple[Chunk, ...] | ChunkTable) -> Iterator[tuple[int | None, tuple[int, ...]]]:
    """Each chunk's ``(rank, sizes)``, in order: a table's columns (no chunk made), else the
    chunks' fields."""
    if type(chunks) is ChunkTable:
        return zip(chunks.ranks if chunks.ranks is not None else itertools.repeat(None), chunks.sizes)
    return ((c.rank, c.sizes) for c in chunks)


def files_of(chunks: tuple[Chunk, ...] | ChunkTable) -> set[str]:
    """The files the chunks are stored in (a table's from its columns: no chunk made)."""
    if type(chunks) is ChunkTable:
        return set(map(chunks.files.__getitem__, set(chunks.spans[0::3])))
    return {c.file for c in chunks}


def columns(chunks: tuple[Chunk, ...] | ChunkTable) -> tuple[Sequence[tuple[int, ...]], Sequence[tuple[int, ...]]]:
    """The chunks' offsets and sizes, each in the chunks' order: a table's own columns (no
    chunk made), else gathered from the chunks."""
    if type(chunks) is ChunkTable:
        return chunks.offsets, chunks.sizes
    return [c.offsets for c in chunks], [c.sizes for c in chunks]


@dataclass(frozen=True)
class TensorInfo:
    """A logical tensor: its group, its name as its state dict spells it, shape, dtype, chunks.

    Optimizer tensors are named ``state.<param fqn>.<key>`` and also carry ``param`` and ``state``.
    """

    group: str
    name: str
    shape: tuple[int, ...]
    dtype: DType
    chunks: tuple[Chunk, ...] | ChunkTable  # (a table: read as the tuple, see ChunkTable)
    param: str | None = None
    state: str | None = None
    # Where a DCP source keeps the tensor: its nesting path as ``dcp.save`` recorded it
    # (``("model", "lm_head.weight")``, torchtitan's ``("tok_embeddings.weight",)``); a DCP
    # written from this source keeps it, so no key is renamed, nested or un-nested.
    path: tuple[Any, ...] = field(default=(), compare=False)

    def __hash__(self) -> int:
        # not the chunks: a tensor of a 1,024-rank save has 1,024 of them, and plans hash
        # pieces (hence their tensors) per entry; equal tensors still hash equal
        return hash((self.group, self.name, self.shape))

    def __getstate__(self) -> dict:
        # (for --workers: not the row index, arrays the hand-over does not take; made again there)
        state = self.__dict__
        return {k: v for k, v in state.items() if k != "_rows_index"} if "_rows_index" in state else state

    @property
    def key(self) -> tuple[str, str]:
        return (self.group, self.name)

    def whole_chunk(self) -> Chunk | None:
        """Its one chunk, where that holds the whole tensor (every tensor of a safetensors file):
        then it is covered, and a piece of it is a copy from that chunk."""
        chunks = self.chunks
        if len(chunks) == 1:
            c = chunks[0]
            if c.sizes == self.shape and len(c.offsets) == len(self.shape) and not any(c.offsets):
                return c
        return None

    def rows_index(self) -> tuple[array, array, int]:
        """The chunks with elements, as (first rows sorted, their indices in ``chunks``, most
        rows in one chunk): the chunks that meet rows [a, b) are found by bisection, so a plan
        for one destination piece touches only the source chunks that overlap it. Built once."""
        got = self.__dict__.get("_rows_index")
        if got is None:
            live, most = [], 0
            for i, (o, z) in enumerate(zip(*columns(self.chunks))):
                if o and 0 not in z:
                    live.append((o[0], i))
                    if z[0] > most:
                        most = z[0]
            live.sort()
            # (as arrays: 8 bytes an entry, kept for the command, where lists of ints were ~50;
            # the order as a range where the chunks are in row order already, a rank file's)
            got = (array("q", [o for o, _ in live]), _in_order(array("q", [i for _, i in live])), most)
            object.__setattr__(self, "_rows_index", got)
        return got

    def row_tiles(self) -> bool:
        """Whether the chunks with elements tile the rows: whole rows each (every column), no
        two meeting, none missing. Then rows [a, b) are in the chunks from the one holding row
        ``a`` on, in row order (a ``Shard(0)`` save; not replicas). Found once."""
        got = self.__dict__.get("_row_tiles")
        if got is None:
            starts, order, _ = self.rows_index()
            offsets, sizes = columns(self.chunks)
            rest, end, got = self.shape[1:], 0, bool(self.shape)
            for start, i in zip(starts, order):
                z = sizes[i]
                if start != end or z[1:] != rest or any(offsets[i][1:]):
                    got = False
                    break
                end += z[0]
            got = got and end == self.shape[0]
            object.__setattr__(self, "_row_tiles", got)
        return got

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def nbytes(self) -> int:
        return self.numel * dtype_size(self.dtype)


@dataclass(frozen=True)
class ObjectInfo:
    """A non-tensor value (param_groups, LR scheduler, RNG state, ...); ``rank`` for per-rank ones."""

    group: str
    name: str
    location: Location
    rank: int | None = None
    # Where the value sits in the saved state: ("lr_scheduler",), ("optimizer", "param_groups"),
    # or DCP's flattened path ("optimizer", "param_groups", 0, "lr").
    path: tuple[Any, ...] = ()


@dataclass(frozen=True)
class FileEntry:
    path: str
    size: int


@dataclass(frozen=True)
class Checkpoint:
    """The description of one checkpoint. ``root`` is its directory (or its single file)."""

    format: str
    root: Path
    world_size: int | None
    tensors: tuple[TensorInfo, ...]
    objects: tuple[ObjectInfo, ...] = ()
    files: tuple[FileEntry, ...] = ()
    mesh_shape: tuple[int, ...] | None = None
    # Facts shown by `inspect` that plans do not need: optimizer type, step, extra-state keys...
    details: dict[str, Any] = field(default_factory=dict, compare=False)
    # Parameter FQNs in the order an int-keyed optimizer state dict numbers them.
    param_order: tuple[str, ...] = ()
    # where the saved state nests the model and the optimizer, when found by what they hold
    # (``("app", "optim")``); objects' paths are the saved ones, see :meth:`rooted`
    roots: Roots = field(default_factory=Roots, compare=False)
    # the source files as they were before they were described (safefs.stamps): an output is
    # published only if they are still the same when it is complete
    stamps: dict[str, tuple[int, int, int, int]] | None = field(default=None, compare=False, repr=False)

    def base_dir(self) -> Path:
        return self._base_dir

    @cached_property
    def _base_dir(self) -> Path:  # asked once per chunk read: one stat per description, not per chunk
        return self.root if self.root.is_dir() else self.root.parent

    def path_of(self, location: Location) -> Path:
        return self.base_dir() / location.file

    def rooted(self, objects) -> tuple[ObjectInfo, ...]:
        """``objects`` with the model's and optimizer's paths under ``("model", ...)`` and
        ``("optimizer", ...)``, as every format but DCP (which keeps the saved keys) writes them."""
        out = []
        for o in objects:
            root = {"model": self.roots.model, "optimizer": self.roots.optimizer}.get(o.group)
            if root is not None and tuple(map(str, o.path[:len(root)])) == root:
                o = replace(o, path=(o.group, *o.path[len(root):]))
            out.append(o)
        return tuple(out)

    def group(self, name: str) -> tuple[TensorInfo, ...]:
        return tuple(t for t in self.tensors if t.group == name)

    def tensor_map(self) -> dict[tuple[str, str], TensorInfo]:
        return {t.key: t for t in self.tensors}

    @property
    def total_bytes(self) -> int:
        return sum(t.nbytes for t in self.tensors)


# equal tuples of a description and its plan as one object: a many-rank job's chunks, pieces
# and copies repeat a few offsets and sizes, and each tensor's key once per rank file parsed,
# hundreds of thousands of times (~60 bytes a tuple, and a key's name string from each file's
# tree: ~45 MB of a 25k-tensor, 8-rank description); bounded, emptied when full
_SHARED: dict[tuple, tuple] = {}
_SHARED_MAX = 1 << 17


def sharing() -> Callable[[tuple, tuple], tuple]:
    """The table's ``setdefault`` (``share(t, t)``: ``t``, or the equal tuple met first), for a
    loop that shares many (emptied first if full). For offsets, sizes and a state dict's keys,
    where equal members act the same (a dict holds one of ``1`` and ``True``)."""
    if len(_SHARED) >= _SHARED_MAX:
        _SHARED.clear()
    return _SHARED.setdefault


def shared(value: tuple) -> tuple:
    """``value``, or the equal tuple met first (see :func:`sharing`)."""
    return sharing()(value, value)


def dtype_size(dtype: DType) -> int:
    return DType.of(dtype).itemsize


def dtype_name(dtype: DType) -> str:
    return str(DType.of(dtype))


def chunk_rows(dim0: int, world_size: int, rank: int) -> tuple[int, int]:
    """Rows [start, stop) that FSDP2's ``Shard(0)`` gives ``rank``: ``torch.chunk`` sizes,
    so ranks at the end may hold fewer rows or none."""
    size = -(-dim0 // world_size) if dim0 else 0
    start = min(rank * size, dim0)
    return start, min(start + size, dim0)


def check_coverage(ckpt: Checkpoint) -> None:
    """Every tensor must be covered by its chunks exactly once (replicas, i.e. identical boxes,
    allowed): no hole, no partial overlap, no chunk outside the tensor."""
    for t in ckpt.tensors:
        if t.whole_chunk() is not None or _tiled(t):
            continue
        boxes = {}
        for c in t.chunks:
            if len(c.offsets) != len(t.shape) or len(c.sizes) != len(t.shape) or any(
                o < 0 or s < 0 or o + s > d for o, s, d in zip(c.offsets, c.sizes, t.shape)
            ):
                raise BadInput(
                    f"{ckpt.root}: tensor {t.name!r}: chunk at {c.offsets} of size {c.sizes} "
                    f"lies outside its shape {t.shape} ({c.location.file}); the shards are inconsistent"
                )
            if c.numel:
                boxes[(c.offsets, c.sizes)] = c
        unique = list(boxes.values())
        covered = sum(c.numel for c in unique)
        if covered != t.numel or _any_overlap(unique):
            kind = "overlapping shards" if covered > t.numel or _any_overlap(unique) else "a hole"
            files = sorted({c.location.file for c in t.chunks})
            raise BadInput(
                f"{ckpt.root}: tensor {t.name!r} has {kind}: its chunks cover {covered} of "
                f"{t.numel} elements (files: {', '.join(files[:4])}{'...' if len(files) > 4 else ''}); "
                "is a rank file missing or from another save?"
            )


def _tiled(t: TensorInfo) -> bool:
    """Whether ``t``'s chunks are a ``Shard(0)`` save's, which :func:`check_coverage` then need not
    look at box by box: the chunks with elements tile the rows (:meth:`TensorInfo.row_tiles`)
    and none has a negative row count, so each lies within the tensor; the empty ones do too."""
    nd = len(t.shape)
    if not nd or not t.row_tiles():
        return False
    for offsets, sizes in zip(*columns(t.chunks)):
        if len(offsets) != nd or len(sizes) != nd or sizes[0] < 0:
            return False
        if 0 in sizes and any(o < 0 or s < 0 or o + s > d for o, s, d in zip(offsets, sizes, t.shape)):
            return False
    return True


def _any_overlap(chunks: list[Chunk]) -> bool:
    # Shards are few per tensor; sort on the first dimension and compare neighbours in it.
    ordered = sorted(chunks, key=lambda c: c.offsets)
    for i, a in enumerate(ordered):
        for b in ordered[i + 1:]:
            if all(ao < bo + bs and bo < ao + as_ for ao, as_, bo, bs in
                   zip(a.offsets, a.sizes, b.offsets, b.sizes)):
                return True
            if a.offsets and b.offsets[0] >= a.offsets[0] + a.sizes[0]:
                break
    return False
