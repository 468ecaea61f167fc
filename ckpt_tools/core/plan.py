"""Plans: which source bytes make which destination piece. Pure data, computed from
descriptions; :mod:`ckpt_tools.engine.execute` carries them out.

A :class:`Target` is a tensor to write (its source, new name, new dtype); a :class:`Piece` is
the rectangle of it that one destination file holds, with the :class:`Copy` list that fills
it from source chunks. A :class:`Span` is a piece whose bytes lie whole in source files, for
the kernel to copy; :func:`by_piece` serves a stream of pieces to a writer in its own order.
"""

from __future__ import annotations

import math
from array import array
from collections import Counter
from bisect import bisect_left, bisect_right
from collections.abc import Callable, Iterable, Iterator, Sequence
from pathlib import Path
from typing import Any, ClassVar
from dataclasses import dataclass, field, replace
from functools import cached_property

from .describe import Chunk, ObjectInfo, TensorInfo, chunk_rows, dtype_size, sharing
from .dtypes import DType
from ..errors import BadInput


@dataclass(frozen=True)
class Computed:
    """A target whose values are computed from its source and ``inputs`` rather than copied:
    ``op`` names the computation (:data:`ckpt_tools.engine.computed.OPS`: a quantized weight
    dequantized with its scales, a weight quantized), ``params`` its settings as ``(key, value)``
    pairs, ``shape`` the result's shape. The plan stays data; the arithmetic lives with the
    engine's storage."""

    op: str
    shape: tuple[int, ...]
    inputs: tuple[TensorInfo, ...] = ()
    params: tuple[tuple[str, Any], ...] = ()

    def param(self, key: str, default: Any = None) -> Any:
        return dict(self.params).get(key, default)


@dataclass(frozen=True)
class Target:
    """A destination tensor: read from ``source`` (or computed from it, ``computed``), written
    as ``group``/``name`` in ``dtype``."""

    source: TensorInfo
    group: str
    name: str
    dtype: DType
    param: str | None = None
    state: str | None = None
    computed: Computed | None = None

    def __post_init__(self) -> None:
        # float8 values are codes of a scaled weight: cast alone they are wrong weights
        if (self.computed is None and self.dtype != self.source.dtype and self.source.dtype.startswith("float8")):
            raise BadInput(f"tensor {self.source.name!r} is {self.source.dtype}: its values are scaled codes, and "
                           f"casting them to {self.dtype} without their scales would write wrong weights; "
                           "a quantized Hugging Face checkpoint needs its config.json (quantization_config)")
        # ``shape``: the computed result's, else the source's; a plain attribute, not a field
        # (asked several times per piece of a many-rank plan: a property's call cost 2% of it)
        self.__dict__["shape"] = self.computed.shape if self.computed is not None else self.source.shape

    shape: ClassVar[tuple[int, ...]]  # (set per target by __post_init__)

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def nbytes(self) -> int:
        return self.numel * dtype_size(self.dtype)


# not frozen, for a cheaper __init__: built per (tensor, rank) (see core.chunks.Location)
@dataclass(slots=True, unsafe_hash=True)
class Copy:
    """Copy ``sizes`` elements from ``chunk`` (starting at ``src_start`` within it) to
    ``dst_start`` within the destination piece."""

    chunk: Chunk
    src_start: tuple[int, ...]
    dst_start: tuple[int, ...]
    sizes: tuple[int, ...]


@dataclass(frozen=True)
class LowRank:
    """``scale * (b @ a)`` added to a whole 2-D piece: a low-rank update (LoRA) folded into
    its base weight. ``a`` and ``b`` are small; they are read whole."""

    a: TensorInfo
    b: TensorInfo
    scale: float
    transposed: bool = False  # an embedding's update: scale * (b @ a).T


_NBYTES: dict[int, int] = {}  # Piece.nbytes's ints, each value once


