"""ckpt_tools.torchfile: torch.save files read and written without torch.

The module itself never imports torch (checked in a subprocess); these tests use torch as the
reference: what torch.save writes, and what torch.load(weights_only=True) makes of our files.
"""

from __future__ import annotations

import errno
import io
import os
import random
import shlex
import struct
import subprocess
import sys
import textwrap
import zipfile
import zlib
from collections import OrderedDict
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.distributed.tensor  # noqa: F401 - makes DTensor & co. safe globals for weights_only loads
from torch.distributed.tensor import DTensor

from ckpt_tools.codecs import torchwriter
from ckpt_tools.security import torchfile, zipdir
from ckpt_tools.errors import BadInput, UnsafeInput
from ckpt_tools.codecs.torchpickler import dumps
from ckpt_tools.codecs.torchwriter import TorchZipWriter, crc32_combine
from ckpt_tools.security.torchfile import Global, NewObj, Reduce, StorageRef, TorchZip, loads

ROOT = Path(__file__).resolve().parent.parent
FIXTURES = ROOT / "fixtures"
RANK_FILES = sorted(p for d in ("llama_sharded_ws2", "llama_sharded_ws8", "llama_tied_sharded_ws2")
                    for p in (FIXTURES / d).glob("*_rank_*.pt"))
ALL_FILES = RANK_FILES + [FIXTURES / "llama_torch_training.pt", FIXTURES / "llama_torch" / "pytorch_model.bin"]
ids = [f"{p.parent.name}/{p.name}" for p in ALL_FILES]
# verl's extra_state files hold numpy RNG state: torch.load needs these to read them weights_only
NUMPY_GLOBALS = [np.ndarray, np.dtype, type(np.dtype(np.uint32)),
                 getattr(np, "_core", getattr(np, "core", None)).multiarray._reconstruct]


def torch_load(path: Path, mmap: bool):
    with torch.serialization.safe_globals(NUMPY_GLOBALS):
        return torch.load(path, weights_only=True, mmap=mmap, map_location="cpu")


def rewrite(src: TorchZip, dst: Path, name_hash: str | None = None) -> str:
    """dst gets src's records in src's order: the pickle re-emitted from src.tree, all others copied."""
    with TorchZipWriter(dst, src.prefix) as w:
        for name in src.records:
            if name == "data.pkl":
                w.write_record(name, dumps(src.tree))
            elif name not in ("version", ".data/serialization_id"):  # the writer adds those last, as torch
                w.copy_record(name, [src.part(name)])
        return w.close(name_hash=name_hash)


def tensors(obj, out=None) -> list[torch.Tensor]:
    """Every plain tensor in obj (DTensors by their local tensor), in traversal order."""
    out = [] if out is None else out
    if isinstance(obj, DTensor):
        out.append(obj._local_tensor)
    elif isinstance(obj, torch.Tensor):
        out.append(obj)
    elif isinstance(obj, dict):
        for v in obj.values():
            tensors(v, out)
    elif isinstance(obj, (list, tuple)):
        for v in obj:
            tensors(v, out)
    return out


def raw_bytes(t: torch.Tensor) -> torch.Tensor:
    return torch.empty(0, dtype=torch.uint8).set_(t.untyped_storage())


def assert_same(a, b, where: str = "obj") -> None:
    """Equal as loaded objects: types, keys, scalars; tensors bit-equal with the same layout;
    DTensors with the same placements and mesh."""
    assert type(a) is type(b), where
    if isinstance(a, DTensor):
        assert a.placements == b.placements and a.shape == b.shape and a.stride() == b.stride(), where
        assert a.device_mesh.shape == b.device_mesh.shape and torch.equal(a.device_mesh.mesh, b.device_mesh.mesh)
        assert a._spec.tensor_meta == b._spec.tensor_meta, where
        assert_same(a._local_tensor, b._local_tensor, where + "._local_tensor")
    elif isinstance(a, torch.Tensor):
        assert (a.dtype, a.shape, a.stride(), a.storage_offset(), a.requires_grad) == (
            b.dtype, b.shape, b.stride(), b.storage_offset(), b.requires_grad), where
        assert torch.equal(raw_bytes(a), raw_bytes(b)), where  # the whole storage, bit for bit
    elif isinstance(a, np.ndarray):
        assert a.dtype == b.dtype and np.array_equal(a, b), where
    elif isinstance(a, dict):
        assert list(a) == list(b), where
        for k in a:
            assert_same(a[k], b[k], f"{where}[{k!r}]")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b)):
            assert_same(x, y, f"{where}[{i}]")
    else:
        assert a == b, where


def sharing(obj) -> list[int]:
    """Which tensors share a storage, as first-seen group numbers (tied weights stay tied)."""
    groups: dict[int, int] = {}
    return [groups.setdefault(t.untyped_storage().data_ptr(), len(groups)) for t in tensors(obj)]


# ---------------------------------------------------------------------------- round trips
@pytest.mark.parametrize("path", ALL_FILES, ids=ids)
def test_fixture_rewrite_is_byte_identical(path, tmp_path):
    """Parse -> dumps gives the very pickle torch wrote; the rewritten file is the fixture's bytes."""
    src = TorchZip(path)
    assert dumps(src.tree) == src.pickle
    sid = rewrite(src, tmp_path / path.name, name_hash=src.serialization_id[:20])
    assert sid == src.serialization_id
    assert (tmp_path / path.name).read_bytes() == path.read_bytes()


@pytest.mark.parametrize("mmap", [False, True], ids=["read", "mmap"])
@pytest.mark.parametrize("path", ALL_FILES, ids=ids)
def test_rewrite_loads_equal_in_torch(path, mmap, tmp_path):
    """With our own serialization-id half, torch.load(weights_only=True) reads the same objects."""
    out = tmp_path / path.name
    rewrite(TorchZip(path), out)
    assert zipfile.ZipFile(out).testzip() is None
    want, got = torch_load(path, mmap), torch_load(out, mmap)
    assert_same(want, got)
    assert sharing(want) == sharing(got)


@pytest.mark.parametrize("path", [FIXTURES / "llama_sharded_ws2" / "model_world_size_2_rank_1.pt",
                                  FIXTURES / "llama_sharded_ws8" / "optim_world_size_8_rank_3.pt",
                                  FIXTURES / "llama_tied_sharded_ws2" / "model_world_size_2_rank_0.pt",
                                  FIXTURES / "llama_torch_training.pt"], ids=lambda p: p.name)
