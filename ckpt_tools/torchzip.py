"""``torch.save`` in bounded memory.

torch's own ``_save`` pickles the object, then writes each storage as a zip record. We let it
pickle an object whose tensors are *placeholders* (``torch.empty``: address space, no touched
pages) and, as it asks to write each placeholder's record, hand it the real bytes instead,
produced on demand. The file is byte-for-byte what ``torch.save`` writes for the real object.
"""

from __future__ import annotations

import pickle
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch.serialization import _open_zipfile_writer, _save

DEFAULT_PROTOCOL = 2


class LazyStorages:
    """Placeholders whose bytes come from a callback when torch writes them."""

    def __init__(self) -> None:
        self._providers: dict[int, tuple[Callable[[], torch.Tensor], int]] = {}
        self._keep: list[torch.Tensor] = []

    def placeholder(self, sizes: tuple[int, ...], dtype: torch.dtype, provide: Callable[[], torch.Tensor]) -> torch.Tensor:
        """A tensor of ``sizes``/``dtype`` whose saved bytes will be ``provide()``'s."""
        t = torch.empty(sizes, dtype=dtype)
        storage = t.untyped_storage()
        self._providers[storage._cdata] = (provide, storage.nbytes())
        self._keep.append(t)
        return t

    def bytes_for(self, storage: Any) -> torch.Tensor | None:
        entry = self._providers.pop(getattr(storage, "_cdata", None), None)
        if entry is None:
            return None
        provide, nbytes = entry
        real = provide().contiguous()
        if real.numel() * real.element_size() != nbytes:
            raise RuntimeError(f"provided {real.numel() * real.element_size()} bytes for a {nbytes}-byte storage")
        return real


class _Writer:
    """Wraps torch's zip writer: records of placeholder storages get the real bytes."""

    def __init__(self, inner: Any, lazy: LazyStorages) -> None:
        self._inner = inner
        self._lazy = lazy

    def write_record(self, name: str, data: Any, nbytes: int) -> None:
        real = self._lazy.bytes_for(data) if not isinstance(data, (str, bytes)) else None
        if real is None:
            self._inner.write_record(name, data, nbytes)
            return
        if real.storage_offset() or real.untyped_storage().nbytes() != nbytes:
            real = real.clone()  # a view into a larger storage: write only its own bytes
        self._inner.write_record(name, real.untyped_storage(), nbytes)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)


def save(obj: Any, path: Path, lazy: LazyStorages) -> None:
    """``torch.save(obj, path)``, with placeholder tensors filled from ``lazy``."""
    with _open_zipfile_writer(str(path)) as zf:
        _save(obj, _Writer(zf, lazy), pickle, DEFAULT_PROTOCOL, False)
