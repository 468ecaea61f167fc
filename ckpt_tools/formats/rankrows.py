"""A job's rank files read as one file's with other ranks and other rows: the case where
tensors' rows do not divide evenly among the ranks (tens of thousands of small tensors, say), so
that hardly two ranks hold the same local sizes and no file repeats another's pickle with only
its rank changed (:class:`~.shardtree.RankTemplate`).

torch pickles a ``Shard(0)`` DTensor's local tensor with its storage's key, element count
(numel), offset and local sizes as ints in a fixed order after the key, and the mesh's rank after
its field's name. :class:`RowsTemplate` finds those places in a parsed file's pickle and proves
them (:meth:`RowsTemplate.learn`): the pickle with a distinct sentinel in each, read back, must
give each tensor its own sentinels as its first local size and its storage's numel, and the mesh
the rank's (and nothing else that one). A later file whose pickle is that one with ints changed
in those places only (:meth:`RowsTemplate.read`) is the parsed file on its own rank with those
rows and storages: it is described from the parsed file's entries (:func:`.rankread.repeat`),
its rows checked against its rank's placement and its storages against its records, never
parsed.
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Callable
from typing import Any

from ..core.describe import shared
from ..errors import BadInput
from ..security.skeleton import first_difference, int_at, int_value, with_ints
from ..security.torchfile import STORAGE_ITEMSIZE, StorageRef, TorchZip, loads_like
from . import shardtree

_RANK, _ROWS, _NUMEL = 0, 1, 2
# sentinels no real pickle holds in those places: a rank, a tensor's rows (+ its index), a
# storage's numel (+ its index); rows times a row's elements stay under a numel's
_RANK_SENTINEL = (1 << 62) + 0x5EED
_ROWS_SENTINEL = 1 << 36
_NUMEL_SENTINEL = 1 << 61


class RowsTemplate:
    """Where the pickle of ``zf`` (a parsed file) holds its rank (``ranks``: opcode starts) and,
    for each row of its describer's ``table`` that is a ``Shard(0)`` tensor alone on its
    storage, its first local size and its storage's numel (``places``: opcode start ->
    ``(what, row)``). ``row_elements``: a row's elements past the first dimension, by row."""

    def __init__(self, zf: TorchZip, ranks: tuple[int, ...], places: dict[int, tuple[int, int]],
                 row_elements: dict[int, int]) -> None:
        self.zf, self.ranks, self.places, self.row_elements = zf, ranks, places, row_elements
        self.order = sorted((start, _int_end_of(zf.pickle, start)) for start in (*ranks, *places))
        self.starts = [start for start, _ in self.order]
        # the last file read: its pickle, where its rank is, what it read as (the ranks of a
        # group holding the same rows differ from it in their rank only)
        self._last: tuple[bytes, list[tuple[int, int]], tuple] | None = None

    @classmethod
    def learn(cls, zf: TorchZip, rank: int, table: list, entries_of: Callable[[Any], list]) -> RowsTemplate | None:
        """The template of ``zf`` (rank ``rank``, a file parsed; only its pickle and storages are
        used) and ``table`` (its entries as :mod:`.sharded` noted them, in order), proved by
        reading its pickle back with sentinels in the places found (``entries_of``: that tree's
        entries, ``(..., DTensor or None, local tensor)`` each); None where a place is not found
        or not proved."""
        skeleton = zf.shape().skeleton()
        strings = skeleton.strings()
        ranks = [_int_after(skeleton, zf.pickle, strings.get(name, []), rank)
                 for name in (b"_rank", b"_coordinate_on_dim")]
        if None in ranks:
            return None
        places: dict[int, tuple[int, int]] = {}
        row_elements: dict[int, int] = {}
        for row, (_, rows, _, chunk, record, delta) in enumerate(table):
            ref = zf.storages.get(record[5:])
            at = strings.get(record[5:].encode(), []) if rows is not None and not delta and ref is not None else []
            found = _tensor_ints(skeleton, zf.pickle, at, ref, chunk.sizes)
            if found is not None:
                places[found[0]], places[found[1]] = (_NUMEL, row), (_ROWS, row)
                row_elements[row] = math.prod(chunk.sizes[1:])
        sentinels = {start: _RANK_SENTINEL for start in ranks}
        sentinels.update({start: (_ROWS_SENTINEL if what == _ROWS else _NUMEL_SENTINEL) + row
                          for start, (what, row) in places.items()})
        try:
            ints = ((start, _int_end_of(zf.pickle, start), sentinels[start]) for start in sorted(sentinels))
            probe = loads_like(with_ints(zf.pickle, ints), zf.shape(), where=str(zf.path))
            proved = shardtree.only_mesh_rank(probe, _RANK_SENTINEL) and _rows_proved(entries_of(probe), table, places)
            del probe  # (before the template's own tables: none of them amid the probe's freed nodes)
        except (BadInput, shardtree.NotSimple, TypeError, ValueError, KeyError, IndexError, AttributeError):
            return None  # (what the probe's reader refuses: the files are parsed one by one)
        return cls(zf, tuple(ranks), places, row_elements) if proved else None

    def read(self, data: bytes, rank: int, table: list
             ) -> tuple[dict[str, StorageRef], dict[int, tuple[int, int]]] | None:
        """If ``data`` (the pickle of ``rank``'s file) is this template's with the rank changed
        to ``rank`` and rows and storages' numels changed only where learned: its storages and,
        by row of ``table``, its local sizes where they differ (and their bytes); else None.
        Each tensor's rows must fit its storage, as the tree reader checks; the caller checks
        them against the rank's placement, and the storages against the file's records.

        ``data`` is compared with the template's pickle in step, at C speed up to each
        difference, which must fall in a place: any int opcode there (the width its value
        needs), and byte-equal from its end. Where the places after it differ too (most
        tensors' rows, in a job of many small tensors), they are read one after the other."""
        last = self._last
        if last is not None and data == with_ints(last[0], ((start, end, rank) for start, end in last[1])):
            return last[2]  # the last file read on another rank: the same rows, storages
        model, order, places = self.zf.pickle, self.order, self.places
        rows: dict[int, int] = {}
        numels: dict[int, int] = {}
        ranks, at_ranks = 0, []
        i = j = 0
        while (k := first_difference(model, i, data, j)) is not None:
            n = bisect.bisect_right(self.starts, i + k) - 1
            if n < 0 or i + k >= order[n][1]:
                return None  # not within a place
            while True:  # place n differs
                start, end = order[n]
                got = int_at(data, j + start - i)
                if got is None:
                    return None
                place = places.get(start)
                if place is None:  # (the rank's)
                    if got[0] != rank:
                        return None
                    ranks += 1
                    at_ranks.append((j + start - i, got[1]))
                else:
                    (rows if place[0] == _ROWS else numels)[place[1]] = got[0]
                i, j, n = end, got[1], n + 1
                if n == len(order):
                    break
                start, end = order[n]
                at = j + start - i
                if data[j:at] != model[i:start] or data[at:at + end - start] == model[start:end]:
                    break  # (a difference before it, found and refused above; or it is the same)
        if ranks != len(self.ranks):
            return None  # (a file of the template's own rank)
        storages = dict(self.zf.storages) if numels else self.zf.storages
        for row in rows.keys() | numels.keys():
            ref = storages[table[row][4][5:]]
            elements = rows.get(row, table[row][3].sizes[0]) * self.row_elements[row]
            numel = numels.get(row, ref.numel)
            if numel < 0 or elements > numel:
                return None
            if row in numels:
                storages[ref.key] = StorageRef(ref.type, ref.key, ref.location, numel)
            if row in rows:
                sizes = table[row][3].sizes
                rows[row] = (shared((rows[row], *sizes[1:])), elements * STORAGE_ITEMSIZE[ref.type.name])
        self._last = (data, at_ranks, (storages, rows))
        return self._last[2]


