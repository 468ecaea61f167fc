"""``torch.save`` zip files written without importing torch: the pickle (emitted by
:mod:`.torchpickler` exactly as torch's pickler would) and the data records laid out as torch's
``PyTorchStreamWriter`` (miniz) does, records copied file-to-file by ``os.copy_file_range``.
Round trips of the fixtures are byte-identical.
"""

from __future__ import annotations

import mmap
import os
import struct
import zlib
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from ..errors import BadInput
from ..security import safefs
from ..security.torchfile import _MAX32
from ..storage.diskio import Flusher, copy_range, open_files_cap, write_all

try:  # zlib-ng's CRC-32 (carry-less multiply) runs 4-5x faster than the system zlib's
    from zlib_ng.zlib_ng import crc32
except ImportError:
    from zlib import crc32


_CRC_POLY, _M64 = 0xEDB88320, (1 << 64) - 1


def _multmodp(a: int, b: int) -> int:
    """a * b modulo the (bit-reflected) CRC-32 polynomial; zlib's multmodp."""
    m, p = 1 << 31, 0
    while True:
        if a & m:
            p ^= b
            if (a & (m - 1)) == 0:
                return p
        m >>= 1
        b = (b >> 1) ^ _CRC_POLY if b & 1 else b >> 1


_X2N = [1 << 30]  # x^(2^k) mod p, k = 0..63
for _ in range(63):
    _X2N.append(_multmodp(_X2N[-1], _X2N[-1]))


def crc32_combine(crc1: int, crc2: int, len2: int) -> int:
    """CRC-32 of A+B from crc(A), crc(B) and len(B), in O(log len2) (zlib's crc32_combine): a record
    that concatenates whole source records gets its CRC without re-reading their bytes."""
    p, k = 1 << 31, 3  # x^0; a byte is 2^3 bits
    while len2:
        if len2 & 1:
            p = _multmodp(_X2N[k & 63], p)
        len2, k = len2 >> 1, k + 1
    return _multmodp(p, crc1) ^ crc2


def _hash_combine(seed: int, value: int) -> int:  # c10::hash_combine on a 64-bit size_t
    return seed ^ ((value + 0x9E3779B9 + (seed << 6) + (seed >> 2)) & _M64)


def _folded(size: int, crc: int, head: bytes) -> tuple[int, ...]:
    """What a record adds to the CRC half of torch's serialization id, in order: its CRC (if
    it has bytes), after the 4 bytes that follow a head torch mistakes for a data descriptor."""
    mistaken = (int.from_bytes(head[4:8], "little"),) if head[:4] == b"PK\x07\x08" and len(head) >= 8 else ()
    return mistaken + (crc,) if size else mistaken


def parts_size(parts: Sequence[tuple]) -> int:
    """Bytes in all of a record's ``parts``."""
    return parts[0][2] if len(parts) == 1 else sum(p[2] for p in parts)


PAGE = 4096
SMALL_RECORD = 256 << 10  # records up to this size are copied through memory (see copy_record)
# Sources.read: small ranges read ahead, in windows of 16x the range (64 KiB-1 MiB), 8 files' kept
_AHEAD_PER, _AHEAD_MIN, _AHEAD_MAX, _WINDOWS_KEPT = 16, 64 << 10, 1 << 20, 8
_MAX_OPEN = open_files_cap()  # source files a writer keeps open at once
_BUFFER = 1 << 20  # bytes gathered before a write
_SID = ".data/serialization_id"
# a zip's fixed-size headers: the local header, the 'FB' extra's head, the data descriptor
# (zip64 and not), the central directory entry
_LOCAL, _PAD = struct.Struct("<IHHHHHIIIHH"), struct.Struct("<HH")
_DESCRIPTOR, _DESCRIPTOR64 = struct.Struct("<IIII"), struct.Struct("<IIQQ")
_CENTRAL = struct.Struct("<IHHHHHHIIIHHHHHII")
_U32 = struct.Struct("<I")
Part = tuple[str | os.PathLike, int, int] | tuple[str | os.PathLike, int, int, int]


