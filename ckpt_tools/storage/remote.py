"""A remote checkpoint at the I/O edge: read through a local stand-in, written through a local
staging tree that is published object by object, markers last.

- :class:`Mirror`: the remote tree as local files of their true sizes (sparse: holes cost no
  disk), holding only the byte ranges fetched so far. Describing a checkpoint needs its
  headers and metadata; :meth:`Mirror.fill` fetches exactly those ranges (several requests in
  flight), :meth:`Mirror.fetch` whole objects. Every reader of the package then works on it
  unchanged (mmap, ``pread``, the restricted unpickler). Registered (``with mirror:``), its
  local paths are known to :func:`present`, which the engine calls with the ranges its plan
  reads (a no-op for local files), and :func:`release`, which punches out what it has written.
- :class:`Destination`: a remote DST written by all processes of a ``torchrun`` launch, each
  from its private staging tree, rank 0 uploading the markers once every upload is done.
- :func:`publish`: upload a finished local tree to a prefix so that no reader ever sees a
  half-written checkpoint: each object appears whole (multipart uploads complete at once), and
  the objects that mark a checkpoint complete (:func:`marker_rank`) are uploaded after
  everything they name; with ``overwrite`` the old markers go first, so the old checkpoint
  stops being complete before any of its objects is replaced.
"""

from __future__ import annotations

import os
import tempfile
import threading
from collections.abc import Callable, Iterable
from pathlib import Path, PurePosixPath

from ..errors import BadInput, DestinationError
from . import manifest
from .objstore import PART_BYTES, Listed, Store
from .streamup import LEASE, Streaming, write_lease

GAP = 64 << 10  # ranges of one object closer than this are fetched as one request
BATCH = 8  # ranged GETs in flight together (each at most PART_BYTES: a batch is at most 64 MiB)

# objects whose presence says "this checkpoint is complete": DCP's coordinator writes
# .metadata last, an HF index names every shard, ckpt's manifest every file
MARKERS = frozenset({".metadata", "model.safetensors.index.json", "pytorch_model.bin.index.json"})


def marker_rank(rel: str) -> int:
    """Upload order of an object: 0 data, 1 a format's marker, 2 ckpt's manifest (names them all)."""
    name = PurePosixPath(rel).name
    return 2 if name == manifest.NAME else 1 if name in MARKERS else 0


def _safe_rel(store: Store, rel: str) -> str:
    parts = PurePosixPath(rel).parts
    if not rel or rel.startswith("/") or ".." in parts or "\x00" in rel:
        raise BadInput(f"{store.url}: object name {rel!r} escapes the prefix; refused")
    return rel


