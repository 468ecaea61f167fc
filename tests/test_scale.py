"""Many-rank checkpoints (256 and 1,024 ranks) made by torch's own writers in one process
(verl rank files under torch's fake process group, DCPs by ``dcp.save``'s own steps rank by
rank): ckpt's outputs are read back by torch and compared with the saved values and with a
small-rank path. Speed and memory live in bench/scale.py."""

from __future__ import annotations

import json
import math
import os
from array import array
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner

from ckpt_tools.cli.main import main as cli
from fw_scale import make_dcp, make_verl

# small tensors, some with fewer rows than ranks (trailing ranks hold none)
SHAPES = {"embed.weight": (300, 4), "layers.0.w": (257, 3), "layers.0.norm": (8,), "layers.1.w": (1030, 2),
          "head.weight": (5, 4)}


def _run(*args: str) -> str:
    r = CliRunner().invoke(cli, [*args], catch_exceptions=False)
    assert r.exit_code == 0, r.output
    return r.output


def _rank_files_state(d: Path, ws: int, kind: str = "model") -> dict[str, torch.Tensor]:
    """The full tensors of verl rank files at ``ws``, as torch loads them, rows concatenated."""
    parts: dict[str, list] = {}
    for r in range(ws):
        sd = torch.load(d / f"{kind}_world_size_{ws}_rank_{r}.pt", weights_only=False)
        if kind == "optim":
            sd = {f"{i}.{k}": v for i, s in sd["state"].items() for k, v in s.items() if k != "step"}
        for k, v in sd.items():
            parts.setdefault(k, []).append(v.to_local() if hasattr(v, "to_local") else v)
    return {k: torch.cat(v) for k, v in parts.items()}


@pytest.mark.parametrize("src_ws,dst_ws", [(256, 192)])
def test_reshard_rank_files_many_ranks(tmp_path, src_ws, dst_ws):
    state = make_verl(tmp_path / "src", src_ws, optim=src_ws <= 256, shapes=SHAPES)
    _run("reshard", str(tmp_path / "src"), str(tmp_path / "out"), "--to", str(dst_ws), "--quiet")
    got = _rank_files_state(tmp_path / "out", dst_ws)
    assert set(got) == set(state)
    for k, v in state.items():
        assert torch.equal(got[k], v), k
    if src_ws <= 256:
        moments = _rank_files_state(tmp_path / "out", dst_ws, "optim")
        for i, (k, v) in enumerate(state.items()):
            assert torch.equal(moments[f"{i}.exp_avg"], v * 0.1), k
            assert torch.equal(moments[f"{i}.exp_avg_sq"], v.abs() * 0.01), k


def test_reshard_many_ranks_equals_small_rank_path(tmp_path):
    """256 -> 4 ranks gives, as torch loads them, the files 8 -> 4 gives from an 8-rank save of
    the same values (bytes differ only where records keep their source's page phase)."""
    make_verl(tmp_path / "big", 256, shapes=SHAPES)
    make_verl(tmp_path / "small", 8, shapes=SHAPES)
    _run("reshard", str(tmp_path / "big"), str(tmp_path / "a"), "--to", "4", "--quiet")
    _run("reshard", str(tmp_path / "small"), str(tmp_path / "b"), "--to", "4", "--quiet")
    for r in range(4):
        name = f"model_world_size_4_rank_{r}.pt"
        a = torch.load(tmp_path / "a" / name, weights_only=False)
        b = torch.load(tmp_path / "b" / name, weights_only=False)
        assert list(a) == list(b)
        for k in a:
            assert a[k].placements == b[k].placements and a[k].shape == b[k].shape, (name, k)
            assert torch.equal(a[k].to_local(), b[k].to_local()), (name, k)


def test_dcp_many_ranks_to_torch_matches_torch(tmp_path):
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    state = make_dcp(tmp_path / "dcp", 256, shapes=SHAPES)
    _run("convert", str(tmp_path / "dcp"), str(tmp_path / "ours.pt"), "--to", "torch", "--quiet")
    dcp_to_torch_save(str(tmp_path / "dcp"), str(tmp_path / "theirs.pt"))
    ours = torch.load(tmp_path / "ours.pt", weights_only=True)
    theirs = torch.load(tmp_path / "theirs.pt", weights_only=True)
    flat_ours = ours["model"] if "model" in ours else ours
    assert set(flat_ours) == set(theirs["model"]) == set(state)
    for k, v in state.items():
        assert torch.equal(flat_ours[k], v) and torch.equal(theirs["model"][k], v), k


