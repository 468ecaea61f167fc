"""A many-rank job's rank files read as pickle trees, kind by kind (model, optimizer), for
:mod:`.sharded` to describe: each file's tensors as ``(DTensor or None, local tensor)`` entries.

A job's ranks save one state dict: their files differ in the mesh's rank, and in the local
shapes of tensors some ranks hold fewer rows of. Each kind's first file is parsed; a later file
that is the first with its own rank and its own rows (:class:`~.rankrows.RowsTemplate`, learned
from the first file once a file of its shape comes) is read, checked and described from the
first's entries, never parsed. Where that template cannot be learned, the next file is parsed
too; where the two differ only in their rank (:class:`~.shardtree.RankTemplate`), a later file
that is the first on its own rank is read from the first the same way. The ranks at the end
that hold fewer rows do the same among themselves.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

from ..core.describe import Chunk, chunk_rows, shared
from ..errors import BadInput
from ..security import bounded
from ..security.torchfile import TorchZip
from . import optim, rankrows, shardtree


def tree_of(file: Path, like: list | None = None, repeats: Callable | None = None) -> TorchZip:
    """The file parsed as a pickle tree (``like``, ``repeats``: to describe it only, read like the
    job's other files, see :func:`.shardtree.described`); anything the tree reader refuses or
    finds damaged goes to the torch path, which is the one that refuses (weights_only) and
    explains."""
    try:
        return shardtree.parsed(file) if like is None else shardtree.described(file, like, repeats)
    except bounded.HostileTree:
        raise  # torch's loader would build the same runaway tree
    except BadInput as e:
        raise shardtree.NotSimple(str(e)) from e


class Base:
    """A file other ranks' files may repeat and, once learned from the next file (``second``),
    the template they repeat it by; ``table``: what the describer noted of its entries to place
    them on another rank (dropped with the base). Its tree is not kept: the describer has its
    entries, and learning needs its pickle only (a 25k-tensor job's trees are ~50 MB each)."""

    def __init__(self, zf: TorchZip, rank: int) -> None:
        self.zf, self.rank = zf, rank
        self.table: list = []
        self.second: tuple[bytes, int] | None = None
        self.template: shardtree.RankTemplate | None = None
        self.tried = False
        self.rows: rankrows.RowsTemplate | None = None  # (learned from the first file of its shape)
        self.rows_tried = False


class Kind:
    """One kind's rank files as :mod:`.sharded` reads them, rank by rank, and the files the
    others repeat (:class:`Base`). A parsed file that repeats none becomes one, and the next
    parsed file its ``second``; the template is learned from the two once a later file's pickle
    has the second's length (not before: where every rank differs, as when tensors' rows do not
    divide evenly, no file would use it). Ranks at the end that hold fewer rows than the others
    repeat one of their own. A base that learned nothing (or whose group was not worth it:
    :meth:`_worth_learning`) is dropped for the next; at most ``MAX_BASES`` are kept (each
    holds its pickle and table)."""

    MAX_BASES = 4
    # a base past the first is learned only while this many files of the kind are left to
    # repeat it: learning parses a pickle once more (at 25k tensors, a transient tree of ~100 MB
    # on top of a description near its largest), which pays over several files only
    LEFT_TO_LEARN = 8

    def __init__(self, files: int) -> None:
        self.files = files  # of this kind, ranks 0 .. files - 1
        self.like: list = []
        self.bases: list[Base] = []
        self._hit: Base | None = None
        # the last file read as a base's: its local sizes and bytes where they differ, by table row
        self.rows: dict[int, tuple[tuple[int, ...], int]] = {}

    def read(self, file: Path, rank: int, entries_of: Callable[[Any], list]
             ) -> tuple[TorchZip, list, int | None, Base | None]:
        """``file`` (of ``rank``), its entries, their DTensors' coordinate where it is not theirs,
        and the base they are:
        - a file that repeats a base: no entries (the base's ``table`` places them), ``rank``
          and the base;
        - a file parsed that became a base: its own entries (``entries_of`` its tree), None and
          that base;
        - any other file parsed: its own entries, None, None."""
        repeats = (lambda data: self._repeats(data, rank, entries_of)) if self.bases else None
        zf = tree_of(file, self.like, repeats)
        if zf.tree is None:
            return zf, [], rank, self._hit
        entries = entries_of(zf.tree)
        last = self.bases[-1] if self.bases else None
        if last is not None and last.template is None:
            if last.second is None and not last.tried:
                last.second = (zf.pickle, rank)
                return zf, entries, None, None
            self.bases.pop()  # it learned nothing, or its second's length never came again
        if len(self.bases) >= self.MAX_BASES:
            return zf, entries, None, None
        self.bases.append(base := Base(zf.without_tree(), rank))
        return zf, entries, None, base

    def _repeats(self, data: bytes, rank: int, entries_of: Callable[[Any], list]) -> TorchZip | None:
        """The base file ``data`` is the pickle of on ``rank`` (the latest first), if any: with
        only its rank changed, or its rows too (:class:`~.rankrows.RowsTemplate`, learned from
        the first file like it; then ``rows`` are its local sizes that differ)."""
        self.rows = {}
        for base in reversed(self.bases):
            if base.template is None and base.second is not None and not base.tried \
                    and len(data) == len(base.second[0]):
                base.tried = True
                if self._worth_learning(base, data, rank):
                    base.template = shardtree.RankTemplate.learn(base.zf, base.rank, *base.second)
                base.second = None
            if base.template is not None and data == base.template.pickle_of(rank):
                self._hit = base
                return base.zf
        for base in reversed(self.bases):
            if not base.rows_tried and (base.rank == 0 or self.files - rank >= self.LEFT_TO_LEARN) \
                    and base.zf.shape().skeleton().same_shape(data):
                base.rows_tried = True
                base.rows = rankrows.RowsTemplate.learn(base.zf, base.rank, base.table, entries_of)
            got = base.rows.read(data, rank, base.table) if base.rows is not None else None
            if got is not None:
                self._hit, self.rows = base, got[1]
                light = base.zf.without_tree()
                light.storages = got[0]
                return light
        return None

    def _worth_learning(self, base: Base, data: bytes, rank: int) -> bool:
        """Whether ``base``'s template is worth learning as ``data`` (rank ``rank``'s pickle)
        comes: it is like the base's second (the group repeats), and the base is the kind's
        first file or enough files are left."""
        return _alike(data, base.second[0]) and (base.rank == 0 or self.files - rank >= self.LEFT_TO_LEARN)


_FEW_BITS = 256  # a rank's ints in a few places: what one rank's pickle changes in the next's


def _alike(a: bytes, b: bytes) -> bool:
    """Whether two pickles of one length differ in a few bits only, as two ranks' files of a
    group that repeats differ in their rank: worth learning a template from (learning parses a
    pickle: at 25k tensors, a transient tree of ~100 MB)."""
    return (int.from_bytes(a, "little") ^ int.from_bytes(b, "little")).bit_count() <= _FEW_BITS


def repeat(table: list, rank: int, ws: int, zf: TorchZip, file: str,
           resized: dict[int, tuple[tuple[int, ...], int]] | None = None) -> None:
    """The chunks of ``file``, which repeats a base file of its kind on ``rank`` (see
    :class:`Kind`): each chunk of the base's ``table`` on the rows ``rank`` holds, at its own
    record's place in ``file``; ``resized``: its local sizes and their bytes, by row of the
    table, where they differ from the base's. A row of the table, as :mod:`.sharded` notes it:
    the tensor's chunk columns (added to: :class:`~ckpt_tools.core.describe.ChunkColumns`), its
    rows where it is a ``Shard(0)`` DTensor's (else None), its name, the base's chunk, its
    record's name and its byte offset in that record."""
    offset = zf.records.offset
    placed: dict = {}  # (rows, the base's sizes and offsets) -> this rank's offsets: checked once, shared
    resized = resized or {}
    for n, (chunks, rows, name, chunk, record, delta) in enumerate(table):
        offsets, sizes, length = chunk.offsets, chunk.sizes, chunk.length
        if n in resized:
            sizes, length = resized[n]
        if rows is not None:
            key = (rows, sizes, offsets)
            mine = placed.get(key)
            if mine is None:
                start, stop = chunk_rows(rows, ws, rank)
                if stop - start != sizes[0]:
                    raise BadInput(f"{zf.path}: tensor {name!r}: rank {rank} holds {sizes}, but its placement "
                                   f"on world size {ws} gives {(stop - start, *sizes[1:])}")
                mine = placed[key] = (start, *offsets[1:])
            offsets = mine
        at = offset(record) + delta if delta else offset(record)
        chunks.add(offsets, sizes, file, "raw", at, length, chunk.key, rank)


def tree_chunk(d: shardtree.DTensorNode, rank: int, ws: int, zf: TorchZip, file: str, name: str,
               key: tuple = ()) -> tuple[tuple[int, ...], Chunk]:
    """``d``'s global shape and the chunk ``rank`` holds, checked against its placement."""
    if d.world != ws:
        raise BadInput(f"{zf.path}: tensor {name!r} lives on a mesh of {d.world} devices, "
                       f"but the files say world size {ws}")
    if d.coord != rank:
        raise BadInput(f"{zf.path}: tensor {name!r} was saved by rank {d.coord} of its mesh, not rank {rank}")
    offsets, sizes = [0] * len(d.shape), list(d.shape)
    if d.sharded and d.shape:
        start, stop = chunk_rows(d.shape[0], ws, rank)
        offsets[0], sizes[0] = start, stop - start
    if d.local.size != tuple(sizes):
        raise BadInput(f"{zf.path}: tensor {name!r}: rank {rank} holds {d.local.size}, but its placement "
                       f"on world size {ws} gives {tuple(sizes)}")
    loc = shardtree.tensor_location(zf, file, d.local, key or shared((name,)))
    return d.shape, Chunk(shared(tuple(offsets)), shared(tuple(sizes)), loc, rank)


def model_entries(sd: Any, file: Path) -> list[tuple[str, shardtree.DTensorNode | None, shardtree.Local]]:
    """A model file's tensors: ``(key, DTensor or None, local tensor)``."""
    if not isinstance(sd, dict):
        raise BadInput(f"{file}: holds a {type(sd).__name__}, not a state dict")
    return [(key, *_tensor(v, "a model entry")) for key, v in sd.items()]


def optim_entries(osd: Any, param_order: tuple[str, ...]) -> list[tuple]:
    """An optimizer file's state tensors: ``(name, fqn, state key, key path, DTensor or None,
    local tensor)``."""
    return [(f"state.{fqn}.{skey}", fqn, skey, kp, *_tensor(v, "an optimizer state value"))
            for fqn, skey, v, kp in optim.state_entries(osd, param_order)]


def _tensor(v: Any, what: str) -> tuple[shardtree.DTensorNode | None, shardtree.Local]:
    """The DTensor a node stands for (or None) and its local tensor; NotSimple for no tensor."""
    d = shardtree.dtensor_of(v)
    local = d.local if d is not None else shardtree.local_of(v)
    if local is None:
        raise shardtree.NotSimple(f"{what} that is not a tensor")
    return d, local
