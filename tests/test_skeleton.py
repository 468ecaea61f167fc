"""A many-rank job's files read like the first one (security/skeleton.py, ``TorchZip(like=...)``).

The careful (pure-Python, key-checking, tree-bounding) reader parses one file of a job; a file
whose pickle differs from it only in values is read by the C unpickler with the same allowlist
and persistent-id checks. These tests pin what that may and may not change: the tree read fast
equals the careful one, a change outside the values falls back to the careful reader, and a
changed value is still checked.
"""

from __future__ import annotations

import pickle
from collections import OrderedDict
from pathlib import Path

import pytest

from ckpt_tools.codecs.torchpickler import dumps
from ckpt_tools.codecs.torchwriter import TorchZipWriter
from ckpt_tools.errors import BadInput, UnsafeInput
from ckpt_tools.formats import sharded, shardtree
from ckpt_tools.security import skeleton
from ckpt_tools.security.torchfile import Global, NewObj, Reduce, StorageRef, Template, TorchZip

FIXTURES = Path(__file__).resolve().parent.parent / "fixtures"


def canon(x, seen=None):
    """A tree as nested tuples: equal for trees of equal content and sharing."""
    t = type(x)
    if t is Global:
        return ("G", x.module, x.name)
    if t in (Reduce, NewObj):
        return (t.__name__, canon(x.func), canon(x.args), canon(x.state))
    if t is StorageRef:
        return ("S", canon(x.type), str(x.key), x.location, x.numel)
    if t is OrderedDict:
        return ("O", tuple((canon(k), canon(v)) for k, v in x.items()), canon(getattr(x, "__dict__", {})))
    if isinstance(x, dict):
        return ("D", tuple((canon(k), canon(v)) for k, v in x.items()))
    if t in (list, tuple):
        return (t.__name__, tuple(canon(v) for v in x))
    if isinstance(x, str):
        return ("s", str(x))
    return (t.__name__, x)


def rank_files(job: str) -> list[Path]:
    return sorted((FIXTURES / job).glob("model_world_size_*_rank_*.pt"), key=lambda p: int(p.stem.rsplit("_", 1)[1]))


@pytest.mark.parametrize("job", ["llama_sharded_ws8", "llama_tied_sharded_ws2"])
def test_rank_files_read_like_rank_0_equal_the_careful_reading(job):
    files = rank_files(job)
    like = [TorchZip(files[0]).template()]
    for f in files[1:]:
        fast, careful = TorchZip(f, like=like), TorchZip(f)
        assert not fast.exact and careful.exact
        assert fast.pickle != like[0].pickle  # the rank differs: a real value change, not a copy
        assert canon(fast.tree) == canon(careful.tree)
        assert {k: (canon(r.type), r.numel) for k, r in fast.storages.items()} == \
               {k: (canon(r.type), r.numel) for k, r in careful.storages.items()}


def test_describe_is_the_same_with_and_without_the_fast_reader(monkeypatch):
    path = FIXTURES / "llama_sharded_ws8"
    fast = sharded.describe(path)
    monkeypatch.setattr(skeleton.Skeleton, "same_shape", lambda self, other: False)
    careful = sharded.describe(path)
    assert fast.tensors == careful.tensors and fast.objects == careful.objects
    read = []
    monkeypatch.setattr(shardtree, "TorchZip",
                        lambda p, like=(), **kw: read.append(bool(like)) or TorchZip(p, like=like, **kw))
    sharded.describe(path)
    assert read and all(read)  # every file after the first is offered the first as a model


def _zip(path: Path, data: bytes, records: dict[str, bytes] | None = None) -> Path:
    with TorchZipWriter(path, "archive") as w:
        w.write_record("data.pkl", data)
        for name, payload in (records or {}).items():
            w.write_record(name, payload)
        w.write_record("version", b"3\n")
    return path


def _tensor_pickle(numel: int, name: str = "w") -> bytes:
    ref = StorageRef(Global("torch", "FloatStorage"), "0", "cpu", numel)
    return dumps({name: Reduce(Global("torch._utils", "_rebuild_tensor_v2"),
                               (ref, 0, (numel,), (1,), False, OrderedDict()))})


def test_skeleton_admits_value_changes_only():
    a = _tensor_pickle(4)
    s = skeleton.Skeleton(a)
    assert s.same_shape(a)
    assert s.same_shape(_tensor_pickle(5))  # an int's value
    assert s.same_shape(_tensor_pickle(4, "v"))  # a string's contents, same length
    assert not s.same_shape(_tensor_pickle(4, "vv"))  # another length
    assert not s.same_shape(_tensor_pickle(4) + b"K\x01")  # more after STOP
    i = a.index(b"q")  # a BINPUT: a memo index is shape, not value
    assert not s.same_shape(a[:i + 1] + bytes([a[i + 1] ^ 1]) + a[i + 2:])
    j = a.index(b"cdatetime") if b"cdatetime" in a else a.index(b"ctorch")  # a GLOBAL's name
    assert not s.same_shape(a[:j + 1] + b"X" + a[j + 2:])