def test_reshard_dcp_many_ranks_reads_back(tmp_path):
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    state = make_dcp(tmp_path / "dcp", 256, shapes=SHAPES)
    _run("reshard", str(tmp_path / "dcp"), str(tmp_path / "out"), "--to", "192", "--quiet")
    names = {n for n in os.listdir(tmp_path / "out") if n.endswith(".distcp")}
    # the ranks with rows, from 0 (trailing ranks that hold nothing get no empty file)
    assert names == {f"__{r}_0.distcp" for r in range(len(names))} and 100 < len(names) <= 192
    dcp_to_torch_save(str(tmp_path / "out"), str(tmp_path / "back.pt"))
    back = torch.load(tmp_path / "back.pt", weights_only=True)["model"]
    for k, v in state.items():
        assert torch.equal(back[k], v), k


def test_inspect_1024_ranks(tmp_path):
    make_verl(tmp_path / "src", 1024, shapes=SHAPES)
    out = json.loads(_run("inspect", str(tmp_path / "src"), "--json"))
    assert out["world_size"] == 1024 and out["num_tensors"] == len(SHAPES)
    assert out["total_bytes"] == 4 * sum(math.prod(s) for s in SHAPES.values())


@pytest.mark.parametrize("dst_ws", [192, 64])
def test_reshard_dcp_writes_only_files_its_metadata_names(tmp_path, dst_ws):
    """A source whose trailing ranks hold no rows (dcp.save wrote them empty ``__r_0.distcp``
    files, which its .metadata names none of): the resharded DCP has no such file, neither the
    source's carried over nor empty ones of its own, and torch's dcp.load fills a state dict
    from it."""
    import pickle

    import torch.distributed.checkpoint as dcp

    state = make_dcp(tmp_path / "dcp", 256, optim=True, shapes=SHAPES)
    assert [p for p in (tmp_path / "dcp").glob("*.distcp") if p.stat().st_size == 0]  # the case
    _run("reshard", str(tmp_path / "dcp"), str(tmp_path / "out"), "--to", str(dst_ws), "--quiet")
    out = tmp_path / "out"
    with open(out / ".metadata", "rb") as f:
        meta = pickle.load(f)  # noqa: S301 - written by this test's own run
    named = {info.relative_path for info in meta.storage_data.values()}
    on_disk = {p.name for p in out.glob("*.distcp")}
    assert on_disk == named
    assert all((out / n).stat().st_size > 0 for n in on_disk)
    assert not [p.name for p in out.iterdir() if p.is_file() and p.name not in named | {".metadata", ".ckpt-manifest.json"}]
    sd = {"model": {k: torch.zeros(v.shape) for k, v in state.items()}}
    dcp.load(sd, checkpoint_id=str(out), no_dist=True)
    for k, v in state.items():
        assert torch.equal(sd["model"][k], v), k
    side = json.loads(_run("inspect", str(tmp_path / "dcp"), "--json"))["side_files"]
    assert not [f for f in side if f.endswith(".distcp")]


