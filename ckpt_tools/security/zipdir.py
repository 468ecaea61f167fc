"""A zip's records (name, data offset, size, CRC) read from its central directory and local
headers, without reading a record's bytes: ``torch.save`` files (:func:`zip_records`) and the
small in-file ``torch.save`` blobs of a DCP (:func:`blob_records`).

A many-rank job has hundreds of such files and tens of thousands of such blobs, alike but for
their data and CRCs: each reader keeps the layout it last read and checks a new zip against it
with a few compares of bytes, reading only the new CRCs, rather than parsing every entry again.
Anything but the plain case (zip64 entries, a comment, compression, encryption, data before the
zip) is left to :mod:`zipfile`, which reads it or says what is wrong.
"""

from __future__ import annotations

import functools
import operator
import os
import struct
import zipfile
from array import array
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from . import safefs
from ..errors import BadInput, Damaged

_CENTRAL = struct.Struct("<4s6H3I5H2I")  # a central directory entry's 46 fixed bytes
_END = struct.Struct("<4s4H2IH")  # the end of central directory record (22 bytes)


_U32 = struct.Struct("<I").unpack_from
# a blob length -> the structure of the last blob of that length read (see blob_records)
_BLOB_LAYOUTS: dict[int, tuple[tuple[Callable[[Any], tuple], tuple], tuple[tuple[str, int, int, int], ...]]] = {}


def blob_records(blob: bytes | memoryview) -> dict[str, tuple[int, int, int]] | None:
    """Name -> ``(offset, size, crc32)`` (offset within ``blob``) of the records of a small
    ``torch.save`` zip (a DCP item), read from its end record, central directory and local
    headers with no zipfile object (a many-rank DCP has one blob per tensor and rank). None for
    anything but the plain case (zip64, a comment, compression, encryption, a record outside
    the blob, names that disagree), which the zipfile path then reads or refuses.

    One tensor's items on every rank are the same zip but for their data and CRCs: a blob
    whose every byte this reads, CRC fields aside, equals those of the last blob of its length
    has that one's records (only its CRCs are read again), found by a compare at C speed per
    run of those bytes (:func:`matches`)."""
    n = len(blob)
    known = _BLOB_LAYOUTS.get(n)
    if known is not None and matches(blob, known[0]):
        return {name: (start, size, _U32(blob, crc_at)[0]) for name, start, size, crc_at in known[1]}
    regions: list[tuple[int, int]] = []
    records = _blob_records(blob, regions)
    if records is not None:
        if len(_BLOB_LAYOUTS) >= 1024:
            _BLOB_LAYOUTS.clear()
        _BLOB_LAYOUTS[n] = (_picked(blob, regions),
                            tuple((name, start, size, crc_at) for name, (start, size, crc_at) in records.items()))
        records = {name: (start, size, _U32(blob, crc_at)[0]) for name, (start, size, crc_at) in records.items()}
    return records


_MASKED = 64 << 10  # an item blob's fixed part is kept up to this size


def _picked(blob: bytes | memoryview, spans: Sequence[tuple[int, int]]) -> tuple[Callable[[Any], tuple], tuple]:
    """The bytes of ``spans`` (byte ranges, merged where they meet) as a picker of those runs
    and what it picks from ``blob``: :func:`matches` compares another blob of its length by them."""
    runs: list[slice] = []
    for a, b in sorted(spans):
        if runs and a <= runs[-1].stop:
            runs[-1] = slice(runs[-1].start, max(b, runs[-1].stop))
        elif b > a:
            runs.append(slice(a, b))
    # (in one call at C speed; a tuple however many runs: there is one at least)
    pick = operator.itemgetter(*runs) if len(runs) > 1 else lambda b, run=runs[0]: (b[run],)
    return pick, tuple(bytes(part) for part in pick(blob))  # (a view's parts copied: the blob may change)


