"""Casts (``--dtype``) streamed in bounded blocks.

A piece whose bytes are byte ranges of source files in another dtype (:class:`CastSpan`) is
converted a block of elements at a time: each block is read (``preadv``, a copy out of the page
cache) into a buffer, converted into another buffer and handed to the writer, while a small pool
already reads and converts the next blocks. The buffers are made once and reused, from one block
and one piece to the next: allocating fresh blocks costs more in page faults than converting.
Memory stays at ``BLOCK_ELEMENTS`` times the element sizes times ``AHEAD``, whatever the
tensor's size; nothing is materialised whole.

The conversion between bfloat16, float16 and float32 is numpy's, a cache-sized chunk at a time
(bits moved for bfloat16 → float16, with a 64 Ki-entry table of every value for the rare values
out of float16's normal range, and for float16 → bfloat16; a shift for bfloat16 → float32;
round-to-nearest-even on the bits for float32 → bfloat16; numpy's own cast between float16 and
float32): importing
torch costs more than a second, and torch's threads spin on the cores the writer needs. The
results are torch's, bit for bit (tests/test_castio.py compares every 16-bit value and the
float32 edge cases), except that a NaN may come out with another sign or payload, as it may
from torch's own vector and scalar loops. Other pairs (float64, float8) go through torch.
"""

from __future__ import annotations

import concurrent.futures
import itertools
import os
import threading
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from typing import Any

from .diskio import WRITE_BYTES
from ..core.dtypes import DType, as_torch

BLOCK_ELEMENTS = 4 << 20  # 8-16 MiB of source per block
AHEAD = 3  # blocks converted ahead of the writer
_BF16_NAN = 0x7FC0


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


# -- conversion kernels: (numpy, src values, dst values, scratch arrays) -> None, run over
# CHUNK elements at a time, so each of their passes works in the cache

CHUNK = 1 << 17  # 128 Ki elements: a kernel's arrays together stay within a core's L2
_BF16_IN_F16 = (0x3880, 0x4780)  # bfloat16 magnitudes (bits) that are normal float16 numbers: [lo, hi)


def _bf16_to_f16(np: Any, u: Any, out: Any, scratch: tuple) -> None:
    """bfloat16 bits → float16 bits. A bfloat16 whose value is a normal float16 converts exactly
    by moving its bits (exponent rebased from 127 to 15, mantissa shifted left 3); the rest
    (float16 subnormals and zeros, overflow, inf, NaN: a fraction of a percent of weights) is
    looked up in the table of every value. Shifts are products that wrap in 16 bits (numpy's
    multiply runs at twice its shift's speed), which also drop the sign bit: no mask."""
    work, odd = (x[:len(u)] for x in scratch)
    np.multiply(u, 8, out=out)  # magnitude << 3: the exponent's 6 low bits remain
    np.subtract(out, (127 - 15) << 10 & 0xFFFF, out=out)  # (e - 112) << 10 for 0 < e - 112 < 31
    np.bitwise_and(u, 0x8000, out=work)
    np.bitwise_or(out, work, out=out)
    # outside [lo, hi) ⇔ 2 (magnitude - lo), wrapping, ≥ 2 (hi - lo): one comparison, no temporary
    np.multiply(u, 2, out=work)
    np.subtract(work, 2 * _BF16_IN_F16[0], out=work)
    np.greater_equal(work, 2 * (_BF16_IN_F16[1] - _BF16_IN_F16[0]), out=odd)
    if odd.any():
        at = np.flatnonzero(odd)
        out[at] = _tables()["bf16_to_f16"][u[at]]


def _to_bf16_bits(np: Any, u32: Any, out: Any, scratch: tuple) -> None:
    """float32 bits → bfloat16 bits, rounded to nearest even, as torch rounds; NaN stays NaN."""
    work, nan = (x[:len(u32)] for x in scratch)
    np.right_shift(u32, 16, out=work)
    np.bitwise_and(work, 1, out=work)
    np.add(work, 0x7FFF, out=work)
    np.add(work, u32, out=work)  # wraps only for NaNs, fixed below
    np.right_shift(work, 16, out=work)
    np.copyto(out, work, casting="unsafe")
    np.isnan(u32.view(np.float32), out=nan)
    if nan.any():
        out[nan] = _BF16_NAN


