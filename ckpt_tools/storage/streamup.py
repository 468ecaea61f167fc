"""A remote destination's files uploaded while they are written: each output file the engine
writes into the local staging tree is followed by a thread that sends it as a multipart
upload, one part as soon as the writer has produced that many bytes, so the upload of the
output overlaps the download of the source and the writing.

Nothing of it is visible before the checkpoint is published: a multipart upload is invisible
to listings until it is completed, and :func:`~ckpt_tools.storage.remote.publish` completes
them in its marker-last order, after its checks (an existing DST refused, old markers removed
first), as it uploaded the files before. Every part is exact: before publish changes anything
(:meth:`Streaming.settle`) every part is in, hashed again from the finished file (xxh3-128) and
sent again if the file changed under it (a writer that patched a header after writing); a file
whose final size does not fit the parts sent is uploaded whole instead. On any failure before
publishing, Ctrl-C or SIGTERM the uploads begun are aborted (the store drops their parts) and
the lease removed; a killed process leaves them to ``ckpt clean``, which its lease (``"phase":
"parts"``: nothing published yet) tells to keep what was there. A publish cut short leaves its
lease, as before.

Memory: at most ``PART_CONCURRENCY`` parts read and in flight, whatever the number of files.
Files under one part and stores without multipart uploads are uploaded at publish, as before.
"""

from __future__ import annotations

import contextlib
import os
import tempfile
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import xxhash

from ..errors import CkptError
from .objstore import PART_BYTES, PART_CONCURRENCY, Store

MAX_PARTS = 10_000  # S3's limit on one upload's parts
POLL = 0.01  # seconds between looks at a file's size while it is written


@dataclass
class _Part:
    number: int
    start: int
    length: int
    digest: bytes
    fut: Any  # concurrent.futures.Future of the ETag


@dataclass
class _Upload:
    rel: str
    part: int  # part size
    upload_id: str | None = None
    parts: list[_Part] = field(default_factory=list)
    error: BaseException | None = None
    given_up: bool = False  # left to publish (small, or more parts than the store takes)
    thread: threading.Thread | None = None
    done: threading.Event = field(default_factory=threading.Event)


