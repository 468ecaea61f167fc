"""verl's per-rank files built from a plan alone, without torch: for sources that are not
``sharded`` (a DCP, safetensors), where no source rank file can serve as a template.

The pickle tree of each file is what torch's pickler visits for the objects
:class:`ckpt_tools.formats.sharded.Writer`'s torch path builds: a dict of FSDP2 DTensors
(``Shard(0)`` on a 1-D CPU mesh whose process group is named "0"), an int-keyed optimizer state
dict, or the extra state. Storages are numbered in pickle order and filled by the kernel from
the source's bytes (:func:`ckpt_tools.formats.shardtree.write_file`).

How torch pickles a DeviceMesh changes between releases, so this path is used only for the
torch versions it was checked against (:data:`CHECKED_TORCH`, tested against torch's own
writer); any other version, a one-rank mesh, or saved objects that are not plain data take the
torch path.
"""

from __future__ import annotations

import math
import struct
from collections import OrderedDict
from pathlib import Path
from typing import Any

from ..core.describe import ObjectInfo
from ..core.state import param_groups_keyed
from ..security.torchfile import Global, NewObj, Reduce, StorageRef
from .dcpnative import NotNative, STORAGE_OF, Writer as _ObjectReader
from .shardrebuild import Patched
from .shardtree import (DEVICE_MESH, DTENSOR, FROM_TYPE, REBUILD_V2, SHARD, WRAPPER, Emitter, NotSimple,
                        contiguous_stride)

CHECKED_TORCH = ("2.13.",)
SMALL_RECORDS = [(".format_version", b"1"), (".storage_alignment", b"64"), ("byteorder", b"little")]
_SPEC = "torch.distributed.tensor._dtensor_spec"
_LAYOUT = "torch.distributed._mesh_layout"


def available() -> bool:
    """Whether the installed torch pickles DTensors as this module builds them (read from the
    package metadata: no torch import)."""
    from importlib import metadata

    try:
        version = metadata.version("torch")
    except metadata.PackageNotFoundError:
        return False
    return version.startswith(CHECKED_TORCH)


def _local(emitter: Emitter, dtype: str, size: tuple[int, ...], source: Any, *, slots: bool = True) -> Reduce:
    """A fresh contiguous CPU tensor of ``size``. ``slots``: its ints are slots (the rank's, in
    a file that the next files of its kind patch: :class:`Synthesized`), else plain ints (a file
    written once: slots would only cost their notes)."""
    storage = STORAGE_OF.get(str(dtype))
    if storage is None:
        raise NotSimple(f"no legacy storage class for {dtype}")
    if slots:
        emitter.sizes.append(tuple(size))
        return emitter.tensor(Global("torch", storage), "cpu", size, source, (False, OrderedDict()))
    numel = math.prod(size)
    ref = emitter.storage(StorageRef(Global("torch", storage), "", "cpu", numel), numel, source)
    return Reduce(REBUILD_V2, (ref, 0, _fresh(size), contiguous_stride(tuple(size)), False, OrderedDict()))


def _fresh(t: tuple) -> tuple:
    """A new tuple equal to ``t``: torch builds each shape and stride tuple anew, and the pickle
    writes a shared one once (as a memo reference) where torch writes it again."""
    return tuple(list(t))


def mesh(emitter: Emitter, world: int, rank: int, names: tuple[str, ...] | None = None) -> NewObj:
    """The 1-D CPU DeviceMesh ``sharded._mesh`` pickles (process group "0", dimension ``names``)."""
    if world < 2:
        raise NotSimple("a mesh of one device")  # torch lays it out differently
    rank_map = _local(emitter, "int32", (world,), struct.pack(f"<{world}i", *range(world)))
    rank_slot, coordinate = emitter.rank(rank)
    layout = NewObj(Global(_LAYOUT, "_MeshLayout"), (), {
        "axes": (NewObj(Global(_LAYOUT, "_FlatLayout"), (), {"shape": (world,), "stride": (1,)}),)})
    return NewObj(DEVICE_MESH, (), {
        "_device_type": "cpu", "_layout": layout, "_rank_map": rank_map, "_mesh_dim_names": names,
        "_root_mesh": None, "_flatten_rank_map": tuple(range(world)), "_thread_id": None, "_flatten_mapping": {},
        "_rank": rank_slot, "_coordinate_on_dim": (coordinate,), "_hash": None, "_dim_group_names": ["0"]})

