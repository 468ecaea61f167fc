"""Read ``torch.save`` zip files without importing torch (stdlib, ``errors`` and ``security`` only).

Why: ``import torch`` costs over a second, and resharding a verl FSDP checkpoint only moves storage
bytes between files and rebuilds a small pickle. ``data.pkl`` is parsed into a tree of inert
stand-ins (allowlisted globals only; nothing from the file runs), which
:mod:`ckpt_tools.codecs.torchwriter` re-emits exactly as torch's pickler would.
"""

from __future__ import annotations

import io
import os
import pickle
import zipfile
import zlib
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from . import bounded, safefs, torchpickle
from .skeleton import Skeleton
from .zipdir import records_of
from ..errors import BadInput, UnsafeInput, brief

# Legacy typed storages torch.save names in persistent ids, with element sizes (torch.load checks
# that a record holds numel * itemsize bytes; so do we).
STORAGE_ITEMSIZE: dict[str, int] = {
    "DoubleStorage": 8, "FloatStorage": 4, "HalfStorage": 2, "BFloat16Storage": 2, "LongStorage": 8,
    "IntStorage": 4, "ShortStorage": 2, "CharStorage": 1, "ByteStorage": 1, "BoolStorage": 1,
    "ComplexFloatStorage": 8, "ComplexDoubleStorage": 16, "UntypedStorage": 1,
}
_DTYPES = ("float64 float32 float16 bfloat16 complex32 complex64 complex128 int8 int16 int32 int64 uint8 "
           "uint16 uint32 uint64 bool float8_e4m3fn float8_e4m3fnuz float8_e5m2 float8_e5m2fnuz "
           "float8_e8m0fnu float4_e2m1fn_x2").split()
_DT = "torch.distributed"
# Each is admitted by torch's weights_only loader too (the distributed ones once torch.distributed
# is imported), except numpy's: verl's extra_state_*.pt hold numpy RNG state, which the safe loader
# reads once those three are added as safe globals (as ckpt_tools.security.safeload does).
ALLOWED_GLOBALS: frozenset[tuple[str, str]] = frozenset([
    ("collections", "OrderedDict"), ("_codecs", "encode"), ("torch", "Size"), ("torch", "device"),
    ("torch.serialization", "_get_layout"), ("torch._tensor", "_rebuild_from_type_v2"),
    ("torch._utils", "_rebuild_tensor_v2"), ("torch._utils", "_rebuild_tensor_v3"),  # v3: uint16, float8...
    ("torch._utils", "_rebuild_wrapper_subclass"), ("torch.storage", "UntypedStorage"),
    (f"{_DT}.tensor", "DTensor"), (f"{_DT}.device_mesh", "DeviceMesh"),
    (f"{_DT}.tensor._dtensor_spec", "DTensorSpec"), (f"{_DT}.tensor._dtensor_spec", "TensorMeta"),
    (f"{_DT}.tensor._dtensor_spec", "ShardOrderEntry"),
    (f"{_DT}._mesh_layout", "_MeshLayout"), (f"{_DT}._mesh_layout", "_FlatLayout"),
    *((f"{_DT}.tensor.placement_types", n) for n in ("Shard", "Replicate", "Partial", "_StridedShard")),
    *(("torch", n) for n in STORAGE_ITEMSIZE if n != "UntypedStorage"), *(("torch", d) for d in _DTYPES),
    ("numpy", "ndarray"), ("numpy", "dtype"),
    ("numpy.core.multiarray", "_reconstruct"), ("numpy._core.multiarray", "_reconstruct"),
])


class Global(type):
    """A pickled global by name (``GLOBAL module\\nname``), never the real object. Interned, so one
    name is one node and re-emission memoizes it once, as torch's pickler does the real class.

    A node is a class (of this metaclass) with nothing of the real one, so that the C unpickler
    can build the same tree as the Python one (:func:`_fast_parse`): calling it, as REDUCE does,
    gives a :class:`Reduce` node; ``__new__``, as NEWOBJ calls it, a :class:`NewObj` node."""

    _interned: dict[tuple[str, str], Global] = {}

    def __new__(mcls, module: str, name: str) -> Global:
        node = mcls._interned.get((module, name))
        if node is None:
            node = type.__new__(mcls, "Global", (), {"__slots__": (), "__new__": _new_obj})
            type.__setattr__(node, "module", module)
            type.__setattr__(node, "name", name)
            mcls._interned[(module, name)] = node
        return node

    def __init__(cls, module: str, name: str) -> None:
        pass

    def __call__(cls, *args: Any) -> Any:
        return OrderedDict() if cls is _ODICT and not args else Reduce(cls, args)

    def __repr__(cls) -> str:
        return f"Global({cls.module!r}, {cls.name!r})"


