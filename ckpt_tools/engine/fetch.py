"""The bytes a plan reads, made present before the engine reads them.

A remote source is read through a sparse local stand-in (:class:`~ckpt_tools.storage.remote.Mirror`,
registered while its command runs) that holds, after it was described, its headers and metadata
only. Before the engine writes a file, :class:`Ahead` asks the storage layer
(:func:`~ckpt_tools.storage.remote.present`) for exactly the byte ranges that file's pieces read,
a few files ahead of the writer in a background thread; for a local source every call here is a
no-op. What one copy of a plan reads, by where its chunk is stored:

- ``raw`` (safetensors, a DCP's raw items): the rows the copy takes, not the whole chunk;
- ``torch_item`` (a DCP item, a ``torch.save`` blob inside a ``.distcp``): the blob's head and
  tail (its pickle and zip records) first, then the rows of its storage the copy takes; the
  whole item where its layout is unusual (the reader then loads the blob whole);
- ``pickled`` (a value of a ``torch.save`` file: torch files, per-rank files): the file's pickle
  and zip records (fetched when it was described) and the whole storage records reachable from
  the value (torch's unpickler maps a storage whole); the whole file when its pickle cannot be
  walked here;
- ``bytes_item``: the item. Saved objects read the same way; a LoRA update reads its factors whole.

Files of the source that no chunk or object names (side files, configs, tokenizers) are
fetched whole (:func:`side_files`): layouts copy them byte for byte.
"""

from __future__ import annotations

import concurrent.futures
import math
import threading
from collections import deque
from collections.abc import Iterable, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

from ..core.describe import Checkpoint, Chunk, Location, TensorInfo
from ..core.plan import Copy, FileJob, copies_of
from ..errors import BadInput
from ..storage import remote
from .reader import Reader
from .torchranges import TorchRanges

HEAD = 16 << 10  # of a torch.save blob: its pickle and the data record's local header lie here
TAIL = 16 << 10  # its central directory and end records
AHEAD_BYTES = 512 << 20  # output bytes whose source ranges may be fetched ahead of the writer
Range = tuple[Path, int, int]


def is_remote(src: Checkpoint) -> bool:
    """Whether ``src`` is read through a registered stand-in (its bytes fetched on demand)."""
    return bool(remote.standin_files(src.base_dir()))


def side_files(src: Checkpoint) -> None:
    """Fetch whole every file of a remote ``src`` that no chunk or object names."""
    files = remote.standin_files(src.base_dir())
    if not files:
        return
    named = {src.base_dir() / c.file for t in src.tensors for c in t.chunks}
    named |= {src.base_dir() / o.location.file for o in src.objects}
    remote.present_whole(p for p in files if p not in named)


class Planner:
    """The byte ranges each job reads (:meth:`ranges`), and making them present (:meth:`fetch`)."""

    def __init__(self, src: Checkpoint) -> None:
        self.src = src
        self.base = src.base_dir()
        self.reader = Reader(src, planned=True)
        self._torch = TorchRanges(self.base)
        self._held: dict[int, list[Range]] = {}  # what each job not yet written reads
        self._lock = threading.Lock()

    def close(self) -> None:
        self.reader.close()

    def fetch(self, i: int, job: FileJob) -> int:
        """Make what job ``i`` reads present (held until :meth:`release`); the bytes moved."""
        moved = remote.present(self._item_heads(job))  # a blob's layout says where its rows are
        rows, releasable = self.ranges(job, releasable=True)
        with self._lock:  # recorded before it is fetched: a release meanwhile keeps it
            self._held.setdefault(i, []).extend(releasable)
        return moved + remote.present(rows)

    def release(self, i: int) -> int:
        """Job ``i`` is written: give back the disk of its tensor bytes that no job fetched or
        being fetched reads (a later job that needs them fetches them again)."""
        with self._lock:
            mine = self._held.pop(i, [])
            others = [r for rs in self._held.values() for r in rs]
            return remote.release(_subtract(mine, others))

    def _copies(self, job: FileJob) -> Iterable[tuple[TensorInfo, Chunk, Copy | None]]:
        for p in job.pieces:
            for c in copies_of(p):
                yield p.target.source, c.chunk, c
            if p.add is not None:
                for t in (p.add.a, p.add.b):
                    for ch in t.chunks:
                        yield t, ch, None

    def _item_heads(self, job: FileJob) -> list[Range]:
        out = []
        for _, chunk, _ in self._copies(job):
            loc = chunk.location
            if loc.kind == "torch_item":
                path = self.base / loc.file
                out.append((path, loc.offset, loc.offset + min(loc.length, HEAD)))
                out.append((path, loc.offset + max(0, loc.length - TAIL), loc.offset + loc.length))
        return out

    def ranges(self, job: FileJob, *, releasable: bool = False) -> Any:
        """The byte ranges ``job`` reads (those of a ``torch_item`` need its head present);
        with ``releasable``, also those of them that hold tensor values only (rows, storage
        records: no reader needs them once the job is written), as a pair."""
        out: list[Range] = []
        values: list[Range] = []
        for tensor, chunk, copy in self._copies(job):
            got, is_values = self._chunk(tensor, chunk, copy)
            out += got
            if is_values:
                values += got
        for obj in job.objects:
            out += self._location(obj.location)[0]
        return (out, values) if releasable else out

    def _chunk(self, tensor: TensorInfo, chunk: Chunk, copy: Copy | None) -> tuple[list[Range], bool]:
        loc = chunk.location
        if loc.kind not in ("raw", "torch_item"):
            return self._location(loc)
        try:
            span = self.reader.span(tensor, chunk)
        except BadInput:
            span = None
        if span is None:
            return self._location(loc)
        path, start, length = span
        if copy is None or not chunk.sizes or not chunk.numel:
            return [(path, start, start + length)], True
        row = math.prod(chunk.sizes[1:]) * tensor.dtype.itemsize
        first = start + copy.src_start[0] * row
        return [(path, first, first + copy.sizes[0] * row)], True

    def _location(self, loc: Location) -> tuple[list[Range], bool]:
        """The ranges of a whole location, and whether they hold tensor values only."""
        path = self.base / loc.file
        if loc.kind in ("raw", "torch_item", "bytes_item"):
            return [(path, loc.offset, loc.offset + loc.length)], loc.kind == "raw"
        if loc.kind == "pickled":
            return self._torch.of(loc.file, loc.key)
        return [], False  # a value the description carries


