"""verl's per-rank files read and written as pickle trees, without torch.

:mod:`ckpt_tools.security.torchfile` parses a ``torch.save`` pickle into inert nodes. Here those nodes
are read as what they stand for (a plain tensor, an FSDP2 DTensor with ``Shard(0)`` on a 1-D
mesh), so a sharded checkpoint is described with every chunk a raw byte range of its zip
record; and a destination rank's file is written as its source's tree with the tensor nodes
rebuilt for the new world size, each record copied file to file by the kernel.

Anything outside that well-trodden shape (2-D meshes, FSDP1, strided or non-contiguous
tensors, a mesh this torch version pickles differently) raises :class:`NotSimple`, and the
caller takes the torch path, which handles it.
"""

from __future__ import annotations

import contextvars
import functools
import math
import os
import struct
import sys
from collections import OrderedDict
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..core.describe import Location
from ..codecs.torchpickler import Slot, dumps
from ..codecs.torchwriter import TorchZipWriter
from ..codecs.tensornodes import REBUILD_V2, Local, NotSimple, contiguous_stride, local_of  # noqa: F401 - served here too
from ..errors import BadInput
from ..security import bounded
from ..security.skeleton import int_value, with_ints
from ..security.torchfile import Global, NewObj, Reduce, StorageRef, TorchZip, loads_like
from ..storage.castio import blocks

_T = "torch._utils"
FROM_TYPE = Global("torch._tensor", "_rebuild_from_type_v2")
WRAPPER = Global(_T, "_rebuild_wrapper_subclass")
DTENSOR = Global("torch.distributed.tensor", "DTensor")
SHARD = Global("torch.distributed.tensor.placement_types", "Shard")
REPLICATE = Global("torch.distributed.tensor.placement_types", "Replicate")
DEVICE_MESH = Global("torch.distributed.device_mesh", "DeviceMesh")
# DeviceMesh state as torch 2.10-2.13 pickles it; a mesh with other fields is not rebuilt here
_MESH_FIELDS = {"_device_type", "_layout", "_rank_map", "_mesh_dim_names", "_root_mesh", "_flatten_rank_map",
                "_thread_id", "_flatten_mapping", "_dim_group_names", "_rank", "_coordinate_on_dim", "_hash"}


@dataclass(frozen=True)
class Entry:
    """A top-level entry of a source file (``key`` of file ``file``), by reference: jobs stay
    plain data, whichever process writes them parses the file itself."""

    file: str
    key: Any


@dataclass(frozen=True)
class DTensorNode:
    """An FSDP2 DTensor node on a 1-D mesh: its local tensor, global shape, placement."""

    node: Reduce
    local: Local
    shape: tuple[int, ...]
    sharded: bool  # Shard(0), else Replicate
    world: int
    coord: int
    mesh: NewObj


# False while a checkpoint is described to read only (inspect, a conversion to safetensors): no
# writer will take a rank file's tree as its template, so the first file's is not kept (at 25k
# tensors, ~50 MB held while every other file is parsed)
KEEP_TEMPLATES: contextvars.ContextVar[bool] = contextvars.ContextVar("keep_templates", default=True)


def parsed(path: Path) -> TorchZip:
    """``TorchZip(path)``, parsed once per process while the file is unchanged (describing and
    writing both read the source's trees)."""
    st = os.stat(path)
    return _parsed(str(path), st.st_size, st.st_mtime_ns)


@functools.lru_cache(maxsize=1024)
def _parsed(path: str, size: int, mtime_ns: int) -> TorchZip:
    return TorchZip(path)


