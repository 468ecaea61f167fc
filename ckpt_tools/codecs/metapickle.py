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

:func:`dumps` runs the C pickler (a many-rank ``.metadata`` is millions of objects: the
pure-Python one took a quarter of a DCP reshard). The C one checks each global by importing its
module and finding the object there, so each torch module has a stand-in module registered
under a name of the same length that no import can mean (``~0~...``); the bytes are then those
names' strings renamed, nothing shifting. A file where a stand-in name is found other than once,
as a global's module (an item named like one), is written by the pure-Python pickler instead.
"""

from __future__ import annotations

import io
import pickle
import sys
import types
from collections.abc import Iterator, Sequence
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


_STANDS: dict[int, types.ModuleType] = {}  # id(a torch module's name) -> its stand-in module
_RENAMES: list[tuple[bytes, bytes]] = []  # (a stand-in module's name, the torch module's) as pickled


def _stand_module(module: str) -> types.ModuleType:
    """The stand-in module for torch's ``module`` (one per name object, as torch has one name
    object per module): registered under a name of the same length no import can mean."""
    got = _STANDS.get(id(module))
    if got is None:
        name = f"~{len(_STANDS)}~".ljust(len(module), "~")
        got = _STANDS[id(module)] = sys.modules[name] = types.ModuleType(name)
        # the C pickler writes a module's name as a short string (memoized: once a module)
        _RENAMES.append((b"\x8c" + bytes([len(name)]) + name.encode(), b"\x8c" + bytes([len(module)]) + module.encode()))
    return got


def _stand_in(obj: Any, module: str, name: str) -> None:
    """Make ``obj`` what the C pickler finds at ``name`` in ``module``'s stand-in module."""
    stand = _stand_module(module)
    setattr(stand, name, obj)
    obj.__module__ = stand.__name__
    obj.__qualname__ = name


class _Global:
    """A global written by name (module string object, qualname string object)."""

    def __init__(self, module: str, name: str) -> None:
        self.module, self.name = module, name
        _stand_in(self, module, name)

    def __call__(self, *args: Any) -> Any:  # the pickler asks that a reduce function be callable
        raise TypeError(f"{self.module}.{self.name} is a name only")

    def __reduce_ex__(self, protocol: int) -> str:
        return self.name  # a name: the C pickler writes the global found there


class _Stand:
    """Base of the stand-ins: pickled as ``NEWOBJ(cls)`` + ``BUILD(__dict__)`` (None if empty),
    like a dataclass: object's own reduction, in C (a ``__reduce_ex__`` here cost a call into
    Python per object: 125k of them for a 25k-tensor DCP)."""

    _global: _Global


def _named(module: str, name: str):
    def mark(cls: type) -> type:
        cls._global = g = _Global(module, "".join([name]))
        # the class itself is what the C pickler writes: under the stand-in module's one name
        # object (its own ``__module__``) and torch's name object for it (``__qualname__``)
        setattr(_STANDS[id(module)], g.name, cls)
        cls.__module__, cls.__qualname__ = g.__module__, g.name
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

    def __getstate__(self) -> tuple:
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

    # batched as the C pickler batches (torch's pickle is the C pickler's; see :func:`batches`)
    def _batch_appends(self, items: Any) -> None:
        items = list(items)
        if len(items) == 1:
            self.save(items[0])
            self.write(pickle.APPEND)
        for batch in batches(items, closed=False):
            self.write(pickle.MARK)
            for x in batch:
                self.save(x)
            self.write(pickle.APPENDS)

    def _batch_setitems(self, items: Any) -> None:
        items = list(items)
        if len(items) == 1:
            self.save(items[0][0])
            self.save(items[0][1])
            self.write(pickle.SETITEM)
        for batch in batches(items, closed=True):
            self.write(pickle.MARK)
            for k, v in batch:
                self.save(k)
                self.save(v)
            self.write(pickle.SETITEMS)

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


BATCH = 1000  # pickle's _BATCHSIZE


def batches(items: Sequence, *, closed: bool) -> Iterator[list]:
    """The runs of MARK ... APPENDS (a list's) or MARK ... SETITEMS (a dict's, ``closed``) the C
    pickler writes an exact list's or dict's items in: 1,000 a run, a dict's full last run
    followed by an empty one; none for a lone item (APPEND / SETITEM) or none. pickle.py differs
    at those edges (a lone last item by APPEND / SETITEM, no empty run). A run at a time (the
    emitter's storage index makes its rows as they are read: never all at once)."""
    n = len(items)
    if n <= 1:
        return
    for at in range(0, n, BATCH):
        yield items[at:at + BATCH]
    if closed and n % BATCH == 0:
        yield []


def dumps(meta: Metadata, protocol: int | None = None) -> bytes:
    """What ``pickle.dump`` writes for torch's ``Metadata`` with this content."""
    protocol = pickle.DEFAULT_PROTOCOL if protocol is None else protocol
    if protocol < 4:
        raise ValueError("DCP metadata is pickled at protocol 4 or later")
    data = _dumps_c(meta, protocol)
    return data if data is not None else _dumps_py(meta, protocol)


def _dumps_c(meta: Metadata, protocol: int) -> bytes | None:
    """By the C pickler, the stand-in modules' names renamed; None where one is found other than
    once, as a global's module, or where the C pickler would not find the stand-ins
    (another Python's way of looking globals up)."""
    try:
        data = pickle.dumps(meta, protocol=protocol)
    except (pickle.PicklingError, AttributeError, ImportError, TypeError):
        return None
    out = bytearray(data)
    for stand, real in _RENAMES:
        at = data.find(stand)
        if at < 0:  # no global of that module was pickled (a checkpoint without tensors)
            continue
        # once only, and as a global's module: its string, MEMOIZE, the name's string, MEMOIZE,
        # STACK_GLOBAL. A string of the checkpoint's that reads the same (an item named like a
        # stand-in module) is neither, whether or not the pickler wrote that module
        end = at + len(stand)
        name = end + 3 + data[end + 2] if end + 2 < len(data) else -1
        if data.find(stand, end) >= 0 or data[end:end + 2] != b"\x94\x8c" or data[name:name + 2] != b"\x94\x93":
            return None
        out[at:end] = real
    return bytes(out)


def _dumps_py(meta: Metadata, protocol: int) -> bytes:
    buf = io.BytesIO()
    _Pickler(buf, protocol=protocol).dump(meta)
    return buf.getvalue()