def test_rank_file_pickles_patched_equal_pickles_written_whole(tmp_path, monkeypatch):
    """A destination rank file's pickle is the previous one's with its slot values (rank, local
    sizes, from the first file's recipe, no tree) replaced: every file equals, byte for byte, the
    one written from its whole tree, records included. The
    shapes make local sizes cross BININT1 -> BININT2 -> BININT between ranks, and trailing ranks
    hold no rows: every file after the first of its kind is patched, some with ints of another
    width spliced in."""
    from ckpt_tools.codecs import torchpickler
    from ckpt_tools.formats import shardrebuild

    # big.w: 70,000 rows a rank (BININT); cross.w: 4 rows of 64 (numel 256, BININT2) on ranks
    # 0-3, 2 rows (128, BININT1) on rank 4
    shapes = {**SHAPES, "big.w": (70_000 * 5, 1), "cross.w": (18, 64)}
    make_verl(tmp_path / "src", 16, optim=True, shapes=shapes)
    patched = []  # (bytes patched, bytes patched from) of each call

    def spy(data, places, values):
        patched.append((torchpickler.patch(data, places, values), data))
        return patched[-1][0]

    monkeypatch.setattr(shardrebuild, "patch", spy)
    _run("reshard", str(tmp_path / "src"), str(tmp_path / "fast"), "--to", "5", "--quiet")
    assert len(patched) >= 8 and all(out is not None for out, _ in patched)
    assert any(len(out) != len(base) for out, base in patched)  # widths changed: spliced
    monkeypatch.setattr(shardrebuild, "patch", lambda *a: None)
    _run("reshard", str(tmp_path / "src"), str(tmp_path / "whole"), "--to", "5", "--quiet")
    files = sorted(p.name for p in (tmp_path / "whole").glob("*.pt"))
    assert len(files) == 15  # model, optim and extra state
    for name in files:
        assert (tmp_path / "fast" / name).read_bytes() == (tmp_path / "whole" / name).read_bytes(), name
    got = _rank_files_state(tmp_path / "fast", 5)
    want = make_verl.__globals__["full_state"](shapes)
    assert all(torch.equal(got[k], want[k]) for k in ("big.w", "cross.w"))


def test_rank_files_after_the_first_of_their_kind_are_checked_by_their_targets(tmp_path, monkeypatch):
    """A reshard's dry run checks each destination rank file against its kind's recipe: where a
    file's targets are, in order, those of the last file checked by its pieces' keys (every
    rank's), it is checked by comparing them, its pieces never made. Written, each file takes
    the pieces the keys give: byte for byte the files written with every file found by keys."""
    from ckpt_tools.core import plan
    from ckpt_tools.formats import shardrebuild

    make_verl(tmp_path / "src", 8, optim=True, shapes=SHAPES)
    made = []
    pieces = plan.RankRows.pieces
    monkeypatch.setattr(plan.RankRows, "pieces", lambda self, rank: made.append(rank) or pieces(self, rank))
    _run("reshard", str(tmp_path / "src"), str(tmp_path / "dry"), "--to", "5", "--quiet", "--dry-run")
    assert sorted(made) == [0, 0, 1, 1]  # model and optim: rank 0 built whole, rank 1 by keys, 2-4 neither
    made.clear()
    _run("reshard", str(tmp_path / "src"), str(tmp_path / "fast"), "--to", "5", "--quiet")
    assert sorted(made) == [0, 0, 0, 0, 1, 1, 1, 1, 2, 2, 3, 3, 4, 4]  # checked as above, then written
    order = shardrebuild.Rebuilt._order

    def by_keys(self, job, recipe):
        self._order_of = None
        return order(self, job, recipe)

    monkeypatch.setattr(shardrebuild.Rebuilt, "_order", by_keys)
    _run("reshard", str(tmp_path / "src"), str(tmp_path / "keys"), "--to", "5", "--quiet")
    files = sorted(p.name for p in (tmp_path / "keys").glob("*.pt"))
    assert len(files) == 15  # model, optim and extra state
    for name in files:
        assert (tmp_path / "fast" / name).read_bytes() == (tmp_path / "keys" / name).read_bytes(), name