class Streaming:
    """The uploads of one remote destination whose local staging is ``local``. Registered
    (``with``), the engine finds it (:func:`follower`) and :meth:`follow`\\ s each file it writes."""

    def __init__(self, store: Store, local: Path) -> None:
        self.store, self.local = store, Path(local)
        self.active = store.can_stream()
        self.leased = False
        self.published = False
        self.publishing = False
        self._uploads: dict[str, _Upload] = {}
        self._ready: dict[str, tuple[str, list[tuple[int, str]]]] = {}  # settled: upload id, parts
        self._slots = threading.BoundedSemaphore(PART_CONCURRENCY)
        self._stop = threading.Event()
        self._lock = threading.Lock()

    # -- registered under the local path the command writes to ----------------------------------
    def __enter__(self) -> Streaming:
        with _LOCK:
            _STREAMS[os.path.abspath(self.local)] = self
        return self

    def __exit__(self, *exc: object) -> None:
        with _LOCK:
            _STREAMS.pop(os.path.abspath(self.local), None)
        self.abort()

    # -- following a file as it is written -------------------------------------------------------
    @contextlib.contextmanager
    def follow(self, path: Path, rel: str, expected: int) -> Iterator[None]:
        """Upload ``path`` (object ``rel``, about ``expected`` bytes) part by part while the
        body writes it; once the body returns, its last parts are sent in the background."""
        self.check()
        part = PART_BYTES
        while expected > part * (MAX_PARTS - 1000):
            part *= 2
        up = _Upload(rel, part)
        old = self._uploads.get(rel)
        if old is not None:  # written again (a retried file): its earlier upload is void
            self._discard(old)
        self._uploads[rel] = up
        up.thread = threading.Thread(target=self._run, args=(up, Path(path)), name="ckpt-upload", daemon=True)
        up.thread.start()
        try:
            yield
        except BaseException:
            up.given_up = True
            up.done.set()
            raise
        up.done.set()

    def check(self) -> None:
        """Raise the first failure of an upload so far (the command stops early)."""
        for up in list(self._uploads.values()):
            if up.error is not None:
                raise up.error

    def _run(self, up: _Upload, path: Path) -> None:
        fd = None  # held: the staging directory is renamed into place while the last parts go
        try:
            at = 0
            while not self._stop.is_set():
                finished = up.done.is_set()  # before the size: a finished file's size is its last
                if fd is None:
                    with contextlib.suppress(FileNotFoundError):
                        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
                size = os.fstat(fd).st_size if fd is not None else 0
                if up.given_up or (finished and up.upload_id is None and size < up.part):
                    up.given_up = True  # small: uploaded at publish
                    return
                while size - at >= up.part or (finished and up.upload_id is not None and at < size):
                    if len(up.parts) >= MAX_PARTS:
                        up.given_up = True
                        return
                    if not self._send(up, fd, at, min(up.part, size - at)):
                        break  # shorter than its size said (rewritten): looked at again
                    at += up.parts[-1].length
                if finished and at >= size:
                    return
                up.done.wait(POLL)
        except BaseException as e:  # noqa: BLE001 - raised in the command's thread (check, publish)
            up.error = e
        finally:
            if fd is not None:
                os.close(fd)

    def _send(self, up: _Upload, fd: int, start: int, length: int) -> bool:
        if up.upload_id is None:
            if up.rel:  # a prefix's lease (one object named by the URL has none, as publish gives it none)
                self._lease()
            up.upload_id = self.store.start_upload(up.rel)
        while not self._slots.acquire(timeout=0.2):
            if self._stop.is_set():
                raise CkptError("stopped")
            self.check()
        try:
            data = _pread(fd, start, length)
        except BaseException:
            self._slots.release()
            raise
        if len(data) < length:
            self._slots.release()
            return False
        number = len(up.parts) + 1
        fut = self.store.send_part(up.rel, up.upload_id, number, data)
        fut.add_done_callback(lambda _: self._slots.release())
        up.parts.append(_Part(number, start, length, xxhash.xxh3_128_digest(data), fut))
        return True

    def _lease(self) -> None:
        """Before the first part: the prefix's lease (``clean`` keeps a live run's uploads), marked
        as holding parts only (a dead run's ``clean`` then removes only it and the parts)."""
        with self._lock:
            if not self.leased:
                write_lease(self.store, phase="parts")
                self.leased = True

    # -- publishing --------------------------------------------------------------------------------
    def settle(self, local: Path) -> None:
        """Before publishing changes anything: wait until every part of the finished tree
        ``local`` is in, each checked against the file as it is now (any that changed sent
        again); a failed part raises here (nothing under DST changed yet but the lease)."""
        for rel, up in list(self._uploads.items()):
            if up.thread is not None:
                up.thread.join()
            if up.error is not None:
                raise up.error
            if up.upload_id is None:
                continue
            parts = self._checked(up, local / rel if rel else local)
            if parts is None:
                self._discard(up)  # uploaded whole by publish
            else:
                self._ready[rel] = (up.upload_id, parts)

    def complete(self, rels: list[str]) -> set[str]:
        """Complete the settled uploads of files ``rels``: each object appears whole, at once;
        the names completed. The others (small, never streamed, or no longer fitting their
        parts) are the caller's to upload."""
        ready = [(rel, *self._ready[rel]) for rel in rels if rel in self._ready]
        self.store.complete_uploads(ready)
        for rel, _, _ in ready:
            self._ready.pop(rel)
            self._uploads.pop(rel)
        return {rel for rel, _, _ in ready}

    def _checked(self, up: _Upload, path: Path) -> list[tuple[int, str]] | None:
        """The parts of ``up`` as ``(number, ETag)`` once each holds what ``path`` holds now;
        None when the file no longer fits the parts sent (not given up: uploaded whole)."""
        if up.given_up:
            return None
        try:
            size = path.stat().st_size
        except FileNotFoundError:  # not part of the finished tree
            return None
        if not up.parts or up.parts[-1].start + up.parts[-1].length != size:
            return None
        out = []
        for p in up.parts:
            etag = self.store.part_result(up.rel, p.fut)
            data = _read(path, p.start, p.length)
            if xxhash.xxh3_128_digest(data) != p.digest:  # changed after it was sent: sent again
                p.digest = xxhash.xxh3_128_digest(data)
                p.fut = self.store.send_part(up.rel, up.upload_id, p.number, data)
                etag = self.store.part_result(up.rel, p.fut)
            out.append((p.number, etag))
        return out

    def _discard(self, up: _Upload) -> None:
        up.given_up = True
        up.done.set()
        if up.thread is not None and up.thread is not threading.current_thread():
            up.thread.join()
        for p in up.parts:
            p.fut.cancel()
        for p in up.parts:
            with contextlib.suppress(BaseException):
                p.fut.result(timeout=60)
        if up.upload_id is not None:
            bucket_key = self.store._bucket_key(up.rel)[1]
            self.store.abort_uploads([{"Key": bucket_key, "UploadId": up.upload_id}])
            up.upload_id = None
        self._uploads.pop(up.rel, None)

    def abort(self) -> None:
        """Stop following, abort every upload not completed; remove the lease unless publishing
        began (a publish cut short leaves it, for ``ckpt clean`` to remove what it made visible)."""
        self._stop.set()
        for up in list(self._uploads.values()):
            up.done.set()
        left = []
        for up in list(self._uploads.values()):
            try:
                self._discard(up)
            except (CkptError, OSError):
                left.append(up.rel)
        if left:
            import sys

            print(f"note: {len(left)} unfinished upload(s) under {self.store.url} could not be aborted; "
                  f"`ckpt clean {self.store.url}` removes them", file=sys.stderr)
        if self.leased and not self.publishing:  # nothing published: the prefix is as it was
            with contextlib.suppress(CkptError, OSError):
                self.store.delete([LEASE])
            self.leased = False


