"""Reading the bytes a description points at: one chunk or one object at a time.

Files are memory-mapped, so a chunk costs page cache, not process memory, until it is copied.
A remote source's stand-in (:mod:`ckpt_tools.storage.remote`) holds only what was fetched: a
reader outside the engine's plan asks for each chunk's (or file's) bytes before reading them;
the engine's (``planned``) has had exactly its plan's ranges fetched (:mod:`.fetch`).
"""

from __future__ import annotations

import ast

import io
import mmap
import os
import struct
import zipfile
import zlib
import threading
from collections import OrderedDict
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ..codecs.tensornodes import NotSimple, local_of
from ..core.describe import Checkpoint, Chunk, Location, ObjectInfo, TensorInfo
from ..core.dtypes import as_torch, scalar_from_bytes
from ..errors import BadInput
from ..security import safefs
from ..security.torchfile import loads, loads_blob
from ..security.zipdir import blob_records, fixed_part, matches
from ..storage import diskio, remote
from .torchranges import TorchRanges

if TYPE_CHECKING:
    import torch


class Reader:
    """Reads chunks and objects of one checkpoint. Use as a context manager.

    ``torch.save``'d files are loaded memory-mapped (their tensors cost page cache, not
    memory) and kept, so a plan that walks W rank files tensor by tensor unpickles each once.
    """

    def __init__(self, ckpt: Checkpoint, *, cache_files: int | None = None, planned: bool = False):
        self.ckpt = ckpt
        self.planned = planned  # the engine made the plan's ranges present: no fetch on demand
        self._torch: TorchRanges | None = None
        self._maps: dict[str, mmap.mmap] = {}
        self._fds: dict[str, tuple[int, bool]] = {}  # files read by pread (small DCP items): fd, windowed
        self._windows: dict[str, tuple[int, bytes]] = {}  # by file: (offset, the bytes last read there)
        self._window = _window_for(len(ckpt.files))
        # windows read (a count), the count at each file's last, and the files whose last window
        # was a hot one's (see _pread), oldest first
        self._reads, self._read_at, self._hot = 0, {}, {}
        self._loaded: OrderedDict[str, Any] = OrderedDict()
        self._cache_files = cache_files
        # the engine's prefetch thread reads chunks while the writer reads objects
        self._lock = threading.RLock()
        self._paths: dict[str, Path] = {}

    def path(self, file: str) -> Path:
        """The path of a file of the checkpoint (made once: a chunk read asks for it)."""
        path = self._paths.get(file)
        if path is None:
            path = self._paths[file] = self.ckpt.base_dir() / file
        return path

    def __enter__(self) -> Reader:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        self._loaded.clear()
        for m in self._maps.values():
            try:
                m.close()
            except BufferError:  # a tensor still views it; the GC closes it later
                pass
        self._maps.clear()
        for fd, _ in self._fds.values():
            os.close(fd)
        self._fds.clear()
        self._windows.clear()
        self._hot.clear()

    # -- raw bytes ----------------------------------------------------------------------
    def _need(self, loc: Location) -> None:
        """A remote stand-in's bytes of ``loc`` fetched (whole: a reader outside a plan)."""
        self._need_at(loc.file, loc.kind, loc.offset, loc.length, loc.key)

    def _need_at(self, file: str, kind: str, offset: int, length: int, key: tuple) -> None:
        # (_need by a location's fields: a chunk's own, asked once per copy, with no Location made)
        if self.planned or not remote.any_standins():
            return
        path = self.path(file)
        if kind == "pickled":
            if remote.is_standin(path):  # the value's storage records (the pickle is there)
                with self._lock:
                    if self._torch is None:
                        self._torch = TorchRanges(self.ckpt.base_dir())
                remote.present(self._torch.of(file, key)[0])
        elif kind in ("raw", "torch_item", "bytes_item"):
            remote.present([(path, offset, offset + length)])

    def _map(self, file: str) -> mmap.mmap:
        with self._lock:
            return self._map_locked(file)

    def _map_locked(self, file: str) -> mmap.mmap:
        m = self._maps.get(file)
        if m is None:
            path = self.path(file)
            with safefs.open_file(path) as f:
                size = os.fstat(f.fileno()).st_size
                if size == 0:
                    raise BadInput(f"{path}: empty file")
                # ACCESS_COPY: a writable (copy-on-write) view, so torch.frombuffer needs no copy
                m = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY)
            self._maps[file] = m
        return m

    def _pread(self, file: str, offset: int, length: int) -> bytes:
        """``length`` bytes at ``offset`` of ``file`` (fewer where it ends first), read: from
        the window last read of that file where they lie in it, else with a window read from
        there (a job's items lie one after the other in each file, and a read each cost a
        hand-off of the interpreter's lock: 10 µs an item; its size: :func:`_window_for`). A
        remote source's stand-in is read range by range. Up to :data:`_OPEN_FILES` files are
        kept open and :data:`_WINDOWS_KEPT` windows (the oldest go); read under the lock, so no
        file closes mid-read."""
        with self._lock:
            window = self._windows.get(file)
            if window is not None:
                at = offset - window[0]
                if 0 <= at and at + length <= len(window[1]):
                    return window[1][at:at + length]
            opened = self._fds.get(file)
            if opened is None:
                if len(self._fds) >= _OPEN_FILES:
                    for old, _ in self._fds.values():
                        os.close(old)
                    self._fds.clear()
                path = self.path(file)
                with safefs.open_file(path) as f:
                    # a remote source's stand-in holds only the ranges fetched so far: never
                    # read past the one asked for (a window would keep bytes not there yet)
                    opened = self._fds[file] = (os.dup(f.fileno()), not remote.is_standin(path))
            fd, windowed = opened
            size = self._window
            if windowed:  # a file read again within a few windows of others' is read in bigger ones
                self._reads += 1
                if self._reads - self._read_at.get(file, -_HOT_GAP) <= _HOT_GAP:
                    size = max(size, _HOT_WINDOW)
                self._read_at[file] = self._reads
            if length >= size or not windowed:
                return os.pread(fd, length, offset)
            data = os.pread(fd, size, offset)
            if file not in self._windows and len(self._windows) >= _WINDOWS_KEPT:
                del self._windows[next(iter(self._windows))]
            self._windows[file] = (offset, data)
            if size > self._window:  # (the hot files' last few kept in bigger windows, no more)
                hot = self._hot
                hot.pop(file, None)
                hot[file] = None
                if len(hot) > _HOT_KEPT:
                    old = next(iter(hot))
                    del hot[old]
                    if len(self._windows.get(old, (0, b""))[1]) > self._window:
                        del self._windows[old]
            return data[:length]

    def raw(self, loc: Location) -> memoryview:
        """The stored bytes of a ``raw`` location (a view of the mapped file)."""
        return self._bytes(loc)

    def raw_small(self, ranges: list[tuple[str, int, int]]) -> list[bytes]:
        """The stored bytes of ``raw`` ranges (``(file, offset, length)``) of a few bytes each, in
        order: read, each file opened once, not mapped (a mapped file's pages near every byte
        read count in the process's memory while it is mapped: the ``step`` of 291 tensors on
        256 ranks, read through maps, raised a reshard's peak by 200 MB). Ranges of a file within
        :data:`_SMALL_GAP` of each other are read together, up to :data:`_SMALL_RUN` bytes at a
        time (a rank file's ``step`` values lie between its moments: a read each was ~2 µs of
        74k); a remote source's stand-in only where they touch (it holds the ranges fetched)."""
        by_file: dict[str, list[int]] = {}
        for i, (file, offset, length) in enumerate(ranges):
            self._need_at(file, "raw", offset, length, ())
            by_file.setdefault(file, []).append(i)
        out: list[bytes] = [b""] * len(ranges)
        for file, indices in by_file.items():
            path = self.path(file)
            gap = 0 if remote.is_standin(path) else _SMALL_GAP
            indices.sort(key=lambda i: ranges[i][1])
            with safefs.open_file(path) as f:
                fd, size = f.fileno(), os.fstat(f.fileno()).st_size
                for i in indices:
                    safefs.check_span(ranges[i][1], ranges[i][2], size, what=str(path))
                k = 0
                while k < len(indices):  # a run of ranges read at once
                    _, start, length = ranges[indices[k]]
                    end, j = start + length, k + 1
                    while j < len(indices):
                        _, at, n = ranges[indices[j]]
                        if at - end > gap or at + n - start > _SMALL_RUN:
                            break
                        end, j = max(end, at + n), j + 1
                    data = os.pread(fd, end - start, start)
                    for i in indices[k:j]:
                        _, at, n = ranges[i]
                        out[i] = data[at - start:at - start + n]
                    k = j
        return out

    def _bytes(self, loc: Location) -> memoryview:
        self._need(loc)
        m = self._map(loc.file)
        safefs.check_span(loc.offset, loc.length, len(m), what=str(self.path(loc.file)))
        return memoryview(m)[loc.offset: loc.offset + loc.length]

    def _pickled(self, file: str) -> Any:
        with self._lock:
            return self._pickled_locked(file)

    def _pickled_locked(self, file: str) -> Any:
        obj = self._loaded.get(file)
        if obj is None:
            from ..security.safeload import load_torch

            obj = load_torch(self.path(file))
            self._loaded[file] = obj
            while self._cache_files is not None and len(self._loaded) > self._cache_files:
                self._loaded.popitem(last=False)
        else:
            self._loaded.move_to_end(file)
        return obj

    def _lookup(self, loc: Location) -> Any:
        self._need(loc)
        obj = self._pickled(loc.file)
        for k in loc.key:
            try:
                obj = obj[k]
            except (KeyError, IndexError, TypeError) as e:
                raise BadInput(f"{self.path(loc.file)}: no entry {loc.key!r}; the file changed since it was described") from e
        return obj

    # -- public ---------------------------------------------------------------------------
    def chunk(self, tensor: TensorInfo, chunk: Chunk) -> torch.Tensor:
        """The stored values of ``chunk`` as a tensor of its sizes (may view a mapped file:
        copy it before the reader closes)."""
        import torch

        loc = chunk.location
        if loc.kind == "raw":
            data = self._bytes(loc)
            if not chunk.numel:
                return torch.empty(chunk.sizes, dtype=as_torch(tensor.dtype))
            return torch.frombuffer(data, dtype=as_torch(tensor.dtype)).view(chunk.sizes)
        if loc.kind == "torch_item":
            value = self._torch_item(loc, tensor.name)
        elif loc.kind == "pickled":
            value = self._lookup(loc)
        else:
            raise BadInput(f"{loc.file}: cannot read a {loc.kind!r} item as a tensor")
        value = _local(value)
        if not isinstance(value, torch.Tensor):
            raise BadInput(f"{self.path(loc.file)}: {tensor.name!r} is a {type(value).__name__}, not a tensor")
        if tuple(value.shape) != tuple(chunk.sizes) or value.dtype != tensor.dtype:
            raise BadInput(f"{self.path(loc.file)}: {tensor.name!r} holds {tuple(value.shape)} "
                           f"{value.dtype}, its metadata says {chunk.sizes} {tensor.dtype}")
        return value

    def span(self, tensor: TensorInfo, chunk: Chunk, *, pickled: bool = False) -> tuple[Path, int, int] | None:
        """``(file, offset, length)`` when the chunk's values are exactly one contiguous,
        row-major byte range of a file (safetensors, simple DCP items; with ``pickled``, a plain
        tensor of a ``torch.save`` file too); else None."""
        # (the chunk's own fields, no Location built: asked once per copy of a many-rank plan)
        file, kind, offset, length = chunk.file, chunk.kind, chunk.byte_offset, chunk.length
        path = self._paths.get(file)
        if path is None:
            path = self.path(file)
        self._need_at(file, kind, offset, length, chunk.key)
        nbytes = chunk.numel * tensor.dtype.itemsize
        if kind == "raw":  # (asked per piece of a many-rank plan: the usual case first)
            return (path, offset, length) if length == nbytes else None
        if kind == "pickled" and pickled:
            with self._lock:
                if self._torch is None:
                    self._torch = TorchRanges(self.ckpt.base_dir())
            found = self._torch.local(file, chunk.key)
            if found is not None and found[1].size == tuple(chunk.sizes) and found[1].dtype == tensor.dtype:
                return path, found[0], nbytes
            return None
        if kind == "torch_item":
            if length <= _READ_ITEMS:
                # read, not mapped: a mapped file's pages near every byte parsed count in the
                # process's memory while it is mapped (a 256-rank DCP's small items, parsed
                # item by item, added the whole source, 196 MB, to a reshard's peak)
                blob = self._pread(file, offset, length)
                local, start, size = _item(blob, 0, len(blob))
                start = None if start is None else offset + start
            else:
                local, start, size = _item(self._map(file), offset, length)
            if (start is not None and local is not None and local.size == tuple(chunk.sizes)
                    and local.dtype == tensor.dtype and local.offset * local.dtype.itemsize + nbytes <= size):
                return path, start + local.offset * local.dtype.itemsize, nbytes
        return None

    def _torch_item(self, loc: Location, name: str) -> torch.Tensor:
        """A ``torch.save``'d tensor inside a larger file (a DCP item), as a view of the mapped
        file: the pickle is read for shape, stride and offset (on the meta device, no data),
        the zip record for where the raw bytes start. Anything unusual is loaded normally."""
        import torch

        from ..security.safeload import load_torch_bytes, load_torch_meta

        where = f"{self.path(loc.file)} ({name})"
        self._need(loc)
        m = self._map(loc.file)
        safefs.check_span(loc.offset, loc.length, len(m), what=where)
        meta = load_torch_meta(_MapSlice(m, loc.offset, loc.length), where=where)
        start, size = _storage_record(m, loc.offset, loc.length)
        if not isinstance(meta, torch.Tensor) or start is None:
            return load_torch_bytes(self._bytes(loc), where=where)
        if not meta.numel():
            return torch.empty(meta.shape, dtype=meta.dtype)
        storage = torch.frombuffer(m, dtype=torch.uint8, count=size, offset=start).untyped_storage()
        try:
            return torch.empty(0, dtype=meta.dtype).set_(storage, meta.storage_offset(), meta.shape, meta.stride())
        except RuntimeError as e:
            raise BadInput(f"{where}: the item's tensor does not fit its {size} stored bytes ({e})") from e

    def object(self, obj: ObjectInfo) -> Any:
        from ..security.safeload import load_torch_bytes

        loc = obj.location
        if loc.kind == "bytes_item":
            return load_torch_bytes(self._bytes(loc), where=f"{self.path(loc.file)} ({obj.name})")
        if loc.kind == "pickled":
            return _local(self._lookup(loc))
        if loc.kind == "value":  # a plain value the description carries (a literal, never code)
            return ast.literal_eval(loc.key[0])
        raise BadInput(f"{loc.file}: cannot read a {loc.kind!r} item as an object")

    def scalar(self, tensor: TensorInfo) -> int | float | bool | None:
        """The value of a one-element tensor (an optimizer's ``step``) read from its stored bytes,
        without torch: a raw byte range, or a plain tensor record of a ``torch.save`` blob (a
        DCP item). None when it is stored any other way (the caller may use :meth:`full`)."""
        # the chunk that holds the value (a (1,)-shaped tensor split over ranks leaves the others empty)
        chunk = next((c for c in tensor.chunks if c.numel == 1), None) if tensor.numel == 1 else None
        if chunk is None:
            return None
        found = self.span(tensor, chunk)
        if found is None:
            return None
        _, offset, length = found
        m = self._map(chunk.location.file)
        safefs.check_span(offset, length, len(m), what=f"{self.path(chunk.location.file)} ({tensor.name})")
        return scalar_from_bytes(m[offset:offset + length], tensor.dtype)

    def rows(self, tensor: TensorInfo, r0: int, r1: int, *, at: tuple[int, ...] = ()) -> torch.Tensor:
        """Rows ``[r0, r1)`` of a logical tensor (whole along its other dimensions), assembled
        from the parts of the chunks that hold them. ``at``: indexes of the leading dimensions
        (an expert's), the rows then those of the next dimension, within them: shape
        ``[r1 - r0, *shape[len(at) + 1:]]``."""
        import torch

        k = len(at)
        out = torch.empty(r1 - r0, *tensor.shape[k + 1:], dtype=as_torch(tensor.dtype))
        for c in tensor.chunks:
            if any(not c.offsets[d] <= at[d] < c.offsets[d] + c.sizes[d] for d in range(k)):
                continue
            lo, hi = max(r0, c.offsets[k]), min(r1, c.offsets[k] + c.sizes[k])
            if lo >= hi:
                continue
            region = out.narrow(0, lo - r0, hi - lo)
            for d in range(k + 1, len(tensor.shape)):
                region = region.narrow(d - k, c.offsets[d], c.sizes[d])
            src = self.chunk(tensor, c)
            for d in range(k):
                src = src.select(0, at[d] - c.offsets[d])
            region.copy_(src.narrow(0, lo - c.offsets[k], hi - lo))
        return out

    def full(self, tensor: TensorInfo) -> torch.Tensor:
        """Assemble a whole logical tensor (for small tensors and tests)."""
        import torch

        if tensor.shape:
            return self.rows(tensor, 0, tensor.shape[0])
        out = torch.empty((), dtype=as_torch(tensor.dtype))
        for c in tensor.chunks:  # a scalar: its one chunk
            out.copy_(self.chunk(tensor, c))
        return out