class Mirror:
    """The checkpoint at ``store`` as a local tree under ``workdir`` (files at their sizes,
    sparse). ``path`` is what to describe: the directory, or the one file a URL names."""

    def __init__(self, store: Store, workdir: Path) -> None:
        self.store = store
        single = store.is_file()
        listed = store.list()
        if not listed:
            store.check_bucket()
            raise BadInput(f"{store.url}: no objects under this prefix (nothing to read; check the URL)")
        name = store.root.rsplit("/", 1)[-1] or "checkpoint"
        if single:
            self.path = workdir / name
            self.files = {listed[0].rel: listed[0]}
            self._local = {listed[0].rel: self.path}
        else:
            self.path = workdir / name
            self.files = {_safe_rel(store, x.rel): x for x in listed}
            self._local = {rel: self.path / rel for rel in self.files}
        for rel, x in self.files.items():
            p = self._local[rel]
            p.parent.mkdir(parents=True, exist_ok=True)
            with open(p, "wb") as f:
                f.truncate(x.size)
        self.fetched: dict[str, list[tuple[int, int]]] = {}  # rel -> sorted, disjoint ranges here
        self.moved = 0  # bytes fetched so far
        self._lock = threading.RLock()  # the engine's fetch-ahead thread and its reader both fill
        self._rels: dict[str, str] | None = None

    def local(self, rel: str) -> Path:
        return self._local[rel]

    def missing(self, rel: str, start: int, end: int) -> list[tuple[int, int]]:
        """The parts of ``[start, end)`` of ``rel`` not fetched yet."""
        out, at = [], start
        for s, e in self.fetched.get(rel, ()):
            if e <= at:
                continue
            if s >= end:
                break
            if s > at:
                out.append((at, s))
            at = max(at, e)
        if at < end:
            out.append((at, end))
        return out

    def _mark(self, rel: str, start: int, end: int) -> None:
        merged: list[tuple[int, int]] = []
        for s, e in sorted([*self.fetched.get(rel, ()), (start, end)]):
            if merged and s <= merged[-1][1]:
                merged[-1] = (merged[-1][0], max(merged[-1][1], e))
            else:
                merged.append((s, e))
        self.fetched[rel] = merged

    def fill(self, ranges: list[tuple[str, int, int]]) -> int:
        """Fetch the parts of ``(rel, start, end)`` ranges (clipped to the objects) not fetched
        yet into place; the bytes moved. Ranges of one object less than ``GAP`` apart are one
        request; a request is at most ``PART_BYTES``; ``BATCH`` requests are in flight together
        (memory: one batch, never an object)."""
        with self._lock:
            todo: list[tuple[str, int, int]] = []
            for rel, start, end in sorted(ranges):
                start, end = max(0, start), min(end, self.files[rel].size)
                for s, e in (self.missing(rel, start, end) if end > start else ()):
                    if todo and todo[-1][0] == rel and s - todo[-1][2] <= GAP:
                        s = todo.pop()[1]
                    todo.append((rel, s, e))
            parts = [(rel, s, min(s + PART_BYTES, end)) for rel, start, end in todo for s in range(start, end, PART_BYTES)]
            moved = 0
            for i in range(0, len(parts), BATCH):
                batch = parts[i:i + BATCH]
                for (rel, start, end), data in zip(batch, self.store.read_ranges(batch)):
                    if len(data) != end - start:
                        raise BadInput(f"{self.store.url}/{rel}: asked for bytes {start}-{end}, got {len(data)}; "
                                       "the object changed while it was read")
                    fd = os.open(self._local[rel], os.O_WRONLY)
                    try:
                        os.pwrite(fd, data, start)
                    finally:
                        os.close(fd)
                    self._mark(rel, start, end)
                    moved += len(data)
            self.moved += moved
            return moved

    def fetch(self, rels: list[str] | None = None) -> None:
        """Download whole objects (all when ``rels`` is None) into place."""
        with self._lock:
            rels = [r for r in (self.files if rels is None else rels)
                    if self.missing(r, 0, self.files[r].size)]
            self.store.download(((r, self._local[r]) for r in rels), {r: self.files[r].size for r in rels})
            for r in rels:
                got = os.path.getsize(self._local[r])
                if got != self.files[r].size:
                    raise BadInput(f"{self.store.url}/{r}: listed with {self.files[r].size} bytes, downloaded {got}; "
                                   "the object changed while it was read")
                self.fetched[r] = [(0, got)]
                self.moved += got

    def release(self, ranges: list[tuple[str, int, int]]) -> int:
        """Give back the local disk of fetched ranges no reader needs any more (holes punched
        in the stand-in: its disk use stays near what is ahead of the writer); they count as not
        fetched again, so a later read fetches them anew. The bytes released (0 where the
        filesystem cannot punch holes: then the stand-in keeps them)."""
        freed = 0
        with self._lock:
            for rel, start, end in sorted(ranges):
                start, end = max(0, start), min(end, self.files[rel].size)
                if end <= start or not _punch(self._local[rel], start, end):
                    continue
                kept = []
                for s, e in self.fetched.get(rel, ()):
                    kept += [(a, b) for a, b in ((s, min(e, start)), (max(s, end), e)) if b > a]
                    freed += max(0, min(e, end) - max(s, start))
                self.fetched[rel] = kept
        return freed

    # -- known to the engine: reads under ``path`` ask for their bytes first ------------------
    def __enter__(self) -> Mirror:
        with _REGISTRY_LOCK:
            _MIRRORS[str(self.path)] = self
        return self

    def __exit__(self, *exc: object) -> None:
        with _REGISTRY_LOCK:
            _MIRRORS.pop(str(self.path), None)

    def rel_of(self, path: str | os.PathLike) -> str | None:
        """The object a local path of the stand-in is (None if it is none of its objects)."""
        if self._rels is None:
            self._rels = {os.path.abspath(local): rel for rel, local in self._local.items()}
        return self._rels.get(os.path.abspath(path))


