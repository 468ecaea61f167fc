"""Parsers of untrusted metadata, fuzzed: the safetensors header, the HF index, and DCP's
pickled ``.metadata`` (through the restricted unpickler, and on to a full describe). Whatever
the bytes, only :class:`ckpt_tools.errors.CkptError` may escape, and nothing may hang."""

from __future__ import annotations

import json
import shutil
import struct
from pathlib import Path

import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from ckpt_tools.errors import BadInput, CkptError, UnsafeInput
from ckpt_tools.formats import dcp, hf
from ckpt_tools.security.dcpmeta import load_dcp_metadata

FUZZ = settings(max_examples=200, deadline=2000, database=None, derandomize=True,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])


@pytest.fixture(scope="module")
def scratch(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("fuzz")


def _only_ckpt_errors(fn, *args) -> None:
    try:
        fn(*args)
    except CkptError:
        pass


# -- safetensors header ---------------------------------------------------------------------

_DTYPES = st.sampled_from([*hf.DTYPES, "F128", "", "f32", None, 3])
# no infinities here: int(inf) is a known bug with its own test below, and would mask the rest
_INTS = st.one_of(st.integers(-2, 64), st.integers(-(2 ** 70), 2 ** 70), st.floats(allow_nan=True, allow_infinity=False),
                  st.text(max_size=3), st.none(), st.booleans())
_ENTRY = st.one_of(
    st.fixed_dictionaries({"dtype": _DTYPES, "shape": st.lists(_INTS, max_size=4),
                           "data_offsets": st.lists(_INTS, min_size=0, max_size=3)}),
    st.dictionaries(st.text(max_size=12), _INTS, max_size=3),
    _INTS, st.lists(_INTS, max_size=3),
)
_HEADER = st.dictionaries(st.text(max_size=8), _ENTRY, max_size=5)


def _safetensors(header_bytes: bytes, data: bytes, claimed: int | None) -> bytes:
    n = len(header_bytes) if claimed is None else claimed
    return struct.pack("<Q", n) + header_bytes + data


@FUZZ
@given(header=_HEADER, data=st.binary(max_size=96),
       claimed=st.one_of(st.none(), st.integers(0, 2 ** 64 - 1)))
@example(header={"w": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}}, data=b"\0" * 8, claimed=None)
def test_read_header_structured(scratch: Path, header: dict, data: bytes, claimed: int | None) -> None:
    p = scratch / "structured.safetensors"
    p.write_bytes(_safetensors(json.dumps(header).encode(), data, claimed))
    _only_ckpt_errors(hf.read_header, p)


@FUZZ
@given(raw=st.binary(max_size=256))
def test_read_header_random_bytes(scratch: Path, raw: bytes) -> None:
    p = scratch / "random.safetensors"
    p.write_bytes(raw)
    _only_ckpt_errors(hf.read_header, p)


def _valid_safetensors() -> bytes:
    header = {"__metadata__": {"format": "pt"},
              "a": {"dtype": "F32", "shape": [2, 2], "data_offsets": [0, 16]},
              "b": {"dtype": "BF16", "shape": [3], "data_offsets": [16, 22]}}
    return _safetensors(json.dumps(header).encode(), bytes(range(22)), None)


_MUTATION = st.lists(st.tuples(st.sampled_from(["flip", "insert", "delete", "truncate"]),
                               st.integers(0, 10 ** 6), st.integers(0, 255)), min_size=1, max_size=4)


def _mutate(data: bytes, ops: list[tuple[str, int, int]]) -> bytes:
    buf = bytearray(data)
    for op, pos, value in ops:
        if not buf:
            break
        i = pos % len(buf)
        if op == "flip":
            buf[i] ^= value or 1
        elif op == "insert":
            buf[i:i] = bytes([value])
        elif op == "delete":
            del buf[i]
        else:
            del buf[i:]
    return bytes(buf)


@FUZZ
@given(ops=_MUTATION)
def test_read_header_mutated_valid_file(scratch: Path, ops) -> None:
    p = scratch / "mutated.safetensors"
    p.write_bytes(_mutate(_valid_safetensors(), ops))
    _only_ckpt_errors(hf.read_header, p)


def test_read_header_baseline_is_valid(scratch: Path) -> None:
    p = scratch / "valid.safetensors"
    p.write_bytes(_valid_safetensors())
    header, start = hf.read_header(p)
    assert set(header) == {"a", "b"} and start == len(_valid_safetensors()) - 22