def test_rank_files_from_a_dcp_patched_equal_files_written_whole(tmp_path, monkeypatch):
    """Rank files built from a DCP (no source rank file to rebuild: each tree built from the
    plan, :class:`~ckpt_tools.formats.shardsynth.Synthesized`) after the first of their kind
    are the previous pickle with the rank and local sizes replaced: every file equals, byte for
    byte, the one written from its whole tree, records included, and torch loads the values
    saved. Local sizes cross opcode widths between ranks and trailing ranks hold no rows."""
    from ckpt_tools.codecs import torchpickler
    from ckpt_tools.formats import shardrebuild

    shapes = {**SHAPES, "big.w": (70_000 * 5, 1), "cross.w": (18, 64)}
    state = make_dcp(tmp_path / "src", 4, optim=True, shapes=shapes)
    patched = []

    def spy(data, places, values):
        patched.append((torchpickler.patch(data, places, values), data))
        return patched[-1][0]

    monkeypatch.setattr(shardrebuild, "patch", spy)
    _run("convert", str(tmp_path / "src"), str(tmp_path / "fast"), "--to", "sharded", "--world-size", "5", "--quiet")
    assert len(patched) == 8 and all(out is not None for out, _ in patched)  # model and optim, ranks 1-4
    assert any(len(out) != len(base) for out, base in patched)  # widths changed: spliced
    monkeypatch.setattr(shardrebuild, "patch", lambda *a: None)
    _run("convert", str(tmp_path / "src"), str(tmp_path / "whole"), "--to", "sharded", "--world-size", "5", "--quiet")
    files = sorted(p.name for p in (tmp_path / "whole").glob("*.pt"))
    assert len(files) == 10  # model and optim
    for name in files:
        assert (tmp_path / "fast" / name).read_bytes() == (tmp_path / "whole" / name).read_bytes(), name
    got = _rank_files_state(tmp_path / "fast", 5)
    assert set(got) == set(state) and all(torch.equal(got[k], v) for k, v in state.items())
    moments = _rank_files_state(tmp_path / "fast", 5, "optim")
    for i, (k, v) in enumerate(state.items()):
        assert torch.equal(moments[f"{i}.exp_avg_sq"], v.abs() * 0.01), k


def test_inspect_says_the_bytes_each_rank_holds(tmp_path):
    """``inspect``'s bytes per rank of rank files are the bytes of the tensors each rank's files
    hold as torch loads them: trailing ranks' fewer rows, replicated tensors and each rank's
    ``step`` included. (The tensors of one chunk layout are counted with one walk of its chunks.)"""
    make_verl(tmp_path / "src", 16, optim=True, shapes=SHAPES)
    got = json.loads(_run("inspect", str(tmp_path / "src"), "--json"))["bytes_per_rank"]

    def held(x) -> int:
        if isinstance(x, torch.Tensor):
            local = getattr(x, "_local_tensor", x)
            return local.numel() * local.element_size()
        if isinstance(x, dict):
            return sum(held(v) for v in x.values())
        return sum(held(v) for v in x) if isinstance(x, (list, tuple)) else 0

    want = [sum(held(torch.load(tmp_path / "src" / f"{kind}_world_size_16_rank_{r}.pt", weights_only=False))
                for kind in ("model", "optim")) for r in range(16)]
    assert got == want and len(set(want)) > 1


