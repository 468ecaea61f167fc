"""``torch.distributed.checkpoint`` directories (``.metadata`` + ``*.distcp``), as torchtitan,
accelerate (``pytorch_model_fsdp_0/`` + ``optimizer_0/``) and ``dcp.save`` write them."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

from ..describe import Checkpoint, Chunk, FileEntry, Location, ObjectInfo, TensorInfo
from ..errors import BadInput
from ..safeload import load_dcp_metadata
from .hf import safe_relative

METADATA = ".metadata"
ACCELERATE_MODEL = re.compile(r"^pytorch_model_fsdp_(\d+)$")
ACCELERATE_OPTIM = re.compile(r"^optimizer_(\d+)$")
RANK_FILE = re.compile(r"^__(\d+)_(\d+)\.distcp$")


def detect(path: Path) -> bool:
    return path.is_dir() and ((path / METADATA).is_file() or bool(_accelerate_dirs(path)))


def _accelerate_dirs(path: Path) -> list[Path]:
    return sorted(p for p in path.iterdir() if p.is_dir() and (p / METADATA).is_file()
                  and (ACCELERATE_MODEL.match(p.name) or ACCELERATE_OPTIM.match(p.name)))


def describe(path: Path) -> Checkpoint:
    if (path / METADATA).is_file():
        parts = [(path, "")]
        layout = "dcp"
    else:
        parts = [(p, p.name + "/") for p in _accelerate_dirs(path)]
        layout = "accelerate"
    tensors: list[TensorInfo] = []
    objects: list[ObjectInfo] = []
    entries: list[FileEntry] = []
    ranks: set[int] = set()
    for part, prefix in parts:
        t, o, e, r = _describe_one(part, prefix)
        tensors += t
        objects += o
        entries += e
        ranks |= r
    if layout == "accelerate":
        # accelerate's save_state keeps the LR scheduler beside the DCP dirs, as a torch.save
        for f in sorted(path.glob("scheduler*.bin")):
            objects.append(ObjectInfo("extra", "lr_scheduler" if f.stem == "scheduler" else f.stem,
                                      Location(f.name, "pickled", key=()),
                                      path=("lr_scheduler" if f.stem == "scheduler" else f.stem,)))
            entries.append(FileEntry(f.name, f.stat().st_size))
    details: dict[str, Any] = {"layout": layout}
    if any(t.group == "optimizer" for t in tensors):
        details["optimizer_keyed"] = "fqn"
    # Parameter order for int-keyed output: the order the optimizer's param_groups name them,
    # else the model's tensor order.
    order = [t.param for t in tensors if t.group == "optimizer" and t.param]
    param_order = tuple(dict.fromkeys(order)) or tuple(t.name for t in tensors if t.group == "model")
    return Checkpoint("dcp", path, max(ranks) + 1 if ranks else 1, tuple(tensors), tuple(objects),
                      tuple(entries), details=details, param_order=param_order)


def _describe_one(path: Path, prefix: str):
    from torch.distributed.checkpoint.metadata import BytesStorageMetadata, MetadataIndex, TensorStorageMetadata

    meta = load_dcp_metadata(path / METADATA)
    storage = meta.storage_data or {}
    paths = meta.planner_data if isinstance(meta.planner_data, dict) else {}
    tensors, objects, files = [], [], set()

    def location(fqn: str, offset=None, kind: str = "torch_item") -> Location:
        try:
            info = storage[MetadataIndex(fqn, offset)]
        except KeyError:
            raise BadInput(f"{path / METADATA}: no storage entry for {fqn!r} at {offset}; the metadata is incomplete") from None
        file = prefix + info.relative_path
        safe_relative(path, info.relative_path, what=f"{path / METADATA}: item {fqn!r}")
        if getattr(info, "transform_descriptors", None):
            raise BadInput(f"{path / METADATA}: item {fqn!r} is stored with transforms "
                           f"{info.transform_descriptors}, which ckpt cannot read yet")
        files.add(info.relative_path)
        return Location(file, kind, int(info.offset), int(info.length))

    for fqn, md in meta.state_dict_metadata.items():
        group, name, param, state = _classify(fqn, paths.get(fqn))
        if isinstance(md, TensorStorageMetadata):
            shape = tuple(md.size)
            chunks = tuple(
                Chunk(tuple(c.offsets), tuple(c.sizes), location(fqn, c.offsets), None)
                for c in md.chunks
            )
            tensors.append(TensorInfo(group, name, shape, md.properties.dtype, chunks, param, state))
        elif isinstance(md, BytesStorageMetadata):
            path_ = tuple(paths.get(fqn) or fqn.split("."))
            objects.append(ObjectInfo(group, name, location(fqn, None, "bytes_item"), path=path_))
        else:
            raise BadInput(f"{path / METADATA}: item {fqn!r} has unknown metadata {type(md).__name__}")
    entries = []
    ranks = set()
    for f in sorted(files):
        full = path / f
        if not full.is_file():
            raise BadInput(f"{path / METADATA}: names data file {f!r}, which is missing")
        entries.append(FileEntry(prefix + f, full.stat().st_size))
        m = RANK_FILE.match(f)
        if m:
            ranks.add(int(m.group(1)))
    entries.append(FileEntry(prefix + METADATA, (path / METADATA).stat().st_size))
    return tensors, objects, entries, ranks


def _classify(fqn: str, obj_path: tuple | None) -> tuple[str, str, str | None, str | None]:
    """Group and name of a flattened DCP key, using the saved nesting path where DCP kept it."""
    parts = [str(p) for p in obj_path] if obj_path else None
    if parts and parts[0] == "optimizer" and len(parts) >= 4 and parts[1] == "state":
        return "optimizer", f"state.{parts[2]}.{'.'.join(parts[3:])}", parts[2], ".".join(parts[3:])
    if parts and parts[0] == "optimizer":
        return "optimizer", ".".join(parts[1:]), None, None
    if parts and parts[0] == "model" and len(parts) >= 2:
        return "model", ".".join(parts[1:]), None, None
    if parts and len(parts) == 1 and not fqn.startswith(("optimizer.", "model.")):
        # torchtitan flattens the model into top-level keys next to its other state
        return "extra" if "." not in fqn else "model", fqn, None, None
    if fqn.startswith("optimizer.state."):
        rest = fqn.removeprefix("optimizer.state.")
        param, _, state = rest.rpartition(".")
        return "optimizer", f"state.{rest}", param, state
    if fqn.startswith("optimizer."):
        return "optimizer", fqn.removeprefix("optimizer."), None, None
    if parts:
        return "extra", fqn, None, None
    return "model", fqn, None, None


# -- writing ------------------------------------------------------------------------------

def dcp_key(target) -> tuple:
    """The nesting path ``dcp.save`` gives a tensor of ``get_state_dict``'s output."""
    if target.group == "optimizer" and target.param:
        return ("optimizer", "state", target.param, target.state)
    return (target.group, target.name)