@dataclass(eq=False, slots=True)
class Reduce:
    """``func(*args)`` as pickled (REDUCE), e.g. ``_rebuild_tensor_v2(storage, offset, size, ...)``;
    ``state`` is what a following BUILD set. Identity matters: a node used twice is emitted once."""

    func: Global
    args: tuple
    state: Any = None

    def __setstate__(self, state: Any) -> None:  # BUILD, as the C unpickler does it
        if self.state is not None:
            raise BadInput("BUILD twice on one object, which torch.save never writes")
        self.state = state


class NewObj(Reduce):
    """``cls.__new__(cls, *args)`` (NEWOBJ) then BUILD ``state``: how dataclass-like objects such as
    DTensorSpec, DeviceMesh or Shard are pickled; their fields are in ``state``."""

    __slots__ = ()
    cls = property(lambda self: self.func)
    # what the C pickler checks a NEWOBJ's object against (``obj.__class__ is cls``) when
    # :mod:`ckpt_tools.codecs.torchpickler` writes the node; ``type()`` and ``isinstance`` go by
    # the real type, NewObj
    __class__ = property(lambda self: self.func)

    def __repr__(self) -> str:
        return f"NewObj(cls={self.func!r}, args={self.args!r}, state={self.state!r})"


@dataclass(eq=False, slots=True)
class StorageRef:
    """torch's persistent id ``('storage', type, key, location, numel)``. The bytes are the record
    ``data/<key>``; ``numel`` counts elements of ``type`` (bytes for UntypedStorage). One node per
    key, so tied tensors share it."""

    type: Global
    key: str
    location: str
    numel: int

    @property
    def nbytes(self) -> int:
        return self.numel * STORAGE_ITEMSIZE[self.type.name]


def _new_obj(cls: Global, *args: Any) -> NewObj:
    return NewObj(cls, args)


class _Str(str):
    """An empty or one-character string from the pickle. CPython shares one object per such value,
    which would merge strings the file kept apart and turn a BINUNICODE into a BINGET on re-emission;
    a distinct instance keeps the file's memo exact. Equal to, and hashes like, the plain string."""

    __slots__ = ()


_ODICT = Global("collections", "OrderedDict")
_STORAGE = "storage"  # one object for every persistent id, as torch's literal is


def _reduce(func: Any, args: Any) -> Any:
    """REDUCE, as both readers build it: an inert node."""
    if type(func) is not Global or type(args) is not tuple:
        raise BadInput("REDUCE of something other than an allowlisted global")
    return OrderedDict() if func is _ODICT and not args else Reduce(func, args)


def _newobj(cls: Any, args: Any) -> NewObj:
    if type(cls) is not Global or type(args) is not tuple:
        raise BadInput("NEWOBJ of something other than an allowlisted global")
    return NewObj(cls, args)


def _build(inst: Any, state: Any) -> None:
    if isinstance(inst, Reduce) and inst.state is None:
        inst.state = state
    elif type(inst) is OrderedDict and type(state) is dict:  # a state_dict()'s ``_metadata``
        inst.__dict__.update(state)
    else:
        raise BadInput(f"BUILD on a {type(inst).__name__}, which torch.save never writes")


