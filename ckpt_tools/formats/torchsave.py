"""One full (unsharded) ``torch.save`` file, or HF ``pytorch_model-*.bin`` shards + index.

The file may hold a bare state dict, or ``{"model": ..., "optimizer": ..., ...}``; anything
that is neither model nor optimizer is extra state.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ..core.describe import Checkpoint, Chunk, FileEntry, Location, ObjectInfo, TensorInfo
from ..core.dtypes import DType
from ..core.state import gather, param_groups_keyed
from ..errors import BadInput
from ..security import safefs
from . import optim
from .hf import safe_relative

if TYPE_CHECKING:
    import torch

SUFFIXES = (".pt", ".pth", ".bin")
INDEX_NAME = "pytorch_model.bin.index.json"


def detect(path: Path) -> bool:
    if path.is_file():
        return path.suffix in SUFFIXES
    return (path / INDEX_NAME).is_file() or (path / "pytorch_model.bin").is_file() or (
        len([p for p in path.iterdir() if p.suffix in SUFFIXES]) == 1
    )


def _files(path: Path) -> tuple[Path, list[str], dict[str, str] | None]:
    if path.is_file():
        return path.parent, [path.name], None
    index = path / INDEX_NAME
    if index.is_file():
        raw = safefs.read_capped(index, safefs.MAX_JSON_BYTES)
        try:
            weight_map = json.loads(raw)["weight_map"]
        except (ValueError, KeyError, TypeError, RecursionError) as e:
            raise BadInput(f"{index}: not a valid index ({e})") from e
        if not isinstance(weight_map, dict):
            raise BadInput(f"{index}: weight_map is not an object")
        for name, file in weight_map.items():
            safe_relative(path, file, what=f"{index}: tensor {name!r}")
        return path, sorted(set(weight_map.values())), weight_map
    if (path / "pytorch_model.bin").is_file():
        return path, ["pytorch_model.bin"], None
    files = sorted(p.name for p in path.iterdir() if p.suffix in SUFFIXES)
    return path, files, None


def describe(path: Path) -> Checkpoint:
    import torch

    from ..security.safeload import load_torch

    base, files, weight_map = _files(path)
    tensors: list[TensorInfo] = []
    objects: list[ObjectInfo] = []
    entries: list[FileEntry] = []
    details: dict[str, Any] = {}
    param_order: tuple[str, ...] = ()
    for name in files:
        # a file the user named is the checkpoint; one a directory lists must stay inside it
        file = safe_relative(base, name, what=str(base)) if path.is_dir() else path
        size = safefs.require_regular(file, what=f"{base / INDEX_NAME}: shard {name!r}" if weight_map else None).st_size
        entries.append(FileEntry(name, size))
        obj = load_torch(file)
        if not isinstance(obj, dict):
            raise BadInput(f"{file}: holds a {type(obj).__name__}, not a state dict")
        model, model_key = _model_part(obj)
        for key, v in model.items():
            kp = (model_key, key) if model_key else (key,)
            if isinstance(v, torch.Tensor):
                if weight_map is not None and weight_map.get(key) != name:
                    raise BadInput(f"{file}: holds {key!r}, but the index puts it in {weight_map.get(key)!r}")
                _whole_tensor(file, key, v)
                tensors.append(_full("model", key, v, Location(name, "pickled", key=kp)))
            else:
                objects.append(ObjectInfo("model", key, Location(name, "pickled", key=kp), path=kp))
        if model_key is None:
            continue
        param_order = optim.param_order_from_model(model)
        # the optimizer is found by what it holds, under any key ("optimizer", "optim", ...);
        # it is described under "optimizer", as every writer but DCP's writes it
        tops = [top for top, value in obj.items() if top != model_key and optim.is_optimizer_state(value)]
        if len(tops) > 1:
            raise BadInput(f"{file}: holds {len(tops)} optimizer states ({', '.join(map(str, tops))}); ckpt handles one")
        for top, value in obj.items():
            if top in tops and optim.is_int_keyed(value):
                param_order = optim.param_order_for(model, value)
            if top == model_key:
                continue
            if top in tops:
                details["optimizer_keyed"] = "int" if optim.is_int_keyed(value) else "fqn"
                for fqn, skey, v, kp in optim.state_entries(value, param_order):
                    loc = Location(name, "pickled", key=(top, *kp))
                    if isinstance(v, torch.Tensor):
                        tensors.append(_full("optimizer", f"state.{fqn}.{skey}", v, loc, fqn, skey))
                    else:
                        objects.append(ObjectInfo("optimizer", f"state.{fqn}.{skey}", loc, path=("optimizer", *kp)))
                objects.append(ObjectInfo("optimizer", "param_groups",
                                          Location(name, "pickled", key=(top, "param_groups")),
                                          path=("optimizer", "param_groups")))
                details["param_groups"] = len(value["param_groups"])
            else:
                objects.append(ObjectInfo("extra", str(top), Location(name, "pickled", key=(top,)), path=(top,)))
    if weight_map is not None:
        missing = set(weight_map) - {t.name for t in tensors}
        if missing:
            raise BadInput(f"{base / INDEX_NAME}: names {len(missing)} tensors no shard holds, e.g. {sorted(missing)[0]!r}")
    return Checkpoint("torch", path, None, tuple(tensors), tuple(objects), tuple(entries),
                      details=details, param_order=param_order)


def _whole_tensor(file: Path, key: str, v: torch.Tensor) -> None:
    """Refuse one rank's file of a sharded save taken for a whole checkpoint: its DTensors
    (ShardedTensors) hold that rank's rows only, so sizes and data would be wrong."""
    from torch.distributed.tensor import DTensor

    from ..security.fsdp1 import is_sharded_tensor

    devices = v.device_mesh.mesh.numel() if isinstance(v, DTensor) else None
    if not (is_sharded_tensor(v) or (devices or 1) > 1):
        return
    m = _RANK_FILE.match(file.name)
    which = f"rank {m.group(2)} of a {m.group(1)}-rank save" if m else "one rank's part of a sharded save"
    kind = "a ShardedTensor" if devices is None else f"a DTensor split over {devices} devices"
    raise BadInput(f"{file}: {which} (tensor {key!r} is {kind}), not a whole checkpoint; "
                   f"point at the directory holding every rank's file ({file.parent})")