class Writer:
    """A DCP directory as an M-rank ``dcp.save`` lays it out: ``__{r}_0.distcp`` holding rank
    r's rows of every sharded tensor, replicated entries (scalars, objects) saved once by rank
    0, items written as ``torch.save`` blobs, and ``.metadata`` (DCP's own classes) last."""

    single_file = False

    def __init__(self, *, param_order: tuple[str, ...] = ()) -> None:
        self.param_order = param_order

    def write(self, path: Path, job, pieces, objects) -> None:
        import io

        import torch

        from ..engine import compact
        from ..state import gather, param_groups_keyed

        records = []
        with open(path, "wb") as f:
            for i, (_, values) in enumerate(pieces):
                start = f.tell()
                torch.save(compact(values), f)
                # the piece's index, not the piece: finish() builds metadata from the plan it
                # holds, so the bytes do not depend on which process wrote the file
                records.append(("tensor", i, start, f.tell() - start))
            if job.objects or job.meta.get("extra"):
                from torch.distributed.checkpoint._nested_dict import flatten_state_dict

                nested = gather(job.objects, objects)
                nested.update(job.meta.get("extra", {}))
                if "optimizer" in nested and "param_groups" in nested["optimizer"]:
                    nested["optimizer"]["param_groups"] = param_groups_keyed(
                        nested["optimizer"]["param_groups"], keyed="fqn", param_order=self.param_order)
                flat, mapping = flatten_state_dict(nested)
                for key, value in flat.items():
                    buf = io.BytesIO()
                    torch.save(value, buf)
                    start = f.tell()
                    f.write(buf.getbuffer())
                    records.append(("bytes", (key, mapping[key]), start, f.tell() - start))
        return records

    def finish(self, out: Path, jobs, written: dict) -> None:
        import pickle

        import torch
        from torch.distributed.checkpoint.filesystem import _StorageInfo
        from torch.distributed.checkpoint.metadata import (
            BytesStorageMetadata, ChunkStorageMetadata, Metadata, MetadataIndex,
            TensorProperties, TensorStorageMetadata,
        )

        state: dict = {}
        planner: dict = {}
        storage: dict = {}
        for job in jobs:
            for kind, what, start, length in written.get(job.path) or []:
                if kind == "tensor":
                    p = job.pieces[what]
                    path_ = dcp_key(p.target)
                    fqn = ".".join(map(str, path_))
                    md = state.setdefault(fqn, TensorStorageMetadata(
                        properties=TensorProperties(dtype=p.target.dtype), size=torch.Size(p.target.shape), chunks=[]))
                    md.chunks.append(ChunkStorageMetadata(offsets=torch.Size(p.offsets), sizes=torch.Size(p.sizes)))
                    storage[MetadataIndex(fqn, torch.Size(p.offsets))] = _StorageInfo(job.path, start, length)
                else:
                    fqn, path_ = what
                    state[fqn] = BytesStorageMetadata()
                    storage[MetadataIndex(fqn)] = _StorageInfo(job.path, start, length)
                planner[fqn] = path_
        meta = Metadata(state_dict_metadata=state, planner_data=planner, storage_data=storage, version="1.0.0")
        # written last, as dcp.save does: a reader that finds it knows the data files are complete
        with open(out / METADATA, "wb") as f:
            pickle.dump(meta, f)
