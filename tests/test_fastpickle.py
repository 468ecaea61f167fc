"""The fast reader of DCP ``.metadata`` (security/fastpickle.py) against the careful one.

It must build exactly what the careful reader builds (the same classes, fields, keys in order,
and shared objects), or decline; never admit what the careful reader refuses. Checked on the
committed DCP fixtures (torch 2.14, 2.15, accelerate's), on a pickle using every opcode it
knows, on hostile pickles, and on thousands of seeded mutations of a real ``.metadata``.
"""

from __future__ import annotations

import io
import pickle
import pickletools
from collections import OrderedDict
from pathlib import Path

import pytest

from mutations import mutations

from ckpt_tools.errors import BadInput, UnsafeInput
from ckpt_tools.security import bounded, dcpmeta, dcprows, fastpickle
from ckpt_tools.security.dcpmeta import load_dcp_metadata

FIX = Path(__file__).resolve().parents[1] / "fixtures"
REAL = ["llama_dcp", "dcp_torch214", "dcp_torch215", "llama_accelerate/optimizer_0",
        "llama_accelerate/pytorch_model_fsdp_0"]


ROWS = (dcprows.ChunkRow, dcprows.IndexKey, dcprows.StorageRow)


def _careful(data: bytes):
    return dcpmeta.MetadataUnpickler(io.BytesIO(data)).load()


def _fast(data: bytes, rows: bool = True, window: int | None = None):
    """The fast reader's tree, DCP's records read as rows in one step where they can be
    (``rows``) and the rest as rows after; Decline where it refers back to what a row skipped.
    ``window``: read from a file that many bytes at a time, as load_dcp_metadata reads it."""
    u = dcpmeta.MetadataUnpickler(io.BytesIO(data))
    u.proto = 4
    readers = dcpmeta.fast_readers(dcprows.Rows()) if rows else None
    if window is None:
        tree = fastpickle.load(data, u.find_class, readers)
    else:
        f = io.BytesIO(data)
        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(fastpickle, "WINDOW", window)
            tree = fastpickle.load(f.read(window), u.find_class, readers, more=f.read)
    for _ in bounded.distinct_nodes(tree):  # (a part of a record read as a row, met again: declined)
        pass
    return tree


def _as_row(x) -> tuple | None:
    """The row a record read as an object stands for (what the fast reader reads it as, in the
    forms torch pickles it): the same attributes, compared by value; None if it has none."""
    state = vars(x)
    if type(x) is dcpmeta.ChunkStorageMetadata and len(state) == 2:
        off, sizes = x.offsets, x.sizes
        if type(off) is tuple and type(sizes) is tuple and len(off) == len(sizes) and all(
                type(v) is int and v >= 0 for v in off + sizes):
            return dcprows.ChunkRow((off, sizes))
    if type(x) is dcpmeta.MetadataIndex and state.keys() <= {"fqn", "offset", "index", "_k"}:
        return dcprows.IndexKey(x._key())
    if type(x) is dcpmeta.StorageInfo and len(state) == 4 and x.transform_descriptors is None and \
            type(x.relative_path) is str and type(x.offset) is int and type(x.length) is int:
        return dcprows.StorageRow((x.relative_path, x.offset, x.length))
    return None


def _shape(x, ids: dict) -> object:
    """``x`` as plain nested data, its classes named and every shared container marked by the
    order it was first met, so two trees are equal only if built alike, sharing included."""
    if type(x) in (str, int, float, bool, bytes, type(None)):
        return (type(x).__name__, x)
    if type(x) in ROWS:  # built of names and ints, compared by value
        return (type(x).__name__, repr(x))
    if type(x) is tuple and all(type(v) is int for v in x):  # a Size: shared or not, the same value
        return ("tuple", repr(x))
    if isinstance(x, dcpmeta._Record) and (row := _as_row(x)) is not None:
        return (type(row).__name__, repr(row))
    if type(x) is dcpmeta.TensorProperties:  # one object per distinct record, shared: by value
        return ("TensorProperties", _shape(vars(x), {}))
    if id(x) in ids:
        return ("shared", ids[id(x)])
    ids[id(x)] = len(ids)
    if isinstance(x, dcpmeta._Record):
        return (type(x).__name__, _shape(vars(x), ids))
    if isinstance(x, dict):
        return (type(x).__name__, [(_shape(k, ids), _shape(v, ids)) for k, v in x.items()],
                _shape(getattr(x, "__dict__", None), ids))
    if isinstance(x, (list, tuple)):
        return (type(x).__name__, [_shape(v, ids) for v in x])
    return (type(x).__name__, repr(x))


def _same(a, b) -> bool:
    return _shape(a, {}) == _shape(b, {})


@pytest.mark.parametrize("name", REAL)
def test_a_real_metadata_reads_the_same_both_ways(name):
    data = (FIX / name / ".metadata").read_bytes()
    assert _same(_fast(data), _careful(data))


def test_torchs_dcp_classes_with_every_opcode_read_the_same(tmp_path):
    """torch's own classes, pickled by dcp.save's pickler, holding every kind of plain data the
    fast reader knows (long strings, bytes, floats, big ints, None/True, lists, OrderedDict)."""
    import torch
    from torch.distributed.checkpoint.metadata import (ChunkStorageMetadata, Metadata, MetadataIndex,
                                                       TensorProperties, TensorStorageMetadata)

    chunks = [ChunkStorageMetadata(offsets=torch.Size([i * 2, 0]), sizes=torch.Size([2, 3])) for i in range(300)]
    meta = Metadata(
        state_dict_metadata={"w": TensorStorageMetadata(TensorProperties(dtype=torch.bfloat16),
                                                        torch.Size([600, 3]), chunks)},
        planner_data={"w": ("w",), "x" * 300: [1.5, -(2 ** 70), 2 ** 40, None, True, b"\x00" * 300, []],
                      "od": OrderedDict(a=1, b=(2, 3, 4, 5))},
        storage_data={MetadataIndex("w", [i * 2, 0], i): i for i in range(300)})
    for protocol in (4, 5):
        data = pickle.dumps(meta, protocol=protocol)
        assert _same(_fast(data), _careful(data))
        p = tmp_path / ".metadata"
        p.write_bytes(data)
        assert load_dcp_metadata(p).storage_data[dcpmeta.MetadataIndex(fqn="w", offset=(4, 0))] == 2


