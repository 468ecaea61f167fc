"""Rank pieces of row-sharded sources (core/plan.py ``rows_of``): the bisection over chunks that
tile the rows gives exactly what the general rectangle intersection gives, in the same order."""

from __future__ import annotations

import random

import pytest

from ckpt_tools.core.describe import Chunk, Location, TensorInfo, chunk_rows
from ckpt_tools.core.dtypes import DType
from ckpt_tools.core.plan import Target, by_piece, piece, rows_of, whole
from ckpt_tools.errors import BadInput


def _tensor(rows: int, boxes: list[tuple[tuple[int, int], tuple[int, int]]]) -> TensorInfo:
    chunks = tuple(Chunk(o, s, Location(f"f{i}", "raw", i * 100, s[0] * s[1] * 4), i) for i, (o, s) in enumerate(boxes))
    return TensorInfo("model", "w", (rows, 6), DType("float32"), chunks)


def _split(rows: int, parts: int, rng: random.Random) -> list[tuple[tuple[int, int], tuple[int, int]]]:
    cuts = sorted(rng.choices(range(rows + 1), k=parts - 1))
    edges = [0, *cuts, rows]
    return [((a, 0), (b - a, 6)) for a, b in zip(edges, edges[1:])]  # (some empty: a rank without rows)


def _general(target: Target, world_size: int, rank: int):
    start, stop = chunk_rows(target.shape[0], world_size, rank)
    return piece(target, (start, 0), (stop - start, 6))


@pytest.mark.parametrize("seed", range(40))
def test_tiled_rows_are_the_general_plan(seed):
    rng = random.Random(seed)
    rows = rng.randrange(1, 40)
    boxes = _split(rows, rng.randrange(1, 20), rng)
    rng.shuffle(boxes)  # chunks in file order, not row order (rank 10 before rank 2)
    t = _tensor(rows, boxes)
    assert t.row_tiles()
    target = Target(t, "model", "w", t.dtype)
    for world_size in (1, 2, 3, 7, rows, rows + 3):
        for r in range(world_size):
            assert rows_of(target, world_size, r) == _general(target, world_size, r)
    assert whole(target) == piece(target, (0, 0), (rows, 6))  # (a whole tensor, the same way)


def test_a_tensor_in_one_whole_chunk_is_planned_as_the_general_plan(monkeypatch):
    """A safetensors file's tensor (one chunk, all of it) takes the one-copy path, whose pieces
    are the general plan's at every world size and rank; a chunk that is not all of it does not."""
    from ckpt_tools.core import plan

    taken = []
    of_whole = plan._of_whole_chunk
    monkeypatch.setattr(plan, "_of_whole_chunk", lambda *a: taken.append(a) or of_whole(*a))
    for rows in (1, 5, 12):
        t = _tensor(rows, [((0, 0), (rows, 6))])
        assert t.whole_chunk() is t.chunks[0]
        target = Target(t, "model", "w", t.dtype)
        for world_size in (1, 2, 5, rows + 3):
            for r in range(world_size):
                assert rows_of(target, world_size, r) == _general(target, world_size, r)
        assert whole(target) == piece(target, (0, 0), (rows, 6))
    assert len(taken) == sum(1 + 2 + 5 + (rows + 3) + 1 for rows in (1, 5, 12))  # every piece by that path
    for boxes in ([((0, 0), (4, 6))], [((0,), (5, 6))], [((1, 0), (5, 6))], [((0, 0), (5, 6)), ((0, 0), (5, 6))]):
        assert _tensor(5, boxes).whole_chunk() is None


@pytest.mark.parametrize("boxes,tiles", [
    ([((0, 0), (4, 6)), ((4, 0), (4, 6))], True),
    ([((0, 0), (4, 6)), ((0, 0), (4, 6)), ((4, 0), (4, 6)), ((4, 0), (4, 6))], False),  # replicas
    ([((0, 0), (8, 3)), ((0, 3), (8, 3))], False),  # split by columns
])
def test_sources_that_do_not_tile_take_the_general_plan(boxes, tiles):
    t = _tensor(8, boxes)
    assert t.row_tiles() is tiles
    target = Target(t, "model", "w", t.dtype)
    for world_size in (1, 3, 8):
        for r in range(world_size):
            assert rows_of(target, world_size, r) == _general(target, world_size, r)


def test_a_hole_is_refused_either_way():
    t = _tensor(8, [((0, 0), (3, 6)), ((4, 0), (4, 6))])
    assert not t.row_tiles()
    with pytest.raises(BadInput, match="hole"):
        rows_of(Target(t, "model", "w", t.dtype), 1, 0)


def _coverage(t: TensorInfo) -> str | None:
    from ckpt_tools.core.describe import Checkpoint, check_coverage

    try:
        check_coverage(Checkpoint("sharded", "root", 1, (t,), (), (), None, {}, ()))
    except BadInput as e:
        return str(e)
    return None