def test_matches_what_torch_save_writes_now(path, tmp_path):
    """torch.save(torch.load(fixture)) with this torch, then rewritten by us: the same bytes."""
    a, b = tmp_path / "a.pt", tmp_path / "b.pt"
    torch.save(torch.load(path, weights_only=True), a)
    src = TorchZip(a)
    rewrite(src, b, name_hash=src.serialization_id[:20])
    assert b.read_bytes() == a.read_bytes()


def test_edge_cases_match_torch_save(tmp_path):
    """Empty, uint16/float8 (UntypedStorage + _rebuild_tensor_v3), tied views at offsets, a strided
    view, bytes that look like a zip data descriptor, one-character and empty strings, a
    state_dict's _metadata, real bytes (pickled through _codecs.encode)."""
    base = torch.arange(24, dtype=torch.float32)
    sd = OrderedDict(w=torch.ones(2, 3, dtype=torch.bfloat16), b=torch.zeros(3, dtype=torch.float64))
    sd._metadata = OrderedDict({"": {"version": 1}})
    obj = {
        "empty": torch.empty(0), "u16": torch.arange(5).to(torch.uint16),
        "f8": torch.ones(4).to(torch.float8_e4m3fn), "tied_a": base[2:10], "tied_b": base.view(4, 6)[:, ::2],
        "pk": torch.tensor(list(b"PK\x07\x08descriptor?"), dtype=torch.uint8),
        "0": "0", "": "", "x": ["0", "", "x", "x"], "flag": torch.tensor(True), "sd": sd,
        "blob": b"raw\x00bytes", "steps": (1, 2.5, None, 10**30, -7),
    }
    a, b = tmp_path / "a.pt", tmp_path / "b.pt"
    torch.save(obj, a)
    src = TorchZip(a)
    assert dumps(src.tree) == src.pickle
    rewrite(src, b, name_hash=src.serialization_id[:20])
    assert b.read_bytes() == a.read_bytes()
    got = torch.load(b, weights_only=True, mmap=True)
    assert_same(torch.load(a, weights_only=True), got)
    assert got["tied_a"].untyped_storage().data_ptr() == got["tied_b"].untyped_storage().data_ptr()
    assert got["sd"]._metadata == sd._metadata


def test_a_patched_pickle_is_the_pickle_of_the_tree_with_the_new_values():
    """patch() gives, byte for byte, what dumps() writes for the tree holding the new values:
    in place where a value keeps its opcode, spliced where it needs another width (BININT1,
    BININT2, BININT, negatives included); None for a value that needs LONG1 or a slot the pickle
    does not hold, so the tree is written whole."""
    from ckpt_tools.codecs import torchpickler
    from ckpt_tools.codecs.torchpickler import Slot, patch, slot_places

    def tree(a: int, b: int) -> dict:
        return {"x": (Slot("a", a), "s", Slot("b", b)), "y": [Slot("a", a), 7, ("t", Slot("b", b))]}

    where: list = []
    base = dumps(tree(3, 300), where)
    python_where: list = []
    assert _python_dumps(tree(3, 300), python_where) == base and python_where == where  # the C pickler's
    places = slot_places(where)
    assert {name: len(at) for name, at in places.items()} == {"a": 2, "b": 2}
    for a, b in [(3, 300), (9, 301), (200, 70_000), (0, 5), (-1, 2**31 - 1), (70_000, 256), (-2**31, 0)]:
        assert patch(base, places, {"a": a, "b": b}) == dumps(tree(a, b)), (a, b)
    assert patch(base, places, {"a": 2**31}) is None  # LONG1
    assert patch(base, places, {"c": 1}) is None
    # a patched pickle's places, moved by the widths changed before them, are those dumps()
    # notes for its tree; the next file patched from it is that file's pickle
    for values in ({"a": 70_000, "b": 5}, {"b": -1}, {"a": 9}):
        where2: list = []
        want = dumps(tree(values.get("a", 3), values.get("b", 300)), where2)
        assert patch(base, places, values) == want
        assert torchpickler.patched_places(places, values) == slot_places(where2)
        assert patch(want, slot_places(where2), {"a": 1, "b": 2**31 - 1}) == dumps(tree(1, 2**31 - 1))


def _python_dumps(tree, where=None) -> bytes:
    """What the pure-Python pickler (torchpickler._Emitter) writes for ``tree``."""
    from ckpt_tools.codecs import torchpickler

    buf = io.BytesIO()
    emitter = torchpickler._Emitter(buf, protocol=2)
    emitter.file, emitter.slots = buf, where if where is not None else []
    emitter.dump(tree)
    return buf.getvalue()


@pytest.mark.parametrize("path", ALL_FILES, ids=ids)
def test_c_pickler_writes_what_torch_wrote_or_hands_over(path):
    """The C pickler (stand-in modules for the Global nodes, sentinels for slots and kept-apart
    strings) writes each fixture's pickle as torch wrote it, or declines (None), and the
    pure-Python one writes the same bytes."""
    from ckpt_tools.codecs import torchpickler

    src = TorchZip(path)
    c = torchpickler._c_dumps(src.tree, [])
    assert c is None or c == src.pickle
    assert _python_dumps(src.tree) == src.pickle


def test_c_pickler_writes_the_usual_rank_files():
    """Model, optimizer and extra-state rank files, with their one-character strings (the
    mesh's process group "0", the root module's "" in ``_metadata``): the C pickler's to write."""
    from ckpt_tools.codecs import torchpickler

    for name in ("model_world_size_8_rank_3.pt", "optim_world_size_8_rank_0.pt", "extra_state_world_size_8_rank_1.pt"):
        src = TorchZip(FIXTURES / "llama_sharded_ws8" / name)
        assert torchpickler._c_dumps(src.tree, []) == src.pickle, name


