"""``torch.distributed.checkpoint`` directories (``.metadata`` + ``*.distcp``), as torchtitan,
accelerate (``pytorch_model_fsdp_0/`` + ``optimizer_0/``) and ``dcp.save`` write them."""

from __future__ import annotations

import math
import os

import re
from array import array
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ..core.describe import (TABLE_MIN, Checkpoint, ChunkTable, FileEntry, Location, ObjectInfo, Palette, TableColumns,
                             TensorInfo, extents)
from ..core.groups import Roots, find_roots
from ..core.dtypes import as_torch
from ..core.state import gather, param_groups_keyed
from ..errors import BadInput, Damaged, brief
from ..security import bounded, safefs
from ..security.dcpmeta import load_dcp_metadata, BytesStorageMetadata, MetadataIndex, TensorStorageMetadata
from ..security.dcprows import ChunkRow, IndexKey, Stored, StorageRow
from ..security.torchfile import Global, NewObj, Reduce, StorageRef, loads_blob

if TYPE_CHECKING:
    import torch

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
    else:
        parts = [(p, p.name + "/") for p in _accelerate_dirs(path)]
    tensors: list[TensorInfo] = []
    objects: list[ObjectInfo] = []
    entries: list[FileEntry] = []
    ranks: set[int] = set()
    roots = Roots()
    for part, prefix in parts:
        t, o, e, r, part_roots = _describe_one(part, prefix)
        tensors += t
        objects += o
        entries += e
        ranks |= r
        roots = Roots(model=roots.model if roots.model is not None else part_roots.model,
                      optimizer=roots.optimizer if roots.optimizer is not None else part_roots.optimizer)
    if len(parts) > 1 or parts[0][1]:
        # accelerate's save_state keeps the LR scheduler beside the DCP dirs, as a torch.save
        for f in sorted(path.glob("scheduler*.bin")):
            safefs.resolve_inside(path, f.name, what=str(path))
            safefs.require_regular(f)
            objects.append(ObjectInfo("extra", "lr_scheduler" if f.stem == "scheduler" else f.stem,
                                      Location(f.name, "pickled", key=()),
                                      path=("lr_scheduler" if f.stem == "scheduler" else f.stem,)))
            entries.append(FileEntry(f.name, f.stat().st_size))
    details: dict[str, Any] = {}
    if any(t.group == "optimizer" for t in tensors):
        details["optimizer_keyed"] = "fqn"
    param_order = _param_order(path, tensors, objects, roots.optimizer or ("optimizer",))
    return Checkpoint("dcp", path, max(ranks) + 1 if ranks else 1, tuple(tensors), tuple(objects),
                      tuple(entries), details=details, param_order=param_order, roots=roots)


def _param_order(path: Path, tensors: list[TensorInfo], objects: list[ObjectInfo],
                 optimizer: tuple) -> tuple[str, ...]:
    """Parameter order for int-keyed output: as the optimizer's ``param_groups`` list them
    (parameters without state included); else the order of optimizer state, else the model's."""
    n = len(optimizer)
    groups = sorted((o for o in objects if len(o.path) == n + 3 and tuple(map(str, o.path[:n])) == optimizer
                     and (o.path[n], o.path[n + 2]) == ("param_groups", "params")), key=lambda o: int(o.path[n + 1]))
    order: list[str] = []
    for o in groups:
        with safefs.open_file(path / o.location.file) as f:
            f.seek(o.location.offset)
            params = load_item(f.read(o.location.length), where=f"{path / o.location.file} ({o.name})")
        if isinstance(params, list) and all(isinstance(p, str) for p in params):
            order += params
    if order:
        return tuple(order)
    order = [t.param for t in tensors if t.group == "optimizer" and t.param]
    return tuple(dict.fromkeys(order)) or tuple(t.name for t in tensors if t.group == "model")


