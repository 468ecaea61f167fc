"""verl's per-rank layout: ``model_/optim_/extra_state_world_size_{W}_rank_{r}.pt``.

Model files hold FSDP2 DTensor state dicts (``Shard``/``Replicate`` placements on a 1-D or
2-D mesh) or FSDP1 ShardedTensors; optimizer files are int-keyed or FQN-keyed.
"""

from __future__ import annotations

import functools
import json
import re
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ..codecs.torchpickler import dumps
from ..core.describe import (Checkpoint, Chunk, ChunkColumns, FileEntry, Location, ObjectInfo, Palette, TensorInfo,
                             chunk_rows)
from ..core.dtypes import DType
from ..core.plan import Span, by_piece, Piece
from ..core.state import gather, param_groups_keyed
from ..errors import BadInput
from ..security import safefs
from ..security.torchfile import TorchZip
from ..security.zipdir import records_of
from ..storage.castio import CastSpan
from . import flatparams, ranknames, rankread, shardedtensor, shardtree, optim, shardsynth
from .hf import tensor_bytes
from .shardsynth import SMALL_RECORDS
from .shardrebuild import Patched, Rebuilt
from .shardtree import NotSimple

if TYPE_CHECKING:
    import torch

PATTERN = re.compile(r"^(model|optim|extra_state)_world_size_(\d+)_rank_(\d+)\.pt$")
CONFIG_NAME = "fsdp_config.json"
# source files whose record CRCs a writer keeps at once (the tables of a 256-rank job's 770
# files, all kept, were 45 MB; each output file reads a few neighbouring source files)
_CRC_TABLES = 64


def file_name(kind: str, world_size: int, rank: int) -> str:
    return f"{kind}_world_size_{world_size}_rank_{rank}.pt"


def detect(path: Path) -> bool:
    return path.is_dir() and (any(PATTERN.match(p.name) for p in path.iterdir()) or ranknames.find(path) is not None)


def read_config(path: Path) -> dict:
    """The directory's ``fsdp_config.json`` (``{}`` when there is none)."""
    config = path / CONFIG_NAME
    if not config.is_file():
        return {}
    raw = safefs.read_capped(config, safefs.MAX_JSON_BYTES)
    try:
        value = json.loads(raw)
    except (ValueError, RecursionError) as e:
        raise BadInput(f"{config}: not valid JSON ({e})") from e
    if not isinstance(value, dict):
        raise BadInput(f"{config}: holds a {type(value).__name__}, expected an object")
    return value


def _inventory(path: Path) -> tuple[int, dict[str, dict[int, str]]]:
    found: dict[str, dict[int, str]] = {"model": {}, "optim": {}, "extra_state": {}}
    sizes = set()
    for p in path.iterdir():
        m = PATTERN.match(p.name)
        if m:
            kind, ws, rank = m.group(1), int(m.group(2)), int(m.group(3))
            sizes.add(ws)
            found[kind][rank] = p.name
    named = ranknames.find(path) if not sizes else None
    if named is not None:  # rank files the user named (model_rank{r}.pt)
        sizes, found = {named[0]}, named[1]
    if len(sizes) != 1:
        raise BadInput(f"{path}: rank files of several world sizes {sorted(sizes)}; keep one save per directory")
    for names in found.values():
        for name in names.values():
            safefs.require_regular(safefs.resolve_inside(path, name, what=str(path)))
    (ws,) = sizes
    cfg_ws = read_config(path).get("world_size")
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
    ws, found = _inventory(path)
    names = sorted(n for kind, ranks in found.items() for n in ranks.values() if not PATTERN.match(n))
    try:
        ckpt = _describe_trees(path, ws, found)
    except (NotSimple, TypeError, ValueError, KeyError, IndexError, AttributeError):
        # anything the tree reader does not know: torch's reader (weights_only) decides
        ckpt = _describe_torch(path, ws, found)
    # files named by the user: the format's own, though not by verl's names
    return replace(ckpt, details={**ckpt.details, "rank_files": names}) if names else ckpt


def _entries(path: Path) -> list[FileEntry]:
    entries = [FileEntry(p.name, p.stat().st_size) for p in sorted(path.iterdir()) if p.is_file()]
    if (path / "huggingface").is_dir():
        entries += [FileEntry(str(p.relative_to(path)), p.stat().st_size)
                    for p in sorted((path / "huggingface").rglob("*")) if p.is_file()]
    return entries