def fixed_part(blob: bytes | memoryview, varying: tuple[str, ...]) -> tuple[Callable[[Any], tuple], tuple] | None:
    """Every byte of ``blob`` (a small zip :func:`blob_records` reads) but the bytes and CRC
    fields (central entry, data descriptor) of the records named ``varying``, as
    :func:`_picked` gives them: a blob of its length with these bytes is this zip but for
    those records' contents (their sizes, names and places too are where they are here). None
    for a blob over 64 KiB or one it does not read."""
    if len(blob) > _MASKED:
        return None
    records = _blob_records(blob, [])
    if records is None or not set(varying) <= records.keys():
        return None
    holes = []
    for name in varying:
        start, size, crc_at = records[name]
        holes += [(start, start + size), (crc_at, crc_at + 4)]
        end = start + size
        if size and bytes(blob[end:end + 4]) == b"PK\x07\x08":  # its data descriptor's CRC
            holes.append((end + 4, end + 8))
    spans, at = [], 0
    for a, b in sorted(holes):
        spans.append((at, a))
        at = max(at, b)
    spans.append((at, len(blob)))
    return _picked(blob, spans) if any(b > a for a, b in spans) else None


def matches(blob: bytes | memoryview, picked: tuple[Callable[[Any], tuple], tuple]) -> bool:
    """Whether ``blob`` (of the length of the blob ``picked`` was taken from) has the bytes
    :func:`_picked` took from that one: a compare at C speed per run."""
    return picked[0](blob) == picked[1]


def _blob_records(blob: bytes | memoryview, regions: list[tuple[int, int]]) -> dict[str, tuple[int, int, int]] | None:
    """:func:`blob_records`, each record's CRC given by where it lies; ``regions`` gets every
    byte range read, but the CRC fields."""
    n = len(blob)
    if n < _END.size:
        return None
    sig, disk, cd_disk, _count_here, count, cd_size, cd_offset, comment = _END.unpack_from(blob, n - _END.size)
    regions.append((n - _END.size, n))
    cd_end = cd_offset + cd_size
    if sig != b"PK\x05\x06" or disk or cd_disk or comment or cd_end not in (n - _END.size, n - _END.size - 76):
        return None
    if cd_end != n - _END.size:  # torch's writer adds a zip64 end record (56 bytes) and its locator (20)
        z64 = struct.unpack_from("<4sQ2H2I4Q", blob, cd_end)
        regions.append((cd_end, cd_end + 60))
        if (z64[0] != b"PK\x06\x06" or z64[6:] != (count, count, cd_size, cd_offset)
                or bytes(blob[cd_end + 56:cd_end + 60]) != b"PK\x06\x07"):
            return None
    records, at = {}, cd_offset
    for _ in range(count):
        if at + _CENTRAL.size > n:
            return None
        (sig, _made, _need, flags, method, _t, _d, _crc, csize, size, name_len, extra_len, comment_len,
         _disk, _iattr, _eattr, header) = _CENTRAL.unpack_from(blob, at)
        name_at = at + _CENTRAL.size
        name = bytes(blob[name_at:name_at + name_len])
        regions += [(at, at + 16), (at + 20, name_at + name_len)]  # (at + 16: the CRC)
        crc_at = at + 16
        at = name_at + name_len + extra_len + comment_len
        if sig != b"PK\x01\x02" or flags & 1 or method != zipfile.ZIP_STORED or csize != size or header + 30 > n:
            return None
        head = bytes(blob[header:header + 30])
        if head[:4] != b"PK\x03\x04":
            return None
        local_name, local_extra = struct.unpack_from("<HH", head, 26)
        start = header + 30 + local_name + local_extra
        regions.append((header, header + 30 + local_name))
        if bytes(blob[header + 30:header + 30 + local_name]) != name or start + size > cd_offset:
            return None
        records[name.decode("utf-8", "surrogateescape")] = (start, size, crc_at)
    return records if at == cd_end and len(records) == count else None