class _MapSlice(io.RawIOBase):
    """A read-only file over ``[start, start + length)`` of a mapped file (no copy)."""

    def __init__(self, m: mmap.mmap, start: int, length: int):
        self._view = memoryview(m)[start:start + length]
        self._pos = 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self._pos

    def seek(self, offset: int, whence: int = 0) -> int:
        base = (0, self._pos, len(self._view))[whence]
        self._pos = max(0, base + offset)
        return self._pos

    def readinto(self, b) -> int:
        n = max(0, min(len(b), len(self._view) - self._pos))
        b[:n] = self._view[self._pos:self._pos + n]
        self._pos += n
        return n


# DCP items up to this size are read to be parsed, larger ones mapped (their data is not touched)
_READ_ITEMS = 256 << 10
# a file whose last window was read at most _HOT_GAP windows (of any file) ago is read in
# windows of _HOT_WINDOW: a reshard reads a few files at a time, item after item (at 256 ranks
# and 8 KiB windows, 96k reads of 232k items: a tenth of its CPU), where an export reads an item
# of every file in turn; the last _HOT_KEPT files' such windows are kept
_HOT_GAP, _HOT_WINDOW, _HOT_KEPT = 8, 64 << 10, 8
# small raw ranges this close are read at once, up to so many bytes (Reader.raw_small)
_SMALL_GAP, _SMALL_RUN = 64 << 10, 1 << 20

