"""Framework layouts: the directory structure, key nesting and side files around a format.

A checkpoint is a format (``formats/``) inside a framework's layout: verl's per-rank files
beside ``fsdp_config.json`` and ``huggingface/``, accelerate's ``save_state`` directory, a
transformers Trainer ``checkpoint-N/``, a torchtitan ``step-N/``. Each framework is one module
here that says how to recognise it and which of its files and entries are rank-local; the
core (describe, plan, engine) never learns their names. :func:`layout_of` names the layout of
a described checkpoint; :func:`keep_layout` and :func:`carry_plan` say what a resharded copy
keeps (entries, side files); :func:`output` says how ``convert --layout NAME`` writes a layout.

Adapter modules provide ``NAME``, ``detect(ckpt) -> bool``, ``fsdp_version(ckpt) -> int | None``,
``RANK_LOCAL_FILE`` (a regex whose group 1 is the rank, or None) and
``rank_local_object(obj) -> int | None`` (the rank a DCP entry belongs to, or None); optionally
``RANK_LOCAL_CHANGED``, what the framework's loader needs once a change of world size has
dropped or split its rank-local entries (said in the warning).
"""

from __future__ import annotations

import shutil
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from ..formats import describe as describe_format
from ..core.describe import Checkpoint, ObjectInfo, check_coverage, files_of
from ..core.state import short_list, warn_rank_local
from ..errors import BadInput, UsageError
from ..formats.sharded import CONFIG_NAME, PATTERN
from ..security import safefs
from ..storage import manifest
from ..storage.atomic import TMP_MARK
from . import accelerate, megatron, plain, torchtitan, trainer, verl

LAYOUTS = ("plain", "verl", "accelerate", "trainer", "torchtitan", "megatron")
# most specific first: a Trainer checkpoint is also an accelerate save_state directory
_ADAPTERS = (verl, trainer, accelerate, torchtitan, megatron)


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


def parts_of(path: Path | str) -> list[str]:
    """The checkpoints a framework's step directory holds as sub-directories, the one its
    trainer resumes first (verl's ``global_step_N/``: ``actor``, then ``critic``); ``[]`` when
    ``path`` is no such directory."""
    return verl.roles_in(Path(path))


def resolve(path: Path | str) -> Path:
    """The checkpoint a path names: a verl ``global_step_N/`` (what ``ckpt latest`` prints)
    names its ``actor/``; any other path itself."""
    parts = parts_of(path)
    return Path(path) / parts[0] if parts else Path(path)


def describe(path: Path | str, *, check: bool = True, base: str | None = None, read_only: bool = False) -> Checkpoint:
    """The checkpoint at ``path`` (:func:`resolve`) described (:func:`ckpt_tools.formats.describe`;
    ``read_only``: nothing will be written from it), then completed by its layout where the
    layout knows what the files leave out (FSDP1 flat parameters' make-up, from the model;
    ``base``: where its config is, if not beside it)."""
    from . import runs  # runs asks the adapters this module imports

    if runs.is_run(Path(path)):
        steps = sorted(rel for rel, _, _ in runs.step_dirs(Path(path)))
        raise BadInput(f"{path}: a run directory holding {len(steps)} checkpoints ({', '.join(steps[:4])}"
                       f"{', ...' if len(steps) > 4 else ''}), not one checkpoint; `ckpt latest {path}` prints the "
                       "newest complete one to use (or name a file in it directly)")
    ckpt = describe_format(resolve(path), check=check, read_only=read_only)
    complete = getattr(layout_of(ckpt).adapter, "complete", None)
    if complete is None:
        return ckpt
    done = complete(ckpt, base)
    if check and done is not ckpt:
        check_coverage(done)
    return done


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
        if rel in owned or rel == manifest.NAME or TMP_MARK in rel:
            continue
        out.append(rel)
    return out


def _format_files(ckpt: Checkpoint) -> set[str]:
    """The files the format's reader takes as tensors or metadata."""
    files: set[str] = set()
    for t in ckpt.tensors:
        files |= files_of(t.chunks)
    files |= {o.location.file for o in ckpt.objects if o.location.kind != "pickled" or "/" in o.location.file}
    if ckpt.format == "dcp":
        # every file of a DCP part directory belongs to it, and so does every data file there
        # its .metadata names none of (dcp.save's empty file of a rank that held nothing):
        # never carried into a copy, whose own .metadata would not name it either
        parts = {f.rpartition("/")[0] for f in files}
        files |= {f.path for f in ckpt.files if f.path.rpartition("/")[0] in parts}
        for part in parts:
            base = ckpt.root / part if part else ckpt.root
            files |= {(f"{part}/{p.name}" if part else p.name) for p in base.glob("*.distcp")}
    if ckpt.format == "hf":
        files |= {p.name for p in ckpt.root.glob("*.index.json")}
    if ckpt.format == "sharded":
        files |= {f.path for f in ckpt.files if PATTERN.match(f.path) or f.path == CONFIG_NAME}
        files |= set(ckpt.details.get("rank_files", ()))
    if ckpt.format == "deepspeed":  # the model states (read for their shapes) and the ``latest`` tag
        files |= {f.path for f in ckpt.files} | {"latest"}
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


