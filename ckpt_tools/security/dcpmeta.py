"""Reading DCP's ``.metadata`` pickle safely, without torch.

:class:`MetadataUnpickler` maps DCP's class names onto plain stand-ins and torch's dtypes onto
:class:`~ckpt_tools.core.dtypes.DType`, so reading a DCP checkpoint neither imports torch (over a
second of start-up) nor lets the pickle reach any code. :func:`load_dcp_metadata` first tries
:mod:`~ckpt_tools.security.fastpickle`, the same steps in one loop, and falls back to
:class:`MetadataUnpickler` for any file it declines. Writing uses torch's own classes, so the
``.metadata`` the tool writes is exactly what ``dcp.save`` writes.
"""

from __future__ import annotations

import io
import os
import pickle
import re
import struct
from enum import Enum
from itertools import repeat
from pathlib import Path
from typing import Any

from . import bounded, dcprows, fastpickle, safefs
from ..core.dtypes import DType, known
from ..errors import BadInput, Damaged, NewerFormat, UnsafeInput, brief, first_line


class _Record:
    """Attributes from the pickled state dict; unknown fields are kept, missing ones None."""

    _fields: tuple[str, ...] = ()
    _known: frozenset[str] = frozenset()

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        cls._known = frozenset(cls._fields)

    def __init__(self, **kwargs: Any) -> None:
        for f in self._fields:
            setattr(self, f, kwargs.get(f))

    def __setstate__(self, state: Any) -> None:
        if type(state) is dict and state.keys() <= self._known:  # the usual: some of its own fields
            for f in self._fields:
                setattr(self, f, state.get(f))
            return
        if isinstance(state, tuple) and len(state) == 2:  # (dict, slots) from a __slots__ class
            state = {**(state[0] or {}), **(state[1] or {})}
        if not isinstance(state, dict):
            raise ValueError(f"{type(self).__name__}: unexpected pickled state {type(state).__name__}")
        for f in self._fields:
            if f not in state:
                setattr(self, f, None)
        # attribute by attribute, in the state's order: the instance keeps its values inline,
        # without a dict of its own (a many-rank .metadata's 220k records: 13 MB less than
        # updating ``__dict__``). Only plain names: ``__class__`` or ``__dict__`` would reach
        # the object itself, not a field
        for k, v in state.items():
            if type(k) is not str or k.startswith("__"):
                raise ValueError(f"{type(self).__name__}: a pickled field named {brief(k)}")
            setattr(self, k, v)

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
    """Hashable like DCP's: by ``fqn`` and ``offset`` (``index`` is only a hint). Its hash is
    cheap whatever the file put in it: a name and a flat tuple of ints, or refused."""

    _fields = ("fqn", "offset", "index")
    _safe_hash = True  # the unpickler may use it as a dict key (bounded.check_key)
    # the key, worked out once (a many-rank save's index hashes each entry as it is read, and
    # a reader looks each up again): a slot, out of the state a pickle sets and of the tree walked
    __slots__ = ("_k",)

    def __setstate__(self, state: Any) -> None:
        super().__setstate__(state)
        self._k = None

    def _key(self) -> tuple:
        k = getattr(self, "_k", None)
        if k is None:
            k = self._k = self.key_of(self.fqn, self.offset)
        return k

    @staticmethod
    def key_of(fqn: Any, offset: Any) -> tuple:
        """What an index of ``fqn`` at ``offset`` hashes and compares as (a plain tuple, for a
        reader's own dict); ValueError unless a name and a short sequence of ints (or None)."""
        offset = None if offset is None else tuple(offset)
        if not isinstance(fqn, str) or offset is not None and (
                len(offset) > 64 or not all(type(o) is int for o in offset)):
            raise ValueError("MetadataIndex: fqn must be a name and offset a short list of integers")
        return (fqn, offset)

    def __hash__(self) -> int:
        return hash(self._key())

    def __eq__(self, other: object) -> bool:  # (equal to its row and to the tuple it hashes as)
        if type(other) is dcprows.IndexKey or type(other) is tuple:
            return self._key() == other
        return isinstance(other, MetadataIndex) and self._key() == other._key()


class MemFormat(Enum):
    TORCH_CONTIGUOUS_FORMAT = 0
    TORCH_CHANNELS_LAST = 1
    TORCH_PRESERVE_FORMAT = 2


