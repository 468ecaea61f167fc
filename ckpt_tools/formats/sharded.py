"""verl's per-rank layout: ``model_/optim_/extra_state_world_size_{W}_rank_{r}.pt``.

Model files hold FSDP2 DTensor state dicts (``Shard``/``Replicate`` placements on a 1-D or
2-D mesh) or FSDP1 ShardedTensors; optimizer files are int-keyed or FQN-keyed.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import TYPE_CHECKING, Any


from ..describe import Checkpoint, Chunk, FileEntry, Location, ObjectInfo, TensorInfo, chunk_rows
from ..errors import BadInput
from . import optim

if TYPE_CHECKING:
    import torch

PATTERN = re.compile(r"^(model|optim|extra_state)_world_size_(\d+)_rank_(\d+)\.pt$")
CONFIG_NAME = "fsdp_config.json"


def file_name(kind: str, world_size: int, rank: int) -> str:
    return f"{kind}_world_size_{world_size}_rank_{rank}.pt"


def detect(path: Path) -> bool:
    return path.is_dir() and any(PATTERN.match(p.name) for p in path.iterdir())


def _inventory(path: Path) -> tuple[int, dict[str, dict[int, str]]]:
    found: dict[str, dict[int, str]] = {"model": {}, "optim": {}, "extra_state": {}}
    sizes = set()
    for p in path.iterdir():
        m = PATTERN.match(p.name)
        if m:
            kind, ws, rank = m.group(1), int(m.group(2)), int(m.group(3))
            sizes.add(ws)
            found[kind][rank] = p.name
    if len(sizes) != 1:
        raise BadInput(f"{path}: rank files of several world sizes {sorted(sizes)}; keep one save per directory")
    (ws,) = sizes
    config = path / CONFIG_NAME
    if config.is_file():
        try:
            cfg_ws = json.loads(config.read_text()).get("world_size")
        except (OSError, ValueError, AttributeError) as e:
            raise BadInput(f"{config}: not valid JSON ({e})") from e
        if cfg_ws is not None and cfg_ws != ws:
            raise BadInput(f"{path}: file names say world size {ws} but {CONFIG_NAME} says {cfg_ws}")
    if not found["model"]:
        raise BadInput(f"{path}: no model_world_size_{ws}_rank_*.pt files (only optimizer or extra state)")
    for kind, ranks in found.items():
        if ranks and set(ranks) != set(range(ws)):
            missing = sorted(set(range(ws)) - set(ranks))
            extra = sorted(set(ranks) - set(range(ws)))
            what = f"missing ranks {missing}" if missing else f"ranks {extra} beyond the world size"
            raise BadInput(f"{path}: {kind} files at world size {ws} have {what}; "
                           f"expected {file_name(kind, ws, 0)} .. {file_name(kind, ws, ws - 1)}")
    return ws, found


def describe(path: Path) -> Checkpoint:
    import torch

    from ..safeload import load_torch

    ws, found = _inventory(path)
    pieces: dict[tuple[str, str], dict[str, Any]] = {}
    objects: list[ObjectInfo] = []
    entries = [FileEntry(p.name, p.stat().st_size) for p in sorted(path.iterdir()) if p.is_file()]
    if (path / "huggingface").is_dir():
        entries += [FileEntry(str(p.relative_to(path)), p.stat().st_size)
                    for p in sorted((path / "huggingface").rglob("*")) if p.is_file()]
    mesh_shape: tuple[int, ...] | None = None
    param_order: tuple[str, ...] = ()
    details: dict[str, Any] = {"fsdp": None}
    for rank in range(ws):
        name = found["model"][rank]
        sd = load_torch(path / name)
        if not isinstance(sd, dict):
            raise BadInput(f"{path / name}: holds a {type(sd).__name__}, not a state dict")
        order = optim.param_order_from_model(sd)
        if rank == 0:
            param_order = order
        elif order != param_order:
            raise BadInput(f"{path / name}: its parameters differ from rank 0's; the files are not from one save")
        for key, v in sd.items():
            loc = Location(name, "pickled", key=(key,))
            if isinstance(v, torch.Tensor):
                shape, chunk, mesh, kind = _chunk(v, rank, ws, loc, path / name, key)
                details["fsdp"] = details["fsdp"] or kind
                mesh_shape = mesh_shape or mesh
                _add(pieces, ("model", key), shape, v.dtype, chunk, path / name)
            elif rank == 0:
                objects.append(ObjectInfo("model", key, loc, path=("model", key)))
        if rank in found["optim"]:
            oname = found["optim"][rank]
            osd = load_torch(path / oname)
            if not optim.is_optimizer_state(osd):
                raise BadInput(f"{path / oname}: not an optimizer state dict (no 'state'/'param_groups')")
            details["optimizer_keyed"] = "int" if optim.is_int_keyed(osd) else "fqn"
            if rank == 0:
                details["param_groups"] = len(osd["param_groups"])
                objects.append(ObjectInfo("optimizer", "param_groups", Location(oname, "pickled", key=("param_groups",)),
                                          path=("optimizer", "param_groups")))
            for fqn, skey, v, kp in optim.state_entries(osd, param_order):
                tname = f"state.{fqn}.{skey}"
                loc = Location(oname, "pickled", key=kp)
                if isinstance(v, torch.Tensor):
                    shape, chunk, _, _ = _chunk(v, rank, ws, loc, path / oname, tname)
                    _add(pieces, ("optimizer", tname), shape, v.dtype, chunk, path / oname, fqn, skey)
                elif rank == 0:
                    objects.append(ObjectInfo("optimizer", tname, loc, path=("optimizer", *kp)))
        if rank in found["extra_state"]:
            ename = found["extra_state"][rank]
            extra = load_torch(path / ename)
            if not isinstance(extra, dict):
                raise BadInput(f"{path / ename}: holds a {type(extra).__name__}, expected a dict")
            for key in extra:
                objects.append(ObjectInfo("extra", str(key), Location(ename, "pickled", key=(key,)), rank=rank,
                                          path=(key,)))
    tensors = tuple(
        TensorInfo(g, n, p["shape"], p["dtype"], tuple(p["chunks"]), p["param"], p["state"])
        for (g, n), p in pieces.items()
    )
    return Checkpoint("sharded", path, ws, tensors, tuple(objects), tuple(entries), mesh_shape,
                      details, param_order)


def _add(pieces: dict, key: tuple[str, str], shape: tuple[int, ...], dtype: torch.dtype, chunk: Chunk | None,
         file: Path, param: str | None = None, state: str | None = None) -> None:
    entry = pieces.setdefault(key, {"shape": shape, "dtype": dtype, "chunks": [], "param": param, "state": state})
    if entry["shape"] != shape or entry["dtype"] != dtype:
        raise BadInput(f"{file}: tensor {key[1]!r} is {tuple(shape)} {dtype} here but "
                       f"{entry['shape']} {entry['dtype']} on rank 0; the files are not from one save")
    if chunk is not None:
        entry["chunks"].append(chunk)


def _chunk(v: torch.Tensor, rank: int, ws: int, loc: Location, file: Path, name: str):
    """Global shape and the chunk that ``rank`` holds, from a DTensor's placements."""
    from torch.distributed.tensor import DTensor, Replicate, Shard

    from ..fsdp1 import is_sharded_tensor

    if isinstance(v, DTensor):
        mesh = v.device_mesh.mesh
        shape = tuple(v.shape)
        if mesh.numel() != ws:
            raise BadInput(f"{file}: tensor {name!r} lives on a mesh of {mesh.numel()} devices, "
                           f"but the files say world size {ws}")
        coord = (mesh == rank).nonzero()
        if coord.shape[0] != 1:
            raise BadInput(f"{file}: rank {rank} is not in the device mesh of tensor {name!r}")
        coord = coord[0].tolist()
        offsets, sizes = [0] * len(shape), list(shape)
        for mesh_dim, p in enumerate(v.placements):
            if type(p) is Shard:
                d = p.dim
                start, stop = chunk_rows(sizes[d], mesh.shape[mesh_dim], coord[mesh_dim])
                offsets[d] += start
                sizes[d] = stop - start
            elif not isinstance(p, Replicate):
                raise BadInput(f"{file}: tensor {name!r} has placement {p}, which ckpt cannot read yet "
                               "(only Shard and Replicate)")
        local = tuple(v._local_tensor.shape)
        if local != tuple(sizes):
            raise BadInput(f"{file}: tensor {name!r}: rank {rank} holds {local}, but its placement "
                           f"{v.placements} on world size {ws} gives {tuple(sizes)}")
        kind = "FSDP2 (DTensor)"
        return shape, Chunk(tuple(offsets), tuple(sizes), loc, rank), tuple(mesh.shape), kind
    if is_sharded_tensor(v):
        shape = tuple(v.metadata().size)
        mine = v.local_shards()
        if not mine:  # FSDP1 gives trailing ranks no shard of a small tensor
            return shape, None, (ws,), "FSDP1 (ShardedTensor)"
        if len(mine) != 1:
            raise BadInput(f"{file}: tensor {name!r}: rank {rank} holds {len(mine)} local shards; expected 0 or 1")
        sm = mine[0].metadata
        if tuple(mine[0].tensor.shape) != tuple(sm.shard_sizes):
            raise BadInput(f"{file}: tensor {name!r}: rank {rank}'s shard holds {tuple(mine[0].tensor.shape)}, "
                           f"its metadata says {tuple(sm.shard_sizes)}")
        return shape, Chunk(tuple(sm.shard_offsets), tuple(sm.shard_sizes), loc, rank), (ws,), "FSDP1 (ShardedTensor)"
    # A plain tensor (a buffer, or a scalar such as `step`) is a full copy on every rank.
    shape = tuple(v.shape)
    return shape, Chunk((0,) * len(shape), shape, loc, rank), None, None


