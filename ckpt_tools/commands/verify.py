"""``ckpt verify``: is a checkpoint intact, and do two checkpoints hold the same tensors?

One checkpoint: every file its manifest lists is there with its size and checksum, the shards
cover each tensor exactly once, and every chunk (and every saved object) can be read. Two
checkpoints, of any formats and world sizes: the same tensors, bit for bit or within a
tolerance. Tensors are compared a block of rows at a time, so memory stays near the largest
stored chunk whatever the model's size.

Differences and damaged files are *findings*, returned with ``ok=False``; only an input that
cannot be described at all (and whose damage no manifest explains) raises :class:`BadInput`.
"""

from __future__ import annotations

import concurrent.futures
import math
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ..storage import manifest
from ..security import safefs
from .convert import normalize_name
from ..core.describe import Checkpoint, Chunk, Location, TensorInfo, dtype_name, dtype_size
from ..core.dtypes import as_torch
from ..engine.execute import progress_bar
from ..errors import BadInput, UnsafeInput, UsageError
from ..formats import describe
from ..engine.reader import Reader

if TYPE_CHECKING:
    import torch

# rows compared at once: bounds the float64 copies a tolerance check makes
BLOCK_BYTES = 32 * 1024 * 1024
_EMBED_SUFFIXES = ("embed_tokens.weight", "wte.weight", "word_embeddings.weight")


@dataclass
class _Findings:
    problems: list[str] = field(default_factory=list)
    differences: list[dict[str, str]] = field(default_factory=list)
    nonfinite: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    checked: int = 0
    # each checkpoint's file check (manifest checksums), running beside the reads: a checkpoint
    # whose files are damaged explains whatever reading it raises next, "unsafe" included (no
    # code runs either way), which is then a finding
    files: dict[Path, concurrent.futures.Future[_FileCheck]] = field(default_factory=dict)

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
class _FileCheck:
    """What checking a checkpoint's files against its manifest found."""

    problems: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)


def verify(a: str | Path, b: str | Path | None = None, *, atol: float = 0.0, rtol: float = 0.0,
           nan_check: bool = False, progress: bool = True) -> dict[str, Any]:
    """Check the checkpoint ``a``, or compare ``a`` with ``b``; never raises for a difference.

    Alone: manifest sizes and xxh3 checksums (directories the tool wrote carry one), shard
    coverage, and a read of every chunk and saved object. With ``b``: both are checked as
    above, then every tensor is compared, keyed by (group, name), bit for bit (same dtype, same
    bytes) or, when ``atol``/``rtol`` is given, as ``|a - b| <= atol + rtol * |b|`` in float64
    (dtypes may then differ). Against an ``hf`` checkpoint only the model is compared, with
    wrapper prefixes (``_orig_mod.``, ``module.``) removed as ``export`` does, and an ``lm_head``
    that HF leaves out because it is tied is compared with the embedding instead.
    ``nan_check`` also flags tensors holding NaN or Inf.

    Returns ``{"ok", "checked", "mismatches", "problems", "differences", "only_in_a",
    "only_in_b", "nonfinite", "notes", "a", "b", "atol", "rtol"}``: ``checked`` counts the
    tensors read (one checkpoint) or compared (two); ``mismatches`` names every tensor that
    differs, is on one side only, cannot be read or (with ``nan_check``) is not finite;
    ``problems`` lists damaged or missing files.

    Example: ``ckpt_tools.verify("ckpt/actor", "hf_out", atol=1e-2)["ok"]``

    Limits: saved objects (param_groups, LR scheduler, RNG state) are read, not compared;
    a single-file checkpoint (``.pt``, ``.safetensors``) has no manifest, so damage inside its
    tensor data shows only against another copy.
    """
    if not (isinstance(atol, (int, float)) and atol >= 0 and math.isfinite(atol)):
        raise UsageError(f"--atol must be a finite number >= 0, not {atol!r}")
    if not (isinstance(rtol, (int, float)) and rtol >= 0 and math.isfinite(rtol)):
        raise UsageError(f"--rtol must be a finite number >= 0, not {rtol!r}")
    found = _Findings()
    roots = [Path(a)] if b is None else [Path(a), Path(b)]
    only_a: list[str] = []
    only_b: list[str] = []
    # the files are checked against their manifests while the tensors are read and compared:
    # both read the same pages, once from the disk, and the two use both cores
    with concurrent.futures.ThreadPoolExecutor(len(roots), thread_name_prefix="ckpt-files") as pool:
        for root in roots:
            found.files.setdefault(root, pool.submit(_check_files, root, progress))
        try:
            ca = _open(Path(a), found)
            cb = _open(Path(b), found) if b is not None else None
            if b is None:
                if ca is not None:
                    _check_one(ca, found, nan_check=nan_check, progress=progress)
            elif ca is not None and cb is not None:
                only_a, only_b = _compare(ca, cb, found, atol=atol, rtol=rtol, nan_check=nan_check, progress=progress)
        finally:
            checks = [found.files[root].result() for root in dict.fromkeys(roots)]
    found.problems[:0] = [p for c in checks for p in c.problems]  # the files' state first, as they explain the rest
    found.notes[:0] = [n for c in checks for n in c.notes]
    mismatches = sorted({d["name"] for d in found.differences} | set(only_a) | set(only_b) | set(found.nonfinite))
    return {
        "ok": not found.problems and not mismatches,
        "checked": found.checked,
        "mismatches": mismatches,
        "problems": found.problems,
        "differences": found.differences,
        "only_in_a": only_a,
        "only_in_b": only_b,
        "nonfinite": sorted(set(found.nonfinite)),
        "notes": found.notes,
        "a": _summary(a, ca),
        "b": _summary(b, cb) if b is not None else None,
        "atol": atol,
        "rtol": rtol,
    }