class NewerTorch(ValueError):
    """The pickle holds a form of DCP's metadata that no torch ckpt knows wrote (a newer torch's)."""


class TensorProperties(_Record):
    """torch's ``__getstate__`` tuple: ``(dtype, layout, requires_grad, memory format encoding,
    pin_memory)`` up to torch 2.14, with ``strides`` (None or a tuple of ints; metadata only, the
    bytes are laid out as before) added by torch 2.15. A longer tuple, or another kind of state,
    is a newer torch's."""

    _fields = ("dtype", "layout", "requires_grad", "memory_format", "pin_memory", "strides")

    def __setstate__(self, state: Any) -> None:
        if isinstance(state, dict) or isinstance(state, tuple) and len(state) > 6 and state and \
                isinstance(state[0], DType):
            raise NewerTorch(f"TensorProperties pickled as {_shape_of(state)}, where torch 2.10 to 2.15 "
                             "pickle a tuple of 5 or 6 fields")
        if not isinstance(state, tuple) or len(state) not in (5, 6) or not isinstance(state[0], DType):
            raise ValueError("TensorProperties: unexpected pickled state")
        self.dtype, self.layout, self.requires_grad, self.memory_format, self.pin_memory = state[:5]
        strides = state[5] if len(state) == 6 else None
        if strides is not None and not (isinstance(strides, tuple) and all(type(x) is int for x in strides)):
            raise ValueError("TensorProperties: strides must be None or a tuple of integers")
        self.strides = strides


def _shape_of(state: Any) -> str:
    return f"a tuple of {len(state)} fields" if isinstance(state, tuple) else f"a {type(state).__name__}"


class SavePlan(_Record):
    """What each rank planned to write. ``dcp.save`` does not keep it, but Megatron-Core's
    ``torch_dist`` strategy stores every rank's plan in ``.metadata`` (``all_local_plans``), to
    reuse on its next save; read as plain records, never used to locate data."""

    _fields = ("items", "storage_data", "planner_data", "usable")


class WriteItem(_Record):
    _fields = ("index", "type", "bytes_io_data", "tensor_data")


class TensorWriteData(_Record):
    _fields = ("chunk", "properties", "size")


class WriteItemType(Enum):
    TENSOR = 1
    SHARD = 2
    BYTE_IO = 3


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
    ("torch.distributed.checkpoint.planner", "SavePlan"): SavePlan,
    ("torch.distributed.checkpoint.planner", "WriteItem"): WriteItem,
    ("torch.distributed.checkpoint.planner", "TensorWriteData"): TensorWriteData,
    ("torch.distributed.checkpoint.planner", "WriteItemType"): WriteItemType,
}


class Forbidden(pickle.UnpicklingError):
    """A pickle asked for a global outside the allow-list."""


DCP_MODULES = "torch.distributed.checkpoint."  # where DCP's own metadata classes live


def _get_layout(name: str) -> str:
    """How torch.layout pickles: ``_get_layout("torch.strided")``; kept as its name."""
    if not isinstance(name, str):
        raise ValueError("layout name must be a string")
    return name


