"""Rank files whose ranks hold different rows, described from one parsed file
(formats.rankrows.RowsTemplate): files written by torch's own ``torch.save`` under its fake
process group; every description made through the template equals the one made by parsing each
file, and a file that differs anywhere else, or claims rows its storage or its rank's placement
does not give, is not read through it."""

from __future__ import annotations

import pytest

from ckpt_tools.core.describe import chunk_rows
from ckpt_tools.errors import BadInput
from ckpt_tools.formats import rankread, rankrows, sharded, shardtree
from ckpt_tools.security.skeleton import int_at, int_opcode
from ckpt_tools.security.torchfile import TorchZip
from fw_scale import make_verl
from test_rank_template import TRAILING, UNIFORM, _facts, _without_templates, counted  # noqa: F401 - a fixture

# rows that divide among no two ranks alike: 3-D, 1-D, a tensor fewer rows than ranks, one of none
UNEVEN = {"embed.weight": (37, 4), "layers.0.w": (9, 3, 2), "layers.0.norm": (5,), "layers.1.w": (23, 3),
          "head.weight": (1, 4), "empty.weight": (0, 3)}


@pytest.mark.parametrize("shapes,ws", [(UNIFORM, 16), (TRAILING, 16), (UNEVEN, 16), (UNEVEN, 7)])
def test_rows_template_describes_as_parsing_does(tmp_path, monkeypatch, counted, shapes, ws):  # noqa: F811
    make_verl(tmp_path / "src", ws, optim=True, shapes=shapes)
    got = sharded.describe(tmp_path / "src")
    # rank 0's model and optimizer files parsed (and the extra_state files), every other one read as rank 0's
    assert (counted["templated"], counted["parsed"]) == (2 * (ws - 1), 2 + ws)
    assert _facts(got) == _facts(_without_templates(tmp_path / "src", monkeypatch))


@pytest.fixture
def learned(tmp_path, monkeypatch):
    """Rank 0's model file of UNEVEN over 8 ranks, what its describer noted of it, and the
    pickles of the other ranks' files."""
    make_verl(tmp_path / "src", 8, shapes=UNEVEN)
    seen = []
    real = rankrows.RowsTemplate.learn.__func__
    monkeypatch.setattr(rankrows.RowsTemplate, "learn",
                        classmethod(lambda cls, *args: seen.append(args) or real(cls, *args)))
    sharded.describe(tmp_path / "src")
    (zf, rank, table, entries_of), = seen
    pickles = [TorchZip(tmp_path / "src" / f"model_world_size_8_rank_{r}.pt").pickle for r in range(8)]
    return zf, rank, table, entries_of, pickles


def test_learn_finds_each_tensors_rows_and_numel_and_the_rank(learned):
    zf, rank, table, entries_of, pickles = learned
    template = rankrows.RowsTemplate.learn(zf, rank, table, entries_of)
    assert template is not None and len(template.ranks) == 2
    # every Shard(0) tensor alone on its storage: its rows and its storage's numel, the empty one's too
    assert sorted(template.places.values()) == sorted((what, row) for row in range(len(table)) for what in (1, 2))
    resized = 0
    for r in range(1, 8):
        storages, rows = template.read(pickles[r], r, table)
        for row, noted in enumerate(table):
            start, stop = chunk_rows(noted[1], 8, r)
            sizes, nbytes = rows.get(row, (noted[3].sizes, noted[3].length))
            assert sizes == (stop - start, *noted[3].sizes[1:]), (r, noted[2])
            assert nbytes == storages[noted[4][5:]].nbytes, (r, noted[2])
            resized += row in rows
    assert resized > 10


def test_learn_declines_what_it_cannot_prove(learned):
    zf, rank, table, entries_of, _ = learned
    assert rankrows.RowsTemplate.learn(zf, rank + 1, table, entries_of) is None  # no mesh rank of 1 in it
    assert rankrows.RowsTemplate.learn(zf, rank, table[::-1], entries_of) is None  # the entries in another order
    assert rankrows.RowsTemplate.learn(zf, rank, table, lambda tree: entries_of(tree)[1:]) is None


def _changed_at(pickle: bytes, template: rankrows.RowsTemplate, start: int, value: int) -> bytes:
    """``pickle`` (a file read like the template's) with the int at the template's ``start``
    set to ``value`` (the places before it may have another width in ``pickle``)."""
    at = start
    for s, e in template.order:
        if s < start:
            at += int_at(pickle, at - start + s)[1] - (at - start + s) - (e - s)
    end = int_at(pickle, at)[1]
    return pickle[:at] + int_opcode(value) + pickle[end:]


def test_read_declines_a_file_that_differs_anywhere_else(learned):
    zf, rank, table, entries_of, pickles = learned
    template = rankrows.RowsTemplate.learn(zf, rank, table, entries_of)
    assert template.read(pickles[3], 3, table) is not None
    assert template.read(pickles[3], 4, table) is None  # another rank's file
    assert template.read(pickles[0], 0, table) is None  # the template's own rank
    assert template.read(pickles[3] + b"\0", 3, table) is None
    places = {start for start, _ in template.order}
    skeleton, others = zf.shape().skeleton(), []
    n = 0
    while (at := skeleton.value_at(n)) is not None:
        if at[0] not in places and int_at(zf.pickle, at[0]) is not None:
            others.append(at[0])
        n += 1
    assert len(others) > 50
    for start in others:  # any other int of rank 3's file: strides, offsets, global shapes, the mesh's ranks
        assert template.read(_changed_at(pickles[3], template, start, int_at(zf.pickle, start)[0] + 1), 3,
                             table) is None, start
    for start in template.ranks:
        assert template.read(_changed_at(pickles[3], template, start, 2), 3, table) is None