# not frozen, for a cheaper __init__: built per (tensor, rank) (see core.chunks.Location)
@dataclass(slots=True, unsafe_hash=True)
class Record:
    """A zip entry: ``name`` relative to the prefix; ``offset``: where its stored bytes start."""

    name: str
    offset: int
    size: int
    crc32: int


@dataclass(frozen=True, eq=False)
class _Columns:
    """A zip's records but their CRCs, as columns: ``index`` (name -> place, file order),
    ``offsets`` (ints: one object each, shared by every description of a chunk at it: a
    job's ranks of one layout), ``sizes``; ``end``, where the last byte of any record's data
    lies."""

    index: dict[str, int]
    offsets: tuple[int, ...]
    sizes: array
    end: int

    @classmethod
    def of(cls, entries: Sequence[tuple[str, int, int]]) -> _Columns:
        """From ``(name, data offset, size)`` per record, in file order. The index is shared with
        the last zip's of the same names (a job's rank files of other layouts: ~3 MB each at 25k
        records)."""
        names = [e[0] for e in entries]
        index = _NAMES.get(len(names))
        if index is None or list(index) != names:
            index = {name: i for i, name in enumerate(names)}
            if len(index) > _SMALL:
                _NAMES.clear()  # one kept (a job's kinds of file take turns only at its first ranks)
                _NAMES[len(index)] = index
        return cls(index, tuple([e[1] for e in entries]), array("q", [e[2] for e in entries]),
                   max((e[1] + e[2] for e in entries), default=0))


_NAMES: dict[int, dict[str, int]] = {}  # record count -> the last large zip's index of names


class Records(Mapping):
    """A zip's records (name -> :class:`Record`, file order), a :class:`Record` built when one is
    asked for: its names, offsets and sizes (``cols``) are shared with every zip of its layout
    (a job's rank files), its ``crcs`` are its own, 4 bytes a record. (A dict of Records cost
    ~120 bytes a record: 35 MB of a 256-rank job with its optimizer, kept while it is copied
    from.)"""

    __slots__ = ("_cols", "_crcs")

    def __init__(self, cols: _Columns, crcs: array) -> None:
        self._cols, self._crcs = cols, crcs

    def __getitem__(self, name: str) -> Record:
        cols = self._cols
        i = cols.index[name]
        return Record(name, cols.offsets[i], cols.sizes[i], self._crcs[i])

    def __contains__(self, name: object) -> bool:
        return name in self._cols.index

    def __iter__(self) -> Iterator[str]:
        return iter(self._cols.index)

    def __len__(self) -> int:
        return len(self._cols.index)

    def offset(self, name: str) -> int:
        """Where record ``name``'s data starts (KeyError for none), no Record built: the same int
        object for every zip of this one's layout."""
        return self._cols.offsets[self._cols.index[name]]

    def size(self, name: str) -> int | None:
        """How many bytes record ``name`` holds; None for no such record."""
        i = self._cols.index.get(name)
        return None if i is None else self._cols.sizes[i]

    @property
    def end(self) -> int:
        return self._cols.end

    def crcs_by_place(self) -> dict[tuple[int, int], int]:
        """``(offset, size) -> CRC-32`` of every record, built at C speed."""
        return dict(zip(zip(self._cols.offsets, self._cols.sizes), self._crcs))


def _crcs_at(central: bytes, fields: struct.Struct) -> array:
    """The CRC fields of a central directory, ``fields`` reading each at its place (a struct
    that skips the bytes between them), picked out at C speed."""
    return array("I", fields.unpack_from(central))


def _fields_at(places: Sequence[int], width: int, code: str) -> struct.Struct:
    """A struct reading one field of ``width`` bytes (``code``) at each of ``places`` (rising, at
    least ``width`` apart) and skipping the bytes between: ~32 bytes a field, where a slice and
    its ints cost ~120."""
    parts, at = ["<"], 0
    for place in places:
        parts.append(f"{place - at}x{code}" if place > at else code)
        at = place + width
    return struct.Struct("".join(parts))


