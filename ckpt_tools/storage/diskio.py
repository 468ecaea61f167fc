"""How the writers' bytes reach the disk: writes in small slices, kernel copies in steps, and
a flush that follows the file while it grows.

- A ``write`` of many MiB makes the kernel allocate large page-cache folios, and fresh
  high-order pages come slow on a virtual machine: writing 1.3 GiB took 0.5-3.2 s of system
  time in 8 MiB writes and 0.3-0.5 s in 256 KiB ones here (``cp`` copies in 64 KiB steps).
- A file flushed only at the end (``cp`` + ``sync``, or the commit's fsync) waits for the
  whole disk write after the copy; :class:`Flusher` has the disk write what is done while the
  rest is still being copied, so the commit's fsync finds little left.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import errno
import os
from collections.abc import Iterator
from typing import Any, Protocol

from ..errors import BadInput

WRITE_BYTES = 256 << 10  # one write() at most
COPY_BYTES = 32 << 20  # one copy_file_range() at most: a flush can follow each step
_NO_KERNEL_COPY = (errno.EXDEV, errno.ENOSYS, errno.EINVAL, errno.EOPNOTSUPP)


_scratch = 0  # > 0 while the files written are scratch (see scratch())


@contextlib.contextmanager
def scratch() -> Iterator[None]:
    """While the body runs, the files this process writes are scratch: the local staging of a
    remote DST, uploaded from the page cache, whose durable copy is the object store's. No
    flush or fsync waits for the disk (:func:`durable` is False); its atomic rename stays."""
    global _scratch
    _scratch += 1
    try:
        yield
    finally:
        _scratch -= 1


def open_files_cap() -> int:
    """Source files a reader or writer keeps open at once: a quarter of what the process may
    open. A job's pieces visit every source file in turn (each tensor's rows lie in all of a
    many-rank job's files), so a cap under the file count reopens a file per piece: 64 made a
    256-rank DCP's conversion open a file for most of its 74k items."""
    try:
        import resource

        soft = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
        if soft == resource.RLIM_INFINITY:
            soft = 1 << 16
    except (ImportError, OSError, ValueError):  # (no such limit where resource is missing)
        soft = 1024
    return max(64, min(soft, 1 << 16) // 4)


def durable() -> bool:
    """Whether written files are to reach the disk (flushes, fsyncs): not inside :func:`scratch`."""
    return _scratch == 0


class Follower(Protocol):
    """What follows a file as it is written (a :class:`Flusher`, a manifest ``Trailer``)."""

    def wrote(self, n: int) -> None: ...


class Flusher:
    """``fdatasync`` a file (through ``fd``, which it does not own) from a background thread
    as it grows: one flush at a time, once ``every`` new bytes were written since the last.
    Close it (or leave its ``with``) before the fd is closed; a flush that failed (EIO,
    ENOSPC) fails :meth:`close` on a clean exit. It takes no durability promise off the
    caller: the commit still fsyncs."""

    def __init__(self, fd: int, *, every: int = 16 << 20) -> None:
        self._fd, self._every, self._unflushed = fd, every, 0
        self._pool: concurrent.futures.ThreadPoolExecutor | None = None
        self._sync: concurrent.futures.Future | None = None

    def wrote(self, n: int) -> None:
        """``n`` more bytes were written."""
        self._unflushed += n
        if self._unflushed >= self._every and (self._sync is None or self._sync.done()) and durable():
            self.flush()

    def flush(self) -> concurrent.futures.Future:
        """Flush now (after the flush in flight): the future of this flush."""
        if self._sync is not None:
            self._sync.result()
        if self._pool is None:
            self._pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="ckpt-sync")
        self._unflushed = 0
        self._sync = self._pool.submit(os.fdatasync if durable() else _no_sync, self._fd)
        return self._sync

    def close(self, *, check: bool = True) -> None:
        """Wait for the flush in flight; with ``check``, raise its error."""
        if self._pool is None:
            return
        self._pool.shutdown(wait=True)
        self._pool = None
        if check and self._sync is not None:
            self._sync.result()

    def __enter__(self) -> Flusher:
        return self

    def __exit__(self, exc_type: Any, *_: Any) -> None:
        self.close(check=exc_type is None)


def _no_sync(fd: int) -> None:
    """Scratch files are not flushed."""


def write_all(fd: int, data: Any, flusher: Follower | None = None) -> int:
    """Write every byte of ``data`` at ``fd``'s position, ``WRITE_BYTES`` at a time; the count."""
    view = memoryview(data).cast("B")
    total = len(view)
    while view:
        n = os.write(fd, view[:WRITE_BYTES])
        view = view[n:]
        if flusher is not None:
            flusher.wrote(n)
    return total


def copy_range(src: int, dst: int, offset: int, length: int, *, what: Any,
               flusher: Follower | None = None) -> None:
    """Copy ``length`` bytes at ``offset`` of ``src`` to ``dst``'s position, in the kernel
    (``copy_file_range``), or read and written 1 MiB at a time where the kernel cannot copy
    between the two. A source shorter than that (``what`` names it) is a BadInput."""
    end, kernel = offset + length, True
    while offset < end:
        if kernel:
            try:
                n = os.copy_file_range(src, dst, min(end - offset, COPY_BYTES), offset)
            except OSError as e:
                if e.errno not in _NO_KERNEL_COPY:
                    raise
                kernel = False
                continue
        else:
            chunk = os.pread(src, min(end - offset, 1 << 20), offset)
            n = len(chunk) and write_all(dst, chunk)
        if n == 0:
            raise BadInput(f"{what}: ended {end - offset} bytes early while copied from (truncated, or changed "
                           "underneath?)")
        offset += n
        if flusher is not None:
            flusher.wrote(n)
