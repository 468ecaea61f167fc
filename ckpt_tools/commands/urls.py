"""Object-storage URLs as command arguments: the one adapter between a command and a bucket.

A command function decorated with :func:`accepts_urls` takes ``s3://bucket/prefix`` (any fsspec
URL; ``file://`` is a local path) wherever it takes a path, and works unchanged on local paths:

- a remote source becomes a local stand-in (:class:`~ckpt_tools.storage.remote.Mirror`): for a
  command that reads headers only (``inspect``, ``latest``) holding just the ranges that
  describe it (:func:`~ckpt_tools.formats.probe.fill_headers`), for one that reads tensors the
  whole objects, downloaded in parallel;
- a remote destination is checked first (exit 4 when it exists without ``overwrite``), written
  to a private local staging tree by the command as usual, then published marker-last
  (:func:`~ckpt_tools.storage.remote.publish`);
- paths in the result and in error messages are shown as the URLs the user gave.

Limits: the stand-in and the staging tree take local disk (sparse for headers-only commands);
tensor data is downloaded whole before a command reads it, not fetched per planned row range;
under ``torchrun`` a URL is refused (exit 2): the per-rank split is not built.
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
from ..storage import manifest, remote
from ..storage.objstore import Store, is_remote, local_path


def accepts_urls(*, sources: tuple[str, ...] = ("src",), dest: str | None = None,
                 need: str | Callable[[dict[str, Any]], str] = "data") -> Callable:
    """Let the decorated command take URLs for the arguments named in ``sources`` (read) and
    ``dest`` (written; its ``overwrite`` argument is honoured). ``need``: ``"headers"`` for a
    command that reads headers and metadata only, ``"data"`` for one that reads tensors."""
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
            if env.world() > 1:
                # each process would stage and publish on its own; the split (each rank uploads
                # its share, rank 0 the markers) is not built yet: refused, never half-done
                raise UsageError(f"{bound.arguments[remote_names[0]]}: object-storage URLs are not supported under "
                                 "torchrun yet; run the command as one process (plain `ckpt ...`)")
            return _run_remote(fn, bound, remote_names, dest, need(bound.arguments) if callable(need) else need)

        return wrapper

    return decorate


def _run_remote(fn: Callable, bound: pyinspect.BoundArguments, remote_names: list[str], dest: str | None,
                need: str) -> Any:
    shown: dict[str, str] = {}  # local stand-in -> URL, for messages and results
    overwrite = bool(bound.arguments.get("overwrite", False))
    with ExitStack() as stack:
        work = remote.staging_dir("ckpt-remote-")
        stack.callback(shutil.rmtree, work, True)
        out_store = out_local = None
        if dest in remote_names:
            url = bound.arguments[dest]
            out_store = Store(url, role="destination")
            for n in remote_names:
                if n != dest and _overlap(bound.arguments[n], url):
                    raise DestinationError(f"{url}: the destination must not be the source, lie inside it, or "
                                           "contain it; choose another DST")
            remote.check_destination(out_store, overwrite=overwrite)  # before any work
            out_local = work / "out" / (PurePosixPath(out_store.root).name or "checkpoint")
            out_local.parent.mkdir()
            bound.arguments[dest] = str(out_local)
            shown[str(out_local)] = url
        for i, n in enumerate(x for x in remote_names if x != dest):
            url = bound.arguments[n]
            (work / f"src{i}").mkdir()
            mirror = remote.Mirror(Store(url, role="source"), work / f"src{i}")
            if need == "headers":
                fill_headers(mirror)
            else:
                mirror.fetch()
            bound.arguments[n] = str(mirror.path)
            shown[str(mirror.path)] = url
        try:
            result = fn(*bound.args, **bound.kwargs)
            if out_store is not None:
                _manifests_name_urls(out_local, shown)
                remote.publish(out_local, out_store, overwrite=overwrite)
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