@pytest.mark.parametrize("case", ["global", "deep", "tuple-key", "shared-key", "set", "protocol-2"])
def test_hostile_pickles_are_declined_and_refused(tmp_path, case):
    import os

    if case == "global":
        data = pickle.dumps(os.system, protocol=4)
    elif case == "deep":  # lists 200,000 deep: the tree check after the read refuses it
        data = b"\x80\x04" + b"]" * 200_000 + b"a" * 199_999 + b"."
    elif case == "tuple-key":  # a key whose hash would recurse 200,000 deep in C: refused before it is hashed
        data = b"\x80\x04}" + b")" + b"\x85" * 200_000 + b"K\x01s."
    elif case == "shared-key":  # ((k, k), (k, k)) 60 levels: written by hand, as {k: 1} would hash it here
        key = b"K\x01\x85\x94" + b"".join(b"h" + bytes([i]) + b"h" + bytes([i]) + b"\x86\x94" for i in range(60))
        data = b"\x80\x04}" + key + b"K\x01s."
    elif case == "set":
        data = pickle.dumps({1, 2}, protocol=4)
    else:
        data = pickle.dumps(OrderedDict(a=1), protocol=2)
    if case != "deep":
        with pytest.raises(fastpickle.Decline):
            _fast(data)
    p = tmp_path / ".metadata"
    p.write_bytes(data)
    with pytest.raises(BadInput) as e:
        load_dcp_metadata(p)
    if case == "global":
        assert isinstance(e.value, UnsafeInput)
    if case in ("tuple-key", "shared-key", "deep", "set"):
        assert isinstance(e.value, bounded.HostileTree)


def test_frames_are_read_as_the_careful_reader_reads_them():
    data = (FIX / "llama_dcp" / ".metadata").read_bytes()
    assert data[2] == 0x95  # FRAME
    size = int.from_bytes(data[3:11], "little")

    def framed(n: int) -> bytes:
        return data[:3] + n.to_bytes(8, "little") + data[11:]

    # a frame that ends inside a string's bytes (the last name of two or more characters): the
    # careful reader refuses the read across its end; the fast one declines
    pos = max(pos for op, arg, pos in pickletools.genops(data) if op.name == "SHORT_BINUNICODE" and len(arg) > 1)
    with pytest.raises(fastpickle.Decline):
        _fast(framed(pos + 3 - 11))
    with pytest.raises(pickle.UnpicklingError, match="exhausted before end of frame"):
        _careful(framed(pos + 3 - 11))
    # a frame claiming a byte more than the file holds: the careful reader reads the shorter
    # frame it gets; the fast one declines rather than judge it, and the careful tree is the answer
    with pytest.raises(fastpickle.Decline):
        _fast(framed(size + 1))
    assert _same(_careful(framed(size + 1)), _careful(data))


def _many_frames() -> bytes:
    """A ``.metadata`` of many frames, as dcp.save pickles a many-rank job's (4,000 chunks)."""
    import torch
    from torch.distributed.checkpoint.metadata import (ChunkStorageMetadata, Metadata, MetadataIndex,
                                                       TensorProperties, TensorStorageMetadata)
    from torch.distributed.checkpoint.filesystem import _StorageInfo

    chunks = [ChunkStorageMetadata(offsets=torch.Size([i, 0]), sizes=torch.Size([1, 3])) for i in range(4000)]
    data = pickle.dumps(Metadata(
        state_dict_metadata={"w": TensorStorageMetadata(TensorProperties(dtype=torch.float32), torch.Size([4000, 3]),
                                                        chunks)},
        storage_data={MetadataIndex("w", [i, 0], i): _StorageInfo(f"__{i % 8}_0.distcp", 12 * i, 12)
                      for i in range(4000)}), protocol=4)
    assert sum(op.name == "FRAME" for op, _, _ in pickletools.genops(data)) > 5
    return data


@pytest.mark.parametrize("window", [1, 100, 5000, 1 << 20])
def test_a_metadata_read_window_by_window_reads_the_same(window):
    """Read a window at a time (frames larger and smaller than the window, a window ending
    anywhere in an opcode), a real file gives the careful reader's tree, every byte read."""
    for name, data in [*((n, (FIX / n / ".metadata").read_bytes()) for n in REAL), ("many frames", _many_frames())]:
        assert _same(_fast(data, window=window), _careful(data)), name
    # an unframed pickle past the first window: declined (the careful reader then reads it), never cut short
    framed = pickle.dumps({"a" * 3000: [1, 2, 3]}, protocol=4)
    data = framed[:2] + framed[11:]  # (its one frame's opcode taken out)
    assert framed[2] == 0x95 and int.from_bytes(framed[3:11], "little") == len(framed) - 11
    assert _careful(data) == {"a" * 3000: [1, 2, 3]}
    with pytest.raises(fastpickle.Decline):
        _fast(data, window=1000)
    assert _fast(data, window=len(data)) == {"a" * 3000: [1, 2, 3]}


def test_a_frame_claiming_more_than_any_pickler_writes_is_declined_unread():
    """Read by windows, a FRAME claiming 2**62 bytes is declined, not read for (the careful
    reader then refuses the file); no read asks for more than a window."""
    data = (FIX / "llama_dcp" / ".metadata").read_bytes()
    data = data[:3] + (2 ** 62).to_bytes(8, "little") + data[11:]
    f, asked = io.BytesIO(data), []
    u = dcpmeta.MetadataUnpickler(io.BytesIO(data))
    u.proto = 4
    with pytest.raises(fastpickle.Decline):
        fastpickle.load(f.read(100), u.find_class, None, more=lambda n: asked.append(n) or f.read(n))
    assert asked and max(asked) <= fastpickle.WINDOW