def _summary(path: str | Path, ckpt: Checkpoint | None) -> dict[str, Any]:
    if ckpt is None:
        return {"path": str(path), "format": None, "world_size": None, "num_tensors": None}
    from .inspect import lora_summary

    return {"path": str(path), "format": ckpt.format, "world_size": ckpt.world_size, "num_tensors": len(ckpt.tensors),
            "lora": lora_summary(ckpt)}


def _what(side: dict[str, Any]) -> str:
    """What a checkpoint holds, when "OK" alone would mislead (a LoRA adapter is no model)."""
    lora = side.get("lora")
    if not lora:
        return ""
    if lora.get("adapter_only"):
        return (f" - PEFT LoRA adapter weights only (rank {lora['rank']}, {', '.join(lora['target_modules'])}), "
                "not a model: load it with its base model, or `ckpt export --lora adapter` / `--base MODEL`")
    return f" - a base model with a PEFT LoRA adapter (rank {lora['rank']}, {', '.join(lora['target_modules'])})"


# -- files ----------------------------------------------------------------------------------

def _open(path: Path, found: _Findings) -> Checkpoint | None:
    """Describe ``path``. A checkpoint that cannot be described is a finding (None) when its
    file check shows damage, else its BadInput propagates."""
    try:
        return describe(path, check=True)
    except BadInput as e:
        # a file the manifest shows damaged may fail in any way, "unsafe" included: no code
        # ran, and the checksum is the better explanation
        if not found.damaged(path):
            raise
        found.problems.append(f"{path}: cannot be read: {e}")
        return None


def _check_files(path: Path, progress: bool) -> _FileCheck:
    """Compare every file the manifest lists with its recorded size and checksum (a lone
    file: its own checksums)."""
    found = _FileCheck()
    if not path.is_dir():
        if path.is_file():
            _check_single_file(path, found)
        return found
    try:
        m = manifest.read(path)
    except (OSError, ValueError) as e:
        found.problems.append(f"{path / manifest.NAME}: unreadable manifest ({e}); the checkpoint may be damaged")
        return found
    if m is None:
        found.notes.append(f"{path}: no {manifest.NAME} (not written by ckpt); file checksums not checked")
        return found
    files = m.get("files") if isinstance(m, dict) else None
    if not isinstance(files, dict):
        found.problems.append(f"{path / manifest.NAME}: malformed manifest (no 'files' object)")
        return found
    todo = []
    for rel, entry in sorted(files.items()):
        full = path / rel
        try:
            safefs.resolve_inside(path, rel, what=str(path / manifest.NAME))
            inside = True
        except BadInput:
            inside = False
        if not isinstance(entry, dict) or not isinstance(entry.get("size"), int) or not isinstance(entry.get("xxh3_64"), str):
            found.problems.append(f"{path / manifest.NAME}: malformed entry for {rel!r}")
        elif not inside:
            found.problems.append(f"{path / manifest.NAME}: names {rel!r}, outside the checkpoint directory")
        elif not full.is_file():
            found.problems.append(f"{full}: missing (the manifest lists it); the checkpoint is incomplete")
        elif full.stat().st_size != entry["size"]:
            found.problems.append(f"{full}: size mismatch: {full.stat().st_size} bytes, the manifest says "
                                  f"{entry['size']}; truncated or overwritten")
        else:
            todo.append((full, entry["xxh3_64"]))
    # files hashed in parallel (xxh3 over the mapped page cache releases the GIL): the check
    # runs at the speed of reading the bytes once
    workers = max(1, min(len(todo), os.cpu_count() or 1, 8))
    with progress_bar(sum(f.stat().st_size for f, _ in todo), f"checksums {path.name}", progress) as bar, \
            concurrent.futures.ThreadPoolExecutor(workers, thread_name_prefix="ckpt-verify") as pool:
        for (full, digest), got in zip(todo, pool.map(manifest.file_digest, [f for f, _ in todo])):
            if got != digest:
                found.problems.append(f"{full}: checksum mismatch (xxh3_64 {got}, the manifest says {digest}); "
                                      "the file is damaged")
            bar.update(full.stat().st_size)
    return found


