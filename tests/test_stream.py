"""The engine's stream of a file's pieces (engine/stream.py): pieces whose bytes lie whole in
the source are prepared in the writer's thread, batch by batch; once a piece needs more (a read,
a cast), the rest go to the reading thread. Either way every piece comes in plan order with
its own values."""

from __future__ import annotations

import concurrent.futures

import pytest
import torch
from safetensors.torch import save_file

from ckpt_tools.core.dtypes import DType
from ckpt_tools.core.plan import Span, rows_of, targets_from
from ckpt_tools.engine import stream as streams
from ckpt_tools.engine.reader import Reader
from ckpt_tools.layouts import describe


class _Counting(concurrent.futures.ThreadPoolExecutor):
    """A one-thread pool that counts what it was handed."""

    def __init__(self) -> None:
        super().__init__(1)
        self.handed = 0
        self.futures: list[concurrent.futures.Future] = []

    def submit(self, *args, **kwargs):
        self.handed += 1
        self.futures.append(super().submit(*args, **kwargs))
        return self.futures[-1]


@pytest.fixture
def ckpt(tmp_path):
    tensors = {f"w{i}": torch.arange(i * 1000, i * 1000 + 48, dtype=torch.float32).reshape(8, 6) for i in range(600)}
    save_file(tensors, tmp_path / "model.safetensors")
    return describe(tmp_path), tensors


def _values(v) -> torch.Tensor:
    if isinstance(v, Span):
        data = b"".join(open(path, "rb").read()[o:o + n] for path, o, n in v.parts)
        return torch.frombuffer(bytearray(data), dtype=torch.float32)
    return v.reshape(-1)


def test_spans_are_prepared_in_the_writers_thread(ckpt, monkeypatch):
    src, tensors = ckpt
    monkeypatch.setattr(streams, "BATCH_PIECES", 16)  # several batches
    pieces = [rows_of(t, 4, r) for r in range(4) for t in targets_from(src.tensors)]
    with Reader(src) as reader, _Counting() as pool:
        got = list(streams.stream(reader, pieces, spans=True, pool=pool))
    assert pool.handed == 0
    assert [p for p, _ in got] == pieces
    for p, v in got:
        assert isinstance(v, Span)
        start = p.offsets[0]
        want = tensors[p.target.name][start:start + p.sizes[0]].reshape(-1)
        assert torch.equal(_values(v), want)


def test_a_piece_that_needs_reading_hands_the_rest_to_the_thread(ckpt, monkeypatch):
    src, tensors = ckpt
    monkeypatch.setattr(streams, "BATCH_PIECES", 16)
    targets = targets_from(src.tensors)
    cast = targets_from(src.tensors, dtype=DType("bfloat16"))  # a cast the writer does not take: read here
    pieces = [rows_of(t, 2, 0) for t in targets[:40]] + [rows_of(cast[40], 2, 0)] \
        + [rows_of(t, 2, 1) for t in targets[41:200]]
    with Reader(src) as reader, _Counting() as pool:
        got = list(streams.stream(reader, pieces, spans=True, pool=pool))
    assert pool.handed >= 1  # the batches after the cast went to the thread
    assert [p for p, _ in got] == pieces
    for p, v in got:
        start = p.offsets[0]
        want = tensors[p.target.name][start:start + p.sizes[0]]
        if p.target.dtype == "bfloat16":
            assert not isinstance(v, Span) and v.dtype == torch.bfloat16
            assert torch.equal(v, want.to(torch.bfloat16))
        else:
            assert torch.equal(_values(v), want.reshape(-1))


def test_a_stream_ended_early_leaves_nothing_running(ckpt, monkeypatch):
    src, _ = ckpt
    monkeypatch.setattr(streams, "BATCH_PIECES", 4)
    targets = targets_from(src.tensors, dtype=DType("bfloat16"))
    pieces = [rows_of(t, 2, 0) for t in targets]
    with Reader(src) as reader, _Counting() as pool:
        it = streams.stream(reader, pieces, spans=True, pool=pool)
        next(it)
        it.close()
        assert pool.handed >= 2  # (one being waited on, more queued behind it)
        assert all(f.done() for f in pool.futures)


@pytest.mark.parametrize("to", ["dcp", "hf"])
def test_a_plan_handed_over_lets_each_files_pieces_go_once_written(ckpt, tmp_path_factory, to):
    """With the plan handed over (``consume``), the engine lets each job's pieces go once its
    file is written (a many-rank plan's pieces go file by file); a writer whose ``finish``
    reads them (HF's index) keeps them. The output is the same either way, and the report taken
    before still counts each file's tensors."""
    from ckpt_tools.commands.report import planned_files
    from ckpt_tools.core.plan import whole
    from ckpt_tools.engine.execute import execute
    from ckpt_tools.formats import hf, writers

    src, tensors = ckpt
    tmp_path = tmp_path_factory.mktemp("out")  # (outside the source's directory)
    targets = targets_from(src.tensors)
    out = {}
    for consume in (False, True):
        if to == "dcp":
            writer, jobs = writers.dcp_dir(src, targets, (), 4, rank_local="drop", open_reader=lambda: Reader(src),
                                           keep_parts=False)
        else:
            writer = hf.Writer(max_shard_size="40KB")
            jobs = writer.plan([whole(t) for t in targets])
        planned = planned_files(jobs)
        execute(src, writer, jobs, tmp_path / f"{to}{consume}", progress=False, consume=consume)
        kept = [len(j.pieces) for j in jobs]
        assert (kept == [0] * len(jobs)) == (consume and to == "dcp") and [j.nbytes for j in jobs] == [
            planned[j.path][1] for j in jobs]
        assert sum(n for n, _ in planned.values()) >= len(tensors) and len(jobs) > 1
        out[consume] = {p.name: p.read_bytes() for p in (tmp_path / f"{to}{consume}").iterdir()
                        if p.name != ".ckpt-manifest.json"}
    assert out[False] == out[True]