def zip_records(path: Path) -> tuple[str, Records]:
    """The archive folder and the records (name -> :class:`Record`, file order) of the
    ``torch.save`` zip at ``path``, from its central directory and local headers alone: BadInput
    unless it is a regular file, a readable stored zip, and every record lies inside the file
    (a truncated or half-written file fails here). Reads no record's bytes."""
    with safefs.open_file(path) as f:  # a FIFO or device is refused, never waited on
        fd, file_size = f.fileno(), os.fstat(f.fileno()).st_size
        found = _plain_records(fd, file_size)
        if found is not None:
            prefix, records = found
            if records.end > file_size:
                name = next(n for n, rec in records.items() if rec.offset + rec.size > file_size)
                raise Damaged(f"{path}: record {name} runs past the end of the file (truncated?)")
            return prefix, records
        try:
            with zipfile.ZipFile(f) as zf:
                infos = zf.infolist()
        except (OSError, zipfile.BadZipFile, ValueError, EOFError) as e:
            raise BadInput(f"{path}: not a readable torch.save (zip) file: {e}") from None
        if not infos or "/" not in infos[0].filename:  # torch takes the first entry's folder
            raise BadInput(f"{path}: the zip has no archive folder; not a torch.save file")
        prefix = infos[0].filename.split("/", 1)[0]
        records: dict[str, Record] = {}  # (then as columns, as the plain case's)
        for info in infos:
            name = info.filename.removeprefix(prefix + "/")
            if name == info.filename or name in records:
                raise BadInput(f"{path}: stray or repeated zip entry {info.filename!r}")
            if info.compress_type != zipfile.ZIP_STORED or info.flag_bits & 1 or info.compress_size != info.file_size:
                raise BadInput(f"{path}: record {name} is compressed or encrypted; torch.save stores records")
            head = os.pread(fd, 30, info.header_offset)
            if len(head) < 30 or head[:4] != b"PK\x03\x04":
                raise BadInput(f"{path}: bad local header for record {name}")
            offset = info.header_offset + 30 + sum(struct.unpack("<HH", head[26:30]))
            if offset + info.file_size > file_size:
                raise Damaged(f"{path}: record {name} runs past the end of the file (truncated?)")
            records[name] = Record(name, offset, info.file_size, info.CRC)
    return prefix, Records(_Columns.of([(r.name, r.offset, r.size) for r in records.values()]),
                           array("I", [r.crc32 for r in records.values()]))