def test_c_pickler_hands_over_what_it_cannot_vouch_for():
    """A one-character string kept apart but referenced twice, a module name too short for a
    stand-in, a string holding a stand-in's GLOBAL text, a plain int equal to a slot's sentinel:
    the C pickler declines or writes what the Python one does, and dumps() gives the Python
    one's bytes either way."""
    from ckpt_tools.codecs import torchpickler
    from ckpt_tools.codecs.torchpickler import Slot
    from ckpt_tools.security.torchfile import Global, NewObj, Reduce, _Str

    zero = _Str("0")
    torch_size = Global("torch", "Size")
    torchpickler._c_dumps(Reduce(torch_size, ((1,),)), [])  # gives "torch" its stand-in
    stand = torchpickler._STANDS["torch"].decode()
    cases = {
        "shared kept-apart string": ([zero, zero, _Str("")], True),
        "short module": (Reduce(Global("ab", "f"), (1,)), True),
        "a stand-in's text": ([f"c{stand}\n", Reduce(torch_size, ((2,),))], True),
        "a sentinel as a value": ({"a": Slot("x", 300), "b": torchpickler._SENTINEL | 0, "c": Slot("y", 5)}, False),
        # two floats whose bytes, with the BINFLOAT opcode between them, read as a slot's sentinel
        "bytes that read as a sentinel": ([struct.unpack(">d", b"\0" * 6 + b"\x8a\x08")[0],
                                           struct.unpack(">d", b"\0" * 5 + b"\xed\x5eQ")[0], Slot("x", 3)], True),
        "nodes": ([NewObj(Global("torch.distributed.tensor.placement_types", "Shard"), (), {"dim": 0}), zero,
                   Reduce(torch_size, ((3, _Str("0")),), {"s": _Str("x")})], False),
    }
    for name, (tree, declined) in cases.items():
        where: list = []
        c = torchpickler._c_dumps(tree, where)
        assert (c is None) == declined, name
        want_where: list = []
        want = _python_dumps(tree, want_where)
        if c is not None:
            assert c == want and where == want_where, name
        got_where: list = []
        assert torchpickler.dumps(tree, got_where) == want and got_where == want_where, name


def test_edited_tree_writes_a_loadable_subset(tmp_path):
    """What resharding does: keep some entries, renumber their storages, copy only those records."""
    src = TorchZip(FIXTURES / "llama_sharded_ws2" / "model_world_size_2_rank_0.pt")
    keep = list(src.tree)[:3]
    tree = OrderedDict((k, src.tree[k]) for k in keep)
    refs: dict[str, StorageRef] = {}

    def walk(node):
        if isinstance(node, StorageRef):
            refs.setdefault(node.key, node)
        elif isinstance(node, Reduce):
            walk((node.args, node.state))
        elif isinstance(node, (list, tuple, dict)):
            for v in node.values() if isinstance(node, dict) else node:
                walk(v)

    walk(tree)
    old = {str(i): ref.key for i, ref in enumerate(refs.values())}  # new key -> key in src
    for new, ref in zip(old, refs.values()):
        ref.key = new  # the node is shared by every tensor on that storage, so all follow
    dst = tmp_path / "subset.pt"
    with TorchZipWriter(dst, "subset") as w:
        w.write_record("data.pkl", dumps(tree))
        for rec in (".format_version", ".storage_alignment", "byteorder"):
            w.copy_record(rec, [src.part(rec)])
        for new, was in old.items():
            w.copy_record(f"data/{new}", [src.part(f"data/{was}")])
    want = torch.load(FIXTURES / "llama_sharded_ws2" / "model_world_size_2_rank_0.pt", weights_only=True)
    got = torch.load(dst, weights_only=True)
    assert_same(OrderedDict((k, want[k]) for k in keep), got)
    assert isinstance(tree[keep[0]], Reduce) and isinstance(tree[keep[0]].args[3][1]["_spec"], NewObj)


# ---------------------------------------------------------------------------- hostile and broken input
class Evil:
    def __init__(self, canary: Path) -> None:
        self.canary = canary

    def __reduce__(self):
        return (os.system, (f"touch {shlex.quote(str(self.canary))}",))


@pytest.fixture
def canary(tmp_path) -> Path:
    return tmp_path / "canary"


def test_hostile_torch_save_file_is_refused_and_does_not_run(tmp_path, canary):
    bad = tmp_path / "evil.pt"
    torch.save({"w": torch.ones(2), "x": Evil(canary)}, bad)  # laid out by torch itself
    with pytest.raises(UnsafeInput, match="system"):
        TorchZip(bad)
    with pytest.raises(UnsafeInput):
        loads(zipfile.ZipFile(bad).read("evil/data.pkl"))
    assert not canary.exists()
    torch.load(bad, weights_only=False)  # the payload is live: the unsafe way runs it
    assert canary.exists()


HOSTILE = {
    "global_eval": (b"\x80\x02cbuiltins\neval\nX\x04\x00\x00\x001+1;\x85R.", UnsafeInput),
    "py2_builtin": (b"\x80\x02c__builtin__\nexec\nX\x00\x00\x00\x00\x85R.", UnsafeInput),
    "stack_global": (b"\x80\x04\x8c\x02os\x8c\x06system\x93.", UnsafeInput),
    "torch_load": (b"\x80\x02ctorch.serialization\nload\n.", UnsafeInput),
    "inst": (b"(ctorch\nSize\ni\n.", BadInput),
    "reduce_non_global": (b"\x80\x02]q\x00)R.", BadInput),
    "newobj_ex": (b"\x80\x04ctorch\nSize\n)}\x92.", BadInput),
    "ext1": (b"\x80\x02\x82\x01.", BadInput),
    "text_persid": (b"Pfoo\n.", BadInput),
    "bad_persid": (b"\x80\x02X\x07\x00\x00\x00storage\x85Q.", BadInput),
    "build_on_list": (b"\x80\x02]}b.", BadInput),
    "truncated": (b"\x80\x02}q\x00(X\x05\x00\x00\x00ab", BadInput),
}


@pytest.mark.parametrize("case", list(HOSTILE))
def test_hostile_pickles_are_refused(case, tmp_path):
    data, error = HOSTILE[case]
    with pytest.raises(error):
        loads(data)
    path = tmp_path / "x.pt"  # the same pickle inside a zip laid out exactly like torch's
    with TorchZipWriter(path, "x") as w:
        w.write_record("data.pkl", data)
    with pytest.raises(error):
        TorchZip(path)