def test_read_declines_rows_that_do_not_fit_their_storage(learned):
    zf, rank, table, entries_of, pickles = learned
    template = rankrows.RowsTemplate.learn(zf, rank, table, entries_of)
    for start, (what, row) in template.places.items():
        if what == 1:  # (a tensor's rows): more than its storage holds
            assert template.read(_changed_at(pickles[1], template, start, 10**6), 1, table) is None
        else:  # (its storage's numel): fewer elements than rank 1's rows need, where they have any
            start_row, stop_row = chunk_rows(table[row][1], 8, 1)
            needs = (stop_row - start_row) * template.row_elements[row]
            forged = _changed_at(pickles[1], template, start, 0)
            assert (template.read(forged, 1, table) is None) == (needs > 0), table[row][2]


def test_a_rank_file_holding_another_ranks_rows_is_refused(learned, tmp_path):
    """Rank 4's file saying it is rank 3's: read through the template (only learned places
    differ from rank 0's), then refused by the placement, as the parsed file would be."""
    zf, rank, table, entries_of, pickles = learned
    template = rankrows.RowsTemplate.learn(zf, rank, table, entries_of)
    _, three, four = (TorchZip(tmp_path / "src" / f"model_world_size_8_rank_{r}.pt") for r in (0, 3, 4))
    forged = four.pickle
    for start in template.ranks:
        forged = _changed_at(forged, template, start, 3)
    assert forged != three.pickle and template.read(forged, 3, table) is not None
    shardtree.write_file(tmp_path / "src" / "model_world_size_8_rank_3.pt", forged, shardtree.small_records(four),
                         ((k, [four.part(f"data/{k}")]) for k in four.storages))
    with pytest.raises(BadInput, match="rank 3 holds .* but its placement on world size 8 gives"):
        sharded.describe(tmp_path / "src")


def test_rows_a_rank_s_placement_does_not_give_are_refused():
    """Rows that fit their storage but not the rank's placement: refused, as the parsed file is."""
    from array import array
    from types import SimpleNamespace

    from ckpt_tools.core.describe import Chunk, ChunkColumns, Location
    from ckpt_tools.security import zipdir

    records = zipdir.Records(zipdir._Columns.of([("data/0", 1000, 24)]), array("I", [0]))
    zf = SimpleNamespace(path="r1", records=records)
    chunks = ChunkColumns([], {})
    table = [(chunks, 10, "a", Chunk((0, 0), (3, 2), Location("r0", "raw", 100, 24, ("k",)), 0), "data/0", 0)]
    rankread.repeat(table, 3, 4, zf, "r3", {0: ((1, 2), 8)})  # rank 3 of 4 holds 1 of 10 rows: its 8 bytes
    (c,) = chunks.chunks()
    assert (c.offsets, c.sizes, c.location) == ((9, 0), (1, 2), Location("r3", "raw", 1000, 8, ("k",)))
    with pytest.raises(BadInput, match=r"tensor 'a': rank 3 holds \(2, 2\), but its placement on world size 4 "
                                       r"gives \(1, 2\)"):
        rankread.repeat(table, 3, 4, zf, "r3", {0: ((2, 2), 16)})


def test_many_uneven_rank_files_reshard_byte_identical_to_parsed(tmp_path, monkeypatch):
    from ckpt_tools import reshard

    make_verl(tmp_path / "src", 12, optim=True, shapes=UNEVEN)
    reshard(tmp_path / "src", tmp_path / "a", to=5)
    with monkeypatch.context() as m:
        m.setattr(rankrows.RowsTemplate, "learn", classmethod(lambda cls, *a: None))
        reshard(tmp_path / "src", tmp_path / "b", to=5)
    files = sorted(p.relative_to(tmp_path / "a") for p in (tmp_path / "a").rglob("*") if p.is_file())
    assert files == sorted(p.relative_to(tmp_path / "b") for p in (tmp_path / "b").rglob("*") if p.is_file())
    assert len(files) > 10
    for name in files:
        assert (tmp_path / "a" / name).read_bytes() == (tmp_path / "b" / name).read_bytes(), name


def test_a_file_holding_the_last_ones_rows_is_read_as_it(learned):
    """Ranks 5 and 6 of UNEVEN over 8 hold the same rows: rank 6's file is read by one compare
    with rank 5's (its rank in rank 5's places), to the very same storages and sizes; under
    another rank's name it is not."""
    zf, rank, table, entries_of, pickles = learned
    template = rankrows.RowsTemplate.learn(zf, rank, table, entries_of)
    five = template.read(pickles[5], 5, table)
    assert five[1] and template.read(pickles[6], 6, table) is five
    assert template.read(pickles[6], 7, table) is None and template.read(pickles[6], 5, table) is None
    assert template.read(pickles[7], 7, table) is not five and template.read(pickles[6], 6, table) is not None