def _plain_records(fd: int, file_size: int) -> tuple[str, Records] | None:
    """:func:`zip_records` of the plain case, read with ``struct`` (zipfile's objects cost a
    many-rank job more than its bytes): one end record, no comment, nothing before the zip,
    every entry stored, unencrypted, 32-bit, named ``<prefix>/...`` once. None for anything
    else, which zipfile then reads, or refuses as the general case does.

    A job's rank files are the same zip but for their data, CRCs and archive folder (torch
    names it for the file): a file whose central directory, those aside, and local headers'
    lengths equal the last such file's (of the same directory size and record count) has its
    records, with its own CRCs and folder, and its own sizes and places where its ranks hold
    other rows (:func:`_same_layout`)."""
    tail = min(file_size, _END.size + 76)
    end = os.pread(fd, tail, file_size - tail)
    if len(end) != tail or tail < _END.size:
        return None
    sig, disk, cd_disk, here, count, cd_size, cd_offset, comment = _END.unpack_from(end, tail - _END.size)
    cd_end = cd_offset + cd_size
    if sig != b"PK\x05\x06" or disk or cd_disk or comment or 0xFFFF in (count, here) or 0xFFFFFFFF in (cd_size, cd_offset):
        return None
    if cd_end != file_size - _END.size:  # torch's writer adds a zip64 end record (56 bytes) and its locator (20)
        if cd_end != file_size - _END.size - 76:
            return None
        z64 = struct.unpack_from("<4sQ2H2I4Q", end, 0)
        if z64[0] != b"PK\x06\x06" or z64[6:] != (count, count, cd_size, cd_offset) or end[56:60] != b"PK\x06\x07":
            return None
    central = os.pread(fd, cd_size, cd_offset)
    if len(central) != cd_size:
        return None
    key = (cd_size, count)
    known = _ZIP_LAYOUTS.get(key)
    if type(known) is _ZipLayout:
        same = _same_layout(fd, central, known)
        if same is not None:
            prefix, layout = same
            if layout is not known:  # (a file of other rows: the files after it that hold its rows share its)
                _ZIP_LAYOUTS[key] = layout
            return prefix, Records(layout.columns, _crcs_at(central, layout.crc_fields))
    read = _read_layout(fd, central, count)
    if read is None:
        return None
    prefix, layout, crcs = read
    # kept once a second zip of its directory's size has it too (the first is only noted, by a
    # fingerprint: its directory but for each file's own values, which a job's ranks holding
    # other rows share): files that are all unlike keep no layout of 25k records each (~10 MB)
    mark = hash(layout.masked)
    _ZIP_LAYOUTS.pop(key, None)
    _ZIP_LAYOUTS[key] = layout if count <= _SMALL or known == mark else mark
    while len(_ZIP_LAYOUTS) > _LAYOUTS_KEPT:  # the oldest go (a job's kinds of file take turns)
        del _ZIP_LAYOUTS[next(iter(_ZIP_LAYOUTS))]
    return prefix, Records(layout.columns, crcs)


@dataclass(frozen=True)
class _ZipLayout:
    """What :func:`_plain_records` read of a zip, but its CRCs and folder: ``masked``, its
    central directory (as a little-endian int) with the values of each file's own cleared by
    ``mask`` (its records' CRCs, sizes, local headers' places and data-descriptor flags, and
    the folder's bytes at the start of each name: ``name_at``, ``folder_len`` bytes); whether
    names are UTF-8; its records' ``columns`` (names in the folder) and where their CRC
    fields lie (``crc_at``); each local header's place and length fields."""

    mask: int
    masked: int
    name_at: array
    folder_len: int
    utf8: bool
    columns: _Columns
    crc_at: array
    places: array  # each record's two sizes and local header's place, as its directory has them
    lens: bytes
    checks: tuple[tuple[int, int, Callable[[bytes], tuple[int, ...]], tuple[int, ...]], ...] | None = None

    @property
    def headers(self) -> array:
        return self.places[2::3]

    # built once a later zip is checked against it (most layouts read are never kept)
    @functools.cached_property
    def crc_fields(self) -> struct.Struct:
        return _fields_at(self.crc_at, 4, "I")

    @functools.cached_property
    def folder_fields(self) -> struct.Struct:
        return _fields_at(self.name_at, self.folder_len, f"{self.folder_len}s")

    @functools.cached_property
    def place_fields(self) -> struct.Struct:
        """Each record's compressed and plain size and its local header's place, in turn."""
        return _fields_at([at + k for at in self.crc_at for k in (4, 8, 26)], 4, "I")