# -- stand-ins registered in this process (the engine's reads go through these) ------------

_REGISTRY_LOCK = threading.Lock()
_MIRRORS: dict[str, Mirror] = {}


def _owner(path: str | os.PathLike) -> tuple[Mirror, str] | None:
    if not _MIRRORS:
        return None
    p = os.path.abspath(path)
    with _REGISTRY_LOCK:
        mirrors = list(_MIRRORS.items())
    for root, mirror in mirrors:
        if p == root or p.startswith(root + os.sep):
            rel = mirror.rel_of(p)
            if rel is not None:
                return mirror, rel
    return None


def any_standins() -> bool:
    """Whether any remote stand-in is registered (else every file is local)."""
    return bool(_MIRRORS)


def is_standin(path: str | os.PathLike) -> bool:
    """Whether ``path`` is a file of a registered remote stand-in (its bytes may not be here yet)."""
    return _owner(path) is not None


def present(ranges: Iterable[tuple[str | os.PathLike, int, int]]) -> int:
    """Make the byte ranges ``(path, start, end)`` present: those of registered stand-ins are
    fetched (the parts not fetched yet, several requests in flight); local files are left as
    they are. The bytes moved."""
    if not _MIRRORS:
        return 0  # a local source: nothing to do
    return sum(m.fill(rs) for m, rs in _by_mirror(ranges))


def release(ranges: Iterable[tuple[str | os.PathLike, int, int]]) -> int:
    """Give back the disk of stand-in ranges no reader needs any more (:meth:`Mirror.release`);
    local files are left as they are. The bytes released."""
    if not _MIRRORS:
        return 0
    return sum(m.release(rs) for m, rs in _by_mirror(ranges))


def _by_mirror(ranges: Iterable[tuple[str | os.PathLike, int, int]]
               ) -> Iterable[tuple[Mirror, list[tuple[str, int, int]]]]:
    """The ranges of registered stand-ins, by stand-in, as ``(name in it, start, end)``."""
    out: dict[int, tuple[Mirror, list[tuple[str, int, int]]]] = {}
    for path, start, end in ranges:
        found = _owner(path)
        if found is not None:
            out.setdefault(id(found[0]), (found[0], []))[1].append((found[1], start, end))
    return out.values()


_FALLOC_PUNCH = 0x02 | 0x01  # FALLOC_FL_PUNCH_HOLE | FALLOC_FL_KEEP_SIZE (Linux)
_fallocate = None


def _punch(path: Path, start: int, end: int) -> bool:
    """Deallocate ``[start, end)`` of a file (it reads as zeros after); False where unsupported."""
    global _fallocate
    if _fallocate is None:
        try:
            import ctypes
            import ctypes.util

            libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
            fn = libc.fallocate
            fn.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_longlong, ctypes.c_longlong]
            _fallocate = fn
        except (OSError, AttributeError):
            _fallocate = False
    if not _fallocate:
        return False
    fd = os.open(path, os.O_WRONLY)
    try:
        return _fallocate(fd, _FALLOC_PUNCH, start, end - start) == 0
    finally:
        os.close(fd)


