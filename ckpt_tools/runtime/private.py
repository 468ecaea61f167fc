"""Files that carry pickled work between ckpt's own processes (:mod:`.procs`, :mod:`.child`).

A pickle runs code when it is loaded, so one is only ever loaded from a file in a directory
that this user alone can reach (``mkdtemp``: 0700, ours) and that this user owns and alone can
write: anything else (a directory opened to others, a file swapped for a link or put there by
another account) is refused before a byte of it is unpickled. Input checkpoints never come
through here; they go through :mod:`ckpt_tools.security`.
"""

from __future__ import annotations

import os
import stat
from pathlib import Path
from typing import BinaryIO


class NotPrivate(RuntimeError):
    """A hand-over file that someone else could have written."""


def _check(st: os.stat_result, what: str, path: Path) -> None:
    if st.st_uid != os.getuid():
        raise NotPrivate(f"{path}: {what} belongs to uid {st.st_uid}, not to this user; refused")
    if st.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        raise NotPrivate(f"{path}: {what} is writable by others (mode {stat.S_IMODE(st.st_mode):o}); refused")


def check_dir(path: Path) -> None:
    """``path`` is a directory of this user's that no one else can enter."""
    st = os.stat(path, follow_symlinks=False)
    if not stat.S_ISDIR(st.st_mode):
        raise NotPrivate(f"{path}: not a directory; refused")
    _check(st, "the directory", path)
    if stat.S_IMODE(st.st_mode) & 0o077:
        raise NotPrivate(f"{path}: the directory is open to others (mode {stat.S_IMODE(st.st_mode):o}); refused")


def open_read(path: Path) -> BinaryIO:
    """Open a hand-over file for reading: in a private directory, owned by this user, not a link."""
    path = Path(path)
    check_dir(path.parent)
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise NotPrivate(f"{path}: not a regular file; refused")
        _check(st, "the file", path)
    except BaseException:
        os.close(fd)
        raise
    return os.fdopen(fd, "rb")


def open_write(path: Path) -> BinaryIO:
    """Create a hand-over file (it must not exist: no link or file is followed or reused)."""
    path = Path(path)
    check_dir(path.parent)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    return os.fdopen(fd, "wb")