class _Unpickler(pickle._Unpickler):
    """The pure-Python unpickler with each opcode that would call or build something replaced by one
    that builds an inert node; containers stay real (dict, list, tuple, OrderedDict)."""

    dispatch = dict(pickle._Unpickler.dispatch)

    def __init__(self, data: bytes | Any, admit: frozenset[tuple[str, str]] = frozenset()) -> None:
        super().__init__(data if hasattr(data, "read") else io.BytesIO(data))
        self.storages: dict[str, StorageRef] = {}
        self.admit = admit

    def find_class(self, module: str, name: str) -> Global:
        if (module, name) not in ALLOWED_GLOBALS and (module, name) not in self.admit:
            raise UnsafeInput(f"the pickle references {module}.{name}, which is not an allowlisted "
                              "tensor-rebuilding global; refusing to load it (it could run code)")
        return Global(module, name)

    def persistent_load(self, pid: Any) -> StorageRef:
        if not (type(pid) is tuple and len(pid) == 5 and pid[0] == _STORAGE and type(pid[1]) is Global
                and pid[1].name in STORAGE_ITEMSIZE and isinstance(pid[2], str) and isinstance(pid[3], str)
                and type(pid[4]) is int and pid[4] >= 0):
            raise BadInput(f"unexpected persistent id in the pickle: {brief(pid)}")
        _, typ, key, location, numel = pid
        ref = self.storages.get(key)
        if ref is None:
            ref = self.storages[key] = StorageRef(typ, key, location, numel)
        elif (ref.type, ref.location, ref.numel) != (typ, location, numel):
            raise BadInput(f"storage {key!r} is described two different ways in the pickle")
        return ref

    def _load_reduce(self) -> None:
        args = self.stack.pop()
        self.stack[-1] = _reduce(self.stack[-1], args)

    def _load_newobj(self) -> None:
        args, cls = self.stack.pop(), self.stack.pop()
        self.append(_newobj(cls, args))

    def _load_build(self) -> None:
        state = self.stack.pop()
        _build(self.stack[-1], state)

    def _refuse(self) -> None:
        raise BadInput("the pickle uses an opcode torch.save never writes (INST/OBJ/NEWOBJ_EX/EXT/PERSID)")

    def _keep_apart(load):  # noqa: N805 - wraps the string loaders while the class is built
        def load_str(self: _Unpickler) -> None:
            load(self)
            if len(self.stack[-1]) <= 1:
                self.stack[-1] = _Str(self.stack[-1])
        return load_str

    dispatch = bounded.guard_dispatch(dispatch)  # keys checked before they are hashed
    dispatch.update({pickle.REDUCE[0]: _load_reduce, pickle.NEWOBJ[0]: _load_newobj, pickle.BUILD[0]: _load_build})
    for _op in (pickle.INST, pickle.OBJ, pickle.NEWOBJ_EX, pickle.EXT1, pickle.EXT2, pickle.EXT4, pickle.PERSID):
        dispatch[_op[0]] = _refuse
    for _op in (pickle.BINUNICODE, pickle.SHORT_BINUNICODE, pickle.BINUNICODE8, pickle.UNICODE):
        dispatch[_op[0]] = _keep_apart(dispatch[_op[0]])
    del _op, _keep_apart


class _Gate(_Unpickler):
    """Reads a pickle only to check its shape before torch's loader reads it: any global and any
    persistent id is kept as an inert node (torch's loader decides what it admits), while dict
    keys are checked before they are hashed and the tree must pass the bounded walk."""

    def find_class(self, module: str, name: str) -> Global:
        return Global(str(module), str(name))

    def persistent_load(self, pid: Any) -> None:
        return None


def check_structure(f: Any, *, where: str, pickles: int = 1) -> None:
    """Raise ``HostileTree`` if any of the next ``pickles`` pickles in ``f`` (bytes or a binary
    file) holds a structure no reader could get through (runaway depth, sharing, or a dict key
    whose hash never ends); return quietly on anything else, which torch's loader explains.
    Legacy (non-zip) torch.save files are five pickles in a row."""
    f = f if hasattr(f, "read") else io.BytesIO(f)
    for _ in range(pickles):
        try:
            tree = _Gate(f).load()
        except bounded.HostileTree as e:
            raise bounded.HostileTree(f"{where}: {e}") from None
        except Exception:  # noqa: BLE001 - damaged, not hostile: torch's reader says what is wrong
            return
        bounded.check_tree(tree, where=where)


def _cycle(n: Reduce) -> str:
    """What a refusal says of a pickled object that contains itself."""
    what = f"{n.func.module}.{n.func.name}" if isinstance(n.func, Global) else type(n).__name__
    if what.rpartition(".")[2] == "DeviceMesh":
        # the one cycle real saves hold: a sliced or flattened mesh and its root refer to each
        # other (tensor-parallel and other multi-dimensional jobs)
        return (f"its DTensors' {what} refers back to itself, as the sliced or flattened mesh of a "
                "tensor-parallel or multi-dimensional job does; ckpt reads per-rank files saved on 1-D and "
                "HSDP meshes only: save such a job with torch.distributed.checkpoint (DCP), which ckpt reads "
                "and reshards")
    return f"the pickle holds a {what} that contains itself; a checkpoint never does (corrupt or hostile file)"


bounded.register(Reduce, lambda n: (n.func, n.args, n.state), _cycle)
bounded.register(NewObj, lambda n: (n.func, n.args, n.state), _cycle)