def described(path: Path, like: list, repeats: Callable[[bytes], TorchZip | None] | None = None) -> TorchZip:
    """``path`` parsed to be described only (not cached, never re-emitted): read like one of
    ``like`` (files of the same job already parsed) when its pickle has the same shape, else
    parsed as :func:`parsed` does, and then added to ``like`` (a few at most, their pickles
    only: a tree each would hold a many-tensor job's description several times over).
    ``repeats``: as :class:`TorchZip` takes it (a file whose pickle is a template's for its
    rank is not parsed at all: its ``tree`` is None)."""
    if repeats is not None:
        zf = TorchZip(path, like=like, repeats=repeats)
    else:
        # the first: kept, a writer's template (unless nothing will be written from it)
        zf = TorchZip(path, like=like) if like else parsed(path) if KEEP_TEMPLATES.get() else TorchZip(path)
    if zf.exact and len(like) < 8:
        like.append(zf.template())
    return zf


_SENTINEL = (1 << 62) + 0x5EED  # a rank no mesh has, put where a template's rank is to find where it lands


class RankTemplate:
    """A job's rank file as its other ranks repeat it: the pickle of ``model`` (a file parsed)
    is every rank's, but for the int opcodes at ``slots`` (byte
    ranges), which hold the rank. Proved, not assumed (:meth:`learn`): those opcodes land in the
    tree as the rank and coordinate of its one device mesh and nowhere else, and as a pickle is
    read the same whatever its ints' values, a file whose pickle is :meth:`pickle_of` ``(r)`` is
    ``model`` on rank ``r``: the same tensors, their local shapes and storages, on coordinate ``r``.
    Such a file is described from ``model``'s tree, not parsed (a many-rank job's cost was a
    parse and a walk per file)."""

    def __init__(self, pickle: bytes, slots: tuple[tuple[int, int], ...]) -> None:
        self.pickle, self.slots = pickle, slots  # (the model's pickle: not its tree, which is let go)

    def pickle_of(self, rank: int) -> bytes:
        """The model's pickle with ``rank`` in the slots, as the pickler writes that int."""
        return with_ints(self.pickle, ((start, end, rank) for start, end in self.slots))

    @classmethod
    def learn(cls, model: TorchZip, rank: int, other: bytes, other_rank: int) -> RankTemplate | None:
        """The template of ``model`` (rank ``rank``: a file parsed, or read as one it repeats;
        only its pickle is used) if ``other``, the pickle of rank ``other_rank``, differs from
        its pickle only in ints that are their ranks, and those ints are its mesh's rank and
        coordinate only; else None."""
        if rank == other_rank:
            return None
        shape = model.shape()  # (one: its skeleton is a scan of the whole pickle)
        slots = shape.skeleton().differing_values(other)
        if not slots or any(int_value(model.pickle, s, e) != rank or int_value(other, s, e) != other_rank
                            for s, e in slots):
            return None
        template = cls(model.pickle, tuple(slots))
        try:
            probe = loads_like(template.pickle_of(_SENTINEL), shape, where=str(model.path))
        except BadInput:
            return None
        try:
            return template if only_mesh_rank(probe, _SENTINEL) else None
        except NotSimple:  # a mesh pickled another way: the files are parsed one by one
            return None


# the references to a node just popped from a walk's stack that one holder makes: the holder's,
# the walk's name for it and getrefcount's argument. A node held once is met once: a walk notes
# only the others (a 25k-tensor rank file's tree has ~500k containers, whose ids in a set cost 55 MB)
_HELD_ONCE = 3


def only_mesh_rank(tree: Any, value: int) -> bool:
    """Whether ``tree`` holds one DeviceMesh node, whose rank and coordinate are ``value``, and
    ``value`` nowhere else (the int leaves of every node, storages' included, looked at)."""
    meshes: list[NewObj] = []
    seen: set[int] = set()  # the nodes met that are held more than once
    stack = [tree]
    while stack:
        x = stack.pop()
        if type(x) is int:
            if x == value:
                return False
            continue
        if id(x) in seen:
            continue
        if type(x) is NewObj and x.func is DEVICE_MESH:
            seen.add(id(x))
            meshes.append(x)
            state = _state_dict(x)
            stack += [x.args, *state.keys()]
            stack += [v for k, v in state.items() if k not in ("_rank", "_coordinate_on_dim")]
        elif type(x) is StorageRef:
            seen.add(id(x))
            stack += [x.key, x.location, x.numel]
        elif (kids := bounded.children(x)) is not None:  # (leaves are not noted: most of a tree's nodes)
            if sys.getrefcount(x) > _HELD_ONCE + (kids is x):  # (a tuple or list is its own children)
                seen.add(id(x))
            stack += kids
            kids = None  # (a list of them may be new: it must not count as a holder of theirs)
    if len(meshes) != 1:
        return False
    state = _state_dict(meshes[0])
    return state.get("_rank") == value and state.get("_coordinate_on_dim") == (value,)