def test_load_dcp_metadata_never_holds_the_file_whole(tmp_path, monkeypatch):
    """The file is read a window at a time, each frame's bytes let go once read: the reads ask
    for a window each, never the whole file; the tree is the careful reader's."""
    data = _many_frames()
    p = tmp_path / ".metadata"
    p.write_bytes(data)
    monkeypatch.setattr(fastpickle, "WINDOW", 1024)
    asked: list[int] = []
    load, rows = fastpickle.load, []
    monkeypatch.setattr(fastpickle, "load", lambda buf, fc, records, more, pairs=None: rows.append(1) or load(
        buf, fc, records, lambda n: asked.append(n) or more(n), pairs))
    got = load_dcp_metadata(p)
    assert rows and len(asked) > len(data) // 70_000 and max(asked) < 70_000 < len(data) // 4  # (frames of 64 KiB)
    assert _same(got, _careful(data))


@pytest.mark.parametrize("name,seed", [("dcp_torch215", s) for s in range(4)] + [("llama_dcp", s) for s in range(2)])
def test_mutated_metadata_reads_the_same_or_is_declined(name, seed):
    """Whatever the bytes, the fast reader gives the careful reader's tree or declines (then the
    careful reader decides); it never gives a tree where the careful reader fails. The second
    file is mostly records read as rows (146 chunks, 169 storage entries)."""
    data = (FIX / name / ".metadata").read_bytes()
    agreed = declined = 0
    for i, m in enumerate(mutations(data, seed, 400)):
        try:
            fast = _fast(m, window=(None, 1, 777)[i % 3])  # whole, or a window at a time
        except fastpickle.Decline:
            declined += 1
            continue
        with bounded.gc_paused():
            careful = _careful(m)  # must not raise: the fast reader vouched for these bytes
        assert _same(fast, careful)
        agreed += 1
    assert agreed and declined


@pytest.mark.parametrize("target", [("pathlib", "PosixPath"),
                                    ("torch.distributed.checkpoint.metadata", "_MEM_FORMAT_ENCODING"),
                                    ("torch.serialization", "_get_layout")])
def test_build_into_a_class_or_function_is_refused_and_changes_nothing(tmp_path, target):
    """BUILD with slot state is ``setattr`` on whatever is on the stack: on a class find_class
    gave (a ``_str`` on PosixPath would rename every path written afterwards) it would change
    that class for the whole process. Both readers refuse it before any attribute is set."""
    module, name = (s.encode() for s in target)
    found = dcpmeta.MetadataUnpickler(io.BytesIO(b"")).find_class(*target)
    data = (b"\x80\x04\x8c" + bytes([len(module)]) + module + b"\x8c" + bytes([len(name)]) + name + b"\x93"
            + b"N}\x8c\x0dckpt_test_bad\x4b\x01s\x86b.")  # BUILD (None, {"ckpt_test_bad": 1})
    p = tmp_path / ".metadata"
    p.write_bytes(data)
    try:
        with pytest.raises(fastpickle.Decline):
            _fast(data)
        with pytest.raises(UnsafeInput, match="sets attributes of"):
            load_dcp_metadata(p)
        assert not hasattr(found, "ckpt_test_bad")
    finally:
        if hasattr(found, "ckpt_test_bad"):
            delattr(found, "ckpt_test_bad")


def _refusal(path: Path) -> tuple[type, str] | None:
    try:
        load_dcp_metadata(path)
    except Exception as e:  # noqa: BLE001 - compared, not handled
        return type(e), str(e)
    return None


@pytest.mark.parametrize("seed", range(2))
def test_a_declined_file_gets_the_careful_readers_own_refusal(tmp_path, monkeypatch, seed):
    """Through load_dcp_metadata, with the fast reader and without it: the same refusal (type
    and message) for every mutated file, and the same tree for every one both accept."""
    data = (FIX / "dcp_torch214" / ".metadata").read_bytes()
    p = tmp_path / ".metadata"
    refused = 0
    for m in mutations(data, 100 + seed, 150):
        p.write_bytes(m)
        with monkeypatch.context() as mp:
            mp.setattr(dcpmeta, "FAST_MAX_BYTES", -1)  # careful reader only
            careful = _refusal(p)
            careful_tree = None if careful else load_dcp_metadata(p)
        fast = _refusal(p)
        assert fast == careful
        if careful:
            refused += 1
        else:
            assert _same(load_dcp_metadata(p), careful_tree)
    assert refused


def test_binput_reads_as_the_careful_readers_memo_takes_it():
    """The memo is a list: protocol 2's BINPUT at its end or over an entry reads as the careful
    reader's dict does, sharing included; a put past its end (a dict takes it, a list cannot)
    is declined, and the careful reader's tree is the answer."""
    # ``]q\x00`` BINPUT 0 at the end, ``q\x00`` again over it, then ``h\x00`` BINGET: the last put wins
    cases = [b"\x80\x04](K\x01q\x00K\x02q\x00h\x00e.",
             b"\x80\x04]q\x00(]q\x01K\x01ah\x01h\x00e.",
             b"\x80\x04](K\x01q\x05h\x05e."]  # BINPUT 5 into an empty memo
    for data in cases[:2]:
        assert _same(_fast(data, rows=False), _careful(data)), data
    assert _same(_fast(cases[1]), _careful(cases[1]))
    with pytest.raises(fastpickle.Decline, match="over a memo entry"):  # (where a record reader may have looked)
        _fast(cases[0])
    assert _careful(cases[0]) == [1, 2, 2]
    got = _careful(cases[1])
    assert got[0] is got[1] and got[2] is got
    with pytest.raises(fastpickle.Decline, match="past the memo's end"):
        _fast(cases[2], rows=False)
    assert _careful(cases[2]) == [1, 1]


def test_an_index_key_is_worked_out_from_its_fields_never_taken_from_the_file():
    """MetadataIndex keeps its key once worked out; a pickled state naming that attribute
    neither sets it nor hides a field change from it, in either reader."""
    from torch.distributed.checkpoint.metadata import MetadataIndex

    forged = MetadataIndex("a", [0, 0])
    object.__setattr__(forged, "_k", ("b", (0, 0)))  # what a hostile file could say
    data = pickle.dumps({forged: 1}, protocol=4)
    assert b"_k" in data
    for read in (_fast, _careful):
        (idx,) = read(data)
        assert idx._key() == ("a", (0, 0)) and hash(idx) == hash(("a", (0, 0)))
        assert idx == dcpmeta.MetadataIndex(fqn="a", offset=(0, 0))
        idx.__setstate__({"fqn": "c", "offset": (1, 0)})  # a second BUILD: the key follows it
        assert idx._key() == ("c", (1, 0))