def present_whole(paths: Iterable[str | os.PathLike]) -> None:
    """Make whole files present (the stand-in's objects downloaded; local files left as they are)."""
    if not _MIRRORS:
        return
    by_mirror: dict[int, tuple[Mirror, list[str]]] = {}
    for path in paths:
        found = _owner(path)
        if found is not None:
            by_mirror.setdefault(id(found[0]), (found[0], []))[1].append(found[1])
    for m, rels in by_mirror.values():
        m.fetch(rels)


def standin_files(root: str | os.PathLike) -> list[Path]:
    """Every file of the registered stand-in that holds ``root`` (a checkpoint inside it); []
    for a local checkpoint."""
    p = os.path.abspath(root)
    with _REGISTRY_LOCK:
        mirrors = list(_MIRRORS.items())
    for base, mirror in mirrors:
        if p == base or p.startswith(base + os.sep) or base.startswith(p + os.sep):
            return [loc for loc in mirror._local.values() if str(loc) == p or str(loc).startswith(p + os.sep)]
    return []


def staging_dir(prefix: str) -> Path:
    """A private local directory for a remote command's staging (``$TMPDIR``)."""
    return Path(tempfile.mkdtemp(prefix=prefix))


def check_destination(store: Store, *, overwrite: bool, ours: bool = False) -> list[Listed]:
    """What is at a remote DST now; refused (exit 4) when something is there and not ``overwrite``
    (``ours``: the lease there is this run's own, taken when it began streaming parts)."""
    existing = [x for x in store.list() if not (ours and x.rel == LEASE)]
    if not existing:
        store.check_bucket()  # a missing bucket or refused credentials: exit 4 before any work
    if existing and not overwrite:
        raise DestinationError(f"{store.url}: already exists ({len(existing)} objects); pass --overwrite to "
                               "replace it")
    return existing


def publish(local: Path, store: Store, *, overwrite: bool, streamed: Streaming | None = None) -> list[str]:
    """Upload the finished tree ``local`` (a directory, or one file) to ``store``, markers last;
    then remove objects of an old checkpoint there that the new one does not have. The
    object names uploaded. Files ``streamed`` sent while they were written have their
    multipart uploads completed in that order instead (:mod:`.streamup`)."""
    if local.is_dir():
        files = sorted(str(p.relative_to(local)) for p in local.rglob("*") if p.is_file())
        pairs = [(local / rel, rel) for rel in files]
    else:
        files = [""]
        pairs = [(local, "")]
    if streamed is not None:
        streamed.settle(local)  # every part in (a refused one raises here, nothing changed yet)
    existing = check_destination(store, overwrite=overwrite, ours=streamed is not None and streamed.leased)
    if streamed is not None:
        streamed.publishing = True  # from here a failure leaves the lease for `ckpt clean`, as before
    old = {x.rel for x in existing}
    # the old checkpoint stops being complete before any of its objects is replaced
    store.delete(sorted((r for r in old if marker_rank(r)), key=marker_rank, reverse=True))
    if files != [""]:
        write_lease(store)
    for rank in (0, 1, 2):
        mine = [(p, rel) for p, rel in pairs if marker_rank(rel or local.name) == rank]
        done = streamed.complete([rel for _, rel in mine]) if streamed is not None else set()
        store.upload([(p, rel) for p, rel in mine if rel not in done])
    if files != [""]:
        store.delete(sorted(old - set(files) - {LEASE}))
        store.delete([LEASE])
    if streamed is not None:
        streamed.published = True
    return files


# -- a destination written by every process of a torchrun launch --------------------------