class MetadataUnpickler(pickle._Unpickler):
    """Unpickles DCP ``.metadata``: DCP's metadata classes (mapped onto the plain stand-ins
    above), torch dtypes (as :class:`DType`) and plain data, nothing else.

    The pure-Python unpickler (about 5x slower than C's: 10^5 items in ~10 s), because only it
    lets every dict key and set member be checked before it is hashed: C's would hash a tuple
    key nested 200,000 deep (a segfault) or a shared one (a hang) with no way to stop it."""

    dispatch = bounded.guard_dispatch(pickle._Unpickler.dispatch)
    _ALLOWED = {
        ("collections", "OrderedDict"),
        # StorageMeta.checkpoint_id is the path dcp.save was given
        ("pathlib", "PosixPath"), ("pathlib", "PurePosixPath"),
        ("pathlib", "WindowsPath"), ("pathlib", "PureWindowsPath"),
        ("pathlib._local", "PosixPath"), ("pathlib._local", "PurePosixPath"),
        ("builtins", "slice"),
    }
    _STAND_INS: dict[tuple[str, str], Any] = {
        ("torch", "Size"): tuple,  # offsets and sizes: torch.Size((...)) is a tuple of ints
        ("torch.serialization", "_get_layout"): _get_layout,
        # members checked before they are hashed
        ("builtins", "set"): bounded.safe_set,
        ("builtins", "frozenset"): bounded.safe_frozenset,
    }

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in CLASSES:
            return CLASSES[(module, name)]
        if (module, name) in self._STAND_INS:
            return self._STAND_INS[(module, name)]
        if (module, name) in self._ALLOWED:
            return super().find_class(module, name)
        if module == "torch" and known(name):
            return DType(name)
        if module.startswith(DCP_MODULES):  # refused all the same: nothing of it is run
            raise NewerTorch(f"it names {module}.{name}, a DCP class no torch from 2.10 to 2.15 pickles")
        raise Forbidden(f"global {module}.{name} is not a DCP metadata class")

    def load_build(self) -> None:
        # state goes only into an object the pickle built, never into a class or function
        # find_class gave it: BUILD's setattr would change that for the whole process (a
        # ``_str`` set on PosixPath renames every path the tool writes afterwards)
        if len(self.stack) > 1 and callable(self.stack[-2]):
            target = self.stack[-2]
            raise Forbidden(f"it sets attributes of {getattr(target, '__qualname__', type(target).__name__)} "
                            "itself, not of an object it built")
        super().load_build()

    dispatch[pickle.BUILD[0]] = load_build


bounded.register(_Record, lambda r: vars(r).values())


# over this, the careful reader only (the fast one reads a window at a time, whatever the size:
# every file a DCP may hold; tests set it lower)
FAST_MAX_BYTES = safefs.MAX_METADATA_BYTES

# a TensorProperties record as torch pickles it after its class: EMPTY_TUPLE NEWOBJ MEMOIZE
# MARK, its 5 fields (6 from torch 2.15, strides None), each a memo reference, a bool or None,
# TUPLE MEMOIZE BUILD
_PROPERTIES = re.compile(rb"\)\x81\x94\(((?:h.|j....|\x88|\x89|N){5,6})t\x94b", re.S).match
_VALUE = re.compile(rb"h(.)|j(....)|.", re.S).finditer
_CONSTANT = {0x88: True, 0x89: False, 0x4E: None}  # NEWTRUE, NEWFALSE, NONE
_U4 = struct.Struct("<I").unpack


def _value_of(m: re.Match, memo: fastpickle.Memo) -> Any:
    """One field of a record :data:`_PROPERTIES` matched: what a memo reference (BINGET,
    LONG_BINGET) names, or a constant."""
    short, long = m.groups()
    if short is not None:
        return memo[short[0]]
    return memo[_U4(long)[0]] if long is not None else _CONSTANT[m.group()[0]]


class _SharedProperties:
    """A :func:`~ckpt_tools.security.fastpickle.load` record reader of ``TensorProperties``:
    one object per distinct record, shared by the tensors whose records are alike (every tensor
    of one dtype). Each was an object, its dict and its state tuple, ~200 bytes of every tensor
    a ``.metadata`` lists (5 MB of a 25k-tensor file's, traced), and a dozen opcodes read one by
    one. Its state is checked by the same ``__setstate__`` as the careful reader's; its memo entries,
    the record and its state tuple, are :data:`~ckpt_tools.security.fastpickle.UNREAD` (torch
    never refers back to them; a pickle that does is read the careful way)."""

    def __init__(self) -> None:
        self._made: dict[bytes, TensorProperties] = {}  # the record's fields, as pickled -> the object

    def __call__(self, buf: bytes, pos: int, fend: int, memo: fastpickle.Memo) -> tuple[Any, int] | None:
        m = _PROPERTIES(buf, pos, fend)
        if m is None:
            return None
        fields = m.group(1)
        obj = self._made.get(fields)
        if obj is None:
            state = tuple(map(_value_of, _VALUE(fields), repeat(memo)))
            obj = TensorProperties.__new__(TensorProperties)
            obj.__setstate__(state)  # (refusing as the careful reader refuses: it reads it then)
            if len(self._made) >= 1 << 12:
                self._made.clear()
            self._made[fields] = obj
        memo.codes.extend((0, 0))  # (the record and its state: UNREAD)
        return obj, m.end()


def fast_readers(rows: dcprows.Rows) -> dict[type, Any]:
    """The record readers :func:`~ckpt_tools.security.fastpickle.load` takes for a ``.metadata``:
    chunks and storage entries as ``rows``' rows, tensors' properties shared."""
    return {**rows.readers(ChunkStorageMetadata, MetadataIndex, StorageInfo), TensorProperties: _SharedProperties()}


