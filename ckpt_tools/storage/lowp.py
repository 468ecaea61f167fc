"""Low-precision weights: the arithmetic of scaled codes, streamed a few block-rows at a time.

A quantized weight is stored as codes (float8 values, or two 4-bit E2M1 codes a byte) and one
scale per block of the weight: ``w[i, j] = value(q[i, j]) * s[i // bh, j // bw]`` over the last
two dimensions (each leading index, an expert, has its own grid). Dequantizing computes that
product in float32 and rounds it once to the output dtype: what DeepSeek-V3's ``weight_dequant``,
transformers' ``Fp8Dequantize`` and compressed-tensors' ``dequantize`` compute (their products
of an 8-bit mantissa by a power of two or an 8-bit mantissa are exact in float32).

:class:`DequantSpan` is a dequantized piece whose codes and scales are byte ranges of source
files: like a :class:`~.castio.CastSpan` it is converted as it is written, a bounded number of
rows at a time (codes and the scale rows they need read with ``preadv``), so memory stays flat
whatever the tensor's size. :func:`dequantize` computes the same from tensors (any source).

Quantizing (``export --quantize``): :func:`quantize_block` (128x128 blocks, e4m3, each block's
scale its absmax / 448) and :func:`quantize_channel` (one scale per output row, as
compressed-tensors' FP8_DYNAMIC weights), again a block-row at a time.

The word for a scheme (fp8, mxfp4, compressed-tensors) lives in :mod:`ckpt_tools.naming.quant`;
this module knows blocks, codes and scales only.
"""

from __future__ import annotations

import concurrent.futures
import math
import os
from collections import deque
from collections.abc import Iterator
from functools import cache
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .castio import AHEAD, CastSpan, _read
from .diskio import WRITE_BYTES
from ..core.dtypes import DType, as_torch

# E2M1: sign, 2 exponent bits, 1 mantissa bit (OCP MX spec); index = the 4-bit code
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
FP8_MAX = {"float8_e4m3fn": 448.0, "float8_e5m2": 57344.0}


