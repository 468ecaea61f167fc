"""Two checkpoints compared tensor by tensor: the second half of ``ckpt verify A B``.

Tensors are paired by (group, name) (against an ``hf`` checkpoint: the model only, names
normalised as ``export`` writes them) and compared a block of rows at a time, so memory stays
near the largest stored chunk whatever the model's size. Rows stored as equal bytes on both
sides are recognised without torch; any others are read as tensors and compared bit for bit
or, with a tolerance, in float64.

:class:`Findings`, what a check finds, lives here rather than in :mod:`.verify`, which fills
it too: the comparison then needs nothing from the command that calls it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING

from ..core.describe import Checkpoint, Chunk, Location, TensorInfo, dtype_name
from ..core.dtypes import DType, as_torch
from ..core.plan import Target, piece, whole
from ..engine import computed
from ..engine.stream import progress_bar
from ..engine.reader import Reader
from ..errors import BadInput, UnsafeInput
from ..hf import archcheck, assets as hfassets
from ..naming import quant
from ..naming.wrappers import normalize_name

if TYPE_CHECKING:
    import concurrent.futures

    import torch

# rows compared at once: bounds the float64 copies a tolerance check makes
BLOCK_BYTES = 32 * 1024 * 1024
_EMBED_SUFFIXES = ("embed_tokens.weight", "wte.weight", "word_embeddings.weight")


# -- findings -------------------------------------------------------------------------------

@dataclass
class Findings:
    """What checking one checkpoint, or comparing two, found: problems (damaged or unreadable
    files), per-tensor differences, NaN/Inf holders and notes, filled as the check goes."""

    problems: list[str] = field(default_factory=list)
    differences: list[dict[str, str]] = field(default_factory=list)
    nonfinite: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    checked: int = 0
    # each checkpoint's file check (manifest checksums), running beside the reads: a checkpoint
    # whose files are damaged explains whatever reading it raises next, "unsafe" included (no
    # code runs either way), which is then a finding
    files: dict[Path, concurrent.futures.Future[FileCheck]] = field(default_factory=dict)

    def damaged(self, root: Path) -> bool:
        check = self.files.get(root)
        return check is not None and bool(check.result().problems)

    def tolerate(self, e: BadInput, *ckpts: Checkpoint) -> None:
        """Record ``e`` as a finding, or re-raise an UnsafeInput from an undamaged checkpoint."""
        if isinstance(e, UnsafeInput) and not any(self.damaged(c.root) for c in ckpts):
            raise e
        self.problems.append(str(e))

    def differ(self, t: TensorInfo, reason: str, name: str | None = None) -> None:
        self.differences.append({"group": t.group, "name": name or t.name, "reason": reason})


@dataclass
class FileCheck:
    """What checking a checkpoint's files against its manifest found."""

    problems: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)


# -- comparing ------------------------------------------------------------------------------

def compare(ca: Checkpoint, cb: Checkpoint, found: Findings, *, atol: float, rtol: float,
            nan_check: bool, progress: bool) -> tuple[list[str], list[str]]:
    """Compare every tensor ``ca`` and ``cb`` share into ``found``; the names only ``ca`` and
    only ``cb`` hold. Bit for bit unless ``atol``/``rtol`` is given; an unreadable tensor is a
    difference (see :meth:`Findings.tolerate`), never an exception."""
    views_a, views_b = _dequantized_views(ca, found), _dequantized_views(cb, found)
    if views_a and views_b:  # both quantized: their codes and scales are compared as stored
        views_a, views_b = {}, {}
    ra_ckpt, rb_ckpt = ca, cb
    ca, cb = _with_views(ca, views_a), _with_views(cb, views_b)
    pairs, only_a, only_b = _pairs(ca, cb, found)
    tolerant = atol > 0 or rtol > 0
    total = sum(ta.nbytes for _, ta, _ in pairs)
    with Reader(ra_ckpt) as ra, Reader(rb_ckpt) as rb, progress_bar(total, "comparing", progress) as bar:
        sa, sb = _Side(ra, views_a), _Side(rb, views_b)
        for name, ta, tb in pairs:
            found.checked += 1
            try:
                _compare_tensor(name, ta, tb, sa, sb, found, atol=atol, rtol=rtol, tolerant=tolerant,
                                nan_check=nan_check)
            except BadInput as e:
                found.tolerate(e, ca, cb)
                found.differ(ta, f"unreadable: {e}", name)
            bar.update(ta.nbytes)
    return only_a, only_b