class Sources:
    """Source files open for :meth:`TorchZipWriter.copy_record`, with their sizes: opened once
    per writer, or once per output file when its writers share one (a DCP file of a many-rank
    save is thousands of item zips, each copying a few rows from the same source files)."""

    def __init__(self) -> None:
        self._fds: dict[Any, int] = {}
        self._sizes: dict[int, int] = {}  # by descriptor (the sources do not change while copied: stamps)
        self._windows: dict[int, tuple[int, bytes]] = {}  # by descriptor: the last bytes read ahead

    def read(self, fd: int, offset: int, length: int) -> bytes:
        """``length`` bytes at ``offset`` of a (small) source range: from the bytes last read
        ahead of ``fd`` where they lie there, else one ``pread`` of up to ``_AHEAD_PER`` times
        as many bytes (at least ``_AHEAD_MIN``, at most ``_AHEAD_MAX``). The rows a record takes
        from one source file lie in record after record of it: read one by one, they cost a
        call each (a 256-rank reshard: 290k of them); read ahead, one per window."""
        window = self._windows.get(fd)
        if window is not None:
            at = offset - window[0]
            if 0 <= at and at + length <= len(window[1]):
                return window[1][at:at + length]
        ahead = min(max(length * _AHEAD_PER, _AHEAD_MIN), _AHEAD_MAX, self._sizes[fd] - offset)
        if ahead <= length:
            return os.pread(fd, length, offset)
        data = os.pread(fd, ahead, offset)
        if len(self._windows) >= _WINDOWS_KEPT and fd not in self._windows:
            del self._windows[next(iter(self._windows))]
        self._windows[fd] = (offset, data)
        return data[:length]

    def check(self, parts: Sequence[Part]) -> None:
        """BadInput unless every range of ``parts`` lies within its file."""
        for part in parts:
            self.checked(part)

    def checked(self, part: Part) -> int:
        """The descriptor of ``part``'s file, BadInput unless its range lies within it. (A
        descriptor is asked for where it is used: Sources closes its files to open more.)"""
        path, start, length = part[0], part[1], part[2]
        fd = self._fds.get(path)
        if fd is None:
            fd = self.fd(path)
        end = self._sizes[fd]
        if not (type(start) is int and type(length) is int and 0 <= start and 0 <= length and start + length <= end):
            safefs.check_span(start, length, end, what=str(path))  # (raises)
        return fd

    def small(self, parts: Sequence[Part], size: int) -> tuple[bytes, int]:
        """The bytes of a small record made of ``parts`` (``size`` in all) and their CRC-32:
        zlib's over the bytes (for a few KiB, cheaper than combining known CRCs in Python), or
        where parts carry known CRCs (``TorchZip.part``) and a part's bytes fail theirs, the
        known ones combined: a damaged source record stays detectably damaged, never re-blessed.
        (Asked per record of a many-rank job's rank files: each range checked as it is read.)"""
        blobs = [self.read(self.checked(part), part[1], part[2]) for part in parts]
        if not blobs:  # (an empty piece: a rank that holds none of a tensor's rows)
            return b"", 0
        data = blobs[0] if len(blobs) == 1 else b"".join(blobs)
        if len(data) != size:
            raise BadInput(f"{parts[0][0]}: a byte range ends before its file does; was it truncated?")
        crc = crc32(data)
        if len(parts[0]) == 4 and all(len(p) == 4 for p in parts) and (
                crc != parts[0][3] if len(parts) == 1
                else any(crc32(blob) != part[3] for blob, part in zip(blobs, parts))):
            crc = 0  # damaged: the known CRCs combined
            for part in parts:
                crc = crc32_combine(crc, part[3], part[2])
        return data, crc

    def fd(self, path: Any) -> int:
        fd = self._fds.get(path)
        if fd is None:
            if len(self._fds) >= _MAX_OPEN:
                self.close()
            fd = self._fds[path] = os.open(path, os.O_RDONLY)
            self._sizes[fd] = os.fstat(fd).st_size
        return fd

    def size(self, fd: int) -> int:
        return self._sizes[fd]

    def close(self) -> None:
        for fd in self._fds.values():
            os.close(fd)
        self._fds.clear()
        self._sizes.clear()
        self._windows.clear()

    def __enter__(self) -> Sources:
        return self

    def __exit__(self, *_: Any) -> None:
        self.close()


