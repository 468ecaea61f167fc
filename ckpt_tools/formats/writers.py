"""Which writer writes a conversion, and the files it writes: ckpt's own writers (no torch,
records copied by the kernel) wherever they cover the plan, torch's otherwise. The layout
functions are pure: descriptions in, jobs out.

Object values a writer needs (extra state merged across ranks, for torch's writers) are read
through ``open_reader``, a callable the caller passes (the engine's reader): formats do not
import the engine.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager
from typing import Any

from ..core.chunks import kinds
from ..core.describe import Checkpoint, ObjectInfo, TensorInfo
from ..core.plan import FileJob, Piece, RankPieces, RankRows, Target, rows_of, whole
from ..core.state import per_rank_extras
from ..errors import BadInput
from ..security import bounded
from . import dcp, dcpnative, flatparams, sharded, shardedtensor, shardsynth, shardtree, torchnative, torchsave

OpenReader = Callable[[], AbstractContextManager]  # () -> a reader with .object(ObjectInfo)


def torch_file(ckpt: Checkpoint, targets: list[Target], objects: tuple[ObjectInfo, ...], name: str, *,
               rank_local: str, open_reader: OpenReader) -> tuple[Any, list[FileJob]]:
    """One ``torch.save`` file ``name``: ckpt's own writer, else torch's."""
    extras = _OneCopy(ckpt, ckpt.rooted(objects), rank_local, open_reader)

    def jobs(merged: dict) -> list[FileJob]:
        return [FileJob(name, tuple(whole(t) for t in targets), extras.shared, meta={"extra": merged})]

    writer = torchnative.native_writer(ckpt, jobs(extras.values), param_order=ckpt.param_order)
    if writer is not None:
        return writer, jobs(extras.values)
    return torchsave.Writer(param_order=ckpt.param_order), jobs(extras.for_torch())


def dcp_dir(ckpt: Checkpoint, targets: list[Target], objects: tuple[ObjectInfo, ...], ws: int, *,
            rank_local: str, open_reader: OpenReader, keep_parts: bool, piece_of=rows_of,
            top_level_model: bool = False, keys: dict[str, str] | None = None,
            ranks: Sequence[int] | None = None) -> tuple[Any, list[FileJob]]:
    """A DCP directory at ``ws`` ranks: ckpt's own writer where it covers the plan, else torch's.
    Either keeps a layout the same way: ``keep_parts`` keeps a DCP source's part directories
    (accelerate's) and copies its items as saved; ``top_level_model`` writes the model's keys
    without their ``model.`` prefix; ``keys`` renames top-level keys (``{"optimizer": "optim"}``).
    ``ranks``: plan only these ranks' files (a process of a torchrun launch); the writer is
    chosen as for the whole plan (rank 0's files, which hold every entry, checked without a plan)."""
    extras = _OneCopy(ckpt, objects, rank_local, open_reader)

    def jobs(merged: dict, ranks=ranks, piece_of=piece_of) -> list[FileJob]:
        return layout_dcp(targets, extras.shared, ws, merged, part_of=dcp_part if keep_parts else None,
                          piece_of=piece_of, ranks=ranks)

    source_dcp = ckpt.format == "dcp" and keep_parts
    # every entry is on rank 0's files; their pieces' copies are not needed to choose the writer
    probe = [] if ranks is None else jobs(extras.values, ranks=(0,), piece_of=_unplanned)
    planned = jobs(extras.values)
    writer = dcpnative.native_writer(ckpt, probe + planned, param_order=ckpt.param_order,
                                     extras=extras.native, verbatim=source_dcp, top_level_model=top_level_model,
                                     keys=keys)
    if writer is not None:
        return writer, planned
    return (dcp.Writer(param_order=ckpt.param_order, source=ckpt.base_dir() if source_dcp else None,
                       top_level_model=top_level_model, keys=keys), jobs(extras.for_torch()))


def rank_files(ckpt: Checkpoint, targets: list[Target], objects: tuple[ObjectInfo, ...], ws: int, *,
               rank_local: str, open_reader: OpenReader, mesh_names: tuple[str, ...] | None = None,
               keep: bool = False, ranks: Sequence[int] | None = None,
               buffers: frozenset[str] = frozenset()) -> tuple[sharded.Writer, list[FileJob]]:
    """The sharded writer and its jobs. From a sharded source read without torch, each new file
    is its source's pickle rebuilt for the new ranks (its mesh kept), records copied by the
    kernel; else (or if the dry run finds something only torch can write) tensors go through
    torch.save, on a mesh of dimensions ``mesh_names`` (None: unnamed, as ``fully_shard``'s
    default mesh is). ``keep``: a reshard, which keeps what a sharded source holds (FSDP1
    ShardedTensors stay ShardedTensors) and its ``FSDP_version``; otherwise FSDP2 files. ``ranks``:
    plan only these ranks' files (a process of a torchrun launch); every rank's files have the
    same entries, so a dry run of these chooses the writer the whole plan's would. ``buffers``:
    model tensors written whole on every rank, not as DTensors (the model holds them as buffers)."""
    keyed = "fqn" if ckpt.format == "sharded" and ckpt.details.get("optimizer_keyed") == "fqn" else "int"
    version = {}
    if keep and ckpt.format == "sharded":
        config = sharded.read_config(ckpt.root)
        old = config.get("FSDP_version", 1 if fsdp1_files(ckpt) else 2)
        version = {"sharded_tensors": fsdp1_files(ckpt), "fsdp_version": old}
    extra_objs = [o for o in objects if o.group == "extra"]
    flat = ckpt.details.get("flat_units") if keep else None
    if flat and any(t.group == "optimizer" for t in targets):
        # FSDP1 flat parameters kept as such: built by torch's writer
        writer = sharded.Writer(world_size=ws, param_order=ckpt.param_order, keyed="int",
                                config=sharded.read_config(ckpt.root), mesh_names=mesh_names, flat_units=flat,
                                **version)
        with open_reader() as reader:
            extras = per_rank_extras(extra_objs, reader.object, src_world=ckpt.world_size, dst_world=ws,
                                     policy=rank_local)
        return writer, layout_sharded(ckpt, targets, ws, extras, flat_units=flat, ranks=ranks, buffers=buffers)
    if ckpt.format == "sharded" and _all_raw(ckpt) and all(t.dtype == t.source.dtype for t in targets) \
            and not ckpt.details.get("rank_files"):  # templates are found by verl's file names
        writer = sharded.Writer(world_size=ws, param_order=ckpt.param_order, keyed=keyed, template=ckpt.root,
                                src_world=ckpt.world_size, config=sharded.read_config(ckpt.root), **version)

        def equal(a: shardtree.Entry, b: shardtree.Entry) -> bool:
            return shardtree.same_value(writer.entry(a), writer.entry(b))

        try:
            extras = per_rank_extras(extra_objs, _entry, src_world=ckpt.world_size, dst_world=ws,
                                     policy=rank_local, equal=equal)
            return writer, _dry_run(writer, layout_sharded(ckpt, targets, ws, extras, ranks=ranks, buffers=buffers), extras)
        except shardtree.NotSimple:
            pass
    elif ckpt.format != "sharded" and shardsynth.available():
        # no source rank files to rebuild: each file's tree is built from the plan, no torch
        writer = sharded.Writer(world_size=ws, param_order=ckpt.param_order, keyed=keyed, synth=ckpt.base_dir(),
                                mesh_names=mesh_names)
        try:
            if any(o.rank is not None for o in extra_objs):
                raise shardtree.NotSimple("rank-local extra state")
            shared = shardsynth.object_values(ckpt.base_dir(), extra_objs)
            extras = [shared] * ws if shared else None
            return writer, _dry_run(writer, layout_sharded(ckpt, targets, ws, extras, ranks=ranks, buffers=buffers), extras)
        except shardtree.NotSimple:
            pass
    config = sharded.read_config(ckpt.root) if ckpt.format == "sharded" else {}
    writer = sharded.Writer(world_size=ws, param_order=ckpt.param_order, keyed=keyed, config=config,
                            mesh_names=mesh_names, **version)
    with open_reader() as reader:
        extras = per_rank_extras(extra_objs, reader.object, src_world=ckpt.world_size, dst_world=ws,
                                 policy=rank_local)
    return writer, layout_sharded(ckpt, targets, ws, extras, ranks=ranks, buffers=buffers)


# -- layouts (pure) ------------------------------------------------------------------------

def layout_sharded(src: Checkpoint, targets: list[Target], world_size: int, extras: list[dict] | None,
                   flat_units: tuple | None = None, ranks: Sequence[int] | None = None,
                   buffers: frozenset[str] = frozenset()) -> list[FileJob]:
    """Per-rank model/optim/extra_state jobs at ``world_size``, FSDP2's ``Shard(0)`` split
    (optimizer state in FSDP1's flat parameters instead, when ``flat_units`` are given); those
    of ``ranks`` only, when given; the model tensors named in ``buffers`` whole on every rank."""
    plain = {t.key for t in src.tensors if _replicated(t, src)}
    model = tuple(t for t in targets if t.group == "model")
    optim = tuple(t for t in targets if t.group == "optimizer")
    plain_targets = {(t.group, t.name) for t in targets
                     if t.source.key in plain or not t.shape or t.group == "model" and t.name in buffers}
    objects = src.rooted(src.objects)
    mobj = tuple(o for o in objects if o.group == "model" and o.rank in (None, 0))
    oobj = tuple(o for o in objects if o.group == "optimizer" and o.rank in (None, 0) and o.path[:2] == ("optimizer", "param_groups"))
    jobs = []
    with bounded.gc_paused():  # a plan is many small objects and no cycles: linear without the collector
        wholes = {id(t): whole(t) for t in targets if (t.group, t.name) in plain_targets}  # every rank's the same
        # (each file's pieces made as it is checked, then as it is written: a few files' at a time)
        model_rows, optim_rows = RankRows(model, wholes, world_size), RankRows(optim, wholes, world_size)
        for r in range(world_size) if ranks is None else ranks:
            jobs.append(FileJob(sharded.file_name("model", world_size, r), RankPieces(model_rows, r), mobj, r, "model",
                                {"plain": plain_targets}))
            if optim and flat_units:
                flat, plan = flatparams.layout(optim, flat_units, world_size, r)
                jobs.append(FileJob(sharded.file_name("optim", world_size, r), flat, oobj, r, "optim", {"flat": plan}))
            elif optim:
                jobs.append(FileJob(sharded.file_name("optim", world_size, r), RankPieces(optim_rows, r), oobj, r, "optim",
                                    {"plain": plain_targets}))
            if extras and extras[r]:
                jobs.append(FileJob(sharded.file_name("extra_state", world_size, r), (), (), r, "extra",
                                    {"extra": extras[r]}))
    return jobs


def fsdp1_files(ckpt: Checkpoint) -> bool:
    """Rank files of FSDP1's SHARDED_STATE_DICT (ShardedTensors)."""
    return ckpt.format == "sharded" and ckpt.details.get("fsdp") == shardedtensor.KIND


def _replicated(t: TensorInfo, src: Checkpoint) -> bool:
    """A plain (non-DTensor) entry of a per-rank file: every rank holds the whole tensor."""
    return (src.format == "sharded" and len(t.chunks) == (src.world_size or 1) > 1
            and all(c.sizes == t.shape for c in t.chunks))


def layout_dcp(targets: list[Target], objects: tuple[ObjectInfo, ...], world_size: int,
               extra: dict | None = None, part_of=None, *, piece_of=rows_of,
               ranks: Sequence[int] | None = None) -> list[FileJob]:
    """``__{r}_0.distcp`` per rank: rank r's rows of every tensor with rows; scalars and
    objects once, on rank 0 (as dcp.save deduplicates replicated entries). A rank past 0 that
    holds no rows of anything gets no file (``.metadata`` would name none of its; a source with
    fewer rows than ranks). ``ranks``: those ranks' jobs only. Each job's ``meta["order"]`` is
    its place in the whole plan (the DCP writers order ``.metadata`` by it).

    ``part_of(target or object)`` names the part directory an entry belongs to (accelerate's
    ``pytorch_model_fsdp_0``, ``optimizer_0``; ``""`` for the root): each part is a DCP of its own.
    ``piece_of`` gives a target's rows for a rank (a naming scheme may reorder them)."""
    part_of = part_of or (lambda item: "")
    parts = list(dict.fromkeys([part_of(t) for t in targets] + [part_of(o) for o in objects])) or [""]
    home = "" if "" in parts else parts[0]  # where merged extra state goes
    jobs = []
    with bounded.gc_paused():  # a plan is many small objects and no cycles: linear without the collector
        for i, part in enumerate(parts):
            mine = [t for t in targets if part_of(t) == part]
            objs = tuple(o for o in objects if part_of(o) == part)
            prefix = f"{part}/" if part else ""
            # FSDP2's rows: each file's pieces made as it is checked and written (see
            # layout_sharded); rows a naming scheme orders its own way: made now
            rows = RankRows([t for t in mine if t.shape], {}, world_size, empty=False,
                            first=[t for t in mine if not t.shape]) if piece_of is rows_of else None
            for r in range(world_size) if ranks is None else ranks:
                if rows is not None:
                    pieces = RankPieces(rows, r)
                else:
                    pieces = tuple(p for t in mine if t.shape for p in [piece_of(t, world_size, r)] if p.numel)
                    if r == 0:
                        pieces += tuple(whole(t) for t in mine if not t.shape)
                if r != 0 and not len(pieces):
                    continue
                meta = {"extra": extra or {}} if r == 0 and part == home else {}
                jobs.append(FileJob(f"{prefix}__{r}_0.distcp", pieces, objs if r == 0 else (), r,
                                    meta={**meta, "order": (i, r)}))
    return jobs


def _unplanned(target: Target, world_size: int, rank: int) -> Piece:
    """``target`` whole as a piece with no copies: what choosing a writer looks at (its dtype,
    its key), without planning where its bytes come from."""
    shape = target.shape
    return Piece(target, (0,) * len(shape), shape, ())


def dcp_part(item: Target | ObjectInfo) -> str:
    """The part directory of a DCP source that holds ``item`` (``""`` at the root)."""
    if isinstance(item, ObjectInfo):
        loc = item.location
    else:
        if not item.source.chunks:
            return ""
        loc = item.source.chunks[0].location
    return loc.file.rpartition("/")[0] if loc.kind in ("torch_item", "bytes_item") else ""


# -- extra state ---------------------------------------------------------------------------

class _OneCopy:
    """Extra state as a format that holds one copy of it takes it: the objects held once, and
    the per-rank ones merged into one copy (values equal on every rank once; rank-local ones by
    ``policy``). ``native``: the copy read as pickle trees, without torch, for ckpt's own writers
    (False where only torch's loader can read it); ``for_torch()``: the copy as torch loads it,
    for torch's writers."""

    def __init__(self, ckpt: Checkpoint, objects: tuple[ObjectInfo, ...], policy: str,
                 open_reader: OpenReader) -> None:
        self.shared = tuple(o for o in objects if o.rank is None)
        self._ckpt, self._policy, self._open_reader = ckpt, policy, open_reader
        self._ranked = [o for o in objects if o.rank is not None]
        trees = _native_extras(ckpt, self._ranked, policy) if self._ranked else None
        self.native = trees is not None
        self.values = trees if trees is not None else self._by_torch()

    def for_torch(self) -> dict:
        # merged once already when read natively: its warnings were said then
        return self._by_torch(warn=_quiet) if self.native else self.values

    def _by_torch(self, warn: Callable[[str], None] | None = None) -> dict:
        if not self._ranked:
            return {}
        with self._open_reader() as reader:
            (values,) = per_rank_extras(self._ranked, reader.object, src_world=self._ckpt.world_size, dst_world=1,
                                        policy=self._policy, warn=warn)
        return values


def _quiet(message: str) -> None:
    """Said once already, by the first merge."""


def _native_extras(ckpt: Checkpoint, rank_objs: list[ObjectInfo], policy: str) -> dict | None:
    """Per-rank extra state of a sharded source merged into one copy (as ``per_rank_extras``
    merges it) as pickle trees, without torch; None where torch's loader must read it."""
    if ckpt.format != "sharded" or not _all_raw(ckpt):
        return None

    def tree(e: shardtree.Entry) -> tuple:
        zf = shardtree.parsed(ckpt.base_dir() / e.file)
        return zf, zf.tree[e.key]

    said: list[str] = []
    try:
        (merged,) = per_rank_extras(rank_objs, _entry, src_world=ckpt.world_size, dst_world=1, policy=policy,
                                    warn=said.append, equal=lambda a, b: shardtree.same_value(tree(a), tree(b)))
        values = {key: tree(e)[1] for key, e in merged.items()}
    except (shardtree.NotSimple, BadInput, KeyError, TypeError):
        return None
    if not all(dcpnative.plain(v) for v in values.values()):
        return None
    for m in said:
        print(f"warning: {m}", file=sys.stderr)
    return values


def _entry(o: ObjectInfo) -> shardtree.Entry:
    return shardtree.Entry(o.location.file, o.location.key[0])


def _all_raw(ckpt: Checkpoint) -> bool:
    """Every tensor chunk a raw byte range (read without torch)."""
    return all(kinds(t.chunks) <= {"raw"} for t in ckpt.tensors)  # (a table's kind: no chunk made)


def _dry_run(writer: sharded.Writer, jobs: list[FileJob], extras: list[dict] | None = None) -> list[FileJob]:
    """Each file's tree built before a byte is written: anything unusual (NotSimple) falls back.
    A plan of some ranks only: every rank's extra state is tried too (it differs by rank, and
    needs no plan), so that each process of a launch chooses the writer the whole plan would."""
    for job in jobs:
        writer.check(job)
        job.unload()  # (its pieces made again as it is written)
    planned = {j.path for j in jobs}
    for r, extra in enumerate(extras or ()):
        name = sharded.file_name("extra_state", writer.world_size, r)
        if extra and name not in planned:
            writer.tree_for(FileJob(name, (), (), r, "extra", {"extra": extra}))
    return jobs
