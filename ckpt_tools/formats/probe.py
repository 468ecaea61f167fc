"""Which bytes of a checkpoint's files describe it: what a remote checkpoint's :class:`Mirror`
must fetch so that every describer (and ``inspect``) gives what it gives on a local copy, while
the tensor data stays in the bucket.

Rounds of ranged reads, each request of a round in flight together:
1. the first ``HEAD_BYTES`` of every object but ``.distcp`` files (a small file is then whole);
2. by kind: a safetensors header (its 8-byte length says how long), a zip's (``torch.save``)
   end records and central directory, whole small metadata (``.metadata``, JSON, unknown kinds);
3. inside those: each zip record that is not tensor storage (the pickle, ``byteorder``,
   ``version``) and storage records of at most ``SMALL_ITEM`` bytes (an optimizer's ``step``);
   each DCP ``.metadata``'s non-tensor items and small tensor items in the ``.distcp`` files.

A ``.distcp`` or a zip's tensor records are never fetched here: a command that writes from a
plan has the engine fetch the ranges its plan reads (:mod:`ckpt_tools.engine.fetch`); one that
checks files byte for byte fetches whole objects (``Mirror.fetch``).
"""

from __future__ import annotations

import struct
from pathlib import PurePosixPath

from ..security.dcpmeta import BytesStorageMetadata, load_dcp_metadata
from ..storage.remote import Mirror

HEAD_BYTES = 64 << 10
SMALL_ITEM = 4096  # storage records read to describe (a step scalar), never weights
_EOCD = b"PK\x05\x06"
_EOCD64_LOC = b"PK\x06\x07"
_CEN = b"PK\x01\x02"


def fill_headers(mirror: Mirror) -> int:
    """Fetch into ``mirror`` the bytes that describe its checkpoint; the bytes moved."""
    files = mirror.files
    # a .distcp is read only where its .metadata points (round 3): a 512-rank DCP's data files
    # are not opened at all
    moved = mirror.fill([(rel, 0, min(x.size, HEAD_BYTES)) for rel, x in files.items()
                         if not mirror.local(rel).name.endswith(".distcp")])
    second: list[tuple[str, int, int]] = []
    zips: list[str] = []
    for rel, x in files.items():
        name = mirror.local(rel).name
        if x.size <= HEAD_BYTES or name.endswith(".distcp"):
            continue
        head = _read(mirror, rel, 0, 8)
        if name.endswith(".safetensors"):
            (n,) = struct.unpack("<Q", head)
            second.append((rel, HEAD_BYTES, min(x.size, 8 + n)))
        elif head[:4] == b"PK\x03\x04":
            zips.append(rel)
            second.append((rel, max(0, x.size - HEAD_BYTES), x.size))
        else:  # metadata, JSON, pickles, anything unknown: whole (small in practice)
            second.append((rel, HEAD_BYTES, x.size))
    moved += mirror.fill(second)
    third: list[tuple[str, int, int]] = []
    for rel in zips:
        third += _zip_cd_ranges(mirror, rel)
    moved += mirror.fill(third)
    fourth: list[tuple[str, int, int]] = []
    for rel in zips:
        fourth += _zip_record_ranges(mirror, rel)
    for rel in files:
        if mirror.local(rel).name == ".metadata":
            fourth += _dcp_item_ranges(mirror, rel)
    moved += mirror.fill(fourth)
    return moved


def _read(mirror: Mirror, rel: str, start: int, length: int) -> bytes:
    with open(mirror.local(rel), "rb") as f:
        f.seek(start)
        return f.read(length)