class _Side:
    """Reads rows of a logical tensor from one checkpoint, keeping the last chunk read (a DCP
    item is unpickled once, not once per block)."""

    def __init__(self, reader: Reader, views: dict | None = None) -> None:
        self.reader = reader
        self.views = views or {}  # name -> (view, quantized weight, its dequantization): values computed
        self._last: tuple[tuple[str, str], Chunk, torch.Tensor] | None = None
        self._spans: dict[int, tuple[Chunk, tuple | None]] = {}  # chunk (kept alive) -> its byte range

    def chunk(self, t: TensorInfo, c: Chunk) -> torch.Tensor:
        if self._last is not None and self._last[0] == t.key and self._last[1] is c:
            return self._last[2]
        values = self.reader.chunk(t, c)
        self._last = (t.key, c, values)
        return values

    def raw_rows(self, t: TensorInfo, start: int, stop: int) -> memoryview | None:
        """The stored bytes of rows ``[start, stop)`` when one chunk holds them as a plain byte
        range (a view of the mapped file, no torch); else None."""
        if t.name in self.views:
            return None
        for c in t.chunks:
            if t.shape and not (c.offsets[0] <= start and stop <= c.offsets[0] + c.sizes[0]
                                and c.sizes[1:] == t.shape[1:]):
                continue
            if id(c) not in self._spans:
                self._spans[id(c)] = (c, self.reader.span(t, c))
            span = self._spans[id(c)][1]
            if span is None:
                return None
            row = math.prod(t.shape[1:]) * t.dtype.itemsize if t.shape else span[2]
            first = (start - c.offsets[0]) * row if t.shape else 0
            return self.reader.raw(Location(c.location.file, "raw", span[1] + first, (stop - start) * row))
        return None

    def rows(self, t: TensorInfo, start: int, stop: int) -> torch.Tensor:
        """Rows ``[start, stop)`` of ``t`` (the whole of a 0-d tensor)."""
        import torch

        if t.name in self.views:  # a quantized weight: these rows dequantized to float32, nothing more
            return dequantized_values(self.reader, *self.views[t.name][1:], rows=(start, stop))
        if not t.shape:
            return self.chunk(t, t.chunks[0])
        for c in t.chunks:  # one chunk holds them all: a view, no copy
            if c.offsets[0] <= start and stop <= c.offsets[0] + c.sizes[0] and c.sizes[1:] == t.shape[1:]:
                return self.chunk(t, c).narrow(0, start - c.offsets[0], stop - start)
        out = torch.empty((stop - start, *t.shape[1:]), dtype=as_torch(t.dtype))
        for c in t.chunks:
            lo, hi = max(start, c.offsets[0]), min(stop, c.offsets[0] + c.sizes[0])
            if lo >= hi or not c.numel:
                continue
            dst = out.narrow(0, lo - start, hi - lo)
            for d in range(1, len(t.shape)):
                dst = dst.narrow(d, c.offsets[d], c.sizes[d])
            dst.copy_(self.chunk(t, c).narrow(0, lo - c.offsets[0], hi - lo))
        return out


def _same_bytes(sa: _Side, ta: TensorInfo, sb: _Side, tb: TensorInfo, start: int, stop: int) -> bool:
    """Rows ``[start, stop)`` are stored as equal bytes on both sides (False: not known so)."""
    a = sa.raw_rows(ta, start, stop)
    if a is None:
        return False
    b = sb.raw_rows(tb, start, stop)
    try:
        if b is None or len(a) != len(b):
            return False
        return _equal_bytes(a, b)
    finally:
        a.release()
        if b is not None:
            b.release()


