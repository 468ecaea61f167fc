"""Framework layouts: the directory structure, key nesting and side files around a format.

A checkpoint is a format (``formats/``) inside a framework's layout: verl's per-rank files
beside ``fsdp_config.json`` and ``huggingface/``, accelerate's ``save_state`` directory, a
transformers Trainer ``checkpoint-N/``, a torchtitan ``step-N/``. Each framework is one module
here that says how to recognise it and which of its files and entries are rank-local; the
core (describe, plan, engine) never learns their names. :func:`layout_of` names the layout of
a described checkpoint; :func:`carry_plan` says which side files a resharded copy carries.

Adapter modules provide ``NAME``, ``detect(ckpt) -> bool``, ``fsdp_version(ckpt) -> int | None``,
``RANK_LOCAL_FILE`` (a regex whose group 1 is the rank, or None) and
``rank_local_object(obj) -> int | None`` (the rank a DCP entry belongs to, or None).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from ..storage.atomic import TMP_MARK
from ..core.describe import Checkpoint, ObjectInfo
from ..core.state import short_list, warn_rank_local
from . import accelerate, plain, torchtitan, trainer, verl

LAYOUTS = ("plain", "verl", "accelerate", "trainer", "torchtitan")
# most specific first: a Trainer checkpoint is also an accelerate save_state directory
_ADAPTERS = (verl, trainer, accelerate, torchtitan)
MANIFEST = ".ckpt-manifest.json"


@dataclass(frozen=True)
class Layout:
    """What :func:`layout_of` found: the framework, its FSDP version where the files say it,
    the side files (relative paths, carried verbatim, never parsed as tensors) and, of those,
    the rank-local ones with the rank each belongs to."""

    name: str
    fsdp_version: int | None
    side_files: tuple[str, ...]
    rank_local_files: dict[str, int]
    adapter: object

    def rank_local_object(self, obj: ObjectInfo) -> int | None:
        return self.adapter.rank_local_object(obj)

    def to_json(self) -> dict:
        return {"layout": self.name, "fsdp_version": self.fsdp_version, "side_files": list(self.side_files)}


def layout_of(ckpt: Checkpoint) -> Layout:
    """The framework layout of a described checkpoint (``plain`` when none is recognised)."""
    adapter = next((a for a in _ADAPTERS if a.detect(ckpt)), plain)
    side = side_files(ckpt, adapter)
    local = {}
    if adapter.RANK_LOCAL_FILE is not None:
        for f in side:
            m = adapter.RANK_LOCAL_FILE.match(f)
            if m:
                local[f] = int(m.group(1))
    return Layout(adapter.NAME, adapter.fsdp_version(ckpt), tuple(side), local, adapter)


def side_files(ckpt: Checkpoint, adapter=plain) -> list[str]:
    """Every regular file under the checkpoint's directory that its format does not own
    (tensor files, DCP metadata), relative to the root; ckpt's own manifest excluded."""
    root = ckpt.root
    if not root.is_dir():
        return []
    owned = set(adapter.owned_files(ckpt)) if hasattr(adapter, "owned_files") else set()
    owned |= _format_files(ckpt)
    out = []
    for p in sorted(root.rglob("*")):
        if p.is_symlink() or not p.is_file():
            continue
        rel = p.relative_to(root).as_posix()
        if rel in owned or rel == MANIFEST or TMP_MARK in rel:
            continue
        out.append(rel)
    return out


def _format_files(ckpt: Checkpoint) -> set[str]:
    """The files the format's reader takes as tensors or metadata."""
    files = {c.location.file for t in ckpt.tensors for c in t.chunks}
    files |= {o.location.file for o in ckpt.objects if o.location.kind != "pickled" or "/" in o.location.file}
    if ckpt.format == "dcp":
        # every file of a DCP part directory belongs to it
        parts = {f.rpartition("/")[0] for f in files}
        files |= {f.path for f in ckpt.files if f.path.rpartition("/")[0] in parts}
    if ckpt.format == "hf":
        files |= {p.name for p in ckpt.root.glob("*.index.json")}
    if ckpt.format == "sharded":
        from ..formats.sharded import CONFIG_NAME, PATTERN

        files |= {f.path for f in ckpt.files if PATTERN.match(f.path) or f.path == CONFIG_NAME}
    return files


@dataclass(frozen=True)
class Carry:
    """Which side files a copy at another world size takes (relative paths), and what was left."""

    files: tuple[str, ...]
    dropped: tuple[str, ...]


def carry_plan(layout: Layout, *, src_world: int | None, dst_world: int, policy: str,
               warn: Callable[[str], None] | None = None) -> Carry:
    """Side files for the resharded copy: shared ones always; rank-local ones all when the
    world size is unchanged, else by ``policy``: ``drop`` (none) or ``keep-first`` (those of
    ranks below ``dst_world``), with a warning naming them."""
    files, dropped = [], []
    for f in layout.side_files:
        rank = layout.rank_local_files.get(f)
        keep = rank is None or src_world == dst_world or (policy == "keep-first" and rank < dst_world)
        (files if keep else dropped).append(f)
    if layout.rank_local_files and src_world != dst_world:
        warn_rank_local(f"rank-local files {short_list(sorted(layout.rank_local_files))} ({layout.name}) "
                        "cannot be split or merged", src_world=src_world, dst_world=dst_world, policy=policy,
                        warn=warn)
    return Carry(tuple(files), tuple(dropped))
