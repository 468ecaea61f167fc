"""Casts streamed block by block (``castio``): the same bytes as torch's cast of the whole
tensor, for every pair of float dtypes, across source parts and block edges; and the writers
that take them (hf, native DCP, sharded) write what torch's casting path writes."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

import ckpt_tools
from ckpt_tools.storage import castio
from ckpt_tools.storage.castio import CastSpan, blocks
from ckpt_tools.core.dtypes import DType

FLOATS = ["float32", "bfloat16", "float16", "float64"]


def _bits(t: torch.Tensor) -> bytes:
    return t.view(torch.uint8).numpy().tobytes()


@pytest.mark.parametrize("block", [97, 1 << 20], ids=["blocks", "one-block"])
@pytest.mark.parametrize("use_numpy", [True, False], ids=["numpy", "torch"])
@pytest.mark.parametrize("src", FLOATS)
@pytest.mark.parametrize("dst", FLOATS)
def test_blocks_equal_a_whole_cast(tmp_path, src, dst, use_numpy, block):
    g = torch.Generator().manual_seed(1)
    a = (torch.randn(1001, generator=g) * 1e3).to(getattr(torch, src))
    b = torch.tensor([float("inf"), float("-inf"), float("nan"), 1e-40, -0.0, 65504.0, 7e4], dtype=getattr(torch, src))
    path = tmp_path / "raw"
    path.write_bytes(b"xyz" + a.view(torch.uint8).numpy().tobytes() + b.view(torch.uint8).numpy().tobytes())
    size = a.element_size()
    parts = ((path, 3, a.numel() * size), (path, 3 + a.numel() * size, b.numel() * size))
    got = b"".join(bytes(x) for x in blocks(CastSpan(parts, DType(src), DType(dst)), block=block, use_numpy=use_numpy))
    want = torch.cat([a, b]).to(getattr(torch, dst))
    got_t = torch.frombuffer(bytearray(got), dtype=want.dtype)
    nan = want.isnan()
    # bit for bit, except NaN: torch's vector and scalar conversion loops (which one runs depends
    # on where an element falls in a block) may give a NaN another sign or payload
    assert torch.equal(got_t.isnan(), nan)
    assert got_t[~nan].view(torch.uint8).numpy().tobytes() == want[~nan].view(torch.uint8).numpy().tobytes()


def _cast_file(tmp_path, values: torch.Tensor, dst: str, **kw) -> torch.Tensor:
    path = tmp_path / "raw"
    path.write_bytes(_bits(values))
    cast = CastSpan(((path, 0, path.stat().st_size),), DType.of(values.dtype), DType(dst))
    got = bytearray(b"".join(bytes(x) for x in blocks(cast, **kw)))
    return torch.frombuffer(got, dtype=getattr(torch, dst)) if got else torch.empty(0, dtype=getattr(torch, dst))


@pytest.mark.parametrize(("src", "dst"), [("bfloat16", "float16"), ("float16", "bfloat16"),
                                          ("bfloat16", "float32"), ("float16", "float32")])
def test_every_16_bit_value_casts_as_torch_casts_it(tmp_path, src, dst):
    """numpy's tables, shift and cast against torch, for all 65536 values of the source type."""
    every = torch.arange(1 << 16, dtype=torch.int32).to(torch.int16).view(getattr(torch, src))
    every = torch.cat([every, every.flip(0), every])  # blocks of 100000 span the kernels' chunks
    want = every.to(getattr(torch, dst))
    got = _cast_file(tmp_path, every, dst, block=100000)
    nan = want.isnan()
    assert int(nan.sum()) > 0 and torch.equal(got.isnan(), nan)
    assert _bits(got[~nan]) == _bits(want[~nan])


@pytest.mark.parametrize("dst", ["bfloat16", "float16"])
def test_float32_narrows_as_torch_narrows_it(tmp_path, dst):
    """Rounding to nearest even at every tie, subnormals, overflow to infinity, the largest
    finite values, signed zeros, and a million random bit patterns (NaNs among them)."""
    g = torch.Generator().manual_seed(3)
    finfo = torch.finfo(getattr(torch, dst))
    ties = torch.arange(1 << 16, dtype=torch.int64).mul(1 << 16).add(0x8000).to(torch.int32).view(torch.float32)
    edges = torch.tensor([0.0, -0.0, float("inf"), float("-inf"), float("nan"), -float("nan"), 1e-45, -1e-45,
                          1.17e-38, 5.96e-8, 2.98e-8, 6.1e-5, finfo.max, -finfo.max, finfo.max * 1.0009765625,
                          65504.0, 65519.99, 65520.0, 3.3895314e38, 3.4028235e38], dtype=torch.float32)
    bits = torch.randint(-(1 << 31), 1 << 31, (1 << 20,), generator=g, dtype=torch.int64).to(torch.int32)
    values = torch.cat([ties, ties + 1, ties - 1, edges, bits.view(torch.float32)])
    want = values.to(getattr(torch, dst))
    got = _cast_file(tmp_path, values, dst, block=1 << 18)
    nan = want.isnan()
    assert torch.equal(got.isnan(), nan)
    assert _bits(got[~nan]) == _bits(want[~nan])


