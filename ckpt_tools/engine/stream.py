"""Reading a plan's pieces and handing them to a writer: for each destination piece, only the
source regions the plan names are read and assembled (a piece that is exactly one stored chunk
is passed through as a view of the mapped file; one whose bytes lie whole in source files is
passed as a :class:`~ckpt_tools.core.plan.Span` for the kernel to copy), cast when asked. A
background thread prepares the next pieces while the writer writes, within a fixed byte budget,
so memory stays near the largest piece plus that budget whatever the model's size.
"""

from __future__ import annotations

import concurrent.futures
import functools
import math
import sys
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from contextlib import AbstractContextManager, nullcontext
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from ..core.describe import Checkpoint, ObjectInfo
from ..core.dtypes import as_torch
from ..core.plan import FileJob, Piece, Span, copies_of
from ..errors import BadInput
from ..storage import manifest
from ..storage.castio import CastSpan
from . import computed
from .fetch import Ahead
from .reader import Reader

if TYPE_CHECKING:
    import torch
    from tqdm import tqdm


PREFETCH_BYTES = 256 * 1024 * 1024
BATCH_BYTES = 1 << 20  # pieces smaller than this share a hand-off to the reading thread
BATCH_PIECES = 256


class Writer(Protocol):
    """A format's writer: plans files from targets, writes one file, then the files that
    describe the others (index, metadata), last."""

    single_file: bool
    # (optional) ``finish_reads_pieces``: ``finish`` reads the jobs' pieces, so an engine the
    # plan is handed to keeps them to the end

    def write(self, path: Path, job: FileJob, pieces: Iterator[tuple[Piece, torch.Tensor]],
              objects: Callable[[ObjectInfo], Any]) -> Any:
        """Write one file; may return facts that ``finish`` needs (picklable)."""

    def finish(self, out: Path, jobs: Sequence[FileJob], written: dict[str, Any]) -> None: ...


def narrow(t: torch.Tensor, start: Sequence[int], sizes: Sequence[int]) -> torch.Tensor:
    for d, (o, s) in enumerate(zip(start, sizes)):
        if o != 0 or s != t.shape[d]:
            t = t.narrow(d, o, s)
    return t


def spans_of(reader: Reader, piece: Piece, *, casts: bool = False) -> Span | CastSpan | None:
    """The byte ranges that make ``piece``, when every copy takes whole rows of a chunk stored
    contiguously (Shard(0) pieces of safetensors and DCP items). A piece to cast is a
    :class:`~ckpt_tools.storage.castio.CastSpan` (converted block by block as it is written) with
    ``casts``, else None. (Asked once per piece: a many-rank reshard's 220k pieces.)"""
    target = piece.target
    source = target.source
    src_dtype = source.dtype
    cast = target.dtype is not src_dtype and target.dtype != src_dtype
    if piece.add is not None or target.computed is not None or (cast and not casts):
        return None
    itemsize = src_dtype.itemsize
    tail = piece.sizes[1:]
    row = math.prod(tail) * itemsize
    copies = copies_of(piece)  # (once: a plan's TILED copies are worked out when read)
    if len(copies) > 2 or len(copies) == 2 and copies[1].dst_start < copies[0].dst_start:
        copies = sorted(copies, key=_dst_start)
    found: dict[int, tuple | None] = {}  # a row-permuted piece copies from each chunk many times
    out, total = [], 0
    for c in copies:
        chunk, sizes = c.chunk, c.sizes
        if sizes[1:] != tail or chunk.sizes[1:] != tail:
            return None
        span = found.get(id(chunk), found)  # (by identity: hashing a chunk hashes its location)
        if span is found:
            span = found[id(chunk)] = reader.span(source, chunk)
        if span is None:
            return None
        n = sizes[0] * row if sizes else row
        out.append((span[0], span[1] + c.src_start[0] * row if sizes else span[1], n))
        total += n
    if total != math.prod(piece.sizes) * itemsize:
        return None
    parts = tuple(out)
    return CastSpan(parts, src_dtype, target.dtype) if cast else Span(parts)


def _dst_start(c: Any) -> tuple[int, ...]:
    return c.dst_start