def _state_dict(node: NewObj | Reduce) -> dict:
    state = node.state
    if type(state) is tuple and len(state) == 2 and state[0] is None:
        state = state[1]
    if type(state) is not dict:
        raise NotSimple("unexpected object state")
    return state


def mesh_names(mesh: NewObj) -> tuple[str, ...] | None:
    """A DeviceMesh node's dimension names (None: unnamed)."""
    names = _state_dict(mesh).get("_mesh_dim_names")
    return tuple(str(n) for n in names) if isinstance(names, (tuple, list)) and names else None


def dtensor_of(node: Any) -> DTensorNode | None:
    """The DTensor a node stands for (None if it is none)."""
    if type(node) is not Reduce or node.func is not FROM_TYPE:
        return None
    args = node.args
    if len(args) != 4 or args[0] is not WRAPPER or args[1] is not DTENSOR:
        raise NotSimple("a tensor subclass other than DTensor")
    wrapper = args[2]
    state = args[3][1] if type(args[3]) is tuple and len(args[3]) == 2 else args[3]
    if type(wrapper) is not tuple or len(wrapper) < 3 or type(state) is not dict:
        raise NotSimple("unexpected DTensor arguments")
    local = local_of(state.get("_local_tensor"))
    spec = state.get("_spec")
    if local is None or type(spec) is not NewObj:
        raise NotSimple("a DTensor without a local tensor and spec")
    spec_state = _state_dict(spec)
    mesh, placements = spec_state.get("mesh"), spec_state.get("placements")
    if type(mesh) is not NewObj or mesh.cls is not DEVICE_MESH or type(placements) is not tuple or len(placements) != 1:
        raise NotSimple("a DTensor on a mesh of several dimensions")
    coord, world = _mesh_facts(mesh)
    (p,) = placements
    if type(p) is NewObj and p.cls is SHARD and _state_dict(p) == {"dim": 0}:
        sharded = True
    elif type(p) is NewObj and p.cls is REPLICATE:
        sharded = False
    else:
        raise NotSimple("a placement other than Shard(0) or Replicate")
    return DTensorNode(node, local, tuple(wrapper[2]), sharded, world, coord[0], mesh)


_MESHES: dict[int, tuple[Any, tuple, int]] = {}


def _mesh_facts(mesh: NewObj) -> tuple[tuple, int]:
    """A 1-D mesh node's coordinate and world size. A file's DTensors share one mesh node, and
    checking its rank map is O(world): done once per node, not once per tensor."""
    got = _MESHES.get(id(mesh))
    if got is not None and got[0] is mesh:  # (the cache holds the node: its id is not reused)
        return got[1], got[2]
    mstate = _state_dict(mesh)
    coord = mstate.get("_coordinate_on_dim")
    world = _mesh_world(mstate)
    if not set(mstate) <= _MESH_FIELDS or type(coord) is not tuple or len(coord) != 1 or world is None:
        raise NotSimple("a device mesh pickled in a way this path does not rebuild")
    if len(_MESHES) >= 4096:
        _MESHES.clear()
    _MESHES[id(mesh)] = (mesh, coord, world)
    return coord, world


def _mesh_world(mstate: dict) -> int | None:
    flat = mstate.get("_flatten_rank_map")
    rank_map = local_of(mstate.get("_rank_map"))
    if type(flat) is not tuple or rank_map is None or rank_map.size != (len(flat),) or flat != tuple(range(len(flat))):
        return None
    return len(flat)


