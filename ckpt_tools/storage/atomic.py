"""Never a partial destination: write into a temporary sibling of DST, fsync, rename.

Ctrl-C, SIGTERM, a crash or a full disk leave DST as it was (absent, or the old one); the
temporary sibling is removed on every exit the process lives through. One it cannot live
through (SIGKILL, power loss) leaves the sibling behind: while a run writes into it, the run
holds an ``flock`` on it, which the kernel drops when the process dies, so the next run to the
same DST tells a stale sibling from a live one, reports it, and removes it with ``--overwrite``
(or ``ckpt clean DST``).
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import os
import sys
import shutil
import signal
import tempfile
import uuid
from collections.abc import Iterator
from pathlib import Path

from ..errors import BadInput, DestinationError, one_line
from ..runtime import env
from .diskio import durable

TMP_MARK = ".ckpt-tmp-"


def check_destination(src: Path | None, dst: Path, *, overwrite: bool, dry_run: bool = False) -> None:
    """Refuse a DST that exists (without overwrite), equals SRC or lies inside it. Leftover
    staging beside DST is reported (removed with ``overwrite``, unless ``dry_run``)."""
    d = dst.resolve()
    s = src.resolve() if src is not None else None
    if s is not None and (d == s or d.is_relative_to(s) or s.is_relative_to(d)):
        raise DestinationError(f"{dst}: the destination must not be the source, lie inside it, or contain it; "
                               "choose another DST")
    if dst.exists() and not overwrite:
        raise DestinationError(f"{dst} exists; pass --overwrite to replace it (the old one stays until the new one is complete)")
    if overwrite and (dst.exists() or dst.is_symlink()):
        foreign = not_a_checkpoint(dst)
        if foreign:
            shown = ", ".join(foreign[:5]) + (f" ... ({len(foreign)} in all)" if len(foreign) > 5 else "")
            raise DestinationError(f"{dst}: holds {shown}, which no checkpoint holds; --overwrite replaces only a "
                                   "checkpoint (or an earlier ckpt output), so nothing was written: move those "
                                   "away or choose another DST")
    parent = d.parent
    if parent.exists() and not os.access(parent, os.W_OK):
        raise DestinationError(f"{parent}: not writable")
    report_stale(dst, remove=overwrite and not dry_run)


# what a checkpoint directory holds, by name: weights and metadata of every format read,
# configs and tokenizers, the frameworks' side files (DeepSpeed's ``latest`` and script)
_CHECKPOINT_SUFFIXES = (".safetensors", ".pt", ".pth", ".bin", ".distcp", ".json", ".pkl", ".model", ".tiktoken",
                        ".jinja")
_CHECKPOINT_NAMES = frozenset({".metadata", ".metadata.tmp", "latest", "vocab.txt", "merges.txt", "README.md",
                               ".gitattributes", "LICENSE", "zero_to_fp32.py"})


def not_a_checkpoint(dst: Path) -> list[str]:
    """What in ``dst`` (a file, or the files under a directory, relative to it) no checkpoint
    holds: files an earlier ckpt output's manifest lists, and files named as a checkpoint's
    are (weights, metadata, configs, tokenizers, side files), are not listed. ``--overwrite``
    replaces ``dst`` only when this is empty: it never deletes a user's own files."""
    from . import manifest

    def ours(name: str) -> bool:
        return name in _CHECKPOINT_NAMES or name.endswith(_CHECKPOINT_SUFFIXES)

    if dst.is_symlink() or not dst.is_dir():
        return [] if ours(dst.name) or _saved_tensors(dst) else [dst.name]
    try:
        found = manifest.read(dst)
    except (ValueError, OSError, BadInput):
        found = None
    listed = set(found.get("files") or ()) if isinstance(found, dict) and isinstance(found.get("files"), dict) else set()
    out = []
    for p in sorted(dst.rglob("*")):
        rel = p.relative_to(dst).as_posix()
        if (p.is_dir() and not p.is_symlink()) or TMP_MARK in rel or rel in listed or rel == manifest.NAME:
            continue
        if not ours(p.name):
            out.append(rel)
    return out


def _saved_tensors(file: Path) -> bool:
    """Whether a file whatever its name is a ``torch.save`` zip or a safetensors file."""
    try:
        with open(file, "rb") as f:
            head = f.read(9)
    except OSError:
        return False
    return head[:4] == b"PK\x03\x04" or head[8:9] == b"{"