def test_reshard_refuses_ranks_whose_step_differs(tmp_path, monkeypatch):
    """Every rank's copy of the optimizer's ``step`` is read (from the files, never mapped) and
    compared: one rank's differing step means files of two saves, refused; the bytes read are
    the bytes a mapping of the file shows, however the ranges are read together."""
    from ckpt_tools.engine import reader
    from ckpt_tools.engine.reader import Reader
    from ckpt_tools.formats import describe

    make_verl(tmp_path / "src", 16, optim=True, shapes=SHAPES)
    ckpt = describe(tmp_path / "src")
    steps = [c.location for t in ckpt.tensors if t.state == "step" for c in t.chunks]
    assert len(steps) == 16 * len(SHAPES)
    ranges = [(loc.file, loc.offset, loc.length) for loc in steps]
    with Reader(ckpt) as r:
        mapped = [bytes(r.raw(loc)) for loc in steps]
    assert len(set(mapped)) == 1 and len(mapped[0]) in (4, 8)  # (one step, as torch stores it)
    # ranges out of order, overlapping and repeated, and reads split where a run grows too long
    # (a rank file's steps lie between its moments: those near each other are read together)
    odd = [ranges[5], ranges[0], (ranges[0][0], ranges[0][1] + 1, 2), ranges[0], ranges[17]]
    for run in (1 << 20, 1):
        monkeypatch.setattr(reader, "_SMALL_RUN", run)
        with Reader(ckpt) as r:
            assert r.raw_small(ranges) == mapped
            got = r.raw_small(odd)
        with Reader(ckpt) as r:
            assert got == [bytes(r.raw(loc)) for loc in (steps[5], steps[0])] + [mapped[0][1:3]] + \
                [bytes(r.raw(loc)) for loc in (steps[0], steps[17])]
    odd = tmp_path / "src" / "optim_world_size_16_rank_9.pt"
    sd = torch.load(odd, weights_only=False)
    sd["state"][2]["step"] = sd["state"][2]["step"] + 1
    torch.save(sd, odd)
    r = CliRunner().invoke(cli, ["reshard", str(tmp_path / "src"), str(tmp_path / "out"), "--to", "8", "--quiet"])
    assert r.exit_code != 0 and "differs between ranks" in r.output, r.output
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("mapped", [False, True])
def test_dcp_item_spans_are_the_saved_bytes_read_or_mapped(tmp_path, monkeypatch, mapped):
    """A DCP's items (torch.save blobs) give their tensor's byte range whether the item is read
    to be parsed (up to 256 KiB: its pages then never count in the process's memory) or mapped
    (larger ones; all of them here with ``mapped``): the range holds the saved rows."""
    from ckpt_tools.engine import reader as reader_mod
    from ckpt_tools.formats import describe

    if mapped:
        monkeypatch.setattr(reader_mod, "_READ_ITEMS", 0)
    shapes = {"big.weight": (600, 300), "small.weight": (10, 3), "norm": (7,)}  # big: 360 KB a rank
    state = make_dcp(tmp_path / "dcp", 2, shapes=shapes)
    ckpt = describe(tmp_path / "dcp")
    seen = 0
    with reader_mod.Reader(ckpt) as r:
        for t in ckpt.tensors:
            (name,) = [k for k in state if t.name.endswith(k)]
            for c in t.chunks:
                path, offset, n = r.span(t, c)
                with open(path, "rb") as f:
                    f.seek(offset)
                    got = f.read(n)
                rows = state[name][c.offsets[0]:c.offsets[0] + c.sizes[0]]
                assert got == rows.contiguous().numpy().tobytes(), (t.name, c.offsets)
                seen += 1
    assert seen == 2 * len(shapes)


def test_reader_windows_of_many_files_hold_a_bounded_total(tmp_path, monkeypatch):
    """A reader of many files reads small ranges by windows that shrink with the files, so the
    windows left behind by a walk over every file (a many-rank job's) stay within their budget;
    every range still reads as a plain read of it does."""
    from ckpt_tools.engine import reader as reader_mod
    from ckpt_tools.formats import describe

    make_dcp(tmp_path / "dcp", 8, shapes={"w": (64, 64)})
    monkeypatch.setattr(reader_mod, "_WINDOWS_BYTES", 4096)
    monkeypatch.setattr(reader_mod, "_MIN_WINDOW", 128)
    files = sorted(p.name for p in (tmp_path / "dcp").iterdir() if p.suffix == ".distcp")
    data = {f: (tmp_path / "dcp" / f).read_bytes() for f in files}
    ckpt = describe(tmp_path / "dcp")
    with reader_mod.Reader(ckpt) as r:
        assert r._window == 4096 // len(ckpt.files) < 2048 < min(len(d) for d in data.values())
        for f in files:
            for at in range(0, len(data[f]), 50):
                assert r._pread(f, at, 50) == data[f][at:at + 50]
        assert len(r._windows) == len(files)
        assert sum(len(w) for _, w in r._windows.values()) <= 4096
    monkeypatch.undo()  # as shipped: 64 KiB at 16 ranks, 8 KiB at 256, never under 4 KiB
    assert [reader_mod._window_for(n) for n in (1, 17, 256, 10**6)] == [64 << 10, 64 << 10, 8 << 10, 4 << 10]


