"""The fast reader of torch.save pickles (security/torchpickle.py) against the careful one.

It must build exactly what the careful reader builds (the same nodes, containers, strings kept
apart, storages, and shared objects), or decline; never admit what the careful reader refuses.
Checked on every committed torch.save fixture, on a save holding every kind of plain data, on
hostile pickles, and on thousands of seeded mutations of a real rank file's pickle.
"""

from __future__ import annotations

import os
import pickle
import zipfile
from collections import OrderedDict
from pathlib import Path

import pytest
import torch

from mutations import mutations

from ckpt_tools.errors import BadInput, UnsafeInput
from ckpt_tools.security import bounded, torchfile, torchpickle

FIX = Path(__file__).resolve().parents[1] / "fixtures"
SAVES = sorted(str(p.relative_to(FIX)) for p in [*FIX.rglob("*.pt"), *FIX.rglob("*.bin")] if zipfile.is_zipfile(p))


def _pickle_of(path: Path) -> bytes:
    with zipfile.ZipFile(path) as z:
        return z.read(next(n for n in z.namelist() if n.endswith("/data.pkl")))


def _careful(data: bytes):
    u = torchfile._Unpickler(data)
    return u.load(), u.storages


def _fast(data: bytes):
    u = torchfile._Unpickler(data)
    nodes = torchpickle.Nodes(u.find_class, u.persistent_load, torchfile._reduce, torchfile._newobj,
                              torchfile._build, torchfile._Str)
    return torchpickle.load(data, nodes), u.storages


def _shape(x, ids: dict) -> object:
    """``x`` as plain nested data, node kinds and string types named, every shared object marked
    by the order it was first met: two trees are equal only if built alike, sharing included."""
    t = type(x)
    if t is torchfile.Global:
        return ("global", x.module, x.name)
    if t in (str, torchfile._Str, int, float, bool, bytes, type(None)):
        return (t.__name__, x)
    if id(x) in ids:
        return ("shared", ids[id(x)])
    ids[id(x)] = len(ids)
    if isinstance(x, torchfile.Reduce):
        return (t.__name__, _shape(x.func, ids), _shape(x.args, ids), _shape(x.state, ids))
    if t is torchfile.StorageRef:
        return ("storage", x.type.name, x.key, x.location, x.numel)
    if isinstance(x, dict):
        return (t.__name__, [(_shape(k, ids), _shape(v, ids)) for k, v in x.items()],
                _shape(getattr(x, "__dict__", None), ids))
    if isinstance(x, (list, tuple)):
        return (t.__name__, [_shape(v, ids) for v in x])
    return (t.__name__, repr(x))


def _same(a, b) -> bool:
    (ta, sa), (tb, sb) = a, b
    return _shape(ta, {}) == _shape(tb, {}) and list(sa) == list(sb) and \
        all(_shape(sa[k], {}) == _shape(sb[k], {}) for k in sa)


@pytest.mark.parametrize("name", SAVES)
def test_every_committed_save_reads_the_same_both_ways(name):
    data = _pickle_of(FIX / name)
    assert _same(_fast(data), _careful(data))


def test_a_save_with_every_kind_of_data_reads_the_same(tmp_path):
    """torch.save's own pickler: tied views, a state dict's _metadata, one-character and empty
    strings, bytes (through _codecs.encode), floats, big and negative ints, long lists (APPENDS
    in batches), None and booleans, nested containers, a DTensor on a mesh."""
    from torch.distributed.tensor import DTensor, Shard
    from torch.testing._internal.distributed.fake_pg import FakeStore
    import torch.distributed as dist

    base = torch.arange(24, dtype=torch.float32)
    sd = OrderedDict(w=torch.ones(2, 3, dtype=torch.bfloat16), b=torch.zeros(3, dtype=torch.float64))
    sd._metadata = OrderedDict({"": {"version": 1}})
    obj = {"tied_a": base[2:10], "tied_b": base.view(4, 6)[:, ::2], "sd": sd, "0": "0", "": "", "é": "é",
           "x": ["0", "", "x", "x"], "blob": b"raw\x00bytes", "steps": (1, 2.5, None, 10**30, -7, -(2**40), True),
           "long": list(range(2500)), "nested": {"a": [{"b": (1, (2, (3,)))}]}, "f8": torch.ones(4).to(torch.float8_e4m3fn)}
    dist.init_process_group("fake", store=FakeStore(), rank=1, world_size=4)
    try:
        mesh = dist.device_mesh.init_device_mesh("cpu", (4,))
        obj["dt"] = DTensor.from_local(torch.ones(2, 3), mesh, [Shard(0)], shape=torch.Size([8, 3]), stride=(3, 1))
        p = tmp_path / "a.pt"
        torch.save(obj, p)
    finally:
        dist.destroy_process_group()
    data = _pickle_of(p)
    assert _same(_fast(data), _careful(data))
    tree, storages = _fast(data)
    assert type(tree["0"]) is torchfile._Str and tree["steps"][3] == 10**30 and len(tree["long"]) == 2500
    assert len(storages) == len(_careful(data)[1]) >= 5


def _deep_pickle(n: int) -> bytes:
    return b"\x80\x02" + b"]" * n + b"a" * (n - 1) + b"."