def _describe_one(path: Path, prefix: str):
    # (a chunk's storage entry in a table where the fast reader joined them: a row and 24
    # bytes a chunk, not ~260 of rows and dict, at the read's peak)
    stored = Stored()
    meta = load_dcp_metadata(path / METADATA, stored=stored)
    storage = meta.storage_data or {}
    paths = meta.planner_data if isinstance(meta.planner_data, dict) else {}
    where = str(path / METADATA)
    tensors, objects = [], []
    files: set[str] = set()  # the data files items are in, each resolved inside the root once

    # looked up by plain tuples: a many-rank save looks up one entry per item, and the records'
    # own hash and compare cost more than the rest of describing it. Its keys (rows, or records
    # where the reader built objects) hash and compare as those tuples, so it is its own index.
    # Each entry is taken out as its item is described: a 256-rank save's rows are ~20 MB, let
    # go while its description is built rather than held beside it (a second lookup of one
    # entry, two chunks at one offset, finds it gone: refused as a missing entry)
    by_tuple = type(storage) is dict and all(type(k) is IndexKey or type(k) is MetadataIndex for k in storage)

    joined_files: list[str | None] = [None] * len(stored.files)  # a joined entry's file, once resolved

    def met(rel: str, fqn: str) -> None:
        # a data file an item is in, resolved inside the root the first time it is met
        if rel not in files:
            safefs.resolve_inside(path, rel, what=f"{where}: item {fqn!r}")
            files.add(rel)

    def name_of(fqn: str, f: int) -> str:
        # a joined entry's file, by its id in ``stored.files``: resolved once
        name = joined_files[f]
        if name is None:
            rel = stored.files[f]
            met(rel, fqn)
            name = joined_files[f] = prefix + rel
        return name

    # this part's chunk tables' file names (one list for all) and values (Palette)
    table_files: list[str] = []
    table_ids: dict[str, int] = {}
    palette = Palette()
    via = [-1] * len(stored.files)  # a joined entry's file id -> its index in table_files

    def table_of(fqn: str, rows: list, table: Any, n: int, rank: int, what: str) -> ChunkTable:
        # a tensor's chunks as columns: what the tuple of them holds, the same entries checked
        columns = TableColumns(table_files, table_ids, palette)
        for at, c in zip(range(0, 3 * len(rows), 3), rows):
            if type(c) is ChunkRow and len(c[0]) == rank:  # (non-negative ints of one length already)
                o, z = c
                if at < n and table[at] >= 0:
                    f = table[at]
                    i = via[f]
                    if i < 0:
                        i = via[f] = columns.names.code(name_of(fqn, f))
                    columns.put(o, z, i, table[at + 1], table[at + 2])
                    continue
            else:
                o = safefs.check_dims(c.offsets, what=f"{what} chunk offsets", rank=rank)
                z = safefs.check_dims(c.sizes, what=f"{what} chunk sizes", rank=rank)
            loc = location(fqn, o)
            columns.add(o, z, loc.file, loc.offset, loc.length)
        return columns.table("torch_item")

    def location(fqn: str, offset: tuple[int, ...] | None = None, kind: str = "torch_item") -> Location:
        # (``offset``: a chunk's, checked to be a tuple of ints: the index's key as it stands)
        try:
            info = storage.pop((fqn, offset) if offset is not None else MetadataIndex.key_of(fqn, None)) \
                if by_tuple else storage[MetadataIndex(fqn=fqn, offset=offset)]
        except KeyError:
            raise BadInput(f"{path / METADATA}: no storage entry for {fqn!r} at {offset} (none, or one named "
                           "twice); the metadata is incomplete") from None
        if type(info) is StorageRow:  # (a row: its ints read as ints, no transforms)
            rel, offset, length = info
            if rel in files and offset >= 0 and length >= 0:  # (the usual: its file met before)
                return Location(prefix + rel, kind, offset, length)
        rel = info.relative_path
        met(rel, fqn)
        if getattr(info, "transform_descriptors", None):
            raise BadInput(f"{where}: item {fqn!r} is stored with transforms "
                           f"{brief(info.transform_descriptors)}, which ckpt cannot read yet")
        offset, length = safefs.check_span(info.offset, info.length, None, what=f"{where}: item {fqn!r}")
        return Location(prefix + rel, kind, offset, length)

    try:
        items = list(meta.state_dict_metadata.items())
    except (AttributeError, TypeError) as e:
        raise BadInput(f"{path / METADATA}: malformed DCP metadata ({e})") from e
    try:
        for fqn, _ in items:
            if not isinstance(fqn, str):
                raise BadInput(f"{where}: an item is keyed by a {type(fqn).__name__}, not a name")
        try:
            roots = find_roots((_obj_path(paths.get(fqn), fqn, where) or (fqn,), isinstance(md, TensorStorageMetadata))
                               for fqn, md in items)
        except BadInput as e:
            raise BadInput(f"{where}: {e}") from None
        for fqn, md in items:
            group, name, param, state = _classify(fqn, _obj_path(paths.get(fqn), fqn, where),
                                                  isinstance(md, TensorStorageMetadata), roots)
            if isinstance(md, TensorStorageMetadata):
                what = f"{where}: tensor {fqn!r}"
                shape = safefs.check_dims(md.size, what=f"{what} size")
                rank = len(shape)
                table = stored.tables.get(fqn)  # (its chunks' joined entries, by place; else none joined)
                n = 0 if table is None else len(table)
                chunks = table_of(fqn, md.chunks, table, n, rank, what)
                if len(md.chunks) < TABLE_MIN:  # (a few chunks: held as Chunks, a table's columns cost more)
                    chunks = tuple(chunks)
                md.chunks = None  # (its rows let go: the chunks above hold what they said)
                tensors.append(TensorInfo(group, name, shape, md.properties.dtype, chunks, param, state,
                                          path=tuple(paths.get(fqn) or (fqn,))))
            elif isinstance(md, BytesStorageMetadata):
                path_ = _obj_path(paths.get(fqn), fqn, where) or tuple(fqn.split("."))
                objects.append(ObjectInfo(group, name, location(fqn, None, "bytes_item"), path=path_))
            else:
                raise BadInput(f"{path / METADATA}: item {fqn!r} has unknown metadata {type(md).__name__}")
    except (AttributeError, TypeError, ValueError) as e:
        raise BadInput(f"{path / METADATA}: malformed DCP metadata ({type(e).__name__}: {e})") from e
    entries = []
    ranks = set()
    sizes = {}
    absent = [f for f in sorted(files) if not os.path.lexists(path / f)]
    if absent:
        raise Damaged(f"{path / absent[0]}: missing" + (f" (and {len(absent) - 1} more data files)" if len(absent) > 1 else "")
                       + f"; {METADATA} lists {len(files)} data files, so the checkpoint is incomplete: copy it again, "
                       "every file of the directory")
    for f in sorted(files):
        size = safefs.require_regular(path / f, what=f"{where}: data file {f!r}").st_size
        sizes[prefix + f] = size
        entries.append(FileEntry(prefix + f, size))
        m = RANK_FILE.match(f)
        if m:
            ranks.add(int(m.group(1)))
    entries.append(FileEntry(prefix + METADATA, (path / METADATA).stat().st_size))
    def within(loc: Location, what: str) -> None:
        if loc.offset + loc.length > sizes[loc.file]:
            raise BadInput(f"{path / loc.file.removeprefix(prefix)}: item {what!r} ends at byte {loc.offset + loc.length}, "
                           f"but the file has {sizes[loc.file]}; it is truncated: copy it again")

    for t in tensors:
        itemsize = t.dtype.itemsize
        for csizes, file, start, length in extents(t.chunks):  # (no chunk made of a table)
            if start + length > sizes[file]:
                within(Location(file, "torch_item", start, length), t.name)
            # refuse declared sizes the stored bytes cannot hold, before anything is allocated
            if length < math.prod(csizes) * itemsize:
                raise BadInput(f"{path / METADATA}: tensor {t.name!r} declares a chunk of {csizes} "
                               f"({math.prod(csizes) * itemsize} bytes) stored in {length} bytes")
    for o in objects:
        within(o.location, o.name)
    # non-tensor items are small: load each now (weights_only), so one carrying code is refused
    # by every command, not only by those that read it
    handles: dict[str, Any] = {}
    try:
        for o in objects:
            f = handles.get(o.location.file) or handles.setdefault(
                o.location.file, safefs.open_file(path / o.location.file.removeprefix(prefix)))
            f.seek(o.location.offset)
            load_item(f.read(o.location.length), where=f"{path / o.location.file.removeprefix(prefix)} ({o.name})")
    finally:
        for f in handles.values():
            f.close()
    return tensors, objects, entries, ranks, roots


