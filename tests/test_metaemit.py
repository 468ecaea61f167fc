""".metadata rendered from its records (codecs/metaemit.py) against the pickler's bytes.

The emitter must write exactly what :func:`metapickle.dumps` writes for the same metadata as
stand-ins (that one is checked against torch's own pickle in test_dcpnative): the same memo
references (by identity: which strings are one object), batches, and frame cuts. Checked on
metadata the DCP writer builds from records of every shape that changes the bytes.
"""

from __future__ import annotations

import pickle
import pickletools
import random

import pytest

from ckpt_tools.codecs import metaemit, metapickle as mp
from ckpt_tools.formats.dcpnative import metadata_of

WIDTHS = [0, 1, 255, 256, 65535, 65536, 2 ** 31 - 1, 2 ** 31, 2 ** 40]  # each int opcode's edges


def _records(rng: random.Random, n_tensors: int, ranks: int, *, ndims=(0, 1, 2, 3, 4), long_names=False,
             objects: int = 2) -> list:
    """What a DCP writer's files hold: per rank file, (kind, what, start, length) records."""
    files = [(f"__{r}_0.distcp", []) for r in range(ranks)]
    for t in range(n_tensors):
        d = rng.choice(ndims)
        if long_names and t % 7 == 0:
            name = "layer_" + "é" * rng.choice([10, 130, 200]) + f".{t}.weight"  # past 255 bytes in utf-8
        elif t % 5 == 0:
            name = f"w{t}"
        else:
            name = f"model.layers.{t}.mlp.weight"
        path = ("model", name) if t % 3 else (name,)  # a one-name path: its fqn is that very string
        if t % 11 == 0:
            path = ("optimizer", "state", name, "exp_avg")
        shape = tuple(rng.choice([1, 2, 3, 300]) for _ in range(d))
        dtype = rng.choice(["float32", "bfloat16", "float16"])
        for r in range(ranks if d else 1):
            offsets = tuple(rng.choice(WIDTHS) if i == 0 else 0 for i in range(d))
            sizes = tuple(rng.choice(WIDTHS[:6]) for _ in range(d))
            files[r][1].append(("tensor", (path, dtype, shape, offsets, sizes), rng.choice(WIDTHS), rng.choice(WIDTHS)))
    for i in range(objects):
        files[0][1].append(("object", ("optimizer", "param_groups", i), rng.choice(WIDTHS), 40))
    files[0][1].append(("bytes", ("extra.step", ("extra", "step")), 7, 9))
    return files


def _both(files, **kw) -> tuple[bytes, bytes]:
    meta, _ = metadata_of(files, **kw)
    rendered = metaemit.dumps(meta, pickle.DEFAULT_PROTOCOL)
    pickled = mp.dumps(metaemit.stand_ins(meta))
    # metapickle's own fallback (the pure-Python pickler, batching as the C one does) agrees
    assert mp._dumps_py(meta, pickle.DEFAULT_PROTOCOL) == pickled
    return rendered, pickled


@pytest.mark.parametrize("kept", [None, 3])
@pytest.mark.parametrize("seed", range(6))
def test_rendered_metadata_is_the_picklers(seed, kept, monkeypatch):
    """(``kept``: the names' opcodes kept 3 at a time, so most are worked out again: the same bytes.)"""
    if kept is not None:
        monkeypatch.setattr(metaemit, "_NAMES_KEPT", kept)
    rng = random.Random(seed)
    files = _records(rng, n_tensors=rng.choice([3, 60, 400]), ranks=rng.choice([1, 3, 8]), long_names=seed % 2 == 0)
    rendered, pickled = _both(files, top_level_model=seed % 3 == 0)
    assert rendered == pickled
    assert list(pickletools.genops(rendered))  # a well-formed pickle, frames included


