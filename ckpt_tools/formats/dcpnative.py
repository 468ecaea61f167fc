"""DCP directories written without torch: the bytes :class:`ckpt_tools.formats.dcp.Writer`
(torch's own ``torch.save`` and ``pickle.dump`` of DCP's classes) writes, made by ckpt.

Why: a ``.distcp`` file is a sequence of ``torch.save`` blobs, and ``.metadata`` a pickle of
DCP's dataclasses. Importing torch to write them costs over a second, and ``torch.save`` copies
every byte through the process. Here each tensor item is a zip laid out by
:class:`~ckpt_tools.codecs.torchwriter.TorchZipWriter` exactly as torch's stream writer lays it out, its
pickle the one torch writes for a plain contiguous tensor, its storage record copied file to
file by the kernel when no cast is asked (its CRC computed alongside by another thread), or
cast block by block (:mod:`ckpt_tools.storage.castio`). The non-tensor items (``param_groups``,
counters, merged extra state) are copied as their source saved them, or re-emitted from their
pickle trees; ``.metadata`` comes from :mod:`ckpt_tools.codecs.metapickle`. Byte-identical to the torch
writer's output (tested).

A framework's layout kept by ``reshard`` (part directories, each with its own ``.metadata``; a
DCP source's non-tensor items copied as saved) and torchtitan's top-level model keys are laid
out as the torch writer lays them out.

What it does not cover (the caller keeps torch's writer for it, see :func:`native_writer`):
dtypes with no legacy storage class (uint16, float8, ...), and saved objects or extra state that
hold tensors or anything but plain data (RNG states: numpy arrays, tensors).
"""

from __future__ import annotations

import functools

import os
import pickle
from zlib import crc32
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from ..codecs import metaemit, metapickle as mp
from ..codecs.tensornodes import REBUILD_V2, STORAGE_DTYPES, contiguous_stride
from ..codecs.torchpickler import dumps
from ..codecs.torchwriter import SMALL_RECORD, Sources, TorchZipWriter, ZipTemplate, parts_size
from ..core.describe import Checkpoint, ObjectInfo
from ..core.plan import Span
from ..errors import BadInput, Damaged
from ..security import bounded
from ..security.torchfile import Global, NewObj, Reduce, StorageRef, loads_blob
from ..storage.castio import CastSpan, blocks
from ..storage.diskio import Flusher, copy_range, write_all
from .dcp import METADATA, Records, by_part, canonical, dcp_key, renamed_keys
from .hf import tensor_bytes
from .shardtree import parsed

STORAGE_OF = {dtype: name for name, dtype in STORAGE_DTYPES.items()}
_ODICT = Global("collections", "OrderedDict")
# The first half of a blob's ``.data/serialization_id`` hashes its record names (torch takes it
# from a std::unordered_set's order, which is not reproduced here); a DCP item's names are always
# the same few, so these are constants (checked against torch.save in the tests).
TENSOR_NAME_HASH = "15728199511854643026"  # data.pkl .format_version .storage_alignment byteorder data/0 version
OBJECT_NAME_HASH = "02908468677762923104"  # the same without data/0
_SMALL = ((".format_version", b"1"), (".storage_alignment", b"64"), ("byteorder", b"little"))


class NotNative(Exception):
    """Something only torch's writer writes; the caller falls back to it."""


def tensor_pickle(dtype: str, sizes: tuple[int, ...]) -> bytes:
    """The ``data.pkl`` torch.save writes for a contiguous CPU tensor with its own storage
    (one template per dtype and shape: a many-rank DCP repeats a few thousand times each)."""
    return _tensor_pickle(str(dtype), tuple(sizes))


@functools.lru_cache(maxsize=4096)
def _tensor_pickle(dtype: str, sizes: tuple[int, ...]) -> bytes:
    storage = STORAGE_OF.get(str(dtype))
    if storage is None:
        raise NotNative(f"no legacy storage class for {dtype}")
    numel = 1
    for s in sizes:
        numel *= s
    ref = StorageRef(Global("torch", storage), "0", "cpu", numel)
    return dumps(Reduce(REBUILD_V2, (ref, 0, tuple(sizes), contiguous_stride(tuple(sizes)), False, Reduce(_ODICT, ()))))