def _eocd(mirror: Mirror, rel: str) -> tuple[int, int, int] | None:
    """(central directory offset, its size, entries) from the end records; None when absent."""
    size = mirror.files[rel].size
    tail_start = max(0, size - HEAD_BYTES)
    tail = _read(mirror, rel, tail_start, size - tail_start)
    i = tail.rfind(_EOCD)
    if i < 0 or len(tail) < i + 22:
        return None
    entries, cd_size, cd_off = struct.unpack("<HII", tail[i + 10: i + 20])
    j = tail.rfind(_EOCD64_LOC, 0, i)
    if j >= 0 and len(tail) >= j + 20:
        (eocd64,) = struct.unpack("<Q", tail[j + 8: j + 16])
        k = eocd64 - tail_start
        if 0 <= k and len(tail) >= k + 56:
            entries, cd_size, cd_off = struct.unpack("<QQQ", tail[k + 32: k + 56])
    return cd_off, cd_size, entries


def _zip_cd_ranges(mirror: Mirror, rel: str) -> list[tuple[str, int, int]]:
    found = _eocd(mirror, rel)
    return [] if found is None else [(rel, found[0], found[0] + found[1])]


def _zip_record_ranges(mirror: Mirror, rel: str) -> list[tuple[str, int, int]]:
    """Local header + data of every record that is not tensor storage, or is small."""
    found = _eocd(mirror, rel)
    if found is None:
        return []  # not a readable zip: the describer says so from what is there
    cd_off, cd_size, _ = found
    cd = _read(mirror, rel, cd_off, cd_size)
    out, i = [], 0
    while i + 46 <= len(cd) and cd[i: i + 4] == _CEN:
        csize, usize = struct.unpack("<II", cd[i + 20: i + 28])
        nlen, xlen, clen = struct.unpack("<HHH", cd[i + 28: i + 34])
        (off,) = struct.unpack("<I", cd[i + 42: i + 46])
        name = cd[i + 46: i + 46 + nlen].decode("utf-8", "replace")
        extra = cd[i + 46 + nlen: i + 46 + nlen + xlen]
        csize, usize, off = _zip64(extra, csize, usize, off)
        parts = name.split("/")
        storage = len(parts) >= 2 and parts[-2] == "data" and parts[-1].isdigit()
        # a local header's extra field may differ from the central one's: 30 + name + room
        end = off + 30 + nlen + max(xlen, 0) + 256 + (csize if (not storage or csize <= SMALL_ITEM) else 0)
        out.append((rel, off, end))
        i += 46 + nlen + xlen + clen
    return out


def _zip64(extra: bytes, csize: int, usize: int, off: int) -> tuple[int, int, int]:
    j = 0
    while j + 4 <= len(extra):
        tag, n = struct.unpack("<HH", extra[j: j + 4])
        if tag == 1:
            body, k = extra[j + 4: j + 4 + n], 0
            vals = []
            for cur in (usize, csize, off):
                if cur == 0xFFFFFFFF and k + 8 <= len(body):
                    vals.append(struct.unpack("<Q", body[k: k + 8])[0])
                    k += 8
                else:
                    vals.append(cur)
            usize, csize, off = vals
        j += 4 + n
    return csize, usize, off


def _dcp_item_ranges(mirror: Mirror, rel: str) -> list[tuple[str, int, int]]:
    """Non-tensor items, and tensor items of at most SMALL_ITEM bytes, of the DCP whose
    ``.metadata`` is ``rel`` (a corrupt one is left to the describer to report)."""
    try:
        meta = load_dcp_metadata(mirror.local(rel))
    except Exception:  # noqa: BLE001 - the describer reports it, with its own message
        return []
    base = PurePosixPath(rel).parent
    sdm = meta.state_dict_metadata if isinstance(meta.state_dict_metadata, dict) else {}
    out = []
    for index, info in (meta.storage_data or {}).items():
        fqn = getattr(index, "fqn", None)
        small = isinstance(getattr(info, "length", None), int) and info.length <= SMALL_ITEM
        if not (isinstance(sdm.get(fqn), BytesStorageMetadata) or small):
            continue
        name = str(base / str(info.relative_path)) if str(base) != "." else str(info.relative_path)
        if name in mirror.files and isinstance(info.offset, int) and isinstance(info.length, int):
            out.append((name, info.offset, info.offset + info.length))
    return out
