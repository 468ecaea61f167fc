"""The manifest: a small JSON file written last into every directory checkpoint the tool
writes, with a checksum per file (xxh3-64, which hashes faster than the disk reads), what
the source was and the tool's version. Consumers of the formats ignore it."""

from __future__ import annotations

import concurrent.futures
import json
import os
from pathlib import Path
from typing import Any

import xxhash

NAME = ".ckpt-manifest.json"
CHUNK = 8 * 1024 * 1024


def file_digest(path: Path) -> str:
    """xxh3-64 of a file."""
    return range_digest(path, 0)


def range_digest(path: Path, start: int) -> str:
    """xxh3-64 of ``path`` from byte ``start`` to its end (read in blocks: mapping the file
    would count its pages in this process's RSS)."""
    h = xxhash.xxh3_64()
    buf = bytearray(CHUNK)
    view = memoryview(buf)
    with open(path, "rb", buffering=0) as f:
        f.seek(start)
        while n := f.readinto(buf):
            h.update(view[:n])
    return h.hexdigest()


class Sealer:
    """Hashes and fsyncs each finished output file in a background thread while the next one
    is written (xxh3 and fsync release the GIL), so neither waits for the end of the job.

    ``digests`` maps each sealed path to its (size, xxh3-64) for :func:`write`.
    """

    def __init__(self) -> None:
        self._pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="ckpt-seal")
        self._pending: list[tuple[Path, concurrent.futures.Future]] = []
        self.digests: dict[Path, tuple[int, str]] = {}

    def seal(self, path: Path) -> None:
        self._pending.append((path, self._pool.submit(self._seal, path)))

    @staticmethod
    def _seal(path: Path) -> tuple[int, str]:
        digest = file_digest(path)
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
            return os.fstat(fd).st_size, digest
        finally:
            os.close(fd)

    def __enter__(self) -> Sealer:
        return self

    def __exit__(self, *exc: Any) -> None:
        try:
            for path, fut in self._pending:
                if exc[0] is None:
                    self.digests[path] = fut.result()
                else:
                    fut.cancel()
        finally:
            self._pool.shutdown(wait=True)


def write(out: Path, *, source: str, source_format: str, format: str,
          known: dict[Path, tuple[int, str]] | None = None) -> None:
    """The manifest of every file under ``out``; ``known`` digests (from a :class:`Sealer`)
    are used for files whose size has not changed since."""
    from . import __version__

    known = known or {}
    files = {}
    for root, _, names in os.walk(out):
        for n in sorted(names):
            p = Path(root) / n
            rel = p.relative_to(out).as_posix()
            if rel != NAME:
                size = p.stat().st_size
                seen = known.get(p)
                digest = seen[1] if seen is not None and seen[0] == size else file_digest(p)
                files[rel] = {"size": size, "xxh3_64": digest}
    manifest = {"tool": "ckpt-tools", "version": __version__, "format": format,
                "source": {"path": source, "format": source_format}, "files": dict(sorted(files.items()))}
    (out / NAME).write_text(json.dumps(manifest, indent=1) + "\n")


def read(root: Path) -> dict[str, Any] | None:
    p = root / NAME
    if not p.is_file():
        return None
    return json.loads(p.read_text())