def test_reader_reads_a_file_read_item_after_item_in_bigger_windows(tmp_path, monkeypatch):
    """A file whose windows follow each other within a few of other files' (a reshard reads a
    few source files at a time) is read in bigger windows, the last few such kept; files read
    in turn (an export reads an item of every file) keep the small ones. Every range reads as
    a plain read of it does, and the windows kept stay within the budget and the hot ones."""
    from types import SimpleNamespace

    from ckpt_tools.engine import reader as reader_mod
    from ckpt_tools.formats import describe

    make_dcp(tmp_path / "dcp", 4, shapes={"w": (256, 64)})
    for name, value in (("_WINDOWS_BYTES", 2048), ("_MIN_WINDOW", 128), ("_HOT_WINDOW", 4096),
                        ("_HOT_GAP", 3), ("_HOT_KEPT", 2)):
        monkeypatch.setattr(reader_mod, name, value)
    sizes: list[int] = []
    monkeypatch.setattr(reader_mod, "os", SimpleNamespace(**{
        **{k: getattr(os, k) for k in dir(os) if not k.startswith("__")},
        "pread": lambda fd, n, at: sizes.append(n) or os.pread(fd, n, at)}))
    files = sorted(p.name for p in (tmp_path / "dcp").iterdir() if p.suffix == ".distcp")
    data = {f: (tmp_path / "dcp" / f).read_bytes() for f in files}
    assert min(len(d) for d in data.values()) > 3 * 4096
    ckpt = describe(tmp_path / "dcp")
    with reader_mod.Reader(ckpt) as r:  # in turn: small windows only
        small = r._window
        assert small == 2048 // len(ckpt.files) < 4096
        for at in range(0, 3 * 4096, 40):
            for f in files:
                assert r._pread(f, at, 40) == data[f][at:at + 40]
        assert sizes and set(sizes) == {small}
    sizes.clear()
    with reader_mod.Reader(ckpt) as r:  # two files at a time, item after item: big windows
        for a, b in zip(files, files[1:]):
            for at in range(0, len(data[a]) - 40, 40):
                assert r._pread(a, at, 40) == data[a][at:at + 40]
                assert r._pread(b, at + 7, 33) == data[b][at + 7:at + 40]
        assert sizes.count(4096) > 2 * sizes.count(small) > 0 and set(sizes) == {small, 4096}
        kept = [len(w) for _, w in r._windows.values()]
        assert sum(n > small for n in kept) <= 2 and sum(kept) <= 2048 + 2 * 4096


def test_reader_reads_small_ranges_through_windows_as_pread_does(tmp_path, monkeypatch):
    """Small ranges of source files read through the reader's windows (forward, backward, past
    a window, at a file's end, over more files than windows and open files kept) are each the
    bytes a plain read of that range gives."""
    import random

    from ckpt_tools.engine import reader as reader_mod
    from ckpt_tools.formats import describe

    make_dcp(tmp_path / "dcp", 4, shapes={"w": (64, 8)})
    monkeypatch.setattr(reader_mod, "_WINDOW", 256)
    monkeypatch.setattr(reader_mod, "_WINDOWS_KEPT", 2)
    monkeypatch.setattr(reader_mod, "_OPEN_FILES", 2)
    files = sorted(p.name for p in (tmp_path / "dcp").iterdir() if p.suffix == ".distcp")
    data = {f: (tmp_path / "dcp" / f).read_bytes() for f in files}
    rng = random.Random(5)
    with reader_mod.Reader(describe(tmp_path / "dcp")) as r:
        for _ in range(400):
            f = rng.choice(files)
            at, n = rng.randrange(len(data[f]) + 10), rng.choice([0, 1, 7, 100, 255, 256, 300])
            assert r._pread(f, at, n) == data[f][at:at + n], (f, at, n)
        for f in files:  # record after record
            for at in range(0, len(data[f]), 50):
                assert r._pread(f, at, 50) == data[f][at:at + 50]


