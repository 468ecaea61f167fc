"""Checkpoints in object storage: a URL (``s3://bucket/prefix``, any fsspec URL) as a tree of
objects, read by byte ranges and written by multipart uploads.

The client is fsspec with ``s3fs`` (the ``.[s3]`` extra) for ``s3://``: what torch's own
``FsspecReader``/``FsspecWriter`` use, so a checkpoint ckpt writes is read by ``dcp.load`` on
the same URL. Endpoint and credentials come from the standard AWS environment and config
(``AWS_ENDPOINT_URL``, ``AWS_ACCESS_KEY_ID``, ``AWS_SECRET_ACCESS_KEY``, ``AWS_REGION``,
``AWS_PROFILE``, ``~/.aws``), as botocore reads them; nothing here is ckpt's own.

Why these settings:
- reads are ``cat_file(start, end)``/``cat_ranges``: one ranged GET each, no read-ahead block
  (s3fs's default 50 MiB block pulled 52 MB to read an 8 KB safetensors header);
- a file is uploaded in ``PART_BYTES`` parts, ``PART_CONCURRENCY`` in flight, read from the
  staged file part by part (memory: parts in flight, never the file); a pending multipart
  upload is invisible to listings, so an object appears whole or not at all;
- short connect timeouts and botocore's ``standard`` retry mode (backoff on throttling and
  5xx): a dead endpoint is an error within seconds, a throttled request is retried first.

``file://`` URLs are local paths (:func:`local_path`) and never come here.
"""

from __future__ import annotations

import concurrent.futures
import os
import re
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..errors import BadInput, CkptError, DestinationError

PART_BYTES = 8 << 20  # a multipart upload's part (S3 refuses parts under 5 MiB but the last)
PART_CONCURRENCY = 4  # parts of one file in flight (loopback: as fast as 8, half the memory)
FILES_IN_FLIGHT = 8  # small files (one PUT or GET each, a PUT of one under 2 parts held whole) in flight
_URL = re.compile(r"^([a-zA-Z][a-zA-Z0-9+.-]*)://")


def scheme(location: str | os.PathLike) -> str | None:
    """The URL scheme of ``location`` (``"s3"``), or None for a local path."""
    m = _URL.match(str(location)) if isinstance(location, str) else None
    return m.group(1).lower() if m else None


def is_remote(location: Any) -> bool:
    """True for an object-storage URL (any scheme but ``file``); False for a local path."""
    s = scheme(location) if isinstance(location, str) else None
    return s is not None and s != "file"


def local_path(location: str | os.PathLike) -> str | os.PathLike:
    """``location`` with a ``file://`` scheme taken off; anything else unchanged."""
    if isinstance(location, str) and scheme(location) == "file":
        return location[len("file://"):]
    return location


def _options(proto: str) -> dict[str, Any]:
    if proto not in ("s3", "s3a"):
        return {}
    opts: dict[str, Any] = {
        "default_block_size": PART_BYTES, "default_cache_type": "none", "default_fill_cache": False,
        "max_concurrency": PART_CONCURRENCY,
        "config_kwargs": {"connect_timeout": 3, "read_timeout": 60,
                          "retries": {"max_attempts": 4, "mode": "standard"}},
    }
    endpoint = os.environ.get("AWS_ENDPOINT_URL_S3") or os.environ.get("AWS_ENDPOINT_URL")
    if endpoint:
        opts["endpoint_url"] = endpoint
    region = os.environ.get("AWS_REGION") or os.environ.get("AWS_DEFAULT_REGION")
    if region:
        opts["client_kwargs"] = {"region_name": region}
    return opts


@dataclass(frozen=True)
class Listed:
    """One object under a prefix: its path relative to the prefix, and its size."""

    rel: str
    size: int