def test_broken_containers_are_refused(tmp_path):
    good = FIXTURES / "llama_sharded_ws2" / "model_world_size_2_rank_1.pt"
    cases: dict[str, tuple[bytes | None, type]] = {}
    cases["not_a_zip"] = (b"\x80\x02}." * 100, BadInput)
    cases["truncated"] = (good.read_bytes()[:-5000], BadInput)
    damaged = bytearray(good.read_bytes())
    damaged[TorchZip(good).records["data.pkl"].offset + 100] ^= 0xFF
    cases["pickle_crc"] = (bytes(damaged), BadInput)
    for name, files, error, method in [
        ("no_data_pkl", {"a/version": b"3\n"}, BadInput, zipfile.ZIP_STORED),
        ("compressed", {"a/data.pkl": b"\x80\x02}.", "a/version": b"3\n"}, BadInput, zipfile.ZIP_DEFLATED),
        ("no_folder", {"data.pkl": b"\x80\x02}.", "version": b"3\n"}, BadInput, zipfile.ZIP_STORED),
        ("torchscript", {"a/data.pkl": b"\x80\x02}.", "a/constants.pkl": b"\x80\x02).", "a/version": b"3\n",
                         "a/code/__torch__.py": b"import os"}, UnsafeInput, zipfile.ZIP_STORED),
        ("missing_storage", {"a/data.pkl": pickle_with_storage("0", 4), "a/version": b"3\n"}, BadInput,
         zipfile.ZIP_STORED),
        ("short_storage", {"a/data.pkl": pickle_with_storage("0", 4), "a/version": b"3\n", "a/data/0": b"x" * 15},
         BadInput, zipfile.ZIP_STORED),
    ]:
        path = tmp_path / f"{name}.pt"
        with zipfile.ZipFile(path, "w", method) as z:
            for n, d in files.items():
                z.writestr(n, d)
        cases[name] = (None, error)
    for name, (data, error) in cases.items():
        path = tmp_path / f"{name}.pt"
        if data is not None:
            path.write_bytes(data)
        with pytest.raises(error):
            TorchZip(path)
    assert TorchZip(good).tree  # the good file itself is fine


def pickle_with_storage(key: str, numel: int) -> bytes:
    ref = StorageRef(Global("torch", "FloatStorage"), key, "cpu", numel)
    return dumps({"w": Reduce(Global("torch._utils", "_rebuild_tensor_v2"),
                              (ref, 0, (numel,), (1,), False, OrderedDict()))})


# ---------------------------------------------------------------------------- the writer
@pytest.mark.parametrize("mode", ["mmap_crc", "combined_crc", "combined_crc_kernel_copy", "read_write_fallback"])
def test_copy_record_concatenates_ranges_of_two_files(mode, tmp_path, monkeypatch):
    rng = random.Random(7)
    one, two = tmp_path / "one.bin", tmp_path / "two.bin"
    one.write_bytes(rng.randbytes(200_000))
    two.write_bytes(rng.randbytes(90_000))
    ranges = [(one, 70_001, 100_000), (two, 13, 0), (two, 5, 60_000), (one, 0, 3)]  # unaligned, empty, tiny
    want = b"".join(p.read_bytes()[o:o + n] for p, o, n in ranges)
    if mode.startswith("combined_crc"):
        ranges = [(p, o, n, zlib.crc32(p.read_bytes()[o:o + n])) for p, o, n in ranges]
    if mode in ("combined_crc_kernel_copy", "read_write_fallback"):
        monkeypatch.setattr(torchwriter, "SMALL_RECORD", 0)  # (a record this size is otherwise read whole)
    if mode == "read_write_fallback":
        def no_cfr(*_a, **_k):
            raise OSError(errno.EXDEV, "cross-device")
        monkeypatch.setattr(torchfile.os, "copy_file_range", no_cfr)
    out = tmp_path / "out.pt"
    with TorchZipWriter(out, "out") as w:
        w.write_record("data.pkl", b"\x80\x02}.")
        w.copy_record("data/0", ranges)
        w.copy_record("data/1", [])
    with zipfile.ZipFile(out) as z:
        assert z.testzip() is None
        assert z.read("out/data/0") == want
        assert z.getinfo("out/data/0").CRC == zlib.crc32(want)
        assert z.read("out/data/1") == b""
    assert [n for n in TorchZip(out).records] == ["data.pkl", "data/0", "data/1", "version", "byteorder",
                                                  ".data/serialization_id"]
    assert all(r.offset % 64 == 0 for r in TorchZip(out).records.values())


@pytest.mark.parametrize("small", [True, False])
def test_copy_record_from_more_source_files_than_the_writer_keeps_open(small, tmp_path, monkeypatch):
    """A record of one part from each of more files than Sources keeps open (a 256 -> 4 reshard
    takes a tensor's rows from 64 files): opening the later parts' files closes the earlier
    ones, and every part is still read from its own file (a stale descriptor, or a number
    reused by another file, would read the wrong bytes or fail)."""
    monkeypatch.setattr(torchwriter, "_MAX_OPEN", 4)
    if not small:
        monkeypatch.setattr(torchwriter, "SMALL_RECORD", 0)
    files = []
    for i in range(11):
        f = tmp_path / f"src{i}.bin"
        f.write_bytes(bytes([i]) * 100 + random.Random(i).randbytes(100))
        files.append(f)
    parts = [(f, 50 + i, 100) for i, f in enumerate(files)]
    want = b"".join(f.read_bytes()[o:o + n] for f, o, n in parts)
    out = tmp_path / "out.pt"
    with TorchZipWriter(out, "out") as w:
        w.write_record("data.pkl", b"\x80\x02}.")
        w.copy_record("data/0", parts)
        w.copy_record("data/1", parts[::-1])
    with zipfile.ZipFile(out) as z:
        assert z.testzip() is None
        assert z.read("out/data/0") == want
        assert z.read("out/data/1") == b"".join(f.read_bytes()[o:o + n] for f, o, n in parts[::-1])


