"""Object-storage URLs as command arguments: the one adapter between a command and a bucket.

A command function decorated with :func:`accepts_urls` takes ``s3://bucket/prefix`` (any fsspec
URL; ``file://`` is a local path) wherever it takes a path, and works unchanged on local paths:

- a remote source becomes a local stand-in (:class:`~ckpt_tools.storage.remote.Mirror`, sparse
  files of the objects' sizes) holding just the ranges that describe it
  (:func:`~ckpt_tools.formats.probe.fill_headers`). A command that reads headers only
  (``inspect``, ``latest``) stops there. One that writes from a plan (``convert``, ``export``,
  ``reshard``: ``need="plan"``) registers the stand-in, and the engine fetches the byte ranges
  its plan's copies read, a few output files ahead of the writer, several requests in flight
  (:mod:`ckpt_tools.engine.fetch`); a reader outside the plan (a tied-weights check) fetches
  the chunk it reads. One that checks files byte for byte (``verify``, ``latest --verify``:
  ``need="data"``) downloads the objects whole, in parallel;
- a remote destination is checked first (exit 4 when it exists without ``overwrite``), written
  to a private local staging tree by the command as usual (scratch: never fsynced), each file
  the engine writes sent as multipart parts while it is written
  (:class:`~ckpt_tools.storage.streamup.Streaming`), then published marker-last
  (:func:`~ckpt_tools.storage.remote.publish`: those uploads completed, the rest uploaded);
- under ``torchrun`` every process does the above in its own ``$TMPDIR`` (no shared filesystem):
  it describes the source, fetches the rows of its share of the output files, writes and
  uploads them; rank 0 checks DST before any process writes and uploads the markers after every
  upload succeeded (:class:`~ckpt_tools.storage.remote.Destination`), so a failed process leaves
  no marker;
- paths in the result and in error messages are shown as the URLs the user gave.

Limits: the staging tree takes local disk for the whole output until it is published (the
stand-in only for the ranges fetched ahead of the writer: the engine punches out what it has
written, where the filesystem can). Whole objects are still fetched for: files of the source
that no chunk names (side files, configs: layouts copy them), a ``torch.save`` file whose pickle
ckpt's restricted reader does not walk (legacy, non-zip files), and a DCP item that is not one
plain tensor record; a value of a ``torch.save`` file (rank files, torch files) moves its whole
storage record (a per-rank shard, not a row range of it). With ``--workers K`` the plan's
ranges are all fetched before the workers start (they read the stand-in). Under ``torchrun``, only outputs the
engine splits over processes (DCP, rank files, HF shards) may go to a URL: a single-file output
is refused there (exit 2, run it as one process) once its plan is made, before any tensor is
fetched (the engine's check), a command that reads no checkpoint (``shard``) before any work.
"""

from __future__ import annotations

import functools
import json
import inspect as pyinspect
import shutil
from collections.abc import Callable
from contextlib import ExitStack
from pathlib import Path, PurePosixPath
from typing import Any

from ..errors import CkptError, DestinationError, UsageError
from ..formats.probe import fill_headers
from ..runtime import env
from ..storage import diskio, manifest, remote, streamup
from ..storage.objstore import Store, is_remote, local_path


def accepts_urls(*, sources: tuple[str, ...] = ("src",), dest: str | None = None,
                 need: str | Callable[[dict[str, Any]], str] | None = None) -> Callable:
    """Let the decorated command take URLs for the arguments named in ``sources`` (read) and
    ``dest`` (written; its ``overwrite`` argument is honoured). ``need``: ``"headers"`` for a
    command that reads headers and metadata only, ``"plan"`` for one that writes from a plan
    (the engine fetches the ranges its plan reads), ``"data"`` for one that checks files byte
    for byte (whole objects); by default ``"plan"`` with a ``dest``, else ``"data"``."""
    # need may also be a function of the bound arguments (latest --verify reads checksummed data)

    def decorate(fn: Callable) -> Callable:
        sig = pyinspect.signature(fn)

        @functools.wraps(fn)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            bound = sig.bind(*args, **kwargs)
            names = [n for n in (*sources, *((dest,) if dest else ())) if n in bound.arguments]
            for n in names:  # file:// is a local path
                bound.arguments[n] = local_path(bound.arguments[n])
            remote_names = [n for n in names if is_remote(bound.arguments[n])]
            if not remote_names:
                return fn(*bound.args, **bound.kwargs)
            if env.world() > 1 and dest in remote_names and not sources:
                # a command that reads no checkpoint (shard) writes through its own framework,
                # not the engine's per-process split: refused before any work
                raise UsageError(f"{bound.arguments[dest]}: this command cannot write object storage under "
                                 "torchrun; run it as one process (plain `ckpt ...`), or write a local DST")
            how = need(bound.arguments) if callable(need) else need or ("plan" if dest else "data")
            return _run_remote(fn, bound, remote_names, dest, how)

        return wrapper

    return decorate