def test_batches_and_frames_at_every_count():
    """Chunk lists and the storage index of 1, 999, 1,000, 1,001 and 2,500 items (APPEND, one
    MARK ... APPENDS, one more batch, or a lone item after a full one), and files long enough
    that frames are cut inside records, in the index and in the headers between them."""
    for n in (1, 999, 1000, 1001, 2500):
        files = [("__0_0.distcp", [("tensor", (("model", "w"), "float32", (n, 4), (i, 0), (1, 4)), 64 * i, 16)
                                   for i in range(n)])]
        rendered, pickled = _both(files)
        assert rendered == pickled, n
        frames = [op.name for op, _, _ in pickletools.genops(rendered)].count("FRAME")
        assert frames == 1 if len(rendered) < 64 * 1024 else frames >= 2


def test_memo_references_past_256_and_shared_strings():
    """Past 256 memo entries references are LONG_BINGET; a fqn that is its path's one string
    (``".".join`` of one name returns it) is referenced, not written again, by every index
    entry, while a joined fqn is written once per entry, as torch's writer does."""
    files = [(f"__{r}_0.distcp", [("tensor", ((f"t{k}",), "float32", (8,), (r,), (1,)), k * 8, 4)
                                  for k in range(300)] +
              [("tensor", (("model", f"m{k}"), "float32", (8,), (r,), (1,)), 9999, 4) for k in range(3)])
             for r in range(8)]
    rendered, pickled = _both(files)
    assert rendered == pickled
    text = [(op.name, arg) for op, arg, _ in pickletools.genops(rendered)]
    assert ("LONG_BINGET" in {name for name, _ in text})
    strings = [arg for name, arg in text if name == "SHORT_BINUNICODE"]
    assert strings.count("t5") == 1  # the key, referenced by all eight entries
    assert strings.count("model.m1") == 8  # the key (its first entry's string) and one per other entry


def test_an_items_name_is_held_once_per_tensor_and_pickled_as_its_own_string():
    """The writer holds one name object per tensor, not one per item: a joined name's later
    items are Anew rows (each pickled as a string of its own, as a join per item gave), a
    one-name path's items refer to that very string; the bytes are those of the metadata built
    with a join per item (torch's writer's objects, which test_dcpnative compares)."""
    files = [(f"__{r}_0.distcp", [("tensor", (("model", f"m{k}"), "float32", (8, 2), (r, 0), (1, 2)), 64 * k, 8)
                                  for k in range(40)] +
              [("tensor", ((f"t{k}",), "float32", (8,), (r,), (1,)), 9999 + k, 4) for k in range(5)])
             for r in range(8)]
    meta, _ = metadata_of(files)
    rows = list(meta.storage_data)
    assert len(rows) == 8 * 45
    assert len({id(row[0]) for row in rows}) == 45  # one name object a tensor
    assert sum(type(row) is metaemit.Anew for row in rows) == 7 * 40  # the joined names' later items
    assert all(row[0] in meta.state_dict_metadata for row in rows)
    # the oracle: every item's name built by its own join, as rows of plain tuples
    meta_joined, _ = metadata_of(files)
    meta_joined.storage_data = metaemit.Entries(
        (".".join(row[0].split(".")) if type(row) is metaemit.Anew else row[0], *row[1:])
        for row in meta_joined.storage_data)
    assert metaemit.dumps(meta, pickle.DEFAULT_PROTOCOL) == mp.dumps(metaemit.stand_ins(meta_joined))
    text = [(op.name, arg) for op, arg, _ in pickletools.genops(metaemit.dumps(meta, pickle.DEFAULT_PROTOCOL))]
    strings = [arg for name, arg in text if name == "SHORT_BINUNICODE"]
    assert strings.count("model.m3") == 8 and strings.count("t3") == 1


def test_what_it_cannot_render_is_left_to_the_pickler():
    meta, _ = metadata_of([("__0_0.distcp", [("tensor", (("x" * 70000,), "float32", (1,), (0,), (1,)), 0, 4)])])
    with pytest.raises(metaemit.Unsupported):
        metaemit.dumps(meta, 4)