def _same_layout(fd: int, central: bytes, known: _ZipLayout) -> tuple[str, _ZipLayout] | None:
    """The archive folder of a zip whose central directory is ``central`` and its layout, if
    that is ``known``'s: the same bytes but for CRCs, sizes, local headers' places and one
    folder, each record stored (its two sizes one). Its layout is ``known`` where its sizes and
    places are too (a job's ranks of one layout share its records; its local headers of the
    same lengths), else ``known`` with its own sizes and places, from its local headers (ranks
    that hold other rows: read as :func:`_read_layout` reads them). None for any other."""
    folders = known.folder_fields.unpack_from(central)
    folder = folders[0]
    if b"/" in folder or b"\x00" in folder or folders.count(folder) != len(folders):
        return None
    if int.from_bytes(central, "little") & known.mask != known.masked:
        return None
    places = array("I", known.place_fields.unpack_from(central))
    if places != known.places:
        # other rows: its own sizes, and its records' places from its own local headers (torch
        # pads each one's extra field to align the data, so their lengths move with their places)
        sizes, headers = array("q", places[1::3]), array("q", places[2::3])
        if places[0::3] != places[1::3] or 0xFFFFFFFF in places:
            return None
        heads = _local_heads(fd, headers)
        if heads is None:
            return None
        lens = b"".join([h[26:30] for h in heads])
        offsets = tuple([at + 30 + n + e for at, (n, e) in zip(headers, struct.iter_unpack("<HH", lens))])
        columns = _Columns(known.columns.index, offsets, sizes, max(map(operator.add, offsets, sizes), default=0))
        mine = replace(known, columns=columns, places=places, lens=lens,
                       checks=None if known.checks is None else _head_checks(headers, heads))
        mine.__dict__.update({k: v for k, v in known.__dict__.items() if k.endswith("_fields")})  # (its structs)
        known = mine
    elif known.checks is not None:  # each window's signature and length bytes picked out at once, in C
        for base, length, pick, want in known.checks:
            window = os.pread(fd, length, base)
            if len(window) != length or pick(window) != want:
                return None
    else:
        heads = _local_heads(fd, known.headers)
        if heads is None or b"".join([h[26:30] for h in heads]) != known.lens:
            return None
    try:
        return folder.decode("utf-8" if known.utf8 else "cp437"), known
    except UnicodeDecodeError:
        return None


# (central directory's size, records) -> the layout, or where the one zip of that key read so
# far was not kept, its layout's fingerprint
_ZIP_LAYOUTS: dict[tuple[int, int], _ZipLayout | int] = {}
_LAYOUTS_KEPT = 8  # a layout of 25k records holds ~10 MB
_SMALL = 4096  # records of a layout kept from the first zip of its kind
_NEAR = 4096  # local headers at most this far apart are read by one pread (a page apiece at most)
_WINDOW = 8 << 20  # of at most this many bytes


def _runs(headers: Sequence[int]) -> Iterator[tuple[int, int, int, int]]:
    """``(i, j, base, length)``: the window of ``headers[i:j]``, each within _NEAR of the last
    (small records lie close together), read by one pread."""
    i, n = 0, len(headers)
    while i < n:
        j = i + 1
        base = headers[i]
        while j < n and 0 <= headers[j] - headers[j - 1] <= _NEAR and headers[j] - base < _WINDOW:
            j += 1
        yield i, j, base, headers[j - 1] + 30 - base
        i = j


def _local_heads(fd: int, headers: Sequence[int]) -> list[bytes] | None:
    """The 30 fixed bytes of the local header at each offset; None unless each is there whole,
    a local header's signature first."""
    heads: list[bytes] = []
    for i, j, base, length in _runs(headers):
        window = os.pread(fd, length, base)
        heads += [window[h - base:h - base + 30] for h in headers[i:j]]
    return heads if all(len(h) == 30 and h[:4] == b"PK\x03\x04" for h in heads) else None


_CHECKED = (0, 1, 2, 3, 26, 27, 28, 29)  # a local header's signature, and its name and extra lengths


def _head_checks(headers: Sequence[int], heads: Sequence[bytes]) -> tuple:
    """Per window of :func:`_runs`: its place, length, a picker of the checked bytes of each of
    its headers and what they are in ``heads``; for a later zip of the same layout."""
    checks = []
    for i, j, base, length in _runs(headers):
        pick = operator.itemgetter(*[h - base + k for h in headers[i:j] for k in _CHECKED])
        checks.append((base, length, pick, tuple(head[k] for head in heads[i:j] for k in _CHECKED)))
    return tuple(checks)