@pytest.mark.parametrize("broken", [None, 0, 1, 5, 11])
def test_chunk_columns_hold_a_repeated_key_and_ranks_in_order_compactly_until_they_differ(broken):
    """A table's key column is one key while every chunk's is that object, its rank column a
    range while chunk i is rank i's; a chunk that breaks either (at any place) turns it into a
    list or array from there, and the table reads as the chunks added, every way."""
    from ckpt_tools.core import describe as core

    key, other = ("w",), ("v",)
    chunks = [core.Chunk.at((2 * i, 0), (2, 4), f"f{i % 3}", "raw", 64 * i, 32,
                            other if i == broken else key, 7 if i == broken else i) for i in range(12)]
    cols = core.ChunkColumns([], {})
    for c in chunks:
        cols.append(c)
    table = cols.chunks()
    assert type(table) is core.ChunkTable and tuple(table) == tuple(chunks)
    assert [table[i] for i in range(-12, 12)] == chunks + chunks and table[3:9] == tuple(chunks[3:9])
    assert list(core.holders(table)) == [(c.rank, c.sizes) for c in chunks]
    assert (type(table.keys), type(table.ranks)) == ((core.Repeated, range) if broken is None else (list, array))
    assert list(table.keys) == [c.key for c in chunks] and list(table.ranks) == [c.rank for c in chunks]
    # offsets, sizes and lengths: codes into the palette a description's tables share
    assert all(type(col) is core.Coded for col in (table.offsets, table.sizes, table.lengths))
    assert table.offsets == [c.offsets for c in chunks] and table.offsets[-1] == chunks[-1].offsets
    assert table.sizes[2:5] == [c.sizes for c in chunks[2:5]] and list(table.lengths) == [32] * 12
    again = core.ChunkColumns([], {}, cols.columns.palette)
    for c in reversed(chunks):
        again.append(c)
    assert tuple(again.chunks()) == tuple(reversed(chunks))
    assert len(cols.columns.palette.values) == 12 + 1 + 1  # (each distinct offsets, the one size and length)
    assert again.chunks()[0].offsets is table[-1].offsets  # (one object per value, every table)
    rep = core.Repeated(key, 3)
    assert list(rep) == [key] * 3 and rep[-3] is key and rep[1:] == [key, key] and rep == [key] * 3
    with pytest.raises(IndexError):
        rep[3]


def test_many_rank_files_are_described_as_columns_that_read_as_their_chunks(tmp_path, monkeypatch):
    """Rank files' tensors of many chunks (a chunk per rank, model and optimizer) are kept as
    ChunkTables with their keys and ranks: read in every way (index, slice, iteration, columns,
    extents, holders, handed to a worker) each is the tuple of Chunks the per-chunk description
    gives, and a reshard from either writes the same bytes."""
    import io
    import pickle

    from ckpt_tools.core import chunks, describe as core
    from ckpt_tools.formats import describe
    from ckpt_tools.runtime import private

    make_verl(tmp_path / "src", 16, optim=True, shapes=SHAPES)
    tables = describe(tmp_path / "src")
    with monkeypatch.context() as m:
        m.setattr(chunks, "TABLE_MIN", 1 << 30)
        chunked = describe(tmp_path / "src")
    many = [t for t in tables.tensors if len(t.chunks) >= 8]
    assert {t.group for t in many} == {"model", "optimizer"}
    assert all(type(t.chunks) is core.ChunkTable and list(t.chunks.ranks) == list(range(16)) for t in many)
    # (a tensor's one storage key and its ranks in order: held as one key and a range)
    assert all(type(t.chunks.keys) is core.Repeated and type(t.chunks.ranks) is range for t in many)
    assert all(type(t.chunks) is tuple for t in chunked.tensors) and tables.tensors == chunked.tensors
    for t, twin in zip(tables.tensors, chunked.tensors):
        got, want = t.chunks, twin.chunks
        assert tuple(got) == want and got[-1] == want[-1] and got[1::3] == want[1::3]
        assert [got[i] for i in range(len(want))] == list(want) and [c.key for c in got] == [c.key for c in want]
        assert list(core.holders(got)) == [(c.rank, c.sizes) for c in want]
        assert core.columns(got) == ([c.offsets for c in want], [c.sizes for c in want])
        assert list(core.extents(got)) == [(c.sizes, c.file, c.byte_offset, c.length) for c in want]
        assert t.rows_index() == twin.rows_index() and t.row_tiles() == twin.row_tiles()
    back = private.load(io.BytesIO(pickle.dumps(many[0])))
    assert back == many[0] and type(back.chunks) is tuple

    _run("reshard", str(tmp_path / "src"), str(tmp_path / "a"), "--to", "12")
    with monkeypatch.context() as m:
        m.setattr(chunks, "TABLE_MIN", 1 << 30)
        _run("reshard", str(tmp_path / "src"), str(tmp_path / "b"), "--to", "12")
    names = sorted(p.name for p in (tmp_path / "a").iterdir())
    assert names == sorted(p.name for p in (tmp_path / "b").iterdir()) and len(names) > 12
    assert all((tmp_path / "a" / n).read_bytes() == (tmp_path / "b" / n).read_bytes() for n in names)


