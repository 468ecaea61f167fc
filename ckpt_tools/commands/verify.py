"""``ckpt verify``: is a checkpoint intact, and do two checkpoints hold the same tensors?

One checkpoint: every file its manifest lists is there with its size and checksum, the shards
cover each tensor exactly once, and every chunk (and every saved object) can be read. Two
checkpoints, of any formats and world sizes: each is checked as above, then their tensors are
compared, bit for bit or within a tolerance, by :mod:`.compare`.

Differences and damaged files are *findings*, returned with ``ok=False`` (exit 1); only an
input that is no checkpoint at all (missing, of no known format), unsafe, inconsistent or
written by a newer release raises :class:`BadInput` (exit 3).
"""

from __future__ import annotations

import concurrent.futures
import math
import os
from pathlib import Path
from typing import Any

from ..core.describe import Checkpoint, Chunk, TensorInfo, dtype_size
from ..engine.reader import Reader
from ..engine.stream import progress_bar
from ..errors import BadInput, Damaged, UsageError
from ..formats import hf, shardtree
from ..layouts import describe
from ..formats.dcp import load_item
from ..naming.lora import summary as lora_summary
from ..security import safefs
from ..storage import manifest
from .compare import FileCheck, Findings, compare, finite
from .urls import accepts_urls


@accepts_urls(sources=("a", "b"))
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
    found = Findings()
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
                only_a, only_b = compare(ca, cb, found, atol=atol, rtol=rtol, nan_check=nan_check, progress=progress)
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

def _open(path: Path, found: Findings) -> Checkpoint | None:
    """Describe ``path``. A checkpoint that cannot be described is a finding (None) when its
    file check shows damage, or when a file of it is damaged (:class:`Damaged`: truncated,
    corrupt, a data file missing); else its BadInput propagates (no checkpoint, an unknown
    format, unsafe content, a newer torch's)."""
    try:
        return describe(path, check=True)
    except BadInput as e:
        # a file the manifest shows damaged may fail in any way, "unsafe" included: no code
        # ran, and the checksum is the better explanation
        if not found.damaged(path) and not isinstance(e, Damaged):
            raise
        found.problems.append(f"{path}: cannot be read: {e}")
        return None


def _check_files(path: Path, progress: bool) -> FileCheck:
    """Compare every file the manifest lists with its recorded size and checksum (a lone
    file: its own checksums)."""
    found = FileCheck()
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
    # files hashed in parallel (xxh3 and the reads release the GIL): the check
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


def _check_single_file(path: Path, found: FileCheck) -> bool:
    """A lone file's own checks: a torch.save zip's per-record CRC32s; the data checksum the
    tool puts in a safetensors header it wrote. True when the file is damaged."""
    import zipfile

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
        try:
            header = hf.read_raw_header(path)
        except BadInput:
            return False  # describing it reports the header
        want = header.metadata.get(hf.CHECKSUM_KEY)
        if isinstance(want, str):
            got = manifest.range_digest(path, header.data_start)
            if got != want:
                found.problems.append(f"{path}: data checksum mismatch (xxh3_64 {got}, its header says {want}); "
                                      "the file is damaged")
                return True
            found.notes.append(f"{path}: data checksum from its header checked")
            return False
    found.notes.append(f"{path}: a single file with no checksum of its own; its bytes are checked only by reading it")
    return False


# -- one checkpoint -------------------------------------------------------------------------

def _check_one(ckpt: Checkpoint, found: Findings, *, nan_check: bool, progress: bool) -> None:
    total = sum(c.numel * dtype_size(t.dtype) for t in ckpt.tensors for c in t.chunks)
    with Reader(ckpt) as reader, progress_bar(total, f"reading {ckpt.root.name}", progress) as bar:
        for t in ckpt.tensors:
            found.checked += 1
            for c in t.chunks:
                try:
                    if not nan_check and _readable(reader, t, c):
                        continue  # (the bar is updated in finally)
                    values = reader.chunk(t, c)
                    if nan_check and not finite(values):
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

    loc = o.location
    if loc.kind == "bytes_item":
        data = reader.raw(loc)
        try:
            load_item(bytes(data), where=f"{reader.ckpt.base_dir() / loc.file} ({o.name})")
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


# -- report ---------------------------------------------------------------------------------

def format_report(report: dict[str, Any], *, limit: int = 20) -> str:
    """The human-readable form of :func:`verify`'s result."""
    a, b = report["a"], report["b"]
    # a side that could not be described has no format: say that, not "None"
    head = (f"{a['path']} ({a['format'] or 'unreadable'})"
            + (f" vs {b['path']} ({b['format'] or 'unreadable'})" if b else ""))
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