def _check_single_file(path: Path, found: _FileCheck) -> bool:
    """A lone file's own checks: a torch.save zip's per-record CRC32s; the data checksum the
    tool puts in a safetensors header it wrote. True when the file is damaged."""
    import json
    import struct
    import zipfile

    from ..formats import hf

    with open(path, "rb") as f:
        magic = f.read(8)
    if magic[:4] == b"PK\x03\x04":
        try:
            with zipfile.ZipFile(path) as z:
                bad = z.testzip()
        except (zipfile.BadZipFile, OSError, ValueError, EOFError) as e:
            found.problems.append(f"{path}: damaged zip structure ({e})")
            return True
        if bad is not None:
            found.problems.append(f"{path}: record {bad!r} fails its CRC32 check; the file is damaged")
            return True
        found.notes.append(f"{path}: every record's CRC32 checked")
        return False
    if path.suffix == ".safetensors" and len(magic) == 8:
        (n,) = struct.unpack("<Q", magic)
        try:
            with open(path, "rb") as f:
                f.seek(8)
                meta = json.loads(f.read(min(n, hf.MAX_HEADER_BYTES))).get("__metadata__") or {}
        except (ValueError, AttributeError, RecursionError):
            return False  # describing it reports the header
        want = meta.get(hf.CHECKSUM_KEY) if isinstance(meta, dict) else None
        if isinstance(want, str):
            got = manifest.range_digest(path, 8 + n)
            if got != want:
                found.problems.append(f"{path}: data checksum mismatch (xxh3_64 {got}, its header says {want}); "
                                      "the file is damaged")
                return True
            found.notes.append(f"{path}: data checksum from its header checked")
            return False
    found.notes.append(f"{path}: a single file with no checksum of its own; its bytes are checked only by reading it")
    return False


# -- one checkpoint -------------------------------------------------------------------------

def _check_one(ckpt: Checkpoint, found: _Findings, *, nan_check: bool, progress: bool) -> None:
    total = sum(c.numel * dtype_size(t.dtype) for t in ckpt.tensors for c in t.chunks)
    with Reader(ckpt) as reader, progress_bar(total, f"reading {ckpt.root.name}", progress) as bar:
        for t in ckpt.tensors:
            found.checked += 1
            for c in t.chunks:
                try:
                    if not nan_check and _readable(reader, t, c):
                        continue  # (the bar is updated in finally)
                    values = reader.chunk(t, c)
                    if nan_check and not _finite(values):
                        found.nonfinite.append(t.name)
                except BadInput as e:
                    found.tolerate(e, ckpt)
                    found.differ(t, f"unreadable: {e}")
                    break
                finally:
                    bar.update(c.numel * dtype_size(t.dtype))
        for o in ckpt.objects:
            try:
                if not _object_readable(reader, o):
                    reader.object(o)
            except BadInput as e:
                found.tolerate(e, ckpt)


def _readable(reader: Reader, t: TensorInfo, c: Chunk) -> bool:
    """Whether a chunk is known to read as its tensor without loading it (so without torch):
    a raw byte range of exactly its size inside its file (its bytes are what the manifest's
    checksum covers), or a DCP item whose pickle is a plain tensor that fits its storage record.
    False: read it the full way."""
    loc = c.location
    if loc.kind == "raw":
        if loc.length != c.numel * t.dtype.itemsize:
            return False
        reader.raw(loc).release()  # raises BadInput when the range runs past the file's end
        return True
    if loc.kind == "torch_item":
        return reader.span(t, c) is not None
    return False