def stale_staging(dst: Path) -> list[Path]:
    """Temporary siblings of ``dst`` that ckpt runs left behind: ones no live run holds locked."""
    dst = Path(dst)
    prefix = f".{dst.name}{TMP_MARK}"
    try:
        names = sorted(p for p in dst.parent.iterdir() if p.name.startswith(prefix))
    except OSError:
        return []
    return [p for p in names if not _in_use(p)]


def _in_use(path: Path) -> bool:
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    except OSError:
        return False
    finally:
        os.close(fd)  # drops the probe's lock with it
    return False


def _size(path: Path) -> int:
    if not path.is_dir() or path.is_symlink():
        return path.lstat().st_size
    return sum(f.lstat().st_size for f in path.rglob("*") if not f.is_dir())


_reported: set[Path] = set()  # said once per process (convert and a torchrun commit both check)


def report_stale(dst: Path, *, remove: bool) -> list[Path]:
    """Say on stderr which stale temporary siblings of ``dst`` were left by interrupted runs;
    remove them when ``remove``. Returns them. Rank 0 alone speaks for a torchrun launch."""
    if env.rank() != 0:
        return []
    found = stale_staging(dst)
    for p in found:
        what = "the previous DST, moved aside by an interrupted commit" if f"{TMP_MARK}old-" in p.name else \
            "the unfinished output of an interrupted run"
        with contextlib.suppress(OSError):
            size = _size(p)
            if remove:
                remove_path(p)
                print(f"note: removed {one_line(str(p))} ({what}, {size:,} bytes)", file=sys.stderr)
            elif p not in _reported:
                print(f"note: {one_line(str(p))} is {what} ({size:,} bytes); --overwrite or "
                      f"`ckpt clean {one_line(str(dst))}` removes it", file=sys.stderr)
        _reported.add(p)
    return found


def clean_staging(dst: str | Path) -> dict[str, list[str]]:
    """``ckpt clean DST``: remove the temporary siblings of ``dst`` that interrupted runs left;
    ones a live run is writing are kept. Returns ``{"removed": [...], "in_use": [...]}``.
    For an object-storage URL: unfinished uploads and an interrupted run's objects
    (:func:`ckpt_tools.storage.remote.clean`)."""
    from .objstore import is_remote, local_path

    if is_remote(dst):
        from .remote import clean

        return clean(str(dst))
    dst = Path(local_path(dst))
    prefix = f".{dst.name}{TMP_MARK}"
    removed, in_use = [], []
    siblings = sorted(p for p in dst.parent.iterdir() if p.name.startswith(prefix)) if dst.parent.is_dir() else []
    for p in siblings:
        if _in_use(p):
            in_use.append(str(p))
        else:
            remove_path(p)
            removed.append(str(p))
    return {"removed": removed, "in_use": in_use}


@contextlib.contextmanager
def holding(path: Path) -> Iterator[None]:
    """Hold an exclusive ``flock`` on ``path`` (a staging directory or file) while writing into
    it: the mark of a live run, dropped by the kernel however the process ends."""
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        with contextlib.suppress(OSError):  # a file system without flock: staging is still atomic
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        yield
    finally:
        os.close(fd)


@contextlib.contextmanager
def staged(dst: Path, *, overwrite: bool, is_dir: bool = True) -> Iterator[Path]:
    """Yield a temporary sibling of ``dst`` to write into; on success, fsync and rename it to
    ``dst``. With ``overwrite`` the old DST is moved aside only once the new one is complete."""
    dst = Path(dst)
    try:
        dst.parent.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise DestinationError(f"{dst.parent}: cannot create it ({e.strerror})") from e
    tmp = make_staging(dst) if is_dir else _make_staging_file(dst)
    with discarded_on_error(tmp, dst), holding(tmp), _sigterm_as_interrupt():
        yield tmp
        fsync_tree(tmp)
        commit_into(tmp, dst, overwrite=overwrite)


@contextlib.contextmanager
def discarded_on_error(tmp: Path, dst: Path) -> Iterator[None]:
    """Remove the staging ``tmp`` if the body fails; a failed write to ``dst`` (full disk, not
    writable) is raised as the exit-4 error it stands for."""
    try:
        yield
    except OSError as e:
        remove_path(tmp)
        mapped = destination_error(e, dst)
        if mapped is not None:
            raise mapped from e
        raise
    except BaseException:
        remove_path(tmp)
        raise