class Destination:
    """A remote DST that the processes of a ``torchrun`` launch write together, each from its own
    private staging directory (no shared filesystem): rank 0 checks the prefix and takes the
    lease (:meth:`begin`), every rank uploads the data files it wrote (:meth:`upload_data`),
    then, once every upload is done, rank 0 uploads the describing files and markers last
    (:meth:`finish`). A rank that fails means rank 0 never calls :meth:`finish`: no marker.
    Registered (``with``) under the local path the command writes to, for the engine to find."""

    def __init__(self, store: Store, local: Path, *, overwrite: bool,
                 prepare: Callable[[Path], None] | None = None) -> None:
        self.store, self.local, self.overwrite, self.prepare = store, local, overwrite, prepare
        self.published = False
        self._old: set[str] = set()

    def __enter__(self) -> Destination:
        with _REGISTRY_LOCK:
            _DESTS[os.path.abspath(self.local)] = self
        return self

    def __exit__(self, *exc: object) -> None:
        with _REGISTRY_LOCK:
            _DESTS.pop(os.path.abspath(self.local), None)

    def begin(self) -> None:
        """(rank 0, before any rank writes) refuse an existing DST without ``overwrite``; with it,
        remove the old markers first; then take the lease."""
        self._old = {x.rel for x in check_destination(self.store, overwrite=self.overwrite)}
        self.store.delete(sorted((r for r in self._old if marker_rank(r)), key=marker_rank, reverse=True))
        write_lease(self.store)

    def upload_data(self, local: Path) -> list[str]:
        """Upload the data files (no markers) under ``local``; the object names."""
        files = [rel for rel in _files(local) if not marker_rank(rel)]
        self.store.upload([(local / rel, rel) for rel in files])
        return files

    def finish(self, local: Path, uploaded: set[str]) -> list[str]:
        """(rank 0, after every rank's upload) upload the rest of ``local`` markers last, remove
        what an old checkpoint there had that the new one has not, release the lease. Every
        object name of the checkpoint."""
        if self.prepare is not None:
            self.prepare(local)
        rest = [rel for rel in _files(local) if rel not in uploaded]
        for rank in (0, 1, 2):
            self.store.upload([(local / rel, rel) for rel in rest if marker_rank(rel) == rank])
        names = uploaded | set(rest)
        self.store.delete(sorted(self._old - names - {LEASE}))
        self.store.delete([LEASE])
        self.published = True
        return sorted(names)


_DESTS: dict[str, Destination] = {}


def destination(local: str | os.PathLike) -> Destination | None:
    """The registered remote destination written to through ``local`` (None: a local DST)."""
    with _REGISTRY_LOCK:
        return _DESTS.get(os.path.abspath(local))


def _files(local: Path) -> list[str]:
    return sorted(str(p.relative_to(local)) for p in local.rglob("*") if p.is_file())


# -- what an interrupted upload leaves ---------------------------------------------------------

def clean(url: str) -> dict[str, list[str]]:
    """``ckpt clean URL``: abort the unfinished multipart uploads under the prefix (the store
    drops their parts) and, when an interrupted ckpt run left objects there without publishing
    its markers (its lease names a process of this host that is gone), remove them; a lease of
    ``"phase": "parts"`` (killed while sending parts, before publishing) leaves the prefix as
    it was, so only the lease goes. A prefix whose writer is alive, or on another host, is kept."""
    import json
    import socket

    store = Store(url, role="destination")
    removed, in_use = [], []
    uploads = store.pending_uploads()
    objects = {x.rel for x in store.list()}
    if LEASE in objects:
        try:
            owner = json.loads(store.read(LEASE, 0, 4096))
        except (ValueError, BadInput):
            owner = {}
        alive = owner.get("host") != socket.gethostname() or _alive(owner.get("pid"))
        if alive:
            in_use.append(f"{store.url} (being written by pid {owner.get('pid')} on {owner.get('host')})")
            return {"removed": removed, "in_use": in_use}
        if owner.get("phase") != "parts" and not any(marker_rank(r) == 2 for r in objects):
            store.delete(sorted(objects))
            removed += [f"{store.url}/{r}" for r in sorted(objects)]
        else:
            store.delete([LEASE])
            removed.append(f"{store.url}/{LEASE}")
    store.abort_uploads(uploads)
    removed += [f"{store.url.split('/', 3)[0]}//{store.root.partition('/')[0]}/{u['Key']} (unfinished upload)"
                for u in uploads]
    return {"removed": removed, "in_use": in_use}


def _alive(pid) -> bool:
    if not isinstance(pid, int) or pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
