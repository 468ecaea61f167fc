"""Hugging Face safetensors: one file, or shards listed by ``model.safetensors.index.json``."""

from __future__ import annotations

import json
import os
import struct
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any, NamedTuple

from ..core.describe import Checkpoint, Chunk, FileEntry, TensorInfo, shared, sharing
from ..core.dtypes import DType
from ..core.plan import FileJob, Span
from ..errors import BadInput, Damaged
from ..security import safefs
from ..storage.castio import CastSpan, blocks
from ..storage.diskio import copy_range, write_all
from ..storage.manifest import Trailer

if TYPE_CHECKING:
    import torch

INDEX_NAME = "model.safetensors.index.json"
SINGLE_NAME = "model.safetensors"
MAX_HEADER_BYTES = 100 * 1024 * 1024
CHECKSUM_KEY = "ckpt_data_xxh3_64"  # in __metadata__ of a single file the tool wrote

DTYPES: dict[str, DType] = {code: DType(name) for code, name in {
    "F64": "float64", "F32": "float32", "F16": "float16", "BF16": "bfloat16",
    "I64": "int64", "I32": "int32", "I16": "int16", "I8": "int8",
    "U8": "uint8", "U16": "uint16", "U32": "uint32", "U64": "uint64",
    "BOOL": "bool", "F8_E4M3": "float8_e4m3fn", "F8_E5M2": "float8_e5m2", "F8_E8M0": "float8_e8m0fnu",
    "C64": "complex64",
}.items()}
DTYPE_CODES = {v: k for k, v in DTYPES.items()}
_CODES = {code: code for code in DTYPES}  # (a header's dtype strings as one object each)


def detect(path: Path) -> bool:
    if path.is_file():
        return path.suffix == ".safetensors"
    return (path / INDEX_NAME).is_file() or (path / SINGLE_NAME).is_file() or (
        any(path.glob("*.safetensors")) and not any(path.glob("*.distcp"))
    )


class Entry(Mapping):
    """A well-formed header entry, ``{"dtype", "shape", "data_offsets"}``, held as its values
    (read as the dict it was parsed from; lists made when asked): a slotted object where the
    dict, its lists and their ints were several hundred bytes, held whole before the first tensor
    is described (an ``inspect`` of 99k tensors peaked 46 MB higher). Equal shapes are one
    tuple, dtypes one string each."""

    __slots__ = ("dtype", "shape", "begin", "end")
    _KEYS = ("dtype", "shape", "data_offsets")

    def __init__(self, dtype: str, shape: tuple[int, ...], begin: int, end: int) -> None:
        self.dtype, self.shape, self.begin, self.end = dtype, shape, begin, end

    def __getitem__(self, key: str) -> Any:
        if key == "dtype":
            return self.dtype
        if key == "shape":
            return list(self.shape)
        if key == "data_offsets":
            return [self.begin, self.end]
        raise KeyError(key)

    def __iter__(self) -> Iterator[str]:
        return iter(self._KEYS)

    def __len__(self) -> int:
        return 3

    def __repr__(self) -> str:
        return repr(dict(self))


_ENTRY_KEYS = frozenset(Entry._KEYS)


class RawHeader(NamedTuple):
    """A safetensors header as stored: parsed, its entries not yet checked."""

    entries: dict[str, Any]  # tensor name -> {"dtype", "shape", "data_offsets"} (an Entry where well-formed), unchecked
    metadata: dict[str, Any]  # ``__metadata__``; empty when absent or not an object
    data_start: int  # byte offset where the tensor data begins (8 + the header's length)
    file_size: int


