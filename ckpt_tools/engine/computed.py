"""The values of computed targets (:class:`~ckpt_tools.core.plan.Computed`): a quantized weight
dequantized with its scales, a weight quantized into codes and scales, or zeros (a state the
destination's model starts with that the source has no counterpart of). The op names are the
plan's data; the arithmetic is :mod:`ckpt_tools.storage.lowp`'s.

A dequantized piece whose codes and scales are each one contiguous byte range of a source file
is handed to the writer as a :class:`~ckpt_tools.storage.lowp.DequantSpan` (computed a few
block-rows at a time as it is written); anything else is computed here with torch.
"""

from __future__ import annotations

import math
from dataclasses import replace
from typing import TYPE_CHECKING

from ..core.dtypes import DType, as_torch
from ..core.plan import Computed, Piece
from ..errors import BadInput
from ..storage import lowp
from .reader import Reader

if TYPE_CHECKING:
    import torch

OPS = ("zeros", "dequant", "quant_block_codes", "quant_block_scale", "quant_channel_codes", "quant_channel_scale")


def grid_of(c: Computed) -> lowp.Grid:
    return c.param("grid")


def code_rows(c: Computed, piece: Piece) -> tuple[int, int]:
    """The code rows (flattened over slabs) that a piece of dim-0 rows of the result needs."""
    g = grid_of(c)
    if any(piece.offsets[1:]) or tuple(piece.sizes[1:]) != tuple(c.shape[1:]):
        raise BadInput(f"tensor {piece.target.source.name!r}: a dequantized weight is cut by rows only")
    a, b = piece.offsets[0] if piece.offsets else 0, (piece.offsets[0] + piece.sizes[0]) if piece.sizes else 1
    if len(c.shape) == 2 and not g.transposed and g.lead == 1:
        return a, b
    per = g.lead * g.rows // c.shape[0]  # code rows per index of the result's first dimension
    if per * c.shape[0] != g.lead * g.rows or (g.transposed and per % g.rows):
        raise BadInput(f"tensor {piece.target.source.name!r}: cannot cut its dequantized rows {a}:{b}")
    return a * per, b * per


def values(reader: Reader, piece: Piece, *,
           spans: bool = False) -> torch.Tensor | lowp.DequantSpan | lowp.QuantSpan:
    c = piece.target.computed
    if c.op == "zeros":  # the source (a small tensor beside it) says only where the target belongs
        import torch

        return torch.zeros(piece.sizes, dtype=as_torch(piece.target.dtype))
    if c.op == "dequant":
        return _dequant(reader, piece, c, spans)
    scales_only = c.op.endswith("scale")
    found = _quant_span(reader, piece, c) if spans or scales_only else None
    if found is not None:
        return found if not scales_only else _narrowed(found.scales(), piece)
    src = _whole(reader, piece.target.source)
    fp8 = c.param("fp8", "float8_e4m3fn")
    if c.op in ("quant_block_codes", "quant_block_scale"):
        codes, scale = lowp.quantize_block(src, tuple(c.param("block")), fp8, scales_only=scales_only)
        out = scale if scales_only else codes
    elif c.op in ("quant_channel_codes", "quant_channel_scale"):
        codes, scale = lowp.quantize_channel(src, src.dtype, fp8, scales_only=scales_only)
        out = scale if scales_only else codes
    else:
        raise BadInput(f"tensor {piece.target.source.name!r}: unknown computation {c.op!r}")
    return _narrowed(out, piece)


def _narrowed(out: torch.Tensor, piece: Piece) -> torch.Tensor:
    for d, (o, s) in enumerate(zip(piece.offsets, piece.sizes)):
        out = out.narrow(d, o, s)
    return out.contiguous()


def _quant_span(reader: Reader, piece: Piece, c: Computed) -> lowp.QuantSpan | None:
    """A 2-D weight stored as one contiguous byte range, to be quantized a step of rows at a
    time: the piece's rows for codes (quantized as they are written), all rows for a scale;
    None where it must be computed here (a weight in several chunks, a piece that cuts columns
    or would split a block-row)."""
    t = piece.target.source
    if len(t.shape) != 2 or len(t.chunks) != 1 or tuple(t.chunks[0].sizes) != tuple(t.shape):
        return None
    rows, cols = t.shape
    if c.op.endswith("scale"):
        a, b = 0, rows
    elif any(piece.offsets[1:]) or tuple(piece.sizes[1:]) != (cols,):
        return None
    else:
        a, b = piece.offsets[0], piece.offsets[0] + piece.sizes[0]
    block = tuple(c.param("block") or (1, cols))
    if c.op.startswith("quant_block") and (a % block[0] or (b % block[0] and b != rows)):
        return None
    span = reader.span(t, t.chunks[0])
    if span is None:
        return None
    scheme = "block" if c.op.startswith("quant_block") else "channel"
    return lowp.QuantSpan((span,), t.dtype, DType(c.param("fp8", "float8_e4m3fn")), cols=cols, rows=(a, b),
                          scheme=scheme, block=block, step=block[0] if scheme == "block" else 128)


