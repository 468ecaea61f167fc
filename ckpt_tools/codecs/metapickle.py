"""DCP's ``.metadata`` written without torch: the bytes ``pickle.dump`` gives for torch's own
``Metadata`` of the same content.

Why: importing torch to build five small dataclasses costs over a second, longer than copying a
gigabyte. The classes below stand in for DCP's (``Metadata``, ``TensorStorageMetadata``, ...):
they hold the same fields in the same order and reduce as the real ones do, and
:class:`_Pickler` (the pure-Python pickler, which at a given protocol writes what the C one
writes) emits each stand-in under the real class's module and name instead of importing it.

The pickle memoizes by object identity, so identity is kept as torch's objects have it: one
module string per torch module, one object per dtype, one ``torch.strided`` and one
``_MEM_FORMAT_ENCODING`` member; callers build the metadata with the same sharing of strings and
tuples as the torch code they replace (see :meth:`ckpt_tools.formats.dcpnative.Writer.finish`).
Tested byte for byte against ``pickle.dump`` of torch's classes.
"""

from __future__ import annotations

import copyreg
import io
import pickle
from typing import Any

# one object per module, as each torch module's classes share their module's ``__name__``;
# built with join so that literals interned elsewhere are not shared with them by accident
_METADATA_MODULE = ".".join(["torch", "distributed", "checkpoint", "metadata"])
_FILESYSTEM_MODULE = ".".join(["torch", "distributed", "checkpoint", "filesystem"])
# torch finds a dtype's module by scanning sys.modules (its key), torch.Size's by __module__:
# equal strings, two objects
_DTYPE_MODULE = "".join(["tor", "ch"])
_SIZE_MODULE = "".join(["to", "rch"])
_SERIALIZATION_MODULE = ".".join(["torch", "serialization"])


class _Global:
    """A global written by name (module string object, qualname string object)."""

    __slots__ = ("module", "name")

    def __init__(self, module: str, name: str) -> None:
        self.module, self.name = module, name

    def __call__(self, *args: Any) -> Any:  # the pickler asks that a reduce function be callable
        raise TypeError(f"{self.module}.{self.name} is a name only")


class _Stand:
    """Base of the stand-ins: pickled as ``NEWOBJ(cls)`` + ``BUILD(__dict__)``, like a dataclass."""

    _global: _Global

    def __reduce_ex__(self, protocol: int) -> tuple:
        state = self._state()
        return (copyreg.__newobj__, (type(self),), state, None, None)

    def _state(self) -> Any:
        return self.__dict__ or None


def _named(module: str, name: str):
    def mark(cls: type) -> type:
        cls._global = _Global(module, "".join([name]))
        return cls
    return mark


class Size(tuple):
    """``torch.Size``: pickles as ``torch.Size(tuple(self))``, a new tuple each time."""

    def __reduce_ex__(self, protocol: int) -> tuple:
        return (_SIZE, (tuple(self),))


class _Reduced:
    """A singleton that pickles as ``func(*args)`` (``torch.strided``, an enum member)."""

    def __init__(self, func: _Global, args: tuple) -> None:
        self.func, self.args = func, args

    def __reduce_ex__(self, protocol: int) -> tuple:
        return (self.func, self.args)


_SIZE = _Global(_SIZE_MODULE, "Size")
STRIDED = _Reduced(_Global(_SERIALIZATION_MODULE, "_get_layout"), ("torch.strided",))
_MEM_FORMAT = _Global(_METADATA_MODULE, "_MEM_FORMAT_ENCODING")
CONTIGUOUS = _Reduced(_MEM_FORMAT, (0,))
_DTYPES: dict[str, _Global] = {}


def dtype(name: str) -> _Global:
    """torch's dtype of that name: one object per name, as torch's dtypes are singletons."""
    name = str(name)
    if name not in _DTYPES:
        _DTYPES[name] = _Global(_DTYPE_MODULE, "".join([name]))
    return _DTYPES[name]