def _equal_bytes(a: memoryview, b: memoryview, step: int = 1 << 20) -> bool:
    """``a == b`` for two equally long buffers, a MiB at a time, as 8-byte words where they
    divide so (numpy's loop releases the GIL; the per-step result fits in the cache)."""
    import numpy as np

    word = np.uint64 if len(a) % 8 == 0 else np.uint8
    xa, xb = np.frombuffer(a, word), np.frombuffer(b, word)
    n = step // xa.itemsize
    try:
        return all(np.array_equal(xa[i:i + n], xb[i:i + n]) for i in range(0, len(xa), n))
    finally:
        del xa, xb  # the views must go before the caller releases the mapped buffers


def _dequantized_views(ckpt: Checkpoint, found: Findings) -> dict:
    """A quantized HF checkpoint's weights as their dequantized values (float32 views, by the
    name a dequantized export writes), so that it compares with its dequantized export within a
    tolerance; {} for any other checkpoint (or one ckpt cannot dequantize: compared as stored)."""
    if ckpt.format != "hf":
        return {}
    try:
        config = hfassets.read_config(hfassets.find_assets(ckpt.root, None))
    except BadInput:  # an unreadable config: the tensors are compared as stored
        return {}
    if quant.config_of(config) is None:
        return {}
    try:
        q = quant.find(list(ckpt.tensors), config, ckpt.root)
    except BadInput as e:
        found.notes.append(f"compared as stored, not dequantized: {e}")
        return {}
    views = {}
    for t in ckpt.tensors:
        if t.name in q.weights:
            name, comp = q.weights[t.name]
            view = replace(t, name=name, shape=comp.shape, dtype=DType("float32"),
                           chunks=(Chunk((0,) * len(comp.shape), comp.shape, t.chunks[0].location),))
            views[name] = (view, t, comp)
    views[None] = q.dropped  # type: ignore[index]
    found.notes.append(f"{ckpt.root} is quantized ({q.method}): its weights compared dequantized, in float32")
    return views


def _with_views(ckpt: Checkpoint, views: dict) -> Checkpoint:
    if not views:
        return ckpt
    originals = {v[1].name for k, v in views.items() if k is not None}
    tensors = [t for t in ckpt.tensors if t.name not in views[None] and t.name not in originals]
    return replace(ckpt, tensors=tuple(tensors) + tuple(v[0] for k, v in views.items() if k is not None))


def dequantized_values(reader: Reader, weight: TensorInfo, comp, rows: tuple[int, int] | None = None) -> torch.Tensor:
    """The float32 values of a quantized weight: rows ``rows`` of its first dimension (default
    all), computed from the code and scale rows they need only (:func:`computed.values`, a few
    block-rows at a time), so that memory follows the rows asked for, not the weight."""
    target = Target(weight, weight.group, weight.name, DType("float32"), computed=comp)
    if rows is None or not comp.shape:
        return computed.values(reader, whole(target))
    return computed.values(reader, piece(target, (rows[0], *[0] * (len(comp.shape) - 1)),
                                         (rows[1] - rows[0], *comp.shape[1:])))


def _keyed(ckpt: Checkpoint, hf_mode: bool, found: Findings) -> dict[tuple[str, str], TensorInfo]:
    if not hf_mode:
        return ckpt.tensor_map()
    out: dict[tuple[str, str], TensorInfo] = {}
    for t in ckpt.group("model"):
        key = ("model", normalize_name(t.name))
        if key in out:
            found.problems.append(f"{ckpt.root}: {out[key].name!r} and {t.name!r} are both {key[1]!r} once "
                                  "wrapper prefixes are removed")
        out[key] = t
    return out