def load_item(blob: bytes, *, where: str) -> Any:
    """A small non-tensor item (``param_groups``, a counter), read without torch when its pickle
    holds plain data only; otherwise torch's weights_only loader reads it, or refuses it."""
    import io

    try:
        tree = loads_blob(io.BytesIO(blob), where=where)
        if not any(isinstance(n, (Global, NewObj, Reduce, StorageRef)) for n in bounded.distinct_nodes(tree)):
            return tree
    except bounded.HostileTree:
        raise  # torch's loader would build the same runaway tree
    except BadInput:
        pass
    from ..security.safeload import load_torch_bytes

    return load_torch_bytes(blob, where=where)


def _obj_path(value: Any, fqn: str, where: str) -> tuple | None:
    """A ``planner_data`` entry: DCP's nesting path of ``fqn``, a short sequence of names and
    indices (anything else, e.g. nested lists, is corrupt metadata)."""
    if value is None:
        return None
    if not isinstance(value, (tuple, list)) or len(value) > 64 or not all(
            type(p) in (str, int) for p in value):
        raise BadInput(f"{where}: the nesting path of {fqn!r} is {brief(value)}, not a list of names; "
                       "the metadata is corrupt")
    return tuple(value)


def _classify(fqn: str, obj_path: tuple | None, is_tensor: bool,
              roots: Roots) -> tuple[str, str, str | None, str | None]:
    """Group, name, parameter and state key of a flattened DCP key, from the nesting path
    ``dcp.save`` kept in ``planner_data`` (FQNs hold dots, so keys are never split on them).
    Where the model and optimizer were found by what they hold (``roots``), by them alone."""
    if roots.found:
        parts = [str(p) for p in obj_path or (fqn,)]
        group = roots.group_of(parts)
        if group == "optimizer":
            rest = parts[len(roots.optimizer):]
            if rest[0] == "state" and len(rest) >= 3:
                return "optimizer", f"state.{rest[1]}.{'.'.join(rest[2:])}", rest[1], ".".join(rest[2:])
            return "optimizer", ".".join(rest), None, None
        if group == "model":
            return "model", ".".join(parts[len(roots.model):]), None, None
        return "extra", fqn, None, None
    if not obj_path:
        # no planner data: only the "optimizer." prefix is unambiguous
        if fqn.startswith("optimizer.state."):
            param, _, state = fqn.removeprefix("optimizer.state.").rpartition(".")
            return "optimizer", f"state.{param}.{state}", param, state
        if fqn.startswith("optimizer."):
            return "optimizer", fqn.removeprefix("optimizer."), None, None
        return ("model" if is_tensor else "extra"), fqn, None, None
    parts = [str(p) for p in obj_path]
    head = parts[0]
    if head == "optimizer":
        if len(parts) >= 4 and parts[1] == "state":
            return "optimizer", f"state.{parts[2]}.{'.'.join(parts[3:])}", parts[2], ".".join(parts[3:])
        if len(parts) == 2 and parts[1].startswith("state."):
            # torchtitan's flatten_optimizer_state_dict: ("optimizer", "state.<fqn>.<key>")
            param, _, state = parts[1].removeprefix("state.").rpartition(".")
            return "optimizer", parts[1], param, state
        return "optimizer", ".".join(parts[1:]), None, None
    if head == "model" and len(parts) >= 2:
        return "model", ".".join(parts[1:]), None, None
    if len(parts) == 1:
        # a top-level key: a tensor is model state saved flat (dcp.save(model.state_dict()),
        # torchtitan); anything else is the job's own state (train_state, dataloader, ...)
        return ("model" if is_tensor and not roots.nested_model else "extra"), fqn, None, None
    return "extra", fqn, None, None