@dataclass(frozen=True)
class Grid:
    """How codes and scales line up, for a code tensor seen as ``lead`` slabs of ``rows`` x
    ``cols`` values (``cols`` values per row: twice the bytes for E2M1) and its scales as ``lead``
    slabs of ``grid[0]`` x ``grid[1]``: scale ``(r // block[0], c // block[1])`` of its slab
    multiplies value ``(r, c)``. ``transposed``: each slab is written transposed (``cols`` x
    ``rows``), as transformers holds gpt-oss's experts."""

    lead: int
    rows: int
    cols: int
    block: tuple[int, int]
    grid: tuple[int, int]
    e2m1: bool = False
    transposed: bool = False

    @property
    def row_bytes(self) -> int:
        return self.cols // 2 if self.e2m1 else self.cols

    def scale_rows(self, r0: int, r1: int) -> tuple[int, int]:
        """The scale rows ``[a, b)`` (flattened over slabs) that code rows ``[r0, r1)`` need."""
        def row(r: int) -> int:
            return (r // self.rows) * self.grid[0] + (r % self.rows) // self.block[0]
        return row(r0), row(r1 - 1) + 1

    def fits(self) -> bool:
        """Whether the scale grid covers the codes exactly (edge blocks may be partial)."""
        return (math.ceil(self.rows / self.block[0]), math.ceil(self.cols / self.block[1])) == self.grid


def scales_f32(s: Any) -> Any:
    """Scales as float32: float types as they are; E8M0 bytes (uint8 or float8_e8m0fnu) as
    ``2 ** (e - 127)``, built from the bits (exact, 255 is NaN)."""
    import torch

    if s.dtype in (torch.uint8, getattr(torch, "float8_e8m0fnu", None)):
        e = s.view(torch.uint8).to(torch.int32)
        bits = torch.where(e == 0, torch.tensor(0x00400000, dtype=torch.int32), e << 23)
        bits = torch.where(e == 255, torch.tensor(0x7FC00000, dtype=torch.int32), bits)
        return bits.view(torch.float32)
    return s.to(torch.float32)


def unpack_e2m1(packed: Any) -> Any:
    """Two E2M1 codes a byte, low nibble first → float32, the last dimension twice as long."""
    import torch

    lut = torch.tensor(E2M1_VALUES, dtype=torch.float32)
    u8 = packed.view(torch.uint8)
    out = torch.empty(*u8.shape[:-1], u8.shape[-1] * 2, dtype=torch.float32)
    out[..., 0::2] = lut[(u8 & 0x0F).long()]
    out[..., 1::2] = lut[(u8 >> 4).long()]
    return out


def dequant_rows(codes: Any, scales: Any, g: Grid, r0: int) -> Any:
    """Code rows ``[r0, r0 + len(codes))`` (flattened over slabs, shape [n, row_bytes] or [n,
    cols]) times their scales (``scales``: the float32 scale rows from ``g.scale_rows``'s first,
    [m, grid[1]]) → float32 [n, cols]."""
    import torch

    n = codes.shape[0]
    values = unpack_e2m1(codes) if g.e2m1 else codes.to(torch.float32)
    r = torch.arange(r0, r0 + n)
    srow = (r // g.rows) * g.grid[0] + (r % g.rows) // g.block[0]
    srow -= int(srow[0]) if n else 0
    s = scales[srow]  # [n, grid[1]]
    if g.block[1] * g.grid[1] == g.cols:
        return (values.view(n, g.grid[1], g.block[1]) * s.unsqueeze(-1)).view(n, g.cols)
    return values * s.repeat_interleave(g.block[1], dim=1)[:, :g.cols]


def dequantize(codes: Any, scales: Any, g: Grid, dtype: DType, lead_range: tuple[int, int] | None = None) -> Any:
    """The dequantized tensor (slabs ``lead_range`` of it, default all) from whole codes and
    scales tensors, in ``dtype``: [n, rows, cols] (or [n, cols, rows] transposed), squeezed to
    2-D when the codes have no leading dimension (reshape as the target's shape)."""
    import torch

    a, b = lead_range or (0, g.lead)
    c2 = codes.reshape(g.lead * g.rows, g.row_bytes) if g.e2m1 else codes.reshape(g.lead * g.rows, g.cols)
    s2 = scales_f32(scales.reshape(g.lead * g.grid[0], g.grid[1]))
    out = []
    for slab in range(a, b):
        r0 = slab * g.rows
        s0, s1 = g.scale_rows(r0, r0 + g.rows)
        v = dequant_rows(c2[r0:r0 + g.rows], s2[s0:s1], g, r0)
        out.append((v.T if g.transposed else v).to(as_torch(dtype)))
    return torch.stack(out) if out else torch.empty(0)


@dataclass(frozen=True)
class DequantSpan(CastSpan):
    """Code rows ``rows`` (flattened over slabs) of one code tensor stored at ``parts[0]``
    (the whole tensor's byte range) with its scales at ``scale_part`` (``scale_dtype``),
    dequantized to ``dst`` as they are written. ``parts``/``src`` name the codes, so a writer
    that takes a :class:`CastSpan` takes this one."""

    scale_part: tuple[Path, int, int] = (Path(), 0, 0)
    scale_dtype: DType = DType("float32")
    grid: Grid | None = None
    rows: tuple[int, int] = (0, 0)

    @property
    def numel(self) -> int:
        return (self.rows[1] - self.rows[0]) * self.grid.cols

    @property
    def nbytes(self) -> int:
        return self.numel * self.dst.itemsize

    def blocks(self, *, elements: int = 1 << 20) -> Iterator[memoryview]:
        """The dequantized bytes in order, a few block-rows (or, transposed, one slab) at a
        time, computed with numpy (codes looked up in a table of their 256 byte values, times
        their scales, rounded once, bits as torch rounds them, see :mod:`.castio`) by a small
        pool that works ``AHEAD`` chunks ahead of the writer (numpy releases the GIL)."""
        g = self.grid
        step = g.rows if g.transposed else max(g.block[0], elements // max(g.cols, 1) // g.block[0] * g.block[0])
        fds = {p: os.open(p, os.O_RDONLY) for p in {self.parts[0][0], self.scale_part[0]}}
        workers = max(1, min(2, os.cpu_count() or 1))
        try:
            with concurrent.futures.ThreadPoolExecutor(workers, thread_name_prefix="ckpt-dequant") as pool:
                starts = iter(range(self.rows[0], self.rows[1], step))
                pending: deque = deque()

                def submit() -> None:
                    r0 = next(starts, None)
                    if r0 is not None:
                        pending.append(pool.submit(self._rows, fds, r0, min(r0 + step, self.rows[1])))

                for _ in range(AHEAD):
                    submit()
                while pending:
                    data = pending.popleft().result()
                    submit()
                    for at in range(0, len(data), WRITE_BYTES):
                        yield data[at:at + WRITE_BYTES]
        finally:
            for fd in fds.values():
                os.close(fd)

    def _rows(self, fds: dict, r0: int, r1: int) -> memoryview:
        """Code rows ``[r0, r1)`` dequantized, as bytes of ``dst``."""
        import numpy as np

        g = self.grid
        path, offset, _ = self.parts[0]
        spath, soffset, _ = self.scale_part
        ssize = self.scale_dtype.itemsize
        raw = bytearray((r1 - r0) * g.row_bytes)
        _read(fds[path], memoryview(raw), offset + r0 * g.row_bytes)
        a, b = g.scale_rows(r0, r1)
        sraw = bytearray((b - a) * g.grid[1] * ssize)
        _read(fds[spath], memoryview(sraw), soffset + a * g.grid[1] * ssize)
        scales = _scales_np(sraw, self.scale_dtype).reshape(b - a, g.grid[1])
        lut = _byte_values("e2m1" if g.e2m1 else str(self.src))
        v = np.take(lut, np.frombuffer(raw, np.uint8), axis=0).reshape(r1 - r0, g.cols)
        _times_scales(np, v, scales, g, r0)
        if g.transposed:
            v = np.ascontiguousarray(v.T)
        return memoryview(_rounded(np, v.reshape(-1), self.dst)).cast("B")


@cache
def _byte_values(codes: str) -> Any:
    """float32 value of each byte (a float8 code), or the two E2M1 values of each byte, [256, 2]."""
    import torch

    every = torch.arange(256, dtype=torch.uint8)
    if codes == "e2m1":
        return unpack_e2m1(every.view(256, 1)).numpy()
    return every.view(getattr(torch, codes)).to(torch.float32).numpy()


def _scales_np(raw: bytearray, dtype: DType) -> Any:
    import torch

    if not raw:
        import numpy as np

        return np.empty(0, np.float32)
    return scales_f32(torch.frombuffer(raw, dtype=as_torch(dtype))).numpy()


def _times_scales(np: Any, v: Any, scales: Any, g: Grid, r0: int) -> None:
    """``v`` (float32 [n, cols], code rows from ``r0``) times its scales, in place."""
    n = v.shape[0]
    r = np.arange(r0, r0 + n)
    srow = (r // g.rows) * g.grid[0] + (r % g.rows) // g.block[0]
    s = scales[srow - srow[0]] if n else scales[:0]
    if g.block[1] * g.grid[1] == g.cols:
        v.reshape(n, g.grid[1], g.block[1])[...] *= s[:, :, None]
    else:
        v *= np.repeat(s, g.block[1], axis=1)[:, :g.cols]


def _rounded(np: Any, v: Any, dst: DType) -> Any:
    """float32 values rounded once to ``dst``, as torch rounds them."""
    from .castio import _to_bf16_bits

    if dst == "float32":
        return v
    if dst == "float16":
        with np.errstate(over="ignore", invalid="ignore"):
            return v.astype(np.float16)
    if dst == "bfloat16":
        out = np.empty(len(v), np.uint16)
        _to_bf16_bits(np, v.view(np.uint32), out, (np.empty(len(v), np.uint32), np.empty(len(v), bool)))
        return out
    import torch

    return torch.from_numpy(v).to(as_torch(dst)).view(torch.uint8).numpy()


# -- quantizing ---------------------------------------------------------------------------

def quantize_block(w: Any, block: tuple[int, int] = (128, 128), fp8: str = "float8_e4m3fn", *,
                   scales_only: bool = False, work: Any = None) -> tuple[Any, Any]:
    """Block FP8 of a [..., rows, cols] weight: ``(codes, scale_inv)``, codes = ``w / s`` rounded
    to ``fp8`` (saturated), ``s`` = the block's absmax / FP8 max (1 for an all-zero block), in
    float32 of shape [..., ceil(rows / bh), ceil(cols / bw)]; edge blocks are partial. Worked a
    block-row at a time (memory: the codes plus one block-row in float32)."""
    import torch

    bh, bw = block
    *lead, rows, cols = w.shape
    gr, gc = math.ceil(rows / bh), math.ceil(cols / bw)
    top = FP8_MAX[fp8]
    w3 = w.reshape(-1, rows, cols)
    codes = torch.empty(0 if scales_only else w3.shape, dtype=getattr(torch, fp8))
    inv = torch.empty(w3.shape[0], gr, gc, dtype=torch.float32)
    pad = gc * bw - cols
    # one float32 block-row, reused: no large temporary a step (glibc keeps freed ones mapped,
    # and a few hundred of them grew the process by the weight's size)
    if work is None or work.shape[0] < min(bh, rows) or work.shape[1] != gc * bw:
        work = torch.zeros(min(bh, rows), gc * bw, dtype=torch.float32)
    for e in range(w3.shape[0]):
        for i in range(gr):
            src = w3[e, i * bh:(i + 1) * bh]
            h = src.shape[0]
            x = work[:h]
            x[:, :cols].copy_(src)
            if pad:
                x[:, cols:].zero_()
            blocks = x.view(h, gc, bw)
            amax = torch.maximum(blocks.amax(dim=(0, 2)), blocks.amin(dim=(0, 2)).neg())  # = |x|'s max
            s = torch.where(amax > 0, amax / top, torch.ones_like(amax))
            inv[e, i] = s
            if scales_only:
                continue
            blocks.div_(s.view(1, gc, 1)).clamp_(-top, top)
            codes[e, i * bh:(i + 1) * bh].copy_(x[:, :cols])
    return (codes if scales_only else codes.reshape(w.shape)), inv.reshape(*lead, gr, gc)


def quantize_channel(w: Any, scale_dtype: Any, fp8: str = "float8_e4m3fn", rows_at_once: int = 128, *,
                     scales_only: bool = False) -> tuple[Any, Any]:
    """Per-output-channel FP8 of a [rows, cols] weight, as compressed-tensors quantizes
    FP8_DYNAMIC weights: ``scale`` = row absmax / FP8 max (kept in ``scale_dtype``, the model's
    dtype; an all-zero row's is that dtype's eps), codes = ``w / scale`` divided in that dtype
    (rounded there, then to ``fp8``: compressed-tensors' two roundings, kept for its bits), saturated. Returns ``(codes [rows, cols], scale [rows, 1])``."""
    import torch

    rows, cols = w.shape
    top = FP8_MAX[fp8]
    finfo = torch.finfo(scale_dtype)
    codes = torch.empty(0 if scales_only else (rows, cols), dtype=getattr(torch, fp8))
    scale = torch.empty(rows, 1, dtype=scale_dtype)
    for r0 in range(0, rows, rows_at_once):
        x = w[r0:r0 + rows_at_once]
        lo = torch.clamp(x.amin(dim=1, keepdim=True), max=0)
        hi = torch.clamp(x.amax(dim=1, keepdim=True), min=0)
        amax = torch.maximum(lo.abs(), hi.abs())
        s = (amax.to(torch.float32) / top).to(scale_dtype)
        s = torch.where(s == 0, torch.full_like(s, finfo.eps), s)  # an all-zero row: its dtype's eps
        scale[r0:r0 + rows_at_once] = s
        if scales_only:
            continue
        q = (x / s).clamp(-top, top)  # in the model dtype, as compressed-tensors divides
        codes[r0:r0 + rows_at_once] = q.to(codes.dtype)
    return codes, scale


@dataclass(frozen=True)
class QuantSpan(CastSpan):
    """Rows ``rows`` of a 2-D weight of ``cols`` columns stored at ``parts[0]`` (``src``
    elements, the whole weight's byte range), quantized to FP8 codes (``dst``) as they are
    written, ``step`` rows at a time: ``scheme`` "block" (:func:`quantize_block` with ``block``;
    ``rows`` start on a block boundary and ``step`` is a whole number of blocks) or "channel"
    (:func:`quantize_channel`). No block or row spans two steps, so the codes are those of the
    whole weight quantized at once, bit for bit; memory is one step's rows."""

    cols: int = 0
    rows: tuple[int, int] = (0, 0)
    scheme: str = "block"
    block: tuple[int, int] = (128, 128)
    step: int = 128

    @property
    def numel(self) -> int:
        return (self.rows[1] - self.rows[0]) * self.cols

    @property
    def nbytes(self) -> int:
        return self.numel * self.dst.itemsize

    def blocks(self) -> Iterator[memoryview]:
        import torch

        work = self._work()
        for w in self._steps():
            if self.scheme == "block":
                codes, _ = quantize_block(w, self.block, str(self.dst), work=work)
            else:
                codes, _ = quantize_channel(w, w.dtype, str(self.dst), rows_at_once=w.shape[0])
            data = memoryview(codes.view(torch.uint8).numpy()).cast("B")
            for at in range(0, len(data), WRITE_BYTES):
                yield data[at:at + WRITE_BYTES]

    def scales(self) -> Any:
        """The scales of these rows (block: float32 [row blocks, col blocks]; channel: the
        weight's dtype [rows, 1]), read a step at a time as :meth:`blocks` reads them."""
        import torch

        if self.scheme == "block":
            work = self._work()
            return torch.cat([quantize_block(w, self.block, str(self.dst), scales_only=True, work=work)[1]
                              for w in self._steps()])
        return torch.cat([quantize_channel(w, w.dtype, str(self.dst), rows_at_once=w.shape[0], scales_only=True)[1]
                          for w in self._steps()])

    def _work(self) -> Any:
        """The float32 block-row :func:`quantize_block` works in, one for all steps."""
        import torch

        return torch.zeros(self.step, -(-self.cols // self.block[1]) * self.block[1], dtype=torch.float32)

    def _steps(self) -> Iterator[Any]:
        """The source rows, ``step`` at a time, as tensors of ``src``, each valid until the next
        is asked for (read with ``preadv`` into one buffer, not mapped: memory is one step,
        allocated once, whatever the weight's size)."""
        import torch

        path, offset, _ = self.parts[0]
        row_bytes = self.cols * self.src.itemsize
        raw = bytearray(min(self.step, self.rows[1] - self.rows[0]) * row_bytes)
        fd = os.open(path, os.O_RDONLY)
        try:
            for r0 in range(self.rows[0], self.rows[1], self.step):
                r1 = min(r0 + self.step, self.rows[1])
                view = memoryview(raw)[:(r1 - r0) * row_bytes]
                _read(fd, view, offset + r0 * row_bytes)
                yield torch.frombuffer(view, dtype=as_torch(self.src)).view(r1 - r0, self.cols)
        finally:
            os.close(fd)