def _to_f16(np: Any, f32: Any, out: Any, scratch: tuple) -> None:
    """float32 → float16 (numpy's cast rounds to nearest even, as torch's does; too large → inf)."""
    with np.errstate(over="ignore", invalid="ignore"):
        np.copyto(out, f32, casting="unsafe")


@cache
def _tables() -> dict[str, Any]:
    """The 16-bit ↔ 16-bit conversions as tables of every value."""
    import numpy as np

    every = np.arange(1 << 16, dtype=np.uint32)
    with np.errstate(over="ignore", invalid="ignore"):
        bf16_to_f16 = (every << 16).view(np.float32).astype(np.float16).view(np.uint16)
    f16_to_bf16 = np.empty(1 << 16, np.uint16)
    as_f32 = every.astype(np.uint16).view(np.float16).astype(np.float32).view(np.uint32)
    _to_bf16_bits(np, as_f32, f16_to_bf16, (np.empty(1 << 16, np.uint32), np.empty(1 << 16, bool)))
    return {"bf16_to_f16": bf16_to_f16, "f16_to_bf16": f16_to_bf16}


# (src, dst) → (numpy view of the source, of the result, scratch dtypes, kernel)
_NUMPY_PAIRS: dict[tuple[str, str], tuple[str, str, tuple[str, ...], Callable]] = {
    ("bfloat16", "float16"): ("uint16", "uint16", ("uint16", "bool"), _bf16_to_f16),
    ("float16", "bfloat16"): ("uint16", "uint16", (),
                              lambda np, a, b, s: np.take(_tables()["f16_to_bf16"], a, out=b)),
    ("bfloat16", "float32"): ("uint16", "uint32", (),
                              lambda np, a, b, s: np.left_shift(a, 16, out=b, dtype=np.uint32)),
    ("float32", "bfloat16"): ("uint32", "uint16", ("uint32", "bool"), _to_bf16_bits),
    ("float16", "float32"): ("float16", "float32", (), lambda np, a, b, s: np.copyto(b, a)),
    ("float32", "float16"): ("float32", "float16", (), _to_f16),
}


def _read(fd: int, into: memoryview, offset: int) -> None:
    got = 0
    while got < len(into):
        n = os.preadv(fd, [into[got:]], offset + got)
        if n <= 0:
            raise OSError(f"a source file ended {len(into) - got} bytes early (changed while read?)")
        got += n


class _Buffers:
    """Reusable buffers for one block: ``out`` for the converted values; ``raw`` for source
    bytes (one cache-sized chunk for numpy's kernels, read and converted while it is in the
    cache; the whole block for torch's) and scratch space for a kernel that needs it."""

    def __init__(self, block: int, src: DType, dst: DType, use_numpy: bool) -> None:
        self.out = bytearray(block * dst.itemsize)
        self._itemsizes = src.itemsize, dst.itemsize
        pair = _NUMPY_PAIRS.get((src, dst)) if use_numpy else None
        if pair is not None:
            import numpy as np

            a, b, scratch, self._kernel = pair
            chunk = min(block, CHUNK)
            self.raw = bytearray(chunk * src.itemsize)
            self._a, self._b = np.frombuffer(self.raw, a), np.frombuffer(self.out, b)
            self._s = tuple(np.empty(chunk, d) for d in scratch)
            self._np, self._chunk = np, chunk
        else:
            import torch

            self.raw = bytearray(block * src.itemsize)
            self._a = torch.frombuffer(self.raw, dtype=as_torch(src)) if self.raw else None
            self._b = torch.frombuffer(self.out, dtype=as_torch(dst)) if self.out else None
            self._np = None

    def convert(self, fd: int, offset: int, length: int) -> memoryview:
        """Read ``length`` bytes at ``offset`` of ``fd`` and convert them; a view of the result."""
        size_in, size_out = self._itemsizes
        numel = length // size_in
        if self._np is None:
            _read(fd, memoryview(self.raw)[:length], offset)
            self._b[:numel].copy_(self._a[:numel])
        else:
            raw = memoryview(self.raw)
            for i in range(0, numel, self._chunk):
                n = min(self._chunk, numel - i)
                _read(fd, raw[:n * size_in], offset + i * size_in)
                self._kernel(self._np, self._a[:n], self._b[i:i + n], self._s)
        return memoryview(self.out)[:numel * size_out]


