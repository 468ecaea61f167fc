"""Format adapters: one module per on-disk format, each with ``detect``, ``describe`` and a
``Writer``; :mod:`.writers` chooses which writer writes a conversion."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

from ..core.describe import Checkpoint, check_coverage
from ..security import bounded, safefs
from ..errors import BadInput
from . import dcp, deepspeed, hf, sharded, shardtree, torchsave

FORMATS = ("hf", "torch", "dcp", "sharded", deepspeed.NAME)  # the formats written (read: _ORDER)
_ORDER = ((deepspeed.NAME, deepspeed), ("sharded", sharded), ("dcp", dcp), ("hf", hf), ("torch", torchsave))


def detect(path: Path | str) -> str:
    """The format name of the checkpoint at ``path``; never asks, raises BadInput if unsure."""
    path = Path(path)
    if not path.exists():
        raise BadInput(f"{path}: no such file or directory")
    if not path.is_dir():
        safefs.require_regular(path)  # a FIFO or device: refused before any reader waits on it
    if path.is_dir():
        if not any(path.iterdir()):
            raise BadInput(f"{path}: the directory is empty; expected a checkpoint "
                           "(safetensors, a torch .pt/.bin, a DCP .metadata, or model_world_size_W_rank_r.pt files)")
        if path.name == "huggingface" and (path / "config.json").is_file() and not hf.detect(path):
            raise BadInput(f"{path}: holds a config but no weights; point at its parent checkpoint directory")
    for name, module in _ORDER:
        if module.detect(path):
            return name
    if path.is_file():
        if path.name == dcp.METADATA or path.suffix == ".distcp":
            raise BadInput(f"{path}: part of a DCP checkpoint; point at its directory {path.parent}")
        raise BadInput(f"{path}: unknown checkpoint file; expected .safetensors, .pt, .pth or .bin")
    names = sorted(p.name for p in path.iterdir())[:5]
    raise BadInput(f"{path}: no checkpoint found (it holds {', '.join(names)}{'...' if len(names) == 5 else ''}); "
                   "expected safetensors, a torch .pt/.bin, a DCP .metadata, or model_world_size_W_rank_r.pt files")


def describe(path: Path | str, *, check: bool = True, read_only: bool = False) -> Checkpoint:
    """Describe the checkpoint at ``path`` from its headers and metadata (no tensor data).
    ``read_only``: nothing will be written from it (inspect, safetensors), so nothing parsed is kept
    for a writer."""
    path = Path(path)
    name = detect(path)
    module = dict(_ORDER)[name]
    before = safefs.stamps(path)  # before reading a byte: what is described is what is copied
    token = shardtree.KEEP_TEMPLATES.set(not read_only)
    try:
        with bounded.gc_paused(promote=True):  # a description is many small objects: linear without the collector
            ckpt = replace(module.describe(path), stamps=before)
    finally:
        shardtree.KEEP_TEMPLATES.reset(token)
    if check:
        check_coverage(ckpt)
    return ckpt
