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

import math
import os
import threading
from collections.abc import Iterator
from functools import cache
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .castio import AHEAD, CastSpan, _read, converted_ahead
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
        time, computed with numpy (see :class:`_Work`) by a small pool that works ``AHEAD``
        chunks ahead of the writer (numpy releases the GIL; a span of one chunk is computed on
        the writer's thread), into buffers made once and reused: each view is valid until the
        next one is asked for."""
        g = self.grid
        step = g.rows if g.transposed else max(g.block[0], elements // max(g.cols, 1) // g.block[0] * g.block[0])
        step = min(step, max(1, self.rows[1] - self.rows[0]))
        fds = {p: os.open(p, os.O_RDONLY) for p in {self.parts[0][0], self.scale_part[0]}}
        kind = (step, g.cols, g.row_bytes, g.block, g.e2m1, g.transposed, str(self.src), str(self.dst))
        with _SPARE_LOCK:
            free = _SPARE.pop(kind, [])
        free += [_Work(self, step) for _ in range(AHEAD - len(free))]
        for work in free:
            work.span = self
        mine = list(free)
        try:
            jobs = ((fds, r0, min(r0 + step, self.rows[1])) for r0 in range(self.rows[0], self.rows[1], step))
            yield from converted_ahead(free, jobs, _Work.rows, _workers(), "ckpt-dequant")
        finally:
            for fd in fds.values():
                os.close(fd)
        with _SPARE_LOCK:  # only after a clean end: after an error a writer may still hold a chunk
            _SPARE.clear()  # one kind kept: a model's weights come in a few shapes, often in a row
            _SPARE[kind] = mine


@cache
def _workers() -> int:
    """Threads computing a span's chunks: two at most (worked out once: ``os.cpu_count`` reads a
    file, and a model of many small weights asks per span)."""
    return max(1, min(2, os.cpu_count() or 1))


_SPARE: dict[tuple, list] = {}  # the buffers of the last finished span, for the next of its kind
_SPARE_LOCK = threading.Lock()
TILE = 1 << 15  # elements gathered at once: their int64 indexes and results stay in L2


class _Work:
    """The buffers of one chunk of a :class:`DequantSpan` (``step`` code rows), reused from
    one chunk to the next, and its arithmetic:

    - ``tabled`` (a float8 source whose blocks hold at least ``TILE // 16`` values, to
      bfloat16, float16 or float32): for each scale, the 256 products ``value(code) * scale``
      in float32, each rounded once to the output dtype (:func:`_rounded`), then every element
      looked up in its block's table (``np.take``, a tile at a time). The same product and the
      same rounding as computing each element, bit for bit, at one gather an element.
    - otherwise: the codes' float32 values looked up, multiplied by their scales in place, and
      rounded (MXFP4's 32-value blocks; a transposed slab).

    No torch: importing it costs more than a second; the tables of code values and the scales'
    float32 are built from the bits (:func:`_code_values`, :func:`_scales_np`)."""

    def __init__(self, span: DequantSpan, step: int):
        import numpy as np

        g = span.grid
        self.span, self.np = span, np
        self.raw = bytearray(step * g.row_bytes)
        self.tabled = (not g.e2m1 and not g.transposed and str(span.dst) in ("bfloat16", "float16", "float32")
                       and _code_values(str(span.src)) is not None and g.block[0] * min(g.block[1], g.cols) >= TILE // 16)
        if self.tabled:
            self.out = np.empty(step * g.cols, _OUT_NP[str(span.dst)])
            self.tile_rows = max(1, min(step, TILE // max(g.cols, 1)))
            self.index = np.empty(self.tile_rows * g.cols, np.intp)
            # each column's table offset, tiled over ``tile_rows`` rows
            self.col_offset = np.tile(np.arange(g.cols, dtype=np.intp) // g.block[1] * 256, self.tile_rows)

    def rows(self, fds: dict, r0: int, r1: int) -> memoryview:
        """Code rows ``[r0, r1)`` dequantized, as bytes of ``dst``."""
        np, span, g = self.np, self.span, self.span.grid
        path, offset, _ = span.parts[0]
        spath, soffset, _ = span.scale_part
        ssize = span.scale_dtype.itemsize
        raw = memoryview(self.raw)[:(r1 - r0) * g.row_bytes]
        _read(fds[path], raw, offset + r0 * g.row_bytes)
        a, b = g.scale_rows(r0, r1)
        sraw = bytearray((b - a) * g.grid[1] * ssize)
        _read(fds[spath], memoryview(sraw), soffset + a * g.grid[1] * ssize)
        scales = _scales_np(sraw, span.scale_dtype).reshape(b - a, g.grid[1])
        if self.tabled:
            return self._gathered(np.frombuffer(raw, np.uint8), scales, r0, r1, a)
        lut = _byte_values("e2m1" if g.e2m1 else str(span.src))
        v = np.take(lut, np.frombuffer(raw, np.uint8), axis=0).reshape(r1 - r0, g.cols)
        _times_scales(np, v, scales, g, r0)
        if g.transposed:
            v = np.ascontiguousarray(v.T)
        return memoryview(_rounded(np, v.reshape(-1), span.dst)).cast("B")

    def _gathered(self, codes: Any, scales: Any, r0: int, r1: int, a: int) -> memoryview:
        """Rows ``[r0, r1)`` through their blocks' tables, one block-row (rows sharing a scale
        row) at a time, a tile of rows at a time within it."""
        np, g = self.np, self.span.grid
        values = _code_values(str(self.span.src))
        cols, out = g.cols, self.out
        r = r0
        while r < r1:
            slab, within = divmod(r, g.rows)
            stop = min(r1, slab * g.rows + min(g.rows, (within // g.block[0] + 1) * g.block[0]))
            srow = slab * g.grid[0] + within // g.block[0] - a
            table = _rounded(np, np.multiply.outer(scales[srow], values).reshape(-1), self.span.dst)
            for t in range(r, stop, self.tile_rows):
                n = (min(t + self.tile_rows, stop) - t) * cols
                at = (t - r0) * cols
                index = self.index[:n]
                np.copyto(index, codes[at:at + n])  # then one add: faster than a mixed-type add
                np.add(index, self.col_offset[:n], out=index)
                np.take(table, index, out=out[at:at + n], mode="clip")  # all in range
            r = stop
        return memoryview(out[:(r1 - r0) * cols]).cast("B")


_OUT_NP = {"bfloat16": "uint16", "float16": "float16", "float32": "float32"}


@cache
def _code_values(codes: str) -> Any:
    """float32 value of each byte as a float8 code (e4m3fn, e5m2), built from its bits with
    numpy (the bits torch gives, NaN payloads included: tests/test_quant.py compares all 256);
    None for another code type."""
    import numpy as np

    b = np.arange(256, dtype=np.uint32)
    if codes == "float8_e4m3fn":
        exp_bits, man_bits, bias = 4, 3, 7
    elif codes == "float8_e5m2":
        exp_bits, man_bits, bias = 5, 2, 15
    else:
        return None
    sign, e, m = b >> 7, (b >> man_bits) & ((1 << exp_bits) - 1), b & ((1 << man_bits) - 1)
    bits = (sign << 31) | ((e + 127 - bias) << 23) | (m << (23 - man_bits))
    sub = (m.astype(np.float32) * np.float32(2.0 ** (1 - bias - man_bits))).view(np.uint32) | (sign << 31)
    bits = np.where(e == 0, sub, bits)
    top = e == (1 << exp_bits) - 1
    if codes == "float8_e4m3fn":  # no infinities; S.1111.111 is NaN
        nan = top & (m == 7)
        bits = np.where(nan, (sign << 31) | 0x7F800000 | (m << 20), bits)
    else:  # IEEE-like: infinities, quiet NaNs
        bits = np.where(top, (sign << 31) | 0x7F800000 | (m << 21) | np.where(m > 0, 0x00400000, 0), bits)
    return bits.astype(np.uint32).view(np.float32)


@cache
def _byte_values(codes: str) -> Any:
    """float32 value of each byte (a float8 code), or the two E2M1 values of each byte, [256, 2]."""
    if codes == "e2m1":
        import numpy as np

        return np.array(E2M1_VALUES, np.float32)[np.stack([np.arange(256) & 0x0F, np.arange(256) >> 4], axis=1)]
    known = _code_values(codes)
    if known is not None:
        return known
    import torch

    every = torch.arange(256, dtype=torch.uint8)
    return every.view(getattr(torch, codes)).to(torch.float32).numpy()


def _scales_np(raw: bytearray, dtype: DType) -> Any:
    """Scales as float32, from their bytes: float32, bfloat16, float16 and E8M0 (uint8 or
    float8_e8m0fnu, see :func:`scales_f32`) with numpy; any other type through torch."""
    import numpy as np

    if not raw:
        return np.empty(0, np.float32)
    name = str(dtype)
    if name == "float32":
        return np.frombuffer(raw, np.float32)
    if name == "bfloat16":
        return (np.frombuffer(raw, np.uint16).astype(np.uint32) << 16).view(np.float32)
    if name == "float16":
        return np.frombuffer(raw, np.float16).astype(np.float32)
    if name in ("uint8", "float8_e8m0fnu"):
        e = np.frombuffer(raw, np.uint8).astype(np.uint32)
        bits = np.where(e == 0, np.uint32(0x00400000), e << 23)
        return np.where(e == 255, np.uint32(0x7FC00000), bits).astype(np.uint32).view(np.float32)
    import torch

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