def _unpickle(f: Any, size: int, fast: bool, stored: dcprows.Stored | None = None) -> Any:
    """The pickle in ``f``: by :func:`fastpickle.load` (DCP's many-rank records read as rows,
    :mod:`.dcprows`) when ``fast`` and it vouches for the whole file, else (from the start, so
    refusals are always its own) by :class:`MetadataUnpickler`."""
    if size > FAST_MAX_BYTES or not fast:
        return MetadataUnpickler(f).load()
    careful = MetadataUnpickler(io.BytesIO())
    careful.proto = 4  # what its find_class consults; fastpickle reads protocol 4 and 5 only
    try:
        reader = dcprows.Rows()
        rows = fast_readers(reader)
        pairs = reader.joiner(TensorStorageMetadata, MetadataIndex, stored) if stored is not None else None
        # read a window at a time: the file is never held whole
        return fastpickle.load(f.read(fastpickle.WINDOW), careful.find_class, rows, more=f.read, pairs=pairs)
    except fastpickle.Decline:
        if stored is not None:
            stored.clear()
        f.seek(0)
        return MetadataUnpickler(f).load()


def _read(path: Path, fast: bool, stored: dcprows.Stored | None = None) -> Any:
    try:
        with safefs.open_file(path) as f:
            # the size is checked before reading: a sparse multi-GB file is refused, not read
            size = os.fstat(f.fileno()).st_size
            if size > safefs.MAX_METADATA_BYTES:
                raise BadInput(f"{path}: {size} bytes, over the {safefs.MAX_METADATA_BYTES >> 20} MiB a DCP "
                               ".metadata may hold; corrupt or not a checkpoint")
            with bounded.gc_paused():
                return _unpickle(f, size, fast, stored)
    except NewerTorch as e:
        raise NewerFormat(f"{path}: written by a newer torch ({first_line(e)}) than this ckpt-tools reads; "
                       "upgrade ckpt-tools (pip install -U ckpt-tools)") from e
    except Forbidden as e:
        raise UnsafeInput(f"{path}: refused: {first_line(e)}; a DCP .metadata holds only DCP's own classes") from e
    except bounded.HostileTree as e:
        raise bounded.HostileTree(f"{path}: {e}") from None
    except (pickle.UnpicklingError, EOFError, ValueError, TypeError, AttributeError, IndexError, KeyError, OSError,
            OverflowError, MemoryError, RecursionError, struct.error) as e:
        if isinstance(e, EOFError):  # the pickle ends before its STOP: the file was cut short
            raise Damaged(f"{path}: truncated: the DCP metadata pickle ends early ({size:,} bytes on disk); "
                           "copy the checkpoint again") from e
        raise Damaged(f"{path}: corrupt or truncated DCP metadata ({first_line(e)}); copy the checkpoint again") from e


def load_dcp_metadata(path: Path, *, stored: dcprows.Stored | None = None) -> Any:
    """Read a DCP ``.metadata`` file as :class:`MetadataUnpickler` reads it: refused unless a
    regular file under :data:`~ckpt_tools.security.safefs.MAX_METADATA_BYTES`, and its objects must pass
    :func:`~ckpt_tools.security.bounded.check_tree` (no runaway depth or sharing) before anything uses them.
    Chunks and storage entries come as rows (:mod:`.dcprows`) where the fast reader read them so,
    else as records: the same attributes either way. ``stored`` (empty): where the fast reader
    reads the file, the storage entry of a chunk, both read as rows, goes into its tables, not
    into ``storage_data`` (:meth:`~ckpt_tools.security.dcprows.Rows.joiner`); emptied again
    where the file is read as records."""
    meta = _read(path, fast=True, stored=stored)
    with bounded.gc_paused():
        try:
            bounded.check_tree(meta, where=str(path))
        except fastpickle.Decline:  # it refers back to a part of a record read as a row: read it all as objects
            if stored is not None:
                stored.clear()
            meta = _read(path, fast=False)
            bounded.check_tree(meta, where=str(path))
    if not isinstance(meta, Metadata):
        raise BadInput(f"{path}: holds a {type(meta).__name__}, not DCP Metadata")
    return meta