def _pairs(ca: Checkpoint, cb: Checkpoint, found: Findings):
    """(name, tensor in a, tensor in b) to compare, and the names only one side has."""
    hf_mode = "hf" in (ca.format, cb.format)
    if hf_mode and (ca.format != cb.format):
        found.notes.append("one side is hf: comparing the model only, names normalised as export writes them")
    ka, kb = _keyed(ca, hf_mode, found), _keyed(cb, hf_mode, found)
    pairs = [(key[1], ka[key], kb[key]) for key in ka if key in kb]
    only_a = [key for key in ka if key not in kb]
    only_b = [key for key in kb if key not in ka]
    head = ("model", "lm_head.weight")
    for side, mine, other, only in (("b", kb, ka, only_a), ("a", ka, kb, only_b)):
        fmt = cb.format if side == "b" else ca.format
        if head in other and head not in mine and fmt == "hf":
            # HF writes a tied lm_head once, as the input embedding: compare with that
            only.remove(head)
            embed = next((t for k, t in mine.items() if k[1].endswith(_EMBED_SUFFIXES)), None)
            if embed is None:
                found.notes.append(f"lm_head.weight is absent from {side} (hf, tied) and has no embedding to compare with")
            else:
                found.notes.append(f"lm_head.weight is absent from {side} (hf, tied): compared with {embed.name}")
                pairs.append(("lm_head.weight", other[head], embed) if side == "b" else ("lm_head.weight", embed, other[head]))
    _as_from_pretrained(ca, cb, ka, kb, only_a, only_b, pairs, found)
    name = lambda k: k[1]  # noqa: E731
    return pairs, sorted(map(name, only_a)), sorted(map(name, only_b))


def _as_from_pretrained(ca: Checkpoint, cb: Checkpoint, ka: dict, kb: dict, only_a: list, only_b: list,
                        pairs: list, found: Findings) -> None:
    """Names on one side only, seen as ``from_pretrained`` of an HF side's config sees them:
    a weight the model ties (written once by HF) is compared with the one it is tied to; one
    the model has no place for and ``from_pretrained`` ignores (what ``shard`` leaves out) is
    not compared, with a note. Anything else stays on one side only: a difference."""
    for side, ckpt, mine, only, other, others_only in (("A", ca, ka, only_a, kb, only_b),
                                                       ("B", cb, kb, only_b, ka, only_a)):
        config = _config_file(ckpt) if ckpt.format == "hf" and (only or others_only) else None
        if config is None:
            continue
        if others_only:
            # weights the model ties, which HF writes once: compared with what they are tied to
            tied = archcheck.tied_sources(config, [k[1] for k in (*mine, *others_only)])
            for key in list(others_only):
                source = ("model", tied.get(key[1], ""))
                if source in mine:
                    others_only.remove(key)
                    found.notes.append(f"{key[1]} is absent from {side.lower()} (hf, tied): compared with {source[1]}")
                    pairs.append((key[1], mine[source], other[key]) if side == "A" else
                                 (key[1], other[key], mine[source]))
        if only:
            skipped = set(ignored_on_load(config, mine, only))
            if skipped:
                only[:] = [k for k in only if k[1] not in skipped]
                names = sorted(skipped)
                found.notes.append(f"{', '.join(names)} only in {side}: from_pretrained ignores "
                                   f"{'it' if len(names) == 1 else 'them'} (the model has no place for "
                                   f"{'it' if len(names) == 1 else 'them'}), as shard and export do; not compared")


def _config_file(ckpt: Checkpoint) -> Path | None:
    assets = hfassets.find_assets(ckpt.root, None)
    return assets / "config.json" if assets is not None else None


def ignored_on_load(config_file: Path, keyed: dict[tuple[str, str], TensorInfo],
                    only: list[tuple[str, str]]) -> list[str]:
    """Of the names only an HF checkpoint holds (``keyed``: all its tensors), those
    ``from_pretrained`` of ``config_file`` skips without calling them unexpected (BERT's old
    ``embeddings.position_ids``, rotary ``inv_freq``): the rule ``shard`` drops them by
    (:func:`ckpt_tools.hf.archcheck.ignored`), asked of ``from_pretrained`` itself. A weight the
    model needs is never among them, whatever the other side lacks."""
    tensors = {k[1]: (t.shape, str(t.dtype)) for k, t in keyed.items()}
    return archcheck.ignored_of(config_file, tensors, {k[1] for k in only})


