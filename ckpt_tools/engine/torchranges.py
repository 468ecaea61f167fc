"""Which bytes of a ``torch.save`` file one value in it uses: the storage records its tensors
rebuild from, found by walking the file's pickle with ckpt's restricted reader (nothing is
imported or constructed). What a remote stand-in must hold for torch's loader to read that value
(the pickle and zip records are fetched when the file is described)."""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

Range = tuple[Path, int, int]


class TorchRanges:
    """Byte ranges of values of the ``torch.save`` files under ``base`` (each file parsed once)."""

    def __init__(self, base: Path) -> None:
        self.base = base
        self._zips: dict[str, Any] = {}
        self._lock = threading.Lock()

    def local(self, file: str, key: tuple[Any, ...]):
        """``(absolute offset, plain tensor node)`` of the contiguous tensor stored at ``key`` of
        ``file`` (its storage record's bytes from the tensor's offset); None when it is stored
        any other way (a legacy file, a non-contiguous or wrapped tensor)."""
        from ..codecs.tensornodes import NotSimple, local_of

        z = self._zip(file)
        node = z.tree if z is not None else None
        for k in key:
            try:
                node = node[k]
            except (KeyError, IndexError, TypeError):
                return None
        try:
            local = local_of(node)
        except NotSimple:
            return None
        rec = z.records.get(f"data/{local.storage.key}") if local is not None else None
        if rec is None:
            return None
        return rec.offset + local.offset * local.dtype.itemsize, local

    def _zip(self, file: str):
        """``file``'s zip, read once (None: not a zip this walks; torch's loader reads or refuses it)."""
        from ..security.torchfile import TorchZip

        with self._lock:
            z = self._zips.get(file, False)
            if z is False:
                try:
                    z = TorchZip(self.base / file)
                except Exception:  # noqa: BLE001 - not a file this path walks: fetched whole
                    z = None
                self._zips[file] = z
        return z

    def of(self, file: str, key: tuple[Any, ...]) -> tuple[list[Range], bool]:
        """The records the value at ``key`` of ``file`` uses, and True; or the whole file and
        False when its pickle cannot be walked here (a legacy file, a global ckpt does not parse,
        a key that is not plain containers all the way)."""
        path = self.base / file
        z = self._zip(file)
        node = z.tree if z is not None else None
        for k in key:
            try:
                node = node[k]
            except (KeyError, IndexError, TypeError):
                node = None
                break
        if z is None or node is None:
            return [(path, 0, path.stat().st_size)], False
        out = []
        for name in storages(node):
            rec = z.records.get(f"data/{name}")
            if rec is not None:
                out.append((path, rec.offset, rec.offset + rec.size))
        return out, True


def storages(node: Any) -> list[str]:
    """Keys of the storages a parsed pickle node reaches (a tensor, a DTensor, a dict of them)."""
    from ..security.torchfile import Reduce, StorageRef

    out: list[str] = []
    seen: set[int] = set()
    todo = [node]
    while todo:
        n = todo.pop()
        if id(n) in seen:
            continue
        seen.add(id(n))
        if isinstance(n, StorageRef):
            out.append(n.key)
        elif isinstance(n, Reduce):
            todo += [n.args, n.state]
        elif isinstance(n, dict):
            todo += list(n.values())
            todo += list(getattr(n, "__dict__", {}).values())
        elif isinstance(n, (list, tuple)):
            todo += list(n)
    return out