def _read_layout(fd: int, central: bytes, count: int) -> tuple[str, _ZipLayout, array] | None:
    """:func:`_plain_records`' full read of a central directory and its local headers: the
    archive folder, the layout and the records' CRCs."""
    entries, names, prefix, at = [], set(), None, 0
    keep = bytearray(b"\xff") * len(central)  # the mask's bytes: 0 where a file's own values lie
    name_at, crc_at, headers, crcs = array("q"), array("q"), array("q"), array("I")
    folder_len, utf8 = 0, False
    for _ in range(count):
        if at + _CENTRAL.size > len(central):
            return None
        (sig, _made, _need, flags, method, _t, _d, crc, csize, size, name_len, extra_len, comment_len,
         disk, _iattr, _eattr, header) = _CENTRAL.unpack_from(central, at)
        raw = central[at + _CENTRAL.size:at + _CENTRAL.size + name_len]
        # its own: its CRC, sizes and local header's place, and whether its sizes follow its data
        # (flag 8: a writer's choice per record, an empty one's not; no reader here takes them there)
        keep[at + 8] = 0xFF ^ 0x08
        keep[at + 16:at + 28] = bytes(12)
        keep[at + 42:at + 46] = bytes(4)
        crcs.append(crc)
        crc_at.append(at + 16)
        name_at.append(at_name := at + _CENTRAL.size)
        at += _CENTRAL.size + name_len + extra_len + comment_len
        if (sig != b"PK\x01\x02" or flags & 1 or method != zipfile.ZIP_STORED or csize != size or disk
                or 0xFFFFFFFF in (size, header) or len(raw) != name_len):
            return None
        try:
            full = raw.decode("utf-8" if flags & 0x800 else "cp437")
        except UnicodeDecodeError:
            return None
        if "\x00" in full:  # zipfile cuts a name there
            return None
        if prefix is None:
            if "/" not in full:
                return None
            prefix = full.split("/", 1)[0]
            folder_len, utf8 = raw.index(b"/"), bool(flags & 0x800)
        name = full.removeprefix(prefix + "/")
        if name == full or name in names or bool(flags & 0x800) != utf8:
            return None
        names.add(name)
        keep[at_name:at_name + folder_len] = bytes(folder_len)
        headers.append(header)
        entries.append((name, header, size))
    if at != len(central) or prefix is None:
        return None
    heads = _local_heads(fd, headers)
    if heads is None:
        return None
    records = []
    for (name, header, size), head in zip(entries, heads):
        local_name, local_extra = struct.unpack_from("<HH", head, 26)
        records.append((name, header + 30 + local_name + local_extra, size))
    mask = int.from_bytes(keep, "little")
    checks = _head_checks(headers, heads) if count <= _SMALL else None  # (~300 bytes a record)
    # (its places as arrays, its header lengths as one string: a layout of 25k records held
    # ~11 MB in tuples of ints, slices and strings, now ~6 MB, most of it its two masks)
    places = array("I", [v for _, header, size in entries for v in (size, size, header)])
    return prefix, _ZipLayout(mask, int.from_bytes(central, "little") & mask, name_at, folder_len, utf8,
                              _Columns.of(records), crc_at, places, b"".join([h[26:30] for h in heads]),
                              checks), crcs


def records_of(path: Path) -> tuple[str, Records]:
    """:func:`zip_records`, read once per process while the file is unchanged (a many-rank job's
    files are described, then copied from, record by record)."""
    st = os.stat(path)
    return _records(str(path), st.st_size, st.st_mtime_ns, st.st_ino)


@functools.lru_cache(maxsize=1024)
def _records(path: str, size: int, mtime_ns: int, ino: int) -> tuple[str, Records]:
    return zip_records(Path(path))