class TorchZipWriter:
    """Writes a zip laid out byte-for-byte as torch's PyTorchStreamWriter does: each record's data
    aligned by padding the local header's extra field (``'FB' <u16 n> 'Z'*n``), CRC and sizes in a
    data descriptor, zip64 extras only for sizes or offsets >= 4 GiB, always a zip64 end record.
    Record names are relative to ``prefix`` ("data.pkl", "data/0") and kept in the caller's order;
    ``close`` adds ``version`` (and ``byteorder``) if missing, then ``.data/serialization_id``."""

    def __init__(self, path: str | os.PathLike, prefix: str, *, alignment: int = 64, page_phase: bool = False,
                 fd: int | None = None, flusher: Flusher | None = None, sources: Sources | None = None) -> None:
        self.path, self.prefix, self.alignment = Path(path), prefix, alignment
        # copy_record puts the data of each record it has the kernel copy (over SMALL_RECORD) at its
        # first source's offset within a page, not at the next multiple of ``alignment``
        # (padding of up to a page; the file then differs from torch.save's, and loads the same)
        self.page_phase = page_phase
        # with ``fd`` (open for writing at its end), the zip is appended to a larger file, as
        # torch.save into an open stream does (a DCP item): offsets count from where it starts,
        # and the caller keeps the fd (an incomplete zip is the caller's to discard)
        self._own = fd is None
        self._fd: int | None = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644) if fd is None else fd
        # the file is flushed to disk while it is written (the caller's flusher for a shared fd)
        self._flusher = Flusher(self._fd) if fd is None else flusher
        self._pos, self._central, self._names = 0, bytearray(), set()
        self._crc_hash = 0  # the CRC half of the serialization id, folded as torch does
        # source files open for copy_record: the caller's (it closes them), else this writer's
        self._own_sources = sources is None
        self._sources = Sources() if sources is None else sources
        self._buf = bytearray()  # written, not yet at the fd (see _write)
        self._prefix_slash = f"{prefix}/".encode()

    def __enter__(self) -> TorchZipWriter:
        return self

    def __exit__(self, exc_type: Any, *_: Any) -> None:
        self._close_srcs()
        if self._fd is not None and exc_type is None:
            self.close()
        elif self._fd is not None and not self._own:
            self._fd = None
        elif self._fd is not None:  # incomplete: leave nothing that looks like a checkpoint
            self._flusher.close(check=False)
            os.close(self._fd)
            self._fd = None
            self.path.unlink(missing_ok=True)

    def _write(self, data: bytes | bytearray | memoryview) -> None:
        # headers, descriptors and small records gather here: a DCP rank file of a many-rank
        # save holds thousands of small zips, seven writes each unbuffered
        n = len(data)
        self._pos += n
        if n >= _BUFFER:
            self._flush()
            write_all(self._fd, data, self._flusher)
            return
        self._buf += data
        if len(self._buf) >= _BUFFER:
            self._flush()

    def _flush(self) -> None:
        if self._buf:
            write_all(self._fd, self._buf, self._flusher)
            self._buf.clear()

    @staticmethod
    def _zip64(size: int, ofs: int, comp: int) -> bytes:
        """miniz's zip64 extra: sizes when the size is >= 4 GiB (in a local header the compressed
        size is still 0 then), the local header offset when that is."""
        fields = (struct.pack("<QQ", size, comp) if size >= _MAX32 else b"") + (
            struct.pack("<Q", ofs) if ofs >= _MAX32 else b"")
        return struct.pack("<HH", 1, len(fields)) + fields if fields else b""

    def _begin(self, name: str, size: int, phase: int | None = None) -> tuple[bytes, int]:
        full, ofs, header = self._header(name, size, phase)
        self._write(header)
        return full, ofs

    def _header(self, name: str, size: int, phase: int | None = None) -> tuple[bytes, int, bytes]:
        """A record's full name, offset and local header, at the current position."""
        if self._fd is None or name in self._names:
            raise ValueError(f"record {name!r} written twice, or the writer is closed")
        self._names.add(name)
        full, ofs = f"{self.prefix}/{name}".encode(), self._pos
        zip64 = self._zip64(size, ofs, 0) if size >= _MAX32 or ofs >= _MAX32 else b""
        data = ofs + 30 + len(full) + len(zip64) + 4
        pad = -data % self.alignment
        if phase is not None and phase % self.alignment == 0:
            # data at the source's offset within a page: the kernel then copies whole pages
            # (about 1.5x faster here); still a multiple of the alignment torch asks for
            pad = (phase - data) % PAGE
        extra = zip64 + _PAD.pack(0x4246, pad) + b"Z" * pad  # 'FB' <u16 pad> 'Z' * pad
        flags = 0x0808 if size else 0x0800  # UTF-8 names; a data descriptor follows unless empty
        return full, ofs, _LOCAL.pack(0x04034B50, 0, flags, 0, 0, 0, 0, 0, 0, len(full), len(extra)) + full + extra

    def _end(self, full: bytes, ofs: int, size: int, crc: int, head: bytes) -> None:
        self._write(self._trailer(full, ofs, size, crc, head))

    def _trailer(self, full: bytes, ofs: int, size: int, crc: int, head: bytes) -> bytes:
        """A record's data descriptor (after its bytes), its central entry noted, its CRC
        folded into the serialization id."""
        for value in _folded(size, crc, head):
            self._crc_hash = _hash_combine(self._crc_hash, value)
        if size >= _MAX32 or ofs >= _MAX32:
            descriptor = _DESCRIPTOR64.pack(0x08074B50, crc, size, size) if size else b""
            extra = self._zip64(size, ofs, size)
        else:
            descriptor = _DESCRIPTOR.pack(0x08074B50, crc, size, size) if size else b""
            extra = b""
        self._central += _CENTRAL.pack(
            0x02014B50, 0, 0, 0x0808 if size else 0x0800, 0, 0, 0, crc, min(size, _MAX32),
            min(size, _MAX32), len(full), len(extra), 0, 0, 0, 0, min(ofs, _MAX32)) + full + extra
        return descriptor

    def write_record(self, name: str, data: bytes) -> None:
        """A record from memory (the pickle, the small text records). Like torch, skips
        ``.data/serialization_id``: ``close`` writes the id for this file's contents."""
        if name != _SID:
            self._in_memory(name, data, zlib.crc32(data))

    def _in_memory(self, name: str, data: bytes | bytearray, crc: int) -> None:
        """A record of ``data`` (CRC-32 ``crc``): its header, bytes and descriptor in one
        write (a many-rank job's rank files hold hundreds of thousands of records of a few KiB:
        :meth:`_header` and :meth:`_trailer` as one, for a record below 4 GiB that starts there)."""
        size, ofs = len(data), self._pos
        if size >= _MAX32 or ofs >= _MAX32 or not size or self._fd is None or name in self._names:
            full, ofs, header = self._header(name, size)
            self._write(b"".join((header, data, self._trailer(full, ofs, size, crc, data[:8]))))
            return
        self._names.add(name)
        full = self._prefix_slash + name.encode()
        pad = -(ofs + 34 + len(full)) % self.alignment
        h = self._crc_hash
        if data[:4] == b"PK\x07\x08" and size >= 8:  # (see _folded)
            h = _hash_combine(h, int.from_bytes(data[4:8], "little"))
        self._crc_hash = h ^ ((crc + 0x9E3779B9 + (h << 6) + (h >> 2)) & _M64)  # _hash_combine(h, crc)
        self._central += _CENTRAL.pack(0x02014B50, 0, 0, 0x0808, 0, 0, 0, crc, size, size, len(full), 0, 0, 0, 0, 0,
                                       ofs)
        self._central += full
        self._write(b"".join((_LOCAL.pack(0x04034B50, 0, 0x0808, 0, 0, 0, 0, 0, 0, len(full), pad + 4), full,
                              _PAD.pack(0x4246, pad), b"Z" * pad, data, _DESCRIPTOR.pack(0x08074B50, crc, size, size))))

    def _by_parts(self, name: str, data: bytes | bytearray, crc: int) -> None:
        """:meth:`_in_memory` through :meth:`_begin`, a write and :meth:`_end` (each record
        noted by a :class:`_Capture`)."""
        full, ofs = self._begin(name, len(data))
        self._write(data)
        self._end(full, ofs, len(data), crc, bytes(data[:8]))

    def write_stream(self, name: str, size: int, chunks: Any) -> None:
        """A record of ``size`` bytes from an iterable of buffers (a cast, block by block), its
        CRC computed as they pass."""
        full, ofs = self._begin(name, size)
        crc, head, n = 0, b"", 0
        for chunk in chunks:
            if len(head) < 8:
                head += bytes(chunk[:8 - len(head)])
            crc = crc32(chunk, crc)
            self._write(chunk)
            n += len(chunk)
        if n != size:
            raise ValueError(f"record {name!r}: {n} bytes streamed, {size} announced")
        self._end(full, ofs, size, crc, head)

    def copy_record(self, name: str, parts: Sequence[Part]) -> None:
        """A record made of byte ranges ``(path, offset, length)`` of other files, concatenated and
        copied kernel-side by ``os.copy_file_range`` (read/write in 1 MiB chunks where that fails).
        Its CRC is zlib's over an mmap of the sources; or, when every part carries a 4th item, its
        known CRC-32 (``TorchZip.part``), the CRCs are combined without reading the bytes at all,
        which also keeps a damaged source record detectably damaged instead of re-blessing it.
        Records up to 256 KiB are read, CRC'd by zlib and written from memory, aligned as torch
        aligns them (a page phase pads, and gains nothing where the kernel does not copy)."""
        if name == _SID:
            return
        sources = self._sources
        size = parts_size(parts)
        if size <= SMALL_RECORD:
            # a small record (a few rows of a tensor of a many-rank save): read, CRC'd and written
            # here; a thread hand-off and a kernel copy per record cost more than the bytes
            data, crc = sources.small(parts, size)
            self._in_memory(name, data, crc)  # (through memory: a page phase would only pad)
            return
        known = all(len(p) == 4 for p in parts)
        sources.check(parts)  # every range checked first: the CRC thread maps them
        full, ofs = self._begin(name, size, phase=parts[0][1] % PAGE if self.page_phase else None)
        # the CRC is computed by another thread while the kernel copies (zlib releases the GIL)
        crc_job = None if known else _crc_pool().submit(_crc_of_parts, [tuple(p[:3]) for p in parts])
        head = b""
        try:
            for part in parts:
                path, start, length = part[0], part[1], part[2]
                fd = sources.fd(path)
                if len(head) < 8:
                    head += os.pread(fd, min(length, 8 - len(head)), start)
                self._copy(fd, start, length, path)
        except BaseException:
            if crc_job is not None:
                crc_job.cancel()  # (a CRC already running only reads; its result is dropped)
            raise
        crc = crc_job.result() if crc_job is not None else 0
        if known:
            for part in parts:
                crc = crc32_combine(crc, part[3], part[2])
        self._end(full, ofs, size, crc, head)

    def _close_srcs(self) -> None:
        if self._own_sources:
            self._sources.close()

    def _copy(self, src: int, start: int, length: int, path: Any) -> None:
        self._flush()
        copy_range(src, self._fd, start, length, what=path, flusher=self._flusher)
        self._pos += length

    def close(self, name_hash: str | None = None) -> str:
        """Finish like torch's ``writeEndOfFile``; returns the serialization id written.

        The id is 20 digits hashing the record names, then 20 folding the record CRCs. The CRC half
        is torch's exactly; the name half torch takes from ``std::hash`` over a
        ``std::unordered_set``'s iteration order, which is not reproduced here: pass ``name_hash``
        (the source's first 20 digits, when the record names are the same) to match it."""
        if self._fd is None:
            raise ValueError("the writer is already closed")
        self._close_srcs()
        if not {"version", ".data/version"} & self._names:
            self.write_record("version", b"3\n")
        if "byteorder" not in self._names:
            self.write_record("byteorder", b"little")
        if name_hash is None:
            own = 0
            for c in map(zlib.crc32, map(str.encode, sorted(self._names))):
                own ^= (c + 0x9E3779B9 + (own << 6) + (own >> 2)) & _M64  # _hash_combine(own, c)
            name_hash = f"{own:020d}"
        if len(name_hash) != 20 or not name_hash.isdigit():
            raise ValueError(f"name_hash must be 20 digits, not {name_hash!r}")
        sid = f"{name_hash}{self._crc_hash:020d}".encode()
        full, ofs = self._begin(_SID, len(sid))
        self._write(sid)
        self._end(full, ofs, len(sid), zlib.crc32(sid), sid[:8])
        n, cd_ofs, cd_size = len(self._names), self._pos, len(self._central)
        self._write(self._central)
        self._write(struct.pack("<IQHHIIQQQQ", 0x06064B50, 44, 0x031E, 0x002D, 0, 0, n, n, cd_size, cd_ofs)
                    + struct.pack("<IIQI", 0x07064B50, 0, self._pos, 1)
                    + struct.pack("<IHHHHIIH", 0x06054B50, 0, 0, min(n, 0xFFFF), min(n, 0xFFFF),
                                  min(cd_size, _MAX32), min(cd_ofs, _MAX32), 0))
        self._flush()
        if self._own:
            try:
                self._flusher.close()
            finally:
                os.close(self._fd)
        self._fd = None
        return sid.decode()


