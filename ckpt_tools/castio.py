"""Casts (``--dtype``) streamed in bounded blocks.

A piece whose bytes are byte ranges of source files in another dtype (:class:`CastSpan`) is
converted a block of elements at a time: each block is read from the mapped page cache, cast by
torch's conversion kernel (which uses the intra-op threads) and handed to the writer, while a
small pool already converts the next blocks. Memory stays near ``BLOCK_ELEMENTS`` times the
element sizes times the blocks in flight, whatever the tensor's size; nothing is materialised
whole.
"""

from __future__ import annotations

import concurrent.futures
import mmap
import os
from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from .dtypes import DType, as_torch

BLOCK_ELEMENTS = 4 << 20  # 8-16 MiB of source per block
AHEAD = 3  # blocks converted ahead of the writer


@dataclass(frozen=True)
class CastSpan:
    """A piece whose values are, in order, byte ranges ``(file, offset, length)`` of source
    files holding ``src`` elements, to be written as ``dst``."""

    parts: tuple[tuple[Path, int, int], ...]
    src: DType
    dst: DType

    @property
    def numel(self) -> int:
        return sum(n for _, _, n in self.parts) // self.src.itemsize

    @property
    def nbytes(self) -> int:
        return self.numel * self.dst.itemsize


def _ranges(cast: CastSpan, block: int) -> list[tuple[Path, int, int]]:
    """The source ranges of each block: at most ``block`` elements, never across a part."""
    out = []
    step = block * cast.src.itemsize
    for path, offset, length in cast.parts:
        for start in range(offset, offset + length, step):
            out.append((path, start, min(step, offset + length - start)))
    return out


def _convert(path: Path, offset: int, length: int, src: DType, dst: DType) -> memoryview:
    import torch

    base = offset - offset % mmap.ALLOCATIONGRANULARITY
    with open(path, "rb") as f:
        m = mmap.mmap(f.fileno(), offset + length - base, access=mmap.ACCESS_COPY, offset=base)
    try:
        values = torch.frombuffer(m, dtype=as_torch(src), count=length // src.itemsize, offset=offset - base)
        # a copy in any case: the mapping is closed below, and .to() of the same dtype aliases
        out = values.to(as_torch(dst)) if src != dst else values.clone()
        del values
    finally:
        try:
            m.close()
        except BufferError:  # still viewed: the GC closes it
            pass
    return memoryview(out.view(torch.uint8).numpy())


def blocks(cast: CastSpan, *, block: int = BLOCK_ELEMENTS) -> Iterator[memoryview]:
    """The bytes of ``cast`` in ``dst``, block by block, in order."""
    ranges = _ranges(cast, block)
    if not ranges:
        return
    workers = max(1, min(2, os.cpu_count() or 1))
    with concurrent.futures.ThreadPoolExecutor(workers, thread_name_prefix="ckpt-cast") as pool:
        pending: deque = deque()
        it = iter(ranges)
        for r in it:
            pending.append(pool.submit(_convert, *r, cast.src, cast.dst))
            if len(pending) >= AHEAD:
                break
        while pending:
            data = pending.popleft().result()
            nxt = next(it, None)
            if nxt is not None:
                pending.append(pool.submit(_convert, *nxt, cast.src, cast.dst))
            yield data