def _int_after(skeleton, pickle: bytes, names: list[int], value: int) -> int | None:
    """The start of the value opcode after the one of the ``names``-th values (a field's name)
    that the int ``value`` follows, if exactly one is."""
    found = [at[0] for n in names if (at := skeleton.value_at(n + 1)) is not None and int_value(pickle, *at) == value]
    return found[0] if len(found) == 1 else None


def _tensor_ints(skeleton, pickle: bytes, keys: list[int], ref: StorageRef | None,
                 sizes: tuple[int, ...]) -> tuple[int, int] | None:
    """The starts of the numel and first local size of the tensor whose storage key is one of
    the ``keys``-th values (its location string may come between): ``('storage', type, key,
    location, numel)``, then offset and sizes, as torch pickles a tensor; those of the one
    key the values ``ref``'s numel, 0 and ``sizes[0]`` follow, if exactly one is."""
    found = []
    for n in keys if sizes else ():
        got = [skeleton.value_at(n + k) for k in (1, 2, 3, 4)]  # (one more: past a location string)
        if None not in got[:3] and int_value(pickle, *got[0]) is None:  # the location's string
            got = got[1:]
        if None not in got[:3] and [int_value(pickle, *at) for at in got[:3]] == [ref.numel, 0, sizes[0]]:
            found.append((got[0][0], got[2][0]))
    return found[0] if len(found) == 1 else None


def _int_end_of(pickle: bytes, start: int) -> int:
    """Where the int opcode at ``start`` (one this module found) ends."""
    return int_at(pickle, start)[1]


def _rows_proved(entries: list, table: list, places: dict[int, tuple[int, int]]) -> bool:
    """Whether the probe's ``entries`` are ``table``'s, in order, on the same storages, each
    learned row with its own sentinels as its first local size and its storage's numel (at
    offset 0, Shard(0)), and no other with any sentinel there."""
    learned = {row for what, row in places.values()}
    if len(entries) != len(table):
        return False
    for row, (entry, noted) in enumerate(zip(entries, table)):
        d, local = entry[-2], entry[-1]
        if f"data/{local.storage.key}" != noted[4]:
            return False
        if row in learned:
            if not (d is not None and d.sharded and local.offset == 0 and local.size[0] == _ROWS_SENTINEL + row
                    and local.storage.numel == _NUMEL_SENTINEL + row):
                return False
        elif (local.size and local.size[0] >= _ROWS_SENTINEL) or local.storage.numel >= _ROWS_SENTINEL:
            return False
    return True