def read_raw_header(path: Path) -> RawHeader:
    """Read the JSON header of the safetensors file ``path``; the one place its bytes are parsed.

    The 8-byte little-endian length is checked against the file's size and ``MAX_HEADER_BYTES``
    before the header is read, so a corrupt length never makes a reader allocate gigabytes;
    the JSON must be UTF-8 and an object, and a duplicate key is refused (readers that keep
    the first or the last copy would see different tensors). BadInput for any of these.
    The entries themselves are not checked: :func:`read_header` does that before data is
    read, while a caller after shapes (``estimate``) or the metadata (``verify``'s checksum)
    takes only what it needs.
    """
    with safefs.open_file(path) as f:
        size = os.fstat(f.fileno()).st_size
        head = f.read(8)
        if len(head) < 8:
            raise Damaged(f"{path}: truncated safetensors file ({size} bytes, no header)")
        (n,) = struct.unpack("<Q", head)
        if n <= MAX_HEADER_BYTES and 8 + n > size:
            raise Damaged(f"{path}: truncated: {size:,} bytes on disk, but its header alone needs {8 + n:,}; "
                           "copy the file again")
        if n > MAX_HEADER_BYTES:
            raise Damaged(f"{path}: safetensors header claims {n} bytes but the file has {size}; corrupt or truncated")
        raw = f.read(n)
    try:
        text = raw.decode("utf-8")
        raw = b""  # (one copy of the header held while it is parsed: ~10 MB at 100k tensors)
        header = json.loads(text, object_pairs_hook=_object)
    except (UnicodeDecodeError, json.JSONDecodeError, ValueError, RecursionError) as e:
        raise BadInput(f"{path}: safetensors header is not valid UTF-8 JSON ({type(e).__name__})") from e
    if type(header) is Entry:  # (the whole header spelled like one tensor's entry: its keys as names)
        header = dict(header)
    if not isinstance(header, dict):
        raise BadInput(f"{path}: safetensors header is not a JSON object")
    metadata = header.pop("__metadata__", None)
    # the format says str -> str; anything else holds nothing a reader uses, and is no reason
    # to refuse the tensors
    return RawHeader(header, metadata if isinstance(metadata, dict) else {}, 8 + n, size)


def _ends(header: dict[str, Any]) -> list[int]:
    """Where each well-formed entry's data ends (for saying how much a truncated file lacks)."""
    ends = []
    for entry in header.values():
        try:
            ends.append(int(entry["data_offsets"][1]))
        except (KeyError, TypeError, ValueError, IndexError, OverflowError):
            pass
    return ends


def read_header(path: Path) -> tuple[dict[str, Any], int]:
    """Parse and validate a safetensors header without touching the data.

    Returns the header (``__metadata__`` removed), each entry an :class:`Entry`, and the byte
    offset where data begins.
    Refuses what the format forbids: a header past the end of the file or over 100 MB,
    non-UTF-8 or duplicate keys (both :func:`read_raw_header`), offsets out of range or
    overlapping, a byte range that does not match shape × dtype, holes or trailing bytes.
    """
    header, _, data_start, size = read_raw_header(path)
    data_len = size - data_start
    spans = []
    for name, entry in header.items():
        try:
            dtype = DTYPES[entry["dtype"]]
            shape = [int(d) for d in entry["shape"]]
            begin, end = (int(x) for x in entry["data_offsets"])
        except (KeyError, TypeError, ValueError, OverflowError) as e:
            raise BadInput(f"{path}: tensor {name!r}: malformed header entry {str(entry)[:200]}") from e
        if end > data_len and 0 <= begin <= end and all(d >= 0 for d in shape):
            needed = data_start + max(data_len, *_ends(header))
            raise Damaged(f"{path}: truncated: {size:,} bytes on disk, but its header needs {needed:,} "
                           f"({needed - size:,} missing); copy the file again")
        if any(d < 0 for d in shape) or not 0 <= begin <= end <= data_len:
            raise BadInput(f"{path}: tensor {name!r}: offsets {begin}..{end} outside the {data_len} data bytes")
        numel = 1
        for d in shape:
            numel *= d
        if numel * dtype.itemsize != end - begin:
            raise BadInput(f"{path}: tensor {name!r}: shape {shape} × {entry['dtype']} does not match its {end - begin} bytes")
        spans.append((begin, end, name))
        if type(entry) is not Entry:  # (a dict where the JSON spelled a number otherwise, 2.0)
            header[name] = Entry(entry["dtype"], tuple(shape), begin, end)
    spans.sort()
    pos = 0
    for begin, end, name in spans:
        if begin < pos:
            raise BadInput(f"{path}: tensor {name!r} overlaps the tensor before it")
        if begin > pos:
            raise BadInput(f"{path}: a hole of {begin - pos} bytes before tensor {name!r}")
        pos = end
    if pos != data_len:
        raise Damaged(f"{path}: {data_len - pos} trailing bytes after the last tensor; truncated or corrupt")
    return header, data_start


