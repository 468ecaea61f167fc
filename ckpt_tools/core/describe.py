"""What a checkpoint holds, described from headers and metadata alone.

A :class:`Checkpoint` lists every logical (unsharded) tensor with its global shape and dtype,
and, for each tensor, the chunks that store it: which rectangle of the global tensor a chunk
covers and where its bytes live. Plans are computed from two descriptions; no tensor data is
needed until the engine carries a plan out.
"""

from __future__ import annotations

import math
from array import array
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field, replace
from functools import cached_property
from pathlib import Path
from typing import Any

# (the chunk types, named here too: where a description's parts have always been imported from)
from .chunks import (TABLE_MIN, Chunk, ChunkColumns, ChunkTable, Coded, Location, Palette, Repeated,  # noqa: F401
                     TableColumns, columns, extents, files_of, holders, in_order, layout_key)
from .dtypes import DType
from .groups import Roots
from ..errors import BadInput

GROUPS = ("model", "optimizer", "extra")


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

    def __post_init__(self) -> None:
        # the caches of rows_index and row_tiles, in its dict from the start: set later, they
        # turned the dict CPython shares the keys of into one of its own (464 bytes against
        # 152: ~8 MB at 25k tensors)
        object.__setattr__(self, "_rows_index", None)
        object.__setattr__(self, "_row_tiles", None)

    def __hash__(self) -> int:
        # not the chunks: a tensor of a 1,024-rank save has 1,024 of them, and plans hash
        # pieces (hence their tensors) per entry; equal tensors still hash equal
        return hash((self.group, self.name, self.shape))

    def __getstate__(self) -> dict:
        # (for --workers: not the row index, arrays the hand-over does not take; made again there)
        state = self.__dict__
        return {k: v for k, v in state.items() if k != "_rows_index"} if state.get("_rows_index") is not None else state

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
            got = (array("q", [o for o, _ in live]), in_order(array("q", [i for _, i in live])), most)
            object.__setattr__(self, "_rows_index", got)
        return got

    def row_tiles(self) -> bool:
        """Whether the chunks with elements tile the rows: whole rows each (every column), no
        two meeting, none missing. Then rows [a, b) are in the chunks from the one holding row
        ``a`` on, in row order (a ``Shard(0)`` save; not replicas). Found once."""
        got = self.__dict__.get("_row_tiles")
        if got is None:
            starts, order, _ = self.rows_index()
            offsets, sizes = map(list, columns(self.chunks))  # (indexed below: a table's codes read once)
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
    # a chunk layout (a shape, its chunks' offsets and sizes) -> its rows index, whether its rows
    # tile and whether it is _tiled: found once for the tensors of that layout (a model's are a
    # few: at 25k tensors on 16 ranks, 0.4 s of an inspect), the index's arrays shared by them
    layouts: dict[tuple, tuple] = {}
    for t in ckpt.tensors:
        if t.whole_chunk() is not None or _tiled_like(t, layouts):
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


def _tiled_like(t: TensorInfo, layouts: dict[tuple, tuple]) -> bool:
    """:func:`_tiled`, from ``layouts`` where a tensor of ``t``'s layout was seen (its rows index
    and tiling then ``t``'s too, as :meth:`TensorInfo.rows_index` and ``row_tiles`` would find
    them: they read only the shape and the chunks' offsets and sizes); else found and noted."""
    key = layout_key(t.chunks)
    if key is None:
        return _tiled(t)
    key = (t.shape, key)
    got = layouts.get(key)
    if got is None:  # (its table kept: the key names its values by id)
        got = layouts[key] = (t.chunks, t.rows_index(), t.row_tiles(), _tiled(t))
    else:
        object.__setattr__(t, "_rows_index", got[1])
        object.__setattr__(t, "_row_tiles", got[2])
    return got[3]


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
