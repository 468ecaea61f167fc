"""Files named by untrusted input, opened safely: one resolver, one opener, one range check.

Every reader goes through these, so a rule is kept in one place:

- :func:`resolve_inside`: a name from a checkpoint's own metadata (DCP ``relative_path``, an
  index's weight map, a rank file) must, once every symlink on the whole path is resolved, lie
  inside the checkpoint's root. Checking only the last component lets a symlinked directory
  lead out.
- :func:`open_regular`: refuse anything but a regular file *before* reading it; a FIFO or a
  device is opened non-blocking (opening a FIFO with no writer would block forever) and refused.
- :func:`read_capped`: small metadata files (``.metadata``, JSON indexes, manifests) are read
  whole only when their size is under a cap: a sparse multi-GB file is refused, not read.
- :func:`check_span` / :func:`check_dims`: offsets, lengths, sizes and shapes from a header are
  non-negative integers and in range, before they reach ``seek``, ``pread`` or arithmetic.
"""

from __future__ import annotations

import os
import stat
from pathlib import Path
from typing import Any, BinaryIO

from ..errors import BadInput

# a DCP .metadata of a 512-rank job with a million chunk entries is ~300 MB; anything larger
# is refused before a byte is read (its unpickled objects would take several times that)
MAX_METADATA_BYTES = 512 * 1024 * 1024
MAX_JSON_BYTES = 256 * 1024 * 1024  # an index, a manifest, a config


def resolve_inside(root: Path | str, name: Any, *, what: str) -> Path:
    """``root / name``, when ``name`` is a plain relative path whose resolved location (every
    symlink followed, directories included) is inside ``root``'s. Raises BadInput otherwise."""
    if (not isinstance(name, str) or not name or "\x00" in name or os.path.isabs(name)
            or ".." in Path(name).parts):
        raise BadInput(f"{what}: file name {name!r} escapes the checkpoint directory")
    root = Path(root)
    full = root / name
    try:
        inside = full.resolve().is_relative_to(root.resolve())
    except (OSError, RuntimeError) as e:  # a symlink loop
        raise BadInput(f"{what}: {name!r} cannot be resolved ({type(e).__name__}); a symlink loop?") from None
    if not inside:
        raise BadInput(f"{what}: {name!r} leads out of the checkpoint directory through a symlink; "
                       "copy the file into the checkpoint instead")
    return full