def test_a_one_block_cast_is_converted_on_the_writers_thread(tmp_path, monkeypatch):
    """A piece of one block (every tensor of a model of many small ones) is converted where
    the writer asks for it: a pool and its thread per piece cost ~0.9 ms, 93% of casting a
    25k-tensor model. A piece of several blocks is still converted ahead, on the pool's."""
    converted_on = []
    convert = castio._Buffers.convert
    monkeypatch.setattr(castio._Buffers, "convert",
                        lambda self, *a: converted_on.append(threading.get_ident()) or convert(self, *a))
    a = torch.randn(1000, generator=torch.Generator().manual_seed(5)).to(torch.bfloat16)
    for block, writer_s in ((1 << 20, True), (1000, True), (999, False), (64, False)):
        converted_on.clear()
        assert _bits(_cast_file(tmp_path, a, "float32", block=block)) == _bits(a.float())
        assert converted_on and (set(converted_on) == {threading.get_ident()}) == writer_s, block


def test_buffers_are_reused_and_blocks_stay_valid_until_the_next(tmp_path):
    """The writer may hold a block until it asks for the next one: a slow writer still sees
    every block intact, across pieces that reuse the same buffers."""
    g = torch.Generator().manual_seed(4)
    for n in (5, 1000, 4096):
        a = torch.randn(n, generator=g).to(torch.bfloat16)
        path = tmp_path / f"raw{n}"
        path.write_bytes(_bits(a))
        out = b""
        for block in blocks(CastSpan(((path, 0, path.stat().st_size),), DType("bfloat16"), DType("float32")), block=64):
            import time

            time.sleep(0.0005)  # the pool converts ahead meanwhile, into the other buffers
            out += bytes(block)
        assert out == _bits(a.float())


def test_export_cast_is_torchs(tmp_path):
    src = tmp_path / "hf"
    src.mkdir()
    g = torch.Generator().manual_seed(0)
    state = {"model.w": torch.randn(37, 11, generator=g), "model.b": torch.randn(5, generator=g),
             "model.i": torch.arange(4)}
    save_file(state, src / "model.safetensors")
    ckpt_tools.convert(src, tmp_path / "dcp", to="dcp", world_size=3, progress=False)
    # no config.json to go with these made-up names: the weights-only path (export refuses it)
    ckpt_tools.convert(tmp_path / "dcp", tmp_path / "out", to="hf", dtype="fp16", progress=False)
    got = load_file(tmp_path / "out" / "model.safetensors")
    for k, v in state.items():
        want = v.half() if v.is_floating_point() else v
        assert got[k].dtype == want.dtype and torch.equal(got[k], want), k


def test_sharded_cast_from_dcp_is_torchs(tmp_path):
    from ckpt_tools.formats import shardsynth

    fix = Path(__file__).resolve().parents[1] / "fixtures" / "llama_dcp"
    ckpt_tools.convert(fix, tmp_path / "a", to="sharded", world_size=2, dtype="bf16", progress=False)
    real = shardsynth.available
    shardsynth.available = lambda: False
    try:
        ckpt_tools.convert(fix, tmp_path / "b", to="sharded", world_size=2, dtype="bf16", progress=False)
    finally:
        shardsynth.available = real
    for f in sorted((tmp_path / "b").glob("model_*.pt")):
        a = torch.load(tmp_path / "a" / f.name, weights_only=True)
        b = torch.load(f, weights_only=True)
        assert list(a) == list(b)
        for k in a:
            assert a[k].dtype == torch.bfloat16 and torch.equal(a[k]._local_tensor, b[k]._local_tensor), k


def test_a_cast_to_dcp_is_torchs_and_its_small_items_are_the_streamed_zips(tmp_path, monkeypatch):
    """Small cast items are converted in memory and rendered from the item template, as small
    copies are; larger ones are streamed into their zip. Either way torch reads back its own
    cast, and the small ones are the bytes the streamed zip would have been, of one byte range
    or of several (whose blocks come in buffers that are reused)."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    from ckpt_tools.formats import dcpnative

    src = tmp_path / "hf"
    src.mkdir()
    g = torch.Generator().manual_seed(6)
    state = {"model.w": torch.randn(400, 400, generator=g), "model.b": torch.randn(7, generator=g),
             "model.m": torch.randn(64, 64, generator=g),
             "model.s": torch.randn(3, 5, generator=g), "model.i": torch.arange(4)}
    save_file(state, src / "model.safetensors")
    # from 8 ranks to 2: a piece is rows of up to 4 source chunks, so as many byte ranges
    ckpt_tools.convert(src, tmp_path / "dcp8", to="dcp", world_size=8, progress=False)
    src = tmp_path / "dcp8"
    ckpt_tools.convert(src, tmp_path / "dcp", to="dcp", world_size=2, dtype="bf16", progress=False)
    dcp_to_torch_save(tmp_path / "dcp", tmp_path / "back.pt")
    got = torch.load(tmp_path / "back.pt", weights_only=True)["model"]
    assert sorted(got) == sorted(state)
    for k, v in state.items():
        want = v.bfloat16() if v.is_floating_point() else v
        assert got[k].dtype == want.dtype and torch.equal(got[k], want), k
    monkeypatch.setattr(dcpnative, "SMALL_RECORD", -1)  # every item streamed into its own zip
    ckpt_tools.convert(src, tmp_path / "streamed", to="dcp", world_size=2, dtype="bf16", progress=False)
    names = sorted(p.name for p in (tmp_path / "dcp").iterdir())
    assert names == sorted(p.name for p in (tmp_path / "streamed").iterdir()) and "__0_0.distcp" in names
    for name in names:
        assert (tmp_path / "dcp" / name).read_bytes() == (tmp_path / "streamed" / name).read_bytes(), name
