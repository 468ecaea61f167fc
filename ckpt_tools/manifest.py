"""The manifest: a small JSON file written last into every directory checkpoint the tool
writes, with a checksum per file (xxh3-64, which hashes faster than the disk reads), what
the source was and the tool's version. Consumers of the formats ignore it."""

from __future__ import annotations

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


def write(out: Path, *, source: str, source_format: str, format: str) -> None:
    from . import __version__

    files = {}
    for root, _, names in os.walk(out):
        for n in sorted(names):
            p = Path(root) / n
            rel = p.relative_to(out).as_posix()
            if rel != NAME:
                files[rel] = {"size": p.stat().st_size, "xxh3_64": file_digest(p)}
    manifest = {"tool": "ckpt-tools", "version": __version__, "format": format,
                "source": {"path": source, "format": source_format}, "files": dict(sorted(files.items()))}
    (out / NAME).write_text(json.dumps(manifest, indent=1) + "\n")


def read(root: Path) -> dict[str, Any] | None:
    p = root / NAME
    if not p.is_file():
        return None
    return json.loads(p.read_text())