def test_the_native_writer_writes_the_rendered_bytes(tmp_path):
    """The writer's .metadata is the emitter's, and equal to the pickler's for the same files."""
    from ckpt_tools.formats import dcpnative

    files = _records(random.Random(7), n_tensors=50, ranks=4)
    w = object.__new__(dcpnative.Writer)
    w.top_level_model, w.keys = False, None
    w._metadata(tmp_path, [(rel, list(records)) for rel, records in files])  # (it empties the lists it reads)
    assert (tmp_path / ".metadata").read_bytes() == _both(files)[1]


def test_records_are_rendered_not_saved_one_object_at_a_time(monkeypatch):
    """The point of the emitter: past the first of each shape, chunks, index entries, tensor
    headers and planner paths are rendered from their fields; only the first of each (or of
    each data file), and those near a frame's end, go through the pickler's algorithm object
    by object (and come out the same)."""
    files = [(f"__{r}_0.distcp", [("tensor", (("model", f"layers.{k}.w"), "float32", (16, 4), (2 * r, 0), (2, 4)),
                                   k * 64, 32) for k in range(500)]) for r in range(8)]
    meta, _ = metadata_of(files)
    paths = {id(p) for p in meta.planner_data.values()}
    saved = {"chunk": 0, "entry": 0, "tensor": 0, "path": 0}
    real_save = metaemit._Emitter.save

    def save(self, obj):
        if type(obj) is metaemit.mp.TensorStorageMetadata:
            saved["tensor"] += 1
        elif id(obj) in paths:
            saved["path"] += 1
        return real_save(self, obj)

    with monkeypatch.context() as m:
        for name in ("chunk", "entry"):
            real = getattr(metaemit, name)
            m.setattr(metaemit, name, lambda *a, _real=real, _n=name: (saved.__setitem__(_n, saved[_n] + 1),
                                                                       _real(*a))[1])
        m.setattr(metaemit._Emitter, "save", save)
        rendered = metaemit.dumps(meta, pickle.DEFAULT_PROTOCOL)
    assert rendered == _both(files)[1]
    frames = len(rendered) // (64 * 1024) + 1  # 10
    # of 4,000 chunks, 4,000 index entries (in 8 files), 500 tensors and 500 paths
    assert saved["chunk"] <= 1 + frames and saved["entry"] <= 1 + 8 + frames, saved
    assert saved["tensor"] <= 1 + frames and saved["path"] <= 1 + frames, saved


def test_the_storage_index_reads_as_its_rows_and_holds_columns():
    """Entries holds columns and reads, every way the emitter and the pickler's stand-ins read
    it (iterated, indexed from either end, sliced in batches), as the rows it was given, each
    an Anew where given as one; a row's ints are not held as objects. The chunks of one value
    share one pair."""
    rows = [("w", (i, 0), "__0_0.distcp", 2 ** 40 + i, 4096 + i) for i in range(2500)] + [("obj", None, "f", 7, 9)]
    rows = [metaemit.Anew(r) if i % 3 else r for i, r in enumerate(rows)]
    e = metaemit.Entries(rows)
    assert len(e) == len(rows) and list(e) == rows
    assert [type(r) for r in e] == [type(r) for r in rows]
    assert e[0] == rows[0] and e[-1] == rows[-1] and type(e[1]) is metaemit.Anew and e[-2501] == rows[0]
    with pytest.raises(IndexError):
        e[len(rows)]
    assert e[999:2001] == rows[999:2001]
    assert [len(b) for b in mp.batches(e, closed=True)] == [len(b) for b in mp.batches(rows, closed=True)]
    assert [len(b) for b in mp.batches(e[:2000], closed=True)] == [1000, 1000, 0]
    assert not any(type(x) is int for x in e._refs)  # (the numbers in an array)

    files = [(f"__{r}_0.distcp", [("tensor", (("model", f"m{k}"), "float32", (8, 2), (r, 0), (1, 2)), 64 * k, 8)
                                  for k in range(40)]) for r in range(8)]
    meta, _ = metadata_of(files)
    pairs = [c for md in meta.state_dict_metadata.values() for c in md.chunks]
    assert len(pairs) == 320 and len({id(c) for c in pairs}) == 8  # (one a rank: every tensor's chunk there alike)