_COVERAGE = [
    ([((0, 0), (4, 6)), ((4, 0), (4, 6)), ((8, 0), (0, 6))], None),  # tiles, an empty chunk at the end
    ([((0, 0), (4, 6)), ((4, 0), (4, 6)), ((9, 0), (0, 6))], "outside"),  # tiles, an empty chunk past the end
    ([((0, 0), (4, 6)), ((4, 0), (4, 6)), ((-1, 0), (0, 6))], "outside"),  # ... before the start
    ([((0, 0), (4, 6)), ((4, 0), (4, 6)), ((4, 0), (0, 7))], "outside"),  # ... too wide
    ([((0, 0), (9, 6)), ((9, 0), (-1, 6))], "outside"),  # rows that add up, one count negative
    ([((0, 0), (4, 6)), ((4,), (4, 6))], "outside"),  # an offset of too few dimensions
    ([((0, 0), (4, 6)), ((0, 0), (4, 6)), ((4, 0), (4, 6))], None),  # replicas: the general check
    ([((0, 0), (4, 6)), ((2, 0), (6, 6))], "overlapping"),
    ([((0, 0), (3, 6)), ((4, 0), (4, 6))], "hole"),
    ([((0, 0), (8, 6))], None),  # one chunk, the whole tensor (a safetensors file's)
    ([((0,), (8, 6))], "outside"),  # ... its offset of too few dimensions
    ([((1, 0), (8, 6))], "outside"),
    ([((0, 0), (7, 6))], "hole"),
]


@pytest.mark.parametrize("boxes,refused", _COVERAGE)
def test_coverage_of_tiled_rows_is_the_general_check(boxes, refused, monkeypatch):
    """A tiling is accepted without the box-by-box check; anything else gets that check, and
    the answer is the same with the shortcut off."""
    from ckpt_tools.core import describe

    got = _coverage(_tensor(8, boxes))
    assert (got is None) if refused is None else (refused in got), got
    monkeypatch.setattr(describe, "_tiled", lambda t: False)
    assert _coverage(_tensor(8, boxes)) == got


def _table_tensor(name: str, boxes: list, columns: tuple) -> TensorInfo:
    """A tensor of 8 x 6 whose chunks are a table's columns (as rank files' are read), the
    description's file names and values ``columns`` shared with the other tensors made."""
    from ckpt_tools.core.chunks import ChunkColumns

    table = ChunkColumns(*columns)
    for i, (o, s) in enumerate(boxes):
        table.add(o, s, f"f{i}", "raw", i * 100, max(s[0], 0) * 6 * 4, (name,), i)
    return TensorInfo("model", name, (8, 6), DType("float32"), table._table())


@pytest.mark.parametrize("boxes,refused", _COVERAGE)
def test_tensors_of_one_chunk_layout_share_what_their_coverage_finds(boxes, refused, monkeypatch):
    """Tensors whose chunk tables have one layout (the same shape, offsets and sizes) are
    checked once: the others take that one's answer and rows index, the same arrays. A tensor
    of a layout of its own among them, a hole or an overlap in it, is found as a check tensor
    by tensor finds it, named."""
    from ckpt_tools.core import describe
    from ckpt_tools.core.chunks import Palette

    def coverage(tensors: list) -> str | None:
        try:
            describe.check_coverage(describe.Checkpoint("sharded", "root", 1, tuple(tensors), (), (), None, {}, ()))
        except BadInput as e:
            return str(e)
        return None

    columns = ([], {}, Palette())
    tiled = [((0, 0), (3, 6)), ((3, 0), (3, 6)), ((6, 0), (2, 6))]
    made = [_table_tensor(f"w{i}", tiled if i != 4 else boxes, columns) for i in range(5)]
    got = coverage(made)
    assert (got is None) if refused is None else (refused in got and "'w4'" in got), got
    assert made[3].rows_index() is made[0].rows_index() and made[3].__dict__["_row_tiles"] is True
    monkeypatch.setattr(describe, "_tiled_like", lambda t, layouts: describe._tiled(t))
    assert coverage([_table_tensor(f"w{i}", tiled if i != 4 else boxes, columns) for i in range(5)]) == got


def test_by_piece_gives_each_piece_its_value_in_any_order():
    """``by_piece`` serves a writer that asks for pieces in another order than the stream's, by
    equality (a piece equal to, not the same object as, the stream's gets its value), each once."""
    pieces = [("w", i) for i in range(5)]
    values = by_piece(iter([(p, f"v{p[1]}") for p in pieces]))
    assert values(pieces[0]) == "v0"  # the stream's next: taken as it comes
    assert values(tuple(["w", 3])) == "v3"  # ahead of the stream, by an equal piece: 1 and 2 held
    assert [values(pieces[2]), values(pieces[1]), values(pieces[4])] == ["v2", "v1", "v4"]
    with pytest.raises(StopIteration):  # asked twice: it was given once
        values(pieces[1])