def _object_readable(reader: Reader, o: Any) -> bool:
    """Whether a saved object reads without torch: a DCP item holding plain data (read as a
    pickle tree), or an entry of a torch.save file that parses as an inert tree (allowlisted
    globals only). False: load it with torch's weights_only loader, which refuses or explains."""
    from ..formats import shardtree
    from ..formats.dcp import _load_item

    loc = o.location
    if loc.kind == "bytes_item":
        data = reader.raw(loc)
        try:
            _load_item(bytes(data), where=f"{reader.ckpt.base_dir() / loc.file} ({o.name})")
        finally:
            data.release()
        return True
    if loc.kind == "pickled" and loc.key:
        try:
            tree = shardtree.parsed(reader.ckpt.base_dir() / loc.file).tree
            for k in loc.key:
                tree = tree[k]
        except (BadInput, KeyError, IndexError, TypeError, OSError):
            return False
        return True
    return False


def _finite(x: torch.Tensor) -> bool:
    import torch

    if not (x.dtype.is_floating_point or x.dtype.is_complex) or not x.numel():
        return True
    if x.element_size() == 1:  # float8: isfinite has no kernel for it
        x = x.float()
    return bool(torch.isfinite(x).all())


# -- two checkpoints ------------------------------------------------------------------------

class _Side:
    """Reads rows of a logical tensor from one checkpoint, keeping the last chunk read (a DCP
    item is unpickled once, not once per block)."""

    def __init__(self, reader: Reader) -> None:
        self.reader = reader
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


def _keyed(ckpt: Checkpoint, hf_mode: bool, found: _Findings) -> dict[tuple[str, str], TensorInfo]:
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


def _pairs(ca: Checkpoint, cb: Checkpoint, found: _Findings):
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
    name = lambda k: k[1]  # noqa: E731
    return pairs, sorted(map(name, only_a)), sorted(map(name, only_b))


def _compare(ca: Checkpoint, cb: Checkpoint, found: _Findings, *, atol: float, rtol: float,
             nan_check: bool, progress: bool) -> tuple[list[str], list[str]]:
    pairs, only_a, only_b = _pairs(ca, cb, found)
    tolerant = atol > 0 or rtol > 0
    total = sum(ta.nbytes for _, ta, _ in pairs)
    with Reader(ca) as ra, Reader(cb) as rb, progress_bar(total, "comparing", progress) as bar:
        sa, sb = _Side(ra), _Side(rb)
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


def _compare_tensor(name: str, ta: TensorInfo, tb: TensorInfo, sa: _Side, sb: _Side, found: _Findings, *,
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
        if nan_check and not (nonfinite or (_finite(va) and _finite(vb))):
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


# -- report ---------------------------------------------------------------------------------

def format_report(report: dict[str, Any], *, limit: int = 20) -> str:
    """The human-readable form of :func:`verify`'s result."""
    a, b = report["a"], report["b"]
    head = f"{a['path']} ({a['format']})" + (f" vs {b['path']} ({b['format']})" if b else "")
    verdict = "OK" if report["ok"] else "FAILED"
    what = "compared" if b else "read"
    lines = [f"{head}: {verdict}, {report['checked']} tensors {what}{'' if b else _what(a)}"]
    if b and (report["atol"] or report["rtol"]):
        lines.append(f"  tolerance: atol {report['atol']:g}, rtol {report['rtol']:g}")
    for p in report["problems"][:limit]:
        lines.append(f"  problem: {p}")
    for d in report["differences"][:limit]:
        lines.append(f"  differs: {d['name']}: {d['reason']}")
    for side in ("a", "b"):
        names = report[f"only_in_{side}"]
        if names:
            lines.append(f"  only in {side.upper()} ({len(names)}): " + ", ".join(names[:limit])
                         + (" ..." if len(names) > limit else ""))
    if report["nonfinite"]:
        lines.append("  NaN/Inf in: " + ", ".join(report["nonfinite"][:limit]))
    hidden = max(0, len(report["problems"]) - limit) + max(0, len(report["differences"]) - limit)
    if hidden:
        lines.append(f"  ... and {hidden} more (use --json for all)")
    for n in report["notes"]:
        lines.append(f"  note: {n}")
    return "\n".join(lines)