def test_read_header_entries_are_held_compact_and_read_as_their_json(scratch: Path) -> None:
    """Each entry is an ``hf.Entry`` (a 99k-tensor header held as dicts of lists: +46 MB at a peak),
    read as the dict it was parsed from; equal shapes are one tuple; an entry spelled otherwise
    (a float, an extra key, another order) becomes one once its values are checked."""
    header = {"__metadata__": {"format": "pt"},
              "a": {"dtype": "F32", "shape": [2, 2], "data_offsets": [0, 16]},
              "b": {"shape": [2, 2], "data_offsets": [16, 32], "dtype": "F32"},
              "c": {"dtype": "BF16", "shape": [3.0], "data_offsets": [32, 38]},
              "d": {"dtype": "U8", "shape": [], "data_offsets": [38, 39], "note": "x"}}
    p = scratch / "entries.safetensors"
    p.write_bytes(_safetensors(json.dumps(header).encode(), bytes(39), None))
    got, _ = hf.read_header(p)
    assert list(got) == ["a", "b", "c", "d"] and all(type(e) is hf.Entry for e in got.values())
    assert got["a"] == header["a"] and got["b"] == header["b"] and dict(got["a"]) == header["a"]
    assert got["a"]["shape"] == [2, 2] and got["a"]["data_offsets"] == [0, 16] and got["a"]["dtype"] == "F32"
    assert repr(got["b"]) == repr({"dtype": "F32", "shape": [2, 2], "data_offsets": [16, 32]})
    assert got["a"].shape is got["b"].shape and got["a"].dtype is got["b"].dtype
    assert got["c"] == {"dtype": "BF16", "shape": [3], "data_offsets": [32, 38]} and type(got["c"].shape[0]) is int
    assert got["d"] == {"dtype": "U8", "shape": [], "data_offsets": [38, 39]}
    with pytest.raises(KeyError):
        got["a"]["note"]
    raw = hf.read_raw_header(p).entries  # (unchecked: as parsed, an Entry only where well-formed)
    assert type(raw["a"]) is hf.Entry and raw["c"] == header["c"] and type(raw["c"]) is dict
    described = {t.name: t for t in hf.describe(p).tensors}
    assert described["a"].shape == (2, 2) and described["c"].shape == (3,)
    assert [(c.offsets, c.byte_offset, c.length) for c in described["b"].chunks] == [((0, 0), 8 + len(json.dumps(header)) + 16, 16)]


def test_a_header_spelled_like_an_entry_is_read_as_its_names(scratch: Path) -> None:
    p = scratch / "top.safetensors"
    p.write_bytes(_safetensors(b'{"dtype": "F32", "shape": [1], "data_offsets": [0, 4]}', b"\0" * 4, None))
    assert hf.read_raw_header(p).entries == {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]}
    with pytest.raises(BadInput, match="tensor 'dtype': malformed header entry"):
        hf.read_header(p)


@pytest.mark.parametrize("entry", [b'{"dtype": "F32", "dtype": "F32", "shape": [1]}',
                                   b'{"dtype": "F32", "shape": [1], "data_offsets": [0, 4], "shape": [1]}',
                                   b'{"dtype": "F32", "shape": [true], "data_offsets": [0, 4], "dtype": "F32"}'])
def test_read_header_refuses_a_duplicate_key_in_an_entry(scratch: Path, entry: bytes) -> None:
    p = scratch / "dup.safetensors"
    p.write_bytes(_safetensors(b'{"w": ' + entry + b"}", b"\0" * 4, None))
    with pytest.raises(BadInput, match="not valid UTF-8 JSON"):
        hf.read_header(p)




@pytest.mark.parametrize("field", ["shape", "data_offsets"])
def test_read_header_infinite_number_is_bad_input(scratch: Path, field: str) -> None:
    entry = {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]}
    entry[field] = [1e999] if field == "shape" else [0, 1e999]
    p = scratch / f"inf-{field}.safetensors"
    p.write_bytes(_safetensors(json.dumps({"w": entry}).encode(), b"\0" * 4, None))
    with pytest.raises(BadInput):
        hf.read_header(p)




def test_read_header_deep_nesting_is_bad_input(scratch: Path) -> None:
    p = scratch / "deep.safetensors"
    p.write_bytes(_safetensors(b"[" * 100_000 + b"]" * 100_000, b"", None))
    with pytest.raises(BadInput):
        hf.read_header(p)


# -- HF index -------------------------------------------------------------------------------

_JSONISH = st.recursive(st.one_of(st.none(), st.booleans(), st.integers(), st.floats(), st.text(max_size=20)),
                        lambda inner: st.one_of(st.lists(inner, max_size=4), st.dictionaries(st.text(max_size=8), inner, max_size=4)),
                        max_leaves=12)
_FILE_NAMES = st.one_of(st.text(max_size=30), st.sampled_from(
    ["model-00001-of-00002.safetensors", "../x.safetensors", "/etc/passwd", "a/../../b", "", ".", "a\x00b", "~/x"]))