@functools.lru_cache(maxsize=1024)
def _item_template(dtype: str, sizes: tuple[int, ...], nbytes: int) -> ZipTemplate:
    """The zip of a tensor item of ``dtype`` and ``sizes`` (``nbytes`` of data), as written
    record by record in :meth:`Writer._write_items`."""
    return ZipTemplate("archive", (("data.pkl", tensor_pickle(dtype, sizes)), *_SMALL), "data/0", nbytes,
                       TENSOR_NAME_HASH)


class _Batch:
    """Small items' bytes gathered and written 1 MiB at a time at ``fd``'s position; ``add``
    returns where an item starts in the file."""

    def __init__(self, fd: int, flusher: Flusher) -> None:
        self.fd, self.flusher, self.buf, self.at = fd, flusher, bytearray(), None

    def add(self, blob: bytes | bytearray) -> int:
        if self.at is None:
            self.at = os.lseek(self.fd, 0, os.SEEK_CUR)
        start = self.at + len(self.buf)
        self.buf += blob
        if len(self.buf) >= 1 << 20:
            self.flush()
        return start

    def flush(self) -> None:
        if self.buf:
            write_all(self.fd, self.buf, self.flusher)
            self.buf.clear()
        self.at = None


def plain(tree: Any) -> bool:
    """A tree of containers and scalars only (no tensor, no global)."""
    if isinstance(tree, (Global, NewObj, Reduce, StorageRef)):
        return False
    if isinstance(tree, dict):
        return type(tree) is dict and all(plain(k) and plain(v) for k, v in tree.items())
    if isinstance(tree, (list, tuple)):
        return all(plain(v) for v in tree)
    return tree is None or isinstance(tree, (str, bytes, int, float, bool, complex))


class _Leaf:
    """A saved value and, when it is a whole item of the source, where its blob lies."""

    __slots__ = ("value", "blob")

    def __init__(self, value: Any, blob: tuple[Path, int, int] | None) -> None:
        self.value, self.blob = value, blob


def _expand(value: Any, blob: tuple[Path, int, int] | None) -> Any:
    """Mappings and lists DCP would traverse become containers; a terminal value a leaf."""
    if isinstance(value, Mapping):
        return {k: _expand(v, None) for k, v in value.items()}
    if isinstance(value, list) and not _terminal(value):
        return [_expand(v, None) for v in value]
    return _Leaf(value, blob)


def _terminal(value: Any) -> bool:
    """DCP's ``traverse_state_dict._is_terminal`` for plain data (no tensors in it)."""
    if isinstance(value, Mapping):
        return False
    if isinstance(value, list):
        return not any(isinstance(e, (Mapping, list)) and not _terminal(e) for e in value)
    return True


def _set_element(root: dict, path: tuple, value: Any) -> None:
    """DCP's ``_traverse.set_element``: dicts for string keys, lists (padded) for ints."""
    cur: Any = root
    for i in range(1, len(path)):
        prev, key = path[i - 1], path[i]
        default: Any = {} if type(key) is str else []
        if isinstance(cur, Mapping):
            cur = cur.setdefault(prev, default)
        else:
            while len(cur) <= prev:
                cur.append(None)
            if cur[prev] is None:
                cur[prev] = default
            cur = cur[prev]
    key = path[-1]
    if type(key) is int:
        while len(cur) <= key:
            cur.append(None)
    cur[key] = value