@pytest.mark.parametrize("field", ["__class__", "__dict__"])
def test_a_record_state_naming_the_object_itself_is_refused(tmp_path, field):
    """A record's fields are set one by one (so its values stay inline, without a dict of its
    own); a state key such as ``__class__`` would then reach the object itself (turn a chunk
    into another record class, or swap its attributes wholesale). Both readers refuse it."""
    meta = b"torch.distributed.checkpoint.metadata"
    glob = b"\x8c" + bytes([len(meta)]) + meta + b"\x8c\x14ChunkStorageMetadata\x93"
    other = b"\x8c" + bytes([len(meta)]) + meta + b"\x8c\x08Metadata\x93"
    key = field.encode()
    # ChunkStorageMetadata() with state {field: <the Metadata class>}
    data = b"\x80\x04" + glob + b")\x81}(\x8c" + bytes([len(key)]) + key + other + b"ub."
    p = tmp_path / ".metadata"
    p.write_bytes(data)
    with pytest.raises(fastpickle.Decline, match="pickled field named"):
        _fast(data)
    with pytest.raises(ValueError, match="pickled field named"):
        _careful(data)
    with pytest.raises(BadInput, match="corrupt"):
        load_dcp_metadata(p)


def _rows_in(tree) -> dict[type, int]:
    counts = {t: 0 for t in ROWS}
    for node in bounded.distinct_nodes(tree):
        for child in bounded.children(node) or ():  # (a dict's: its keys and values)
            if type(child) in counts:
                counts[type(child)] += 1
    return counts


def test_a_real_many_record_metadata_is_read_as_rows():
    """torch's chunks and storage entries come as rows, each in one step (all but the first
    of each kind, whose field names are new to the memo), and read the same attributes."""
    data = (FIX / "llama_dcp" / ".metadata").read_bytes()
    fast, careful = _fast(data), _careful(data)
    counts = _rows_in(fast)
    chunks = sum(len(md.chunks) for md in careful.state_dict_metadata.values() if hasattr(md, "chunks"))
    assert counts[dcprows.ChunkRow] == chunks - 1 > 100
    assert counts[dcprows.IndexKey] == counts[dcprows.StorageRow] == len(careful.storage_data) - 1
    for (k, v), (ck, cv) in zip(fast.storage_data.items(), careful.storage_data.items()):
        assert k == ck and hash(k) == hash(ck) and k.fqn == ck.fqn and k.offset == ck.offset
        assert (v.relative_path, v.offset, v.length, v.transform_descriptors) == \
            (cv.relative_path, cv.offset, cv.length, cv.transform_descriptors)
        assert fast.storage_data[ck] is v  # a record looks its row up, and the other way round
        assert careful.storage_data[k] is cv
    lengths: dict[int, int] = {}  # items of one length share one int (the description holds one per chunk)
    rows = [v for v in fast.storage_data.values() if type(v) is dcprows.StorageRow]
    assert all(lengths.setdefault(v.length, v.length) is v.length for v in rows) and len(lengths) < len(rows) // 2
    for name, md in careful.state_dict_metadata.items():
        for c, r in zip(getattr(md, "chunks", ()), getattr(fast.state_dict_metadata[name], "chunks", ())):
            assert (r.offsets, r.sizes) == (c.offsets, c.sizes)


def test_every_form_of_a_record_reads_the_same(tmp_path):
    """Chunks of 0 to 4 dims, offsets past 2**31 (LONG1) and below 0, names over 255 bytes, an
    index of None, a byte item's entry (no offsets), a path shared by memo: rows where torch's
    forms allow (at most 3 dims, a name in one opcode), records otherwise; the same tree."""
    import torch
    from torch.distributed.checkpoint.filesystem import _StorageInfo
    from torch.distributed.checkpoint.metadata import (BytesStorageMetadata, ChunkStorageMetadata, Metadata,
                                                       MetadataIndex, TensorProperties, TensorStorageMetadata)

    long = "w" * 300
    state, storage = {}, {}
    for dims in range(5):
        name = f"t{dims}" if dims != 2 else long
        size = torch.Size([4] * dims)
        chunks = [ChunkStorageMetadata(offsets=torch.Size([0] * dims), sizes=size)]
        state[name] = TensorStorageMetadata(TensorProperties(dtype=torch.float32), size, chunks)
        storage[MetadataIndex(name, [0] * dims, None if dims == 1 else 0)] = \
            _StorageInfo("__0_0.distcp", 2 ** 33 + dims if dims < 3 else -dims, 64)
    state["obj"] = BytesStorageMetadata()
    storage[MetadataIndex("obj")] = _StorageInfo("__0_0.distcp", 0, 8)
    data = pickle.dumps(Metadata(state_dict_metadata=state, storage_data=storage), protocol=4)
    fast, careful = _fast(data), _careful(data)
    assert _same(fast, careful)
    counts = _rows_in(fast)
    assert counts[dcprows.ChunkRow] == 3  # dims 1 to 3 (the first chunk, of 0 dims, names its fields)
    assert counts[dcprows.IndexKey] == 4 and counts[dcprows.StorageRow] == 5  # not the first; the long name's
    p = tmp_path / ".metadata"
    p.write_bytes(data)
    got = load_dcp_metadata(p)
    assert [c.sizes for md in got.state_dict_metadata.values() for c in getattr(md, "chunks", ())] == \
        [(), (4,), (4, 4), (4, 4, 4), (4, 4, 4, 4)]
    assert got.storage_data[dcpmeta.MetadataIndex(fqn="t1", offset=(0,))].offset == 2 ** 33 + 1
    assert got.storage_data[("obj", None)].length == 8