def _planned(tmp_path: Path, plan) -> tuple[dict, list, list, int]:
    """A 64-rank save with moments, planned by ``plan(ckpt, targets, open_reader)`` (a writer
    and its jobs, at 48 ranks): its state, targets, jobs, and the ``Piece`` objects the
    planning left alive."""
    import gc

    from ckpt_tools.core.plan import Piece, targets_from
    from ckpt_tools.engine.reader import Reader
    from ckpt_tools.layouts import describe

    state = make_verl(tmp_path / "src", 64, optim=True, shapes=SHAPES)
    ckpt = describe(tmp_path / "src")
    targets = targets_from(ckpt.tensors)
    gc.collect()
    before = sum(type(o) is Piece for o in gc.get_objects())
    _, jobs = plan(ckpt, targets, lambda: Reader(ckpt))
    gc.collect()
    return state, targets, jobs, sum(type(o) is Piece for o in gc.get_objects()) - before


def test_a_many_rank_plan_holds_no_file_s_pieces_once_checked(tmp_path):
    """Rank files planned for many ranks hold each file's pieces only while it is checked or
    written (made from the targets when asked for, let go after): once the dry run has checked
    every file, the plan holds no rank's pieces but the few whole ones every rank shares, and
    each file's are made again, equal, as it is written."""
    from ckpt_tools.core.plan import RankPieces, rows_of, whole
    from ckpt_tools.formats import writers

    _, _, jobs, held = _planned(tmp_path, lambda ckpt, targets, reader: writers.rank_files(
        ckpt, targets, ckpt.objects, 48, rank_local="drop", open_reader=reader, keep=True))
    tensor_jobs = [j for j in jobs if j.kind in ("model", "optim")]
    assert len(tensor_jobs) == 96 and all(type(j.pieces) is RankPieces for j in tensor_jobs)
    # the first file of each kind's, kept by the dry run for its write, and the whole ones
    firsts = [next(j for j in tensor_jobs if j.kind == kind) for kind in ("model", "optim")]
    wholes = {(t.group, t.name) for j in firsts for t in j.pieces.rows.targets if (t.group, t.name) in j.meta["plain"]}
    assert held <= sum(len(j.pieces) for j in firsts) + len(wholes) < sum(len(j.pieces) for j in tensor_jobs) / 20, held
    for job in tensor_jobs:
        plain = job.meta["plain"]
        want = tuple(whole(t) if (t.group, t.name) in plain else rows_of(t, 48, job.rank)
                     for t in job.pieces.rows.targets)
        assert job.pieces == want and job.nbytes == sum(p.nbytes for p in want)
        job.unload()


def test_a_many_rank_dcp_plan_holds_no_file_s_pieces_once_checked(tmp_path):
    """The same of a DCP's files (``layout_dcp``): the writer checks their targets, no piece is
    made before a file is written, and then they are the eager plan's; written, the DCP loads
    as the source's tensors."""
    from ckpt_tools.core.plan import RankPieces, rows_of, whole
    from ckpt_tools.formats import writers

    state, targets, jobs, held = _planned(tmp_path, lambda ckpt, targets, reader: writers.dcp_dir(
        ckpt, targets, ckpt.objects, 48, rank_local="drop", open_reader=reader, keep_parts=False))
    assert held == 0
    assert all(type(j.pieces) is RankPieces for j in jobs)
    for job in jobs:
        want = tuple(p for t in targets if t.shape for p in [rows_of(t, 48, job.rank)] if p.numel)
        want += tuple(whole(t) for t in targets if not t.shape) if job.rank == 0 else ()
        assert job.pieces == want and job.nbytes == sum(p.nbytes for p in want)
        job.unload()
    _run("convert", str(tmp_path / "src"), str(tmp_path / "out"), "--to", "dcp", "--world-size", "48", "--quiet")
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    dcp_to_torch_save(str(tmp_path / "out"), str(tmp_path / "out.pt"))
    got = torch.load(tmp_path / "out.pt", weights_only=False)
    for k, v in state.items():
        assert torch.equal(got["model"][k], v), k