def _flatten(nested: dict) -> list[tuple[str, tuple, _Leaf]]:
    """DCP's ``flatten_state_dict`` over containers of leaves: (key, path, leaf) in its order."""
    out: list[tuple[str, tuple, _Leaf]] = []

    def leaf_of(value: Any) -> _Leaf:
        if type(value) is _Leaf:
            return value
        return _Leaf(_unwrap(value), None)

    def visit(path: tuple, value: Any) -> None:
        if isinstance(value, Mapping):
            for k, v in value.items():
                visit(path + (str(k),), v)
        elif type(value) is _Leaf or value is None or (isinstance(value, list) and _terminal_wrapped(value)):
            out.append((".".join(map(str, path)), path, leaf_of(value)))
        else:
            for i, v in enumerate(value):
                visit(path + (i,), v)

    for key, value in nested.items():
        visit((str(key),), value)
    return out


def _terminal_wrapped(value: list) -> bool:
    return not any(isinstance(e, Mapping) or (isinstance(e, list) and not _terminal_wrapped(e)) for e in value)


def _unwrap(value: Any) -> Any:
    if type(value) is _Leaf:
        return value.value
    if isinstance(value, Mapping):
        return {k: _unwrap(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_unwrap(v) for v in value]
    return value


class Writer:
    """A DCP directory laid out as :class:`ckpt_tools.formats.dcp.Writer` lays it out, written
    without torch. Build it with :func:`native_writer`, which says whether it can."""

    single_file = False
    accepts_spans = True
    accepts_casts = True

    def __init__(self, *, root: Path, param_order: tuple[str, ...] = (), extras: bool = False,
                 verbatim: bool = False, top_level_model: bool = False, keys: dict[str, str] | None = None) -> None:
        self.root = Path(root)  # the source's base directory, for its saved objects
        self.param_order = param_order
        # job.meta["extra"] holds plain pickle trees (merged per-rank state, read without torch)
        self.extras = extras
        # a DCP source's own non-tensor items are copied as saved, under their own keys (a
        # framework's layout kept by reshard), as the torch writer's ``source`` does
        self.verbatim = verbatim
        # torchtitan's layout: model keys at the top level, no "model." prefix
        self.top_level_model = top_level_model
        self.keys = dict(keys or {})
        self._heads: dict[int, tuple] = {}  # id(target) -> (target, its (path, dtype, shape)): one for all files

    def _head(self, target: Any) -> tuple:
        got = self._heads.get(id(target))
        if got is None or got[0] is not target:
            got = self._heads[id(target)] = (target, (dcp_key(target), target.dtype, target.shape))
        return got[1]

    def _as_saved(self, o: ObjectInfo) -> bool:
        return self.verbatim and o.location.kind == "bytes_item" and bool(o.path)

    def _rest(self, job) -> list[tuple[str, tuple, _Leaf]]:
        """The job's items that are not copied as saved, flattened, in the torch writer's order."""
        rest = tuple(o for o in job.objects if not self._as_saved(o))
        return self.items(rest, job.meta.get("extra") if self.extras else None)

    # -- saved objects ------------------------------------------------------------------
    def _source_value(self, o: ObjectInfo) -> tuple[Any, tuple[Path, int, int] | None]:
        loc = o.location
        if loc.kind == "bytes_item":
            path = self.root / loc.file
            with open(path, "rb") as f:
                f.seek(loc.offset)
                data = f.read(loc.length)
            if len(data) != loc.length:
                raise Damaged(f"{path}: item {o.name!r} is truncated")
            import io

            try:
                tree = loads_blob(io.BytesIO(data))
            except BadInput as e:
                raise NotNative(str(e)) from e
            blob = (path, loc.offset, loc.length)
        elif loc.kind == "pickled" and loc.key:
            try:
                tree = parsed(self.root / loc.file).tree
                for k in loc.key:
                    tree = tree[k]
            except (BadInput, KeyError, IndexError, TypeError) as e:
                raise NotNative(str(e)) from e
            blob = None
        else:
            raise NotNative(f"a {loc.kind} object")
        if not plain(tree):
            raise NotNative(f"object {o.name!r} holds more than plain data")
        return tree, blob

    def items(self, objects: tuple[ObjectInfo, ...], extra: dict | None = None) -> list[tuple[str, tuple, _Leaf]]:
        """The flattened non-tensor items the torch writer would save for ``objects`` (and the
        ``extra`` values), in its order: nested by their paths, ``param_groups`` keyed by FQN,
        flattened as DCP does."""
        if not objects and not extra:
            return []
        nested = self.nested(objects) if objects else {}
        for key, value in (extra or {}).items():
            if not plain(value):
                raise NotNative(f"extra state {key!r} holds more than plain data")
            nested[key] = _expand(value, None)
        opt = nested.get("optimizer")
        if isinstance(opt, Mapping) and "param_groups" in opt:
            opt["param_groups"] = self._keyed(opt["param_groups"])
        return _flatten(nested)

    def nested(self, objects: tuple[ObjectInfo, ...]) -> dict:
        """``state.gather`` without torch: the objects nested by their paths, as leaves."""
        flat: dict[str, tuple[tuple, Any]] = {}
        for o in objects:
            path = o.path or (o.group, o.name)
            value, blob = self._source_value(o)
            # state.nest: a repeated key keeps its place, with the later path and value
            flat[".".join(map(str, path))] = (tuple(path), _expand(value, blob))
        nested: dict = {}
        for mapping, value in flat.values():
            _set_element(nested, mapping, value)
        return nested

    def values(self, objects: tuple[ObjectInfo, ...]) -> dict:
        """The objects nested by their paths, as plain values (what ``state.gather`` returns)."""
        return _unwrap(self.nested(objects)) if objects else {}

    def _keyed(self, groups: Any) -> list:
        """``state.param_groups_keyed(..., keyed="fqn")`` over leaves: each group copied, its
        ``params`` a new list (ints named by the parameter order)."""
        if type(groups) is _Leaf:  # a terminal list: empty, or of no dicts
            groups = [_expand(g, None) for g in groups.value] if isinstance(groups.value, list) else None
        if not isinstance(groups, list):
            raise NotNative("param_groups that are not a list")
        out = []
        for g in groups:
            if not isinstance(g, Mapping):
                raise NotNative("a param group that is not a dict")
            g = dict(g)
            old = _unwrap(g.get("params", []))
            params = []
            for p in old:
                params.append(self.param_order[p] if isinstance(p, int) and p < len(self.param_order) else p)
            g["params"] = _Leaf(params, None)
            out.append(g)
        return out

    # -- files ----------------------------------------------------------------------------
    def check(self, jobs) -> None:
        """Raise NotNative before anything is written if a job needs torch's writer."""
        for job in jobs:
            if job.meta.get("extra") and not self.extras:
                raise NotNative("extra state merged through torch's loader")
            for t in job.targets():  # (pieces made on demand are not made for it)
                if str(t.dtype) not in STORAGE_OF:
                    raise NotNative(f"{t.dtype} has no legacy storage class")
            for _, _, leaf in self._rest(job):
                if leaf.blob is None and not plain(leaf.value):
                    raise NotNative("an object that is not plain data")

    def write(self, path: Path, job, pieces, objects) -> list:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        try:
            # the file reaches the disk while it is written; its items' sources open once
            with Flusher(fd) as flusher, Sources() as sources:
                return self._write_items(path, fd, flusher, sources, job, pieces)
        finally:
            os.close(fd)

    def _write_items(self, path: Path, fd: int, flusher: Flusher, sources: Sources, job, pieces) -> list:
        """Each item, written at ``fd``'s position: ``(kind, which, offset, length)`` each."""

        records = Records()
        it = iter(pieces)
        batch = _Batch(fd, flusher)  # small items' zips, rendered from a template per dtype and shape
        for i, p in enumerate(job.pieces):
            got, values = next(it)
            if got is not p:
                raise RuntimeError("the engine's stream is out of the plan's order")
            small = None  # a small item's bytes and CRC-32, for its zip rendered from the template
            if isinstance(values, Span):
                size = parts_size(values.parts)
                if size <= SMALL_RECORD:
                    small = sources.small(values.parts, size)
            elif isinstance(values, CastSpan) and values.nbytes <= SMALL_RECORD:
                # a small cast, converted in memory (its zip written record by record was ~3/4
                # of a many-tensor cast's time)
                data = b"".join([bytes(block) for block in blocks(values)])  # (each valid until the next)
                small = data, crc32(data)
            if small is not None:
                blob = _item_template(str(p.target.dtype), tuple(p.sizes), len(small[0])).render(*small)
                records.tensor(self._head(p.target), p.offsets, p.sizes, batch.add(blob), len(blob))
                continue
            batch.flush()
            start = os.lseek(fd, 0, os.SEEK_CUR)
            with TorchZipWriter(path, "archive", fd=fd, flusher=flusher, sources=sources) as z:
                z.write_record("data.pkl", tensor_pickle(p.target.dtype, p.sizes))
                for name, data in _SMALL:
                    z.write_record(name, data)
                if isinstance(values, Span):
                    z.copy_record("data/0", values.parts)
                elif isinstance(values, CastSpan):
                    z.write_stream("data/0", values.nbytes, blocks(values))
                else:
                    z.write_record("data/0", tensor_bytes(values))
                z.close(name_hash=TENSOR_NAME_HASH)
            records.tensor(self._head(p.target), p.offsets, p.sizes, start, os.lseek(fd, 0, os.SEEK_CUR) - start)
        batch.flush()
        for i, o in enumerate(job.objects):
            if self._as_saved(o):
                start = os.lseek(fd, 0, os.SEEK_CUR)
                loc = o.location
                with open(self.root / loc.file, "rb") as src:
                    copy_range(src.fileno(), fd, loc.offset, loc.length, what=self.root / loc.file, flusher=flusher)
                records.append(("object", o.path, start, loc.length))
        for key, obj_path, leaf in self._rest(job):
            start = os.lseek(fd, 0, os.SEEK_CUR)
            if leaf.blob is not None:
                with open(leaf.blob[0], "rb") as src:
                    copy_range(src.fileno(), fd, leaf.blob[1], leaf.blob[2], what=leaf.blob[0], flusher=flusher)
            else:
                with TorchZipWriter(path, "archive", fd=fd, flusher=flusher) as z:
                    z.write_record("data.pkl", dumps(leaf.value))
                    for name, data in _SMALL:
                        z.write_record(name, data)
                    z.close(name_hash=OBJECT_NAME_HASH)
            records.append(("bytes", (key, obj_path), start, os.lseek(fd, 0, os.SEEK_CUR) - start))
        # plain data, the plan's order beside it: finish() needs no plan (the processes of a
        # torchrun launch each plan only their own files)
        return job.meta.get("order", ()), records

    def finish(self, out: Path, jobs, written: dict) -> None:
        # the items' heads are spent once every file is written: let go before the .metadata's
        # rows are made (at 100k tensors, ~25 MB beside them at the writer's peak)
        self._heads.clear()
        for part, files in by_part(written).items():  # a part directory (accelerate's) each
            self._metadata(out / part if part else out, files)

    def _metadata(self, out: Path, files: list) -> None:
        # written last, as dcp.save does: a reader that finds it knows the data files are
        # complete (the output is staged: none sees it half-written). (Hundreds of thousands of
        # small objects and no cycles: the collector's passes over them were a third of the
        # step at 256 ranks with moments, 2.4 -> 1.5 s.)
        with bounded.gc_paused(), open(out / METADATA, "wb") as f:
            # (``files``: the engine's records, read here once: let go as the rows are made)
            meta, canon = metadata_of(files, top_level_model=self.top_level_model, consume=True)
            if not self.keys:
                try:
                    # a frame at a time as it is made (~20 MB at 256 ranks: never held whole)
                    return metaemit.dump(meta, f.write, pickle.DEFAULT_PROTOCOL)
                except metaemit.Unsupported:
                    f.seek(0)
                    f.truncate()
            meta = metaemit.stand_ins(meta)
            if self.keys:
                meta.state_dict_metadata, meta.planner_data, meta.storage_data = renamed_keys(
                    meta.state_dict_metadata, meta.planner_data, meta.storage_data, self.keys, canon)
            f.write(mp.dumps(meta))


def metadata_of(files: list, *, top_level_model: bool = False, consume: bool = False) -> tuple[mp.Metadata, dict]:
    """The ``.metadata`` of the data files written (``(relative path, records)`` each, in the
    plan's order), and the strings its keys were made one object of (``canon``). The same steps
    as the torch writer's, so the pickle shares strings and tuples as that one does (the pickle
    memoizes by identity); chunks and storage entries kept as their fields
    (:mod:`~ckpt_tools.codecs.metaemit` renders them), the rest as stand-ins of DCP's classes.
    ``consume``: each file's records list is emptied once read (at 256 ranks with moments, the
    records and the rows made of them were ~50 MB together at the writer's peak)."""
    state: dict = {}
    planner: dict = {}
    storage = metaemit.Entries()
    canon: dict = {}
    # a tensor's items after its first, by the path they name: its name and metadata, and
    # whether that name is its path's one string (``".".join`` of one name returns it: every
    # item refers to it). Else each item's name is a new string object, as the join built one
    # per item: an Anew row says so, the string not built and held per item (at 256 ranks,
    # 3.6 MB of names and 3.6 MB of the emitter's memo of them, each met once)
    seen: dict[tuple, tuple[str, Any, bool]] = {}
    # a chunk's (offsets, sizes): one pair per distinct value (a many-rank plan's are a few,
    # met 10^5 times; the pickle is the same whichever object holds them)
    pairs: dict[tuple, tuple] = {}
    for rel, records in files:
        file = rel.rpartition("/")[2]
        for kind, what, start, length in records:
            if kind == "tensor":
                key, dtype, shape, offsets, sizes = what
                got = seen.get(key)
                pair = (offsets, sizes)
                pair = pairs.setdefault(pair, pair)
                if got is not None:
                    fqn, md, one = got
                    md.chunks.append(pair)
                    storage.add(fqn, offsets, file, start, length, not one)
                    continue
                path_ = key[1:] if top_level_model and key[0] == "model" else key
                path_ = canonical(path_, canon)
                fqn = ".".join(map(str, path_))
                md = state.get(fqn)
                if md is None:
                    md = state[fqn] = mp.TensorStorageMetadata(
                        properties=mp.TensorProperties(dtype=mp.dtype(dtype)), size=mp.Size(shape),
                        chunks=metaemit.Chunks())
                    seen[key] = (fqn, md, len(path_) == 1 and fqn is path_[0])
                md.chunks.append(pair)
                storage.add(fqn, offsets, file, start, length)
            else:
                if kind == "object":
                    path_ = canonical(what, canon)
                    fqn = ".".join(map(str, path_))
                else:
                    fqn, path_ = what[0], canonical(what[1], canon)
                state[fqn] = mp.BytesStorageMetadata()
                storage.add(fqn, None, file, start, length)
            planner[fqn] = path_
        if consume:
            records.clear()
    meta = mp.Metadata(state_dict_metadata=state, planner_data=planner, storage_data=storage, version="1.0.0")
    return meta, canon


def native_writer(ckpt: Checkpoint, jobs, *, param_order: tuple[str, ...], extras: bool = False,
                  verbatim: bool = False, top_level_model: bool = False, keys: dict[str, str] | None = None
                  ) -> Writer | None:
    """The torch-free writer for ``jobs``, or None where torch's writer is needed. ``extras``:
    the jobs' extra state is plain pickle trees (else such state needs torch's writer);
    ``verbatim`` and ``top_level_model`` as :class:`ckpt_tools.formats.dcp.Writer`'s ``source``
    and ``top_level_model``."""
    writer = Writer(root=ckpt.base_dir(), param_order=param_order, extras=extras, verbatim=verbatim,
                    top_level_model=top_level_model, keys=keys)
    try:
        writer.check(jobs)
    except NotNative:
        return None
    return writer