def materialize(reader: Reader, piece: Piece, *, spans: bool = False,
                casts: bool = False) -> torch.Tensor | Span | CastSpan:
    """The values of ``piece`` in its target dtype (or, with ``spans``, where its bytes lie
    when they can be copied straight from the source files; with ``casts`` too, where they lie
    when they are to be cast block by block as they are written)."""
    target = piece.target
    if target.computed is not None:
        return computed.values(reader, piece, spans=spans and casts)
    if piece.add is not None:
        return _plus_low_rank(reader, piece)
    if spans:
        found = spans_of(reader, piece, casts=casts)
        if found is not None:
            return found
    copies = copies_of(piece)
    if len(copies) == 1:
        c = copies[0]
        if c.sizes == c.chunk.sizes == piece.sizes:
            src = reader.chunk(target.source, c.chunk)
            return src if src.dtype == target.dtype else src.to(as_torch(target.dtype))
    import torch

    out = torch.empty(piece.sizes, dtype=as_torch(target.dtype))
    for c in copies:
        src = reader.chunk(target.source, c.chunk)
        narrow(out, c.dst_start, c.sizes).copy_(narrow(src, c.src_start, c.sizes))
    return out


def _plus_low_rank(reader: Reader, piece: Piece) -> torch.Tensor:
    """``W + scale * (B @ A)`` (its transpose for an embedding) computed in fp32 (as PEFT merges
    on CPU), then cast."""
    from dataclasses import replace

    base = materialize(reader, replace(piece, add=None, target=replace(piece.target, dtype=piece.target.source.dtype)))
    lr = piece.add
    delta = reader.full(lr.b).float() @ reader.full(lr.a).float()
    if lr.transposed:
        delta = delta.T
    if tuple(delta.shape) != tuple(piece.sizes):
        raise BadInput(f"tensor {piece.target.source.name!r}: its LoRA update {lr.b.name!r} @ {lr.a.name!r} is "
                       f"{list(delta.shape)}, the weight is {list(piece.sizes)}")
    out = base.float() + delta * lr.scale
    return out.to(as_torch(piece.target.dtype))


def stream(reader: Reader, pieces: Sequence[Piece], bar: tqdm | _NoBar | None = None,
           budget: int = PREFETCH_BYTES, spans: bool = False, casts: bool = False,
           ready: Callable[[int], None] | None = None,
           pool: concurrent.futures.ThreadPoolExecutor | None = None,
           ) -> Iterator[tuple[Piece, torch.Tensor | Span | CastSpan]]:
    """Yield ``(piece, values)`` in order, preparing the next ones in a background thread
    (which first calls ``ready(n)`` for piece ``n``: its source bytes are then present). Small
    pieces go to the thread in batches (up to :data:`BATCH_BYTES` or :data:`BATCH_PIECES`): a
    many-rank job's pieces are mostly a few KiB, and a hand-off each cost more than the piece.
    ``pool``: a one-thread pool to prepare them in, shared by a job's files (a thread started
    per file cost ~0.1 s over a 256-rank reshard's 768); else one of its own. Either way, what
    it handed the thread is done or cancelled when the stream ends."""
    if type(bar) is _NoBar:
        bar = None  # (nothing to do per piece)
    if pool is None:
        with concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="ckpt-read") as own:
            yield from stream(reader, pieces, bar, budget, spans, casts, ready, own)
        return

    def prepare(batch: list[tuple[int, Piece]]) -> list[torch.Tensor | Span | CastSpan]:
        out = []
        for n, p in batch:
            if ready is not None:
                ready(n)
            out.append(materialize(reader, p, spans=spans, casts=casts))
        return out

    def spanned(batch: list[tuple[int, Piece]]) -> list[Span | CastSpan] | None:
        """The batch's spans, or None where a piece is more than byte ranges to copy."""
        out = []
        for _, p in batch:
            v = spans_of(reader, p, casts=casts)
            if v is None:
                return None
            out.append(v)
        return out

    pending: deque = deque()
    it = iter(enumerate(pieces))
    inflight = 0
    # a piece whose bytes are copied as they lie is a few lookups to prepare: done here, batch
    # by batch as the writer asks (handed to the thread, a many-rank job's 220k small pieces
    # waited on its turn for the GIL), until a piece is more (a read, a cast): then the thread
    inline = spans and ready is None

    def fill() -> None:
        nonlocal inflight
        while not pending or inflight < budget:
            batch, size = [], 0
            while size < BATCH_BYTES and len(batch) < BATCH_PIECES:
                n, p = next(it, (0, None))
                if p is None:
                    break
                batch.append((n, p))
                size += p.nbytes
            if not batch:
                return
            if inline:
                pending.append((batch, 0, None))
                return
            pending.append((batch, size, pool.submit(prepare, batch)))
            inflight += size

    try:
        fill()
        while pending:
            batch, size, fut = pending.popleft()
            if fut is None:
                values = spanned(batch)
                if values is None:
                    inline = False
                    values = prepare(batch)
            else:
                values = fut.result()
            inflight -= size
            fill()
            for (_, p), v in zip(batch, values):
                yield p, v
                if bar is not None:
                    bar.update(p.nbytes)
    finally:  # (ended early: nothing of this stream's left running in a shared thread)
        handed = [fut for _, _, fut in pending if fut is not None]
        for fut in handed:
            fut.cancel()
        concurrent.futures.wait(handed)