def _subtract(ranges: list[Range], others: list[Range]) -> list[Range]:
    """The parts of ``ranges`` that no range of ``others`` covers."""
    by_path: dict[Path, list[tuple[int, int]]] = {}
    for p, s, e in others:
        by_path.setdefault(p, []).append((s, e))
    for v in by_path.values():
        v.sort()
    out = []
    for p, s, e in ranges:
        at = s
        for a, b in by_path.get(p, ()):
            if b <= at:
                continue
            if a >= e:
                break
            if a > at:
                out.append((p, at, a))
            at = max(at, b)
        if at < e:
            out.append((p, at, e))
    return out


class Ahead:
    """Fetch what ``jobs`` read in order, in a background thread, in slices of a job's pieces
    (at most ``SLICE_BYTES`` of output each; a job's objects with its first), at most
    ``AHEAD_BYTES`` of output ahead of the writer: :meth:`wait` before a piece is read, so a big
    output file is written while its later slices arrive; :meth:`done` once a job is written.
    Nothing runs for a local source."""

    def __init__(self, src: Checkpoint, jobs: Sequence[FileJob]) -> None:
        self.active = is_remote(src)
        self.jobs = jobs
        self.moved = 0
        self.released = 0
        if not self.active:
            return
        self._planner = Planner(src)
        self._pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="ckpt-fetch")
        self._units = [u for i, job in enumerate(jobs) for u in _slices(i, job)]
        self._pending: deque = deque()  # (job, last piece index, output bytes, future), in order
        self._next = 0
        self._ahead = 0
        self._upto = (-1, 0)  # (job, last piece) of the last slice present
        self._lock = threading.Lock()  # the writer and the engine's read thread both wait
        self._fill()

    def _fill(self) -> None:
        while self._next < len(self._units) and (not self._pending or self._ahead < AHEAD_BYTES):
            i, last, part = self._units[self._next]
            self._pending.append((i, last, part.nbytes, self._pool.submit(self._planner.fetch, i, part)))
            self._ahead += part.nbytes
            self._next += 1

    def wait(self, i: int, piece: int = 0) -> None:
        """Return once piece ``piece`` of job ``i`` (and the job's objects) are present (the
        fetch's error raised here)."""
        if not self.active:
            return
        with self._lock:
            # the slices up to the one that holds the piece (none when that one is present
            # already: waiting for the next would keep the writer a slice behind the fetch)
            while self._pending and (i, piece) > self._upto:
                j, last, nbytes, fut = self._pending.popleft()
                self.moved += fut.result()
                self._ahead -= nbytes
                self._upto = (j, last)
                self._fill()

    def done(self, i: int) -> None:
        """Job ``i`` is written: the stand-in's disk of what only it read is given back."""
        if self.active:
            self.wait(i, len(self.jobs[i].pieces))
            self.released += self._planner.release(i)

    def all(self) -> None:
        """Make every job's bytes present now (for processes that have no stand-in of their own)."""
        if self.active:
            self.wait(len(self.jobs), 0)

    def close(self) -> None:
        if self.active:
            for *_, fut in self._pending:
                fut.cancel()
            self._pool.shutdown(wait=True)
            self._planner.close()

    def __enter__(self) -> Ahead:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


SLICE_BYTES = 64 << 20  # output bytes of one fetch unit: a big file's first pieces are written while the rest arrive


def _slices(i: int, job: FileJob) -> list[tuple[int, int, FileJob]]:
    """Job ``i`` as units ``(i, index of its last piece, a job of those pieces)``; the first
    holds the job's objects, the last ends past the last piece (so a job without pieces has one)."""
    out, start, size = [], 0, 0
    pieces = job.pieces
    for n, p in enumerate(pieces):
        size += p.nbytes
        if size >= SLICE_BYTES:
            out.append((i, n, replace(job, pieces=pieces[start:n + 1], objects=job.objects if not out else ())))
            start, size = n + 1, 0
    out.append((i, len(pieces), replace(job, pieces=pieces[start:], objects=job.objects if not out else ())))
    return out