# not frozen, for a cheaper __init__: built per (tensor, rank) (see core.chunks.Location);
# slots: a many-rank plan holds hundreds of thousands (a __dict__ each was ~100 bytes more)
@dataclass(slots=True, eq=False)
class Piece:
    """The rectangle ``offsets``/``sizes`` of ``target`` that one destination file holds,
    filled by ``copies`` (plus ``add``, when a low-rank update is folded in)."""

    target: Target
    offsets: tuple[int, ...]
    sizes: tuple[int, ...]
    copies: tuple[Copy, ...] | _Tiled  # (TILED: worked out when read, by copies_of)
    add: LowRank | None = None
    _nbytes: int = field(default=-1, init=False, repr=False, compare=False)

    def __hash__(self) -> int:
        # writers key pieces in dicts (by_piece); the copies follow from the rest
        return hash((self.target.name, self.offsets, self.sizes))

    def __eq__(self, other: object) -> bool:
        # (as the dataclass compares, TILED copies as the tuple they stand for)
        if type(other) is not Piece:
            return NotImplemented
        return (self.target, self.offsets, self.sizes, self.add) == (other.target, other.offsets, other.sizes, other.add) \
            and (self.copies is other.copies or copies_of(self) == copies_of(other))

    @property
    def numel(self) -> int:
        return math.prod(self.sizes)

    @property
    def nbytes(self) -> int:  # (asked several times per piece: progress, balance, each job's total)
        n = self._nbytes
        if n < 0:
            n = self.numel * dtype_size(self.target.dtype)
            if len(_NBYTES) >= 1 << 16:
                _NBYTES.clear()
            # (one int per distinct size: a many-rank plan's pieces are a few sizes, and each
            # int over 256 is 32 bytes of its own, 1.8 MB of a 256-rank plan)
            n = self._nbytes = _NBYTES.setdefault(n, n)
        return n

    @property
    def whole(self) -> bool:
        return self.sizes == self.target.shape


@dataclass(frozen=True)
class FileJob:
    """One destination file: its path relative to DST, the pieces and objects it holds, in
    order (the pieces a tuple, or made when asked for: :class:`RankPieces`), and
    writer-specific facts (``rank``, ``kind``)."""

    path: str
    pieces: Sequence[Piece] = ()
    objects: tuple[ObjectInfo, ...] = ()
    rank: int | None = None
    kind: str = ""
    meta: dict = field(default_factory=dict, compare=False)

    @cached_property
    def nbytes(self) -> int:
        pieces = self.pieces
        return pieces.nbytes if type(pieces) is RankPieces else sum(p.nbytes for p in pieces)

    def targets(self) -> list[Target]:
        """The targets of this file's pieces, in order (pieces made on demand are not made)."""
        pieces = self.pieces
        return pieces.targets() if type(pieces) is RankPieces else [p.target for p in pieces]

    def tensors(self) -> int:
        """How many tensors this file holds (pieces made on demand are not made)."""
        return len({t.name for t in self.targets()})

    def unload(self) -> None:
        """Let go of pieces made on demand (:class:`RankPieces`), to be made again when next
        asked for: a pass over every job (a dry run) holds one job's at a time."""
        if type(self.pieces) is RankPieces:
            self.pieces.forget()

    def release(self) -> None:
        """Let this job's pieces go, its file written (its ``nbytes`` kept): for an engine the
        plan was handed over to (:func:`~ckpt_tools.engine.execute.execute`'s ``consume``)."""
        self.nbytes  # noqa: B018 (worked out while the pieces are here)
        object.__setattr__(self, "pieces", ())