def tensor_location(zf: TorchZip, file: str, local: Local, key: tuple = ()) -> Location:
    """The raw bytes of a local tensor: its storage record, from its offset (``key``: the
    location's, the entry's keys in its file)."""
    start = zf.records.offset(f"data/{local.storage.key}")  # (an int the zip's layout shares)
    if local.offset:
        start += local.offset * local.dtype.itemsize
    return Location(file, "raw", start, local.nbytes, key)


# -- writing ---------------------------------------------------------------------------------

class Emitter:
    """Builds one destination file's tree: new storages numbered in the order they are made,
    each with the byte ranges (or bytes) that fill its record."""

    def __init__(self) -> None:
        self.records: list[tuple[str, Any]] = []  # (key, parts | bytes | piece)
        self.slots: dict[Any, int] = {}  # the values that differ between files of one shape
        self.sizes: list[tuple[int, ...]] = []  # each storage's local sizes, where a replay notes them

    def storage(self, like: StorageRef, numel: int, source: Any) -> StorageRef:
        return StorageRef(like.type, self.record(source), like.location, numel)

    def record(self, source: Any) -> str:
        """A storage filled from ``source``, with no node and no slots; its key."""
        key = str(len(self.records))
        self.records.append((key, source))
        return key

    def account(self, size: tuple[int, ...], source: Any) -> str:
        """A tensor's storage (filled from ``source``) and its slot values (numel, sizes,
        strides), with no node: what :meth:`local` records; its storage key."""
        key = self.record(source)
        size = tuple(size)
        self.slots[(key, "numel")] = math.prod(size)
        self.slots.update({(key, "size", i): n for i, n in enumerate(size)})
        self.slots.update({(key, "stride", i): n for i, n in enumerate(contiguous_stride(size))})
        return key

    def local(self, like: Local, size: tuple[int, ...], source: Any) -> Reduce:
        """``like`` (a source's local tensor) with ``size``, its storage filled from ``source``."""
        return self.tensor(like.storage.type, like.storage.location, size, source, like.node.args[4:])

    def tensor(self, storage: Global, location: str, size: tuple[int, ...], source: Any, rest: tuple) -> Reduce:
        """A contiguous tensor of ``size`` on a new storage of type ``storage`` (filled from
        ``source``), its numel, sizes and strides slots; ``rest``: ``_rebuild_tensor_v2``'s
        arguments after the stride (requires_grad, backward hooks, ...)."""
        key, n = self.account(size, source), len(size)
        slot = self._slot
        ref = StorageRef(storage, key, location, slot((key, "numel")))
        args = (ref, 0, tuple(slot((key, "size", i)) for i in range(n)),
                tuple(slot((key, "stride", i)) for i in range(n)), *rest)
        return Reduce(REBUILD_V2, args)

    def rank(self, rank: int) -> tuple[Slot, Slot]:
        """A mesh's rank and its coordinate on the mesh's one dimension, as slots."""
        self.slots["rank"] = self.slots["coordinate"] = rank
        return self._slot("rank"), self._slot("coordinate")

    def _slot(self, name: Any) -> Slot:
        return Slot(name, self.slots[name])


def rebuild_mesh(mesh: NewObj, emitter: Emitter, world: int, rank: int) -> NewObj:
    """``mesh`` (a 1-D DeviceMesh node) for ``rank`` of ``world``; its cached hashes cleared
    (torch recomputes a None hash on first use)."""
    state = dict(_state_dict(mesh))
    rank_map = local_of(state["_rank_map"])
    itemsize = rank_map.dtype.itemsize
    values = struct.pack(f"<{world}{'q' if itemsize == 8 else 'i'}", *range(world))
    state["_rank_map"] = emitter.local(rank_map, (world,), values)
    state["_flatten_rank_map"] = tuple(range(world))
    state["_layout"] = _relayout(state["_layout"], world)
    state["_rank"], coordinate = emitter.rank(rank)
    state["_coordinate_on_dim"] = (coordinate,)
    if "_hash" in state:
        state["_hash"] = None
    return NewObj(mesh.cls, mesh.args, (None, state) if type(mesh.state) is tuple else state)