def _describe_trees(path: Path, ws: int, found: dict[str, dict[int, str]]) -> Checkpoint:
    """The common case without torch: FSDP2 DTensors (Shard(0) or Replicate on a 1-D mesh) and
    plain tensors, every chunk a raw byte range of its storage record. NotSimple otherwise.

    Each kind's rank 0 file is parsed. Every other rank whose pickle is rank 0's with its own
    rank, and its own rows and storage sizes, in the places those are proved to be
    (:class:`~.rankrows.RowsTemplate`) holds rank 0's entries, on its own coordinate: its chunks
    are rank 0's on its rows (:func:`.rankread.repeat`), at its own records' places. Where that
    template is not learned, rank 1's file is parsed too, and files that differ from one parsed
    only in their rank (:class:`~.shardtree.RankTemplate`) repeat it (:class:`~.rankread.Kind`)."""
    pieces: dict[tuple[str, str], dict[str, Any]] = {}
    # (the files and values of the tensors' chunk columns, shared)
    add = functools.partial(_add, chunk_files=([], {}, Palette()))
    objects: list[ObjectInfo] = []
    param_order: tuple[str, ...] = ()
    details: dict[str, Any] = {"fsdp": None}
    kinds = {"model": rankread.Kind(ws), "optim": rankread.Kind(ws)}  # rank files read so far, by kind
    for rank in range(ws):
        name = found["model"][rank]
        file = path / name
        zf, entries, coord, base = kinds["model"].read(file, rank, lambda sd, file=file: rankread.model_entries(sd, file))
        if coord is not None:
            rankread.repeat(base.table, rank, ws, zf, name, kinds["model"].rows)
        else:
            order, seen, table = [], set(), None if base is None else base.table
            for key, d, local in entries:
                if d is not None:
                    # tied parameters: two names, one storage; the optimizer numbers it once
                    if (local.storage.key, local.offset) not in seen:
                        order.append(key)
                        seen.add((local.storage.key, local.offset))
                    shape, chunk = rankread.tree_chunk(d, rank, ws, zf, name, key)
                    details["fsdp"] = "FSDP2 (DTensor)"
                    if "mesh_dim_names" not in details:  # a loading job's mesh must have the same names
                        details["mesh_dim_names"] = shardtree.mesh_names(d.mesh)
                else:
                    loc = shardtree.tensor_location(zf, name, local, (key,))
                    shape, chunk = local.size, Chunk((0,) * len(local.size), local.size, loc, rank)
                add(pieces, ("model", key), shape, local.dtype, chunk, file, table=table, d=d, local=local)
            if not order:
                raise shardtree.NotSimple("no DTensor parameters")
            if rank == 0:
                param_order = tuple(order)
            elif tuple(order) != param_order:
                raise BadInput(f"{path / name}: its parameters differ from rank 0's; the files are not from one save")
        if rank in found["optim"]:
            oname = found["optim"][rank]
            ofile = path / oname

            def entries_of(osd: Any, ofile: Path = ofile, rank: int = rank) -> list:
                _optimizer_header(osd, ofile, rank, details, objects)
                return rankread.optim_entries(osd, param_order)

            zo, oentries, ocoord, obase = kinds["optim"].read(ofile, rank, entries_of)
            if ocoord is not None:
                rankread.repeat(obase.table, rank, ws, zo, oname, kinds["optim"].rows)
                oentries = ()
            table = None if obase is None or ocoord is not None else obase.table
            for tname, fqn, skey, kp, d, local in oentries:
                if d is not None:
                    shape, chunk = rankread.tree_chunk(d, rank, ws, zo, oname, tname, key=kp)
                else:
                    loc = shardtree.tensor_location(zo, oname, local, kp)
                    shape, chunk = local.size, Chunk((0,) * len(local.size), local.size, loc, rank)
                add(pieces, ("optimizer", tname), shape, local.dtype, chunk, ofile, fqn, skey,
                    table=table, d=d, local=local)
        if rank in found["extra_state"]:
            ename = found["extra_state"][rank]
            _extra_objects(rankread.tree_of(path / ename).tree, path / ename, rank, objects)
        zf = zo = entries = oentries = d = local = None  # (let go before the next rank's: ~50 MB at 25k tensors)
    param_order = _check_flat_optimizer(path, pieces, details, param_order, objects)
    return Checkpoint("sharded", path, ws, _tensors(pieces), tuple(objects), tuple(_entries(path)), (ws,),
                      details, param_order)


