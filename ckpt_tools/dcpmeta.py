"""Plain stand-ins for DCP's metadata classes, for reading ``.metadata``.

:class:`~ckpt_tools.safeload.MetadataUnpickler` maps DCP's class names onto these, so reading
a DCP checkpoint neither imports ``torch.distributed.checkpoint`` (about a second of start-up)
nor lets the pickle reach any of torch's code. Writing uses torch's own classes, so the
``.metadata`` the tool writes is exactly what ``dcp.save`` writes.
"""

from __future__ import annotations

from enum import Enum
from typing import Any

import torch


class _Record:
    """Attributes from the pickled state dict; unknown fields are kept, missing ones None."""

    _fields: tuple[str, ...] = ()

    def __init__(self, **kwargs: Any) -> None:
        for f in self._fields:
            setattr(self, f, kwargs.get(f))

    def __setstate__(self, state: Any) -> None:
        for f in self._fields:
            setattr(self, f, None)
        if isinstance(state, tuple) and len(state) == 2:  # (dict, slots) from a __slots__ class
            state = {**(state[0] or {}), **(state[1] or {})}
        if not isinstance(state, dict):
            raise ValueError(f"{type(self).__name__}: unexpected pickled state {type(state).__name__}")
        self.__dict__.update(state)

    def __repr__(self) -> str:
        return f"{type(self).__name__}({', '.join(f'{f}={getattr(self, f, None)!r}' for f in self._fields)})"


class Metadata(_Record):
    _fields = ("state_dict_metadata", "planner_data", "storage_data", "storage_meta", "version")


class StorageMeta(_Record):
    _fields = ("checkpoint_id", "save_id", "load_id", "modules")


class TensorStorageMetadata(_Record):
    _fields = ("properties", "size", "chunks")


class BytesStorageMetadata(_Record):
    pass


class ChunkStorageMetadata(_Record):
    _fields = ("offsets", "sizes")


class StorageInfo(_Record):
    _fields = ("relative_path", "offset", "length", "transform_descriptors")


class StoragePrefix(_Record):
    _fields = ("prefix",)


class MetadataIndex(_Record):
    """Hashable like DCP's: by ``fqn`` and ``offset`` (``index`` is only a hint)."""

    _fields = ("fqn", "offset", "index")

    def _key(self) -> tuple:
        return (self.fqn, tuple(self.offset) if self.offset is not None else None)

    def __hash__(self) -> int:
        return hash(self._key())

    def __eq__(self, other: object) -> bool:
        return isinstance(other, MetadataIndex) and self._key() == other._key()


class MemFormat(Enum):
    TORCH_CONTIGUOUS_FORMAT = 0
    TORCH_CHANNELS_LAST = 1
    TORCH_PRESERVE_FORMAT = 2


class TensorProperties(_Record):
    _fields = ("dtype", "layout", "requires_grad", "memory_format", "pin_memory")

    def __setstate__(self, state: Any) -> None:
        if not isinstance(state, tuple) or len(state) != 5 or not isinstance(state[0], torch.dtype):
            raise ValueError("TensorProperties: unexpected pickled state")
        self.dtype, self.layout, self.requires_grad, self.memory_format, self.pin_memory = state


# DCP's (module, name) → stand-in
CLASSES: dict[tuple[str, str], type] = {
    ("torch.distributed.checkpoint.metadata", "Metadata"): Metadata,
    ("torch.distributed.checkpoint.metadata", "StorageMeta"): StorageMeta,
    ("torch.distributed.checkpoint.metadata", "TensorStorageMetadata"): TensorStorageMetadata,
    ("torch.distributed.checkpoint.metadata", "BytesStorageMetadata"): BytesStorageMetadata,
    ("torch.distributed.checkpoint.metadata", "ChunkStorageMetadata"): ChunkStorageMetadata,
    ("torch.distributed.checkpoint.metadata", "MetadataIndex"): MetadataIndex,
    ("torch.distributed.checkpoint.metadata", "TensorProperties"): TensorProperties,
    ("torch.distributed.checkpoint.metadata", "_MEM_FORMAT_ENCODING"): MemFormat,
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"): StorageInfo,
    ("torch.distributed.checkpoint.filesystem", "_StoragePrefix"): StoragePrefix,
}