def _relayout(node: Any, world: int) -> Any:
    """The mesh layout with its one dimension's size set to ``world``."""
    if world == 1:  # torch lays out a one-device mesh differently (a size-1 dim has no stride)
        raise NotSimple("a mesh of one device")
    if type(node) is NewObj:
        return NewObj(node.cls, node.args, _relayout(node.state, world))
    if type(node) is tuple:
        return tuple(_relayout(x, world) for x in node)
    if type(node) is dict:
        out = {k: _relayout(v, world) for k, v in node.items()}
        if "shape" in out:
            if type(out["shape"]) is not tuple or len(out["shape"]) != 1 or out.get("stride") != (1,):
                raise NotSimple("a mesh layout of several dimensions")
            out["shape"] = (world,)
        return out
    return node


def rebuild_dtensor(d: DTensorNode, local: Reduce, mesh: NewObj) -> Reduce:
    """``d`` with a new local tensor and mesh (its global shape and placement unchanged)."""
    args = d.node.args
    outer = args[3]
    state = dict(outer[1] if type(outer) is tuple else outer)
    spec = state["_spec"]
    spec_state = dict(_state_dict(spec))
    spec_state["mesh"] = mesh
    if "_hash" in spec_state:
        spec_state["_hash"] = None
    state["_local_tensor"] = local
    state["_spec"] = NewObj(spec.cls, spec.args, (None, spec_state) if type(spec.state) is tuple else spec_state)
    return Reduce(FROM_TYPE, (args[0], args[1], args[2], (outer[0], state) if type(outer) is tuple else state))


def map_tensors(tree: Any, fn: Callable[[tuple, Any], Any], path: tuple = ()) -> Any:
    """A copy of the containers of ``tree`` with each tensor node replaced by ``fn(path, node)``
    (path: the keys that reach it, as descriptions record them)."""
    if type(tree) is Reduce and tree.func in (REBUILD_V2, FROM_TYPE):
        return fn(path, tree)
    if isinstance(tree, dict):
        out = type(tree)() if type(tree) in (dict, OrderedDict) else {}
        for k, v in tree.items():
            out[k] = map_tensors(v, fn, (*path, k))
        if type(tree) is OrderedDict and tree.__dict__:
            out.__dict__.update(tree.__dict__)
        return out
    if type(tree) is list:
        return [map_tensors(v, fn, (*path, i)) for i, v in enumerate(tree)]
    return tree


def write_file(path: Path, pickled: bytes, small_records: list[tuple[str, bytes]],
               fill: Iterator[tuple[str, Any]], *, prefix: str | None = None, page_phase: bool = True) -> None:
    """Write a torch.save zip: the pickle, ``small_records`` (as the source had them), then each
    storage record, in key order, from ``fill`` ((key, parts or bytes)). ``prefix``: the
    archive's folder (default: the file's stem, as ``torch.save(path)`` names it); without
    ``page_phase``, records are aligned as torch aligns them (no page of padding that no CRC
    covers: what a lone file without a manifest needs). ``pickled``: its tree's pickle."""
    with TorchZipWriter(path, prefix or path.stem, page_phase=page_phase) as out:
        out.write_record("data.pkl", pickled)
        for name, data in small_records:
            out.write_record(name, data)
        for key, source in fill:
            if isinstance(source, (bytes, bytearray, memoryview)):
                out.write_record(f"data/{key}", bytes(source))
            elif hasattr(source, "dst"):  # a castio.CastSpan: converted block by block
                out.write_stream(f"data/{key}", source.nbytes, blocks(source))
            else:
                out.copy_record(f"data/{key}", source)


def small_records(zf: TorchZip) -> list[tuple[str, bytes]]:
    """The records torch writes between the pickle and the storages (format version, alignment,
    byte order), copied as the source has them."""
    return [(n, zf.read(n)) for n in zf.records
            if n not in ("data.pkl", "version", ".data/version", ".data/serialization_id") and not n.startswith("data/")]