class _Capture(TorchZipWriter):
    """A writer whose bytes stay in memory, noting where each record's data, CRC fields and
    contribution to the serialization id fall (for :class:`ZipTemplate`)."""

    def __init__(self, prefix: str, alignment: int) -> None:
        super().__init__(Path(os.devnull), prefix, alignment=alignment, fd=-1)
        self.out = bytearray()
        self.noted: dict[str, tuple] = {}  # name -> (data start, descriptor, central entry, hash before, folds)
        self.central_at = -1

    def _write(self, data: bytes | bytearray | memoryview) -> None:
        if data is self._central:
            self.central_at = self._pos
        self._pos += len(data)
        self.out += data

    def _flush(self) -> None:
        pass

    _in_memory = TorchZipWriter._by_parts  # (each record through _end, which notes it)

    def _end(self, full: bytes, ofs: int, size: int, crc: int, head: bytes) -> None:
        if size >= _MAX32 or ofs >= _MAX32:
            raise ValueError("a template is for small zips")
        name = full.decode()[len(self.prefix) + 1:]
        self.noted[name] = (self._pos - size, self._pos if size else None, len(self._central), self._crc_hash,
                            _folded(size, crc, head))
        super()._end(full, ofs, size, crc, head)


class ZipTemplate:
    """The torch.save zip of ``records`` (name, bytes) then a record ``name`` of ``size``
    bytes, closed with ``name_hash`` as :meth:`TorchZipWriter.close` closes it, offsets from
    its own start (a DCP item), as bytes with a hole: :meth:`render` fills in the record's bytes,
    its CRC (descriptor and central entry) and the serialization id that CRC changes. A
    many-rank DCP holds thousands of items of one dtype and shape; written record by record,
    each cost ~40 µs of headers in Python. Byte-for-byte the writer's, which builds it."""

    def __init__(self, prefix: str, records: Sequence[tuple[str, bytes]], name: str, size: int, name_hash: str,
                 *, alignment: int = 64) -> None:
        cap = _Capture(prefix, alignment)
        for rec, data in records:
            cap.write_record(rec, data)
        cap.write_record(name, bytes(size))  # (its CRC and what it folds into the id: render's)
        cap.close(name_hash=name_hash)
        noted, sid = cap.noted[name], cap.noted[_SID]
        if cap.central_at < 0 or len(cap.out) > SMALL_RECORD + (64 << 10):
            raise ValueError("not a small zip")
        self.size, self.name_hash, self._bytes = size, name_hash, bytes(cap.out)
        self._data, self._descriptor, self._hash = noted[0], noted[1], noted[3]
        self._central = cap.central_at + noted[2] + 16  # (the CRC field of the central entry)
        # what the records after it add to the id before close computes it
        self._after = [v for rec, n in cap.noted.items() if n[0] > noted[0] and rec != _SID for v in n[4]]
        self._sid, self._sid_descriptor, self._sid_central = sid[0], sid[1], cap.central_at + sid[2] + 16

    def render(self, data: bytes, crc: int) -> bytearray:
        """The zip with ``data`` (``size`` bytes, CRC-32 ``crc``) in the record."""
        if len(data) != self.size:
            raise ValueError(f"{len(data)} bytes for a record of {self.size}")
        h = self._hash
        for value in _folded(self.size, crc, data[:8]):
            h = _hash_combine(h, value)
        for value in self._after:
            h = _hash_combine(h, value)
        sid = f"{self.name_hash}{h:020d}".encode()
        sid_crc = zlib.crc32(sid)
        out = bytearray(self._bytes)
        out[self._data:self._data + self.size] = data
        if self._descriptor is not None:
            _U32.pack_into(out, self._descriptor + 4, crc)
        _U32.pack_into(out, self._central, crc)
        out[self._sid:self._sid + len(sid)] = sid
        _U32.pack_into(out, self._sid_descriptor + 4, sid_crc)
        _U32.pack_into(out, self._sid_central, sid_crc)
        return out


_POOL: list = []


def _crc_pool() -> Any:
    if not _POOL:
        import concurrent.futures

        _POOL.append(concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="ckpt-crc"))
    return _POOL[0]


def _crc_of_parts(parts: Sequence[tuple[Any, int, int]]) -> int:
    crc = 0
    for path, start, length in parts:
        with open(path, "rb") as f:
            crc = _crc_of_range(f.fileno(), start, length, crc)
    return crc


def _crc_of_range(fd: int, start: int, length: int, crc: int) -> int:
    """zlib.crc32 over an mmap of the range: the bytes never pass through Python objects."""
    if length == 0:
        return crc
    base = start - start % mmap.ALLOCATIONGRANULARITY
    with mmap.mmap(fd, length + start - base, access=mmap.ACCESS_READ, offset=base) as m, memoryview(m) as view:
        return crc32(view[start - base:], crc)