def keep_layout(ckpt: Checkpoint, objects: tuple[ObjectInfo, ...], ws: int, policy: str
                ) -> tuple[Layout, tuple[ObjectInfo, ...], Carry]:
    """What a copy of ``ckpt`` in its own format and framework layout at ``ws`` ranks keeps:
    its side files (carried as files, so entries read from them are not written again), its
    rank-local entries (by ``policy`` when the world size changes, with a warning)."""
    lay = layout_of(ckpt)
    side = set(lay.side_files)
    kept, local = [], []
    for o in objects:
        if o.location.file in side:
            continue
        rank = lay.rank_local_object(o) if o.rank is None else None
        if rank is not None and ckpt.world_size != ws:
            local.append(".".join(map(str, o.path)))
            if policy != "keep-first" or rank >= ws:
                continue
        kept.append(o)
    if local:
        # what the framework's own loader then needs, said in the same warning (torchtitan:
        # leave its data loader out of loading)
        then = getattr(lay.adapter, "RANK_LOCAL_CHANGED", None)
        warn_rank_local(f"rank-local entries {short_list(sorted(local))} ({lay.name}) cannot be split or merged",
                        src_world=ckpt.world_size, dst_world=ws, policy=policy,
                        warn=(lambda m: print(f"warning: {m}; {then}", file=sys.stderr)) if then else None)
    carry = carry_plan(lay, src_world=ckpt.world_size, dst_world=ws, policy=policy)
    return lay, tuple(kept), carry


def copy_side_files(src: Path, files: tuple[str, ...], tmp: Path) -> None:
    """Side files into the staging directory, byte for byte."""
    for rel in files:
        out = tmp / rel
        out.parent.mkdir(parents=True, exist_ok=True)
        # resolved whole and required inside the checkpoint: never a file from elsewhere
        path = safefs.resolve_inside(src, rel, what=f"{src}: side file")
        safefs.require_regular(path)
        shutil.copyfile(path, out)


# -- layouts written from another format (convert --layout NAME) ---------------------------

@dataclass(frozen=True)
class Output:
    """How ``convert --layout NAME`` writes a framework's layout: the one format it is written
    in (None: any), the device mesh names of rank files, model keys at a DCP's top level, and
    ``retarget(targets, config, src, ckpt) -> (targets, piece_of)`` for a layout with names of its own."""

    name: str
    to: str | None
    mesh_names: tuple[str, ...] | None = None
    top_level_model: bool = False
    retarget: Callable | None = None


# "plain": the source's framework layout is not kept, nothing added
_OUTPUTS = {o.name: o for o in (
    Output(plain.NAME, None),
    Output(torchtitan.NAME, torchtitan.WRITES, top_level_model=torchtitan.TOP_LEVEL_MODEL,
           retarget=torchtitan.retarget),
    Output(verl.NAME, verl.WRITES, mesh_names=verl.MESH_NAMES),
)}
WRITTEN = tuple(_OUTPUTS)


def output(name: str | None, to: str) -> Output | None:
    """The :class:`Output` that ``--layout name`` asks of ``convert --to to`` (None without
    ``--layout``); a layout not written in that format is a usage error naming those that are."""
    if name is None:
        return None
    found = _OUTPUTS.get(name)
    if found is None or found.to not in (None, to):
        pairs = ", ".join(f"--to {o.to} --layout {o.name}" for o in _OUTPUTS.values() if o.to)
        raise UsageError(f"--layout {name} is not written by convert --to {to} ({pairs})")
    return found


def unnamed_mesh_note() -> str:
    """Said when rank files are built from another format without ``--layout``: which jobs
    load an unnamed mesh and how to name it for those that do not."""
    named = [o for o in _OUTPUTS.values() if o.mesh_names]
    how = "; ".join(f"for {o.name} (mesh {o.mesh_names}) convert with --layout {o.name}" for o in named)
    return ("the rank files' device mesh is unnamed, as fully_shard's default mesh is; a job loads them "
            f"only onto a mesh of the same names: {how}")