def same_value(a: tuple[TorchZip, Any], b: tuple[TorchZip, Any]) -> bool:
    """Two subtrees (of two files) stand for equal values: the same pickle, the same bytes in
    every storage they use."""
    (za, ta), (zb, tb) = a, b
    if dumps(ta) != dumps(tb):
        return False
    refs_a, refs_b = storages_in(ta), storages_in(tb)
    for ra, rb in zip(refs_a, refs_b):
        if za.read(f"data/{ra.key}") != zb.read(f"data/{rb.key}"):
            return False
    return len(refs_a) == len(refs_b)


def storages_in(tree: Any) -> list[StorageRef]:
    """Every storage a subtree uses, once each, in pickle order."""
    seen: dict[int, StorageRef] = {}

    def walk(x: Any) -> None:
        if type(x) is StorageRef:
            seen.setdefault(id(x), x)
        elif type(x) in (Reduce, NewObj):
            walk(x.args)
            walk(x.state)
        elif isinstance(x, dict):
            for k, v in x.items():
                walk(k)
                walk(v)
        elif type(x) in (list, tuple):
            for v in x:
                walk(v)

    walk(tree)
    return list(seen.values())


def renumber(tree: Any, zf: TorchZip, emitter: Emitter, leaf: Callable[[Any], Any] | None = None) -> Any:
    """A copy of ``tree`` (from file ``zf``) whose storages are new ones of ``emitter``, each
    filled from the source record it replaces. ``leaf(x)``: a writer's own node types, replaced
    by what it returns (None for any other node)."""
    new: dict[int, StorageRef] = {}
    memo: dict[int, Any] = {}

    def copy(x: Any) -> Any:
        if type(x) is StorageRef:
            if id(x) not in new:
                new[id(x)] = emitter.storage(x, x.numel, [zf.part(f"data/{x.key}")])
            return new[id(x)]
        if leaf is not None and (out := leaf(x)) is not None:
            return out
        if id(x) in memo:
            return memo[id(x)]
        if type(x) in (Reduce, NewObj):
            out = type(x)(x.func if type(x) is Reduce else x.cls, copy(x.args), copy(x.state))
        elif type(x) is OrderedDict:
            out = OrderedDict((k, copy(v)) for k, v in x.items())
            out.__dict__.update(x.__dict__)
        elif type(x) is dict:
            out = {k: copy(v) for k, v in x.items()}
        elif type(x) is list:
            out = [copy(v) for v in x]
        elif type(x) is tuple:
            out = tuple(copy(v) for v in x)
        else:
            return x
        memo[id(x)] = out
        return out

    return copy(tree)


def with_crcs(parts: Sequence[tuple[Path, int, int]], crc_of: Callable[[Path, int, int], int | None],
              copies: Sequence | None = None) -> Sequence[tuple]:
    """Span parts, each with the CRC of the source record it is the whole of (so the record's
    CRC is combined, not recomputed from the bytes) when every part is one; else ``parts``.
    ``copies``: the plan's copies the parts are of; a part is no whole record where its copy is
    not a whole chunk (most parts of a reshard to other ranks: a few rows of a chunk), so then
    nothing is looked up. A plan's ``TILED`` copies (worked out when read) are not looked at:
    each part's lookup answers as well."""
    if type(copies) is tuple and any(c.sizes != c.chunk.sizes for c in copies):
        return parts
    out = []
    for path, offset, length in parts:
        crc = crc_of(path, offset, length)
        if crc is None:  # (most parts of a reshard to other ranks: a few rows of a record)
            return parts
        out.append((path, offset, length, crc))
    return out


__all__ = ["NotSimple", "Entry", "Local", "DTensorNode", "local_of", "dtensor_of", "tensor_location", "Emitter",
           "rebuild_mesh", "rebuild_dtensor", "map_tensors", "write_file", "small_records", "same_value",
           "renumber", "with_crcs"]
