"""A many-rank job's rank files described from one file's tree (formats.shardtree.RankTemplate):
files written by torch's own ``torch.save`` under its fake process group; every description made
through the template equals the one made by parsing each file, and a file that is not its
rank's template is parsed (and refused where it is wrong)."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner

from ckpt_tools.cli.main import main as cli
from ckpt_tools.errors import BadInput
from ckpt_tools.formats import rankread, rankrows, sharded, shardtree
from ckpt_tools.security import torchfile
from ckpt_tools.security.torchfile import Global, NewObj, StorageRef, TorchZip
from fw_scale import make_verl

UNIFORM = {"embed.weight": (64, 4), "layers.0.w": (32, 3), "layers.0.norm": (16,), "head.weight": (48, 2)}
TRAILING = {"embed.weight": (300, 4), "layers.0.w": (257, 3), "layers.0.norm": (8,), "head.weight": (5, 4)}


def _facts(ckpt) -> list:
    """Everything a description says, chunk by chunk."""
    return [(t.group, t.name, t.shape, str(t.dtype), t.param, t.state,
             [(c.offsets, c.sizes, c.rank, c.location) for c in t.chunks]) for t in ckpt.tensors] + \
        [repr(ckpt.objects), repr(sorted(ckpt.details.items(), key=str)), ckpt.param_order]


@pytest.fixture
def counted(monkeypatch):
    """Counts the files described without a tree (read as their rank's template)."""
    seen = {"templated": 0, "parsed": 0}
    init = TorchZip.__init__

    def counting(self, *args, **kwargs):
        init(self, *args, **kwargs)
        seen["templated" if self.tree is None else "parsed"] += 1

    monkeypatch.setattr(TorchZip, "__init__", counting)
    return seen


def _without_templates(path: Path, monkeypatch):
    with monkeypatch.context() as m:
        m.setattr(shardtree.RankTemplate, "learn", classmethod(lambda cls, *a: None))
        m.setattr(rankrows.RowsTemplate, "learn", classmethod(lambda cls, *a: None))
        return sharded.describe(path)


@pytest.fixture
def rank_only(monkeypatch):
    """Templates of a file with only its rank changed (no :class:`~.rankrows.RowsTemplate`)."""
    monkeypatch.setattr(rankrows.RowsTemplate, "learn", classmethod(lambda cls, *a: None))


# TRAILING at 16 ranks: ranks 0-4 hold a row of every small tensor, 5-7 none of head.weight,
# 8-14 none of head.weight or layers.0.norm, 15 fewer rows of the big ones too. Each group's first
# two files are parsed and the rest repeat the first (5-7: 7; 8-14: 10-14); 15 is parsed. With
# at least 8 files left to learn a later group's template, 8-14's is not learned (at rank 10, 6 are
# left): its files are parsed, and so are those of each base tried after it.
@pytest.mark.parametrize("shapes,ws,bases,left,templated,parsed", [(UNIFORM, 16, 4, 1, 2 * 14, 2 * 2),
                                                                 (TRAILING, 16, 4, 1, 2 * 9, 2 * 7),
                                                                 (TRAILING, 16, 1, 1, 2 * 3, 2 * 13),
                                                                 (TRAILING, 16, 4, 8, 2 * 4, 2 * 12)])
def test_template_describes_as_parsing_does(tmp_path, monkeypatch, counted, rank_only, shapes, ws, bases, left,
                                            templated, parsed):
    make_verl(tmp_path / "src", ws, optim=True, shapes=shapes)
    monkeypatch.setattr(rankread.Kind, "MAX_BASES", bases)
    monkeypatch.setattr(rankread.Kind, "LEFT_TO_LEARN", left)
    got = sharded.describe(tmp_path / "src")
    assert (counted["templated"], counted["parsed"]) == (templated, parsed + ws)  # (+ extra_state files)
    assert _facts(got) == _facts(_without_templates(tmp_path / "src", monkeypatch))


def test_parsed_files_chunks_share_their_keys_and_shapes(tmp_path, monkeypatch, counted):
    """Every file parsed (no template learned): each tensor's chunks on the ranks holding the same
    rows share one key tuple (rank 0's, its name string with it) and one sizes tuple, instead of
    each file's own copies from its tree, and describe the same as before."""
    make_verl(tmp_path / "src", 4, shapes=UNIFORM)
    got = _without_templates(tmp_path / "src", monkeypatch)
    assert counted["parsed"] == 4
    for t in got.tensors:
        first = t.chunks[0]
        assert len(t.chunks) == 4 and all(c.location.key is first.location.key for c in t.chunks), t.name
        assert all(c.sizes is first.sizes for c in t.chunks if c.sizes == first.sizes), t.name
        assert first.location.key == (t.name,) and [c.offsets[0] for c in t.chunks] == sorted(
            c.offsets[0] for c in t.chunks)


def test_a_description_to_read_only_keeps_no_tree(tmp_path):
    """inspect and a conversion to safetensors describe to read only: the first rank file's tree, kept for a writer
    that patches it, is not kept (at 25k tensors ~50 MB held while the others are parsed);
    the description is the same, and a description for writing keeps it."""
    import ckpt_tools
    from ckpt_tools.layouts import describe

    make_verl(tmp_path / "src", 4, shapes=UNIFORM)
    shardtree._parsed.cache_clear()
    ckpt_tools.inspect(tmp_path / "src")
    ckpt_tools.convert(tmp_path / "src", tmp_path / "hf", to="hf", progress=False)
    assert shardtree._parsed.cache_info().currsize == 0
    read = describe(tmp_path / "src", read_only=True)
    assert shardtree._parsed.cache_info().currsize == 0
    assert _facts(describe(tmp_path / "src")) == _facts(read)
    assert shardtree._parsed.cache_info().currsize == 1


def test_a_file_under_another_ranks_name_is_parsed_and_refused(tmp_path):
    make_verl(tmp_path / "src", 8, shapes=UNIFORM)
    shutil.copy(tmp_path / "src" / "model_world_size_8_rank_2.pt", tmp_path / "src" / "model_world_size_8_rank_5.pt")
    with pytest.raises(BadInput, match="rank 2 .*not rank 5|rank 5"):
        sharded.describe(tmp_path / "src")


@pytest.mark.parametrize("shapes", [UNIFORM, TRAILING])
def test_templated_reshard_reads_back(tmp_path, counted, shapes):
    state = make_verl(tmp_path / "src", 16, optim=True, shapes=shapes)
    r = CliRunner().invoke(cli, ["reshard", str(tmp_path / "src"), str(tmp_path / "out"), "--to", "6", "--quiet"],
                           catch_exceptions=False)
    assert r.exit_code == 0, r.output
    assert counted["templated"] >= 2 * 14
    for kind, expect in (("model", state), ("optim", None)):
        parts: dict[str, list] = {}
        for rank in range(6):
            sd = torch.load(tmp_path / "out" / f"{kind}_world_size_6_rank_{rank}.pt", weights_only=False)
            if kind == "optim":
                sd = {f"{i}": s["exp_avg"] for i, s in sd["state"].items()}
            for k, v in sd.items():
                assert list(v.device_mesh.get_coordinate()) == [rank]
                parts.setdefault(k, []).append(v.to_local())
        for i, (k, v) in enumerate(state.items()):
            got = torch.cat(parts[k] if kind == "model" else parts[str(i)])
            assert torch.equal(got, v if kind == "model" else v * 0.1), (kind, k)


def _pair(tmp_path: Path, shapes: dict, ws: int, a: int, b: int) -> tuple[TorchZip, TorchZip]:
    make_verl(tmp_path / "src", ws, shapes=shapes)
    first = TorchZip(tmp_path / "src" / f"model_world_size_{ws}_rank_{a}.pt")
    return first, TorchZip(tmp_path / "src" / f"model_world_size_{ws}_rank_{b}.pt", like=[first.template()])


def test_learn_finds_the_mesh_rank_and_nothing_else(tmp_path):
    first, second = _pair(tmp_path, UNIFORM, 8, 0, 1)
    template = shardtree.RankTemplate.learn(first, 0, second.pickle, 1)
    assert template is not None and len(template.slots) == 2
    assert template.pickle_of(1) == second.pickle
    # rank 300 needs a wider int: the pickle torch would write for it
    wide = torchfile.loads_like(template.pickle_of(300), first.template())
    mesh = shardtree.dtensor_of(next(iter(wide.values()))).mesh
    assert shardtree._state_dict(mesh)["_rank"] == 300


def test_learn_declines_what_is_not_the_rank(tmp_path):
    first, second = _pair(tmp_path, UNIFORM, 8, 0, 2)
    assert shardtree.RankTemplate.learn(first, 0, second.pickle, 1) is None  # the ints are 0 and 2, not 0 and 1
    assert shardtree.RankTemplate.learn(first, 0, first.pickle, 0) is None
    first, trailing = _pair(tmp_path / "t", TRAILING, 16, 0, 15)
    assert shardtree.RankTemplate.learn(first, 0, trailing.pickle, 15) is None  # its local sizes differ too


MESH = Global("torch.distributed.device_mesh", "DeviceMesh")
S = shardtree._SENTINEL


def _mesh(rank: int, coord: tuple = None) -> NewObj:
    return NewObj(MESH, (MESH,), {"_rank": rank, "_coordinate_on_dim": (rank,) if coord is None else coord})


def test_only_mesh_rank():
    mesh = _mesh(S)
    assert shardtree.only_mesh_rank({"a": [mesh, mesh], "b": 3}, S)
    assert not shardtree.only_mesh_rank({"a": mesh, "b": S}, S)  # elsewhere too
    assert not shardtree.only_mesh_rank({"a": mesh, S: 1}, S)  # as a key
    storage = StorageRef(Global("torch", "FloatStorage"), "0", "cpu", S)
    assert not shardtree.only_mesh_rank({"a": mesh, "b": (storage,)}, S)  # a storage's size
    assert not shardtree.only_mesh_rank({"a": mesh, "b": _mesh(S)}, S)  # two meshes
    assert not shardtree.only_mesh_rank({"a": _mesh(S, (0,))}, S)  # the coordinate is not the rank
    assert not shardtree.only_mesh_rank({"a": 1}, S)  # no mesh


def test_only_mesh_rank_walks_a_node_held_twice_once():
    """The walk notes the nodes held by two holders or more (only those: most of a tree's are
    held once) and walks each once: 2**60 paths to the bottom through any kind of node take a
    step per node, and the bottom is still looked at; 200,000 nodes held once are walked
    without a table of them."""
    g = Global("m", "f")
    kinds = [lambda a: (a, a), lambda a: [a, a], lambda a: {"x": a, "y": a},
             lambda a: torchfile.Reduce(g, (a, a)), lambda a: NewObj(g, (a,), {"s": a})]
    for make in kinds:
        for bottom, holds in (((_mesh(S), 1), True), ((_mesh(S), S), False), ((1, 2), False)):
            node: object = bottom
            for _ in range(60):
                node = make(node)
            assert shardtree.only_mesh_rank(node, S) is holds
    import tracemalloc

    many = [torchfile.Reduce(g, ([i, i + 1], {"k": (i, [i])})) for i in range(200_000)]
    tracemalloc.start()
    try:
        assert shardtree.only_mesh_rank([_mesh(S), many], S)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 16 << 20  # (its stack only: a set of its ~1,000,000 containers' ids is ~60 MB)


def test_a_template_is_learned_only_where_the_group_repeats(tmp_path, monkeypatch, rank_only):
    """Learning waits for a file like the second (a few bits apart: their ranks); files that go on
    changing (each rank its own local sizes) never pay for a learn, and are described as parsed."""
    a = bytes(4096)
    b = bytearray(a)
    b[100:102] = b"\x05\x06"
    assert rankread._alike(a, bytes(b))
    b[200:300] = b"\xff" * 100
    assert not rankread._alike(a, bytes(b))
    make_verl(tmp_path / "src", 16, shapes=TRAILING)
    learned = []
    real = shardtree.RankTemplate.learn.__func__
    monkeypatch.setattr(shardtree.RankTemplate, "learn",
                        classmethod(lambda cls, *args: learned.append(args[1]) or real(cls, *args)))
    monkeypatch.setattr(rankread, "_alike", lambda x, y: False)
    got = sharded.describe(tmp_path / "src")
    assert learned == []
    assert _facts(got) == _facts(_without_templates(tmp_path / "src", monkeypatch))


def test_repeat_places_each_chunk_on_its_ranks_rows_and_refuses_rows_that_do_not_fit():
    """A repeating file's chunks: the base's, on the rows its own rank holds (the offsets worked
    out once per shape and shared), at its own records' places; a rank whose placement gives
    other local sizes than the base's is refused."""
    from types import SimpleNamespace

    from ckpt_tools.core.describe import Chunk, ChunkColumns, Location, chunk_rows

    def table(chunks):
        base = [Chunk((0, 0), (3, 2), Location("r0", "raw", 100, 24, ("k",)), 0),
                Chunk((0, 0), (3, 2), Location("r0", "raw", 200, 24, ("k",)), 0),
                Chunk((0,), (5,), Location("r0", "raw", 300, 20, ("k",)), 0)]
        return [(chunks[0], 10, "a", base[0], "data/0", 0), (chunks[1], 10, "b", base[1], "data/1", 8),
                (chunks[2], None, "c", base[2], "data/2", 0)]

    from array import array

    from ckpt_tools.security import zipdir

    records = zipdir.Records(zipdir._Columns.of([(f"data/{i}", 1000 * (i + 1), 24) for i in range(3)]),
                             array("I", [0] * 3))
    zf = SimpleNamespace(path="r1", records=records)
    files = ([], {})
    chunks = [ChunkColumns(*files) for _ in range(3)]
    rankread.repeat(table(chunks), 1, 4, zf, "r1")
    (a,), (b,), (c,) = (cols.chunks() for cols in chunks)
    assert files[0] == ["r1"]  # (one name for the three tensors' columns)
    assert (a.offsets, b.offsets, c.offsets) == ((3, 0), (3, 0), (0,)) and a.offsets is b.offsets
    assert chunk_rows(10, 4, 1) == (3, 6) and (a.sizes, a.rank) == ((3, 2), 1)
    assert (a.location, b.location) == (Location("r1", "raw", 1000, 24, ("k",)), Location("r1", "raw", 2008, 24, ("k",)))
    assert c.location == Location("r1", "raw", 3000, 20, ("k",))
    with pytest.raises(BadInput, match=r"tensor 'a': rank 3 holds \(3, 2\), but its placement on world size 4 "
                                       r"gives \(1, 2\)"):
        rankread.repeat(table([ChunkColumns(*files) for _ in range(3)]), 3, 4, zf, "r1")