def _object(pairs: list[tuple[str, Any]]) -> dict[str, Any] | Entry:
    """A JSON object of the header: an :class:`Entry` where it is a tensor's, well-formed (its
    three keys, once each; a dtype the format names; ints, the offsets two of them), else its
    dict, a duplicate key refused."""
    if len(pairs) == 3 and {k for k, _ in pairs} == _ENTRY_KEYS:
        fields = dict(pairs)
        dtype, shape, offsets = fields["dtype"], fields["shape"], fields["data_offsets"]
        if type(dtype) is str and dtype in DTYPES and type(shape) is list and type(offsets) is list \
                and len(offsets) == 2 and all(type(d) is int for d in (*shape, *offsets)):
            return Entry(_CODES[dtype], shared(tuple(shape)), *offsets)
    return _no_duplicates(pairs)


def _no_duplicates(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in pairs:
        if k in out:
            raise ValueError(f"duplicate key {k!r}")
        out[k] = v
    return out


def shard_files(path: Path) -> tuple[Path, list[str], dict[str, str] | None]:
    """The base dir, the shard file names, and the index's weight map (None without index)."""
    if path.is_file():
        return path.parent, [path.name], None
    index = path / INDEX_NAME
    if index.is_file():
        weight_map = read_index(index)
        return path, sorted(set(weight_map.values())), weight_map
    if (path / SINGLE_NAME).is_file():
        return path, [SINGLE_NAME], None
    files = sorted(p.name for p in path.glob("*.safetensors"))
    if len(files) > 1:
        raise BadInput(f"{path}: {len(files)} .safetensors files but no {INDEX_NAME}; cannot tell how they fit together")
    return path, files, None


def read_index(index: Path) -> dict[str, str]:
    raw = safefs.read_capped(index, safefs.MAX_JSON_BYTES)
    try:
        weight_map = json.loads(raw)["weight_map"]
    except (OSError, ValueError, KeyError, TypeError, RecursionError) as e:
        raise BadInput(f"{index}: not a valid safetensors index ({type(e).__name__}: {str(e)[:200]})") from e
    if not isinstance(weight_map, dict):
        raise BadInput(f"{index}: weight_map is not an object")
    for name, file in weight_map.items():
        safe_relative(index.parent, file, what=f"{index}: tensor {name!r}")
    return weight_map


def safe_relative(base: Path, name: str, *, what: str) -> Path:
    """``base / name``, refused unless it resolves inside ``base`` (see
    :func:`ckpt_tools.security.safefs.resolve_inside`, which this is)."""
    return safefs.resolve_inside(base, name, what=what)


def describe(path: Path) -> Checkpoint:
    base, files, weight_map = shard_files(path)
    tensors: list[TensorInfo] = []
    entries: list[FileEntry] = []
    seen: dict[str, str] = {}
    share = sharing()
    for name in files:
        # a file the user named is the checkpoint; one a directory lists must stay inside it
        file = safe_relative(base, name, what=str(base)) if path.is_dir() else path
        if not file.is_file():
            safefs.require_regular(file, what=f"{base / INDEX_NAME}: shard {name!r}")
            raise BadInput(f"{base / INDEX_NAME}: names shard {name!r}, which is missing")
        header, data_start = read_header(file)
        entries.append(FileEntry(name, file.stat().st_size))
        for key, e in header.items():
            if key in seen:
                raise BadInput(f"{file}: tensor {key!r} is also in {seen[key]}")
            if weight_map is not None and weight_map.get(key) != name:
                raise BadInput(f"{file}: holds {key!r}, but the index puts it in {weight_map.get(key)!r}")
            seen[key] = name
            zeros = (0,) * len(e.shape)
            chunk = Chunk.at(share(zeros, zeros), e.shape, name, "raw", data_start + e.begin, e.end - e.begin)
            tensors.append(TensorInfo("model", key, e.shape, DTYPES[e.dtype], (chunk,)))
    if weight_map is not None:
        missing = sorted(set(weight_map) - set(seen))
        if missing:
            raise BadInput(f"{base / INDEX_NAME}: names {len(missing)} tensors no shard holds, e.g. {missing[0]!r}")
    root = path
    return Checkpoint("hf", root, None, tuple(tensors), files=tuple(entries))


# -- writing ------------------------------------------------------------------------------

def tensor_bytes(t: torch.Tensor) -> memoryview:
    """The raw little-endian bytes of a contiguous tensor, without a copy where possible."""
    t = t.contiguous().reshape(-1)
    if not t.numel():
        return memoryview(b"")
    import torch

    return memoryview(t.view(torch.uint8).numpy())


class Writer:
    """safetensors: one file, or shards of ``max_shard_size`` with HF's names and index.

    The header is computed from the plan, so each file is written front to back in one pass.
    """

    accepts_spans = True
    accepts_casts = True
    finish_reads_pieces = True  # (the index names each tensor's file)

    def __init__(self, *, single_file: bool = False, max_shard_size: int | str = "5GB") -> None:
        self.single_file = single_file
        self.max_shard_size = max_shard_size

    def plan(self, pieces: list) -> list:
        from huggingface_hub.serialization._base import split_state_dict_into_shards_factory

        by_name = {p.target.name: p for p in pieces}
        if self.single_file:
            return [FileJob(SINGLE_NAME, tuple(pieces))]
        split = split_state_dict_into_shards_factory(
            by_name, max_shard_size=self.max_shard_size, filename_pattern="model{suffix}.safetensors",
            get_storage_size=lambda p: p.nbytes, get_storage_id=lambda p: None,
        )
        return [FileJob(name, tuple(by_name[n] for n in names), meta={"sharded": split.is_sharded})
                for name, names in split.filename_to_tensors.items()]

    def write(self, path: Path, job, pieces, objects):
        # a lone file has no manifest beside it: its data checksum goes in the header, filled in
        # once the data is written (the placeholder keeps the header's length fixed)
        header: dict[str, Any] = {"__metadata__": {"format": "pt", **({CHECKSUM_KEY: "0" * 16} if self.single_file else {})}}
        pos = 0
        for p in job.pieces:
            header[p.target.name] = {"dtype": DTYPE_CODES[DType.of(p.target.dtype)], "shape": list(p.sizes),
                                     "data_offsets": [pos, pos + p.nbytes]}
            pos += p.nbytes
        raw = json.dumps(header, separators=(",", ":")).encode()
        raw += b" " * (-len(raw) % 8)  # keep data 8-byte aligned, as safetensors does

        sources: dict[Path, int] = {}
        data_start = 8 + len(raw)
        with open(path, "w+b", buffering=0) as f:  # read too: the trailer hashes what was written
            # a lone file's checksum covers its data (the header is patched after); a shard's, all of it
            trailer = Trailer(f.fileno(), start=data_start if self.single_file else 0)
            try:
                write_all(f.fileno(), struct.pack("<Q", len(raw)) + raw, trailer)
                for p, values in pieces:
                    if isinstance(values, Span):
                        for src, offset, length in values.parts:
                            if src not in sources:
                                sources[src] = os.open(src, os.O_RDONLY)
                            copy_range(sources[src], f.fileno(), offset, length, what=src, flusher=trailer)
                    elif isinstance(values, CastSpan):
                        for block in blocks(values):
                            write_all(f.fileno(), block, trailer)
                    else:
                        write_all(f.fileno(), tensor_bytes(values), trailer)
                digest = trailer.finish()
            except BaseException:
                trailer.close()
                raise
            finally:
                for fd in sources.values():
                    os.close(fd)
        if not self.single_file:
            return digest
        at = raw.index(b'"' + CHECKSUM_KEY.encode() + b'":"') + len(CHECKSUM_KEY) + 4
        with open(path, "r+b") as f:
            f.seek(8 + at)
            f.write(digest.xxh3_64.encode())
        return None

    def finish(self, out: Path, jobs: list, written: dict) -> None:
        if self.single_file or len(jobs) == 1 and not jobs[0].meta.get("sharded"):
            return  # one file (model.safetensors, or a PEFT adapter's): no index
        index = {"metadata": {"total_size": sum(j.nbytes for j in jobs)},
                 "weight_map": {p.target.name: j.path for j in jobs for p in j.pieces}}
        # the index is written last: a reader that finds it knows every shard is complete
        (out / INDEX_NAME).write_text(json.dumps(index, indent=2, sort_keys=True) + "\n")