# -- writing ------------------------------------------------------------------------------

def canonical(path, canon: dict) -> tuple:
    """``path`` with each string replaced by the first equal one seen (``canon``): pickle
    memoizes by identity, so equal key strings must be one object, whichever process built
    them, for ``.metadata`` to come out the same bytes (both DCP writers do this)."""
    return tuple(canon.setdefault(p, p) if isinstance(p, str) else p for p in path)


def tensor_record(p) -> tuple:
    """What ``.metadata`` says of piece ``p``, as plain data: its nesting path, dtype, the
    tensor's shape, the piece's offsets and sizes."""
    return dcp_key(p.target), p.target.dtype, p.target.shape, p.offsets, p.sizes


class Records:
    """What a DCP writer wrote into one data file, for its ``.metadata``, in the order written:
    it iterates as ``(kind, what, start, length)``, as a list of those (which
    :func:`~ckpt_tools.formats.dcpnative.metadata_of` reads too) would. A tensor's item is kept
    as three references (its tensor's ``(path, dtype, shape)``, one tuple for all files, and
    the piece's offsets and sizes) and two 8-byte numbers: ~40 bytes, where a record's tuples
    and ints were ~220 (12 MB of a 256-rank reshard's peak, held from the first file written
    to the ``.metadata``)."""

    __slots__ = ("_refs", "_spans")

    def __init__(self, refs: list | None = None, spans: bytes = b"") -> None:
        self._refs = refs if refs is not None else []  # (head, offsets, sizes) or (kind, what, None) each
        self._spans = array("q")  # (start, length) each
        self._spans.frombytes(spans)

    def tensor(self, head: tuple, offsets: tuple, sizes: tuple, start: int, length: int) -> None:
        """A tensor's piece; ``head``: ``(path, dtype, shape)`` as :func:`tensor_record` gives them."""
        self._refs += (head, offsets, sizes)
        self._spans.extend((start, length))

    def append(self, record: tuple) -> None:
        """Any record, ``(kind, what, start, length)``."""
        kind, what, start, length = record
        if kind == "tensor":
            self.tensor(what[:3], what[3], what[4], start, length)
        else:
            self._refs += (kind, what, None)
            self._spans.extend((start, length))

    def __iter__(self) -> Iterator[tuple]:
        refs, spans = self._refs, self._spans
        for i in range(len(spans) // 2):
            a, b, c = refs[3 * i:3 * i + 3]
            if type(a) is tuple:
                yield "tensor", (*a, b, c), spans[2 * i], spans[2 * i + 1]
            else:
                yield a, b, spans[2 * i], spans[2 * i + 1]

    def __len__(self) -> int:
        return len(self._spans) // 2

    def clear(self) -> None:
        self._refs.clear()
        del self._spans[:]

    def __reduce__(self) -> tuple:  # (its numbers as bytes: a worker hands its records back so)
        return Records, (self._refs, self._spans.tobytes())


def by_part(written: dict) -> dict[str, list]:
    """The files a DCP writer wrote (``written``: path -> (order, records)) in the plan's order
    (``FileJob.meta["order"]``, set by the layout), grouped by part directory (``""``: the root)."""
    parts: dict[str, list] = {}
    for rel, (_, records) in sorted(written.items(), key=lambda kv: kv[1][0]):
        parts.setdefault(rel.rpartition("/")[0], []).append((rel, records))
    return parts


def dcp_key(target) -> tuple:
    """The nesting path of a tensor in the DCP written: its DCP source's own path, unchanged
    (a reshard never renames, nests or un-nests a key); else the path ``dcp.save`` gives a
    tensor of ``get_state_dict``'s output."""
    source = target.source
    if source.path and (target.group, target.name) == (source.group, source.name):
        return source.path
    if target.group == "optimizer" and target.param:
        return ("optimizer", "state", target.param, target.state)
    return (target.group, target.name)


def renamed_keys(state: dict, planner: dict, storage: dict, keys: dict[str, str], canon: dict
                 ) -> tuple[dict, dict, dict]:
    """A DCP's metadata (its three maps, as a writer builds them) with top-level keys renamed
    (``{"optimizer": "optim"}``: ``optimizer.state.w.exp_avg`` -> ``optim.state.w.exp_avg``),
    for a loader whose state dict names them so (``convert --to dcp --keys``)."""
    new: dict[str, tuple[str, tuple]] = {}
    for fqn, path_ in planner.items():
        if path_ and str(path_[0]) in keys:
            p = canonical((keys[str(path_[0])], *path_[1:]), canon)
            new[fqn] = (".".join(map(str, p)), p)
    if not new:
        return state, planner, storage

    def name(fqn: str) -> str:
        return new[fqn][0] if fqn in new else fqn

    state = {name(k): v for k, v in state.items()}
    planner = {name(k): (new[k][1] if k in new else v) for k, v in planner.items()}
    out = {}
    for i, v in storage.items():
        if i.fqn in new:
            offset = getattr(i, "offset", None)
            i = type(i)(name(i.fqn), offset, i.index) if offset is not None else type(i)(name(i.fqn), index=i.index)
        out[i] = v
    return state, planner, out


class Writer:
    """A DCP directory as an M-rank ``dcp.save`` lays it out: ``__{r}_0.distcp`` holding rank
    r's rows of every sharded tensor, replicated entries (scalars, objects) saved once by rank
    0, items written as ``torch.save`` blobs, and ``.metadata`` (DCP's own classes) last.

    A job's path may name a part directory (accelerate's ``pytorch_model_fsdp_0/``): each part
    gets its own ``.metadata``. Non-tensor items of a DCP source (``source``: its directory) are
    copied as the bytes they were saved as, under their own keys."""

    single_file = False

    def __init__(self, *, param_order: tuple[str, ...] = (), source: Path | None = None,
                 top_level_model: bool = False, keys: dict[str, str] | None = None) -> None:
        self.param_order = param_order
        self.keys = dict(keys or {})
        self.source = source
        # torchtitan's layout: model keys at the top level, no "model." prefix
        self.top_level_model = top_level_model

    def _blob(self, o) -> bytes | None:
        if self.source is None or o.location.kind != "bytes_item" or not o.path:
            return None
        with open(self.source / o.location.file, "rb") as f:
            f.seek(o.location.offset)
            return f.read(o.location.length)

    def write(self, path: Path, job, pieces, objects) -> None:
        import io

        import torch

        from ..codecs.torchzip import recorded_writes

        records = []
        with open(path, "wb") as raw, recorded_writes(raw) as f:
            for i, (_, values) in enumerate(pieces):
                start = f.tell()
                torch.save(compact(values), f)
                # what .metadata says of it, as plain data: finish() needs no plan (the
                # processes of a torchrun launch each plan only their own files)
                records.append(("tensor", tensor_record(job.pieces[i]), start, f.tell() - start))
            blobs = [(o, self._blob(o)) for o in job.objects]
            for i, (o, blob) in enumerate(blobs):
                if blob is not None:
                    start = f.tell()
                    f.write(blob)
                    records.append(("object", o.path, start, len(blob)))
            rest = tuple(o for o, blob in blobs if blob is None)
            if rest or job.meta.get("extra"):
                from torch.distributed.checkpoint._nested_dict import flatten_state_dict

                nested = gather(rest, objects)
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
        return job.meta.get("order", ()), records

    def finish(self, out: Path, jobs, written: dict) -> None:
        for part, files in by_part(written).items():
            self._metadata(out / part if part else out, files)

    def _metadata(self, out: Path, files: list) -> None:
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
        canon: dict = {}
        for rel, records in files:
            file = rel.rpartition("/")[2]
            for kind, what, start, length in records:
                if kind == "tensor":
                    path_, dtype, shape, offsets, sizes = what
                    if self.top_level_model and path_[0] == "model":
                        path_ = path_[1:]
                    path_ = canonical(path_, canon)
                    fqn = ".".join(map(str, path_))
                    md = state.setdefault(fqn, TensorStorageMetadata(
                        properties=TensorProperties(dtype=as_torch(dtype)), size=torch.Size(shape), chunks=[]))
                    md.chunks.append(ChunkStorageMetadata(offsets=torch.Size(offsets), sizes=torch.Size(sizes)))
                    storage[MetadataIndex(fqn, torch.Size(offsets))] = _StorageInfo(file, start, length)
                else:
                    if kind == "object":
                        path_ = canonical(what, canon)
                        fqn = ".".join(map(str, path_))
                    else:
                        fqn, path_ = what[0], canonical(what[1], canon)
                    state[fqn] = BytesStorageMetadata()
                    storage[MetadataIndex(fqn)] = _StorageInfo(file, start, length)
                planner[fqn] = path_
        if self.keys:
            state, planner, storage = renamed_keys(state, planner, storage, self.keys, canon)
        meta = Metadata(state_dict_metadata=state, planner_data=planner, storage_data=storage, version="1.0.0")
        # written last, as dcp.save does: a reader that finds it knows the data files are complete
        with open(out / METADATA, "wb") as f:
            pickle.dump(meta, f)


def compact(t: torch.Tensor) -> torch.Tensor:
    """``t`` with a storage of exactly its own bytes (torch.save writes whole storages)."""
    t = t.contiguous()
    if t.storage_offset() or t.untyped_storage().nbytes() != t.numel() * t.element_size():
        t = t.clone()
    return t