@FUZZ
@given(index=st.one_of(
    _JSONISH,
    st.fixed_dictionaries({"weight_map": st.dictionaries(st.text(max_size=12), st.one_of(_FILE_NAMES, _JSONISH), max_size=5)}),
))
@example(index={"weight_map": {"w": "a\x00b"}})
def test_read_index(scratch: Path, index) -> None:
    p = scratch / "idx" / hf.INDEX_NAME
    p.parent.mkdir(exist_ok=True)
    p.write_text(json.dumps(index))
    _only_ckpt_errors(hf.read_index, p)


@FUZZ
@given(raw=st.binary(max_size=200))
def test_read_index_random_bytes(scratch: Path, raw: bytes) -> None:
    p = scratch / "idx-raw" / hf.INDEX_NAME
    p.parent.mkdir(exist_ok=True)
    p.write_bytes(raw)
    _only_ckpt_errors(hf.read_index, p)


def test_read_index_deep_nesting_is_bad_input(scratch: Path) -> None:
    p = scratch / "idx-deep" / hf.INDEX_NAME
    p.parent.mkdir(exist_ok=True)
    p.write_text("[" * 100_000 + "]" * 100_000)
    with pytest.raises(BadInput):
        hf.read_index(p)


# -- DCP .metadata --------------------------------------------------------------------------

# a module constant, not a fixture: hypothesis would print all 45 kB of it with each failure
REAL_METADATA = (Path(__file__).resolve().parent.parent / "fixtures" / "llama_dcp" / ".metadata").read_bytes()


@pytest.fixture(scope="module")
def dcp_copy(fixtures_dir: Path, scratch: Path) -> Path:
    d = scratch / "dcp"
    shutil.copytree(fixtures_dir / "llama_dcp", d)
    return d


_META_MUTATION = st.lists(st.tuples(st.sampled_from(["flip", "insert", "delete", "truncate"]),
                                    st.integers(0, 10 ** 7), st.integers(0, 255)), min_size=1, max_size=3)




@FUZZ
@given(ops=_META_MUTATION)
def test_load_dcp_metadata_mutated(scratch: Path, ops) -> None:
    p = scratch / "mutated.metadata"
    p.write_bytes(_mutate(REAL_METADATA, ops))
    _only_ckpt_errors(load_dcp_metadata, p)


@FUZZ
@given(raw=st.binary(max_size=200))
def test_load_dcp_metadata_random_bytes(scratch: Path, raw: bytes) -> None:
    p = scratch / "random.metadata"
    p.write_bytes(raw)
    _only_ckpt_errors(load_dcp_metadata, p)


@FUZZ
@given(ops=_META_MUTATION)
def test_describe_dcp_with_mutated_metadata(dcp_copy: Path, ops) -> None:
    """Past the unpickler: whatever Metadata the bytes make, describing it fails cleanly."""
    (dcp_copy / ".metadata").write_bytes(_mutate(REAL_METADATA, ops))
    _only_ckpt_errors(dcp.describe, dcp_copy)


def test_dcp_metadata_baseline_is_valid(fixtures_dir: Path) -> None:
    meta = load_dcp_metadata(fixtures_dir / "llama_dcp" / ".metadata")
    assert meta.state_dict_metadata


def test_truncated_metadata_is_corrupt_not_unsafe(scratch: Path) -> None:
    p = scratch / "truncated.metadata"
    p.write_bytes(REAL_METADATA[: len(REAL_METADATA) // 2])
    with pytest.raises(BadInput) as e:
        load_dcp_metadata(p)
    assert not isinstance(e.value, UnsafeInput)


# the smallest cases the fuzzers above found, one per bug

# (the MemoryError twin, a BINUNICODE8 inserted at 0 claiming ~700 GB, depends on the host's
# overcommit policy, so it is left to the fuzzer)
def test_corrupt_length_prefix_in_metadata_is_bad_input(scratch: Path) -> None:
    p = scratch / "length.metadata"
    p.write_bytes(_mutate(REAL_METADATA, [("insert", 438, 0x8D)]))  # a BINUNICODE8 length > 2**63
    with pytest.raises(BadInput):
        load_dcp_metadata(p)


@pytest.mark.parametrize("pos", [pytest.param(400, id="chunk-without-offsets"),
                                 pytest.param(72, id="metadata-without-state_dict_metadata")])
def test_metadata_with_a_renamed_field_is_bad_input(dcp_copy: Path, pos: int) -> None:
    (dcp_copy / ".metadata").write_bytes(_mutate(REAL_METADATA, [("flip", pos, 1)]))
    with pytest.raises(BadInput):
        dcp.describe(dcp_copy)