LEASE = ".ckpt-writing"  # present under a prefix from the first part ckpt sends there until it has published


def write_lease(store: Store, *, phase: str | None = None) -> None:
    """Mark the prefix as being written by this process (host and pid), before any data;
    ``phase="parts"``: only unfinished multipart uploads so far, the prefix otherwise as it was."""
    import json
    import socket

    with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as f:
        json.dump({"host": socket.gethostname(), "pid": os.getpid(), **({"phase": phase} if phase else {})}, f)
    try:
        store.upload([(f.name, LEASE)])
    finally:
        os.unlink(f.name)


def _pread(fd: int, start: int, length: int) -> bytes:
    """Bytes ``[start, start + length)`` of ``fd`` (fewer at its end)."""
    chunks, at, end = [], start, start + length
    while at < end:
        b = os.pread(fd, end - at, at)
        if not b:
            break
        chunks.append(b)
        at += len(b)
    return chunks[0] if len(chunks) == 1 else b"".join(chunks)


def _read(path: Path, start: int, length: int) -> bytes:
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        return _pread(fd, start, length)
    finally:
        os.close(fd)


_LOCK = threading.Lock()
_STREAMS: dict[str, Streaming] = {}


def follower(dst: str | os.PathLike) -> Callable[[Path, str, int], contextlib.AbstractContextManager] | None:
    """For a write to ``dst`` inside a registered remote destination's staging: a function
    ``(file written, its name relative to dst ("" for dst itself), expected size)`` giving the
    context to write it in; None for a local destination (or a store without multipart uploads)."""
    p = os.path.abspath(dst)
    with _LOCK:
        found = [(root, s) for root, s in _STREAMS.items() if p == root or p.startswith(root + os.sep)]
    if not found or not found[0][1].active:
        return None
    root, streaming = found[0]
    base = os.path.relpath(p, root).replace(os.sep, "/") if p != root else ""

    def follow(path: Path, rel: str, expected: int) -> contextlib.AbstractContextManager:
        return streaming.follow(path, "/".join(x for x in (base, rel) if x), expected)

    return follow