class _NoBar:
    """What a disabled bar does (nothing), without importing tqdm (~70 ms of a quiet run)."""

    def update(self, n: int = 1) -> None:
        pass

    def __enter__(self) -> _NoBar:
        return self

    def __exit__(self, *exc: Any) -> None:
        pass


def on_terminal() -> bool:
    """Whether stderr is a terminal: bars are drawn only there (in a pipe or a log file their
    ``\\r`` frames and cursor moves are noise); ``note:``, ``warning:`` and ``wrote`` lines are not bars."""
    try:
        return sys.stderr.isatty()
    except (AttributeError, ValueError):
        return False


def progress_bar(total: int, desc: str, enabled: bool) -> tqdm | _NoBar:
    if not enabled or not on_terminal():
        return _NoBar()
    from tqdm import tqdm

    return tqdm(total=total, desc=desc, unit="B", unit_scale=True, unit_divisor=1024,
                file=sys.stderr, dynamic_ncols=True, leave=False)


def run_jobs(src: Checkpoint, writer: Writer, jobs: Sequence[FileJob], out: Path, *,
             progress: bool, desc: str, sealed: dict[Path, tuple[int, str]] | None = None,
             upload: Callable[[Path, str, int], AbstractContextManager] | None = None,
             consume: bool = False) -> dict[str, Any]:
    """Write ``jobs`` under ``out`` (a staging directory, or the staging file itself);
    ``consume``: each job's pieces let go once its file is written (:meth:`FileJob.release`).

    With ``sealed``, each file is hashed and fsynced in the background as soon as it is
    written, and its (size, digest) recorded there for the manifest. With ``upload`` (a
    remote DST: :func:`ckpt_tools.storage.streamup.follower`), each file is written inside
    ``upload(path, name, expected size)``, which sends its parts as they are written."""
    total = sum(j.nbytes for j in jobs)
    written = {}
    # a remote source's ranges are fetched a few files ahead of the writer (nothing for a local one)
    with Ahead(src, jobs) as ahead, Reader(src, planned=ahead.active) as reader, \
            progress_bar(total, desc, progress) as bar, manifest.Sealer() as sealer, \
            concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="ckpt-read") as pool:
        for i, job in enumerate(jobs):
            ahead.wait(i)  # its objects and first pieces
            path = out if writer.single_file else out / job.path
            path.parent.mkdir(parents=True, exist_ok=True)
            pieces = stream(reader, job.pieces, bar, spans=getattr(writer, "accepts_spans", False),
                            casts=getattr(writer, "accepts_casts", False),
                            ready=functools.partial(ahead.wait, i) if ahead.active else None, pool=pool)
            with upload(path, "" if writer.single_file else job.path, job.nbytes) if upload else nullcontext():
                written[job.path] = writer.write(path, job, pieces, reader.object)
            ahead.done(i)  # the stand-in's disk stays near what is fetched ahead of the writer
            if consume:
                job.release()
            if sealed is not None:
                # a writer that hashed its file as it wrote it returns the digest
                known = written[job.path] if isinstance(written[job.path], manifest.Digest) else None
                sealer.seal(path, known)
    if sealed is not None:
        sealed.update(sealer.digests)
    return written