def _check_flat_optimizer(path: Path, pieces: dict, details: dict, param_order: tuple[str, ...],
                          objects: list[ObjectInfo]) -> tuple[str, ...]:
    """FSDP1 with ``use_orig_params=False`` (verl's ``strategy: fsdp``) saves the optimizer's
    state per *flat* parameter: one padded 1-D shard per FSDP unit, int-keyed by unit. Which
    parameters a unit holds is not in the files: the state is left out of the tensors (noted in
    ``details``, so writers of optimizer state refuse it) and kept in ``details["flat_state"]``,
    one 1-D tensor per unit and state (rank r's shard at ``r * S``), for a layout that knows the
    units to map onto parameters (:mod:`.flatparams`). Recognised by state whose shape is not
    its parameter's. An int-keyed optimizer over some parameters only is renamed instead
    (:func:`.optim.renumber`). Returns the parameters the optimizer's ids number."""
    param_order = optim.renumber(pieces, param_order, objects) or param_order
    if read_config(path).get("FSDP_version") == 1 and details.get("fsdp") != shardedtensor.KIND:
        details["fsdp"] = "FSDP1"
    flat = []
    for (group, name), p in pieces.items():
        model = pieces.get(("model", p["param"] or ""))
        if group == "optimizer" and p["state"] != "step" and p["shape"] and (model is None or model["shape"] != p["shape"]):
            flat.append(name)
    if not flat:
        return param_order
    first = pieces[("optimizer", flat[0])]
    ids = {pieces[("optimizer", n)]["param"] for n in flat}
    details["optimizer_flat"] = (
        f"its optimizer state is held per FSDP1 flat parameter ({len(ids)} with state; the first holds "
        f"{first['state']} of shape {first['shape']}), not per parameter; which parameters each flat parameter "
        "holds, in what order and with what padding is not saved in the checkpoint")
    details["fsdp"] = "FSDP1 (flat parameters)"
    details["flat_state"] = flatparams.collect(pieces, param_order)
    for key in [k for k in pieces if k[0] == "optimizer"]:
        del pieces[key]
    return param_order


def _extra_objects(extra: Any, file: Path, rank: int, objects: list[ObjectInfo]) -> None:
    """One rank-local object per top-level key of an extra_state file."""
    if not isinstance(extra, dict):
        raise BadInput(f"{file}: holds a {type(extra).__name__}, expected a dict")
    for key in extra:
        objects.append(ObjectInfo("extra", str(key), Location(file.name, "pickled", key=(key,)), rank=rank,
                                  path=(key,)))


def _tensors(pieces: dict[tuple[str, str], dict[str, Any]]) -> tuple[TensorInfo, ...]:
    return tuple(TensorInfo(g, n, p["shape"], p["dtype"], p["chunks"].chunks(), p["param"], p["state"])
                 for (g, n), p in pieces.items())


def _optimizer_header(osd: Any, file: Path, rank: int, details: dict, objects: list[ObjectInfo]) -> None:
    """Check an optimizer file's top level; note its keying and (rank 0) its param_groups."""
    if not optim.is_optimizer_state(osd):
        raise BadInput(f"{file}: not an optimizer state dict (no 'state'/'param_groups')")
    details["optimizer_keyed"] = "int" if optim.is_int_keyed(osd) else "fqn"
    if rank == 0:
        details["param_groups"] = len(osd["param_groups"])
        objects.append(ObjectInfo("optimizer", "param_groups", Location(file.name, "pickled", key=("param_groups",)),
                                  path=("optimizer", "param_groups")))