def _whole(reader: Reader, t) -> torch.Tensor:
    """A whole tensor: a view of the mapped file when one stored chunk is all of it (no copy)."""
    if len(t.chunks) == 1 and tuple(t.chunks[0].sizes) == tuple(t.shape):
        return reader.chunk(t, t.chunks[0])
    return reader.full(t)


def _dequant(reader: Reader, piece: Piece, c: Computed, spans: bool) -> torch.Tensor | lowp.DequantSpan:
    g = grid_of(c)
    codes_t, scale_t = piece.target.source, c.inputs[0]
    r0, r1 = code_rows(c, piece)
    if spans and len(codes_t.chunks) == 1 and len(scale_t.chunks) == 1:
        code_span = reader.span(codes_t, codes_t.chunks[0])
        scale_span = reader.span(scale_t, scale_t.chunks[0])
        if code_span is not None and scale_span is not None:
            return lowp.DequantSpan((code_span,), codes_t.dtype, piece.target.dtype, scale_span, scale_t.dtype,
                                    g, (r0, r1))
    if g.transposed:
        a, b = r0 // g.rows, r1 // g.rows
        if len(codes_t.chunks) == 1 and len(scale_t.chunks) == 1:  # views of the mapped files
            out = lowp.dequantize(_whole(reader, codes_t), _whole(reader, scale_t), g, piece.target.dtype, (a, b))
        else:  # the slabs asked for, from the chunks that hold them
            out = lowp.dequantize(reader.rows(codes_t, a, b), reader.rows(scale_t, a, b), replace(g, lead=b - a),
                                  piece.target.dtype)
    elif _by_rows(codes_t, scale_t, g):
        out = _dequant_rows(reader, codes_t, scale_t, g, (r0, r1), piece.target.dtype)
    else:
        full = lowp.dequantize(_whole(reader, codes_t), _whole(reader, scale_t), g, piece.target.dtype)
        out = full.reshape(g.lead * g.rows, g.cols)[r0:r1]
    return out.reshape(piece.sizes)


def _by_rows(codes_t, scale_t, g: lowp.Grid) -> bool:
    """Whether codes [*lead, rows, cols] and scales [*lead, grid rows, grid cols] (2-D: no lead)
    can be read a window of rows at a time (float8 codes; not MXFP4's grouped bytes)."""
    lead = tuple(codes_t.shape[:-2])
    return (not g.e2m1 and len(codes_t.shape) >= 2 and math.prod(lead) == g.lead
            and tuple(codes_t.shape[-2:]) == (g.rows, g.cols)
            and tuple(scale_t.shape) == (*lead, *g.grid))


def _dequant_rows(reader: Reader, codes_t, scale_t, g: lowp.Grid, rows: tuple[int, int], dtype: DType) -> torch.Tensor:
    """Code rows ``rows`` (flattened over the leading dimensions: an expert's rows follow the
    previous one's) of a quantized weight stored in several chunks (a DCP or rank-file copy),
    dequantized a few block-rows of one slab at a time: only the chunks' rows each step needs
    are read (:meth:`Reader.rows`), so memory is the result plus one step in float32, not the
    whole weight."""
    import torch

    r0, r1 = rows
    lead = tuple(codes_t.shape[:-2])
    out = torch.empty(r1 - r0, g.cols, dtype=as_torch(dtype))
    step = max(g.block[0], (1 << 20) // max(g.row_bytes, 1) // g.block[0] * g.block[0])
    start = r0
    while start < r1:
        slab, local = divmod(start, g.rows)
        stop = min(r1, slab * g.rows + min(g.rows, (local // g.block[0]) * g.block[0] + step))
        a, b = g.scale_rows(start, stop)
        at = tuple(int(i) for i in _unravel(slab, lead))
        codes = reader.rows(codes_t, local, stop - slab * g.rows, at=at)
        scales = reader.rows(scale_t, a - slab * g.grid[0], b - slab * g.grid[0], at=at)
        out[start - r0:stop - r0] = lowp.dequant_rows(codes, lowp.scales_f32(scales), g, start)
        start = stop
    return out


def _unravel(i: int, shape: tuple[int, ...]) -> list[int]:
    """The index of flat position ``i`` in ``shape`` (row-major)."""
    at = []
    for n in reversed(shape):
        i, r = divmod(i, n)
        at.append(r)
    return at[::-1]