class RankRows:
    """What every rank's file of one kind holds under FSDP2's ``Shard(0)`` at ``world_size``:
    a piece of each of ``targets`` (:func:`rows_of`), in order; those in ``wholes``
    (``id(target) -> piece``) the same whole piece on every rank. ``empty``: whether a piece
    without elements is held (a rank file holds every tensor; a DCP file only those it has
    rows of); ``first``: targets held whole by rank 0 alone, after the rest (a DCP's scalars).
    Each rank's pieces are made from it when asked for (:class:`RankPieces`); how many there
    are, their targets and bytes are worked out without them."""

    def __init__(self, targets: Sequence[Target], wholes: dict[int, Piece], world_size: int, *,
                 empty: bool = True, first: Sequence[Target] = ()) -> None:
        self.targets, self.wholes, self.world_size = tuple(targets), wholes, world_size
        self.empty, self.first = empty, tuple(first)
        fixed, rows = [0, 0], Counter()
        for t in self.targets:
            piece = wholes.get(id(t))
            if piece is not None or not t.shape:
                size = piece.nbytes if piece is not None else dtype_size(t.dtype)
                fixed[0] += size
                fixed[1] += bool(size)
            else:  # (by rows and a row's bytes: a model's tensors are a few shapes)
                rows[(t.shape[0], math.prod(t.shape[1:]) * dtype_size(t.dtype))] += 1
        self._fixed, self._rows = tuple(fixed), tuple(rows.items())
        self._first_bytes = sum(whole(t).nbytes for t in self.first)
        # how each target's piece is made (its whole piece; True: rows of tiled chunks, as
        # rows_of finds them; else None: rows_of), found once for every rank
        self._how = tuple([wholes.get(id(t)) or (True if _tiles_rows(t) else None) for t in self.targets])
        # (without ``empty``) how many ranks, from rank 0, hold elements of each target: torch.chunk
        # gives a tensor's rows to the first ranks, so a rank holds those whose count exceeds it.
        # A rank's targets are found by these counts, not by making every target's piece: a file
        # of many small tensors (an MoE's experts cut finer than the ranks) holds few of them.
        # (Worked out when first asked, where the pieces are made: arrays, which the hand-over
        # to --workers does not take.)
        self._holders: array | None = None
        self._levels: list[int] = []
        self._last: tuple[int, array] | None = None  # the last rank's targets: (level, indices)

    def __getstate__(self) -> dict:
        return {**self.__dict__, "_holders": None, "_levels": [], "_last": None}

    def _holders_of(self, t: Target) -> int:
        """How many ranks (the first ones) hold elements of ``t`` (see :meth:`held`)."""
        ws, piece = self.world_size, self.wholes.get(id(t))
        if piece is not None or not t.shape:
            return ws if (piece.numel if piece is not None else 1) else 0
        n = t.shape[0]
        if not n or not math.prod(t.shape[1:]):
            return 0
        size = -(-n // ws)  # (chunk_rows: rank r holds rows while r * size < n)
        return min(ws, -(-n // size))

    def _held_at(self, rank: int) -> array:
        """The indices in ``targets`` of those rank ``rank`` holds elements of, in order (the
        same for the ranks between two levels of the holders' counts: the last kept)."""
        if self._holders is None:  # (the levels first: a thread that finds the counts finds them)
            holders = array("q", [self._holders_of(t) for t in self.targets])
            self._levels = sorted(set(holders))
            self._holders = holders
        level = bisect_right(self._levels, rank)
        last = self._last
        if last is None or last[0] != level:
            last = self._last = (level, array("q", [i for i, n in enumerate(self._holders) if n > rank]))
        return last[1]

    def pieces(self, rank: int) -> tuple[Piece, ...]:
        ws, empty, got = self.world_size, self.empty, []
        targets, how_of = self.targets, self._how
        if empty:
            pairs = zip(targets, how_of)
        else:
            pairs = ((targets[i], how_of[i]) for i in self._held_at(rank))
        for t, how in pairs:
            if how is True:
                n = t.shape[0]
                size = -(-n // ws)  # (chunk_rows, inline: a many-rank plan asks it ~10^5 times)
                start = min(rank * size, n)
                p = _tiled_rows(t, start, min(start + size, n))
            else:
                p = how if how is not None else rows_of(t, ws, rank)
            if empty or p.numel:
                got.append(p)
        if rank == 0:
            got += [whole(t) for t in self.first]
        return tuple(got)

    def nbytes(self, rank: int) -> int:
        """``sum(p.nbytes for p in self.pieces(rank))``, nothing made."""
        total = self._fixed[0] + (self._first_bytes if rank == 0 else 0)
        for (n, row), count in self._rows:
            start, stop = chunk_rows(n, self.world_size, rank)
            total += count * (stop - start) * row
        return total

    def count(self, rank: int) -> int:
        """``len(self.pieces(rank))``, nothing made."""
        first = len(self.first) if rank == 0 else 0
        if self.empty:
            return len(self.targets) + first
        held = self._fixed[1] + first
        for (n, row), count in self._rows:
            start, stop = chunk_rows(n, self.world_size, rank)
            held += count if stop > start and row else 0
        return held

    def held(self, rank: int) -> list[Target]:
        """The targets of ``self.pieces(rank)``, in order, nothing made."""
        first = list(self.first if rank == 0 else ())
        if self.empty:
            return [*self.targets, *first]
        targets = self.targets
        return [targets[i] for i in self._held_at(rank)] + first


class RankPieces(Sequence):
    """Rank ``rank``'s pieces of ``rows`` (:class:`RankRows`), made when first asked for and
    kept, the same objects, until :meth:`forget`. A many-rank plan is a job per rank and kind:
    their pieces made at once, a 1,024-rank reshard's plan held 223k (~17 MB) before a byte
    moved; made as each file is checked and written, a few files' at a time. Compares as the
    tuple of its pieces."""

    __slots__ = ("rows", "rank", "_made")

    def __init__(self, rows: RankRows, rank: int) -> None:
        self.rows, self.rank = rows, rank
        self._made: tuple[Piece, ...] | None = None

    @property
    def nbytes(self) -> int:
        return self.rows.nbytes(self.rank)

    def targets(self) -> list[Target]:
        return self.rows.held(self.rank)

    def made(self) -> tuple[Piece, ...]:
        got = self._made
        if got is None:
            got = self._made = self.rows.pieces(self.rank)
        return got

    def forget(self) -> None:
        self._made = None

    def __len__(self) -> int:
        return self.rows.count(self.rank)

    def __getitem__(self, i):  # type: ignore[override]
        return self.made()[i]

    def __iter__(self) -> Iterator[Piece]:
        return iter(self.made())

    def __eq__(self, other: object) -> bool:
        if isinstance(other, (RankPieces, tuple)):
            return self.made() == tuple(other)
        return NotImplemented

    def __hash__(self) -> int:
        return hash(self.made())

    def __reduce__(self) -> tuple:  # (to a worker process: what it makes them from)
        return (RankPieces, (self.rows, self.rank))


def share_of(n: int, parts: int, i: int) -> range:
    """Part ``i`` of ``parts`` contiguous, near-equal parts of ``range(n)``: the output ranks a
    process of a launch of ``parts`` plans and writes (neighbouring ranks read neighbouring
    source files)."""
    return range(i * n // parts, (i + 1) * n // parts)


def targets_from(tensors: Iterable[TensorInfo], *, dtype: DType | None = None,
                 rename=lambda t: t.name) -> list[Target]:
    """Targets for ``tensors``: renamed by ``rename``, floating-point ones cast to ``dtype``
    (integer, bool and ``step`` tensors keep theirs)."""
    out = []
    for t in tensors:
        cast = dtype is not None and t.dtype.is_floating_point and t.state != "step"
        out.append(Target(t, t.group, rename(t), dtype if cast else t.dtype, t.param, t.state))
    return out


def piece(target: Target, offsets: tuple[int, ...], sizes: tuple[int, ...]) -> Piece:
    """Plan the copies that fill ``offsets``/``sizes`` of ``target`` from its source chunks.

    Identical chunks (replicas on several ranks) are read once, from the first. Only the
    chunks whose rows meet the piece's are looked at (bisection on the tensor's row index). A
    computed target reads its inputs whole (its copies name every chunk, for a reader that fetches them).
    """
    if target.computed is not None:
        reads = [(target.source, c) for c in target.source.chunks]
        reads += [(t, c) for t in target.computed.inputs for c in t.chunks]
        return Piece(target, tuple(offsets), tuple(sizes),
                     tuple(Copy(c, (0,) * len(c.sizes), (0,) * len(c.sizes), c.sizes) for _, c in reads))
    copies = []
    remaining = math.prod(sizes)
    seen = set()
    chunks = target.source.chunks
    if offsets and len(chunks) > 8:
        starts, order, most = target.source.rows_index()
        a, b = offsets[0], offsets[0] + sizes[0]
        near = order[bisect_left(starts, a - most + 1):bisect_left(starts, b)]
        candidates = [chunks[i] for i in sorted(near)]  # in the chunks' order: the first replica wins
    else:
        candidates = chunks
    for c in candidates:
        box = (c.offsets, c.sizes)
        if box in seen or not c.numel:
            continue
        seen.add(box)
        lo = [max(o, co) for o, co in zip(offsets, c.offsets)]
        hi = [min(o + s, co + cs) for o, s, co, cs in zip(offsets, sizes, c.offsets, c.sizes)]
        if any(h <= l for l, h in zip(lo, hi)) and lo:
            continue
        n = tuple(h - l for l, h in zip(lo, hi))
        copies.append(Copy(c, tuple(l - co for l, co in zip(lo, c.offsets)),
                           tuple(l - o for l, o in zip(lo, offsets)), n))
        remaining -= math.prod(n)
        if remaining <= 0:
            break
    if remaining != 0 and math.prod(sizes):
        raise BadInput(f"tensor {target.source.name!r}: the source chunks do not cover rows "
                       f"{offsets}+{sizes}; the checkpoint has a hole")
    return Piece(target, tuple(offsets), tuple(sizes), tuple(copies))


def whole(target: Target) -> Piece:
    shape = target.shape
    if (chunk := _whole_chunk(target)) is not None:
        return _of_whole_chunk(target, chunk, 0, shape[0])
    if shape and target.computed is None and target.source.row_tiles():
        # (a many-rank source's tensor: its chunks met in row order, not each intersected)
        return _tiled_rows(target, 0, shape[0])
    return piece(target, (0,) * len(shape), shape)


def rows_of(target: Target, world_size: int, rank: int) -> Piece:
    """Rank ``rank``'s piece under FSDP2's ``Shard(0)`` at ``world_size`` (0-dim: the whole)."""
    shape = target.shape
    if not shape:
        return whole(target)
    start, stop = chunk_rows(shape[0], world_size, rank)
    if (chunk := _whole_chunk(target)) is not None:
        return _of_whole_chunk(target, chunk, start, stop)
    if target.computed is None and target.source.row_tiles():
        return _tiled_rows(target, start, stop)
    return piece(target, (start, *([0] * (len(shape) - 1))), (stop - start, *shape[1:]))


def _tiles_rows(target: Target) -> bool:
    """Whether :func:`rows_of` makes ``target``'s pieces with :func:`_tiled_rows`."""
    return bool(target.shape) and _whole_chunk(target) is None and target.computed is None \
        and target.source.row_tiles()


def _tiled_rows(target: Target, a: int, b: int) -> Piece:
    """:func:`piece` of rows [a, b) of a target whose source chunks tile its rows
    (:meth:`TensorInfo.row_tiles`): its copies are :data:`TILED`, worked out from the rows when
    read (a many-rank reshard plans one such piece per tensor and rank)."""
    zeros = (0,) * (len(target.shape) - 1)
    # equal offsets and sizes as one tuple each: a many-rank plan's are a few distinct values
    # met hundreds of thousands of times
    shared = sharing()
    offsets, sizes = (a, *zeros), (b - a, *target.shape[1:])
    return Piece(target, shared(offsets, offsets), shared(sizes, sizes), TILED)


class _Tiled:
    """The copies of a piece whose source chunks tile its rows (:meth:`TensorInfo.row_tiles`):
    the chunks from the one holding its first row, each met in one row interval, in the
    chunks' order as :func:`piece` gives them. The piece's own target, offsets and sizes say
    which, so it holds this one mark, not an object of its own: :func:`copies_of` works them
    out each time they are read. A many-rank plan holds one piece per tensor and output rank
    until its file is written; a tuple of ``Copy`` objects was ~230 bytes of each, an object
    holding the piece's source and rows 56 (12 MB of a 1,024-rank reshard's plan)."""

    __slots__ = ()

    def __repr__(self) -> str:
        return "TILED"

    def __reduce__(self) -> str:  # (one mark, in a worker process too)
        return "TILED"


TILED = _Tiled()


def _tiled_copies(source: TensorInfo, offsets: tuple[int, ...], sizes: tuple[int, ...]) -> tuple[Copy, ...]:
    """The copies :data:`TILED` stands for in the piece ``offsets``/``sizes`` of ``source``."""
    n = sizes[0]
    if not n:
        return ()
    a = offsets[0]
    starts, order, _ = source.rows_index()
    j = bisect_right(starts, a) - 1  # (the chunk holding row a: the first starts at row 0)
    stop = bisect_left(starts, a + n, j)
    chunks, zeros = source.chunks, offsets[1:]
    if stop - j == 1:  # (one chunk holds the rows: the piece is its rows from a on)
        return (Copy(chunks[order[j]], (a - starts[j], *zeros), (0, *zeros), sizes),)
    b, rest = a + n, sizes[1:]
    got = []
    for k in range(j, stop):
        c0, i = starts[k], order[k]
        chunk = chunks[i]
        lo, hi = max(a, c0), min(b, c0 + chunk.sizes[0])
        got.append((i, Copy(chunk, (lo - c0, *zeros), (lo - a, *zeros), (hi - lo, *rest))))
    got.sort(key=_first)  # in the chunks' order, as piece() gives them
    return tuple([c for _, c in got])


def copies_of(piece: Piece) -> tuple[Copy, ...]:
    """``piece``'s copies as a tuple (:data:`TILED` ones worked out: each time they are read)."""
    copies = piece.copies
    return copies if copies is not TILED else _tiled_copies(piece.target.source, piece.offsets, piece.sizes)


def _whole_chunk(target: Target) -> Chunk | None:
    """The source's one chunk where ``target`` is that chunk as it is, with elements (see
    :meth:`TensorInfo.whole_chunk`); else None."""
    shape = target.shape
    if not shape or target.computed is not None or 0 in shape:
        return None
    return target.source.whole_chunk()


def _of_whole_chunk(target: Target, chunk: Chunk, a: int, b: int) -> Piece:
    """:func:`_tiled_rows` of a target whose source is ``chunk``, one chunk holding it whole (a
    safetensors file's tensor): rows [a, b) are one copy from that chunk."""
    zeros = (0,) * (len(target.shape) - 1)
    shared = sharing()
    start, size = (a, *zeros), (b - a, *target.shape[1:])
    offsets, sizes = shared(start, start), shared(size, size)
    if a == b:  # (no rows: no copy, as the tiling's walk finds none)
        return Piece(target, offsets, sizes, ())
    dst = (0, *zeros)
    return Piece(target, offsets, sizes, (Copy(chunk, offsets, shared(dst, dst), sizes),))


def _first(pair: tuple) -> Any:
    return pair[0]


def permuted_rows(target: Target, rows, *, rank: int = 0, world_size: int = 1) -> Piece:
    """``target`` with its rows reordered (row ``i`` of the result is row ``rows[i]`` of the
    source), whole or as rank ``rank``'s ``Shard(0)`` rows at ``world_size``. One copy per
    row, so the engine streams it like any piece."""
    shape = target.shape
    if len(rows) != shape[0] or sorted(rows) != list(range(shape[0])):
        raise ValueError(f"{target.name}: {len(rows)} rows is not a permutation of {shape[0]}")
    rest = tuple(shape[1:])
    owner = {}
    for c in target.source.chunks:
        if c.numel and c.sizes[1:] == rest:
            for r in range(c.offsets[0], c.offsets[0] + c.sizes[0]):
                owner.setdefault(r, c)
    if len(owner) != shape[0]:  # chunks that split columns: whole rows are not stored together
        raise BadInput(f"tensor {target.source.name!r}: its chunks do not hold whole rows; cannot reorder them")
    start, stop = chunk_rows(shape[0], world_size, rank)
    zeros = (0,) * len(rest)
    copies = tuple(Copy(owner[src], (src - owner[src].offsets[0], *zeros), (dst - start, *zeros), (1, *rest))
                   for dst, src in enumerate(rows) if start <= dst < stop)
    return Piece(target, (start, *zeros), (stop - start, *rest), copies)


def rename_piece(p: Piece, **changes) -> Piece:
    return replace(p, target=replace(p.target, **changes))


@dataclass(frozen=True)
class Span:
    """A piece whose bytes are, in order, byte ranges ``(file, offset, length)`` of source
    files, to be copied as they are (``os.copy_file_range``: the kernel copies, nothing passes
    through this process)."""

    parts: tuple[tuple[Path, int, int], ...]


def by_piece(stream: Iterator[tuple[Piece, Any]]) -> Callable[[Piece], Any]:
    """``values(piece)`` for a writer that needs the stream's pieces in another order than the
    plan's: pulls the stream forward, holding the pieces it passes until they are asked for."""
    ready: dict = {}

    def values(piece: Piece) -> Any:
        if ready:
            v = ready.pop(piece, ready)
            if v is not ready:
                return v
        while True:  # most often the stream's next piece is the one asked for: nothing is hashed
            got, v = next(stream)
            if got is piece:
                return v
            ready[got] = v
            if piece in ready:
                return ready.pop(piece)

    return values