def _parse(data: bytes, where: str = "the pickle",
           admit: frozenset[tuple[str, str]] = frozenset()) -> tuple[Any, dict[str, StorageRef]]:
    unpickler = _Unpickler(data, admit)
    try:
        try:  # the same steps in one loop, where it vouches for the whole pickle
            tree = torchpickle.load(data, torchpickle.Nodes(unpickler.find_class, unpickler.persistent_load,
                                                            _reduce, _newobj, _build, _Str))
        except torchpickle.Decline:  # read from the start, so that a refusal is the careful reader's
            unpickler = _Unpickler(data, admit)
            tree = unpickler.load()
    except bounded.HostileTree as e:
        raise bounded.HostileTree(f"{where}: {e}") from None
    except BadInput:
        raise
    except Exception as e:  # noqa: BLE001 - any failure of a damaged or hostile pickle
        raise BadInput(f"{where}: damaged pickle: {type(e).__name__}: {e}") from None
    # before anything walks it: not too deep, no cycle, no exponential sharing
    bounded.check_tree(tree, where=where)
    return tree, unpickler.storages


class _FastUnpickler(pickle.Unpickler):
    """The C unpickler with the same allowlist and persistent ids: for a pickle whose shape the
    careful reader has already proved safe (:class:`~.skeleton.Skeleton`), never for any other.
    Its tree is the careful one's, except that one-character strings are CPython's shared ones
    (so it is described, never re-emitted)."""

    find_class = _Unpickler.find_class
    persistent_load = _Unpickler.persistent_load

    def __init__(self, data: bytes, admit: frozenset[tuple[str, str]]) -> None:
        super().__init__(io.BytesIO(data))
        self.storages: dict[str, StorageRef] = {}
        self.admit = admit


def _fast_parse(data: bytes, where: str, admit: frozenset[tuple[str, str]]) -> tuple[Any, dict[str, StorageRef]]:
    unpickler = _FastUnpickler(data, admit)
    try:
        tree = unpickler.load()
    except BadInput:
        raise
    except Exception as e:  # noqa: BLE001 - a value the careful reader never saw (bad UTF-8, ...)
        raise BadInput(f"{where}: damaged pickle: {type(e).__name__}: {e}") from None
    return tree, unpickler.storages


def loads(data: bytes, *, where: str = "the pickle") -> Any:
    """Parse a torch pickle into a tree of containers, scalars and the nodes above. Raises
    ``UnsafeInput`` for a global off the allowlist, ``HostileTree`` for a tree no walker could
    finish, ``BadInput`` for anything else amiss."""
    return _parse(data, where)[0]


def loads_like(data: bytes, model: Template, *, where: str = "the pickle") -> Any:
    """The tree of ``data``, a pickle that differs from ``model``'s in values only (read as a file
    read ``like`` it is); BadInput if it differs in anything else."""
    if not model.skeleton().same_shape(data):
        raise BadInput(f"{where}: not of the shape of the pickle it was made from")
    return _fast_parse(data, where, model.admit)[0]


def loads_blob(f: Any, *, where: str = "a torch.save blob") -> Any:
    """The tree of a small in-file ``torch.save`` blob (a DCP item), given as a file-like object:
    only its ``data.pkl`` is read, and only when it is stored (not compressed) within the blob.
    Raises ``BadInput`` (``UnsafeInput``, ``HostileTree``) like :func:`loads`."""
    try:
        size = f.seek(0, os.SEEK_END)
        f.seek(0)
        with zipfile.ZipFile(f) as z:
            infos = [i for i in z.infolist() if i.filename.endswith("/data.pkl")]
            if len(infos) != 1:
                raise BadInput(f"{where}: {len(infos)} data.pkl records in a torch.save blob")
            # the zip's own sizes are claims: a deflated record could expand without bound
            if infos[0].compress_type != zipfile.ZIP_STORED or not 0 <= infos[0].file_size <= size:
                raise BadInput(f"{where}: its data.pkl is compressed or claims more bytes than the blob holds")
            data = z.read(infos[0])
    except (zipfile.BadZipFile, ValueError, OSError, KeyError, EOFError) as e:
        raise BadInput(f"{where}: not a readable torch.save blob ({e})") from None
    return loads(data, where=where)


MODELS_TRIED = 2  # ``like`` files a pickle is compared with (see TorchZip)


@dataclass(eq=False)
class Template:
    """A file read the careful way, as files read ``like`` it use it: its pickle (and where that
    holds values), without its tree; see :class:`TorchZip`."""

    pickle: bytes
    admit: frozenset[tuple[str, str]]
    _skeleton: Skeleton | None = None

    def skeleton(self) -> Skeleton:
        if self._skeleton is None:
            self._skeleton = Skeleton(self.pickle)
        return self._skeleton