def test_item_writers_sharing_sources_open_each_source_once(tmp_path, monkeypatch):
    """Zips appended to one file (a DCP file's items) with one Sources: each source file is
    opened once for all of them, stays open until the Sources closes, and every copy is right."""
    src = tmp_path / "src.bin"
    src.write_bytes(bytes(range(256)) * 64)
    opened = []
    real_open = os.open
    monkeypatch.setattr(torchwriter.os, "open", lambda p, *a, **k: (opened.append(str(p)), real_open(p, *a, **k))[1])
    out = tmp_path / "items.bin"
    fd = real_open(out, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    starts = []
    try:
        with torchwriter.Flusher(fd) as flusher, torchwriter.Sources() as sources:
            for i in range(5):
                starts.append(os.lseek(fd, 0, os.SEEK_CUR))
                with TorchZipWriter(out, "archive", fd=fd, flusher=flusher, sources=sources) as z:
                    z.write_record("data.pkl", b"\x80\x02}.")
                    z.copy_record("data/0", [(src, i * 100, 100)])
            assert opened.count(str(src)) == 1
    finally:
        os.close(fd)
    data = out.read_bytes()
    for i, start in enumerate(starts):
        end = starts[i + 1] if i + 1 < len(starts) else len(data)
        with zipfile.ZipFile(io.BytesIO(data[start:end])) as z:
            assert z.read("archive/data/0") == src.read_bytes()[i * 100:i * 100 + 100]
            assert z.testzip() is None


def test_sources_read_ahead_returns_what_pread_does(tmp_path, monkeypatch):
    """Small source ranges read through a window read ahead: forward, backward, past the window,
    at the file's end, over several files (more than the windows kept), each the bytes a pread
    of that range gives; ranges that run on within a window cost no read of their own."""
    monkeypatch.setattr(torchwriter, "_AHEAD_MIN", 256)
    monkeypatch.setattr(torchwriter, "_AHEAD_MAX", 1024)
    monkeypatch.setattr(torchwriter, "_WINDOWS_KEPT", 2)
    rng = random.Random(0)
    files = []
    for i in range(3):
        f = tmp_path / f"src{i}.bin"
        f.write_bytes(rng.randbytes(3000 + 700 * i))
        files.append(f)
    calls = []
    real_pread = os.pread
    monkeypatch.setattr(torchwriter.os, "pread", lambda fd, n, at: (calls.append(n), real_pread(fd, n, at))[1])
    with torchwriter.Sources() as sources:
        fds = [sources.fd(f) for f in files]
        for at in range(0, 1000, 10):  # record after record: a read of 256 bytes serves 25 of them
            assert sources.read(fds[0], at, 10) == files[0].read_bytes()[at:at + 10]
        assert calls == [256] * 4
        calls.clear()
        assert sources.read(fds[0], 1000, 100) == files[0].read_bytes()[1000:1100]  # 16x: capped at 1024
        assert calls == [1024]
        ranges = [(rng.randrange(3), rng.randrange(4400), rng.randrange(1, 300)) for _ in range(500)]
        ranges += [(0, 2990, 10), (1, 3690, 10), (2, 4390, 10), (0, 2999, 1), (0, 3000, 0), (1, 0, 2000)]
        for i, at, n in ranges:
            data = files[i].read_bytes()
            n = min(n, len(data) - at) if at < len(data) else 0
            assert sources.read(fds[i], at, n) == data[at:at + n], (i, at, n)
            assert sources.read(fds[i], at, n) == data[at:at + n], (i, at, n)  # (now from its window)


@pytest.mark.parametrize("small", [True, False])
def test_copy_record_keeps_a_damaged_source_record_damaged(small, tmp_path, monkeypatch):
    """A part whose known CRC its bytes do not match (a source record damaged on disk): the copy
    carries the known CRCs combined, so a reader still sees the damage; it is never re-blessed."""
    if not small:
        monkeypatch.setattr(torchwriter, "SMALL_RECORD", 0)
    src = tmp_path / "src.bin"
    src.write_bytes(bytes(range(256)) * 40)
    good = zlib.crc32(src.read_bytes()[:5000])
    parts = [(src, 0, 5000, good ^ 1), (src, 5000, 5240, zlib.crc32(src.read_bytes()[5000:]))]
    out = tmp_path / "out.pt"
    with TorchZipWriter(out, "out") as w:
        w.write_record("data.pkl", b"\x80\x02}.")
        w.copy_record("data/0", parts)
    with zipfile.ZipFile(out) as z:
        assert z.getinfo("out/data/0").CRC == crc32_combine(good ^ 1, parts[1][3], 5240)
        assert z.testzip() == "out/data/0"


def test_page_phase_puts_each_record_at_its_source_offset_within_a_page(tmp_path):
    """With page_phase, a record the kernel copies (over 256 KiB) has its data at its first
    source's offset modulo the page size (the kernel then copies whole pages), still a multiple
    of 64; a small record, copied through memory, is aligned as torch aligns it (no page of
    padding, which would only make the file bigger); torch loads the file."""
    src = tmp_path / "src.pt"
    values = {"a": torch.arange(5000, dtype=torch.float32), "big": torch.arange(70_000, dtype=torch.float32),
              "b": torch.arange(7, dtype=torch.int64)}
    torch.save(values, src)
    zf = TorchZip(src)
    out = tmp_path / "out.pt"
    with TorchZipWriter(out, "out", page_phase=True) as w:
        w.write_record("data.pkl", zf.read("data.pkl"))
        for key in zf.storages:
            w.copy_record(f"data/{key}", [zf.part(f"data/{key}")])
    written = TorchZip(out)
    end = 0  # where the record before ends (its data descriptor included)
    sizes = []
    for name in sorted(written.records, key=lambda n: written.records[n].offset):
        rec = written.records[name]
        assert rec.offset % 64 == 0
        if name.startswith("data/"):
            sizes.append(rec.size)
            pad = rec.offset - end - (30 + len(f"out/{name}") + 4)  # after its local header and 'FB' extra
            if rec.size > 256 << 10:
                assert rec.offset % 4096 == zf.records[name].offset % 4096
            else:
                assert 0 <= pad < 64, name
        end = rec.offset + rec.size + (16 if rec.size else 0)
    assert sorted(sizes) == [56, 20_000, 280_000]
    loaded = torch.load(out, weights_only=True, mmap=True)
    assert all(torch.equal(loaded[k], values[k]) for k in values)


def test_crc32_combine_matches_zlib():
    rng = random.Random(3)
    for _ in range(200):
        a, b = rng.randbytes(rng.randrange(0, 3000)), rng.randbytes(rng.randrange(0, 3000))
        assert crc32_combine(zlib.crc32(a), zlib.crc32(b), len(b)) == zlib.crc32(a + b)


def test_writer_guards(tmp_path):
    path = tmp_path / "w.pt"
    with pytest.raises(RuntimeError), TorchZipWriter(path, "w") as w:
        w.write_record("data.pkl", b"\x80\x02}.")
        raise RuntimeError("fails halfway")
    assert not path.exists(), "an aborted writer leaves no half-written file"
    with TorchZipWriter(path, "w") as w:
        w.write_record("data.pkl", b"\x80\x02}.")
        w.write_record(".data/serialization_id", b"9" * 40)  # skipped, as torch's writer does
        with pytest.raises(ValueError):
            w.write_record("data.pkl", b"again")
    assert TorchZip(path).serialization_id != "9" * 40
    assert torch.load(path, weights_only=True) == {}


# ---------------------------------------------------------------------------- hygiene and speed
def test_module_never_imports_torch():
    """The reader and the writer, loaded under a bare package (ckpt_tools/__init__ imports the
    commands, which may import torch), used end to end: no torch, no numpy."""
    package, files = str(ROOT / "ckpt_tools"), [str(p) for p in RANK_FILES]
    code = textwrap.dedent(f"""
        import importlib, sys, types, tempfile, os
        pkg = types.ModuleType("ckpt_tools"); pkg.__path__ = [{package!r}]
        sys.modules["ckpt_tools"] = pkg
        tf = importlib.import_module("ckpt_tools.security.torchfile")
        tw = importlib.import_module("ckpt_tools.codecs.torchwriter")
        tp = importlib.import_module("ckpt_tools.codecs.torchpickler")
        for path in {files!r}:
            src = tf.TorchZip(path)
            with tw.TorchZipWriter(os.path.join(tempfile.mkdtemp(), "x.pt"), src.prefix) as w:
                w.write_record("data.pkl", tp.dumps(src.tree))
                for name in src.records:
                    if name not in ("data.pkl", "version", ".data/serialization_id"):
                        w.copy_record(name, [src.part(name)])
        bad = [m for m in sys.modules if m.split(".")[0] in ("torch", "numpy")]
        assert not bad, bad
        print("ok")
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr


def test_hundreds_of_tensors_round_trip():
    """Ten distinct copies of the ws8 optimizer state (630 DTensors, 640 storages): parsed and
    emitted again to the same bytes. (Speed is the benchmark's business, not a test's.)"""
    copies = [TorchZip(FIXTURES / "llama_sharded_ws8" / "optim_world_size_8_rank_0.pt") for _ in range(10)]
    for i, copy in enumerate(copies):
        for ref in copy.storages.values():
            ref.key = str(i * 1000 + int(ref.key))
    big = {"state": {i * 100 + k: v for i, c in enumerate(copies) for k, v in c.tree["state"].items()},
           "param_groups": copies[0].tree["param_groups"]}
    data = dumps(big)
    assert dumps(loads(data)) == data
    assert len(loads(data)["state"]) == 210


@pytest.mark.skipif(not os.environ.get("CKPT_TEST_ZIP64"), reason="writes ~13 GB; set CKPT_TEST_ZIP64=1")
def test_zip64_matches_torch_save(tmp_path):
    """A record over 4 GiB and records past 4 GiB: zip64 extras and descriptors exactly as torch's."""
    big = torch.zeros(2**32 + 100, dtype=torch.uint8)
    big[0], big[-1] = 3, 7
    a, b = tmp_path / "a.pt", tmp_path / "b.pt"
    try:
        torch.save({"big": big, "small": torch.arange(10.0)}, a)
        del big
        src = TorchZip(a)
        assert src.records["data/1"].offset > 2**32
        rewrite(src, b, name_hash=src.serialization_id[:20])
        assert subprocess.run(["cmp", str(a), str(b)]).returncode == 0
        got = torch.load(b, weights_only=True, mmap=True)
        assert got["big"][-1] == 7 and torch.equal(got["small"], torch.arange(10.0))
        del got
    finally:  # pytest keeps tmp dirs around; not these
        a.unlink(missing_ok=True)
        b.unlink(missing_ok=True)


def _saved(value) -> bytes:
    """What torch.save writes for ``value`` (a DCP item's blob)."""
    buf = io.BytesIO()
    torch.save(value, buf)
    return buf.getvalue()


@pytest.mark.parametrize("numel", [12, 20_000], ids=["masked", "by-region"])
def test_blob_records_of_a_blob_like_the_last_are_its_own(numel):
    """Two items of one tensor (same zip, other values): the second's records come from the
    first's layout, with its own CRCs; a blob of that length differing anywhere the parse reads
    (a name, a header) is parsed afresh, and refused like any other. A small blob is compared
    whole under a mask, a large one region by region."""
    blob = _saved

    def parsed(b):
        zipdir._BLOB_LAYOUTS.clear()
        return zipdir.blob_records(b)

    one, two = blob(torch.arange(numel, dtype=torch.float32)), blob(torch.arange(numel, dtype=torch.float32) * 3)
    assert len(one) == len(two) and one != two and (len(one) > zipdir._MASKED) == (numel > 12)
    zipdir._BLOB_LAYOUTS.clear()
    assert zipdir.blob_records(one) == parsed(one)
    want = parsed(two)
    zipdir.blob_records(one)  # (its layout cached)
    got = zipdir.blob_records(two)
    assert got == want and got != zipdir.blob_records(one)  # (the CRCs differ)
    i = two.index(b"PK\x01\x02")
    renamed = two[:i + 46] + b"X" + two[i + 47:]  # a central name no longer its local header's
    zipdir.blob_records(one)
    assert zipdir.blob_records(renamed) is None
    deflated = two[:i + 10] + b"\x08" + two[i + 11:]
    zipdir.blob_records(one)
    assert zipdir.blob_records(deflated) is None


def test_an_item_like_the_last_read_is_read_by_its_fixed_part():
    """A DCP item blob of the length of the last one read whose every byte but its data and
    serialization id (and their CRCs) is that one's holds the same tensor at the same place;
    one that differs anywhere else (a byte of its pickle, its pickle's CRC field) is read afresh,
    and what it holds judged as before."""
    from ckpt_tools.engine import reader

    blob = _saved

    def fresh(b):
        reader._ITEM_LAYOUTS.clear()
        reader._ITEM_TENSORS.clear()
        return reader._item(b, 0, len(b))

    one, two = blob(torch.arange(12, dtype=torch.float32)), blob(torch.arange(12, dtype=torch.float32) * 3)
    want = fresh(two)
    assert want[0] is not None and want[0].size == (12,)
    fresh(one)
    assert len(reader._ITEM_LAYOUTS) == 1  # (the fixed part of one noted)
    got = reader._item(two, 0, len(two))
    assert got[0] is reader._ITEM_TENSORS[next(iter(reader._ITEM_TENSORS))] and got[1:] == want[1:]
    assert two[got[1]:got[1] + got[2]] == torch.arange(12, dtype=torch.float32).mul(3).numpy().tobytes()
    at = two.index(b"FloatStorage")
    other = two[:at] + b"F" + b"l".upper() + two[at + 2:]  # its pickle changed: its CRC no longer holds
    fresh(one)
    assert reader._item(other, 0, len(other)) == fresh(other) == (None, None, 0)
    i = two.index(b"PK\x01\x02")  # the pickle's central entry comes first: its CRC field
    recrc = two[:i + 16] + bytes(4) + two[i + 20:]
    fresh(one)
    assert reader._item(recrc, 0, len(recrc)) == fresh(recrc) == (None, None, 0)


def test_an_items_fixed_part_is_every_byte_but_its_datas_and_their_crcs():
    """Flip any one byte of an item blob: it still matches the fixed part of the blob it was
    taken from exactly where that byte is the data record's, or a CRC field of it (central
    entry, data descriptor), read as bytes or through a view alike."""
    blob = _saved(torch.arange(12, dtype=torch.float32))
    records = zipdir.blob_records(blob)
    data = next(n for n in records if n.endswith("/data/0"))
    fixed = zipdir.fixed_part(blob, (data,))
    start, size, _ = records[data]
    central = [j for j in range(len(blob)) if blob.startswith(b"PK\x01\x02", j)]
    crc_fields = {j + 16 + k for j in central for k in range(4)
                  if blob[j + 46:j + 46 + len(data.encode())] == data.encode()}
    descriptor = {start + size + 4 + k for k in range(4)} if blob[start + size:start + size + 4] == b"PK\x07\x08" else set()
    free = set(range(start, start + size)) | crc_fields | descriptor
    assert len(crc_fields) == 4
    for j in range(len(blob)):
        flipped = blob[:j] + bytes([blob[j] ^ 0x5A]) + blob[j + 1:]
        got = zipdir.matches(flipped, fixed)
        assert got == zipdir.matches(memoryview(flipped), fixed) == (j in free), j
    assert zipdir.matches(blob, fixed) and zipdir.matches(memoryview(bytearray(blob)), fixed)


@pytest.mark.parametrize("value", [torch.arange(7, dtype=torch.float32), torch.zeros(0), torch.ones(3, 5, dtype=torch.bfloat16),
                                   torch.tensor(3.5)])
def test_blob_records_match_zipfile(value):
    """A DCP item blob's records read without zipfile (a 1,024-rank DCP has one per tensor and
    rank) are zipfile's, offsets and CRCs included; anything but the plain case is None (and the
    zipfile path reads it)."""
    import io
    import struct

    buf = io.BytesIO()
    torch.save(value, buf)
    blob = buf.getvalue()
    got = zipdir.blob_records(blob)
    with zipfile.ZipFile(io.BytesIO(blob)) as z:
        want = {}
        for i in z.infolist():
            n, e = struct.unpack_from("<HH", blob, i.header_offset + 26)
            start = i.header_offset + 30 + n + e
            assert blob[start:start + i.file_size] == z.read(i)
            want[i.filename] = (start, i.file_size, i.CRC)
    assert got == want
    assert zipdir.blob_records(memoryview(blob)) == want
    assert zipdir.blob_records(blob[:-1]) is None  # truncated
    assert zipdir.blob_records(blob[:-2] + b"\x01\x00" + b"x") is None  # a comment
    i = blob.index(b"PK\x01\x02")
    assert zipdir.blob_records(blob[:i + 10] + b"\x08" + blob[i + 11:]) is None  # deflated


def _zip_mutations(tmp_path: Path) -> list[Path]:
    """torch.save files, and the same altered in ways the zip reader's fast path must leave to
    zipfile (or read as zipfile does)."""
    out = []
    plain = tmp_path / "plain.pt"
    torch.save({"w": torch.arange(6.0), "b": torch.ones(2, dtype=torch.int64)}, plain)
    out.append(plain)
    accented = tmp_path / "accented.pt"  # an archive folder name that is not ASCII (a UTF-8 flagged name)
    with zipfile.ZipFile(plain) as src, zipfile.ZipFile(accented, "w") as dst:
        for info in src.infolist():
            dst.writestr("modèle/" + info.filename.split("/", 1)[1], src.read(info))
    out.append(accented)
    data = plain.read_bytes()
    for name, blob in {
        "prepended": b"junk" * 16 + data,
        "truncated": data[: len(data) // 2] + data[-200:],
        "cut": data[:-10],
        "commented": data[:-2] + (7).to_bytes(2, "little") + b"comment",
        "bad-central": data.replace(b"PK\x01\x02", b"PK\x01\x03", 1),
        "bad-local": data.replace(b"PK\x03\x04", b"PK\x03\x05", 2),
    }.items():
        (p := tmp_path / f"{name}.pt").write_bytes(blob)
        out.append(p)
    deflated = tmp_path / "deflated.pt"
    with zipfile.ZipFile(plain) as src, zipfile.ZipFile(deflated, "w", zipfile.ZIP_DEFLATED) as dst:
        for info in src.infolist():
            dst.writestr(info.filename, src.read(info))
    out.append(deflated)
    # a job's files: one layout, other data and CRCs, and another folder name of that length
    # (read from the first's layout), then that layout with one thing changed
    for rank in "ABC":
        torch.save({"w": torch.arange(6.0) + ord(rank), "b": torch.ones(2, dtype=torch.int64)}, p := tmp_path / f"job{rank}.pt")
        out.append(p)
    job = (tmp_path / "jobC.pt").read_bytes()
    at = job.index(b"PK\x03\x04", 1)  # the second record's local header: its extra field one byte longer
    extra = int.from_bytes(job[at + 28:at + 30], "little")
    (p := tmp_path / "jobD.pt").write_bytes(job[:at + 28] + (extra + 1).to_bytes(2, "little") + job[at + 30:])
    out.append(p)
    (p := tmp_path / "jobH.pt").write_bytes(job[:at + 3] + b"\x05" + job[at + 4:])  # its signature damaged
    out.append(p)
    # the layout's names with other sizes, so other places (a rank holding other rows): read by it
    torch.save({"w": torch.arange(9.0), "b": torch.ones(2, dtype=torch.int64)}, p := tmp_path / "jobI.pt")
    out.append(p)
    at = job.index(b"PK\x01\x02")  # the first record's central directory entry
    size = int.from_bytes(job[at + 20:at + 24], "little")
    (p := tmp_path / "jobJ.pt").write_bytes(job[:at + 20] + (size + 1).to_bytes(4, "little") + job[at + 24:])  # compressed?
    out.append(p)
    place = int.from_bytes(job[at + 42:at + 46], "little")
    (p := tmp_path / "jobK.pt").write_bytes(job[:at + 42] + (place + 1).to_bytes(4, "little") + job[at + 46:])  # no header there
    out.append(p)
    at = job.rindex(b"jobC/data/0")  # its name in the central directory
    (p := tmp_path / "jobE.pt").write_bytes(job[:at] + b"jobC/data/1" + job[at + 11:])  # a repeated name
    out.append(p)
    (p := tmp_path / "jobF.pt").write_bytes(job[:at] + b"jobX/data/0" + job[at + 11:])  # two folders
    out.append(p)
    (p := tmp_path / "jobG.pt").write_bytes(job.replace(b"jobC/", b"jo/C/"))  # a folder with a slash
    out.append(p)
    stray = tmp_path / "stray.pt"
    with zipfile.ZipFile(plain) as src, zipfile.ZipFile(stray, "w") as dst:
        for info in src.infolist():
            dst.writestr(info.filename, src.read(info))
        dst.writestr("other/data.pkl", b"x")
    out.append(stray)
    return out


@pytest.mark.parametrize("small", [4096, 0], ids=["small-layouts", "large-layouts"])
def test_zip_records_fast_path_reads_as_zipfile_does(tmp_path, monkeypatch, small):
    """The struct reader of plain zips gives zipfile's records, or leaves the file to it: every
    file, altered or not, gets the same records or the same refusal either way. Large layouts
    (25k records) are kept only once a second zip repeats them, and check a later zip by their
    places' structs and its headers' lengths in one string: the same records and refusals."""
    monkeypatch.setattr(zipdir, "_SMALL", small)
    monkeypatch.setattr(zipdir, "_ZIP_LAYOUTS", {})
    def outcome(path: Path):
        try:
            return zipdir.zip_records(path)
        except BadInput as e:
            return type(e), str(e)

    used, same = [], []
    plain_records, same_layout = zipdir._plain_records, zipdir._same_layout
    monkeypatch.setattr(zipdir, "_plain_records", lambda *a: used.append(r := plain_records(*a)) or r)
    monkeypatch.setattr(zipdir, "_same_layout", lambda *a: same.append(r := same_layout(*a)) or r)
    for path in _zip_mutations(tmp_path):
        if path.stem in ("jobD", "jobE", "jobF", "jobG", "jobH", "jobI", "jobJ", "jobK"):
            for _ in range(1 if small else 2):  # (large: kept once read twice, after the last file's)
                zipdir.zip_records(tmp_path / "jobC.pt")  # the layout each is compared with: jobC's
        used.clear()
        same.clear()
        fast = outcome(path)
        with monkeypatch.context() as m:
            m.setattr(zipdir, "_plain_records", lambda *a: None)
            slow = outcome(path)
        assert fast == slow, path.name
        if path.stem in ("plain", "accented", "jobA", "jobB", "jobC"):
            assert used and used[0] is not None, path.name  # read by the fast path itself
        if path.stem in (("jobB", "jobC", "jobI") if small else ("jobC", "jobI")):
            assert same[0][0] == path.stem, path.name  # by the layout of the job's first file (large: its second's)
        if path.stem in ("jobD", "jobE", "jobF", "jobG", "jobH", "jobJ", "jobK"):
            assert same and same[0] is None, path.name  # not by that layout
    assert zipdir.zip_records(tmp_path / "accented.pt")[0] == "modèle"


def test_zip_records_of_one_jobs_files_share_their_columns(tmp_path):
    """A job's rank files (one zip layout, their own data and CRCs) share one set of names,
    offsets and sizes: each keeps 4 bytes a record of its own, not a Record apiece. What they
    read is zipfile's all the same, Record by Record, and by the shortcuts the describer and
    the writer use."""
    import binascii

    files = []
    for rank in range(3):
        torch.save({"w": torch.arange(6.0) + rank, "b": torch.ones(2, dtype=torch.int64) * rank},
                   p := tmp_path / f"rank{rank}.pt")
        files.append(p)
    read = [zipdir.zip_records(p)[1] for p in files]
    assert read[1]._cols is read[2]._cols  # the second and later files of a layout: one set of columns
    assert all(read[1].offset(n) is read[2].offset(n) for n in read[1])  # (ints a description shares)
    for path, records in zip(files, read):
        with zipfile.ZipFile(path) as z:
            want = {i.filename.split("/", 1)[1]: i for i in z.infolist()}
            data = path.read_bytes()
        assert list(records) == list(want) and len(records) == len(want)
        for name, info in want.items():
            rec = records[name]
            assert (rec.name, rec.size, rec.crc32) == (name, info.file_size, info.CRC)
            assert binascii.crc32(data[rec.offset:rec.offset + rec.size]) == info.CRC
            assert records.offset(name) == rec.offset and records.size(name) == rec.size and name in records
        assert records.size("data/99") is None and "data/99" not in records
        assert records.crcs_by_place() == {(r.offset, r.size): r.crc32 for r in records.values()}
        with pytest.raises(KeyError):
            records.offset("data/99")


def test_zip_layouts_kept_once_seen_twice_and_names_shared(tmp_path, monkeypatch):
    """A layout is kept once a second zip of its directory's size has it, so a zip that is the
    first of its kind keeps none. Rank files whose records lie elsewhere (ranks holding other
    rows: other sizes, other places) are read from it, with their own sizes and places; those
    that hold the same rows share its columns. Zips with the same record names share one index
    of names; each reads as zipfile does."""
    monkeypatch.setattr(zipdir, "_SMALL", 0)  # (as for a 25k-record zip, with two records)
    monkeypatch.setattr(zipdir, "_ZIP_LAYOUTS", {})
    monkeypatch.setattr(zipdir, "_NAMES", {})
    whole = []
    read_layout = zipdir._read_layout
    monkeypatch.setattr(zipdir, "_read_layout", lambda *a: whole.append(1) or read_layout(*a))

    def save(name: str, a: int, b: int) -> Path:
        torch.save({"x": torch.zeros(a), "y": torch.ones(b)}, p := tmp_path / f"{name}.pt")
        return p

    u0, v0, v1, w0 = save("u0", 64, 16), save("v0", 16, 64), save("v1", 16, 64), save("w0", 300, 7)
    read = {}
    for p in (u0, v0, v1, w0, u0):
        read[p.stem] = zipdir.zip_records(p)[1]
        data = p.read_bytes()
        with zipfile.ZipFile(p) as z:
            want = {i.filename.split("/", 1)[1]: (i.file_size, i.CRC) for i in z.infolist()}
            assert {n: (r.size, r.crc32) for n, r in read[p.stem].items()} == want
            for n, r in read[p.stem].items():  # (its data where zipfile reads it)
                assert z.read(f"{p.stem}/{n}") == data[r.offset:r.offset + r.size]
        kept = [v for v in zipdir._ZIP_LAYOUTS.values() if type(v) is zipdir._ZipLayout]
        assert len(kept) == (0 if p is u0 and len(whole) == 1 else 1), p.stem  # v0's, the second of its size
    assert len(whole) == 2  # u0 and v0 read whole; v1, w0 and u0 again from v0's layout
    assert read["u0"].offset("data/1") != read["v0"].offset("data/1")  # other places
    assert read["u0"]._cols.index is read["v0"]._cols.index is read["w0"]._cols.index  # one index of names
    assert read["v1"]._cols is read["v0"]._cols  # the same rows: the layout's columns
    assert read["w0"]._cols is not read["v0"]._cols  # other rows: its own sizes and places
