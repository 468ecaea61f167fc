"""Never a partial destination: write into a temporary sibling of DST, fsync, rename.

Ctrl-C, SIGTERM, a crash or a full disk leave DST as it was (absent, or the old one); the
temporary sibling is removed on every exit the process lives through.
"""

from __future__ import annotations

import contextlib
import errno
import os
import shutil
import signal
import uuid
from collections.abc import Iterator
from pathlib import Path

from .errors import DestinationError, UsageError

TMP_MARK = ".ckpt-tmp-"


def check_destination(src: Path, dst: Path, *, overwrite: bool) -> None:
    """Refuse a DST that exists (without overwrite), equals SRC or lies inside it."""
    s, d = src.resolve(), dst.resolve()
    if d == s or d.is_relative_to(s) or (s.is_dir() and s.is_relative_to(d)):
        raise DestinationError(f"{dst}: the destination must not be the source, lie inside it, or contain it; "
                               "choose another DST")
    if dst.exists() and not overwrite:
        raise DestinationError(f"{dst} exists; pass --overwrite to replace it (the old one stays until the new one is complete)")
    parent = d.parent
    if parent.exists() and not os.access(parent, os.W_OK):
        raise DestinationError(f"{parent}: not writable")


@contextlib.contextmanager
def staged(dst: Path, *, overwrite: bool, is_dir: bool = True) -> Iterator[Path]:
    """Yield a temporary sibling of ``dst`` to write into; on success, fsync and rename it to
    ``dst``. With ``overwrite`` the old DST is moved aside only once the new one is complete."""
    dst = Path(dst)
    try:
        dst.parent.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise DestinationError(f"{dst.parent}: cannot create it ({e.strerror})") from e
    tmp = dst.parent / f".{dst.name}{TMP_MARK}{uuid.uuid4().hex[:8]}"
    try:
        if is_dir:
            tmp.mkdir()
        with _sigterm_as_interrupt():
            yield tmp
            fsync_tree(tmp)
            commit_into(tmp, dst, overwrite=overwrite)
    except OSError as e:
        remove_path(tmp)
        if e.errno in (errno.ENOSPC, errno.EDQUOT, errno.EFBIG):
            raise DestinationError(f"{dst}: out of space ({e.strerror}); nothing was written, free space and re-run") from e
        if e.errno in (errno.EACCES, errno.EPERM, errno.EROFS):
            raise DestinationError(f"{dst}: not writable ({e.strerror})") from e
        raise
    except BaseException:
        remove_path(tmp)
        raise


def commit_into(tmp: Path, dst: Path, *, overwrite: bool) -> None:
    if dst.exists() or dst.is_symlink():
        if not overwrite:
            raise DestinationError(f"{dst} appeared while writing; pass --overwrite to replace it")
        old = dst.parent / f".{dst.name}{TMP_MARK}old-{uuid.uuid4().hex[:8]}"
        os.rename(dst, old)
        os.rename(tmp, dst)
        _fsync_dir(dst.parent)
        remove_path(old)
    else:
        os.rename(tmp, dst)
        _fsync_dir(dst.parent)


def remove_path(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path, ignore_errors=True)
    else:
        with contextlib.suppress(FileNotFoundError):
            path.unlink()


def fsync_tree(path: Path) -> None:
    if path.is_file():
        _fsync_file(path)
        return
    for root, _, files in os.walk(path):
        for f in files:
            _fsync_file(Path(root) / f)
        _fsync_dir(Path(root))


def _fsync_file(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _fsync_dir(path: Path) -> None:
    with contextlib.suppress(OSError):
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


@contextlib.contextmanager
def _sigterm_as_interrupt() -> Iterator[None]:
    """Turn SIGTERM into KeyboardInterrupt (main thread only), so cleanup runs."""
    import threading

    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def handler(signum, frame):
        raise KeyboardInterrupt(f"signal {signum}")

    previous = signal.signal(signal.SIGTERM, handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def validate_option(ok: bool, message: str) -> None:
    if not ok:
        raise UsageError(message)