class TorchZip:
    """A torch.save file: ``prefix`` (its archive folder), ``records`` (name -> Record, file order),
    the raw ``pickle``, its parsed ``tree`` and ``storages`` (key -> StorageRef, first-use order).
    Refuses what torch.load refuses, and TorchScript archives (they carry code). ``admit``: more
    global names a caller's format saves (a framework's own classes, :mod:`.zeroglobals`), kept
    as inert :class:`Global` nodes like every other: named, never imported or constructed."""

    def __init__(self, path: str | os.PathLike, *, admit: frozenset[tuple[str, str]] = frozenset(),
                 like: Sequence[Template] = (), repeats: Callable[[bytes], TorchZip | None] | None = None) -> None:
        self.path, self.admit = Path(path), admit
        self.prefix, self.records = records_of(self.path)
        names = self.records.keys()
        if "constants.pkl" in names or any(n.startswith("code/") for n in names):
            raise UnsafeInput(f"{self.path} is a TorchScript archive (it contains code); refusing to read it")
        if "data.pkl" not in names or not {"version", ".data/version"} & names:
            raise BadInput(f"{self.path}: no {self.prefix}/data.pkl or version record; not a torch.save file")
        if self.records["data.pkl"].size > safefs.MAX_METADATA_BYTES:
            raise BadInput(f"{self.path}: its pickle claims {self.records['data.pkl'].size} bytes; "
                           "corrupt or not a checkpoint file")
        self.pickle = self.read("data.pkl")
        model = repeats(self.pickle) if repeats is not None else None
        if model is not None:
            # ``repeats``: given this pickle, a file the caller read whose pickle this one is with
            # values changed whose place in the tree the caller proved. This file has that
            # tree, changed there, and the same storages: no tree is built (``tree`` None)
            self.exact, self.tree, self.storages = False, None, model.storages
            self._check_storages()
            return
        # ``like``: files of the same job read the careful way; a pickle differing from one's
        # only in values has the same (safe) shape and is read by the C unpickler. Such a tree
        # (``exact`` False) is described, never re-emitted: its short strings are shared.
        # At most MODELS_TRIED of them, nearest in length first (the same length unless ints
        # changed width): a file like none is read the careful way and often becomes a model
        # itself, so trying every one would cost each such file a walk per model.
        models = sorted((t for t in like if t.admit == admit), key=lambda t: abs(len(t.pickle) - len(self.pickle)))
        self.exact = not any(t.skeleton().same_shape(self.pickle) for t in models[:MODELS_TRIED])
        parse = _parse if self.exact else _fast_parse
        self.tree, self.storages = parse(self.pickle, str(self.path), admit)
        self._check_storages()

    def _check_storages(self) -> None:
        size = self.records.size
        for key, ref in self.storages.items():
            if (got := size(f"data/{key}")) != ref.nbytes:
                raise BadInput(f"{self.path}: storage {key} needs {ref.nbytes} bytes but record data/{key} "
                               f"has {'none' if got is None else got}")

    def template(self) -> Template:
        """What files read ``like`` this one need of it (its pickle, not its tree); only a file
        read the careful way is one."""
        if not self.exact:
            raise ValueError(f"{self.path} was read like another file: it is no model for others")
        return self.shape()

    def without_tree(self) -> TorchZip:
        """This file as files read like it need it once its tree is described: its records,
        pickle and storages, not its tree (``tree`` None)."""
        light = object.__new__(TorchZip)
        light.__dict__.update(self.__dict__)
        light.tree = None
        return light

    def shape(self) -> Template:
        """Its pickle as :func:`loads_like` takes a model, to read pickles of its shape by: a
        file read ``like`` another has that one's shape, which the careful reader walked. One
        per file (its skeleton is a scan of the whole pickle)."""
        shape = self.__dict__.get("_shape")
        if shape is None:
            shape = self._shape = Template(self.pickle, self.admit)
        return shape

    def read(self, name: str) -> bytes:
        """A (small) record's bytes, CRC-checked."""
        rec = self.records[name]
        with safefs.open_file(self.path) as f:
            data = os.pread(f.fileno(), rec.size, rec.offset)
        if len(data) != rec.size or zlib.crc32(data) != rec.crc32:
            raise BadInput(f"{self.path}: record {name} fails its CRC check (damaged file)")
        return data

    def part(self, name: str) -> tuple[Path, int, int, int]:
        """``(path, offset, size, crc32)`` of a whole record, for ``TorchZipWriter.copy_record``."""
        rec = self.records[name]
        return (self.path, rec.offset, rec.size, rec.crc32)

    @property
    def serialization_id(self) -> str | None:
        sid = ".data/serialization_id"
        return self.read(sid).decode("ascii", "replace") if sid in self.records else None


_MAX32 = 0xFFFFFFFF