_RANK_FILE = re.compile(r"^\w+_world_size_(\d+)_rank_(\d+)\.pt$")


def _model_part(obj: dict) -> tuple[dict, str | None]:
    """A training checkpoint nests the model under "model" (or "state_dict"/"module");
    a bare state dict is the model itself."""
    for key in ("model", "state_dict", "module"):
        if isinstance(obj.get(key), dict):
            return obj[key], key
    return obj, None


def _full(group: str, name: str, v: torch.Tensor, loc: Location,
          param: str | None = None, state: str | None = None) -> TensorInfo:
    shape = tuple(v.shape)
    return TensorInfo(group, name, shape, DType.of(v.dtype), (Chunk((0,) * len(shape), shape, loc),), param, state)


# -- writing ------------------------------------------------------------------------------

class Writer:
    """One ``torch.save`` file: a bare state dict, or ``{"model", "optimizer", ...}`` when
    there is more than the model. Written through :mod:`ckpt_tools.codecs.torchzip`, so tensors are
    produced one at a time as torch writes them."""

    single_file = True

    def __init__(self, *, param_order: tuple[str, ...] = ()) -> None:
        self.param_order = param_order

    def write(self, path: Path, job, pieces, objects) -> None:
        from ..codecs.torchzip import LazyStorages, from_stream, save

        lazy = LazyStorages()
        provider = from_stream(pieces)

        values = {p: lazy.placeholder(p.sizes, p.target.dtype, provider(p)) for p in job.pieces}
        rest = gather(job.objects, objects)
        rest.update(job.meta.get("extra", {}))
        save(training_state(job.pieces, values, rest, self.param_order), path, lazy)

    def finish(self, out: Path, jobs, written: dict) -> None:
        pass


def training_state(pieces, values: dict, rest: dict, param_order: tuple[str, ...]) -> dict:
    """What a full ``torch.save`` file holds: the model state dict alone, or ``{"model",
    "optimizer" (FQN-keyed state and param_groups), ...}`` with the other saved state (``rest``).
    ``values[piece]`` is what stands for each piece's tensor (shared by both torch writers)."""

    model: dict = {}
    state: dict = {}
    for p in pieces:
        if p.target.group == "optimizer" and p.target.param:
            state.setdefault(p.target.param, {})[p.target.state] = values[p]
        else:
            model[p.target.name] = values[p]
    if not state and not rest:
        return model
    obj = {"model": {**model, **rest.pop("model", {})}}
    opt = rest.pop("optimizer", {})
    if state or opt:
        groups = param_groups_keyed(opt.get("param_groups", []), keyed="fqn", param_order=param_order)
        obj["optimizer"] = {"state": state, "param_groups": groups}
    obj.update(rest)
    return obj
