"""Destination rank files of one kind (model, optimizer) whose pickles differ only in ints: the
first file's tree built whole, the next files' pickles that one's with those ints replaced.

Every destination file of a kind is one tree with its tensor nodes built for its rank: the
same nodes in the same order, only the rank and the local sizes differ. So the first file's
tree is built whole (:meth:`Patched.tree`), and what it did is kept as a recipe: which entry of
the plan each tensor takes, in pickling order. The next files replay the recipe
(:meth:`Patched.emitter`: the storages and :class:`~..codecs.torchpickler.Slot` values, no
tree) and their pickle is the last one with the slot values replaced
(:func:`~..codecs.torchpickler.patch`); a value that needs another opcode has its tree built
and written whole. :class:`Rebuilt` builds the tree from a source rank-0 file's;
:class:`~.shardsynth.Synthesized` from the plan alone.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from ..codecs.tensornodes import NotSimple, local_of
from ..codecs.torchpickler import dumps, patch, patched_places, slot_places
from ..security import bounded
from ..security.torchfile import TorchZip
from . import shardtree

_MESH = "mesh"


class Patched:
    """One kind's destination files, the first built whole and the next patched (see the
    module's docstring). A subclass builds a file's tree with the recipe that built it
    (:meth:`tree`) and replays a recipe for another file (:meth:`_replay`). The recipe is kept
    with the pickle it built (``_last``): a file is only ever patched from a pickle of the
    recipe it replayed."""

    template: TorchZip | None = None  # the source file the trees are rebuilt from, if any

    def __init__(self, world: int) -> None:
        self.world = world
        # the pickle the next files patch: (bytes, its slots' places, local sizes, its tree's recipe)
        self._last: tuple | None = None
        self._first: tuple | None = None  # (job, pickle, emitter) the dry run wrote whole, until written

    def tree(self, job: Any) -> tuple[Any, shardtree.Emitter, Any]:
        """``job``'s tree, built whole, the storages that fill it (their local sizes noted, as a
        replay notes them) and the recipe that built it."""
        raise NotImplementedError

    def _replay(self, job: Any, recipe: Any, emitter: shardtree.Emitter | None,
                storage: Callable[[tuple[int, ...], Any], None] | None) -> bool:
        """``recipe`` replayed for ``job``: ``storage(local sizes, source)`` for each storage in
        pickling order and ``emitter.rank`` for its mesh (None: a check only, nothing called).
        False where ``job``'s tree is not the recipe's shape (then it is built whole), NotSimple
        where no tree can be built for it."""
        raise NotImplementedError

    def emitter(self, job: Any, *, check: bool = False, since: list | None = None) -> shardtree.Emitter | None:
        """The storages and slot values ``job``'s tree would have, from the recipe (no tree);
        ``check``: only whether it can be built (NotSimple if not), nothing kept but for the
        kind's first file, whose tree this builds: it is pickled and kept for its write. ``since``: the
        local sizes, entry by entry, of a file whose slot values are known: an entry of the same
        sizes gets its storage and no slots (its values are that file's). The emitter's
        ``sizes`` are this file's. None (not ``check``) where ``job`` is not of the recipe's shape."""
        if self._last is None:  # the first file: built, so pickled now and kept for its write
            data, emitter = self._whole(job)
            self._first = (job, data, emitter)
            return emitter
        recipe = self._last[3]
        if check:
            if not self._replay(job, recipe, None, None):
                self.tree(job)  # (raises NotSimple where no tree can be built)
            return None
        emitter = shardtree.Emitter()
        sizes = emitter.sizes

        def storage(size: tuple[int, ...], source: Any) -> None:
            if since is not None and since[len(sizes)] == size:
                emitter.record(source)
            else:
                emitter.account(size, source)
            sizes.append(size)

        return emitter if self._replay(job, recipe, emitter, storage) else None

    def pickle(self, job: Any) -> tuple[bytes, shardtree.Emitter]:
        """``job``'s pickle and storages: the last pickle written whole, patched where its
        tensors' local sizes and its rank differ, when every value keeps its opcode; else its
        tree written whole."""
        first = self._first
        if first is not None and first[0] is job:
            self._first = None
            return first[1], first[2]
        if self._last is not None:
            data, places, sizes, recipe = self._last
            emitter = self.emitter(job, since=sizes)
            patched = None if emitter is None else patch(data, places, emitter.slots)
            if patched is not None:
                if len(patched) != len(data):  # ints of other widths: the files after patch from this one
                    self._last = (patched, patched_places(places, emitter.slots), emitter.sizes, recipe)
                return patched, emitter
        return self._whole(job)

    def _whole(self, job: Any) -> tuple[bytes, shardtree.Emitter]:
        """``job``'s tree built and pickled whole; its pickle (with its storages' sizes and its
        recipe) kept as the one the next files patch."""
        with bounded.gc_paused():  # (a tree of many small objects and no cycles)
            tree, emitter, recipe = self.tree(job)
            where: list = []
            data = dumps(tree, where)
        self._last = (data, slot_places(where), emitter.sizes, recipe)
        return data, emitter


class Rebuilt(Patched):
    """The destination files of one kind, built from ``template`` (the source's rank-0 file of
    that kind) for ``world`` ranks."""

    def __init__(self, template: TorchZip, world: int) -> None:
        super().__init__(world)
        self.template = template
        self._dtensors: dict[int, tuple[Any, Any]] = {}  # id(template node) -> (node, dtensor_of)
        self._keys: dict[int, tuple] = {}  # id(target) -> (target, its source's key, dtype kept)
        self._order_of: tuple | None = None  # the last (recipe, targets, their order) replayed

    def _dtensor(self, node: Any) -> shardtree.DTensorNode | None:
        got = self._dtensors.get(id(node))
        if got is None or got[0] is not node:
            got = self._dtensors[id(node)] = (node, shardtree.dtensor_of(node))
        return got[1]

    def _pieces(self, job: Any) -> dict:
        """``job``'s pieces by their source's key in the template's tree."""
        keys = self._keys
        by_key = {}
        for p in job.pieces:
            t = p.target
            known = keys.get(id(t))
            if known is None or known[0] is not t:  # each target once: every rank's pieces share it
                known = keys[id(t)] = (t, t.source.chunks[0].location.key if t.source.chunks else None,
                                       t.dtype == t.source.dtype)
            if known[1] is None or not known[2]:
                raise NotSimple("pieces that are not the source's tensors as they are")
            by_key[known[1]] = p
        if len(by_key) != len(job.pieces):
            raise NotSimple("pieces that are not the source's tensors as they are")
        return by_key

    def tree(self, job: Any) -> tuple[Any, shardtree.Emitter, list]:
        emitter, by_key, recipe = shardtree.Emitter(), self._pieces(job), []
        sizes = emitter.sizes
        mesh = None

        def rebuild(key: tuple, node: Any) -> Any:
            nonlocal mesh
            p = _take(by_key, key)
            d = self._dtensor(node)
            recipe.append((key, d))
            sizes.append(p.sizes)
            if d is None:
                _whole(p)
                return emitter.local(local_of(node), p.sizes, p)
            if not d.sharded:
                raise NotSimple("a replicated DTensor")
            local = emitter.local(d.local, p.sizes, p)  # numbered before the mesh, as pickling visits them
            if mesh is None:
                mesh = shardtree.rebuild_mesh(d.mesh, emitter, self.world, job.rank)
                recipe.append((_MESH, emitter.records[-1][1]))
                sizes.append((self.world,))
            return shardtree.rebuild_dtensor(d, local, mesh)

        tree = shardtree.map_tensors(self.template.tree, rebuild)
        if by_key:
            raise NotSimple("pieces the source file does not hold")
        return tree, emitter, recipe

    def _order(self, job: Any, recipe: list) -> tuple[list, list]:
        """``job``'s targets and the place in them of each ``recipe`` entry's piece (None: the
        mesh). Worked out by the pieces' keys for the first job of a sequence of targets, then
        for the next jobs of that sequence (every rank's file of a kind) by comparing their
        targets with it at C speed, no piece made: a 256-rank reshard's dry run made and keyed
        every file's pieces, 168k, to check each (~0.4 s of its serial part)."""
        targets = job.targets()
        known = self._order_of
        if known is not None and known[0] is recipe and known[1] == targets:
            return targets, known[2]
        pieces = job.pieces
        at = {id(p): i for i, p in enumerate(pieces)}
        by_key = self._pieces(job)
        order = [None if key is _MESH else at[id(_take(by_key, key))] for key, _ in recipe]
        if by_key:
            raise NotSimple("pieces the source file does not hold")
        made = [p.target for p in pieces]
        if made == targets:  # (the targets a job names are its pieces': kept only where they are)
            self._order_of = (recipe, targets, order)
        return made, order

    def _replay(self, job: Any, recipe: list, emitter: shardtree.Emitter | None,
                storage: Callable[[tuple[int, ...], Any], None] | None) -> bool:
        targets, order = self._order(job, recipe)
        pieces = job.pieces if storage is not None else None
        for (key, d), i in zip(recipe, order):
            if i is None:  # rebuild_mesh's storage and slots
                if storage is not None:
                    storage((self.world,), d)
                    emitter.rank(job.rank)
                continue
            p = pieces[i] if pieces is not None else None
            if d is None and (p is not None or targets[i].shape):  # (a 0-d tensor's piece is whole)
                _whole(p if p is not None else job.pieces[i])
            if p is not None:
                storage(p.sizes, p)
        return True


def _take(by_key: dict, key: tuple) -> Any:
    p = by_key.pop(key, None)
    if p is None:
        raise NotSimple(f"no piece for {key}")
    return p


def _whole(p: Any) -> None:
    if p.sizes != p.target.shape:
        raise NotSimple("rows of a tensor its source holds whole on every rank")