def dtensor(local: Reduce, mesh_node: NewObj, shape: tuple[int, ...], dtype: str, layout: Reduce) -> Reduce:
    """``DTensor.from_local(local, mesh, [Shard(0)], shape=shape)`` as torch pickles it."""
    stride = contiguous_stride(tuple(shape))
    dt = Global("torch", str(dtype))
    # torch.device("cpu") reduces to a new "cpu" string each time; storage locations and the
    # mesh's device type share one (the pickle memoizes strings by identity)
    device = Reduce(Global("torch", "device"), ("".join(["cp", "u"]),))
    wrapper = (DTENSOR, dt, _fresh(shape), stride, 0, layout, device, False)
    spec = NewObj(Global(_SPEC, "DTensorSpec"), (), {
        "mesh": mesh_node, "placements": (NewObj(SHARD, (), {"".join(["di", "m"]): 0}),),
        "tensor_meta": NewObj(Global(_SPEC, "TensorMeta"), (Reduce(Global("torch", "Size"), (_fresh(shape),)),
                                                            contiguous_stride(tuple(shape)), dt)),
        "shard_order": (NewObj(Global(_SPEC, "ShardOrderEntry"), _fresh((0, _fresh((0,))))),),
        "use_strided_shard_as_shard_order": False, "_hash": None})
    return Reduce(FROM_TYPE, (WRAPPER, DTENSOR, wrapper, (None, {"_local_tensor": local, "_spec": spec})))


def tree_for(writer: Any, job: Any) -> tuple[Any, Emitter]:
    """The tree of ``job``'s file and the storages that fill it (``writer``: the sharded
    Writer, for the world size, parameter order and keying)."""
    if job.kind == "extra":
        return dict(job.meta["extra"]), Emitter()
    tree, emitter, _ = Synthesized(writer).tree(job)
    return tree, emitter


class Synthesized(Patched):
    """The model or optimizer files of a sharded writer with no source rank files (``writer``):
    the first built from the plan, the next patched (:class:`~.shardrebuild.Patched`). The
    recipe: the plan's targets in pickling order, where the mesh's storage comes among theirs
    (and its bytes), and what else the tree is built from (the plain tensors' names, the saved
    objects)."""

    def __init__(self, writer: Any) -> None:
        super().__init__(writer.world_size)
        self.writer = writer

    def tree(self, job: Any) -> tuple[Any, Emitter, tuple]:
        writer, emitter = self.writer, Emitter()
        if job.objects and job.kind == "model":
            raise NotSimple("non-tensor model entries")
        plain = job.meta.get("plain", ())
        layout = Reduce(Global("torch.serialization", "_get_layout"), ("torch.strided",))  # one object: torch.strided
        mesh_node, order, mesh_at = None, [], None  # mesh_at: (its place among the tensors, its rank map)

        def node(p: Any) -> Reduce:
            # called in the order pickling visits the tensors: storages are numbered in that order
            nonlocal mesh_node, mesh_at
            order.append(p.target)
            local = _local(emitter, p.target.dtype, p.sizes, p)  # before the mesh, as pickling visits them
            if (p.target.group, p.target.name) in plain:
                return local
            if mesh_node is None:
                mesh_node = mesh(emitter, writer.world_size, job.rank or 0, writer.mesh_names)
                mesh_at = (len(order), emitter.records[-1][1])
            return dtensor(local, mesh_node, p.target.shape, p.target.dtype, layout)

        if job.kind == "model":
            tree = {p.target.name: node(p) for p in job.pieces}
        else:
            state = {key: {name: node(p) for name, p in per.items()} for key, per in _optim_state(writer, job).items()}
            opt = object_values(writer.synth, job.objects).get("optimizer", {})
            groups = param_groups_keyed(opt.get("param_groups", []), keyed=writer.keyed, param_order=writer.param_order)
            tree = {"state": state, "param_groups": groups}
        return tree, emitter, (order, mesh_at, plain, tuple(job.objects), job.kind)

    def _replay(self, job: Any, recipe: tuple, emitter: Emitter | None, storage: Any) -> bool:
        order, mesh_at, plain, objects, kind = recipe
        if job.kind != kind or job.meta.get("plain", ()) != plain or tuple(job.objects) != objects:
            return False
        pieces = job.pieces if kind == "model" else [p for per in _optim_state(self.writer, job).values()
                                                     for p in per.values()]
        if len(pieces) != len(order) or any(p.target is not t and p.target != t for p, t in zip(pieces, order)):
            return False
        if storage is not None:
            for i, p in enumerate(pieces, 1):
                storage(p.sizes, p)
                if mesh_at is not None and i == mesh_at[0]:
                    storage((self.world,), mesh_at[1])
                    emitter.rank(job.rank or 0)
        return True


def _optim_state(writer: Any, job: Any) -> dict:
    """An optimizer file's pieces by parameter key and state name, in pickling order."""
    state: dict = {}
    for p in job.pieces:
        key = writer.param_order.index(p.target.param) if writer.keyed == "int" else p.target.param
        state.setdefault(key, {})[p.target.state] = p
    return state


def object_values(root: Path, objects: tuple[ObjectInfo, ...] | list[ObjectInfo]) -> dict:
    """Saved objects (of the checkpoint in ``root``) nested by their paths, read without torch
    (plain data only)."""
    try:
        return _ObjectReader(root=root).values(tuple(objects))
    except NotNative as e:
        raise NotSimple(str(e)) from e