@pytest.mark.parametrize("case", ["global", "deep", "tuple-key", "shared-key", "set", "build-global", "persistent-id"])
def test_hostile_pickles_are_declined_and_refused(case):
    if case == "global":
        data = pickle.dumps(os.system, protocol=2)
    elif case == "deep":  # lists 200,000 deep: the tree check after the read refuses it
        data = _deep_pickle(200_000)
    elif case == "tuple-key":  # a key whose hash would recurse 200,000 deep in C: refused before it is hashed
        data = b"\x80\x02}" + b")" + b"\x85" * 200_000 + b"K\x01s."
    elif case == "shared-key":  # ((k, k), (k, k)) 60 levels deep, shared through the memo
        key = b"K\x01\x85q\x00" + b"".join(b"h" + bytes([i]) + b"h" + bytes([i]) + b"\x86q" + bytes([i + 1])
                                         for i in range(60))
        data = b"\x80\x02}" + key + b"K\x01s."
    elif case == "set":
        data = b"\x80\x02\x8f(K\x01K\x02\x90."  # EMPTY_SET MARK 1 2 ADDITEMS
    elif case == "build-global":  # BUILD into an allowlisted global itself
        data = b"\x80\x02ctorch\nSize\nq\x00}q\x01X\x01\x00\x00\x00aK\x01sb."
    else:  # a persistent id that is not torch's storage tuple
        data = b"\x80\x02K\x01Q."
    if case != "deep":  # built as the careful reader builds it, then refused by the tree check
        with pytest.raises(torchpickle.Decline):
            _fast(data)
    with pytest.raises(BadInput) as e:
        torchfile.loads(data)
    if case == "global":
        assert isinstance(e.value, UnsafeInput)
    if case in ("tuple-key", "shared-key", "deep", "set"):
        assert isinstance(e.value, bounded.HostileTree)


def test_another_protocol_is_declined_and_read_the_careful_way():
    data = pickle.dumps(OrderedDict(a=1, b=(2, "x")), protocol=4)
    with pytest.raises(torchpickle.Decline):
        _fast(data)
    assert torchfile.loads(data) == OrderedDict(a=1, b=(2, "x"))


@pytest.mark.parametrize("seed", range(4))
def test_mutated_pickles_read_the_same_or_are_declined(seed):
    """Whatever the bytes, the fast reader gives the careful reader's tree or declines; it never
    gives a tree where the careful reader fails."""
    data = _pickle_of(FIX / "llama_sharded_ws8" / "model_world_size_8_rank_3.pt")
    agreed = declined = 0
    for m in mutations(data, seed, 400):
        try:
            fast = _fast(m)
        except torchpickle.Decline:
            declined += 1
            continue
        with bounded.gc_paused():
            careful = _careful(m)  # must not raise: the fast reader vouched for these bytes
        assert _same(fast, careful)
        agreed += 1
    assert agreed and declined


def _refusal(data: bytes) -> tuple[type, str] | None:
    try:
        torchfile.loads(data, where="x")
    except Exception as e:  # noqa: BLE001 - compared, not handled
        return type(e), str(e)
    return None


@pytest.mark.parametrize("seed", range(2))
def test_a_declined_pickle_gets_the_careful_readers_own_refusal(monkeypatch, seed):
    """Through torchfile.loads, with the fast reader and without it: the same refusal (type and
    message) for every mutated pickle, and the same tree for every one both accept."""
    data = _pickle_of(FIX / "llama_sharded_ws2" / "optim_world_size_2_rank_1.pt")
    refused = 0

    def declining(*_):
        raise torchpickle.Decline("off")

    for m in mutations(data, 200 + seed, 150):
        with monkeypatch.context() as mp:
            mp.setattr(torchpickle, "load", declining)  # careful reader only
            careful = _refusal(m)
            careful_tree = None if careful else torchfile._parse(m)
        fast = _refusal(m)
        assert fast == careful
        if careful:
            refused += 1
        else:
            assert _same(torchfile._parse(m), careful_tree)
    assert refused


def test_memo_puts_read_as_the_careful_readers_memo_takes_them():
    """A put over an entry or at the memo's end reads as the careful reader's dict takes it; a
    put past the end (a dict takes it, a list cannot) is declined."""
    cases = [b"\x80\x02](K\x01q\x00K\x02q\x00h\x00e.",  # the last put at 0 wins
             b"\x80\x02]q\x00(]q\x01K\x01ah\x01h\x00e.",  # shared lists, one holding the outer
             b"\x80\x02](K\x01r\x00\x00\x00\x00K\x02r\x00\x00\x00\x00h\x00e."]  # LONG_BINPUT the same way
    for data in cases:
        assert _same(_fast(data), _careful(data)), data
    assert _careful(cases[0])[0] == [1, 2, 2]
    with pytest.raises(torchpickle.Decline, match="past the memo's end"):
        _fast(b"\x80\x02](K\x01q\x05h\x05e.")
    assert _careful(b"\x80\x02](K\x01q\x05h\x05e.")[0] == [1, 1]


def test_rank_files_read_with_the_fast_reader(monkeypatch):
    """TorchZip's careful parse goes through the fast reader (a file of the job parsed)."""
    calls = []
    real = torchpickle.load
    monkeypatch.setattr(torchpickle, "load", lambda *a: calls.append(1) or real(*a))
    zf = torchfile.TorchZip(FIX / "llama_sharded_ws8" / "model_world_size_8_rank_0.pt")
    assert calls and zf.exact and zf.storages
    assert _same((zf.tree, zf.storages), _careful(zf.pickle))
