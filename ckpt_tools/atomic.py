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
import tempfile
import uuid
from collections.abc import Iterator
from pathlib import Path

from .errors import DestinationError, UsageError

TMP_MARK = ".ckpt-tmp-"


def check_destination(src: Path | None, dst: Path, *, overwrite: bool) -> None:
    """Refuse a DST that exists (without overwrite), equals SRC or lies inside it."""
    d = dst.resolve()
    s = src.resolve() if src is not None else None
    if s is not None and (d == s or d.is_relative_to(s) or s.is_relative_to(d)):
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
    tmp = make_staging(dst) if is_dir else dst.parent / f".{dst.name}{TMP_MARK}{uuid.uuid4().hex[:8]}"
    try:
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


def make_staging(dst: Path) -> Path:
    """A hidden sibling directory of ``dst`` on the same file system (so the final rename is
    atomic), with the permissions a plain mkdir would give."""
    try:
        tmp = Path(tempfile.mkdtemp(prefix=f".{dst.name}{TMP_MARK}", dir=dst.parent))
        umask = os.umask(0)
        os.umask(umask)
        tmp.chmod(0o777 & ~umask)  # mkdtemp's 0700 would make DST private
    except OSError as e:
        raise DestinationError(f"{dst.parent}: cannot write there ({e.strerror})") from e
    return tmp


def commit_into(tmp: Path, dst: Path, *, overwrite: bool) -> None:
    """Rename the finished ``tmp`` to ``dst``; an old ``dst`` is moved aside first and deleted
    only once the new one is in place, so a crash leaves either the old or the new one."""
    if dst.exists() or dst.is_symlink():
        if not overwrite:
            raise DestinationError(f"{dst} appeared while writing; pass --overwrite to replace it")
        old = dst.parent / f".{dst.name}{TMP_MARK}old-{uuid.uuid4().hex[:8]}"
        os.rename(dst, old)
        try:
            os.rename(tmp, dst)
        except OSError as e:
            os.rename(old, dst)
            raise DestinationError(f"{dst}: could not move the new checkpoint into place ({e.strerror})") from e
        fsync_dir(dst.parent)
        remove_path(old)
    else:
        os.rename(tmp, dst)
        fsync_dir(dst.parent)


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
        fsync_dir(Path(root))


def _fsync_file(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_dir(path: Path) -> None:
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