def _describe_torch(path: Path, ws: int, found: dict[str, dict[int, str]]) -> Checkpoint:
    import torch
    from torch.distributed.tensor import DTensor

    from ..security.safeload import load_torch

    pieces: dict[tuple[str, str], dict[str, Any]] = {}
    # (the files and values of the tensors' chunk columns, shared)
    add = functools.partial(_add, chunk_files=([], {}, Palette()))
    objects: list[ObjectInfo] = []
    entries = _entries(path)
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
                if isinstance(v, DTensor) and "mesh_dim_names" not in details:
                    names = v.device_mesh.mesh_dim_names
                    details["mesh_dim_names"] = tuple(names) if names else None
                mesh_shape = mesh_shape or mesh
                add(pieces, ("model", key), shape, v.dtype, chunk, path / name)
            elif rank == 0:
                objects.append(ObjectInfo("model", key, loc, path=("model", key)))
        if rank in found["optim"]:
            oname = found["optim"][rank]
            osd = load_torch(path / oname)
            _optimizer_header(osd, path / oname, rank, details, objects)
            for fqn, skey, v, kp in optim.state_entries(osd, param_order):
                tname = f"state.{fqn}.{skey}"
                loc = Location(oname, "pickled", key=kp)
                if isinstance(v, torch.Tensor):
                    shape, chunk, _, _ = _chunk(v, rank, ws, loc, path / oname, tname)
                    add(pieces, ("optimizer", tname), shape, v.dtype, chunk, path / oname, fqn, skey)
                elif rank == 0:
                    objects.append(ObjectInfo("optimizer", tname, loc, path=("optimizer", *kp)))
        if rank in found["extra_state"]:
            ename = found["extra_state"][rank]
            _extra_objects(load_torch(path / ename), path / ename, rank, objects)
    param_order = _check_flat_optimizer(path, pieces, details, param_order, objects)
    return Checkpoint("sharded", path, ws, _tensors(pieces), tuple(objects), tuple(entries), mesh_shape,
                      details, param_order)


def _add(pieces: dict, key: tuple[str, str], shape: tuple[int, ...], dtype: DType, chunk: Chunk | None,
         file: Path, param: str | None = None, state: str | None = None, *, table: list | None = None,
         d: shardtree.DTensorNode | None = None, local: shardtree.Local | None = None,
         chunk_files: tuple[list[str], dict[str, int], Palette]) -> None:
    """``chunk`` added to tensor ``key``'s columns (``chunk_files``: their files and values; ``table``: noted
    there, with its DTensor ``d`` and local tensor, for :func:`.rankread.repeat` to place on another rank)."""
    dtype = DType.of(dtype)
    entry = pieces.get(key)
    if entry is None:
        entry = pieces[key] = {"shape": shape, "dtype": dtype, "chunks": ChunkColumns(*chunk_files),
                               "param": param, "state": state}
    elif entry["shape"] != shape or entry["dtype"] is not dtype and entry["dtype"] != dtype:
        # (a rank file read as rank 0's repeats its very objects: compared by identity first)
        raise BadInput(f"{file}: tensor {key[1]!r} is {tuple(shape)} {dtype} here but "
                       f"{entry['shape']} {entry['dtype']} on rank 0; the files are not from one save")
    if chunk is not None:
        entry["chunks"].append(chunk)
        if table is not None:  # (the rows of a Shard(0) DTensor's tensor: placed by rank)
            rows = shape[0] if d is not None and d.sharded and shape else None
            table.append((entry["chunks"], rows, key[1], chunk, f"data/{local.storage.key}",
                          local.offset * local.dtype.itemsize))


def _chunk(v: torch.Tensor, rank: int, ws: int, loc: Location, file: Path, name: str):
    """Global shape and the chunk that ``rank`` holds, from a DTensor's placements."""
    from torch.distributed.tensor import DTensor, Replicate, Shard

    from ..security.fsdp1 import is_sharded_tensor

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
            return shape, None, (ws,), shardedtensor.KIND
        if len(mine) != 1:
            raise BadInput(f"{file}: tensor {name!r}: rank {rank} holds {len(mine)} local shards; expected 0 or 1")
        sm = mine[0].metadata
        if tuple(mine[0].tensor.shape) != tuple(sm.shard_sizes):
            raise BadInput(f"{file}: tensor {name!r}: rank {rank}'s shard holds {tuple(mine[0].tensor.shape)}, "
                           f"its metadata says {tuple(sm.shard_sizes)}")
        return shape, Chunk(tuple(sm.shard_offsets), tuple(sm.shard_sizes), loc, rank), (ws,), shardedtensor.KIND
    # A plain tensor (a buffer, or a scalar such as `step`) is a full copy on every rank.
    shape = tuple(v.shape)
    return shape, Chunk((0,) * len(shape), shape, loc, rank), None, None