def _compare_tensor(name: str, ta: TensorInfo, tb: TensorInfo, sa: _Side, sb: _Side, found: Findings, *,
                    atol: float, rtol: float, tolerant: bool, nan_check: bool) -> None:
    if ta.shape != tb.shape:
        found.differ(ta, f"shape {ta.shape} vs {tb.shape}", name)
        return
    if ta.dtype != tb.dtype and not tolerant:
        found.differ(ta, f"dtype {dtype_name(ta.dtype)} vs {dtype_name(tb.dtype)} (pass atol/rtol to compare values)", name)
        return
    bad, worst, nonfinite = 0, 0.0, False
    for start, stop in _blocks(ta, tb):
        if not tolerant and not nan_check and _same_bytes(sa, ta, sb, tb, start, stop):
            continue  # the stored bytes are equal: no tensor (and no torch) needed
        va, vb = sa.rows(ta, start, stop), sb.rows(tb, start, stop)
        if nan_check and not (nonfinite or (finite(va) and finite(vb))):
            nonfinite = True
        if tolerant:
            n, w = _count_not_close(va, vb, atol=atol, rtol=rtol)
        else:
            n, w = _count_bit_differences(va, vb)
        bad += n
        worst = max(worst, w) if not math.isnan(w) else math.nan
    if nonfinite:
        found.nonfinite.append(name)
    if bad:
        what = "not within tolerance" if tolerant else "differ"
        found.differ(ta, f"{bad} of {ta.numel} elements {what} (max |a-b| {worst:.3g})", name)


def _blocks(ta: TensorInfo, tb: TensorInfo):
    """Row ranges that never straddle a chunk boundary of either side, at most BLOCK_BYTES each."""
    if not ta.shape:
        yield 0, 1
        return
    rows = ta.shape[0]
    row_bytes = max(1, math.prod(ta.shape[1:]) * 8)  # as float64
    step = max(1, BLOCK_BYTES // row_bytes)
    cuts = {0, rows}
    for t in (ta, tb):
        for c in t.chunks:
            cuts |= {c.offsets[0], c.offsets[0] + c.sizes[0]}
    edges = sorted(x for x in cuts if 0 <= x <= rows)
    for lo, hi in zip(edges, edges[1:]):
        for s in range(lo, hi, step):
            yield s, min(s + step, hi)


def _count_bit_differences(a: torch.Tensor, b: torch.Tensor) -> tuple[int, float]:
    import torch

    if not a.numel():
        return 0, 0.0
    size = a.element_size()
    ba = a.contiguous().reshape(-1).view(torch.uint8).view(-1, size)
    bb = b.contiguous().reshape(-1).view(torch.uint8).view(-1, size)
    differs = (ba != bb).any(dim=1)
    n = int(differs.sum())
    if not n:
        return 0, 0.0
    return n, _max_abs(a.reshape(-1)[differs], b.reshape(-1)[differs])


def _count_not_close(a: torch.Tensor, b: torch.Tensor, *, atol: float, rtol: float) -> tuple[int, float]:
    import torch

    if not a.numel():
        return 0, 0.0
    wide = torch.complex128 if (a.dtype.is_complex or b.dtype.is_complex) else torch.float64
    a64, b64 = a.to(wide), b.to(wide)
    close = torch.isclose(a64, b64, rtol=rtol, atol=atol, equal_nan=True)
    n = int((~close).sum())
    return n, (_max_abs(a64[~close], b64[~close]) if n else 0.0)


def _max_abs(a: torch.Tensor, b: torch.Tensor) -> float:
    import torch

    wide = torch.complex128 if (a.dtype.is_complex or b.dtype.is_complex) else torch.float64
    d = (a.to(wide) - b.to(wide)).abs()
    return float(d.max()) if d.numel() else 0.0


def finite(x: torch.Tensor) -> bool:
    """No NaN or Inf in ``x`` (always so for integer and empty tensors); also what
    ``verify --nan-check`` asks of a single checkpoint."""
    import torch

    if not (x.dtype.is_floating_point or x.dtype.is_complex) or not x.numel():
        return True
    if x.element_size() == 1:  # float8: isfinite has no kernel for it
        x = x.float()
    return bool(torch.isfinite(x).all())

