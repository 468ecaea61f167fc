"""Element types by name, without importing torch.

``import torch`` costs over a second of start-up, longer than copying a gigabyte. Describing a
checkpoint and planning a copy only need a dtype's name, its size and whether it is floating
point, so descriptions hold a :class:`DType`; torch's own dtype object is looked up (and torch
imported) only where tensor values are made.
"""

from __future__ import annotations

import struct
from typing import Any

# name: (bytes per element, floating point, complex) for torch's dtypes a checkpoint holds
_TABLE: dict[str, tuple[int, bool, bool]] = {
    "float64": (8, True, False), "float32": (4, True, False), "float16": (2, True, False),
    "bfloat16": (2, True, False), "float8_e4m3fn": (1, True, False), "float8_e5m2": (1, True, False),
    "float8_e4m3fnuz": (1, True, False), "float8_e5m2fnuz": (1, True, False), "float8_e8m0fnu": (1, True, False),
    "complex128": (16, False, True), "complex64": (8, False, True), "complex32": (4, False, True),
    "int64": (8, False, False), "int32": (4, False, False), "int16": (2, False, False), "int8": (1, False, False),
    "uint64": (8, False, False), "uint32": (4, False, False), "uint16": (2, False, False), "uint8": (1, False, False),
    "bool": (1, False, False),
}
_INTERNED: dict[str, DType] = {}  # name -> its DType
_FACTS: dict[DType, tuple[int, bool, bool]] = {}  # _TABLE by DType (found by identity)
# torch's other spellings of the same types (how torch.FloatStorage etc. and old files name them)
ALIASES = {"float": "float32", "double": "float64", "half": "float16", "long": "int64", "int": "int32",
           "short": "int16", "cfloat": "complex64", "cdouble": "complex128", "chalf": "complex32"}


class DType(str):
    """A torch dtype by its name (``DType("bfloat16")``): a ``str``, so it hashes and prints
    as the name, and compares equal to torch's own dtype of that name.

    ``.torch`` is torch's dtype object (imports torch).
    """

    __slots__ = ()

    def __new__(cls, name: str) -> DType:
        # one object per name: equal dtypes are the same object, so comparing two and finding
        # one in a table keyed by them take no call of __eq__ (asked per piece of a plan)
        if type(name) is str and cls is DType:
            got = _INTERNED.get(name)
            if got is not None:
                return got
        name = str(name).removeprefix("torch.")
        name = ALIASES.get(name, name)
        if name not in _TABLE:
            raise ValueError(f"unknown dtype {name!r}")
        if cls is not DType:
            return super().__new__(cls, name)
        got = _INTERNED.get(name)
        if got is None:
            got = _INTERNED[name] = super().__new__(cls, name)
            _FACTS[got] = _TABLE[name]
        return got

    @classmethod
    def of(cls, dtype: Any) -> DType:
        """The DType of a torch dtype (or of a name)."""
        return dtype if isinstance(dtype, DType) else cls(str(dtype))

    @property
    def itemsize(self) -> int:
        return _FACTS[self][0]

    @property
    def is_floating_point(self) -> bool:
        return _FACTS[self][1]

    @property
    def is_complex(self) -> bool:
        return _FACTS[self][2]

    @property
    def torch(self) -> Any:
        import torch

        return getattr(torch, str.__str__(self))

    def __eq__(self, other: object) -> bool:
        if isinstance(other, str):
            return str.__eq__(self, other)
        if _is_torch_dtype(other):
            return str(other) == "torch." + str.__str__(self)
        return NotImplemented

    def __ne__(self, other: object) -> bool:
        if isinstance(other, str):  # (the usual case, asked per piece of a plan: one call, not two)
            return not str.__eq__(self, other)
        eq = self.__eq__(other)
        return eq if eq is NotImplemented else not eq

    __hash__ = str.__hash__

    def __repr__(self) -> str:
        return f"DType({str.__str__(self)!r})"


for _name in _TABLE:  # (every name's DType made once, here)
    DType(_name)


def _is_torch_dtype(x: object) -> bool:
    t = type(x)
    return t.__name__ == "dtype" and t.__module__ == "torch"


def as_torch(dtype: Any) -> Any:
    """torch's dtype object for a DType (torch's own passes through)."""
    return dtype.torch if isinstance(dtype, DType) else dtype


def known(name: str) -> bool:
    name = str(name).removeprefix("torch.")
    return ALIASES.get(name, name) in _TABLE


# struct codes of the types a scalar (an optimizer's ``step``) is stored in; bfloat16 is the
# high half of a float32
_STRUCT = {"float64": "d", "float32": "f", "float16": "e", "int64": "q", "int32": "i", "int16": "h",
           "int8": "b", "uint64": "Q", "uint32": "I", "uint16": "H", "uint8": "B", "bool": "?"}


def scalar_from_bytes(data: bytes | memoryview, dtype: DType) -> int | float | bool | None:
    """The value of a one-element tensor from its stored little-endian bytes, without torch
    (what ``tensor.item()`` returns); None for a type this does not decode (float8, complex)
    or bytes of the wrong length."""
    data = bytes(data)
    if len(data) != dtype.itemsize:
        return None
    if dtype == "bfloat16":
        return struct.unpack("<f", b"\0\0" + data)[0]
    code = _STRUCT.get(str.__str__(dtype))
    return struct.unpack("<" + code, data)[0] if code else None