def test_tensors_properties_are_one_object_per_distinct_record(tmp_path):
    """A tensor's ``TensorProperties`` is read in one step, one object for each distinct record
    (its dtype, requires_grad, pin_memory...) shared by the tensors that have it, each reading
    as the careful reader's: many tensors' properties were an object, a dict and a tuple each."""
    import torch
    from torch.distributed.checkpoint.metadata import (ChunkStorageMetadata, Metadata, TensorProperties,
                                                       TensorStorageMetadata)

    kinds = [dict(dtype=torch.float32), dict(dtype=torch.bfloat16), dict(dtype=torch.float32, requires_grad=True),
             dict(dtype=torch.int64, pin_memory=True)]
    state = {f"t{i}": TensorStorageMetadata(TensorProperties(**kinds[i % 4]), torch.Size([2]),
                                            [ChunkStorageMetadata(offsets=torch.Size([0]), sizes=torch.Size([2]))])
             for i in range(400)}  # (past 256 memo entries: LONG_BINGET references too)
    data = pickle.dumps(Metadata(state_dict_metadata=state), protocol=4)
    fast, careful = _fast(data), _careful(data)
    assert _same(fast, careful)
    got = {id(md.properties): md.properties for md in fast.state_dict_metadata.values()}
    assert len(got) < 20  # (not one per tensor: a record referring to its fields another way is another)
    for name, md in careful.state_dict_metadata.items():
        mine = fast.state_dict_metadata[name].properties
        assert vars(mine) == vars(md.properties) and type(mine) is dcpmeta.TensorProperties
    p = tmp_path / ".metadata"
    p.write_bytes(data)
    assert load_dcp_metadata(p).state_dict_metadata["t2"].properties.requires_grad is True


@pytest.mark.parametrize("name", ["w.weight", "w\u2014w", "\u00e9" * 40])
def test_an_index_named_again_is_read_in_one_step_or_the_careful_way(name):
    """A tensor's storage entries after its first name it anew, as torch pickles each key: read
    in one step by their name's bytes when that name was read before, and the same either way
    when those bytes hold the byte of MEMOIZE (\u2014 is e2 80 94 in UTF-8: the one-step match
    ends early, its length tells, and the entry is read the other way)."""
    import torch
    from torch.distributed.checkpoint.filesystem import _StorageInfo
    from torch.distributed.checkpoint.metadata import (ChunkStorageMetadata, Metadata, MetadataIndex,
                                                       TensorProperties, TensorStorageMetadata)

    chunks = [ChunkStorageMetadata(offsets=torch.Size([2 * r, 0]), sizes=torch.Size([2, 4])) for r in range(6)]
    state = {name: TensorStorageMetadata(TensorProperties(dtype=torch.float32), torch.Size([12, 4]), chunks)}
    # (each key its own string, as a many-rank save gathers them: pickled anew, not referred to)
    storage = {MetadataIndex(name.encode().decode(), [2 * r, 0], 0): _StorageInfo(f"__{r}_0.distcp", 8, 32)
               for r in range(6)}
    data = pickle.dumps(Metadata(state_dict_metadata=state, storage_data=storage), protocol=4)
    assert data.count(name.encode()) == 7
    fast, careful = _fast(data), _careful(data)
    assert _same(fast, careful)
    keys = list(fast.storage_data)
    assert [k.fqn for k in keys] == [name] * 6 and [k.offset for k in keys] == [(2 * r, 0) for r in range(6)]
    # (all but the first, whose field names are new; with MEMOIZE's byte in the name, one step or not)
    assert _rows_in(fast)[dcprows.IndexKey] == 5


@pytest.mark.parametrize("again", ["state", "record", "tensor state", "properties"])
def test_a_pickle_referring_back_into_a_row_is_read_the_careful_way(tmp_path, again):
    """A chunk's state dict and a ``torch.Size`` call's arguments are not built when the chunk
    is read as a row, and the memo does not keep the record itself; nor does it keep the state
    dict of a record read opcode by opcode once spent (a tensor's), nor a tensor's properties
    record (one object shared by the tensors alike). A pickle that refers to any of these again
    (torch never does) is declined by the tree check and read again by the careful reader: the
    same tree as the careful one."""
    import torch
    from torch.distributed.checkpoint.metadata import (ChunkStorageMetadata, Metadata, TensorProperties,
                                                       TensorStorageMetadata)

    chunks = [ChunkStorageMetadata(offsets=torch.Size([i, 0]), sizes=torch.Size([1, 3])) for i in range(3)]
    tensors = {n: TensorStorageMetadata(TensorProperties(dtype=torch.float32), torch.Size([3, 3]), chunks)
               for n in ("w", "v")}  # (the second's properties read in one step, its fields memoized)
    target = {"state": chunks[2].__dict__, "record": chunks[2], "tensor state": tensors["v"].__dict__,
              "properties": tensors["v"].properties}[again]
    meta = Metadata(state_dict_metadata=tensors, planner_data={"w": ("w",), "again": target})
    data = pickle.dumps(meta, protocol=4)
    with pytest.raises(fastpickle.Decline, match="refers back"):
        _fast(data)
    p = tmp_path / ".metadata"
    p.write_bytes(data)
    got = load_dcp_metadata(p)
    assert _same(got, _careful(data))
    assert all(type(c) is dcpmeta.ChunkStorageMetadata for c in got.state_dict_metadata["w"].chunks)
    if again == "state":
        assert got.planner_data["again"] == {"offsets": (2, 0), "sizes": (1, 3)}
    elif again == "record":
        assert got.planner_data["again"] is got.state_dict_metadata["w"].chunks[2]
    elif again == "tensor state":
        assert got.planner_data["again"].keys() == {"properties", "size", "chunks"}
    else:
        assert got.planner_data["again"] is got.state_dict_metadata["v"].properties