def destination_error(e: OSError, dst: Path) -> DestinationError | None:
    """The exit-4 error a failed write to ``dst`` stands for (full disk, not writable), if any."""
    if e.errno in (errno.ENOSPC, errno.EDQUOT, errno.EFBIG):
        return DestinationError(f"{dst}: out of space ({e.strerror}); nothing was written, free space and re-run")
    if e.errno in (errno.EACCES, errno.EPERM, errno.EROFS):
        return DestinationError(f"{dst}: not writable ({e.strerror})")
    return None


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
    remember_staging(dst, tmp)
    return tmp


def _make_staging_file(dst: Path) -> Path:
    """An empty hidden sibling file of ``dst``, created here so it can be locked; the writer
    then truncates and fills the same file."""
    tmp = dst.parent / f".{dst.name}{TMP_MARK}{uuid.uuid4().hex[:8]}"
    try:
        os.close(os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o644))
    except OSError as e:
        raise DestinationError(f"{dst.parent}: cannot write there ({e.strerror})") from e
    remember_staging(dst, tmp)
    return tmp


def commit_into(tmp: Path, dst: Path, *, overwrite: bool) -> None:
    """Rename the finished ``tmp`` to ``dst``; an old ``dst`` is moved aside first and deleted
    once the new one is in place. The swap and that deletion are one step: a SIGINT or SIGTERM
    arriving meanwhile is held until both are done (a crash still leaves the old or the new one,
    and the moved-aside old one is then reported by the next run), so an interrupted run leaves
    DST either as it was or as the new checkpoint, with nothing beside it."""
    with signals_deferred():
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


@contextlib.contextmanager
def signals_deferred() -> Iterator[None]:
    """Hold SIGINT and SIGTERM while the body runs, then deliver the first that came, to the
    handler that was in place (main thread only; elsewhere signals reach the main thread)."""
    import threading

    if threading.current_thread() is not threading.main_thread():
        yield
        return
    pending: list[int] = []

    def hold(signum, frame):
        pending.append(signum)

    previous = {s: signal.signal(s, hold) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)
        if pending:
            signal.raise_signal(pending[0])


# Every destination this process started to stage, with the staging's inode: a rename keeps
# it, so after an interrupt DST shows whether the new checkpoint was put in place, whichever
# process (this one, or a rank it started) did the rename.
_staging_of: dict[Path, tuple[Path, int, int]] = {}


def remember_staging(dst: Path, tmp: Path) -> None:
    """Note that this process stages ``dst`` in ``tmp`` (for :func:`interrupted_message`)."""
    with contextlib.suppress(OSError):
        st = tmp.stat()
        _staging_of[Path(dst).absolute()] = (tmp, st.st_dev, st.st_ino)


def interrupted_message() -> str:
    """What an interrupted command says, from what each DST it was writing holds now: the new
    checkpoint (the interrupt came after the commit), or what was there before; and any sibling
    an interrupted commit left (``ckpt clean DST`` removes it)."""
    if not _staging_of:
        return "interrupted before anything was written; the destination was left as it was"
    parts = []
    for dst, (tmp, dev, ino) in _staging_of.items():
        try:
            st = dst.stat()
            now = (st.st_dev, st.st_ino)
        except OSError:
            now = None
        if now == (dev, ino):
            text = f"{dst} holds the new, complete checkpoint (it was in place before the interrupt)"
        elif now is None:
            text = f"nothing was written to {dst}"
        else:
            text = f"{dst} was left as it was (the old one)"
        left = stale_staging(dst)
        if left:
            text += "; left beside it: " + ", ".join(p.name for p in left) + \
                f" (`ckpt clean {dst}` removes {'it' if len(left) == 1 else 'them'})"
        parts.append(text)
    return "interrupted; " + "; ".join(parts)


def remove_path(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path, ignore_errors=True)
    else:
        with contextlib.suppress(FileNotFoundError):
            path.unlink()


def fsync_tree(path: Path) -> None:
    if not durable():  # a remote DST's scratch staging
        return
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
    if not durable():
        return
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
