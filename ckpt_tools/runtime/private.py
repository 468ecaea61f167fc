"""Files that carry pickled work between ckpt's own processes (:mod:`.procs`, :mod:`.child`).

A pickle runs code when it is loaded, so one is only ever loaded from a file in a directory
that this user alone can reach (``mkdtemp``: 0700, ours) and that this user owns and alone can
write: anything else (a directory opened to others, a file swapped for a link or put there by
another account) is refused before a byte of it is unpickled. It is then read by a restricted
unpickler (:func:`load`) that looks up only ckpt's own functions and classes, paths, built-in
exceptions and the functions the writer named (:func:`names_of`): a hand-over naming anything
else is refused before any of it runs. Input checkpoints never come through here; they go
through :mod:`ckpt_tools.security`.
"""

from __future__ import annotations

import builtins
import io
import os
import pickle
import stat
from collections.abc import Iterable
from pathlib import Path
from typing import Any, BinaryIO


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


# -- reading a hand-over pickle ---------------------------------------------------------------
_OURS = "ckpt_tools"
_NAMED = frozenset({("pathlib", "PosixPath"), ("pathlib", "PurePosixPath"), ("collections", "OrderedDict")})


def names_of(fns: Iterable[Any]) -> list[list[str]]:
    """The ``[module, qualified name]`` of each function the writer passes (what :func:`load`
    is told to admit besides ckpt's own)."""
    return [[fn.__module__, fn.__qualname__] for fn in fns]


class _HandOver(pickle.Unpickler):
    def __init__(self, f: BinaryIO, admit: Iterable[Iterable[str]]) -> None:
        super().__init__(f)
        self.admit = _NAMED | {tuple(a) for a in admit}

    def find_class(self, module: str, name: str) -> Any:
        if module == _OURS or module.startswith(_OURS + ".") or (module, name) in self.admit:
            return super().find_class(module, name)
        obj = getattr(builtins, name, None) if module == "builtins" else None
        if isinstance(obj, type) and issubclass(obj, BaseException):
            return obj  # an exception a child reports
        raise pickle.UnpicklingError(f"a hand-over file names {module}.{name}, which its writer did not name; "
                                     "ckpt's processes pass only its own functions and data: refused")


def load(f: BinaryIO, admit: Iterable[Iterable[str]] = ()) -> Any:
    """The hand-over pickle in ``f`` (opened by :func:`open_read`), looking up only ckpt's own
    globals, paths, built-in exceptions and those ``admit`` names (``[module, qualname]``)."""
    return _HandOver(f, admit).load()


def admitted(data: bytes) -> bool:
    """Whether :func:`load` takes ``data`` with nothing more admitted (a child checks what it
    reports before writing it; what it cannot report so goes back as text)."""
    try:
        load(io.BytesIO(data))
    except pickle.UnpicklingError:
        return False
    return True