@_named(_METADATA_MODULE, "ChunkStorageMetadata")
class ChunkStorageMetadata(_Stand):
    def __init__(self, offsets: Size, sizes: Size) -> None:
        self.offsets, self.sizes = offsets, sizes


@_named(_METADATA_MODULE, "TensorProperties")
class TensorProperties(_Stand):
    def __init__(self, dtype: _Global) -> None:
        self.dtype = dtype

    def _state(self) -> tuple:
        # torch's __getstate__: (dtype, layout, requires_grad, memory format encoding, pin_memory)
        return (self.dtype, STRIDED, False, CONTIGUOUS, False)


@_named(_METADATA_MODULE, "TensorStorageMetadata")
class TensorStorageMetadata(_Stand):
    def __init__(self, properties: TensorProperties, size: Size, chunks: list) -> None:
        self.properties, self.size, self.chunks = properties, size, chunks


@_named(_METADATA_MODULE, "BytesStorageMetadata")
class BytesStorageMetadata(_Stand):
    pass


@_named(_METADATA_MODULE, "MetadataIndex")
class MetadataIndex(_Stand):
    def __init__(self, fqn: str, offset: tuple | None = None, index: int | None = None) -> None:
        # torch's own __init__ order (fqn, index, then offset only when given, as a new Size)
        self.fqn = fqn
        self.index = index
        if offset is not None:
            self.offset = Size(offset)


@_named(_FILESYSTEM_MODULE, "_StorageInfo")
class StorageInfo(_Stand):
    def __init__(self, relative_path: str, offset: int, length: int) -> None:
        self.relative_path, self.offset, self.length = relative_path, offset, length


@_named(_METADATA_MODULE, "Metadata")
class Metadata(_Stand):
    def __init__(self, state_dict_metadata: dict, planner_data: Any = None, storage_data: Any = None,
                 storage_meta: Any = None, version: str | None = None) -> None:
        self.state_dict_metadata = state_dict_metadata
        self.planner_data = planner_data
        self.storage_data = storage_data
        self.storage_meta = storage_meta
        self.version = version


class _Pickler(pickle._Pickler):
    """The pure-Python pickler, writing stand-ins and :class:`_Global` under torch's names."""

    dispatch = pickle._Pickler.dispatch.copy()

    def save_global(self, obj: Any, name: str | None = None) -> None:
        g = obj if type(obj) is _Global else getattr(obj, "_global", None)
        if g is None or not isinstance(g, _Global):
            raise pickle.PicklingError(f"{obj!r} is not a DCP metadata stand-in")
        # protocol >= 4, as save_global writes a global
        self.save(g.module)
        self.save(g.name)
        self.write(pickle.STACK_GLOBAL)
        self.memoize(obj)

    dispatch[_Global] = save_global
    dispatch[type] = save_global

    def save(self, obj: Any, save_persistent_id: bool = True) -> None:
        # pickle._Pickler.save's own steps for the objects a many-rank .metadata is mostly made
        # of (hundreds of thousands of ints, strings and small tuples), without its generic
        # lookups: no persistent ids here, no reducer_override; ints are never memoized
        t = type(obj)
        if t is int:
            self.framer.commit_frame()
            self.save_long(obj)
        elif t is str or t is tuple:
            self.framer.commit_frame()
            x = self.memo.get(id(obj))
            if x is not None:
                self.write(self.get(x[0]))
            elif t is str:
                self.save_str(obj)
            else:
                self.save_tuple(obj)
        else:
            super().save(obj, save_persistent_id)


def dumps(meta: Metadata, protocol: int | None = None) -> bytes:
    """What ``pickle.dump`` writes for torch's ``Metadata`` with this content."""
    protocol = pickle.DEFAULT_PROTOCOL if protocol is None else protocol
    if protocol < 4:
        raise ValueError("DCP metadata is pickled at protocol 4 or later")
    buf = io.BytesIO()
    _Pickler(buf, protocol=protocol).dump(meta)
    return buf.getvalue()