# -- writing ------------------------------------------------------------------------------

class Writer:
    """verl's layout at world size M: per rank, ``model_`` (``model.state_dict()`` of an
    FSDP2 job: DTensors with ``Shard(0)``), ``optim_`` (``optimizer.state_dict()``, int-keyed
    unless the source's own per-rank files were FQN-keyed) and ``extra_state_`` files, plus
    ``fsdp_config.json``.

    From a sharded source read without torch (``template``: its directory), each file is the
    source rank 0 file's pickle tree rebuilt for the new rank (:mod:`.shardtree`) and its storage
    records are copied file to file; otherwise files go through :mod:`ckpt_tools.codecs.torchzip`
    (torch.save, tensor by tensor)."""

    single_file = False

    def __init__(self, *, world_size: int, param_order: tuple[str, ...], keyed: str = "int",
                 template: Path | None = None, src_world: int | None = None, config: dict | None = None,
                 synth: Path | None = None, mesh_names: tuple[str, ...] | None = None,
                 sharded_tensors: bool = False, fsdp_version: int = 2, flat_units: tuple = ()) -> None:
        self.world_size = world_size
        # FSDP1 flat parameters (core.flat.Unit): optimizer files hold their padded shards
        self.flat_units = flat_units
        # FSDP1 SHARDED_STATE_DICT files: ShardedTensors (torch's writer), not DTensors
        self.sharded_tensors = sharded_tensors
        self.fsdp_version = fsdp_version
        # the device mesh's dimension names: a loading job's DTensors must be on a mesh of the
        # same names (load_state_dict refuses to copy across meshes); verl names its ("fsdp",)
        self.mesh_names = mesh_names
        self.config = config or {}
        self.param_order = param_order
        self.keyed = keyed
        # a sharded source read without torch: each file is its source's tree, rebuilt
        self.template, self.src_world = template, src_world
        # any other source (its base directory, for saved objects): trees built from the plan
        self.synth = synth
        self._zips: dict[str, TorchZip] = {}
        self._crcs: dict[str, dict[tuple[int, int], int]] = {}  # the latest _CRC_TABLES files'
        self._rebuilt: dict[str, Patched] = {}  # kind -> its files, from the template or the plan

    def __getstate__(self) -> dict:
        # parsed files stay in the process that parsed them
        return {**self.__dict__, "_zips": {}, "_crcs": {}, "_rebuilt": {}}

    def _rebuild(self, job) -> Patched | None:
        """How ``job``'s file is built, the first of its kind whole and the next patched: from
        the source's rank-0 file of its kind, or from the plan (None: neither)."""
        if job.kind not in ("model", "optim") or self.template is None and self.synth is None:
            return None
        if job.kind not in self._rebuilt:
            if self.template is None:
                self._rebuilt[job.kind] = shardsynth.Synthesized(self)
            else:
                template = self._zip(file_name("model" if job.kind == "model" else "optim", self.src_world, 0))
                self._rebuilt[job.kind] = Rebuilt(template, self.world_size)
        return self._rebuilt[job.kind]

    @property
    def accepts_spans(self) -> bool:
        return self.template is not None or self.synth is not None

    @property
    def accepts_casts(self) -> bool:
        return self.synth is not None  # a rebuilt source file never casts

    def _zip(self, name: str) -> TorchZip:
        if name not in self._zips:
            self._zips[name] = shardtree.parsed(self.template / name)
        return self._zips[name]

    def _record_crc(self, path: Path, offset: int, length: int) -> int | None:
        """The CRC-32 of the source record that is exactly ``length`` bytes at ``offset`` of
        ``path`` (so a copied record's CRC is combined, not recomputed), else None."""
        key = str(path)  # (asked once per copied record: a str hashes faster than a Path)
        crcs = self._crcs.get(key)
        if crcs is None:
            path = Path(path)
            # (not the pickle: most files are not templates)
            crcs = {} if path.parent != self.template else records_of(path)[1].crcs_by_place()
            if len(self._crcs) >= _CRC_TABLES:  # the oldest goes: the writer moves on from file to file
                del self._crcs[next(iter(self._crcs))]
            self._crcs[key] = crcs
        return crcs.get((offset, length))

    def entry(self, entry: shardtree.Entry) -> tuple[TorchZip, Any]:
        zf = self._zip(entry.file)
        return zf, zf.tree[entry.key]

    def tree_for(self, job) -> tuple[Any, shardtree.Emitter, TorchZip]:
        """The tree of ``job``'s file, built from the source rank 0 file of its kind, and the
        storages that fill it. Raises NotSimple where only the torch path can write it."""
        if self.synth is not None:
            return (*shardsynth.tree_for(self, job), None)
        emitter = shardtree.Emitter()
        if job.kind == "extra":
            tree = {}
            for key, entry in job.meta["extra"].items():
                zf, subtree = self.entry(entry)
                tree[key] = shardtree.renumber(subtree, zf, emitter)
            source = self._zip(file_name("extra_state", self.src_world, 0))
            return tree, emitter, source
        rebuilt = self._rebuild(job)
        tree, emitter, _ = rebuilt.tree(job)
        return tree, emitter, rebuilt.template

    def check(self, job) -> None:
        """NotSimple unless ``job``'s file can be written from the source's trees (a dry run)."""
        rebuilt = self._rebuild(job)
        if rebuilt is None:
            self.tree_for(job)
        else:
            rebuilt.emitter(job, check=True)

    def _write_tree(self, path: Path, job, pieces) -> None:
        rebuilt = self._rebuild(job)
        if rebuilt is None:
            tree, emitter, source = self.tree_for(job)
            pickled = dumps(tree)
        else:
            (pickled, emitter), source = rebuilt.pickle(job), rebuilt.template
        stream = iter(pieces)
        values = by_piece(stream)

        def fill():
            for key, src in emitter.records:
                if isinstance(src, Piece):
                    v = values(src)
                    if isinstance(v, Span):
                        yield key, shardtree.with_crcs(v.parts, self._record_crc, src.copies)
                    else:
                        yield key, v if isinstance(v, CastSpan) else tensor_bytes(v)
                else:
                    yield key, src
            for _ in stream:  # the rest of the stream (none: every piece has its record)
                pass

        if source is None:  # built from the plan: the records torch.save writes
            small = SMALL_RECORDS
        else:
            small = shardtree.small_records(source)
        shardtree.write_file(path, pickled, small, fill(), prefix="archive" if source is None else None)

    def write(self, path: Path, job, pieces, objects) -> None:
        if self.template is not None or self.synth is not None:
            self._write_tree(path, job, pieces)
            return
        from ..codecs.torchzip import LazyStorages, from_stream, save

        lazy = LazyStorages()
        provider = from_stream(pieces)

        mesh = _mesh(self.world_size, job.rank, self.mesh_names)
        if job.kind == "extra":
            obj = job.meta["extra"]
        elif job.meta.get("flat"):
            obj = flatparams.write_state(job, objects, lazy, provider, self.flat_units)
        else:
            values = {}
            for p in job.pieces:
                local = lazy.placeholder(p.sizes, p.target.dtype, provider(p))
                plain = (p.target.group, p.target.name) in job.meta.get("plain", ())
                if plain:
                    values[p] = local
                elif self.sharded_tensors:
                    values[p] = shardedtensor.value(local, p.target.shape, local.dtype, job.rank, self.world_size)
                else:
                    values[p] = _dtensor(local, mesh, p.target.shape)
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
        # the source's own fsdp_config.json, other fields kept, for what these files are
        config = {**self.config, "FSDP_version": self.fsdp_version, "world_size": self.world_size}
        (out / CONFIG_NAME).write_text(json.dumps(config) + "\n")


_MESHES: dict = {}


def _mesh(world_size: int, rank: int | None, names: tuple[str, ...] | None = None):
    """A 1-D CPU DeviceMesh for pickling, built without a process group (the loading job's
    own mesh, which must have the same dimension ``names``, replaces it when it loads)."""
    import torch
    from torch.distributed.device_mesh import DeviceMesh

    key = (world_size, rank or 0, names)
    if key not in _MESHES:
        mesh = DeviceMesh("cpu", torch.arange(world_size), mesh_dim_names=names, _init_backend=False, _rank=rank or 0)
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
