"""What the inert nodes of a parsed ``torch.save`` pickle stand for: a plain tensor node read as
its storage record, offset, shape and dtype, so its bytes can be copied or mapped without torch.

A node outside that well-trodden shape (non-contiguous, an untyped storage, ...) raises
:class:`NotSimple`, and the caller takes the torch path, which handles it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from ..core.dtypes import DType
from ..errors import BadInput
from ..security.torchfile import Global, Reduce, StorageRef

REBUILD_V2 = Global("torch._utils", "_rebuild_tensor_v2")
STORAGE_DTYPES = {"DoubleStorage": "float64", "FloatStorage": "float32", "HalfStorage": "float16",
                  "BFloat16Storage": "bfloat16", "LongStorage": "int64", "IntStorage": "int32",
                  "ShortStorage": "int16", "CharStorage": "int8", "ByteStorage": "uint8", "BoolStorage": "bool",
                  "ComplexFloatStorage": "complex64", "ComplexDoubleStorage": "complex128"}

class NotSimple(Exception):
    """The file uses something only the torch path handles."""


@dataclass(frozen=True)
class Local:
    """A plain tensor node: ``_rebuild_tensor_v2(storage, offset, size, stride, ...)``."""

    node: Reduce
    storage: StorageRef
    offset: int
    size: tuple[int, ...]
    dtype: DType

    @property
    def nbytes(self) -> int:
        return math.prod(self.size) * self.dtype.itemsize


def contiguous_stride(size: tuple[int, ...]) -> tuple[int, ...]:
    stride, acc = [], 1
    for s in reversed(size):
        stride.append(acc)
        acc *= max(s, 1)
    return tuple(reversed(stride))


def local_of(node: Any) -> Local | None:
    """The plain tensor a node stands for (None if it is no tensor); NotSimple if it is one this
    path cannot copy as bytes (non-contiguous, an untyped storage, ...)."""
    if type(node) is not Reduce or node.func is not REBUILD_V2:
        return None
    args = node.args
    if len(args) < 4 or type(args[0]) is not StorageRef:
        raise NotSimple("unexpected tensor rebuild arguments")
    storage, offset, size, stride = args[:4]
    name = STORAGE_DTYPES.get(storage.type.name)
    if name is None or not isinstance(offset, int) or not isinstance(size, tuple) or not isinstance(stride, tuple):
        raise NotSimple(f"tensor stored as {storage.type.name}")
    size = tuple(size)
    if any(a != b for a, b, s in zip(stride, contiguous_stride(size), size) if s > 1) or len(stride) != len(size):
        raise NotSimple("non-contiguous tensor")
    if offset < 0 or offset + math.prod(size) > storage.numel:
        raise BadInput(f"a tensor of {size} at element {offset} does not fit its storage of {storage.numel}")
    return Local(node, storage, offset, size, DType(name))
