"""``torch.save`` in bounded memory.

torch's own ``_save`` pickles the object, then writes each storage as a zip record. We let it
pickle an object whose tensors are *placeholders* (``torch.empty``: address space, no touched
pages) and, as it asks to write each placeholder's record, hand it the real bytes instead,
produced on demand. The file is byte-for-byte what ``torch.save`` writes for the real object.
"""

from __future__ import annotations

import contextlib
import pickle
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch
from torch.serialization import _open_zipfile_writer, _save

from ..core.dtypes import DType, as_torch
from ..core.plan import by_piece

DEFAULT_PROTOCOL = 2


class LazyStorages:
    """Placeholders whose bytes come from a callback when torch writes them."""

    def __init__(self) -> None:
        self._providers: dict[int, tuple[Callable[[], torch.Tensor], int]] = {}
        self._keep: list[torch.Tensor] = []

    def placeholder(self, sizes: tuple[int, ...], dtype: DType, provide: Callable[[], torch.Tensor]) -> torch.Tensor:
        """A tensor of ``sizes``/``dtype`` whose saved bytes will be ``provide()``'s."""
        t = torch.empty(sizes, dtype=as_torch(dtype))
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


def from_stream(pieces: Iterator[tuple[Any, torch.Tensor]]) -> Callable[[Any], Callable[[], torch.Tensor]]:
    """Providers over the engine's stream of ``(piece, values)``: ``provider(piece)()`` returns
    that piece's values, pulling the stream forward (and holding any piece asked for later)."""

    values = by_piece(iter(pieces))

    def provider(piece: Any) -> Callable[[], torch.Tensor]:
        return lambda: values(piece)

    return provider


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


class RecordingFile:
    """A binary file whose ``write`` remembers the first exception it raised.

    torch's zip writer calls ``write`` from C++ and turns any failure into a RuntimeError
    ("unexpected pos ..."); the recorded exception says what really happened (a full disk,
    an interrupt), so it can be raised instead."""

    def __init__(self, f: Any) -> None:
        self._f = f
        self.error: BaseException | None = None

    def write(self, data: Any) -> int:
        try:
            return self._f.write(data)
        except BaseException as e:
            if self.error is None:
                self.error = e
            raise

    def __getattr__(self, name: str) -> Any:
        return getattr(self._f, name)


@contextlib.contextmanager
def recorded_writes(f: Any) -> Iterator[RecordingFile]:
    """Yield ``f`` wrapped; a RuntimeError from torch becomes the write error behind it."""
    rec = RecordingFile(f)
    try:
        yield rec
    except RuntimeError as e:
        if rec.error is not None:
            raise rec.error from e
        raise


def save(obj: Any, path: Path, lazy: LazyStorages) -> None:
    """``torch.save(obj, path)``, with placeholder tensors filled from ``lazy``."""
    with open(path, "wb") as f, recorded_writes(f) as rec:
        with _open_zipfile_writer(rec) as zf:
            _save(obj, _Writer(zf, lazy), pickle, DEFAULT_PROTOCOL, False)