@pytest.mark.parametrize("seed", range(12))
def test_a_tiled_piece_holds_no_copies_and_reads_as_the_tuple_of_them(seed):
    """A row-tiled piece holds one mark, no object of its own for its copies (they are worked
    out from its rows when read: a many-rank plan holds one piece per tensor and output rank);
    read by ``copies_of``, and handed to a worker process, they are the general plan's tuple."""
    import io
    import pickle

    from ckpt_tools.core.plan import TILED, Copy, copies_of
    from ckpt_tools.runtime import private

    rng = random.Random(seed)
    rows = rng.randrange(2, 40)
    boxes = _split(rows, rng.randrange(2, 20), rng)
    rng.shuffle(boxes)
    t = _tensor(rows, boxes)
    target = Target(t, "model", "w", t.dtype)
    for world_size in (1, 3, rows + 2):
        for r in range(world_size):
            got, want = rows_of(target, world_size, r), _general(target, world_size, r).copies
            assert got.copies is TILED
            assert not any(isinstance(v, Copy) for v in (got.target, got.offsets, got.sizes))
            assert copies_of(got) == want
            back = private.load(io.BytesIO(pickle.dumps(got)))
            assert back == got and back.copies is TILED and copies_of(back) == want


def test_a_chunk_keeps_its_location_s_fields_and_is_the_value_it_was():
    """A chunk holds its location's fields (no Location of its own); made either way, it is
    equal, hashes alike, gives back the same Location, and crosses to a worker by value."""
    import io
    import pickle

    from ckpt_tools.runtime import private

    loc = Location("__3_0.distcp", "torch_item", 1 << 40, 96, ("k", 1))
    a = Chunk((4, 0), (2, 6), loc, 3)
    b = Chunk.at((4, 0), (2, 6), "__3_0.distcp", "torch_item", 1 << 40, 96, ("k", 1), 3)
    assert a == b and hash(a) == hash(b) and a.location == loc
    assert (a.file, a.kind, a.byte_offset, a.length, a.key) == ("__3_0.distcp", "torch_item", 1 << 40, 96, ("k", 1))
    assert not hasattr(a, "__dict__")
    for other in (a.replaced(rank=2), a.replaced(offsets=(0, 0)), a.replaced(location=Location("x", "raw"))):
        assert other != a
    assert a.replaced(location=Location("x", "raw", 5, 6)).location == Location("x", "raw", 5, 6)
    back = private.load(io.BytesIO(pickle.dumps(a)))
    assert back == a and back.location == loc and back.rank == 3
    assert repr(a) == f"Chunk(offsets=(4, 0), sizes=(2, 6), location={loc!r}, rank=3)"


@pytest.mark.parametrize("seed", range(10))
def test_rank_pieces_are_rows_of_made_when_asked_for(seed):
    """A rank's pieces made on demand (:class:`RankPieces`, as a many-rank plan holds them) are
    ``rows_of``'s for each target (tiled, one whole chunk, a 0-dim, a general one, one whole on
    every rank), in order; their bytes are worked out without making them; they are made once
    and kept, the same objects, until let go, then made again, equal."""
    import pickle

    from ckpt_tools.core.plan import FileJob, RankPieces, RankRows

    rng = random.Random(seed)
    targets = []
    for i in range(6):
        rows = rng.randrange(1, 30)
        boxes = _split(rows, rng.randrange(1, 9), rng)
        rng.shuffle(boxes)
        targets.append(Target(_tensor(rows, boxes), "model", f"t{i}", DType("float32")))
    one = _tensor(7, [((0, 0), (7, 6))])  # (a safetensors tensor)
    gaps = _tensor(8, [((0, 0), (8, 3)), ((0, 3), (8, 3))])  # (its chunks split columns: no tiling)
    scalar = TensorInfo("model", "s", (), DType("int64"), (Chunk((), (), Location("f", "raw", 0, 8), 0),))
    targets += [Target(one, "model", "one", one.dtype), Target(gaps, "model", "gaps", gaps.dtype),
                Target(scalar, "model", "step", scalar.dtype), Target(one, "model", "kept", DType("float32"))]
    wholes = {id(targets[-1]): whole(targets[-1])}
    for world_size in (1, 3, 8, 40):
        rows = RankRows(targets, wholes, world_size)
        for r in range(world_size):
            lazy = RankPieces(rows, r)
            eager = tuple(wholes[id(t)] if id(t) in wholes else rows_of(t, world_size, r) for t in targets)
            assert lazy.nbytes == sum(p.nbytes for p in eager)  # (nothing made)
            assert lazy._made is None
            assert len(lazy) == len(targets) and lazy == eager and tuple(lazy) == eager
            first = lazy[0]
            assert lazy[0] is first and next(iter(lazy)) is first  # (made once, kept)
            assert lazy[-1] is wholes[id(targets[-1])]
            job = FileJob("f", lazy, rank=r)
            assert job.nbytes == sum(p.nbytes for p in eager) and job.tensors() == len(targets)
            assert lazy.targets() == list(targets) == job.targets()
            job.unload()
            assert lazy[0] is not first and lazy[0] == first  # (let go, made again)
            sent = pickle.loads(pickle.dumps(lazy))  # (to a worker process: what it makes them from)
            assert sent == eager and sent._made is None or sent._made == eager