@pytest.mark.parametrize("numel", [255, 300, 70_000, -1, 1 << 40, 1 << 300])
def test_an_int_of_another_width_is_the_same_shape(numel):
    # BININT1 (4) for BININT2, BININT, LONG1 of any length, and back: one int all the same,
    # the rest of the pickle compared shifted
    small, other = _tensor_pickle(4), _tensor_pickle(numel)
    assert skeleton.Skeleton(small).same_shape(other) and skeleton.Skeleton(other).same_shape(small)
    if numel != 255:
        assert len(other) != len(small)


def _ops(*parts: bytes) -> bytes:
    return b"\x80\x02]q\x00" + b"".join(parts) + b"."  # PROTO 2, a memoized list, parts, STOP


def test_an_int_of_another_width_changes_nothing_else():
    model = skeleton.Skeleton(_ops(b"K\x05a", b"K\x06a"))  # [5, 6]
    assert model.same_shape(_ops(b"M\x2c\x01a", b"\x8a\x01\x07a"))  # BININT2, LONG1: [300, 7]
    # a memo put after the int where the model has none: not a value, so another shape
    assert not model.same_shape(_ops(b"M\x2c\x01q\x01a", b"K\x06a"))
    assert not model.same_shape(_ops(b"K\x05q\x01a", b"K\x06a"))
    # another opcode in an int's place: a float, a string, None, a bool, a memo get
    for other in (b"G" + bytes(8), b"\x8c\x01x", b"N", b"\x88", b"h\x00"):
        assert not model.same_shape(_ops(other + b"a", b"K\x06a")), other
    # the int dropped or doubled, or a LONG1 whose length overruns the pickle
    assert not model.same_shape(_ops(b"K\x06a"))
    assert not model.same_shape(_ops(b"K\x05K\x05a", b"K\x06a"))
    assert not model.same_shape(b"\x80\x02]q\x00\x8a\x09\x05a")
    # a float is a value of its own width only; and it is no int
    floats = skeleton.Skeleton(_ops(b"G" + bytes(8) + b"a"))
    assert floats.same_shape(_ops(b"G" + bytes(7) + b"\x01a"))
    assert not floats.same_shape(_ops(b"K\x05a"))


def test_a_length_prefix_changes_into_nothing_else():
    model = skeleton.Skeleton(_ops(b"\x8c\x02abq\x01a"))  # ['ab'], the string memoized
    assert model.same_shape(_ops(b"\x8c\x02xyq\x01a"))
    # a shorter string whose next bytes line up again, bytes for text, a LONG1 of the same bytes
    assert not model.same_shape(_ops(b"\x8c\x01aq\x01a"))
    assert not model.same_shape(_ops(b"C\x02abq\x01a"))
    assert not model.same_shape(_ops(b"\x8a\x02abq\x01a"))
    assert not model.same_shape(_ops(b"\x8c\x02abq\x02a"))  # the memo index
    ints = skeleton.Skeleton(_ops(b"\x8a\x02ab" + b"a"))  # a LONG1 is an int: not a string
    assert not ints.same_shape(_ops(b"\x8c\x02aba"))


def test_scan_of_a_damaged_pickle_ends_in_value_error():
    # every cut of a real pickle (a GLOBAL's name line cut short among them), and bytes no
    # opcode has: a ValueError or an answer, never a hang or another exception
    data = dumps({"w": [1, 300, 1 << 40, 1.5, "abc", b"xy", Global("torch", "Size")]})
    assert b"ctorch\nSize\n" in data
    for n in range(len(data)):
        try:
            skeleton._scan(data[:n])
        except ValueError:
            pass
        assert not skeleton.Skeleton(data).same_shape(data[:n])
    for bad in (b"\xff", b"c", b"ctorch\n", b"ctorch", b"X\xff\xff\xff\x7f", b"\x8b\xff\xff\xff\x7f",
                b"I12", b"Fnot a float\n", b"V\\u12\n", b"S'abc\n", b"\x95\x01"):
        with pytest.raises(ValueError):
            skeleton._scan(b"\x80\x02" + bad)
    assert skeleton.Skeleton(b"\x80\x02\xff.").same_shape(b"\x80\x02\xff.") is False