_OPEN_FILES = diskio.open_files_cap()  # files a reader keeps open for reading items
# small items are read in windows of at most this size, the last of each of up to so many files
# kept, all of them within about _WINDOWS_BYTES (see _window_for)
_WINDOW, _WINDOWS_KEPT = 64 << 10, 256
_WINDOWS_BYTES, _MIN_WINDOW = 2 << 20, 4 << 10
_ITEM_TENSORS: dict[bytes, Any] = {}  # an item blob's pickle -> the tensor it holds (a few shapes a job)
# a blob length -> the fixed part of the last item of that length read (zipdir.fixed_part), its
# tensor, and its data record's offset and size
_ITEM_LAYOUTS: dict[int, tuple[tuple[Any, tuple], Any, int, int]] = {}


def _window_for(files: int) -> int:
    """The window a reader of a checkpoint of ``files`` files reads small items by: the windows
    of all its files within :data:`_WINDOWS_BYTES`, none over :data:`_WINDOW` nor (many-file
    sources aside) under :data:`_MIN_WINDOW`. A many-rank job visits every source file and
    each one's window stays: at 64 KiB each, a 256-rank reshard held ~8 MB of them and an
    export ~14 MB, where at 8 KiB the same reads hold 2 MB (at 16 ranks, 64 KiB as before)."""
    return min(_WINDOW, max(_MIN_WINDOW, _WINDOWS_BYTES // max(files, 1)))


def _item(m: mmap.mmap | bytes, start: int, length: int) -> tuple[Any, int | None, int]:
    """The plain tensor a DCP item blob holds (None if anything else) and the absolute offset
    and size of its one storage record (``(None, 0)`` if not that simple). One tensor's items
    on every rank pickle the same bytes, so each distinct pickle is parsed once."""
    whole = type(m) is bytes and start == 0 and len(m) == length  # (an item read: compared as bytes, faster)
    view = memoryview(m)[start:start + length]
    known = _ITEM_LAYOUTS.get(length)
    if known is not None and matches(m if whole else view, known[0]):
        return known[1], start + known[2], known[3]  # (an item of the last read of its length, its data aside)
    records = blob_records(view)
    pickles = [n for n in records or () if n.endswith("/data.pkl")]
    data = [n for n in records or () if "/data/" in n and not n.endswith("/data.pkl")]
    if len(pickles) != 1 or len(data) != 1:
        return _item_tensor(m, start, length), *_storage_record(m, start, length)
    at, size, crc = records[pickles[0]]
    pickled = bytes(view[at:at + size])
    if zlib.crc32(pickled) != crc:
        return None, None, 0  # damaged: the torch path says so
    if pickled not in _ITEM_TENSORS:
        try:
            local = local_of(loads(pickled, where="a DCP item"))
        except (NotSimple, BadInput):
            local = None
        if len(_ITEM_TENSORS) >= 4096:
            _ITEM_TENSORS.clear()
        _ITEM_TENSORS[pickled] = local
    at, size, _ = records[data[0]]
    local = _ITEM_TENSORS[pickled]
    if local is not None:
        # another item of this tensor's (its rows on another rank; the next tensor of its shape)
        # is this blob but for its data and serialization id: one masked compare instead of
        # reading its zip, copying its pickle and checking its CRC (a 256-rank DCP has 74k items)
        sid = [n for n in records if n.endswith("/.data/serialization_id")]
        fixed = fixed_part(view, (data[0], *sid))
        if fixed is not None:
            if len(_ITEM_LAYOUTS) >= 1024:
                _ITEM_LAYOUTS.clear()
            _ITEM_LAYOUTS[length] = (fixed, local, at, size)
    return local, start + at, size


def _item_tensor(m: mmap.mmap, start: int, length: int):
    """The plain contiguous tensor a ``torch.save`` blob holds, read from its pickle without
    torch (:mod:`ckpt_tools.security.torchfile`: allowlisted globals only, nothing runs); None when it
    holds anything else."""

    try:
        return local_of(loads_blob(_MapSlice(m, start, length)))
    except (NotSimple, BadInput):  # the torch path reads it, or refuses it with its reasons
        return None


def _storage_record(m: mmap.mmap, start: int, length: int) -> tuple[int | None, int]:
    """Absolute offset and size of the single uncompressed ``*/data/0`` record of a
    ``torch.save`` blob at ``[start, start + length)``; ``(None, 0)`` if it is not that simple."""
    try:
        with zipfile.ZipFile(_MapSlice(m, start, length)) as z:
            records = [i for i in z.infolist() if "/data/" in i.filename and not i.filename.endswith("/data.pkl")]
            if len(records) != 1 or records[0].compress_type != zipfile.ZIP_STORED:
                return None, 0
            info = records[0]
    except (zipfile.BadZipFile, ValueError, OSError):
        return None, 0
    header = start + info.header_offset
    if m[header:header + 4] != b"PK\x03\x04":
        return None, 0
    name_len, extra_len = struct.unpack("<HH", m[header + 26:header + 30])
    data = header + 30 + name_len + extra_len
    if data + info.file_size > start + length:
        return None, 0
    return data, info.file_size


def _local(value: Any) -> Any:
    """A DTensor or ShardedTensor's local data; anything else as it is."""
    from ..security.fsdp1 import is_sharded_tensor

    if type(value).__name__ == "DTensor":
        return value._local_tensor
    if is_sharded_tensor(value):
        shards = value.local_shards()
        return shards[0].tensor if shards else value
    return value