@pytest.mark.parametrize("seed", range(10))
def test_a_dcp_file_s_pieces_made_when_asked_for_are_its_plan_s(seed, monkeypatch):
    """A DCP file's pieces made on demand (``RankRows(..., empty=False, first=scalars)``, as
    ``layout_dcp`` holds them) are the eager plan's: the rows of each tensor the rank holds
    any of (none of one it holds no rows of), then, on rank 0 alone, each scalar whole; how
    many, their names and bytes worked out without making them. Ranks asked in any order, and
    again, get the same; only the pieces a rank holds are made (a file of many small tensors
    holds few of them: its pieces cost what it holds, not what the job holds)."""
    from ckpt_tools.core import plan
    from ckpt_tools.core.plan import FileJob, RankPieces, RankRows

    rng = random.Random(seed)
    targets = []
    for i in range(6):
        rows = rng.randrange(1, 12)
        boxes = _split(rows, rng.randrange(1, 6), rng)
        targets.append(Target(_tensor(rows, boxes), "model", f"t{i}", DType("float32")))
    flat = TensorInfo("model", "flat", (5, 0), DType("float32"), (Chunk((0, 0), (5, 0), Location("f", "raw", 0, 0), 0),))
    targets.append(Target(flat, "model", "flat", flat.dtype))  # (rows of no elements: held by no file)
    scalars = [Target(TensorInfo("optimizer", f"step{i}", (), DType("int64"),
                                 (Chunk((), (), Location("f", "raw", 8 * i, 8), 0),)), "optimizer", f"step{i}",
                      DType("int64")) for i in range(2)]
    made = []
    for name in ("rows_of", "_tiled_rows"):
        monkeypatch.setattr(plan, name, lambda *a, _f=getattr(plan, name), **k: made.append(1) or _f(*a, **k))
    for world_size in (1, 4, 9, 16):
        rows = RankRows(targets, {}, world_size, empty=False, first=scalars)
        order = [*range(world_size)] * 2
        rng.shuffle(order)
        for r in order:
            eager = tuple(p for t in targets for p in [rows_of(t, world_size, r)] if p.numel)
            if r == 0:
                eager += tuple(whole(t) for t in scalars)
            lazy = RankPieces(rows, r)
            assert len(lazy) == len(eager) and lazy.nbytes == sum(p.nbytes for p in eager)
            assert lazy.targets() == [p.target for p in eager]
            assert lazy._made is None  # (none of that made them)
            made.clear()
            assert lazy == eager and FileJob("f", lazy, rank=r).tensors() == len({p.target.name for p in eager})
            assert len(made) == len(eager) - (len(scalars) if r == 0 else 0)  # (no piece made to be dropped)


def test_a_tensors_row_caches_keep_its_dict_small():
    """rows_index and row_tiles cache their answers in the tensor's dict, whose slots are there
    from the start: a dict that CPython shares the keys of stays so (a key added later made
    each 25k-tensor job's tensor's dict its own, ~300 bytes more), and the answers stay exact
    and out of the hand-over to --workers."""
    import pickle
    import tracemalloc

    many = [_tensor(8, [((0, 0), (4, 6)), ((4, 0), (4, 6))]) for _ in range(500)]
    tracemalloc.start()
    try:
        assert all(t.row_tiles() for t in many)
        grown = tracemalloc.get_traced_memory()[0] / len(many)
    finally:
        tracemalloc.stop()
    assert grown < 450, grown  # (the answers, ~270 bytes; ~670 with each dict made its own)
    t = many[0]
    starts, order, most = t.rows_index()
    assert (list(starts), list(order), most) == ([0, 4], [0, 1], 4)
    back = pickle.loads(pickle.dumps(t))
    assert back == t and back.__dict__.get("_rows_index") is None  # (arrays made again there)
    assert back.row_tiles() is True and list(back.rows_index()[0]) == [0, 4]
    gap = _tensor(8, [((0, 0), (4, 6)), ((5, 0), (3, 6))])
    assert gap.row_tiles() is False