def test_a_changed_value_is_still_checked(tmp_path):
    good = TorchZip(_zip(tmp_path / "a.pt", _tensor_pickle(4), {"data/0": bytes(16)})).template()
    # the same shape, but the storage now claims 5 floats: its record holds 4
    with pytest.raises(BadInput, match="needs 20 bytes"):
        TorchZip(_zip(tmp_path / "b.pt", _tensor_pickle(5), {"data/0": bytes(16)}), like=[good])
    # an int of another width too: a numel far past any record, or below zero (refused)
    for numel in (1 << 2000, -4):
        with pytest.raises(BadInput):
            TorchZip(_zip(tmp_path / "d.pt", _tensor_pickle(numel), {"data/0": bytes(16)}), like=[good])
    ok = TorchZip(_zip(tmp_path / "c.pt", _tensor_pickle(4, "v"), {"data/0": bytes(16)}), like=[good])
    assert not ok.exact and list(ok.tree) == ["v"]


def test_a_global_named_by_changed_strings_is_still_refused(tmp_path):
    # protocol 4 names globals by two strings (STACK_GLOBAL): values, as far as the skeleton
    # is concerned; the allowlist sees the new name
    def p4(module: str, name: str) -> bytes:
        return (b"\x80\x04\x8c" + bytes([len(module)]) + module.encode() + b"\x8c" + bytes([len(name)])
                + name.encode() + b"\x93)R.")  # STACK_GLOBAL, EMPTY_TUPLE, REDUCE: module.name()
    good = TorchZip(_zip(tmp_path / "a.pt", p4("torch", "Size"))).template()
    assert skeleton.Skeleton(good.pickle).same_shape(p4("posix", "syst"))
    with pytest.raises(UnsafeInput, match="posix.syst"):
        TorchZip(_zip(tmp_path / "b.pt", p4("posix", "syst")), like=[good])
    assert pickle.loads(p4("builtins", "list")) == []  # (the opcodes mean what the comment says)


def test_bad_text_in_a_changed_value_is_damage_not_a_crash(tmp_path):
    a = _tensor_pickle(4, "w")
    good = TorchZip(_zip(tmp_path / "a.pt", a, {"data/0": bytes(16)})).template()
    i = a.index(b"X\x01\x00\x00\x00w") + 5
    bad = a[:i] + b"\xff" + a[i + 1:]  # not UTF-8
    with pytest.raises(BadInput, match="damaged pickle"):
        TorchZip(_zip(tmp_path / "b.pt", bad, {"data/0": bytes(16)}), like=[good])


def test_a_file_is_compared_with_the_two_models_nearest_its_length(tmp_path, monkeypatch):
    # a file like no model is parsed the careful way; its cost stays two walks, whatever `like` holds
    like = [Template(_tensor_pickle(n), frozenset()) for n in (1 << 300, 70_000, 5, 300)]
    tried = []
    monkeypatch.setattr(skeleton.Skeleton, "same_shape", lambda self, other: tried.append(self.data) or False)
    zf = TorchZip(_zip(tmp_path / "a.pt", _tensor_pickle(4), {"data/0": bytes(16)}), like=like)
    assert zf.exact and tried == [like[2].pickle, like[3].pickle]
    assert like[2].skeleton() is like[2].skeleton()  # built once per model


@pytest.mark.parametrize("value", [0, 255, 256, 65535, 65536, -1, 2**31, -(2**40)])
def test_the_values_strings_and_ints_a_pickle_holds_are_found_by_place(value):
    """``strings`` lists each string value at every place it is held (a name held twice, twice);
    ``value_at`` gives each value's opcode; ``int_at`` reads the int there at any width."""
    bb = "".join(["b", "b"])  # (another object than the key: pickled again, not memoized)
    data = pickle.dumps({"a": [value, bb, "a"], "bb": 1.5, "key": "cpu"}, protocol=2)
    sk = skeleton.Skeleton(data)
    strings = sk.strings()
    assert set(strings) == {b"a", b"bb", b"key", b"cpu"}
    assert [len(strings[s]) for s in (b"a", b"bb", b"key", b"cpu")] == [1, 2, 1, 1]  # (the second "a": memoized)
    ints = [(at, got) for n in range(20) if (at := sk.value_at(n)) and (got := skeleton.int_at(data, at[0]))]
    assert [got[0] for _, got in ints] == [value] and ints[0][0][1] == ints[0][1][1]  # (where it ends)
    assert sk.value_at(-1) is None and sk.value_at(10**6) is None
    n = strings[b"cpu"][0]
    start, end = sk.value_at(n)
    assert data[start:end].endswith(b"cpu") and skeleton.int_at(data, start) is None