def _many_rank_metadata(ranks: int = 64, tensors: int = 8, share: bool = False, backwards: bool = False,
                        one_process: bool = False, paths_shared: bool = False, at=None) -> bytes:
    """A ``.metadata`` as a many-rank save gathers it, pickled by torch's own classes: every
    key's name its own string, every Size its own object. ``share``: the first two tensors
    hold one chunks list (which torch never writes: a pickle's memo can); ``backwards``: the
    entries listed from the last rank to the first, against their chunks' order;
    ``one_process``: every key's name the state dict's own string (a save that gathered
    nothing: the pickle refers back to it); ``paths_shared``: a rank's entries share its
    file's name, as one rank's gathered results do (else each entry has its own string);
    ``at(r, t)``: the byte offset of tensor ``t``'s item on rank ``r`` (else ``1000 * t``)."""
    import torch
    from torch.distributed.checkpoint.filesystem import _StorageInfo
    from torch.distributed.checkpoint.metadata import (ChunkStorageMetadata, Metadata, MetadataIndex,
                                                       TensorProperties, TensorStorageMetadata)

    state, storage, first = {}, {}, None
    for t in range(tensors):
        fqn = f"layers.{t}.w"
        chunks = [ChunkStorageMetadata(offsets=torch.Size([2 * r, 0]), sizes=torch.Size([2, 4])) for r in range(ranks)]
        if share:
            chunks = first = first or chunks
        state[fqn] = TensorStorageMetadata(TensorProperties(dtype=torch.float32), torch.Size([2 * ranks, 4]), chunks)
    names, paths = list(state), [f"__{r}_0.distcp" for r in range(ranks)]
    for r in range(ranks)[::-1 if backwards else 1]:  # (rank by rank, as torch gathers the entries)
        for t in range(tensors):
            storage[MetadataIndex(names[t] if one_process else f"layers.{t}.w", torch.Size([2 * r, 0]), r)] = \
                _StorageInfo(paths[r] if paths_shared else f"__{r}_0.distcp", at(r, t) if at else 1000 * t, 32 + t)
    return pickle.dumps(Metadata(state_dict_metadata=state, storage_data=storage), protocol=4)


def test_the_memo_keeps_codes_and_each_distinct_part_once(monkeypatch):
    """A many-record ``.metadata``'s memo (as a 64-rank save gathers it: every record's
    ``torch.Size`` its own object): four bytes an entry, the records and their unbuilt parts
    one code (UNREAD), each distinct Size value and name one object however many records
    hold it, two bytes an entry; and the tree read is the careful reader's, each distinct
    chunk in it one row."""
    ranks = 64
    data = _many_rank_metadata(ranks=ranks, tensors=8)

    seen = []

    class Spy(fastpickle.Memo):
        __slots__ = ()

        def __init__(self):
            super().__init__()
            seen.append(self)

    monkeypatch.setattr(fastpickle, "Memo", Spy)
    fast = _fast(data)
    assert _same(fast, _careful(data))
    memo, = seen
    # each distinct chunk one row, its tensors' chunks alike (but the first, read as a record,
    # and one across a frame's end)
    rows = [c for md in fast.state_dict_metadata.values() for c in md.chunks]
    assert len(rows) == 8 * ranks and ranks <= len({id(c) for c in rows}) <= ranks + 1 + len(data) // (64 << 10) + 1
    assert memo.codes.itemsize == 2  # (it names fewer than 65,536 objects)
    assert len(memo.codes) > 12 * 8 * ranks  # (every MEMOIZE of the pickle has its entry)
    assert memo.objs[0] is fastpickle.UNREAD and memo.codes.count(0) > len(memo.codes) // 2
    assert len(memo.objs) < len(memo.codes) // 10
    sizes = [x for x in memo.objs if type(x) is tuple and all(type(v) is int for v in x)]
    # each offsets value once (and the tensors' sizes, the records read opcode by opcode): not one per record, 1,536
    assert len(sizes) < 2 * ranks
    assert not any(type(x) in ROWS for x in memo.objs)  # (a record read as a row is not kept there)


def test_the_memo_widens_to_four_bytes_an_entry_wherever_it_must(monkeypatch, tmp_path):
    """Past 65,536 objects the memo's codes widen from two bytes to four, once, wherever that
    falls: between records, or inside a record reader (the Size or name that needs the wider
    code: the record read again, nothing of it added twice). Swept over every point it can
    fall at (the memo made to widen sooner), and at its real limit (a file of 12,000 tensors),
    the tree read is the careful reader's."""
    seen, raised = [], []

    class Spy(fastpickle.Memo):
        __slots__ = ()
        room = 0xFFFF

        def __init__(self):
            super().__init__()
            self._room = Spy.room
            seen.append(self)

        def shared(self, x):
            try:
                return super().shared(x)
            except fastpickle.Widened:
                raised.append(len(self.codes))
                raise

    monkeypatch.setattr(fastpickle, "Memo", Spy)
    data = _many_rank_metadata(ranks=24, tensors=6)
    careful = _careful(data)
    assert _same(_fast(data), careful)
    objs = len(seen[-1].objs)
    assert seen[-1].codes.itemsize == 2 and not raised
    for room in range(objs - 1):  # (its largest code, objs - 1, past the room)
        Spy.room = room
        assert _same(_fast(data), careful), room
        memo = seen[-1]
        assert memo.codes.itemsize == 4 and len(memo.objs) == objs
        assert memo.codes.tolist() == seen[0].codes.tolist()  # (every entry the code it had at two bytes)
    assert 0 < len(raised) < objs - 1  # (widened inside a record's reader at some points, between records at the rest)

    # read with the joiner, entries joined a run at a time: the same joins wherever it widens
    p = tmp_path / ".metadata"
    p.write_bytes(data)
    plain = load_dcp_metadata(p)
    Spy.room, raised[:] = 0xFFFF, []
    stored = dcprows.Stored()
    load_dcp_metadata(p, stored=stored)
    objs, joined = len(seen[-1].objs), _joined(stored)
    assert joined > len(plain.storage_data) // 2
    for room in range(objs - 1):
        Spy.room, stored = room, dcprows.Stored()
        got = load_dcp_metadata(p, stored=stored)
        assert seen[-1].codes.itemsize == 4 and len(seen[-1].objs) == objs, room
        assert _joined(stored) == joined and _entries(got, stored) == _entries(plain), room
    assert raised

    Spy.room, raised[:] = 0xFFFF, []
    data = _many_rank_metadata(ranks=2, tensors=12000)
    assert _same(_fast(data), _careful(data))
    memo = seen[-1]
    assert len(memo.objs) > 0x10000 and memo.codes.itemsize == 4 and max(memo.codes) == len(memo.objs) - 1