_SPARE: dict[tuple, list[_Buffers]] = {}  # the buffers of the last finished cast, for the next
_SPARE_LOCK = threading.Lock()


@cache
def _converters() -> int:
    """Threads converting blocks: two at most, and one core left to the writer. On two cores a
    second converter only takes turns at the GIL with the first and the writer (each numpy pass
    hands it over): a 1.2 GiB bf16 → fp16 export 1.26 → 1.16 s with one. (Worked out once:
    ``os.cpu_count`` reads a file, 7 µs, and a many-tensor cast asks per piece.)"""
    return max(1, min(2, (os.cpu_count() or 1) - 1))


def blocks(cast: CastSpan, *, block: int = BLOCK_ELEMENTS, use_numpy: bool = True) -> Iterator[memoryview]:
    """The bytes of ``cast`` in ``dst``, in order, as views of at most ``WRITE_BYTES`` (what
    one write takes, see :mod:`ckpt_tools.storage.diskio`) into reused block buffers, each valid until
    the next one is asked for. ``use_numpy=False`` converts with torch even where numpy could.
    A span that computes its own values (:class:`~.lowp.DequantSpan`) gives them itself."""
    own = getattr(cast, "blocks", None)
    if own is not None:
        yield from own()
        return
    ranges = _ranges(cast, block)
    if not ranges:
        return
    kind = (block, cast.src, cast.dst, use_numpy)
    with _SPARE_LOCK:
        free = _SPARE.pop(kind, [])
    free += [_Buffers(*kind) for _ in range(AHEAD - len(free))]
    mine = list(free)
    fds: dict[Path, int] = {}
    try:
        def opened(path: Path) -> int:
            if path not in fds:
                fds[path] = os.open(path, os.O_RDONLY)
            return fds[path]

        jobs = ((opened(path), offset, length) for path, offset, length in ranges)
        yield from converted_ahead(free, jobs, _Buffers.convert, _converters(), "ckpt-cast")
    finally:
        for fd in fds.values():
            os.close(fd)
    with _SPARE_LOCK:  # only after a clean end: after an error a writer may still hold a block
        _SPARE.clear()  # one kind kept (a checkpoint is cast to one dtype)
        _SPARE[kind] = mine


def converted_ahead(free: list, jobs: Iterator[tuple], work: Callable[..., memoryview], workers: int,
                    name: str) -> Iterator[memoryview]:
    """``work(buffer, *job)`` for each of ``jobs`` in order, by a pool of ``workers`` threads
    (``name``) ``len(free)`` jobs ahead of the writer, each into a buffer of ``free`` the writer
    is done with (it asked for the next); the results as views of at most ``WRITE_BYTES``, each
    valid until the next one is asked for. The jobs are taken on the writer's thread. A single
    job is done there too: the writer would wait for it anyway, and a pool and its thread cost
    ~0.9 ms (93% of casting a 25k-tensor model, whose pieces are a block each)."""
    ahead = list(itertools.islice(jobs, 2))
    if len(ahead) < 2:
        for job in ahead:
            done = work(free[-1], *job)
            for at in range(0, len(done), WRITE_BYTES):
                yield done[at:at + WRITE_BYTES]
        return
    jobs = itertools.chain(ahead, jobs)
    with concurrent.futures.ThreadPoolExecutor(workers, thread_name_prefix=name) as pool:
        pending: deque = deque()

        def submit() -> None:
            job = next(jobs, None)
            if job is not None:
                buf = free.pop()
                pending.append((buf, pool.submit(work, buf, *job)))

        for _ in range(len(free)):
            submit()
        while pending:
            buf, fut = pending.popleft()
            done = fut.result()
            for at in range(0, len(done), WRITE_BYTES):
                yield done[at:at + WRITE_BYTES]
            free.append(buf)  # the writer is done with it: it asked for the next block
            submit()
