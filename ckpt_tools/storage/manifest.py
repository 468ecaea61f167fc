"""The manifest: a small JSON file written last into every directory checkpoint the tool
writes, with a checksum per file (xxh3-64, which hashes faster than the disk reads), what
the source was and the tool's version. Consumers of the formats ignore it."""

from __future__ import annotations

import concurrent.futures
import json
import os
from pathlib import Path
from typing import Any, NamedTuple

import xxhash

from .._version import __version__
from ..errors import BadInput
from ..security import safefs
from .diskio import Flusher, durable

NAME = ".ckpt-manifest.json"
# bytes read at a time to hash a file (into one buffer, reused): a mapping of the file would
# put its pages into this process's RSS while mapped (a 64 MiB window raised a 256-rank
# reshard's peak by its .metadata's size, and an export's by its file's); 256 KiB reads hash a
# 1 GB file from the page cache as fast as 2 MiB mappings (0.20-0.22 s)
CHUNK = 256 * 1024


def file_digest(path: Path) -> str:
    """xxh3-64 of a file."""
    return range_digest(path, 0)


def range_digest(path: Path, start: int) -> str:
    """xxh3-64 of ``path`` from byte ``start`` to its end."""
    h = xxhash.xxh3_64()
    with open(path, "rb", buffering=0) as f:
        _hash_range(f.fileno(), h, start, os.fstat(f.fileno()).st_size)
    return h.hexdigest()


def _hash_range(fd: int, h: Any, start: int, end: int) -> None:
    """Feed bytes ``start``..``end`` of ``fd`` to ``h``, :data:`CHUNK` at a time through one
    buffer. A file that ends before ``end`` raises (it was cut while hashed)."""
    buf = bytearray(min(CHUNK, max(end - start, 0)))
    view = memoryview(buf)
    pos = start
    while pos < end:
        got = os.preadv(fd, [view[:end - pos]], pos)
        if got == 0:
            raise OSError(f"the file ends at {pos:,} bytes, before the {end:,} being hashed")
        h.update(view[:got])
        pos += got


class Digest(NamedTuple):
    """A file's size and xxh3-64, as the manifest records them."""

    size: int
    xxh3_64: str


class Trailer:
    """Follows a file while it is written (through ``fd``, which it does not own): a background
    thread hashes each new byte range (read a :data:`CHUNK` at a time) and a
    :class:`~ckpt_tools.storage.diskio.Flusher` flushes the file as it grows, so at the end
    neither the checksum nor the flush waits for the whole file, as ``cp`` + ``sync`` would.
    xxh3 and fdatasync release the GIL.

    Tell it each write by :meth:`wrote`, and :meth:`finish` when the file is complete;
    ``start`` skips a prefix the digest must not cover (a header patched afterwards)."""

    def __init__(self, fd: int, *, start: int = 0, every: int = 16 << 20) -> None:
        self._fd, self._every, self._pos, self._queued, self._written = fd, every, start, start, 0
        self._hash = xxhash.xxh3_64()
        self._hasher = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="ckpt-hash")
        self._flusher = Flusher(fd, every=every)
        self._tasks: list[concurrent.futures.Future] = []

    def wrote(self, n: int) -> None:
        """``n`` more bytes were written (counted from the file's start)."""
        self._flusher.wrote(n)
        self._written += n
        if self._written - self._queued >= self._every:
            self._queued = self._written
            self._tasks.append(self._hasher.submit(self._hash_to, self._written))

    def _hash_to(self, upto: int) -> None:
        _hash_range(self._fd, self._hash, self._pos, upto)
        self._pos = max(self._pos, upto)

    def finish(self) -> Digest:
        """Hash and sync the rest; the digest of bytes ``start``..end."""
        try:
            size = os.fstat(self._fd).st_size
            self._tasks.append(self._hasher.submit(self._hash_to, size))
            self._tasks.append(self._flusher.flush())
            for t in self._tasks:
                t.result()  # a failed read or flush (EIO, ENOSPC) fails the write
            return Digest(size, self._hash.hexdigest())
        finally:
            self.close()

    def close(self) -> None:
        """Stop (after a failed write, nothing more is hashed or synced)."""
        for t in self._tasks:
            t.cancel()
        self._hasher.shutdown(wait=True)
        self._flusher.close(check=False)


class Sealer:
    """Hashes and fsyncs each finished output file in a background thread while the next one
    is written (xxh3 and fsync release the GIL), so neither waits for the end of the job.

    ``digests`` maps each sealed path to its (size, xxh3-64) for :func:`write`.
    """

    def __init__(self) -> None:
        self._pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="ckpt-seal")
        self._pending: list[tuple[Path, concurrent.futures.Future]] = []
        self.digests: dict[Path, tuple[int, str]] = {}

    def seal(self, path: Path, known: Digest | None = None) -> None:
        """Hash (unless its writer ``known`` it already) and fsync ``path`` in the background."""
        self._pending.append((path, self._pool.submit(self._seal, path, known)))

    @staticmethod
    def _seal(path: Path, known: Digest | None) -> tuple[int, str]:
        digest = known.xxh3_64 if known is not None else file_digest(path)
        fd = os.open(path, os.O_RDONLY)
        try:
            if durable():  # not a remote DST's scratch staging
                os.fsync(fd)
            size = os.fstat(fd).st_size
        finally:
            os.close(fd)
        if known is not None and known.size != size:
            digest = file_digest(path)  # changed after its writer hashed it
        return size, digest

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
          known: dict[Path, tuple[int, str]] | None = None,
          elsewhere: dict[str, tuple[int, str]] | None = None) -> None:
    """The manifest of every file under ``out``; ``known`` digests (from a :class:`Sealer`)
    are used for files whose size has not changed since. ``elsewhere``: files of the checkpoint
    written by other processes, not under ``out`` (relative name -> size, digest)."""

    known = known or {}
    files = {rel: {"size": size, "xxh3_64": digest} for rel, (size, digest) in (elsewhere or {}).items()}
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
    """The manifest of ``root`` (None without one). Raises ValueError for one that is not
    JSON, nests too deeply to parse, or is not a small regular file."""

    p = root / NAME
    if not p.exists() and not p.is_symlink():
        return None
    try:
        return json.loads(safefs.read_capped(p, safefs.MAX_JSON_BYTES))
    except RecursionError:
        raise ValueError("it nests too deeply to be a manifest") from None
    except BadInput as e:
        raise ValueError(str(e)) from None