def _entries(meta, stored=None) -> dict:
    """Every chunk's storage entry, as ``(name, offsets) -> (file, offset, length)``, whether the
    reader joined it to its chunk (in ``stored``'s tables) or left it in ``storage_data``."""
    out = {k._key() if hasattr(k, "_key") else tuple(k): (v.relative_path, v.offset, v.length)
           for k, v in meta.storage_data.items()}
    for fqn, table in (stored.tables if stored else {}).items():
        chunks = meta.state_dict_metadata[fqn].chunks
        assert len(table) % 3 == 0 and len(table) <= 3 * len(chunks)
        for c, at in zip(chunks, range(0, len(table), 3)):
            if table[at] >= 0:
                assert (fqn, c.offsets) not in out
                out[(fqn, c.offsets)] = (stored.files[table[at]], table[at + 1], table[at + 2])
    return out


def _joined(stored) -> int:
    return sum(table[at] >= 0 for table in stored.tables.values() for at in range(0, len(table), 3))


@pytest.mark.parametrize("name", ["many", "backwards", "llama_dcp", "dcp_torch215"])
def test_a_joined_read_moves_each_entry_to_its_chunk_and_nothing_else(tmp_path, name):
    """Read with ``stored``, the storage entry of a chunk, both read as rows, is in the tables
    at its chunk's place, gone from the dict: every chunk and every entry as the plain read has them,
    in order, and (torch lists both rank by rank) all but the first few joined; entries in
    another order than their chunks are left in the dict, each where it was."""
    if name in ("many", "backwards"):
        p = tmp_path / ".metadata"
        p.write_bytes(_many_rank_metadata(backwards=name == "backwards"))
    else:
        p = FIX / name / ".metadata"
    stored = dcprows.Stored()
    plain, joined = load_dcp_metadata(p), load_dcp_metadata(p, stored=stored)
    assert list(plain.state_dict_metadata) == list(joined.state_dict_metadata)
    for fqn, md in plain.state_dict_metadata.items():
        got = joined.state_dict_metadata[fqn]
        if not hasattr(md, "chunks"):
            continue
        assert [(c.offsets, c.sizes) for c in md.chunks] == [(c.offsets, c.sizes) for c in got.chunks]
    n = _joined(stored)
    assert _entries(plain) == _entries(joined, stored)
    assert n == len(plain.storage_data) - len(joined.storage_data)
    if name == "backwards":  # (each tensor's rank-0 entry, last, meets the cursor still at its first chunk)
        assert n <= len(plain.state_dict_metadata)
    else:
        assert n >= len(plain.storage_data) - 2 * len(plain.state_dict_metadata)


def test_an_entrys_offset_is_joined_as_pickled_at_every_width_and_a_negative_one_is_not(tmp_path):
    """A storage entry's byte offset, pickled at the width its value needs (BININT1, BININT2,
    BININT, LONG1), is joined as that value; a negative one (a BININT is signed) is not joined:
    it stays in the dict as read, as the plain read has it."""
    def at(r, t):
        return (5, 70_000 + r, 1 << 40, -7 - r)[t % 4] if r % 2 else 1000 * t

    p = tmp_path / ".metadata"
    p.write_bytes(_many_rank_metadata(ranks=16, tensors=8, paths_shared=True, at=at))
    plain, stored = load_dcp_metadata(p), dcprows.Stored()
    got = load_dcp_metadata(p, stored=stored)
    assert _entries(got, stored) == _entries(plain)
    negative = {k for k, v in _entries(plain).items() if v[1] < 0}
    assert len(negative) == 8 * 2 and negative <= {k._key() if hasattr(k, "_key") else tuple(k) for k in got.storage_data}
    assert _joined(stored) >= 16 * 8 - len(negative) - 8  # (the rest: all but the first few)


@pytest.mark.parametrize("one_process", [False, True])
def test_many_tensors_entries_are_joined_in_runs_as_long_as_a_frame(monkeypatch, tmp_path, one_process):
    """Many tensors of a few chunks each: every entry names its tensor, or the first offsets
    value, before any other entry did. Both are entered in the memo within the run, so a run
    ends only at a frame's end (or a SETITEMS): a few runs per frame, not one per entry, and
    every entry joined as before (its name a new string or, from a save in one process, a
    reference to the state dict's)."""
    calls = []
    index = dcprows.Rows.index

    def spy(self, *args):
        calls.append(1)
        return index(self, *args)

    monkeypatch.setattr(dcprows.Rows, "index", spy)
    data = _many_rank_metadata(ranks=2, tensors=3000, one_process=one_process, paths_shared=True)
    p = tmp_path / ".metadata"
    p.write_bytes(data)
    plain, stored = load_dcp_metadata(p), dcprows.Stored()
    calls.clear()
    got = load_dcp_metadata(p, stored=stored)
    assert _entries(got, stored) == _entries(plain) and len(plain.storage_data) == 6000
    # (left in the dict: the first entry, which names the fields, and one across a frame's end)
    frames = len(data) // (64 << 10) + 1
    assert _joined(stored) == 6000 - len(got.storage_data) and len(got.storage_data) <= frames + 1 < 20
    assert len(calls) <= 3 * frames < 60  # (a few a frame: one reads across its end)
    assert _same(_fast(data), _careful(data))


def test_a_tensors_name_is_one_string_however_often_the_metadata_names_it(tmp_path):
    """A many-rank save names each tensor anew in its metadata's key and in each rank's storage
    entry: read, the name is one string, whether the entries are read as objects or joined to
    their chunks (a 25k-tensor DCP's read peaked 4.7 MB lower); the tree is the careful
    reader's all the same."""
    data = _many_rank_metadata(ranks=4, tensors=300, paths_shared=True)
    p = tmp_path / ".metadata"
    p.write_bytes(data)
    plain, stored = load_dcp_metadata(p), dcprows.Stored()
    joined = load_dcp_metadata(p, stored=stored)
    names = {id(name) for name in plain.state_dict_metadata}
    assert len(plain.storage_data) == 1200 and all(id(key.fqn) in names for key in plain.storage_data)
    names = {id(name) for name in joined.state_dict_metadata}
    assert len(stored.tables) == 300 and all(id(name) in names for name in stored.tables)
    assert _same(_fast(data), _careful(data))


