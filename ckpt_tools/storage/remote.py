"""A remote checkpoint at the I/O edge: read through a local stand-in, written through a local
staging tree that is published object by object, markers last.

- :class:`Mirror`: the remote tree as local files of their true sizes (sparse: holes cost no
  disk), holding only the byte ranges fetched so far. Describing a checkpoint needs its
  headers and metadata; :meth:`Mirror.fill` fetches exactly those ranges (several requests in
  flight), :meth:`Mirror.fetch` whole objects for the commands that read tensor data. Every
  reader of the package then works on it unchanged (mmap, ``pread``, the restricted unpickler).
- :func:`publish`: upload a finished local tree to a prefix so that no reader ever sees a
  half-written checkpoint: each object appears whole (multipart uploads complete at once), and
  the objects that mark a checkpoint complete (:func:`marker_rank`) are uploaded after
  everything they name; with ``overwrite`` the old markers go first, so the old checkpoint
  stops being complete before any of its objects is replaced.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path, PurePosixPath

from ..errors import BadInput, DestinationError
from . import manifest
from .objstore import Listed, Store

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
        self.fetched: dict[str, list[tuple[int, int]]] = {}
        self.whole: set[str] = set()

    def local(self, rel: str) -> Path:
        return self._local[rel]

    def fill(self, ranges: list[tuple[str, int, int]]) -> int:
        """Fetch ``(rel, start, end)`` ranges (clipped to the objects) into place; bytes moved."""
        todo = []
        for rel, start, end in ranges:
            size = self.files[rel].size
            start, end = max(0, start), min(end, size)
            if end > start and rel not in self.whole:
                todo.append((rel, start, end))
        moved = 0
        for (rel, start, end), data in zip(todo, self.store.read_ranges(todo)):
            if len(data) != end - start:
                raise BadInput(f"{self.store.url}/{rel}: asked for bytes {start}-{end}, got {len(data)}; "
                               "the object changed while it was read")
            fd = os.open(self._local[rel], os.O_WRONLY)
            try:
                os.pwrite(fd, data, start)
            finally:
                os.close(fd)
            self.fetched.setdefault(rel, []).append((start, end))
            moved += len(data)
        return moved

    def fetch(self, rels: list[str] | None = None) -> None:
        """Download whole objects (all when ``rels`` is None) into place."""
        rels = [r for r in (self.files if rels is None else rels) if r not in self.whole]
        self.store.download(((r, self._local[r]) for r in rels), {r: self.files[r].size for r in rels})
        for r in rels:
            got = os.path.getsize(self._local[r])
            if got != self.files[r].size:
                raise BadInput(f"{self.store.url}/{r}: listed with {self.files[r].size} bytes, downloaded {got}; "
                               "the object changed while it was read")
        self.whole.update(rels)


def staging_dir(prefix: str) -> Path:
    """A private local directory for a remote command's staging (``$TMPDIR``)."""
    return Path(tempfile.mkdtemp(prefix=prefix))


def check_destination(store: Store, *, overwrite: bool) -> list[Listed]:
    """What is at a remote DST now; refused (exit 4) when something is there and not ``overwrite``."""
    existing = store.list()
    if not existing:
        store.check_bucket()  # a missing bucket or refused credentials: exit 4 before any work
    if existing and not overwrite:
        raise DestinationError(f"{store.url}: already exists ({len(existing)} objects); pass --overwrite to "
                               "replace it")
    return existing


def publish(local: Path, store: Store, *, overwrite: bool) -> list[str]:
    """Upload the finished tree ``local`` (a directory, or one file) to ``store``, markers last;
    then remove objects of an old checkpoint there that the new one does not have. The
    object names uploaded."""
    if local.is_dir():
        files = sorted(str(p.relative_to(local)) for p in local.rglob("*") if p.is_file())
        pairs = [(local / rel, rel) for rel in files]
    else:
        files = [""]
        pairs = [(local, "")]
    existing = check_destination(store, overwrite=overwrite)
    old = {x.rel for x in existing}
    # the old checkpoint stops being complete before any of its objects is replaced
    store.delete(sorted((r for r in old if marker_rank(r)), key=marker_rank, reverse=True))
    if files != [""]:
        write_lease(store)
    for rank in (0, 1, 2):
        store.upload([(p, rel) for p, rel in pairs if marker_rank(rel or local.name) == rank])
    if files != [""]:
        store.delete(sorted(old - set(files) - {LEASE}))
        store.delete([LEASE])
    return files


# -- what an interrupted upload leaves ---------------------------------------------------------

LEASE = ".ckpt-writing"  # present under a prefix while ckpt publishes into it


def write_lease(store: Store) -> None:
    """Mark the prefix as being written by this process (host and pid), before any data."""
    import json
    import socket

    with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as f:
        json.dump({"host": socket.gethostname(), "pid": os.getpid()}, f)
    try:
        store.upload([(f.name, LEASE)])
    finally:
        os.unlink(f.name)


def clean(url: str) -> dict[str, list[str]]:
    """``ckpt clean URL``: abort the unfinished multipart uploads under the prefix (the store
    drops their parts) and, when an interrupted ckpt run left objects there without publishing
    its markers (its lease names a process of this host that is gone), remove them. A prefix
    whose writer is alive, or on another host, is kept."""
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
        if not any(marker_rank(r) == 2 for r in objects):
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