class Store:
    """The objects under one URL prefix (a "directory"), or the one object a URL names.

    ``role`` ("source" or "destination") chooses the error an I/O failure becomes: BadInput
    (exit 3) for a source, DestinationError (exit 4) for a destination.
    """

    def __init__(self, url: str, *, role: str = "source") -> None:
        self.url = url.rstrip("/")
        self.role = role
        proto = scheme(url) or "file"
        try:
            import fsspec
        except ImportError as e:  # pragma: no cover - fsspec comes with torch
            raise self._error("fsspec is not installed; install ckpt-tools[s3]") from e
        try:
            cls = fsspec.get_filesystem_class(proto)
        except (ImportError, ValueError) as e:
            raise self._error(f"no client for {proto}:// ({e}); for s3:// install ckpt-tools[s3] "
                              "(pip install 's3fs>=2025.1')") from None
        # a fresh instance each time: fsspec caches instances, and a cached one would keep an
        # old endpoint or credentials, or an event loop of a forked parent
        self.fs = cls(skip_instance_cache=True, **_options(proto))
        if proto in ("s3", "s3a"):
            self.fs.retries = 1  # no loop of s3fs on top of botocore's retries: a dead endpoint fails fast
        self.root = cls._strip_protocol(self.url).rstrip("/")

    # -- errors -----------------------------------------------------------------------------
    def _error(self, text: str) -> CkptError:
        return (BadInput if self.role == "source" else DestinationError)(f"{self.url}: {text}")

    @contextmanager
    def _io(self, what: str) -> Iterator[None]:
        """Turn a client's failure into one CkptError line naming the URL and the fix."""
        try:
            yield
        except CkptError:
            raise
        except FileNotFoundError as e:
            raise self._error(f"{what}: not found ({_reason(e)}); check the bucket and prefix") from e
        except PermissionError as e:
            raise self._error(f"{what}: access refused ({_reason(e)}); check AWS_ACCESS_KEY_ID, "
                              "AWS_SECRET_ACCESS_KEY or AWS_PROFILE and the bucket's policy") from e
        except Exception as e:  # noqa: BLE001 - the client raises many kinds (OSError, botocore's, aiohttp's)
            if not _client_error(e):
                raise  # a bug, not the store's answer
            text = _reason(e)
            if any(w in text for w in ("Could not connect", "Connect timeout", "Cannot connect", "Connection refused",
                                       "EndpointConnectionError", "Name or service not known")):
                raise self._error(f"{what}: cannot reach the endpoint ({text}); check AWS_ENDPOINT_URL and the "
                                  "network") from e
            if "NoSuchBucket" in text or "does not exist" in text:
                raise self._error(f"{what}: the bucket does not exist ({text})") from e
            if any(w in text for w in ("InvalidAccessKeyId", "SignatureDoesNotMatch", "AccessDenied", "Forbidden")):
                raise self._error(f"{what}: access refused ({text}); check the credentials") from e
            if isinstance(e, OSError) and self.role == "destination" and "Slow Down" not in text:
                raise self._error(f"{what}: {text}") from e
            raise self._error(f"{what}: {type(e).__name__}: {text}") from e

    # -- reading ----------------------------------------------------------------------------
    def is_file(self) -> bool:
        """Whether the URL names one object (a single-file checkpoint) rather than a prefix."""
        with self._io("checking it"):
            try:
                info = self.fs.info(self.root)
            except FileNotFoundError:
                return False
            return info.get("type") == "file"

    def list(self) -> list[Listed]:
        """Every object under the prefix (or the one object the URL names, as ``""``), sorted."""
        with self._io("listing it"):
            try:
                found = self.fs.find(self.root, detail=True)
            except FileNotFoundError:
                found = {}
        out = []
        for path, info in found.items():
            if info.get("type") != "file":
                continue
            rel = path[len(self.root):].lstrip("/")
            out.append(Listed(rel, int(info.get("size") or 0)))  # "" for the object the URL names
        return sorted(out, key=lambda x: x.rel)

    def check_bucket(self) -> None:
        """Raise (this store's error kind) unless the bucket answers: missing, refused, unreachable."""
        if not hasattr(self.fs, "_call_s3"):
            return
        from fsspec.asyn import sync

        bucket = self.root.partition("/")[0]
        with self._io(f"bucket {bucket!r}"):
            try:
                sync(self.fs.loop, self.fs._call_s3, "head_bucket", Bucket=bucket)
            except FileNotFoundError as e:
                raise self._error(f"the bucket {bucket!r} does not exist; create it or check the URL") from e

    def exists(self) -> bool:
        """Whether anything is at the URL: an object, or any object under the prefix (a
        ``HEAD prefix/`` is not asked: some stores answer 200 for any prefix)."""
        return bool(self.list()) if not self.is_file() else True

    def _key(self, rel: str) -> str:
        return f"{self.root}/{rel}" if rel else self.root

    def read(self, rel: str, start: int, end: int) -> bytes:
        """Bytes ``[start, end)`` of object ``rel``: one ranged GET."""
        with self._io(f"reading {rel}"):
            return self.fs.cat_file(self._key(rel), start=start, end=end)

    def read_ranges(self, ranges: list[tuple[str, int, int]]) -> list[bytes]:
        """Several ``(rel, start, end)`` ranges, requested concurrently."""
        if not ranges:
            return []
        with self._io("reading ranges"):
            out = self.fs.cat_ranges([self._key(r) for r, _, _ in ranges], [s for _, s, _ in ranges],
                                     [e for _, _, e in ranges], on_error="raise")
        return out

    def download(self, pairs: Iterable[tuple[str, str | os.PathLike]], sizes: dict[str, int] | None = None) -> None:
        """Download objects ``rel`` to local files: small ones (under ``PART_BYTES``, streamed)
        several at a time, each large one in ``PART_BYTES`` ranged GETs, ``PART_CONCURRENCY``
        in flight (memory: those parts, never a file; not several files' parts at once)."""
        pairs = [(r, str(p)) for r, p in pairs]
        sizes = sizes or {}
        small = [(r, p) for r, p in pairs if sizes.get(r, 0) <= PART_BYTES]
        large = [(r, p) for r, p in pairs if sizes.get(r, 0) > PART_BYTES]
        with self._io("downloading"):
            if small:
                self.fs.get([self._key(r) for r, _ in small], [p for _, p in small], batch_size=FILES_IN_FLIGHT)
            for r, p in large:
                self.fs.get_file(self._key(r), p, chunksize=PART_BYTES, max_concurrency=PART_CONCURRENCY)

    # -- writing ----------------------------------------------------------------------------
    def upload(self, pairs: Iterable[tuple[str | os.PathLike, str]]) -> None:
        """Upload local files to objects ``rel``: small ones several at a time, each large one
        as a multipart upload of ``PART_BYTES`` parts, ``PART_CONCURRENCY`` in flight, read
        from its file part by part. An object appears whole when its upload completes."""
        pairs = [(str(p), r) for p, r in pairs]
        small = [(p, r) for p, r in pairs if os.path.getsize(p) < 2 * PART_BYTES]
        large = [(p, r) for p, r in pairs if os.path.getsize(p) >= 2 * PART_BYTES]
        with self._io("uploading"):
            if small:
                self.fs.put([p for p, _ in small], [self._key(r) for _, r in small], batch_size=FILES_IN_FLIGHT)
            for p, r in large:
                self.fs.put_file(p, self._key(r), chunksize=PART_BYTES, max_concurrency=PART_CONCURRENCY)

    # -- multipart uploads part by part (storage/streamup.py sends a file's parts as it is written)
    def can_stream(self) -> bool:
        """Whether this store takes multipart uploads part by part (S3 and its kin)."""
        return hasattr(self.fs, "_call_s3")

    def _bucket_key(self, rel: str) -> tuple[str, str]:
        bucket, _, key = self._key(rel).partition("/")
        return bucket, key

    def start_upload(self, rel: str) -> str:
        """Begin a multipart upload of object ``rel`` (invisible until completed); its id."""
        import mimetypes

        from fsspec.asyn import sync

        bucket, key = self._bucket_key(rel)
        kind = mimetypes.guess_type(key)[0]  # as s3fs's own upload labels it
        with self._io(f"uploading {rel}"):
            return sync(self.fs.loop, self.fs._call_s3, "create_multipart_upload", Bucket=bucket, Key=key,
                        **({"ContentType": kind} if kind else {}))["UploadId"]

    def send_part(self, rel: str, upload_id: str, number: int, data: bytes) -> concurrent.futures.Future:
        """Send part ``number`` of an upload in the background; the future of its ETag (the
        client's error: :meth:`part_result` turns it into this store's)."""
        import asyncio

        bucket, key = self._bucket_key(rel)

        async def put() -> str:
            r = await self.fs._call_s3("upload_part", Bucket=bucket, Key=key, PartNumber=number, UploadId=upload_id,
                                       Body=data)
            return r["ETag"]

        return asyncio.run_coroutine_threadsafe(put(), self.fs.loop)

    def part_result(self, rel: str, fut: concurrent.futures.Future) -> str:
        """The ETag a :meth:`send_part` future gives, or its failure as this store's error."""
        with self._io(f"uploading {rel}"):
            return fut.result()

    def complete_uploads(self, done: list[tuple[str, str, list[tuple[int, str]]]]) -> None:
        """Complete multipart uploads ``(rel, upload id, [(part number, ETag), ...])`` together:
        each object appears whole, at once."""
        if not done:
            return
        import asyncio

        from fsspec.asyn import sync

        async def all_of() -> None:
            await asyncio.gather(*(self.fs._call_s3(
                "complete_multipart_upload", Bucket=self._bucket_key(rel)[0], Key=self._bucket_key(rel)[1],
                UploadId=uid, MultipartUpload={"Parts": [{"PartNumber": n, "ETag": e} for n, e in sorted(parts)]})
                for rel, uid, parts in done))

        with self._io("completing uploads"):
            sync(self.fs.loop, all_of)
        self.fs.invalidate_cache()

    def delete(self, rels: Iterable[str]) -> None:
        keys = [self._key(r) for r in rels]
        if keys:
            with self._io("deleting old objects"):
                self.fs.rm(keys)

    def pending_uploads(self) -> list[dict[str, Any]]:
        """Unfinished multipart uploads under the prefix (``{"Key", "UploadId", ...}``); none
        for stores without multipart uploads."""
        if not hasattr(self.fs, "list_multipart_uploads"):
            return []
        bucket, _, prefix = self.root.partition("/")
        with self._io("listing unfinished uploads"):
            ups = self.fs.list_multipart_uploads(bucket)
        return [u for u in ups if u.get("Key", "") == prefix or u.get("Key", "").startswith(prefix.rstrip("/") + "/")
                or not prefix]

    def abort_uploads(self, uploads: list[dict[str, Any]]) -> None:
        """Abort unfinished multipart uploads (their parts are deleted by the store)."""
        bucket = self.root.partition("/")[0]
        from fsspec.asyn import sync

        with self._io("aborting unfinished uploads"):
            for u in uploads:
                sync(self.fs.loop, self.fs._call_s3, "abort_multipart_upload", Bucket=bucket, Key=u["Key"],
                     UploadId=u["UploadId"])


def _client_error(e: BaseException) -> bool:
    mod = type(e).__module__.split(".")[0]
    return isinstance(e, (OSError, TimeoutError)) or mod in ("botocore", "aiobotocore", "aiohttp", "s3fs", "fsspec",
                                                            "gcsfs", "adlfs", "google", "urllib3", "requests")


def _reason(e: BaseException) -> str:
    text = " ".join(str(e).split()) or type(e).__name__
    return text[:300]

