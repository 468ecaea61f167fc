"""What a writing command (``convert``, ``export``, ``reshard``, ``shard``) reports: the files it
wrote (or, with ``dry_run``, would write), its tensors, bytes and dtypes, and the ``note:`` and
``warning:`` lines it printed. The CLI prints this dict with ``--json``; the Python API returns it.

Keys added to every report (beside each command's own ``src``, ``dst``, ``format``,
``world_size``, ``num_tensors``, ``total_bytes``, ...):

- ``dry_run``: true when nothing was written (the plan only);
- ``files``: ``[{"path", "tensors", "tensor_bytes", "bytes"}]``, paths relative to DST (a
  single-file DST: its name). A real run lists every file on disk with its size (``bytes``);
  ``tensors`` and ``tensor_bytes`` are what the plan put in it (null for files outside the plan:
  indexes, ``.metadata``, the manifest, config and tokenizer). A dry run lists the plan's files
  and the config/side files it would copy; ``bytes`` is null (headers, indexes and the manifest
  are laid out while writing);
- ``written_bytes``: the sum of ``bytes`` (null in a dry run);
- ``dtypes``: ``{dtype: count}`` of the tensors written; ``dtype``: the ``--dtype`` asked for,
  else the floating-point dtype that holds most of the elements (what an HF ``config.json`` gets);
- ``notes``: the ``note:`` and ``warning:`` lines printed on stderr, without their prefix word.
"""

from __future__ import annotations

import contextlib
import io
import sys
from collections import Counter
from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path
from typing import Any

from ..core.plan import FileJob, Target

PREFIXES = ("note: ", "warning: ")


class _Tee(io.TextIOBase):
    """Passes everything through to ``stream``; keeps the ``note:``/``warning:`` lines."""

    def __init__(self, stream: Any, lines: list[str]) -> None:
        self._stream, self._lines, self._partial = stream, lines, ""

    def write(self, s: str) -> int:
        n = self._stream.write(s)
        self._partial += s
        *done, self._partial = self._partial.split("\n")
        for line in done:
            line = line.rsplit("\r", 1)[-1]  # after a progress bar's carriage return
            if line.startswith(PREFIXES):
                self._lines.append(line)
        return n if n is not None else len(s)

    def flush(self) -> None:
        self._stream.flush()

    def isatty(self) -> bool:
        return self._stream.isatty()

    def fileno(self) -> int:
        return self._stream.fileno()

    @property
    def encoding(self) -> str:  # type: ignore[override]
        return getattr(self._stream, "encoding", "utf-8")


@contextlib.contextmanager
def recording_notes() -> Iterator[list[str]]:
    """The ``note:``/``warning:`` lines printed on stderr inside the block (still printed). A
    block inside another records into the outer list only (one report, one list)."""
    if isinstance(sys.stderr, _Tee):
        yield sys.stderr._lines
        return
    lines: list[str] = []
    real = sys.stderr
    sys.stderr = _Tee(real, lines)
    try:
        yield lines
    finally:
        sys.stderr = real


def written_dtype(targets: Iterable[Target], cast: str | None = None) -> str | None:
    """``cast`` when given, else the floating-point dtype holding most elements (None: none)."""
    if cast:
        return str(cast)
    numel: Counter = Counter()
    for t in targets:
        if t.dtype.is_floating_point:
            numel[str(t.dtype)] += t.numel
    return numel.most_common(1)[0][0] if numel else None


def planned_files(jobs: Sequence[FileJob]) -> dict[str, tuple[int, int]]:
    """Each file of a plan: its (tensors, tensor bytes), for the report (taken before the plan
    is handed to the engine, which may let its pieces go as it writes)."""
    return {j.path: (j.tensors(), j.nbytes) for j in jobs}


def summary(dst: Path, jobs: Sequence[FileJob], targets: Sequence[Target], *, dry_run: bool,
            cast: str | None = None, extra_files: Iterable[str] = (),
            planned: dict[str, tuple[int, int]] | None = None) -> dict[str, Any]:
    """The report's ``files``, ``written_bytes``, ``dtypes`` and ``dtype`` for a plan of
    ``jobs`` writing ``targets`` into ``dst`` (read from disk after a real run); ``planned``:
    :func:`planned_files` of ``jobs``, taken before they were carried out."""
    planned = planned_files(jobs) if planned is None else planned
    targets = list({(t.group, t.name): t for t in targets}.values())  # a tensor in several pieces: once
    return {**files_report(dst, planned, dry_run=dry_run, extra_files=extra_files),
            "dtypes": dict(sorted(Counter(str(t.dtype) for t in targets).items())),
            "dtype": written_dtype(targets, cast)}


def files_report(dst: Path, planned: dict[str, tuple[int | None, int | None]], *, dry_run: bool,
                 extra_files: Iterable[str] = ()) -> dict[str, Any]:
    """The report's ``files`` and ``written_bytes``: ``planned`` maps a file of the plan to its
    (tensors, tensor bytes); a real run lists what is on disk at ``dst`` instead."""
    files: dict[str, dict[str, Any]] = {}
    for path, (n, size) in planned.items():
        files[path] = {"path": path, "tensors": n, "tensor_bytes": size, "bytes": None}
    if dry_run:
        for rel in extra_files:
            files.setdefault(rel, {"path": rel, "tensors": None, "tensor_bytes": None, "bytes": None})
    else:
        for rel, size in on_disk(dst):
            files.setdefault(rel, {"path": rel, "tensors": None, "tensor_bytes": None, "bytes": None})["bytes"] = size
        files = {k: v for k, v in files.items() if v["bytes"] is not None}
    listed = sorted(files.values(), key=lambda f: f["path"])
    return {"files": listed, "written_bytes": None if dry_run else sum(f["bytes"] for f in listed)}


def on_disk(dst: Path) -> list[tuple[str, int]]:
    """Every regular file at ``dst`` (a file: its name) with its size, paths relative to DST."""
    dst = Path(dst)
    if dst.is_file():
        return [(dst.name, dst.stat().st_size)]
    if not dst.is_dir():
        return []
    return sorted((p.relative_to(dst).as_posix(), p.stat().st_size) for p in dst.rglob("*") if p.is_file())


def finish(report: dict[str, Any], notes: list[str], *, dry_run: bool) -> dict[str, Any]:
    """``report`` with ``dry_run`` and ``notes`` (prefix words dropped) set."""
    report["dry_run"] = dry_run
    report["notes"] = [n.split(": ", 1)[1] if n.startswith(PREFIXES) else n for n in notes]
    return report