def _kind(mode: int) -> str:
    for test, name in ((stat.S_ISDIR, "a directory"), (stat.S_ISFIFO, "a FIFO"), (stat.S_ISSOCK, "a socket"),
                       (stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device")):
        if test(mode):
            return name
    return "not a regular file"


def require_regular(path: Path | str, *, what: str | None = None) -> os.stat_result:
    """The ``stat`` of ``path`` (symlinks followed) when it is a regular file; BadInput naming
    what it is otherwise (missing, a FIFO, a directory...). Never opens it."""
    try:
        st = os.stat(path)
    except FileNotFoundError:
        raise BadInput(f"{what or path}: missing") from None
    except OSError as e:
        raise BadInput(f"{what or path}: cannot read it ({e.strerror})") from None
    if not stat.S_ISREG(st.st_mode):
        raise BadInput(f"{what or path}: is {_kind(st.st_mode)}, not a regular file; a checkpoint holds regular files")
    return st


def open_regular(path: Path | str, *, what: str | None = None) -> int:
    """A read-only file descriptor of ``path``, refused (BadInput) unless it is a regular file.
    Opened non-blocking, checked with ``fstat``, then set blocking: no FIFO can stall it."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    except FileNotFoundError:
        raise BadInput(f"{what or path}: missing") from None
    except OSError as e:
        raise BadInput(f"{what or path}: cannot open it ({e.strerror})") from None
    try:
        mode = os.fstat(fd).st_mode
        if not stat.S_ISREG(mode):
            raise BadInput(f"{what or path}: is {_kind(mode)}, not a regular file; a checkpoint holds regular files")
        os.set_blocking(fd, True)
    except BaseException:
        os.close(fd)
        raise
    return fd


def open_file(path: Path | str, *, what: str | None = None) -> BinaryIO:
    """:func:`open_regular` as a binary file object (a context manager)."""
    return os.fdopen(open_regular(path, what=what), "rb")


def read_capped(path: Path | str, cap: int, *, what: str | None = None) -> bytes:
    """The whole of a small file, refused (BadInput) before reading when it is over ``cap``
    bytes or not a regular file."""
    with open_file(path, what=what) as f:
        size = os.fstat(f.fileno()).st_size
        if size > cap:
            raise BadInput(f"{what or path}: {size} bytes, over the {cap >> 20} MiB such a file may hold; "
                           "corrupt or not a checkpoint file")
        return f.read(cap + 1)


def _is_int(x: Any) -> bool:
    return type(x) is int  # not bool, not a float that happens to be whole


def check_span(offset: Any, length: Any, size: int | None, *, what: str) -> tuple[int, int]:
    """``(offset, length)`` as ints when both are non-negative integers and, with ``size``,
    ``offset + length <= size``; BadInput otherwise."""
    if not (_is_int(offset) and _is_int(length)) or offset < 0 or length < 0:
        raise BadInput(f"{what}: byte range {offset!r}+{length!r} is not a pair of non-negative integers; "
                       "the metadata is corrupt")
    if size is not None and offset + length > size:
        raise BadInput(f"{what}: byte range {offset}+{length} ends at byte {offset + length}, but the file has "
                       f"{size}; it is truncated")
    return offset, length


def check_dims(values: Any, *, what: str, rank: int | None = None) -> tuple[int, ...]:
    """``values`` (a shape, chunk offsets or sizes) as a tuple of non-negative ints, of ``rank``
    entries when given; BadInput otherwise."""
    try:
        dims = tuple(values)
    except TypeError:
        raise BadInput(f"{what}: {type(values).__name__} where a list of sizes belongs; the metadata is corrupt") from None
    if not all(_is_int(d) and d >= 0 for d in dims) or (rank is not None and len(dims) != rank):
        shown = dims if len(dims) <= 8 else (*dims[:8], "...")
        raise BadInput(f"{what}: {shown} is not a list of {rank if rank is not None else 'some'} non-negative "
                       "integers; the metadata is corrupt")
    return dims


# -- sources that change while they are read ---------------------------------------------------

Stamp = tuple[int, int, int, int]  # inode, size, mtime_ns, ctime_ns


def _stamp(st: os.stat_result) -> Stamp:
    return (st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns)


def stamps(root: Path | str) -> dict[str, Stamp]:
    """Identity, size and times of the regular files of a checkpoint (``root`` itself when it is
    a file; else its files and those one directory down), keyed by path relative to ``root``'s
    directory. Taken before a checkpoint is described, compared before its output is published."""
    root = Path(root)
    out: dict[str, Stamp] = {}
    if not root.is_dir():
        with _suppress_os():
            out[root.name] = _stamp(os.stat(root))
        return out
    todo = [(root, "", 0)]
    while todo:
        d, rel, depth = todo.pop()
        with _suppress_os(), os.scandir(d) as it:
            for e in it:
                name = f"{rel}{e.name}"
                with _suppress_os():
                    if e.is_dir():
                        if depth < 1:
                            todo.append((Path(e.path), f"{name}/", depth + 1))
                    elif e.is_file():
                        out[name] = _stamp(e.stat())
    return out


def check_unchanged(base: Path | str, before: dict[str, Stamp], *, names: Any = None) -> None:
    """Raise BadInput if any file of ``before`` (only ``names``, when given) was modified,
    replaced or removed since: the output read from it cannot be published as a faithful copy."""
    base = Path(base)
    for name in (before if names is None else [n for n in names if n in before]):
        try:
            now = _stamp(os.stat(base / name))
        except OSError:
            now = None
        if now != before[name]:
            how = "was removed" if now is None else "was replaced" if now[0] != before[name][0] else \
                f"changed size ({before[name][1]} -> {now[1]} bytes)" if now[1] != before[name][1] else "was modified"
            raise BadInput(f"{base / name}: {how} while it was read; nothing was written. Re-run once the "
                           "source is no longer being written")


class _suppress_os:  # noqa: N801 - a tiny contextlib.suppress(OSError) that stays cheap in loops
    def __enter__(self) -> None:
        return None

    def __exit__(self, exc_type: Any, *_: Any) -> bool:
        return exc_type is not None and issubclass(exc_type, OSError)
