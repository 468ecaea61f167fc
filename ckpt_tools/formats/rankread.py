"""A many-rank job's rank files read as pickle trees, kind by kind (model, optimizer), for
:mod:`.sharded` to describe: each file's tensors as ``(DTensor or None, local tensor)`` entries.

A job's ranks save one state dict: their files differ in the mesh's rank, and in the local
shapes of tensors some ranks hold fewer rows of. Each kind's first two files are parsed; where
they differ only in that rank (:class:`~.shardtree.RankTemplate`), a later file that is the
first on its own rank is read, checked and described from the first's entries, never parsed.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

from ..errors import BadInput
from ..security import bounded
from ..security.torchfile import TorchZip
from . import optim, shardtree


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


class Kind:
    """One kind's rank files as :mod:`.sharded` reads them, rank by rank: its first file's
    entries, and the template the other ranks' files repeat. That is learned from the first two
    files once a third file's pickle has the second's length (not before: where every rank
    differs, as when tensors' rows do not divide evenly, no file would use it)."""

    def __init__(self) -> None:
        self.like: list = []
        self.first: tuple[TorchZip, int, list] | None = None
        self.second: tuple[bytes, int] | None = None
        self.template: shardtree.RankTemplate | None = None
        self.tried = False

    def read(self, file: Path, rank: int, entries_of: Callable[[Any], list]) -> tuple[TorchZip, list, int | None]:
        """``file`` (of ``rank``), its entries and their DTensors' coordinate where it is not
        theirs: the first file's entries and ``rank`` where the file repeats the first (their
        DTensors say the first's coordinate), else its own (``entries_of`` its tree) and None."""
        repeats = (lambda data: self._repeats(data, rank)) if self.second or self.template else None
        zf = tree_of(file, self.like, repeats)
        if zf.tree is None:
            return zf, self.first[2], rank
        entries = entries_of(zf.tree)
        if self.first is None:
            self.first = (zf, rank, entries)
        elif self.second is None and not self.tried:
            self.second = (zf.pickle, rank)
        return zf, entries, None

    def _repeats(self, data: bytes, rank: int) -> TorchZip | None:
        """The first file, if ``data`` is its pickle on ``rank``."""
        if not self.tried and len(data) == len(self.second[0]):
            self.tried = True
            self.template = shardtree.RankTemplate.learn(self.first[0], self.first[1], *self.second)
            self.second = None
        if self.template is not None and data == self.template.pickle_of(rank):
            return self.first[0]
        return None


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