def _run_remote(fn: Callable, bound: pyinspect.BoundArguments, remote_names: list[str], dest: str | None,
                need: str) -> Any:
    shown: dict[str, str] = {}  # local stand-in -> URL, for messages and results
    overwrite = bool(bound.arguments.get("overwrite", False))
    spread = env.world() > 1  # under torchrun: every process stages privately, the engine publishes
    dry_run = bool(bound.arguments.get("dry_run", False))  # the plan only: nothing uploaded
    with ExitStack() as stack:
        work = remote.staging_dir("ckpt-remote-")
        stack.callback(shutil.rmtree, work, True)
        out_store = out_local = out_dest = out_stream = None
        if dest in remote_names:
            url = bound.arguments[dest]
            out_store = Store(url, role="destination")
            for n in remote_names:
                if n != dest and _overlap(bound.arguments[n], url):
                    raise DestinationError(f"{url}: the destination must not be the source, lie inside it, or "
                                           "contain it; choose another DST")
            if not spread or dry_run:  # under torchrun rank 0 checks it, before any process writes
                remote.check_destination(out_store, overwrite=overwrite)  # before any work
            out_local = work / "out" / (PurePosixPath(out_store.root).name or "checkpoint")
            out_local.parent.mkdir()
            bound.arguments[dest] = str(out_local)
            shown[str(out_local)] = url
            if spread and not dry_run:
                out_dest = stack.enter_context(remote.Destination(
                    out_store, out_local, overwrite=overwrite,
                    prepare=lambda out: _manifests_name_urls(out, shown)))
            elif not dry_run:  # the engine sends each file's parts as it writes them
                out_stream = stack.enter_context(streamup.Streaming(out_store, out_local))
                stack.enter_context(diskio.scratch())  # the staging is uploaded, never flushed to disk
        for i, n in enumerate(x for x in remote_names if x != dest):
            url = bound.arguments[n]
            (work / f"src{i}").mkdir()
            mirror = remote.Mirror(Store(url, role="source"), work / f"src{i}")
            if need == "data":
                mirror.fetch()
            else:
                fill_headers(mirror)
                if need == "plan":
                    stack.enter_context(mirror)  # the engine (and any reader) fetches what it reads
            bound.arguments[n] = str(mirror.path)
            shown[str(mirror.path)] = url
        try:
            result = fn(*bound.args, **bound.kwargs)
            if out_dest is not None and not out_dest.published:
                # only the engine's split writes (rank files, DCP, HF shards) spread over processes
                raise UsageError(f"{out_store.url}: this command's output is not split over the processes "
                                 "of a torchrun launch, so it cannot be written there; run it as one process "
                                 "(plain `ckpt ...`)")
            if out_store is not None and out_dest is None and not dry_run:
                _manifests_name_urls(out_local, shown)
                remote.publish(out_local, out_store, overwrite=overwrite, streamed=out_stream)
        except CkptError as e:
            if e.args and isinstance(e.args[0], str):
                e.args = (_as_urls(e.args[0], shown), *e.args[1:])
            raise
        return _as_urls(result, shown)


def _overlap(a: str, b: str) -> bool:
    a, b = a.rstrip("/") + "/", b.rstrip("/") + "/"
    return a.startswith(b) or b.startswith(a)


def _manifests_name_urls(out: Path, shown: dict[str, str]) -> None:
    """A manifest records its source's path: the URL, not the stand-in's temporary directory."""
    for p in ([out / manifest.NAME] if out.is_dir() else []) + (sorted(out.rglob(f"*/{manifest.NAME}"))
                                                               if out.is_dir() else []):
        if p.is_file():
            data = json.loads(p.read_text())
            p.write_text(json.dumps(_as_urls(data, shown), indent=1) + "\n")


def _as_urls(obj: Any, shown: dict[str, str]) -> Any:
    """``obj`` with every path under a local stand-in written as its URL."""
    if isinstance(obj, str):
        for local, url in shown.items():
            if local in obj:
                obj = obj.replace(local, url)
        return obj
    if isinstance(obj, Path):
        return _as_urls(str(obj), shown)
    if isinstance(obj, dict):
        return {k: _as_urls(v, shown) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(_as_urls(v, shown) for v in obj)
    return obj