def test_a_run_of_entries_joined_anywhere_but_a_storage_dict_s_keys_is_refused(tmp_path):
    """The index reader joins a run of entries as it reads them, leaving one JOINED where their
    keys and values were: dropped from the dict SETITEMS fills where it stands in a key's place;
    in a value's place, or in a list (the same records listed in ``planner_data``, before the
    storage dict), the fast read is declined and the file read the careful way: every entry
    in the dict, none joined."""
    import torch
    from torch.distributed.checkpoint.filesystem import _StorageInfo
    from torch.distributed.checkpoint.metadata import MetadataIndex

    J = dcprows.JOINED
    assert dcprows._without_joined([J, "k", "v", J, "k2", "v2", J]) == ["k", "v", "k2", "v2"]
    items = ["k", "v"]
    assert dcprows._without_joined(items) is items
    with pytest.raises(fastpickle.Decline):
        dcprows._without_joined(["k", J, "k2", "v2"])

    meta = pickle.loads(_many_rank_metadata(ranks=16, tensors=4))  # (torch's own classes: torch is the writer)
    # each tensor's rank-0 entry twice (the first read as records: its name, Size and file then
    # known), its file one string (as torch's entries share theirs): the second joined as read
    file = "__0_0.distcp"
    meta.planner_data = [x for t in range(4) for _ in range(2)
                         for x in (MetadataIndex(f"layers.{t}.w", torch.Size([0, 0]), 0), _StorageInfo(file, 1000 * t, 32 + t))]
    p = tmp_path / ".metadata"
    p.write_bytes(pickle.dumps(meta, protocol=4))
    plain, stored = load_dcp_metadata(p), dcprows.Stored()
    got = load_dcp_metadata(p, stored=stored)
    assert _joined(stored) == 0 and len(got.storage_data) == 64 and _entries(got) == _entries(plain)
    assert len(got.planner_data) == 16 and not any(x is dcprows.JOINED for x in got.planner_data)


def test_a_chunks_list_two_tensors_share_gives_each_its_own_entries(tmp_path):
    """A pickle may hand two tensors one chunks list: each name keeps its own cursor and table,
    so each tensor's chunks are described by its own entries (never by the other's)."""
    from ckpt_tools.formats import dcp as dcp_format

    (tmp_path / ".metadata").write_bytes(_many_rank_metadata(ranks=4, tensors=2, share=True))
    for r in range(4):
        (tmp_path / f"__{r}_0.distcp").write_bytes(b"\0" * 2048)
    stored = dcprows.Stored()
    joined = load_dcp_metadata(tmp_path / ".metadata", stored=stored)
    a, b = joined.state_dict_metadata.values()
    assert a.chunks is b.chunks and sorted(stored.tables) == ["layers.0.w", "layers.1.w"]
    for t, length in (("layers.0.w", 32), ("layers.1.w", 33)):  # (rank 0's, read as records, stay in the dict)
        table = stored.tables[t]
        assert [table[at + 2] for at in range(3, len(table), 3)] == [length] * 3 and table[0] == -1
    tensors = {t.name: t for t in dcp_format._describe_one(tmp_path, "")[0]}
    for t, length in (("layers.0.w", 32), ("layers.1.w", 33)):
        locs = [c.location for c in tensors[t].chunks]
        assert [(loc.file, loc.length) for loc in locs] == [(f"__{r}_0.distcp", length) for r in range(4)]


def test_describe_is_the_same_joined_or_not(monkeypatch, tmp_path):
    """A DCP described from a joined read is the one described from the plain read."""
    from ckpt_tools.formats import dcp as dcp_format
    from ckpt_tools.formats import describe

    (tmp_path / ".metadata").write_bytes(_many_rank_metadata())
    for r in range(64):
        (tmp_path / f"__{r}_0.distcp").write_bytes(b"\0" * 8192)
    for path in (tmp_path, FIX / "llama_dcp"):
        joined = describe(path)
        monkeypatch.setattr(dcp_format, "load_dcp_metadata", lambda p, stored=None: load_dcp_metadata(p))
        plain = describe(path)
        monkeypatch.undo()
        assert joined.tensors == plain.tensors and joined.objects == plain.objects


def test_a_many_rank_tensor_is_described_as_columns_that_read_as_its_chunks(monkeypatch, tmp_path):
    """A tensor of many chunks is kept as a ChunkTable: read in every way (index, slice,
    iteration, its columns, its files and extents, handed to a worker), it is the tuple of
    Chunks the per-chunk description gives, joined read or plain."""
    import io
    import pickle

    from ckpt_tools.core.describe import ChunkTable, columns, extents, files_of
    from ckpt_tools.formats import dcp as dcp_format
    from ckpt_tools.formats import describe
    from ckpt_tools.runtime import private

    (tmp_path / ".metadata").write_bytes(_many_rank_metadata())
    for r in range(64):
        (tmp_path / f"__{r}_0.distcp").write_bytes(b"\0" * 8192)
    tables = describe(tmp_path)
    monkeypatch.setattr(dcp_format, "TABLE_MIN", 1 << 30)
    chunked = describe(tmp_path)
    monkeypatch.setattr(dcp_format, "load_dcp_metadata", lambda p, stored=None: load_dcp_metadata(p))
    plain = describe(tmp_path)
    many = [t for t in tables.tensors if len(t.chunks) >= 8]
    assert many and all(type(t.chunks) is ChunkTable for t in many)
    assert all(type(t.chunks) is tuple for t in chunked.tensors)
    assert tables.tensors == chunked.tensors == plain.tensors
    for t, twin in zip(tables.tensors, chunked.tensors):
        got, want = t.chunks, twin.chunks
        assert tuple(got) == want and len(got) == len(want) and got[-1] == want[-1] and got[1::3] == want[1::3]
        assert [got[i] for i in range(len(want))] == list(want)
        assert columns(got) == ([c.offsets for c in want], [c.sizes for c in want])
        assert list(extents(got)) == [(c.sizes, c.file, c.byte_offset, c.length) for c in want]
        assert files_of(got) == {c.file for c in want}
        assert t.rows_index() == twin.rows_index() and t.row_tiles() == twin.row_tiles()
    back = private.load(io.BytesIO(pickle.dumps(many[0])))
    assert back == many[0] and type(back.chunks) is tuple