# -- writing ------------------------------------------------------------------------------

class Writer:
    """verl's layout at world size M: per rank, ``model_`` (``model.state_dict()`` of an
    FSDP2 job: DTensors with ``Shard(0)``), ``optim_`` (``optimizer.state_dict()``, int-keyed
    unless the source's own per-rank files were FQN-keyed) and ``extra_state_`` files, plus
    ``fsdp_config.json``. Files are written through :mod:`ckpt_tools.torchzip`, tensor by
    tensor."""

    single_file = False

    def __init__(self, *, world_size: int, param_order: tuple[str, ...], keyed: str = "int") -> None:
        self.world_size = world_size
        self.param_order = param_order
        self.keyed = keyed

    def write(self, path: Path, job, pieces, objects) -> None:
        from ..state import gather, param_groups_keyed
        from ..torchzip import LazyStorages, from_stream, save

        lazy = LazyStorages()
        provider = from_stream(pieces)

        mesh = _mesh(self.world_size, job.rank)
        if job.kind == "extra":
            obj = job.meta["extra"]
        else:
            values = {}
            for p in job.pieces:
                local = lazy.placeholder(p.sizes, p.target.dtype, provider(p))
                plain = (p.target.group, p.target.name) in job.meta.get("plain", ())
                values[p] = local if plain else _dtensor(local, mesh, p.target.shape)
            if job.kind == "model":
                obj = {p.target.name: values[p] for p in job.pieces}
                obj.update(gather(job.objects, objects).get("model", {}))
            else:
                state: dict = {}
                for p in job.pieces:
                    key = self.param_order.index(p.target.param) if self.keyed == "int" else p.target.param
                    state.setdefault(key, {})[p.target.state] = values[p]
                opt = gather(job.objects, objects).get("optimizer", {})
                groups = param_groups_keyed(opt.get("param_groups", []), keyed=self.keyed,
                                            param_order=self.param_order)
                obj = {"state": state, "param_groups": groups}
        save(obj, path, lazy)

    def finish(self, out: Path, jobs, written: dict) -> None:
        (out / CONFIG_NAME).write_text(json.dumps({"FSDP_version": 2, "world_size": self.world_size}) + "\n")


_MESHES: dict = {}


def _mesh(world_size: int, rank: int | None):
    """A 1-D CPU DeviceMesh for pickling, built without a process group (the loading job's
    own mesh replaces it when it loads the state dict)."""
    import torch

    from torch.distributed.device_mesh import DeviceMesh

    key = (world_size, rank or 0)
    if key not in _MESHES:
        mesh = DeviceMesh("cpu", torch.arange(world_size), _init_backend=False, _rank=rank or 0)
        # a real 1-D FSDP2 mesh names the default process group ("0"); the loading job resolves
        # it when it unpickles, so optimizer states loaded from these files can run collectives
        mesh._dim_group_names = ["0"]
        _MESHES[key] = mesh
    return _MESHES[key]


def _dtensor(local: torch.Tensor, mesh, shape: tuple[int, ...]):
    import torch

    from torch.distributed.tensor import DTensor, Shard

    stride = torch.empty(shape, device="meta").stride()
    return DTensor.from_local(local, mesh, [Shard(0)], run_check=False, shape=torch.Size(shape), stride=stride)
